//! Continuous batching on the decoding loop: one thread per model decodes
//! every running completion together, one token per row per step. Between
//! two steps, new requests are prefilled and join the batch (their
//! key/value cache is appended to the running one) and finished or
//! abandoned completions leave it, so a request never waits for another to
//! finish, and many concurrent clients share each step's weight reads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use super::text::TextStream;
use crate::data::Tokenizer;
use crate::error::Result;
use crate::generate::decoding::{DecodeRow, Decoding, Verdict};
use crate::generate::sampling::{with_penalty, Pick};
use crate::generate::{FinishReason, Sampler, Sampling, Stepping};
use crate::model::Network;
use crate::rng::Rng;
use crate::service::server::Shutdown;
use crate::service::Cancel;

/// How often an idle engine looks at the stop flag.
const POLL: Duration = Duration::from_millis(200);

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
    sampler: Sampler,
    stepping: Stepping,
}

pub fn engine<'m>(
    net: &'m Network,
    tokenizer: &'m Tokenizer,
    device: &Device,
    max_rows: usize,
    (sampler, stepping): (Sampler, Stepping),
) -> (Engine, EngineLoop<'m>) {
    let (jobs, queue) = mpsc::channel();
    let stats = Arc::new(EngineStats::default());
    let handle = Engine { jobs: Mutex::new(jobs), stats: stats.clone(), max_rows };
    (handle, EngineLoop { net, tokenizer, device: device.clone(), queue, stats, max_rows, sampler, stepping })
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
    stop_ids: Vec<u32>,
    logprobs: Option<usize>,
    events: Sender<Event>,
    cancel: Cancel,
}

/// What the server keeps of a completion beside its tokens.
struct Row {
    request: Arc<Shared>,
    choice: usize,
    text: TextStream,
}

type Batch<'m> = Decoding<'m, Row>;

/// What became of a row after its newest token.
enum Outcome {
    Continues,
    /// With the event that tells its client, sent once the row is counted out.
    Finished(Event),
    /// Nobody listens any more.
    Abandoned,
}

