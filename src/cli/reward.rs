//! `rloo reward train`: a reward model from preference pairs;
//! `rloo reward serve`: a reward model over HTTP.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use rloo::model::{parse_device, Precision};
use rloo::reward::serve::{serve, ServeOptions};
use rloo::reward::RewardModel;
use rloo::train::config::Schedule;
use rloo::train::reward_model::{train_reward_model, RewardTrainConfig};

use super::dataset_flags::TrainingDataFlags;
use super::listen_flags::ListenFlags;

#[derive(Debug, Subcommand)]
pub enum RewardCommand {
    Train(RewardTrainArgs),
    Serve(RewardServeArgs),
}

/// Serve a reward model over HTTP for `type = "http"` rewards on other machines.
///
/// `POST /score` takes `{"prompts": [...], "completions": [...], "rows": [...]}`
/// (prompts as text or chat message lists; rows optional) and answers
/// `{"scores": [...]}`. `GET /health` answers `{"status": "ok"}`. Requests that
/// arrive together are scored together. Listens on loopback unless --host says
/// otherwise; stops on Ctrl-C.
#[derive(Debug, Args)]
pub struct RewardServeArgs {
    /// A *ForSequenceClassification model directory (num_labels = 1) or cached hub id.
    #[arg(long)]
    model: String,
    #[command(flatten)]
    listen: ListenFlags,
    /// Samples scored together at most (also the forward-pass batch).
    #[arg(long, alias = "batch_size", default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    batch_size: u64,
    /// Samples one request may hold.
    #[arg(long, alias = "max_request_samples", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_request_samples: u64,
    /// Largest request body in MiB.
    #[arg(long, alias = "max_body_mib", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..4096))]
    max_body_mib: u64,
    /// Requests handled at the same time.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    threads: u64,
    /// Requests waiting beyond those; more are answered 503 (which the `http` reward source retries).
    #[arg(long, alias = "max_queue", default_value_t = 256)]
    max_queue: usize,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: String,
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
    #[command(flatten)]
    data: TrainingDataFlags,
    /// Fraction of the training rows held out when no --eval-dataset or --dataset_test_split is given.
    #[arg(long, default_value_t = 0.1)]
    eval_fraction: f64,
    #[arg(long, default_value = "runs/reward_model")]
    output_dir: String,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    /// bf16 mixed precision: bf16 weights and activations, f32 master weights and optimizer state.
    #[arg(long)]
    bf16: bool,
    /// Keep only each layer's input in the forward pass and recompute the layer in the backward.
    #[arg(long = "gradient_checkpointing", alias = "gradient-checkpointing")]
    gradient_checkpointing: bool,
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
    #[command(flatten)]
    peft: super::peft_flags::PeftFlags,
}

pub fn run(cmd: RewardCommand) -> Result<()> {
    match cmd {
        RewardCommand::Train(a) => train(a),
        RewardCommand::Serve(a) => serve_model(a),
    }
}

fn serve_model(a: RewardServeArgs) -> Result<()> {
    let token = a.listen.token()?;
    let device = parse_device(&a.device)?;
    let batch_size = a.batch_size as usize;
    let model = RewardModel::load("reward_model", &a.model, &device, batch_size)?;
    let opts = ServeOptions {
        host: a.listen.host,
        port: a.listen.port,
        token,
        batch_size,
        max_request_samples: a.max_request_samples as usize,
        max_body_bytes: (a.max_body_mib as usize) << 20,
        threads: a.threads as usize,
        max_queue: a.max_queue,
    };
    rloo::train::stop::install();
    serve(&model, &opts, rloo::train::stop::requested, |addr| {
        eprintln!("serving {} on http://{addr} (POST /score, GET /health)", model.dir().display());
    })?;
    eprintln!("stopped");
    Ok(())
}

fn train(a: RewardTrainArgs) -> Result<()> {
    let (dataset, eval_dataset) = a.data.specs();
    let cfg = RewardTrainConfig {
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
        weight_decay: a.weight_decay,
        max_grad_norm: a.max_grad_norm,
        max_length: a.max_length,
        seed: a.seed,
        overwrite_output_dir: a.overwrite_output_dir,
        max_skipped_steps: a.max_skipped_steps,
        peft: a.peft.options(),
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
