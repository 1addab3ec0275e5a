//! `rloo sft`: supervised fine-tuning of a causal LM, in the idiom of
//! `rloo train` (TOML file, `--set`, flags; see `config_flags`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{ArgMatches, Command};

use rloo::train::config::load_toml;
use rloo::train::sft::{train_sft, SftConfig};

use super::config_flags::{self, config_file, Flag, Flags, Kind};
use super::dataset_flags::{self, HeldOut};

const FLAGS: &[Flag] = &[
    ("model", "model", Kind::Str, "Model directory or cached hub id to start from"),
    ("model_name_or_path", "model", Kind::Str, "TRL's name of --model"),
    ("all_tokens", "all_tokens", Kind::Bool, "Train on prompt tokens too, not only on completions"),
];

fn flags() -> Flags {
    Flags::new()
        .with("Model", "", FLAGS)
        .with("Model", "", config_flags::DEVICE)
        .with("Data", "", dataset_flags::TRAINING_DATA)
        .with("Training", "", config_flags::PRECISION)
        .with("Training", "", config_flags::BATCH)
        .with("Training", "", config_flags::OPTIMIZER)
        .with("Training", "", config_flags::RUN)
        .with("PEFT", "", config_flags::PEFT)
}

#[derive(Debug)]
pub struct SftArgs {
    config: Option<PathBuf>,
    overrides: Vec<(String, toml::Value)>,
    held_out: HeldOut,
    print_config: bool,
}

impl clap::Args for SftArgs {
    fn augment_args(cmd: Command) -> Command {
        flags().augment(cmd, &toml::Value::try_from(SftConfig::default()).expect("the default config serialises"))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for SftArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let (config, print_config) = config_file(m);
        let overrides = flags().overrides(m, |_, key| key.to_string())?;
        Ok(Self { config, overrides, held_out: HeldOut::from_matches(m), print_config })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

pub fn run(a: SftArgs) -> Result<()> {
    let mut cfg: SftConfig = load_toml(a.config.as_deref(), &a.overrides, |_, _| Ok(()))?;
    a.held_out.apply(&cfg.dataset, &mut cfg.eval_dataset);
    if a.print_config {
        cfg.validate()?;
        print!("{}", cfg.to_toml());
        return Ok(());
    }
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
