//! Batch generation on the decoding loop: k completions per prompt, in
//! closed batches of `batch_size` rows, where the k rows of a prompt read
//! its cached keys and values from one copy. Each completion ends on a stop
//! token, a stop string or the length limit.

use std::sync::Arc;

use candle_core::Device;

use super::decoding::{DecodeRow, Decoding, Verdict};
use super::fixed::Stepping;
use super::race::Sampler;
use super::sampling::Sampling;
use crate::data::Tokenizer;
use crate::error::{Error, Result};
use crate::model::Network;
use crate::rng::Rng;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS id, a stop token id or a stop string ended the completion.
    Stop,
    /// `max_new_tokens` was reached.
    Length,
}

/// When a completion ends.
#[derive(Debug, Clone, Default)]
pub struct StopCriteria {
    /// EOS ids (from `generation_config.json`, or overridden) and extra stop
    /// token ids; the stopping token is kept in the completion.
    pub token_ids: Vec<u32>,
    /// Text that ends a completion once the decoded completion contains it.
    pub strings: Vec<String>,
}

impl StopCriteria {
    /// Refuses an empty stop string: every text contains it, so every
    /// completion would end before its first token.
    pub fn check_strings(strings: &[String]) -> std::result::Result<(), String> {
        match strings.iter().any(String::is_empty) {
            true => Err("a stop string is empty, which would end every completion before its first token".into()),
            false => Ok(()),
        }
    }

    /// The model's EOS ids: `generation_config.json`'s (one or several),
    /// else the tokenizer's EOS token; empty when it has neither.
    pub fn model_eos_ids(model_dir: &std::path::Path, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
        let from_config =
            crate::model::GenerationConfig::from_dir(model_dir)?.unwrap_or_default().eos_token_ids().to_vec();
        Ok(if from_config.is_empty() { tokenizer.eos_token_id().into_iter().collect() } else { from_config })
    }
}

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// Completions per prompt (k).
    pub num_return_sequences: usize,
    pub sampling: Sampling,
    /// transformers' repetition penalty over the prompt and the completion
    /// so far (1: none); see [`with_penalty`](super::sampling::with_penalty).
    pub repetition_penalty: f32,
    pub stop: StopCriteria,
    /// Rows (prompt x sample) decoded together.
    pub batch_size: usize,
    /// How tokens are picked from the logits ([`Sampler::from_env`]).
    pub sampler: Sampler,
    /// How a batch's steps are launched ([`Stepping::from_env`]).
    pub stepping: Stepping,
    pub seed: u64,
    /// Added to a prompt's index where its rows' random streams are keyed:
    /// a process sampling one share of a batch draws what one process
    /// sampling the whole batch would.
    pub prompt_offset: usize,
    /// The longest prompt + completion the model allows, if bounded.
    pub max_positions: Option<usize>,
}

/// One finished completion.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Completion {
    pub prompt_index: usize,
    pub sample_index: usize,
    /// Generated ids, including the stop token when one ended it.
    pub tokens: Vec<u32>,
    /// Log-prob of each generated token under the sampling distribution
    /// (temperature applied, before truncation).
    pub logprobs: Vec<f32>,
    /// Entropy of that distribution at each generated token.
    pub entropies: Vec<f32>,
    pub finish_reason: FinishReason,
}

/// What the engine keeps of a row beside its tokens.
struct Row {
    prompt_index: usize,
    sample_index: usize,
    logprobs: Vec<f32>,
    entropies: Vec<f32>,
}

/// Generates `num_return_sequences` completions for every prompt. Each
/// finished completion is handed to `on_done` as soon as it stops (so it can
/// be written out); `on_tokens` hears how many tokens each step produced.
pub fn generate(
    net: &Network,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
    device: &Device,
    on_tokens: &mut dyn FnMut(usize),
    on_done: &mut dyn FnMut(Completion) -> Result<()>,
) -> Result<()> {
    opts.sampling.validate().map_err(Error::Invalid)?;
    if !(opts.repetition_penalty.is_finite() && opts.repetition_penalty > 0.0) {
        return Err(Error::Invalid(format!("repetition_penalty must be > 0, got {}", opts.repetition_penalty)));
    }
    if opts.num_return_sequences == 0 || opts.batch_size == 0 {
        return Err(Error::Invalid("num_return_sequences and batch_size must be at least 1".into()));
    }
    StopCriteria::check_strings(&opts.stop.strings).map_err(Error::Invalid)?;
    if !opts.stop.strings.is_empty() && tokenizer.is_none() {
        return Err(Error::Invalid("stop strings need the tokenizer".into()));
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(Error::Invalid(format!("prompt {i} has no tokens")));
        }
        if let Some(max) = opts.max_positions {
            if p.len() + opts.max_new_tokens > max {
                return Err(Error::Invalid(format!(
                    "prompt {i}: {} prompt tokens + {} new tokens exceed the model's {max} positions",
                    p.len(),
                    opts.max_new_tokens
                )));
            }
        }
    }
    let k = opts.num_return_sequences;
    let shared: Vec<Arc<[u32]>> = prompts.iter().map(|p| Arc::from(p.as_slice())).collect();
    let rows: Vec<(usize, usize)> = (0..prompts.len()).flat_map(|p| (0..k).map(move |s| (p, s))).collect();
    for batch in rows.chunks(opts.batch_size) {
        let rows = batch
            .iter()
            .map(|&(p, s)| DecodeRow {
                prompt: shared[p].clone(),
                sampling: opts.sampling.clone(),
                repetition_penalty: opts.repetition_penalty,
                rng: Rng::stream(opts.seed, &[(opts.prompt_offset + p) as u64, s as u64]),
                max_tokens: opts.max_new_tokens,
                tokens: Vec::with_capacity(opts.max_new_tokens),
                client: Row {
                    prompt_index: p,
                    sample_index: s,
                    logprobs: Vec::with_capacity(opts.max_new_tokens),
                    entropies: Vec::with_capacity(opts.max_new_tokens),
                },
            })
            .collect();
        decode_batch(net, rows, opts, tokenizer, device, on_tokens, on_done)?;
    }
    Ok(())
}

