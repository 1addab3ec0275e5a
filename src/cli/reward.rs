//! `rloo reward train`: a reward model from preference pairs.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use rloo::train::config::Schedule;
use rloo::train::reward_model::{train_reward_model, RewardTrainConfig};

#[derive(Debug, Subcommand)]
pub enum RewardCommand {
    Train(RewardTrainArgs),
}

/// Train a reward model (Bradley-Terry) on preference pairs.
///
/// Rows are `{"prompt", "chosen", "rejected"}`: a text or chat prompt with
/// text answers, or chosen/rejected as whole conversations. Starting from a
/// causal LM adds a new score head; the result is a
/// `*ForSequenceClassification` directory (num_labels = 1) that
/// transformers and `rloo train --reward_model_path` load.
#[derive(Debug, Args)]
pub struct RewardTrainArgs {
    /// Model directory or cached hub id to start from (causal LM or reward model).
    #[arg(long)]
    model: String,
    /// Preference pairs (JSONL or JSON).
    #[arg(long)]
    dataset: String,
    /// Held-out pairs for accuracy and margin [default: --eval-fraction of the pairs].
    #[arg(long)]
    eval_dataset: Option<String>,
    /// Fraction of the pairs held out when no --eval-dataset is given.
    #[arg(long, default_value_t = 0.1)]
    eval_fraction: f64,
    #[arg(long, default_value = "runs/reward_model")]
    output_dir: String,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    #[arg(long, default_value_t = 1e-5)]
    learning_rate: f64,
    /// Pairs per forward/backward.
    #[arg(long, default_value_t = 8)]
    per_device_train_batch_size: usize,
    #[arg(long, default_value_t = 1)]
    gradient_accumulation_steps: usize,
    #[arg(long, default_value_t = 1)]
    num_train_epochs: usize,
    /// constant, linear or cosine.
    #[arg(long, default_value = "linear", value_parser = super::sft::parse_schedule)]
    lr_scheduler_type: Schedule,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Clip gradients to this global norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    /// Longest sequence in tokens (longer ones are cut).
    #[arg(long, default_value_t = 1024)]
    max_length: usize,
    /// Seed of the new score head, the held-out split and the batch order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Replace the logs of a previous run in --output-dir (refused without it).
    #[arg(long, alias = "overwrite_output_dir")]
    overwrite_output_dir: bool,
    /// Stop (saving the model so far) after N optimizer steps in a row with a non-finite loss or gradient.
    #[arg(long, alias = "max_skipped_steps", default_value_t = 10)]
    max_skipped_steps: usize,
}

pub fn run(cmd: RewardCommand) -> Result<()> {
    let RewardCommand::Train(a) = cmd;
    let cfg = RewardTrainConfig {
        model: a.model,
        dataset: a.dataset,
        eval_dataset: a.eval_dataset,
        eval_fraction: a.eval_fraction,
        output_dir: a.output_dir,
        device: a.device,
        learning_rate: a.learning_rate,
        per_device_train_batch_size: a.per_device_train_batch_size,
        gradient_accumulation_steps: a.gradient_accumulation_steps,
        num_train_epochs: a.num_train_epochs,
        lr_scheduler_type: a.lr_scheduler_type,
        weight_decay: a.weight_decay,
        max_grad_norm: a.max_grad_norm,
        max_length: a.max_length,
        seed: a.seed,
        overwrite_output_dir: a.overwrite_output_dir,
        max_skipped_steps: a.max_skipped_steps,
    };
    let s = train_reward_model(&cfg).context("reward-model training failed")?;
    match s.eval {
        Some(e) => eprintln!(
            "trained {} steps: held-out accuracy {:.3}, margin {:.3}, loss {:.4} -> {}",
            s.steps,
            e.accuracy,
            e.margin,
            e.loss,
            s.output_dir.display()
        ),
        None => eprintln!("trained {} steps -> {}", s.steps, s.output_dir.display()),
    }
    Ok(())
}
