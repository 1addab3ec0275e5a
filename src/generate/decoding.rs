//! The one decoding loop. Rows (a prompt, how to draw from it, a random
//! stream, the tokens so far) decode together, one token per row per step;
//! each distinct prompt is prefilled once; rows join between steps and leave
//! when their client says so, and no compute is spent on them after that.
//! `rloo generate`, the trainers' rollouts, `rloo eval` (through
//! [`generate`](super::generate)) and `rloo serve`'s continuous batching are
//! its clients: they decide when a completion ends and what becomes of it.
//!
//! It runs on the frozen network (detached weights), so no autograd graph
//! is recorded.

use std::sync::Arc;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use rayon::prelude::*;

use super::clock::{Mark, StepClock};
use super::fixed::{FixedBatch, Stepping};
use super::race::{self, RaceRow, Sampler};
use super::sampling::{Pick, Sampling, Scratch};
use crate::error::{Error, Result};
use crate::model::{Inputs, KvCache, Network, PadSide};
use crate::rng::Rng;

/// Leading cache slots no row uses are dropped once there are this many
/// (rows that joined later sit behind left padding).
const TRIM_SLOTS: usize = 64;

/// One completion being decoded, with what its client keeps beside it.
pub struct DecodeRow<R> {
    /// Rows of one prompt sit next to each other and share this allocation,
    /// which is how a prompt is recognised and prefilled once for all of them.
    pub prompt: Arc<[u32]>,
    pub sampling: Sampling,
    /// transformers' repetition penalty over the prompt and the completion
    /// so far (1: none).
    pub repetition_penalty: f32,
    /// The row's random stream: the host sampler draws from it, the race
    /// takes its key from it.
    pub rng: Rng,
    /// The most tokens the row may get (sizes the cache).
    pub max_tokens: usize,
    pub tokens: Vec<u32>,
    pub client: R,
}

/// What a client says of a row after its newest token.
pub enum Verdict {
    Continues,
    Leaves,
}

/// A prefill's result, for rows about to join.
pub struct Prefilled {
    cache: KvCache,
    /// (rows, V) next-token logits.
    logits: Tensor,
}

/// The rows decoding together, their key/value cache and next logits.
pub struct Decoding<'n, R> {
    net: &'n Network,
    device: Device,
    sampler: Sampler,
    /// Whether rows join while others run (a server): each row then keeps
    /// its own copy of its prompt's keys and values, so caches can be joined.
    /// Otherwise the rows of a prompt read one shared copy, and rows join
    /// only an empty batch.
    open: bool,
    /// How the batch steps.
    stepping: Stepping,
    rows: Vec<DecodeRow<R>>,
    cache: KvCache,
    /// (rows, V) next-token logits.
    logits: Option<Tensor>,
    /// The batch's rows on the device, with fixed stepping.
    fixed: Option<FixedBatch>,
    /// Where a closed batch's steps spend their time, when asked.
    clock: Option<StepClock>,
}

impl<'n, R: Send> Decoding<'n, R> {
    /// A batch whose rows all start together.
    pub fn closed(net: &'n Network, device: &Device, sampler: Sampler, stepping: Stepping) -> Self {
        Self::new(net, device, sampler, false, stepping)
    }

    /// A batch that rows join while others run.
    pub fn open(net: &'n Network, device: &Device, sampler: Sampler, stepping: Stepping) -> Self {
        Self::new(net, device, sampler, true, stepping)
    }

