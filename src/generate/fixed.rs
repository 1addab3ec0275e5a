//! Fixed stepping: every decoding step launches the same kernels on the
//! same buffers, so that on a GPU the step can be recorded once as a CUDA
//! graph and replayed, one launch a token instead of several hundred. The
//! cache's slots are fixed at their final number ([`KvCache::fix_slots`]);
//! the step's tokens, positions and the slot it writes lie in one device
//! buffer refreshed before each step; rows that finish stay in the batch,
//! their results unread. A closed batch is compacted to its live rows once
//! at most half of it decodes (and, on a GPU, recorded again at that size).
//! A server's batch has a power of two of places: a row that joins takes
//! the place of one that left, its prefilled keys and values written into
//! the buffers the recording reads ([`KvCache::place`]), so that rows come
//! and go without a new recording; it is made again (and recorded again)
//! only when the rows outgrow its places or its slots.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::model::{Inputs, KvCache, Network};

/// Picks how a batch steps (a closed one, and a server's): `shrink` (the
/// CPU's default: a finished row leaves the batch at once, and each step's
/// work is launched anew),
/// `fixed` (this module, launched from the host) or `graph` (the GPU's
/// default: fixed, each step a replay of a CUDA graph recorded at the
/// batch's size; on the CPU, where there is nothing to record, the same as
/// `fixed`; where a step cannot be recorded, it is launched from the host).
pub const DECODE_STEP_VAR: &str = "RLOO_DECODE_STEP";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stepping {
    Shrink,
    Fixed,
    Graph,
}

impl Stepping {
    /// `RLOO_DECODE_STEP`, when unset `graph` on a GPU and `shrink`
    /// elsewhere; any other value is an error.
    pub fn from_env(device: &Device) -> Result<Self> {
        let choices = match device.is_cuda() {
            true => ["graph", "shrink", "fixed"],
            false => ["shrink", "fixed", "graph"],
        };
        Ok(match crate::model::device::variant(DECODE_STEP_VAR, &choices).map_err(Error::Invalid)? {
            "fixed" => Self::Fixed,
            "graph" => Self::Graph,
            _ => Self::Shrink,
        })
    }
}

/// This process's recordings of decoding steps: how many were recorded
/// as CUDA graphs, how many could not be (their batches' steps then
/// launched from the host) and the last one's cause. `rloo check` reads it
/// to say whether a model's steps were recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recordings {
    pub recorded: usize,
    pub failed: usize,
    pub cause: Option<String>,
}

static RECORDINGS: std::sync::Mutex<Recordings> =
    std::sync::Mutex::new(Recordings { recorded: 0, failed: 0, cause: None });

