//! The options of the supervised trainers, `rloo sft` and `rloo reward
//! train`: their own flags, then the data, device, precision, batch,
//! optimizer, run and PEFT groups, read as `config_flags` reads them.

use std::marker::PhantomData;
use std::path::PathBuf;

use anyhow::Result;
use clap::{ArgMatches, Command};
use rloo::train::config::{load_toml, to_toml};
use rloo::train::supervised::SupervisedConfig;

use super::config_flags::{self, config_file, Flag, Flags};
use super::dataset_flags::{self, HeldOut};

/// What a supervised trainer adds to the shared options.
pub trait Trainer: std::fmt::Debug {
    type Kind: rloo::train::supervised::Trainer + std::fmt::Debug;
    /// Its own flags (the model to start from, ...).
    const FLAGS: &'static [Flag];
}

#[derive(Debug)]
pub struct SupervisedArgs<T: Trainer> {
    config: Option<PathBuf>,
    overrides: Vec<(String, toml::Value)>,
    held_out: HeldOut,
    print_config: bool,
    trainer: PhantomData<T>,
}

fn flags<T: Trainer>() -> Flags {
    Flags::new()
        .with("Model", "", T::FLAGS)
        .with("Model", "", config_flags::DEVICE)
        .with("Data", "", dataset_flags::TRAINING_DATA)
        .with("Training", "", config_flags::PRECISION)
        .with("Training", "", config_flags::BATCH)
        .with("Training", "", config_flags::OPTIMIZER)
        .with("Training", "", config_flags::RUN)
        .with("Training", "", config_flags::CHECKPOINTS)
        .with("PEFT", "", config_flags::PEFT)
}

impl<T: Trainer> clap::Args for SupervisedArgs<T> {
    fn augment_args(cmd: Command) -> Command {
        let defaults = SupervisedConfig::<T::Kind>::default();
        flags::<T>().augment(cmd, &toml::Value::try_from(defaults).expect("the default config serialises"))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl<T: Trainer> clap::FromArgMatches for SupervisedArgs<T> {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let (config, print_config) = config_file(m);
        let overrides = flags::<T>().overrides(m, |_, key| key.to_string())?;
        Ok(Self { config, overrides, held_out: HeldOut::from_matches(m), print_config, trainer: PhantomData })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl<T: Trainer> SupervisedArgs<T> {
    /// The resolved config to train with; `None` once printed for `--print_config`.
    pub fn config(&self) -> Result<Option<SupervisedConfig<T::Kind>>> {
        let mut cfg: SupervisedConfig<T::Kind> = load_toml(self.config.as_deref(), &self.overrides, |_, _| Ok(()))?;
        self.held_out.apply(&cfg.dataset, &mut cfg.eval_dataset);
        if !self.print_config {
            return Ok(Some(cfg));
        }
        cfg.validate()?;
        print!("{}", to_toml(&cfg));
        Ok(None)
    }
}

/// Says where a run stopped by `--stop_after` left its work.
pub fn stopped_early(steps: usize, output_dir: &std::path::Path) {
    eprintln!(
        "stopped after step {steps} with a checkpoint in {}; continue with --resume_from_checkpoint latest",
        output_dir.display()
    );
}