    fn new(net: &'n Network, device: &Device, sampler: Sampler, open: bool, stepping: Stepping) -> Self {
        let (rows, cache) = (Vec::new(), net.new_cache());
        let (logits, fixed, clock) = (None, None, None);
        Self { net, device: device.clone(), sampler, open, stepping, rows, cache, logits, fixed, clock }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Takes every row out, leaving an empty batch.
    pub fn drain(&mut self) -> Vec<DecodeRow<R>> {
        self.cache = self.net.new_cache();
        self.logits = None;
        self.fixed = None;
        self.clock = None;
        std::mem::take(&mut self.rows)
    }

    /// Runs each distinct prompt of `rows` once (left-padded together) and
    /// gives the cache and last-position logits for every row. Changes
    /// nothing, so a failure concerns only these rows.
    pub fn prefill(&self, rows: &[DecodeRow<R>]) -> Result<Prefilled> {
        let mut prompts: Vec<Vec<u32>> = Vec::new();
        let mut owner: Vec<u32> = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            if row.prompt.is_empty() {
                return Err(Error::Invalid("a prompt has no tokens".into()));
            }
            if i == 0 || !Arc::ptr_eq(&row.prompt, &rows[i - 1].prompt) {
                prompts.push(row.prompt.to_vec());
            }
            owner.push(prompts.len() as u32 - 1);
        }
        let inputs = Inputs::from_rows(&prompts, 0, PadSide::Left, &self.device)?;
        let mut cache = self.net.new_cache();
        let hidden = self.net.hidden_states(&inputs, Some(&mut cache))?;
        let t = hidden.dim(1)?;
        let last = self.net.project_to_sample(&hidden.narrow(1, t - 1, 1)?.squeeze(1)?)?; // (U, V)
        if owner.len() == prompts.len() {
            return Ok(Prefilled { cache, logits: last });
        }
        match self.open {
            true => cache.select_rows(&owner)?,
            false => cache.share(&owner)?,
        }
        let logits = last.index_select(&Tensor::from_slice(&owner, owner.len(), &self.device)?, 0)?;
        Ok(Prefilled { cache, logits })
    }

    /// Adds prefilled rows to the batch.
    pub fn join(&mut self, rows: Vec<DecodeRow<R>>, prefilled: Prefilled) -> Result<()> {
        if !self.open {
            if !self.rows.is_empty() {
                return Err(Error::Invalid("rows join a closed batch only when it is empty".into()));
            }
            self.cache = prefilled.cache;
            self.cache.reserve(rows.iter().map(room).max().unwrap_or(0));
            if self.stepping != Stepping::Shrink && !rows.is_empty() {
                let (n, vocab, graph) = (rows.len(), prefilled.logits.dim(1)?, self.stepping == Stepping::Graph);
                self.fixed = Some(FixedBatch::new(n, vocab, &mut self.cache, &self.device, graph)?);
            }
            self.logits = Some(prefilled.logits);
            self.clock = StepClock::new(&self.device, rows.len())?;
            self.rows = rows;
            return Ok(());
        }
        let (joining, vocab) = (rows.len(), prefilled.logits.dim(1)?);
        self.rows.extend(rows);
        self.logits = Some(match self.logits.take() {
            Some(running) => Tensor::cat(&[&running, &prefilled.logits], 0)?,
            None => prefilled.logits,
        });
        let reserve = self.rows.iter().map(room).max().unwrap_or(0);
        if self.stepping == Stepping::Shrink {
            return Ok(self.cache.join(prefilled.cache, reserve)?);
        }
        let new_rows = &self.rows[self.rows.len() - joining..];
        let needed = new_rows.iter().map(room).max().unwrap_or(0);
        let placed = match &mut self.fixed {
            Some(fixed) => fixed.place(&mut self.cache, &prefilled.cache, joining, needed)?,
            None => false,
        };
        match placed {
            true => Ok(()),
            false => self.remake_open(prefilled.cache, vocab, reserve),
        }
    }

