//! `rloo sft`: supervised fine-tuning of a causal LM.

use anyhow::{Context, Result};

use rloo::train::sft::{self, train_sft};

use super::config_flags::{Flag, Kind};
use super::supervised::{SupervisedArgs, Trainer};

#[derive(Debug)]
pub struct SftFlags;

impl Trainer for SftFlags {
    type Kind = sft::Sft;
    const FLAGS: &'static [Flag] = &[
        ("model", "model", Kind::Str, "Model directory or cached hub id to start from"),
        ("model_name_or_path", "model", Kind::Str, "TRL's name of --model"),
        ("all_tokens", "all_tokens", Kind::Bool, "Train on prompt tokens too, not only on completions"),
    ];
}

pub type SftArgs = SupervisedArgs<SftFlags>;

pub fn run(a: SftArgs) -> Result<()> {
    let Some(cfg) = a.config()? else { return Ok(()) };
    let s = train_sft(&cfg).context("fine-tuning failed")?;
    if !s.main {
        return Ok(());
    }
    if !s.finished {
        super::supervised::stopped_early(s.steps, &s.output_dir);
        return Ok(());
    }
    eprintln!(
        "fine-tuned {} steps, train loss {:.4}{} -> {}",
        s.steps,
        s.train_loss,
        s.eval_loss.map_or(String::new(), |l| format!(", eval loss {l:.4}")),
        s.output_dir.display()
    );
    Ok(())
}
