//! `rloo serve`: models behind an OpenAI-compatible API and a chat page.

use anyhow::Result;
use clap::Args;

use rloo::model::hub::resolve_model;
use rloo::model::{parse_device, Precision};
use rloo::serve::{model_arg, serve, Loaded, ServeOptions};

use super::listen_flags::ListenFlags;

/// Serve models over an OpenAI-compatible API, with a chat page at `/`.
///
/// Text models answer `POST /v1/chat/completions` (messages rendered with
/// the model's chat template) and `POST /v1/completions`, whole or streamed
/// (`"stream": true`); reward models (a sequence-classification head)
/// answer `POST /score` as `rloo reward serve` does. `GET /v1/models` lists
/// them, `GET /health` says what each is doing. Concurrent requests are
/// decoded together. Listens on loopback unless --host says otherwise;
/// stops on Ctrl-C.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A model to serve: a directory (or cached hub id), served under that name, or NAME=DIR
    /// (repeatable). Reward models are recognised by their head.
    #[arg(long = "model", value_name = "[NAME=]DIR", required = true)]
    models: Vec<String>,
    #[command(flatten)]
    listen: ListenFlags,
    /// Completions each text model decodes together at most; requests beyond wait their turn.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    max_batch_rows: u64,
    /// Completions (prompts x n) one request may ask for; more is answered 400.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    max_request_rows: u64,
    /// Requests handled at the same time (each stream holds one until it ends).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    max_concurrent: u64,
    /// Requests waiting beyond those; more are answered 503.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..4096))]
    max_body_mib: u64,
    /// Samples a reward model scores together.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..))]
    score_batch_size: u64,
    /// cpu, cuda, cuda:N or auto (the first GPU if there is one).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Compute text models in bf16 (logits in f32).
    #[arg(long)]
    bf16: bool,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let listen = a.listen.listen(a.max_body_mib, a.max_concurrent, a.max_queue)?;
    let device = parse_device(&a.device)?;
    let mut models = Vec::with_capacity(a.models.len());
    for arg in &a.models {
        let (name, path) = model_arg(arg);
        let dir = resolve_model(&path)?;
        let dtype = Precision::from_bf16(a.bf16).dtype();
        models.push(Loaded::load(&name, &dir, &device, dtype, a.score_batch_size as usize)?);
    }
    let opts = ServeOptions {
        listen,
        max_batch_rows: a.max_batch_rows as usize,
        max_request_rows: a.max_request_rows as usize,
        score_batch_size: a.score_batch_size as usize,
        max_score_samples: 1024,
    };
    rloo::train::stop::install();
    let names: Vec<&str> = models.iter().map(Loaded::name).collect();
    serve(&models, &opts, rloo::train::stop::requested, |addr| {
        eprintln!("serving {} on http://{addr} (chat page at /, OpenAI API under /v1)", names.join(", "));
    })?;
    eprintln!("stopped");
    Ok(())
}