    /// Makes a server's fixed batch again around the rows decoding and
    /// those of `joining` (prefilled, after them): its places the next
    /// power of two, its slots what its rows need (`reserve` more steps)
    /// and as many again, for rows to come.
    fn remake_open(&mut self, joining: KvCache, vocab: usize, reserve: usize) -> Result<()> {
        let mut cache = std::mem::replace(&mut self.cache, self.net.new_cache());
        if let Some(fixed) = self.fixed.take() {
            cache.unfix()?;
            cache.select_rows(fixed.live())?;
        }
        cache.join(joining, 0)?;
        cache.trim_front(TRIM_SLOTS)?;
        let (rows, places) = (self.rows.len(), self.rows.len().next_power_of_two());
        cache.pad_rows(places - rows)?;
        cache.reserve(2 * reserve);
        let graph = self.stepping == Stepping::Graph;
        self.fixed = Some(FixedBatch::open(places, rows, vocab, &mut cache, &self.device, graph)?);
        self.cache = cache;
        Ok(())
    }

    /// With fixed stepping, the batch's rows (finished or not) and the
    /// steps its cache's slots still hold.
    pub fn fixed_size(&self) -> Option<(usize, usize)> {
        Some((self.fixed.as_ref()?.rows(), self.cache.slots_left()?))
    }

    /// [`prefill`](Self::prefill) and [`join`](Self::join).
    pub fn admit(&mut self, rows: Vec<DecodeRow<R>>) -> Result<()> {
        let started = std::time::Instant::now();
        let prefilled = self.prefill(&rows)?;
        self.join(rows, prefilled)?;
        match &mut self.clock {
            Some(clock) => clock.prefilled(started),
            None => Ok(()),
        }
    }

    /// Picks every row's next token with its own settings and generator,
    /// appends it, and asks `verdict` (given the row, the pick and the
    /// step's (rows, V) logits with the row's index in them) whether the row
    /// goes on; then computes the next logits of those that do. Returns how
    /// many tokens were picked. If `verdict` fails, the rows that had not
    /// left are still in the batch, for `drain`.
    pub fn step(
        &mut self,
        mut verdict: impl FnMut(&mut DecodeRow<R>, &Pick, &Tensor, usize) -> Result<Verdict>,
    ) -> Result<usize> {
        let Some(logits) = self.logits.take() else { return Ok(0) };
        self.mark(Mark::PicksStart)?;
        let picks = match self.sampler {
            Sampler::Host => pick_rows(&logits, &mut self.rows, |row, row_logits, scratch| {
                let seen = row.prompt.iter().chain(&row.tokens).copied();
                row.sampling.pick_penalized(row_logits, seen, row.repetition_penalty, &mut row.rng, scratch)
            })?,
            Sampler::Race => self.race(&logits)?,
        };
        self.mark(Mark::PicksEnd)?;
        let produced = picks.len();
        let mut keep: Vec<u32> = Vec::with_capacity(produced);
        let mut still = Vec::with_capacity(produced);
        let mut rows = std::mem::take(&mut self.rows).into_iter().zip(picks).enumerate();
        while let Some((i, (mut row, pick))) = rows.next() {
            row.tokens.push(pick.token);
            match verdict(&mut row, &pick, &logits, i) {
                Ok(Verdict::Continues) => {
                    keep.push(i as u32);
                    still.push(row);
                }
                Ok(Verdict::Leaves) => {}
                // The rows that have not left stay, so that the caller can
                // tell their clients (`drain`); the batch cannot step again.
                Err(e) => {
                    still.push(row);
                    still.extend(rows.map(|(_, (row, _))| row));
                    self.rows = still;
                    return Err(e);
                }
            }
        }
        self.rows = still;
        if self.rows.is_empty() {
            self.cache = self.net.new_cache();
            self.fixed = None;
            if let Some(clock) = self.clock.take() {
                clock.report()?;
            }
            return Ok(produced);
        }
        let tokens: Vec<u32> = self.rows.iter().map(|r| *r.tokens.last().unwrap_or(&0)).collect();
        let positions: Vec<u32> = self.rows.iter().map(|r| (r.prompt.len() + r.tokens.len() - 1) as u32).collect();
        self.mark(Mark::ForwardStart)?;
        if let Some(fixed) = &mut self.fixed {
            self.logits = Some(fixed.step(self.net, &mut self.cache, &keep, &tokens, &positions)?);
            self.mark(Mark::ForwardEnd)?;
            return Ok(produced);
        }
        if keep.len() < produced {
            self.cache.select_rows(&keep)?;
            if self.open {
                self.cache.trim_front(TRIM_SLOTS)?;
            }
        }
        let step = Inputs::step(&tokens, &positions, &self.device)?;
        self.logits = Some(self.net.logits_to_sample(&step, Some(&mut self.cache))?.squeeze(1)?);
        self.mark(Mark::ForwardEnd)?;
        Ok(produced)
    }
}