/// One greedy token decoded after a one-token prompt, the result dropped,
/// stepped as `sampler` and `stepping` say: a process's first forward pass
/// on a GPU pays its one-time costs (loading the kernels' module, making
/// the BLAS handles), which a command then pays before its first request
/// or its timed run rather than in it. (On the CPU, where there are none
/// to speak of, it measured no faster after one.)
pub fn warm_up(net: &Network, device: &Device, sampler: Sampler, stepping: Stepping) -> Result<()> {
    let opts = GenerateOptions {
        max_new_tokens: 2,
        num_return_sequences: 1,
        sampling: Sampling::greedy(),
        repetition_penalty: 1.0,
        stop: StopCriteria::default(),
        batch_size: 1,
        sampler,
        stepping,
        seed: 0,
        prompt_offset: 0,
        max_positions: None,
    };
    generate(net, &[vec![0]], &opts, None, device, &mut |_| {}, &mut |_| Ok(()))?;
    // What a log says after this line is the real work's (bench/gpu/report.py reads it so).
    tracing::info!("warmed up: a greedy token decoded, the device's one-time costs paid");
    Ok(())
}

fn decode_batch(
    net: &Network,
    rows: Vec<DecodeRow<Row>>,
    opts: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
    device: &Device,
    on_tokens: &mut dyn FnMut(usize),
    on_done: &mut dyn FnMut(Completion) -> Result<()>,
) -> Result<()> {
    if opts.max_new_tokens == 0 {
        for mut row in rows {
            on_done(finish(&mut row, FinishReason::Length))?;
        }
        return Ok(());
    }
    let mut batch = Decoding::closed(net, device, opts.sampler, opts.stepping);
    batch.admit(rows)?;
    let longest_stop = opts.stop.strings.iter().map(String::len).max().unwrap_or(0);
    while !batch.is_empty() {
        let produced = batch.step(|row, pick, _, _| {
            row.client.logprobs.push(pick.logprob);
            row.client.entropies.push(pick.entropy);
            let stopped = opts.stop.token_ids.contains(&pick.token)
                || (longest_stop > 0 && hits_stop_string(tokenizer, &row.tokens, &opts.stop.strings, longest_stop)?);
            let reason = match stopped {
                true => FinishReason::Stop,
                false if row.tokens.len() >= opts.max_new_tokens => FinishReason::Length,
                false => return Ok(Verdict::Continues),
            };
            on_done(finish(row, reason))?;
            Ok(Verdict::Leaves)
        })?;
        on_tokens(produced);
    }
    Ok(())
}

/// The completion of a row that leaves the batch (its tokens move out).
fn finish(row: &mut DecodeRow<Row>, finish_reason: FinishReason) -> Completion {
    Completion {
        prompt_index: row.client.prompt_index,
        sample_index: row.client.sample_index,
        tokens: std::mem::take(&mut row.tokens),
        logprobs: std::mem::take(&mut row.client.logprobs),
        entropies: std::mem::take(&mut row.client.entropies),
        finish_reason,
    }
}

/// Whether the decoded tail of `tokens` contains a stop string. Only the
/// last few tokens are decoded: a stop string completed by the newest token
/// lies within its byte length plus a few tokens of the end.
fn hits_stop_string(tokenizer: Option<&Tokenizer>, tokens: &[u32], strings: &[String], longest: usize) -> Result<bool> {
    let Some(tok) = tokenizer else {
        return Ok(false);
    };
    let tail = &tokens[tokens.len().saturating_sub(longest + 4)..];
    let text = tok.decode(tail, false)?;
    Ok(strings.iter().any(|s| text.contains(s.as_str())))
}
