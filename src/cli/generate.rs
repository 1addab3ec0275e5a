//! `rloo generate`: k sampled completions per prompt, written as JSONL as
//! they finish.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{Map, Value};

use rloo::data::jsonl::JsonlWriter;
use rloo::data::prompts::{ContextRoom, PromptDataset};
use rloo::data::Tokenizer;
use rloo::generate::{generate, warm_up, GenerateOptions, Sampler, Sampling, Stepping, StopCriteria};
use rloo::model::hub::resolve_model;
use rloo::model::{parse_device, GenerationConfig, HeadKind, Model, Placement, Precision};

use super::dataset_flags::DatasetFlags;

/// Sample completions for a file of prompts.
///
/// Input rows carry a `prompt` (a string, or a list of chat messages
/// rendered with the model's chat template). Output rows keep the input
/// fields and add `completion`, `finish_reason` (`stop` or `length`),
/// `completion_tokens`, `prompt_index` and `sample_index`. Sampling options
/// left unset come from the model's `generation_config.json`; with neither,
/// decoding is greedy.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Model directory in the Hugging Face layout, or a hub id (`owner/name`) found in the local cache.
    #[arg(long)]
    model: String,
    /// Rows with a `prompt` field: a dataset file (JSONL, JSON, CSV, Parquet, Arrow; .gz/.zst),
    /// a dataset directory or datasets save, or a hub dataset id.
    #[arg(long)]
    prompts: String,
    #[command(flatten)]
    data: DatasetFlags,
    /// Where to write the completions (JSONL, one row per completion, in finishing order), replaced only when all are done.
    #[arg(long)]
    output: PathBuf,
    /// Completions per prompt (k).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    num_return_sequences: u64,
    /// Most tokens to generate per completion [default: generation config, else 64].
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// Sampling temperature; 0 means greedy [default: generation config, else greedy].
    #[arg(long)]
    temperature: Option<f32>,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long)]
    top_k: Option<usize>,
    /// Nucleus sampling: keep the most likely tokens up to this total probability (1: off).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop tokens less likely than min_p times the most likely one (0: off).
    #[arg(long)]
    min_p: Option<f32>,
    /// Divide (multiply, when negative) the logits of tokens already in the prompt or the completion
    /// by this, as transformers does (1: off) [default: generation config, else 1].
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Seed of the sampler; the same seed gives the same completions on the same machine.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Rows (prompt x sample) decoded together.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    batch_size: u64,
    /// Token ids that end a completion, replacing the generation config's EOS ids (repeatable, comma-separated).
    #[arg(long, value_delimiter = ',')]
    eos_token_id: Vec<u32>,
    /// Extra token ids that end a completion (repeatable, comma-separated).
    #[arg(long, value_delimiter = ',')]
    stop_token_id: Vec<u32>,
    /// Text that ends a completion (repeatable); the output text is cut before it.
    #[arg(long)]
    stop: Vec<String>,
    /// Do not stop at EOS: always generate max_new_tokens (for benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// cpu, cuda, cuda:N or auto (the first GPU if there is one).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Compute in bf16 (weights and activations; logits and scores in f32).
    #[arg(long)]
    bf16: bool,
}

/// Sampling from the flags, each falling back to the generation config.
fn sampling(args: &GenerateArgs, gen: &GenerationConfig) -> Sampling {
    let temperature = match args.temperature {
        Some(t) => t,
        None if gen.do_sample == Some(true) => gen.temperature.unwrap_or(1.0) as f32,
        None => 0.0,
    };
    if temperature == 0.0 {
        return Sampling::greedy();
    }
    Sampling::temperature(temperature)
        .with_top_k(args.top_k.or(gen.top_k.map(|k| k as usize)).unwrap_or(0))
        .with_top_p(args.top_p.or(gen.top_p.map(|p| p as f32)).unwrap_or(1.0))
        .with_min_p(args.min_p.or(gen.min_p.map(|p| p as f32)).unwrap_or(0.0))
}

