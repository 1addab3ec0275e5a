//! The sampling engine: k completions per prompt, decoded in batches with a
//! KV cache. Each prompt is prefilled once and its k rows read its cached
//! keys and values from one copy; every row keeps its own position; rows
//! that stop leave the batch so no compute is spent on them.
//!
//! It runs on the frozen network (detached weights), so no autograd graph
//! is recorded.

use candle_core::{CpuStorage, Device, Storage, Tensor};
use rayon::prelude::*;

use super::sampling::{Pick, Sampling, Scratch};
use crate::data::Tokenizer;
use crate::error::{Error, Result};
use crate::model::{Inputs, Network, PadSide};
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

/// A row being decoded.
struct Row {
    prompt_index: usize,
    sample_index: usize,
    prompt_len: usize,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    entropies: Vec<f32>,
    rng: Rng,
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
    let rows: Vec<(usize, usize)> = (0..prompts.len()).flat_map(|p| (0..k).map(move |s| (p, s))).collect();
    for batch in rows.chunks(opts.batch_size) {
        decode_batch(net, prompts, batch, opts, tokenizer, device, on_tokens, on_done)?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn decode_batch(
    net: &Network,
    prompts: &[Vec<u32>],
    batch: &[(usize, usize)],
    opts: &GenerateOptions,
    tokenizer: Option<&Tokenizer>,
    device: &Device,
    on_tokens: &mut dyn FnMut(usize),
    on_done: &mut dyn FnMut(Completion) -> Result<()>,
) -> Result<()> {
    let mut rows: Vec<Row> = batch
        .iter()
        .map(|&(p, s)| Row {
            prompt_index: p,
            sample_index: s,
            prompt_len: prompts[p].len(),
            tokens: Vec::with_capacity(opts.max_new_tokens),
            logprobs: Vec::with_capacity(opts.max_new_tokens),
            entropies: Vec::with_capacity(opts.max_new_tokens),
            rng: Rng::stream(opts.seed, &[(opts.prompt_offset + p) as u64, s as u64]),
        })
        .collect();
    if opts.max_new_tokens == 0 {
        for row in rows {
            on_done(finish(row, FinishReason::Length))?;
        }
        return Ok(());
    }

    // Prefill each distinct prompt once (left-padded so every row's last
    // column is its last prompt token); its rows share its cached slots.
    let mut distinct: Vec<usize> = batch.iter().map(|&(p, _)| p).collect();
    distinct.dedup();
    let prefill_rows: Vec<Vec<u32>> = distinct.iter().map(|&p| prompts[p].clone()).collect();
    let inputs = Inputs::from_rows(&prefill_rows, 0, PadSide::Left, device)?;
    let mut cache = net.new_cache();
    let hidden = net.hidden_states(&inputs, Some(&mut cache))?;
    let t = hidden.dim(1)?;
    let last = net.project(&hidden.narrow(1, t - 1, 1)?.squeeze(1)?)?; // (U, V)
    let owner: Vec<u32> =
        batch.iter().map(|&(p, _)| distinct.iter().position(|&d| d == p).unwrap_or(0) as u32).collect();
    let mut logits = if owner.len() == distinct.len() {
        last
    } else {
        cache.share(&owner)?;
        last.index_select(&Tensor::from_slice(&owner, owner.len(), device)?, 0)?
    };
    // The last sampled token is never fed back.
    cache.reserve(opts.max_new_tokens - 1);

    let longest_stop = opts.stop.strings.iter().map(String::len).max().unwrap_or(0);
    loop {
        let picks = pick_tokens(&logits, &mut rows, prompts, opts)?;
        let produced = rows.len();
        let mut keep: Vec<u32> = Vec::with_capacity(rows.len());
        let mut still = Vec::with_capacity(rows.len());
        for (i, (mut row, pick)) in std::mem::take(&mut rows).into_iter().zip(picks).enumerate() {
            let token = pick.token;
            row.tokens.push(token);
            row.logprobs.push(pick.logprob);
            row.entropies.push(pick.entropy);
            let stopped = opts.stop.token_ids.contains(&token)
                || (longest_stop > 0 && hits_stop_string(tokenizer, &row.tokens, &opts.stop.strings, longest_stop)?);
            if stopped {
                on_done(finish(row, FinishReason::Stop))?;
            } else if row.tokens.len() >= opts.max_new_tokens {
                on_done(finish(row, FinishReason::Length))?;
            } else {
                keep.push(i as u32);
                still.push(row);
            }
        }
        on_tokens(produced);
        rows = still;
        if rows.is_empty() {
            return Ok(());
        }
        if keep.len() < produced {
            cache.select_rows(&keep)?;
        }
        let tokens: Vec<u32> = rows.iter().map(|r| *r.tokens.last().unwrap_or(&0)).collect();
        let positions: Vec<u32> = rows.iter().map(|r| (r.prompt_len + r.tokens.len() - 1) as u32).collect();
        let step = Inputs::step(&tokens, &positions, device)?;
        logits = net.logits(&step, Some(&mut cache))?.squeeze(1)?;
    }
}

/// Picks each row's next token from its row of the (B, V) logits. Rows
/// sample independently (each has its own generator), so in parallel.
fn pick_tokens(logits: &Tensor, rows: &mut [Row], prompts: &[Vec<u32>], opts: &GenerateOptions) -> Result<Vec<Pick>> {
    pick_rows(logits, rows, |row, row_logits, scratch| {
        let seen = prompts[row.prompt_index].iter().chain(&row.tokens).copied();
        opts.sampling.pick_penalized(row_logits, seen, opts.repetition_penalty, &mut row.rng, scratch)
    })
}

/// Runs `pick` on each row with its row of the (B, V) logits, in parallel,
/// reading the logits in place when they are on the CPU.
pub(crate) fn pick_rows<R: Send>(
    logits: &Tensor,
    rows: &mut [R],
    pick: impl Fn(&mut R, &[f32], &mut Scratch) -> Pick + Sync,
) -> Result<Vec<Pick>> {
    let vocab = logits.dim(1)?;
    if logits.dim(0)? != rows.len() {
        return Err(Error::Invalid(format!("{} logit rows for {} rows", logits.dim(0)?, rows.len())));
    }
    let (storage, layout) = logits.storage_and_layout();
    let copied: Vec<f32>;
    // Read in place on the CPU: copying the logits costs about as much as sampling from them.
    let host: &[f32] = match (&*storage, layout.contiguous_offsets()) {
        (Storage::Cpu(cpu @ CpuStorage::F32(_)), Some((start, end))) => &cpu.as_slice::<f32>()?[start..end],
        _ => {
            copied = logits.flatten_all()?.to_vec1()?;
            &copied
        }
    };
    Ok(rows
        .par_iter_mut()
        .zip(host.par_chunks(vocab))
        .map_init(Scratch::default, |scratch, (row, row_logits)| pick(row, row_logits, scratch))
        .collect())
}

fn finish(row: Row, finish_reason: FinishReason) -> Completion {
    Completion {
        prompt_index: row.prompt_index,
        sample_index: row.sample_index,
        tokens: row.tokens,
        logprobs: row.logprobs,
        entropies: row.entropies,
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