impl EngineLoop<'_> {
    /// Decodes until every [`Engine`] handle is gone, or until the server
    /// stops: from then on waiting requests are turned away, and the rows
    /// running get the grace period to finish before they are stopped.
    pub fn run(self, shutdown: &Shutdown) -> Result<()> {
        let mut batch: Batch = Decoding::open(self.net, &self.device, self.sampler, self.stepping);
        let mut waiting: VecDeque<GenRequest> = VecDeque::new();
        loop {
            if shutdown.stopping() {
                waiting.extend(self.queue.try_iter());
                for request in waiting.drain(..) {
                    let _ = request.events.send(Event::Stopped);
                }
                if shutdown.past_grace() {
                    for row in batch.drain() {
                        let _ = row.client.request.events.send(Event::Stopped);
                    }
                }
                if batch.is_empty() {
                    break;
                }
            } else {
                if batch.is_empty() && waiting.is_empty() {
                    match self.queue.recv_timeout(POLL) {
                        Ok(request) => waiting.push_back(request),
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
                waiting.extend(self.queue.try_iter());
            }
            let admitted = self.admit(&mut waiting, batch.len());
            self.stats.waiting_requests.store(waiting.len(), Ordering::Relaxed);
            if let Err(e) = self.step(&mut batch, admitted) {
                // A failed step fails the requests in it; the server goes on.
                tracing::error!("decoding failed: {e}");
                for row in batch.drain() {
                    let _ = row.client.request.events.send(Event::Failed(e.to_string()));
                }
            }
            self.stats.running_rows.store(batch.len(), Ordering::Relaxed);
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
            self.stats.running_rows.store(batch.len(), Ordering::Relaxed);
        }
        batch.step(|row, pick, logits, i| {
            self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
            let outcome = self.advance(row, pick, logits, i)?;
            let counter = match outcome {
                Outcome::Continues => return Ok(Verdict::Continues),
                Outcome::Finished(_) => &self.stats.completed,
                Outcome::Abandoned => &self.stats.cancelled,
            };
            // Counted out before its client hears that it is done, so that
            // `/health` read after the answer never shows the row running.
            counter.fetch_add(1, Ordering::Relaxed);
            self.stats.running_rows.fetch_sub(1, Ordering::Relaxed);
            if let Outcome::Finished(done) = outcome {
                let _ = row.client.request.events.send(done);
            }
            Ok(Verdict::Leaves)
        })?;
        Ok(())
    }

    /// Prefills the new requests' prompts (each runs once; its `n` rows get
    /// copies of its cache) and adds their rows to the batch. If the prefill
    /// fails, only the new requests fail.
    fn prefill(&self, batch: &mut Batch, admitted: Vec<GenRequest>) -> Result<()> {
        let mut rows = Vec::new();
        for request in admitted {
            let prompt: Arc<[u32]> = Arc::from(request.prompt);
            let shared = Arc::new(Shared {
                stop_ids: request.stop_ids,
                logprobs: request.logprobs,
                events: request.events,
                cancel: request.cancel,
            });
            rows.extend((0..request.n).map(|c| DecodeRow {
                prompt: prompt.clone(),
                sampling: request.sampling.clone(),
                repetition_penalty: request.repetition_penalty,
                rng: Rng::stream(request.seed, &[c as u64]),
                max_tokens: request.max_tokens,
                tokens: Vec::with_capacity(request.max_tokens),
                client: Row {
                    request: shared.clone(),
                    choice: request.first_choice + c,
                    text: TextStream::new(&request.stop_strings),
                },
            }));
        }
        match batch.prefill(&rows) {
            Ok(prefilled) => batch.join(rows, prefilled),
            Err(e) => {
                tracing::error!("prefill failed: {e}");
                for row in rows {
                    let _ = row.client.request.events.send(Event::Failed(e.to_string()));
                }
                Ok(())
            }
        }
    }

    /// Tells the request of a row its newest token.
    fn advance(&self, row: &mut DecodeRow<Row>, pick: &Pick, logits: &Tensor, i: usize) -> Result<Outcome> {
        let request = row.client.request.clone();
        if request.cancel.is_cancelled() {
            return Ok(Outcome::Abandoned);
        }
        let stop_token = request.stop_ids.contains(&pick.token);
        let piece = if stop_token { Default::default() } else { row.client.text.push(self.tokenizer, pick.token)? };
        let finish = if stop_token || piece.stopped {
            Some(FinishReason::Stop)
        } else if row.tokens.len() >= row.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        let mut text = piece.text;
        if finish.is_some() {
            text.push_str(&row.client.text.finish(self.tokenizer)?);
        }
        let logprob = match request.logprobs {
            Some(top) => Some(self.token_logprob(pick, &logits.get(i)?, row, top)?),
            None => None,
        };
        let choice = row.client.choice;
        let sent = request.events.send(Event::Token { choice, text, logprob }).is_ok();
        Ok(match finish {
            _ if !sent => Outcome::Abandoned,
            Some(finish_reason) => Outcome::Finished(Event::Done { choice, finish_reason, tokens: row.tokens.len() }),
            None => Outcome::Continues,
        })
    }

    /// The picked token's log-prob and the `top` most likely tokens' under
    /// the distribution it was drawn from (the repetition penalty included),
    /// once `row` holds it.
    fn token_logprob(&self, pick: &Pick, logits: &Tensor, row: &DecodeRow<Row>, top: usize) -> Result<TokenLogprob> {
        let raw: Vec<f32> = logits.to_dtype(DType::F32)?.to_vec1()?;
        let mut buf = Vec::new();
        let seen = row.prompt.iter().chain(&row.tokens[..row.tokens.len() - 1]).copied();
        let inv_t = 1.0 / row.sampling.logprob_temperature();
        let row = with_penalty(&raw, seen, row.repetition_penalty, &mut buf);
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
