//! `rloo reward train`: a reward model from preference pairs;
//! `rloo reward serve`: a reward model over HTTP.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use rloo::model::parse_device;
use rloo::reward::serve::{serve, ServeOptions};
use rloo::reward::RewardModel;
use rloo::train::reward_model::{train_reward_model, RewardTraining};

use super::config_flags::{Flag, Kind};
use super::listen_flags::ListenFlags;
use super::supervised::{SupervisedArgs, Trainer};

#[derive(Debug, Subcommand)]
pub enum RewardCommand {
    /// Train a reward model (Bradley-Terry) on preference pairs.
    ///
    /// Rows are `{"prompt", "chosen", "rejected"}`: a text or chat prompt with
    /// text answers, or chosen/rejected as whole conversations. Starting from a
    /// causal LM adds a new score head; the result is a
    /// `*ForSequenceClassification` directory (num_labels = 1) that
    /// transformers and `rloo train --reward_model_path` load. Options come
    /// from a TOML file, then `--set key=value`, then flags.
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
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    batch_size: u64,
    /// Samples one request may hold.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_request_samples: u64,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..4096))]
    max_body_mib: u64,
    /// Requests handled at the same time.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    threads: u64,
    /// Requests waiting beyond those; more are answered 503 (which the `http` reward source retries).
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: String,
}

#[derive(Debug)]
pub struct RewardTrainer;

impl Trainer for RewardTrainer {
    type Kind = RewardTraining;
    const FLAGS: &'static [Flag] = &[
        ("model", "model", Kind::Str, "Model directory or cached hub id to start from (causal LM or reward model)"),
        ("model_name_or_path", "model", Kind::Str, "TRL's name of --model"),
    ];
}

pub type RewardTrainArgs = SupervisedArgs<RewardTrainer>;

pub fn run(cmd: RewardCommand) -> Result<()> {
    match cmd {
        RewardCommand::Train(a) => train(a),
        RewardCommand::Serve(a) => serve_model(a),
    }
}

fn serve_model(a: RewardServeArgs) -> Result<()> {
    let listen = a.listen.listen(a.max_body_mib, a.threads, a.max_queue)?;
    let device = parse_device(&a.device)?;
    let batch_size = a.batch_size as usize;
    let model = RewardModel::load("reward_model", &a.model, &device, batch_size)?;
    let opts = ServeOptions { listen, batch_size, max_request_samples: a.max_request_samples as usize };
    rloo::train::stop::install();
    serve(&model, &opts, rloo::train::stop::requested, |addr| {
        eprintln!("serving {} on http://{addr} (POST /score, GET /health)", model.dir().display());
    })?;
    eprintln!("stopped");
    Ok(())
}

fn train(a: RewardTrainArgs) -> Result<()> {
    let Some(cfg) = a.config()? else { return Ok(()) };
    let s = train_reward_model(&cfg).context("reward-model training failed")?;
    if !s.main {
        return Ok(());
    }
    if !s.finished {
        super::supervised::stopped_early(s.steps, &s.output_dir);
        return Ok(());
    }
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
