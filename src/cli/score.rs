//! `rloo score`: per-token log-probs of completions under a causal LM, or
//! the score a reward (sequence-classification) model gives each row.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{Map, Value};

use rloo::data::jsonl::JsonlWriter;
use rloo::data::{Prompt, Tokenizer};
use rloo::model::hub::resolve_model;
use rloo::model::scoring::{completion_logprobs, sequence_scores, Pair, Sequences};
use rloo::model::{parse_device, HeadKind, Model, Placement, Precision};

use super::dataset_flags::DatasetFlags;

/// Score prompt/completion pairs with a model.
///
/// Input rows are `{"prompt": ..., "completion": ...}` where `prompt` is a
/// string or a list of chat messages (rendered with the model's chat
/// template and the generation prompt). Prompt and completion are tokenized
/// separately without special tokens, plus a BOS token when the tokenizer
/// config asks for one. Output rows keep the input fields and add
/// `logprobs` and `sum_logprob` (causal LM) or `score` (reward model).
#[derive(Debug, Args)]
pub struct ScoreArgs {
    /// Model directory in the Hugging Face layout, or a hub id (`owner/name`) found in the local cache.
    #[arg(long)]
    model: String,
    /// Rows with `prompt` and `completion`: a dataset file (JSONL, JSON, CSV, Parquet, Arrow; .gz/.zst),
    /// a dataset directory or datasets save, or a hub dataset id.
    #[arg(long)]
    input: String,
    #[command(flatten)]
    data: DatasetFlags,
    /// Where to write the scored rows as JSONL (replaced only when every row is scored).
    #[arg(long)]
    output: PathBuf,
    /// Rows per forward pass.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    batch_size: u64,
    /// cpu, cuda, cuda:N or auto (the first GPU if there is one).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Compute in bf16 (weights and activations; logits and scores in f32).
    #[arg(long)]
    bf16: bool,
}

struct ScoreRow {
    fields: Map<String, Value>,
    pair: Pair,
}

pub fn run(args: ScoreArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    let dir = resolve_model(&args.model)?;
    let dtype = Precision::from_bf16(args.bf16).dtype();
    let model = Model::load_computing(&dir, Placement::new(&device, dtype))
        .with_context(|| format!("loading model {}", dir.display()))?;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    tokenizer.check_model(model.config())?;
    let rows = args.data.spec(&args.input, "train", None).read_all()?;
    // Tokenize everything first so a malformed row fails before any output.
    let mut items = Vec::with_capacity(rows.len());
    for row in rows {
        let at = || row.location();
        let prompt = row.column("prompt").map_err(|e| row.error(e))?;
        let prompt = Prompt::from_value(prompt).map_err(|e| row.error(format!("column `prompt`: {e}")))?;
        let completion = match row.column("completion").map_err(|e| row.error(e))? {
            Value::String(s) => s.clone(),
            other => return Err(row.error(format!("column `completion` must be a string, got {other}")).into()),
        };
        let pair = Pair {
            prompt: tokenizer.encode_prompt(&prompt).with_context(at)?,
            completion: tokenizer.encode(&completion).with_context(at)?,
        };
        if pair.prompt.is_empty() && pair.completion.is_empty() {
            bail!("{}: prompt and completion are both empty", at());
        }
        let joined = [pair.prompt.as_slice(), pair.completion.as_slice()].concat();
        model.check_tokens(&joined).with_context(at)?;
        items.push(ScoreRow { fields: row.fields, pair });
    }

    let mut out = JsonlWriter::replacing(&args.output)?;
    let bar = super::progress_bar(items.len() as u64, "rows");
    for chunk in items.chunks(args.batch_size as usize) {
        let pairs: Vec<Pair> = chunk.iter().map(|r| r.pair.clone()).collect();
        match model.head() {
            HeadKind::CausalLm => {
                let seqs = Sequences::new(
                    pairs.iter().map(|p| p.prompt.as_slice()).collect(),
                    pairs.iter().map(|p| p.completion.as_slice()).collect(),
                );
                let padded: Vec<Vec<f32>> =
                    completion_logprobs(model.frozen(), &seqs, 1.0, &device)?.logprobs.to_vec2()?;
                for ((row, mut lp), pair) in chunk.iter().zip(padded).zip(&pairs) {
                    lp.truncate(pair.completion.len());
                    let mut fields = row.fields.clone();
                    let sum: f64 = lp.iter().map(|&x| x as f64).sum();
                    fields.insert("logprobs".into(), Value::from(lp));
                    fields.insert("sum_logprob".into(), Value::from(sum));
                    out.write_row(&fields)?;
                }
            }
            HeadKind::SequenceClassification { num_labels } => {
                let scores = sequence_scores(model.frozen(), &pairs, &device)?;
                for (row, s) in chunk.iter().zip(scores) {
                    let mut fields = row.fields.clone();
                    let score = if num_labels == 1 { Value::from(s[0]) } else { Value::from(s) };
                    fields.insert("score".into(), score);
                    out.write_row(&fields)?;
                }
            }
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    out.commit()?;
    tracing::info!("scored {} rows -> {}", items.len(), args.output.display());
    Ok(())
}