/// The recordings so far.
pub fn recordings() -> Recordings {
    RECORDINGS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Counts one recording, failed with `cause` or not.
#[cfg(feature = "cuda")]
fn tally(cause: Option<String>) {
    let mut r = RECORDINGS.lock().unwrap_or_else(|e| e.into_inner());
    match cause {
        None => r.recorded += 1,
        Some(cause) => (r.failed, r.cause) = (r.failed + 1, Some(cause)),
    }
}

/// A batch's rows on the device, finished or not, and how its steps are
/// launched.
pub struct FixedBatch {
    /// u32 (2B + 1): each batch row's token, each row's position, then the
    /// cache slot the step writes. `inputs` and the cache's slot are views
    /// of it, so every step reads them where the first one did.
    staging: Tensor,
    /// What `staging` is set to before each step.
    host: Vec<u32>,
    inputs: Inputs,
    /// The batch row (place) of each row still decoding, in order.
    live: Vec<u32>,
    /// Words in the vocabulary: the logits are (B, V).
    vocab: usize,
    launch: Launch,
    /// A server's batch: rows join it in the places of rows that left
    /// ([`place`](Self::place)), and it is compacted to a power of two
    /// once at most a quarter of its places decode, not at half, so that
    /// a batch whose rows come and go keeps its size (and its recording).
    open: bool,
}

/// How a step's work reaches the device.
enum Launch {
    /// Op by op from the host.
    Host,
    /// The first step at this size: launched from the host, with candle
    /// keeping the kernel parameters it uploads, so that recording finds
    /// them on the device (a recorded step may not upload).
    #[cfg(feature = "cuda")]
    WarmUp,
    /// The next step is recorded, then replayed; its logits are in the
    /// warm-up's dtype.
    #[cfg(feature = "cuda")]
    Record(candle_core::DType),
    #[cfg(feature = "cuda")]
    Replay(super::graph::StepGraph),
}

impl FixedBatch {
    /// Fixes `cache`'s slots for a closed batch of `rows` rows decoding
    /// from logits over `vocab` words; `graph` records the steps where
    /// `device` is a GPU.
    pub fn new(rows: usize, vocab: usize, cache: &mut KvCache, device: &Device, graph: bool) -> Result<Self> {
        Self::build(rows, rows, vocab, cache, (device, graph), false)
    }

    /// The same for a server's batch of `places` rows, the first `live` of
    /// which decode (the rest are places for rows to come).
    pub fn open(
        places: usize,
        live: usize,
        vocab: usize,
        cache: &mut KvCache,
        device: &Device,
        graph: bool,
    ) -> Result<Self> {
        Self::build(places, live, vocab, cache, (device, graph), true)
    }

    fn build(
        rows: usize,
        live: usize,
        vocab: usize,
        cache: &mut KvCache,
        (device, graph): (&Device, bool),
        open: bool,
    ) -> Result<Self> {
        let staging = Tensor::zeros(2 * rows + 1, DType::U32, device)?;
        let inputs = Inputs {
            ids: staging.narrow(0, 0, rows)?.reshape((rows, 1))?,
            mask: Tensor::ones((rows, 1), DType::F32, device)?,
            positions: staging.narrow(0, rows, rows)?.reshape((rows, 1))?,
            segments: None,
            real_runs: None,
        };
        cache.fix_slots(staging.narrow(0, 2 * rows, 1)?)?;
        let launch = match graph && device.is_cuda() {
            #[cfg(feature = "cuda")]
            true => Launch::WarmUp,
            _ => Launch::Host,
        };
        let (host, live) = (vec![0; 2 * rows + 1], (0..live as u32).collect());
        Ok(Self { staging, host, inputs, live, vocab, launch, open })
    }

    /// B: the batch's rows, finished or not.
    pub fn rows(&self) -> usize {
        self.host.len() / 2
    }

    /// The place of each row still decoding, in order.
    pub fn live(&self) -> &[u32] {
        &self.live
    }

    /// Places no decoding row holds, in order.
    fn free(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.rows() as u32).filter(|place| !self.live.contains(place))
    }

    /// Takes the `rows` rows of `prefilled` (a cache of their own slots,
    /// whose rows join the decoding ones after them) into free places of
    /// `cache`, if there are enough, their slots fit before the slot the
    /// next step writes and the buffers hold `room` more steps; otherwise
    /// changes nothing and says so.
    pub fn place(&mut self, cache: &mut KvCache, prefilled: &KvCache, rows: usize, room: usize) -> Result<bool> {
        let places: Vec<u32> = self.free().take(rows).collect();
        let before_slot = cache.fixed_slot().is_some_and(|slot| prefilled.len() <= slot);
        if places.len() < rows || !before_slot || cache.slots_left().is_none_or(|left| left < room) {
            return Ok(false);
        }
        for (from, &place) in places.iter().enumerate() {
            cache.place(place as usize, prefilled, from)?;
        }
        self.live.extend(places);
        Ok(true)
    }

    /// The places the batch keeps when it is compacted, and how many it
    /// then has; None while it is not.
    fn compacted(&self) -> Option<(Vec<u32>, usize)> {
        let (live, rows) = (self.live.len(), self.rows());
        let size = match self.open {
            false if 2 * live <= rows => live,
            true if 4 * live <= rows && rows > 1 => live.next_power_of_two(),
            _ => return None,
        };
        Some((self.live.iter().copied().chain(self.free().take(size - live)).collect(), size))
    }

    /// One step for the rows `kept` (indices among those that decoded last
    /// step, then those placed since) with their newest tokens and
    /// positions: compacts the batch when few of it still decode, then
    /// runs the step and gives the decoding rows' logits (rows, V), in
    /// order.
    pub fn step(
        &mut self,
        net: &Network,
        cache: &mut KvCache,
        kept: &[u32],
        tokens: &[u32],
        positions: &[u32],
    ) -> Result<Tensor> {
        self.live = kept.iter().map(|&i| self.live[i as usize]).collect();
        let device = self.staging.device().clone();
        if let Some((places, size)) = self.compacted() {
            cache.select_rows(&places)?;
            let graph = !matches!(self.launch, Launch::Host);
            *self = Self::build(size, self.live.len(), self.vocab, cache, (&device, graph), self.open)?;
        }
        let rows = self.rows();
        for ((&at, &token), &position) in self.live.iter().zip(tokens).zip(positions) {
            self.host[at as usize] = token;
            self.host[rows + at as usize] = position;
        }
        let Some(slot) = cache.fixed_slot() else {
            return Err(Error::Invalid("the cache's slots are not fixed".into()));
        };
        self.host[2 * rows] = slot as u32;
        self.staging.slice_set(&Tensor::from_slice(&self.host, self.host.len(), &device)?, 0, 0)?;
        let logits = self.forward(net, cache)?;
        // Every place decoding, in order (a server's rows may hold every place in another).
        if self.live.iter().copied().eq(0..rows as u32) {
            return Ok(logits);
        }
        let at = Tensor::from_slice(&self.live, self.live.len(), &device)?;
        Ok(logits.index_select(&at, 0)?)
    }

    fn forward(&mut self, net: &Network, cache: &mut KvCache) -> Result<Tensor> {
        let launched = |inputs: &Inputs, cache: &mut KvCache| -> Result<Tensor> {
            Ok(net.logits_to_sample(inputs, Some(cache))?.squeeze(1)?)
        };
        match &mut self.launch {
            Launch::Host => launched(&self.inputs, cache),
            #[cfg(feature = "cuda")]
            Launch::WarmUp => {
                let logits = super::graph::keeping_uploads(self.staging.device(), || launched(&self.inputs, cache))?;
                self.launch = Launch::Record(logits.dtype());
                Ok(logits)
            }
            #[cfg(feature = "cuda")]
            &mut Launch::Record(dtype) => {
                let shape = (self.rows(), self.vocab);
                match super::graph::StepGraph::record(self.staging.device(), shape, dtype, || {
                    launched(&self.inputs, cache)
                }) {
                    Ok(graph) => {
                        tally(None);
                        let logits = graph.replay()?;
                        self.launch = Launch::Replay(graph);
                        Ok(logits)
                    }
                    // A step that cannot be recorded (a head size the decoding kernels do
                    // not take, say) counted no slot: it runs from the host, as do the rest.
                    Err(e) => {
                        tally(Some(e.to_string()));
                        super::graph::unrecorded(&e);
                        self.launch = Launch::Host;
                        launched(&self.inputs, cache)
                    }
                }
            }
            #[cfg(feature = "cuda")]
            Launch::Replay(graph) => {
                let logits = graph.replay()?;
                // The recorded pass counted its slot once, when it was recorded.
                cache.advance(1);
                Ok(logits)
            }
        }
    }
}