pub fn run(args: GenerateArgs) -> Result<()> {
    StopCriteria::check_strings(&args.stop).map_err(|e| anyhow::anyhow!("--stop: {e}"))?;
    let device = parse_device(&args.device)?;
    let dir = resolve_model(&args.model)?;
    let dtype = Precision::from_bf16(args.bf16).dtype();
    let model = Model::load_computing(&dir, Placement::new(&device, dtype))
        .with_context(|| format!("loading model {}", dir.display()))?;
    if model.head() != HeadKind::CausalLm {
        bail!("{}: a sequence-classification model cannot generate text", dir.display());
    }
    let tokenizer = Tokenizer::from_dir(&dir)?;
    tokenizer.check_model(model.config())?;
    let gen = GenerationConfig::from_dir(&dir)?.unwrap_or_default();
    let max_new_tokens = args.max_new_tokens.or(gen.max_new_tokens.map(|n| n as usize)).unwrap_or(64);

    let room = ContextRoom::of(model.config(), max_new_tokens);
    let dataset = PromptDataset::from_prompt_column(&args.data.spec(&args.prompts, "train", None), &tokenizer, room)?;
    let prompts: Vec<Vec<u32>> = dataset.rows.iter().map(|r| r.ids.clone()).collect();

    let mut stop_ids = if args.ignore_eos {
        Vec::new()
    } else if !args.eos_token_id.is_empty() {
        args.eos_token_id.clone()
    } else {
        StopCriteria::model_eos_ids(&dir, &tokenizer)?
    };
    stop_ids.extend(&args.stop_token_id);
    let opts = GenerateOptions {
        max_new_tokens,
        num_return_sequences: args.num_return_sequences as usize,
        sampling: sampling(&args, &gen),
        repetition_penalty: args.repetition_penalty.or(gen.repetition_penalty.map(|p| p as f32)).unwrap_or(1.0),
        stop: StopCriteria { token_ids: stop_ids, strings: args.stop.clone() },
        batch_size: args.batch_size as usize,
        sampler: Sampler::from_env(&model.device())?,
        stepping: Stepping::from_env(&model.device())?,
        seed: args.seed,
        prompt_offset: 0,
        max_positions: model.config().max_positions(),
    };
    tracing::info!(
        "{} prompts x {} samples, up to {} new tokens, {:?}",
        prompts.len(),
        opts.num_return_sequences,
        opts.max_new_tokens,
        opts.sampling
    );

    // A GPU's one-time costs fall before the timed run, as a warm-up call
    // of transformers' `generate` takes them (the CPU has none to speak of).
    if device.is_cuda() {
        warm_up(model.frozen(), &device, opts.sampler, opts.stepping)?;
    }
    let mut out = JsonlWriter::replacing(&args.output)?;
    let bar = super::progress_bar((prompts.len() * opts.num_return_sequences) as u64, "completions");
    let started = Instant::now();
    let mut generated = 0usize;
    let mut on_tokens = |n: usize| {
        generated += n;
        bar.set_message(format!("{:.0} tok/s", generated as f64 / started.elapsed().as_secs_f64()));
    };
    let mut on_done = |c: rloo::generate::Completion| -> rloo::Result<()> {
        let mut text = tokenizer.decode(&c.tokens, true)?;
        if let Some(cut) = args.stop.iter().filter_map(|s| text.find(s.as_str())).min() {
            text.truncate(cut);
        }
        let mut fields: Map<String, Value> = dataset.rows[c.prompt_index].row.fields.clone();
        fields.insert("completion".into(), text.into());
        fields.insert("finish_reason".into(), serde_json::to_value(c.finish_reason).unwrap_or_default());
        fields.insert("completion_tokens".into(), c.tokens.len().into());
        fields.insert("prompt_index".into(), c.prompt_index.into());
        fields.insert("sample_index".into(), c.sample_index.into());
        out.write_row(&fields)?;
        bar.inc(1);
        Ok(())
    };
    generate(model.frozen(), &prompts, &opts, Some(&tokenizer), &device, &mut on_tokens, &mut on_done)?;
    bar.finish_and_clear();
    out.commit()?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "generated {generated} tokens in {secs:.3} s ({:.1} tokens/s) -> {}",
        generated as f64 / secs,
        args.output.display()
    );
    Ok(())
}