impl<R> Decoding<'_, R> {
    /// Records `mark` on the batch's clock, if it has one.
    fn mark(&mut self, mark: Mark) -> Result<()> {
        match &mut self.clock {
            Some(clock) => clock.mark(mark),
            None => Ok(()),
        }
    }

    /// Every row's pick by the race, where the logits lie; the seen bits
    /// go along only when some row has a repetition penalty.
    fn race(&self, logits: &Tensor) -> Result<Vec<Pick>> {
        let draws: Vec<RaceRow> =
            self.rows.iter().map(|r| RaceRow::new(&r.sampling, r.repetition_penalty, &r.rng, r.tokens.len())).collect();
        let seen = match self.rows.iter().any(|r| r.repetition_penalty != 1.0) {
            false => None,
            true => {
                let rows = self.rows.iter().map(|r| r.prompt.iter().chain(&r.tokens));
                let (bits, width) = race::seen_bits(rows, logits.dim(1)?);
                Some(Tensor::from_vec(bits, (self.rows.len(), width), logits.device())?)
            }
        };
        race::pick(logits, &draws, seen.as_ref())
    }
}

/// The decoding steps a row may still take (its last sampled token is
/// never fed back).
fn room<R>(row: &DecodeRow<R>) -> usize {
    row.max_tokens.saturating_sub(row.tokens.len() + 1)
}

/// Runs `pick` on each row with its row of the (B, V) logits, in parallel
/// (rows sample independently, each with its own generator), reading the
/// logits in place when they are on the CPU.
fn pick_rows<R: Send>(
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
            copied = logits.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
            &copied
        }
    };
    Ok(rows
        .par_iter_mut()
        .zip(host.par_chunks(vocab))
        .map_init(Scratch::default, |scratch, (row, row_logits)| pick(row, row_logits, scratch))
        .collect())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// A verdict that fails leaves the rows that had not left in the
    /// batch, so that the caller can tell their clients; the rows after it
    /// are not asked.
    #[test]
    fn a_failing_verdict_keeps_the_rows_that_had_not_left() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gpt_neox-causal");
        let model = crate::model::Model::load(&dir, &Device::Cpu).unwrap();
        let mut batch = Decoding::open(model.frozen(), &Device::Cpu, Sampler::Host, Stepping::Shrink);
        let prompt: Arc<[u32]> = Arc::from(vec![1u32, 2, 3]);
        let row = |client: usize| DecodeRow {
            prompt: prompt.clone(),
            sampling: Sampling::Greedy,
            repetition_penalty: 1.0,
            rng: Rng::new(client as u64),
            max_tokens: 8,
            tokens: Vec::new(),
            client,
        };
        let rows: Vec<DecodeRow<usize>> = (0..4).map(row).collect();
        let prefilled = batch.prefill(&rows).unwrap();
        batch.join(rows, prefilled).unwrap();
        let stepped = batch.step(|row, _, _, _| match row.client {
            0 => Ok(Verdict::Continues),
            1 => Ok(Verdict::Leaves),
            2 => Err(Error::Invalid("the client's text could not be decoded".into())),
            _ => panic!("a row after the failed one was asked"),
        });
        assert!(stepped.is_err());
        let kept: Vec<usize> = batch.drain().iter().map(|r| r.client).collect();
        assert_eq!(kept, [0, 2, 3]);
    }
}
