//! `rloo sft`: supervised fine-tuning of a causal LM.

use anyhow::{Context, Result};
use clap::Args;

use rloo::model::Precision;
use rloo::train::config::Schedule;

use super::dataset_flags::TrainingDataFlags;
use rloo::train::sft::{train_sft, SftConfig};

fn d() -> SftConfig {
    SftConfig::default()
}

/// Fine-tune a causal LM on demonstrations (cross-entropy on completion tokens).
///
/// Rows are `{"prompt", "completion"}` (strings or chat messages),
/// `{"messages": [...]}` (the last assistant message is the completion), or
/// `{"text"}`. An EOS token ends text completions.
#[derive(Debug, Args)]
pub struct SftArgs {
    /// Model directory or cached hub id to start from.
    #[arg(long)]
    model: String,
    #[command(flatten)]
    data: TrainingDataFlags,
    /// Fraction of the training rows held out when no --eval-dataset or --dataset_test_split is given.
    #[arg(long, default_value_t = d().eval_fraction)]
    eval_fraction: f64,
    /// Where the model and metrics go.
    #[arg(long, default_value_t = d().output_dir)]
    output_dir: String,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value_t = d().device)]
    device: String,
    /// bf16 mixed precision: bf16 weights and activations, f32 master weights and optimizer state.
    #[arg(long)]
    bf16: bool,
    /// Keep only each layer's input in the forward pass and recompute the layer in the backward.
    #[arg(long = "gradient_checkpointing", alias = "gradient-checkpointing")]
    gradient_checkpointing: bool,
    #[arg(long, default_value_t = d().learning_rate)]
    learning_rate: f64,
    /// Rows per forward/backward.
    #[arg(long, default_value_t = d().per_device_train_batch_size)]
    per_device_train_batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = d().gradient_accumulation_steps)]
    gradient_accumulation_steps: usize,
    #[arg(long, default_value_t = d().num_train_epochs)]
    num_train_epochs: usize,
    /// constant, linear or cosine.
    #[arg(long, default_value = "linear", value_parser = parse_schedule)]
    lr_scheduler_type: Schedule,
    #[arg(long, default_value_t = d().warmup_ratio)]
    warmup_ratio: f64,
    /// AdamW weight decay (not on biases and norms).
    #[arg(long, default_value_t = d().weight_decay)]
    weight_decay: f64,
    /// Clip gradients to this global norm (0: off).
    #[arg(long, default_value_t = d().max_grad_norm)]
    max_grad_norm: f64,
    /// Longest prompt + completion in tokens (longer completions are cut).
    #[arg(long, default_value_t = d().max_length)]
    max_length: usize,
    /// Train on prompt tokens too, not only on completions.
    #[arg(long)]
    all_tokens: bool,
    #[arg(long, default_value_t = d().seed)]
    seed: u64,
    /// Log every N optimizer steps.
    #[arg(long, default_value_t = d().logging_steps)]
    logging_steps: usize,
    /// Replace the logs of a previous run in --output-dir (refused without it).
    #[arg(long, alias = "overwrite_output_dir")]
    overwrite_output_dir: bool,
    /// Stop (saving the model so far) after N optimizer steps in a row with a non-finite loss or gradient.
    #[arg(long, alias = "max_skipped_steps", default_value_t = d().max_skipped_steps)]
    max_skipped_steps: usize,
    #[command(flatten)]
    peft: super::peft_flags::PeftFlags,
}

pub(crate) fn parse_schedule(s: &str) -> Result<Schedule, String> {
    match s {
        "constant" => Ok(Schedule::Constant),
        "linear" => Ok(Schedule::Linear),
        "cosine" => Ok(Schedule::Cosine),
        other => Err(format!("`{other}` is not a schedule (constant, linear or cosine)")),
    }
}

pub fn run(a: SftArgs) -> Result<()> {
    let (dataset, eval_dataset) = a.data.specs();
    let cfg = SftConfig {
        model: a.model,
        dataset,
        eval_dataset,
        eval_fraction: a.eval_fraction,
        output_dir: a.output_dir,
        device: a.device,
        dtype: Precision::from_bf16(a.bf16),
        gradient_checkpointing: a.gradient_checkpointing,
        learning_rate: a.learning_rate,
        per_device_train_batch_size: a.per_device_train_batch_size,
        gradient_accumulation_steps: a.gradient_accumulation_steps,
        num_train_epochs: a.num_train_epochs,
        lr_scheduler_type: a.lr_scheduler_type,
        warmup_ratio: a.warmup_ratio,
        weight_decay: a.weight_decay,
        max_grad_norm: a.max_grad_norm,
        max_length: a.max_length,
        all_tokens: a.all_tokens,
        seed: a.seed,
        logging_steps: a.logging_steps,
        overwrite_output_dir: a.overwrite_output_dir,
        max_skipped_steps: a.max_skipped_steps,
        peft: a.peft.options(),
    };
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
