//! Continuous batching: one thread per model decodes every running
//! completion together, one token per row per step. Between two steps, new
//! requests are prefilled and join the batch (their key/value cache is
//! appended to the running one) and finished or abandoned completions
//! leave it, so a request never waits for another to finish, and many
//! concurrent clients share each step's weight reads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use super::text::TextStream;
use crate::data::Tokenizer;
use crate::error::Result;
use crate::generate::engine::pick_rows;
use crate::generate::sampling::{with_penalty, Pick};
use crate::generate::{FinishReason, Sampling};
use crate::model::{Inputs, KvCache, Network, PadSide};
use crate::rng::Rng;
use crate::service::server::Shutdown;
use crate::service::Cancel;

/// How often an idle engine looks at the stop flag.
const POLL: Duration = Duration::from_millis(200);

/// Leading cache slots no row uses are dropped once there are this many.
const TRIM_SLOTS: usize = 64;

/// One request: `n` completions of one prompt.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub n: usize,
    /// The index its first completion has among the answer's choices
    /// (several prompts may share one answer).
    pub first_choice: usize,
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// transformers' repetition penalty (1: none).
    pub repetition_penalty: f32,
    /// Token ids that end a completion (EOS and stop tokens); the stopping
    /// token counts as generated but adds no text.
    pub stop_ids: Vec<u32>,
    /// Text that ends a completion, which is cut before it.
    pub stop_strings: Vec<String>,
    pub seed: u64,
    /// Report each token's log-prob, with this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// Where the completions' events go. When the receiver is dropped or
    /// `cancel` is set (the client left), the request's rows leave the
    /// batch, or never join it.
    pub events: Sender<Event>,
    pub cancel: Cancel,
}

/// What a request hears as its completions grow.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Completion `choice` has a new token: the text now safe to show (may
    /// be empty while it could still begin a stop string) and, when asked
    /// for, the token's log-probs.
    Token { choice: usize, text: String, logprob: Option<TokenLogprob> },
    /// Completion `choice` ended after `tokens` tokens.
    Done { choice: usize, finish_reason: FinishReason, tokens: usize },
    /// The engine failed on this request.
    Failed(String),
    /// The server stopped before the request was done.
    Stopped,
}

/// A token's log-prob under the sampling distribution (temperature applied,
/// before truncation) and its most likely alternatives, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// Counters for `/health` and the tests: what the engine holds right now.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub running_rows: AtomicUsize,
    pub waiting_requests: AtomicUsize,
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub generated_tokens: AtomicU64,
}

impl EngineStats {
    pub fn json(&self) -> Value {
        json!({
            "running": self.running_rows.load(Ordering::Relaxed),
            "waiting": self.waiting_requests.load(Ordering::Relaxed),
            "completed": self.completed.load(Ordering::Relaxed),
            "cancelled": self.cancelled.load(Ordering::Relaxed),
            "generated_tokens": self.generated_tokens.load(Ordering::Relaxed),
        })
    }
}

/// The handle request handlers submit to.
pub struct Engine {
    jobs: Mutex<Sender<GenRequest>>,
    pub stats: Arc<EngineStats>,
    /// Completions decoded together at most.
    pub max_rows: usize,
}

/// The decoding thread behind an [`Engine`].
pub struct EngineLoop<'m> {
    net: &'m Network,
    tokenizer: &'m Tokenizer,
    device: Device,
    queue: Receiver<GenRequest>,
    stats: Arc<EngineStats>,
    max_rows: usize,
}

pub fn engine<'m>(
    net: &'m Network,
    tokenizer: &'m Tokenizer,
    device: &Device,
    max_rows: usize,
) -> (Engine, EngineLoop<'m>) {
    let (jobs, queue) = mpsc::channel();
    let stats = Arc::new(EngineStats::default());
    let handle = Engine { jobs: Mutex::new(jobs), stats: stats.clone(), max_rows };
    (handle, EngineLoop { net, tokenizer, device: device.clone(), queue, stats, max_rows })
}

