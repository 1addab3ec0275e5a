//! `rloo sft`: supervised fine-tuning of a causal LM.

use anyhow::{Context, Result};

use rloo::data::DatasetSpec;
use rloo::train::sft::{train_sft, SftConfig};

use super::config_flags::{Flag, Kind};
use super::supervised::{SupervisedArgs, Trainer};

#[derive(Debug)]
pub struct Sft;

impl Trainer for Sft {
    type Config = SftConfig;
    const FLAGS: &'static [Flag] = &[
        ("model", "model", Kind::Str, "Model directory or cached hub id to start from"),
        ("model_name_or_path", "model", Kind::Str, "TRL's name of --model"),
        ("all_tokens", "all_tokens", Kind::Bool, "Train on prompt tokens too, not only on completions"),
    ];
    fn datasets(cfg: &mut SftConfig) -> (&DatasetSpec, &mut Option<DatasetSpec>) {
        (&cfg.dataset, &mut cfg.eval_dataset)
    }
    fn validate(cfg: &SftConfig) -> rloo::Result<()> {
        cfg.validate()
    }
}

pub type SftArgs = SupervisedArgs<Sft>;

pub fn run(a: SftArgs) -> Result<()> {
    let Some(cfg) = a.config()? else { return Ok(()) };
    let s = train_sft(&cfg).context("fine-tuning failed")?;
    eprintln!(
        "fine-tuned {} steps, train loss {:.4}{} -> {}",
        s.steps,
        s.train_loss,
        s.eval_loss.map_or(String::new(), |l| format!(", eval loss {l:.4}")),
        s.output_dir.display()
    );
    Ok(())
}