impl Engine {
    /// Queues a request; its events arrive on the request's sender.
    pub fn submit(&self, request: GenRequest) -> std::result::Result<(), String> {
        if request.n == 0 || request.n > self.max_rows {
            return Err(format!("n must be between 1 and {}, got {}", self.max_rows, request.n));
        }
        self.stats.waiting_requests.fetch_add(1, Ordering::Relaxed);
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).send(request).map_err(|_| {
            self.stats.waiting_requests.fetch_sub(1, Ordering::Relaxed);
            "the server is stopping".to_string()
        })
    }
}

/// A request's settings, shared by its rows.
struct Shared {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: Sampling,
    repetition_penalty: f32,
    stop_ids: Vec<u32>,
    logprobs: Option<usize>,
    events: Sender<Event>,
    cancel: Cancel,
}

/// One completion being decoded.
struct Row {
    request: Arc<Shared>,
    choice: usize,
    /// Its prompt among those prefilled with it.
    prompt: usize,
    tokens: Vec<u32>,
    rng: Rng,
    text: TextStream,
}

/// What became of a row after its newest token.
enum Outcome {
    Continues,
    Finished,
    /// Nobody listens any more.
    Abandoned,
}

impl EngineLoop<'_> {
    /// Decodes until every [`Engine`] handle is gone, or until the server
    /// stops: from then on waiting requests are turned away, and the rows
    /// running get the grace period to finish before they are stopped.
    pub fn run(self, shutdown: &Shutdown) -> Result<()> {
        let mut batch = Batch { rows: Vec::new(), cache: self.net.new_cache(), logits: None };
        let mut waiting: VecDeque<GenRequest> = VecDeque::new();
        loop {
            if shutdown.stopping() {
                waiting.extend(self.queue.try_iter());
                for request in waiting.drain(..) {
                    let _ = request.events.send(Event::Stopped);
                }
                if shutdown.past_grace() {
                    for row in batch.rows.drain(..) {
                        let _ = row.request.events.send(Event::Stopped);
                    }
                }
                if batch.rows.is_empty() {
                    break;
                }
            } else {
                if batch.rows.is_empty() && waiting.is_empty() {
                    match self.queue.recv_timeout(POLL) {
                        Ok(request) => waiting.push_back(request),
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
                waiting.extend(self.queue.try_iter());
            }
            let admitted = self.admit(&mut waiting, batch.rows.len());
            self.stats.waiting_requests.store(waiting.len(), Ordering::Relaxed);
            if let Err(e) = self.step(&mut batch, admitted) {
                // A failed step fails the requests in it; the server goes on.
                tracing::error!("decoding failed: {e}");
                for row in batch.rows.drain(..) {
                    let _ = row.request.events.send(Event::Failed(e.to_string()));
                }
                batch = Batch { rows: Vec::new(), cache: self.net.new_cache(), logits: None };
            }
            self.stats.running_rows.store(batch.rows.len(), Ordering::Relaxed);
        }
        Ok(())
    }

    /// The waiting requests whose rows fit beside `running` rows, in order;
    /// those whose client has gone are dropped.
    fn admit(&self, waiting: &mut VecDeque<GenRequest>, running: usize) -> Vec<GenRequest> {
        waiting.retain(|r| {
            let gone = r.cancel.is_cancelled();
            if gone {
                self.stats.cancelled.fetch_add(r.n as u64, Ordering::Relaxed);
            }
            !gone
        });
        let mut room = self.max_rows.saturating_sub(running);
        let mut admitted = Vec::new();
        while waiting.front().is_some_and(|r| r.n <= room) {
            let request = waiting.pop_front().expect("a waiting request");
            room -= request.n;
            admitted.push(request);
        }
        admitted
    }

    /// Prefills the admitted requests into the batch, then picks one token
    /// for every row and computes the next logits of the rows that go on.
    fn step(&self, batch: &mut Batch, admitted: Vec<GenRequest>) -> Result<()> {
        if !admitted.is_empty() {
            self.prefill(batch, admitted)?;
        }
        let Some(logits) = batch.logits.take() else { return Ok(()) };
        let picks = pick_tokens(&logits, &mut batch.rows)?;
        let mut keep = Vec::with_capacity(batch.rows.len());
        let mut rows = Vec::with_capacity(batch.rows.len());
        for (i, (mut row, pick)) in std::mem::take(&mut batch.rows).into_iter().zip(picks).enumerate() {
            match self.advance(&mut row, &pick, &logits, i)? {
                Outcome::Continues => {
                    keep.push(i as u32);
                    rows.push(row);
                }
                Outcome::Finished => {
                    self.stats.completed.fetch_add(1, Ordering::Relaxed);
                }
                Outcome::Abandoned => {
                    self.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.stats.generated_tokens.fetch_add(logits.dim(0)? as u64, Ordering::Relaxed);
        batch.rows = rows;
        if batch.rows.is_empty() {
            batch.cache = self.net.new_cache();
            return Ok(());
        }
        if keep.len() < logits.dim(0)? {
            batch.cache.select_rows(&keep)?;
            batch.cache.trim_front(TRIM_SLOTS)?;
        }
        let tokens: Vec<u32> = batch.rows.iter().map(|r| *r.tokens.last().unwrap_or(&0)).collect();
        let positions: Vec<u32> =
            batch.rows.iter().map(|r| (r.request.prompt.len() + r.tokens.len() - 1) as u32).collect();
        let step = Inputs::step(&tokens, &positions, &self.device)?;
        batch.logits = Some(self.net.logits(&step, Some(&mut batch.cache))?.squeeze(1)?);
        Ok(())
    }

    /// Runs the new prompts once each (left-padded together), copies each
    /// one's cache for its `n` rows, and appends rows, cache and last-position
    /// logits to the batch. If that fails, only the new requests fail.
    fn prefill(&self, batch: &mut Batch, admitted: Vec<GenRequest>) -> Result<()> {
        let prompts: Vec<Vec<u32>> = admitted.iter().map(|r| r.prompt.clone()).collect();
        let mut rows = Vec::new();
        for (i, request) in admitted.into_iter().enumerate() {
            let shared = Arc::new(Shared {
                prompt: request.prompt,
                max_tokens: request.max_tokens,
                sampling: request.sampling,
                repetition_penalty: request.repetition_penalty,
                stop_ids: request.stop_ids,
                logprobs: request.logprobs,
                events: request.events,
                cancel: request.cancel,
            });
            rows.extend((0..request.n).map(|c| Row {
                request: shared.clone(),
                choice: request.first_choice + c,
                prompt: i,
                tokens: Vec::with_capacity(request.max_tokens),
                rng: Rng::stream(request.seed, &[c as u64]),
                text: TextStream::new(&request.stop_strings),
            }));
        }
        let (cache, logits) = match self.run_prompts(&prompts, &rows) {
            Ok(out) => out,
            Err(e) => {
                tracing::error!("prefill failed: {e}");
                for row in rows {
                    let _ = row.request.events.send(Event::Failed(e.to_string()));
                }
                return Ok(());
            }
        };
        batch.rows.extend(rows);
        let reserve = batch.rows.iter().map(|r| r.request.max_tokens - r.tokens.len()).max().unwrap_or(0);
        batch.cache.join(cache, reserve)?;
        batch.logits = Some(match batch.logits.take() {
            Some(running) => Tensor::cat(&[&running, &logits], 0)?,
            None => logits,
        });
        Ok(())
    }

    /// The cache and last-position logits (rows, V) of new rows: each
    /// distinct prompt runs once and its rows share copies of its result.
    fn run_prompts(&self, prompts: &[Vec<u32>], rows: &[Row]) -> Result<(KvCache, Tensor)> {
        let inputs = Inputs::from_rows(prompts, 0, PadSide::Left, &self.device)?;
        let mut cache = self.net.new_cache();
        let hidden = self.net.hidden_states(&inputs, Some(&mut cache))?;
        let t = hidden.dim(1)?;
        let last = self.net.project(&hidden.narrow(1, t - 1, 1)?.squeeze(1)?)?; // (U, V)
        if rows.len() == prompts.len() {
            return Ok((cache, last));
        }
        let owner: Vec<u32> = rows.iter().map(|r| r.prompt as u32).collect();
        cache.select_rows(&owner)?;
        Ok((cache, last.index_select(&Tensor::from_slice(&owner, owner.len(), &self.device)?, 0)?))
    }

    /// Adds a picked token to its row and tells the request.
    fn advance(&self, row: &mut Row, pick: &Pick, logits: &Tensor, i: usize) -> Result<Outcome> {
        let request = row.request.clone();
        if request.cancel.is_cancelled() {
            return Ok(Outcome::Abandoned);
        }
        row.tokens.push(pick.token);
        let stop_token = request.stop_ids.contains(&pick.token);
        let piece = if stop_token { Default::default() } else { row.text.push(self.tokenizer, pick.token)? };
        let finish = if stop_token || piece.stopped {
            Some(FinishReason::Stop)
        } else if row.tokens.len() >= request.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        let mut text = piece.text;
        if finish.is_some() {
            text.push_str(&row.text.finish(self.tokenizer)?);
        }
        let logprob = match request.logprobs {
            Some(top) => Some(self.token_logprob(pick, &logits.get(i)?, row, top)?),
            None => None,
        };
        let sent = request.events.send(Event::Token { choice: row.choice, text, logprob }).is_ok();
        Ok(match finish {
            _ if !sent => Outcome::Abandoned,
            Some(finish_reason) => {
                let done = Event::Done { choice: row.choice, finish_reason, tokens: row.tokens.len() };
                let _ = request.events.send(done);
                Outcome::Finished
            }
            None => Outcome::Continues,
        })
    }

    /// The picked token's log-prob and the `top` most likely tokens' under
    /// the distribution it was drawn from (the repetition penalty included),
    /// once `row` holds it.
    fn token_logprob(&self, pick: &Pick, logits: &Tensor, row: &Row, top: usize) -> Result<TokenLogprob> {
        let r = &row.request;
        let raw: Vec<f32> = logits.to_vec1()?;
        let mut buf = Vec::new();
        let seen = r.prompt.iter().chain(&row.tokens[..row.tokens.len() - 1]).copied();
        let row = with_penalty(&raw, seen, r.repetition_penalty, &mut buf);
        let inv_t = 1.0 / r.sampling.logprob_temperature();
        // log p_j = l_j / T - log Z, and log Z follows from the picked token.
        let log_z = row[pick.token as usize] * inv_t - pick.logprob;
        let mut ids: Vec<u32> = (0..row.len() as u32).collect();
        let top = top.min(ids.len());
        if top > 0 {
            ids.select_nth_unstable_by(top - 1, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
        }
        ids.truncate(top);
        ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
        let top = ids
            .iter()
            .map(|&id| Ok((self.token_text(id)?, row[id as usize] * inv_t - log_z)))
            .collect::<Result<Vec<_>>>()?;
        Ok(TokenLogprob { token: self.token_text(pick.token)?, logprob: pick.logprob, top })
    }

    fn token_text(&self, id: u32) -> Result<String> {
        self.tokenizer.decode(&[id], false)
    }
}

/// The running rows, their cache, and their next-token logits (B, V).
struct Batch {
    rows: Vec<Row>,
    cache: KvCache,
    logits: Option<Tensor>,
}

/// Each row's next token, drawn with its own settings and generator.
fn pick_tokens(logits: &Tensor, rows: &mut [Row]) -> Result<Vec<Pick>> {
    pick_rows(logits, rows, |row, l, scratch| {
        let r = &row.request;
        let seen = r.prompt.iter().chain(&row.tokens).copied();
        r.sampling.pick_penalized(l, seen, r.repetition_penalty, &mut row.rng, scratch)
    })
}
