//! A start-up estimate of a run's peak memory, so that a batch that cannot
//! fit is reported before the machine starts swapping or kills the run.
//! Sizes are upper bounds: every prompt as long as the longest and every
//! completion full, in the compute dtype's bytes (optimizer state,
//! gradients, logits and attention masks in f32).

use candle_core::DType;

use super::config::{BatchSizes, TrainConfig};
use crate::model::arch::Keeping;
use crate::model::scoring::PACKED_ROW_TOKENS;
use crate::model::ModelConfig;

const F32: u64 = 4;
/// Per token, what a training forward keeps beside its layers', in tensors
/// of the hidden size: the last layer's output, the final norm's (which
/// the selection of the completions' tokens keeps) and the LM head's input.
const KEPT_OUTSIDE_LAYERS: f64 = 3.0;

/// A training micro-batch as it is packed (each prompt once, its
/// completions behind it, [`crate::model::scoring::Sequences`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MicroTokens {
    /// Every token of the packed rows.
    pub tokens: u64,
    /// The longest packed row.
    pub row: u64,
}

impl MicroTokens {
    /// At most: `micro` completions of `completion` tokens after prompts of
    /// `prompt` tokens. The k completions of a prompt stand together when
    /// a mini-batch is the whole batch; then a micro-batch holds whole
    /// groups of them, or a part of one, or else may cut one at each end. A
    /// shuffled mini-batch's rows need not share a prompt.
    pub fn at_most(sizes: &BatchSizes, prompt: usize, completion: usize) -> Self {
        let (micro, k) = (sizes.micro.max(1), sizes.k.max(1));
        let share = sizes.mini / sizes.world.max(1);
        let prompts = match sizes.mini < sizes.batch {
            true => micro,
            false if micro.is_multiple_of(k) && share.is_multiple_of(k) => micro / k,
            false if k.is_multiple_of(micro) => 1,
            false => (micro.div_ceil(k) + 1).min(micro),
        };
        let per_row = micro.div_ceil(prompts.max(1)).min(k);
        let row = (prompt + per_row * completion).min(PACKED_ROW_TOKENS.max(prompt + completion));
        Self { tokens: (prompts * prompt + micro * completion) as u64, row: row as u64 }
    }
}

/// What a training forward over `micro` keeps for its backward, in bytes:
/// each layer's share ([`ModelConfig::kept_per_layer`]), or with gradient
/// checkpointing each layer's input and one layer's share, in `compute`
/// bytes; and the attention mask of each packed row: in f32, at most the
/// longest row's length per token, or each query's runs of keys, 16 bytes
/// a token (where `keeping.mask_spans`).
pub fn activation_bytes(
    model: &ModelConfig,
    keeping: Keeping,
    micro: MicroTokens,
    compute: u64,
    checkpointing: bool,
) -> (u64, u64) {
    let (h, layers) = (model.hidden_size() as f64, model.num_layers() as f64);
    let per_layer = model.kept_per_layer(keeping);
    let kept = match checkpointing {
        true => layers + per_layer,
        false => layers * per_layer,
    } + KEPT_OUTSIDE_LAYERS;
    let activations = (micro.tokens as f64 * h * kept).ceil() as u64 * compute;
    let mask = match keeping.mask_spans {
        true => micro.tokens * 16,
        false => micro.tokens * micro.row * F32,
    };
    (activations, mask)
}

#[derive(Debug)]
pub struct Estimate {
    pub parts: Vec<(&'static str, u64)>,
    /// How the activations were counted.
    pub activations: String,
}

impl Estimate {
    pub fn total(&self) -> u64 {
        self.parts.iter().map(|(_, b)| b).sum()
    }

    pub fn describe(&self) -> String {
        let parts: Vec<String> = self.parts.iter().map(|(name, b)| format!("{name} {}", gib(*b))).collect();
        format!("{} ({}); {}", gib(self.total()), parts.join(", "), self.activations)
    }
}

/// What a run's models hold, for [`rloo_estimate`].
#[derive(Debug, Clone, Copy)]
pub struct Held {
    /// The policy's parameters, and how many of them train.
    pub params: usize,
    pub trainable: usize,
    /// Whether the LM head trains (its gradient is summed over chunks).
    pub head_trains: bool,
    /// Whether a reference of its own is on the device at the training's peak.
    pub reference: bool,
    /// PPO's critic's parameters (0: none).
    pub critic_params: usize,
    /// The dtype the networks compute in.
    pub dtype: DType,
}

/// Weights, gradients, AdamW moments, the reference, the sampling KV cache,
/// the training micro-batch's activations and logits, and one scoring
/// chunk's logits.
pub fn rloo_estimate(
    cfg: &TrainConfig,
    sizes: &BatchSizes,
    (model, keeping): (&ModelConfig, Keeping),
    held: Held,
    longest_prompt: usize,
) -> Estimate {
    let Held { params, trainable, head_trains, reference, critic_params, dtype } = held;
    let (params, trainable) = (params as u64, trainable as u64);
    let compute = dtype.size_in_bytes() as u64;
    let critic = critic_params as u64;
    let (layers, vocab) = (model.num_layers() as u64, model.vocab_size() as u64);
    let chunk = cfg.generation.local_rollout_forward_batch_size.min(sizes.batch) as u64;
    // A sampling chunk's rows read their prompt's slots from one copy and
    // have their own; a chunk that is not whole prompts may start inside one.
    let k = sizes.k as u64;
    let prompts = if chunk.is_multiple_of(k) { chunk / k } else { (chunk + k - 1).div_ceil(k) };
    let slots = prompts * longest_prompt as u64 + chunk * cfg.generation.response_length as u64;
    let micro = sizes.micro as u64;
    let completion = cfg.generation.response_length as u64;
    let logits_rows =
        |rows: u64| (rows * completion).min(crate::model::kernels::logits_chunk_rows(vocab as usize) as u64);
    let packed = MicroTokens::at_most(sizes, longest_prompt, cfg.generation.response_length);
    let (saved, masks) = activation_bytes(model, keeping, packed, compute, cfg.train.gradient_checkpointing);
    let activations = format!(
        "activations: {:.1} tensors of the hidden size a layer and token{}, {} tokens a micro-batch",
        model.kept_per_layer(keeping),
        if cfg.train.gradient_checkpointing { " (one layer at a time)" } else { "" },
        packed.tokens
    );
    // In bf16 the trained parameters keep beside the copies the networks
    // compute with what the copies' rounding dropped of their f32 masters,
    // or whole f32 masters (RLOO_MASTERS=f32).
    let masters = if crate::model::kernels::masters_split(dtype).unwrap_or(false) {
        crate::model::kernels::split_master_bytes(trainable)
    } else if compute < F32 {
        trainable * F32
    } else {
        0
    };
    Estimate {
        parts: vec![
            ("weights", params * compute + masters),
            // LoRA: only the adapters have gradients and optimizer state.
            ("gradients", trainable * F32),
            ("optimizer state", 2 * trainable * F32),
            ("reference", if reference { params * compute } else { 0 }),
            // PPO's critic: weights, gradients and optimizer state, and its activations.
            ("critic", 4 * critic * F32 + if critic > 0 { saved } else { 0 }),
            ("KV cache", slots * layers * 2 * model.kv_width() as u64 * compute),
            ("activations", saved),
            ("attention masks", masks),
            // Over completion tokens, a chunk of rows at a time: a training
            // micro-batch's (kept when they fit one chunk) and their
            // gradient's, and a scoring pass's.
            ("logits", (2 * logits_rows(micro) + logits_rows(chunk)) * vocab * F32),
            // A trained LM head's gradient (not a LoRA run's, unless its
            // `modules_to_save` trains the head), summed in f32 over those
            // chunks beside one chunk's term.
            ("head gradient", if head_trains { vocab * model.hidden_size() as u64 * (F32 + compute) } else { 0 }),
        ],
        activations,
    }
}

/// The process's peak resident memory so far, in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    // Safety: a zeroed rusage is a valid value for getrusage to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // Safety: fills the local with this process's usage.
    let ok = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } == 0;
    // ru_maxrss is in kilobytes on Linux.
    ok.then(|| usage.ru_maxrss as u64 * 1024)
}

/// GPU memory tensors hold on `device` once the queued work is done, in
/// bytes (what PyTorch's `memory_allocated` counts: not the memory the
/// allocation pool keeps for later, nor the CUDA context's); None on the CPU.
pub fn device_used_bytes(device: &candle_core::Device) -> Option<u64> {
    device.synchronize().ok()?;
    #[cfg(feature = "cuda")]
    return pool_reading(
        device,
        candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
    );
    #[cfg(not(feature = "cuda"))]
    None
}

/// Memory tensors hold now, in bytes: the GPU's once its queued work is done,
/// or the CPU heap's ([`crate::heap`]).
pub fn in_use_bytes(device: &candle_core::Device) -> Option<u64> {
    match device.is_cpu() {
        true => Some(crate::heap::in_use()),
        false => device_used_bytes(device),
    }
}

/// The most GPU memory allocations have held at once since the process
/// started (the high-water mark of the device's allocation pool, which
/// every tensor comes from): what PyTorch's `max_memory_allocated` counts.
pub fn device_peak_bytes(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    return pool_reading(
        device,
        candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
    );
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

/// The most memory held at once in each phase of a step: each reading is
/// the high-water mark since the last one (of the GPU's allocation pool, or
/// on the CPU of the process's heap, [`crate::heap`]), which then starts
/// again from the memory in use.
#[derive(Debug, Default)]
pub struct PhasePeaks {
    readings: Vec<(&'static str, u64)>,
    /// The largest reading of the run, the pool's own mark being reset.
    pub most: u64,
}

impl PhasePeaks {
    /// Ends `phase` here: its peak, for [`Self::record`].
    pub fn mark(&mut self, device: &candle_core::Device, phase: &'static str) {
        if let Some(peak) = take_peak(device) {
            self.readings.push((phase, peak));
            self.most = self.most.max(peak);
        }
    }

    /// The step's readings as `memory/peak_<phase>_gib`, cleared for the next step.
    pub fn record(&mut self, metrics: &mut crate::report::Metrics) {
        for (phase, bytes) in self.readings.drain(..) {
            metrics.set(format!("memory/peak_{phase}_gib"), in_gib(bytes));
        }
    }
}

/// The device's high-water mark, then reset to the memory in use now.
fn take_peak(device: &candle_core::Device) -> Option<u64> {
    if device.is_cpu() {
        return Some(crate::heap::take_peak());
    }
    #[cfg(feature = "cuda")]
    return take_device_peak(device);
    #[cfg(not(feature = "cuda"))]
    None
}

/// The pool's high-water mark, then reset to the memory in use now.
#[cfg(feature = "cuda")]
fn take_device_peak(device: &candle_core::Device) -> Option<u64> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let peak = device_peak_bytes(device)?;
    let pool = default_pool(device)?;
    let mut zero: u64 = 0;
    // Safety: zero is the one value the driver takes for this attribute (it
    // restarts the mark from the memory in use), from a local it reads.
    unsafe {
        let high = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        sys::cuMemPoolSetAttribute(pool, high, (&mut zero as *mut u64).cast());
    }
    Some(peak)
}

/// A byte count of the device's default allocation pool; None off a GPU.
#[cfg(feature = "cuda")]
fn pool_reading(
    device: &candle_core::Device,
    attribute: candle_core::cuda_backend::cudarc::driver::sys::CUmemPool_attribute,
) -> Option<u64> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let pool = default_pool(device)?;
    let mut bytes: u64 = 0;
    // Safety: the out-pointer is a local of the type the driver writes.
    let ok = unsafe {
        sys::cuMemPoolGetAttribute(pool, attribute, (&mut bytes as *mut u64).cast()) == sys::CUresult::CUDA_SUCCESS
    };
    ok.then_some(bytes)
}

/// The device's default allocation pool; None off a GPU.
#[cfg(feature = "cuda")]
fn default_pool(device: &candle_core::Device) -> Option<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool> {
    crate::model::device::default_pool(device.as_cuda_device().ok()?)
}

/// A CPU run's memory: the start-up plan, the process's peak resident
/// memory and the most its heap held at once (over the marked phases).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostMemory {
    pub planned: Option<u64>,
    pub resident: Option<u64>,
    pub held: Option<u64>,
}

impl HostMemory {
    pub fn describe(&self) -> Option<String> {
        let resident = self.resident?;
        let held = self.held.map_or(String::new(), |h| format!(", {} held at most", gib(h)));
        let plan = self.planned.map_or(String::new(), |p| format!(" (planned at start-up: {})", gib(p)));
        Some(format!("peak memory {} resident{held}{plan}", gib(resident)))
    }
}

/// GPU memory in use at the end of each step (the first, the last and the
/// largest reading, to show whether a run grows), the peak allocated and
/// the start-up plan.
#[derive(Debug, Clone, Copy)]
pub struct DeviceMemory {
    pub first: u64,
    pub last: u64,
    pub max: u64,
    pub peak_allocated: Option<u64>,
    pub planned: Option<u64>,
}

impl DeviceMemory {
    pub fn add(seen: Option<Self>, used: u64) -> Self {
        match seen {
            None => Self { first: used, last: used, max: used, peak_allocated: None, planned: None },
            Some(m) => Self { last: used, max: m.max.max(used), ..m },
        }
    }

    pub fn describe(&self) -> String {
        let plan = self.planned.map_or(String::new(), |p| format!(" (planned at start-up: {})", gib(p)));
        let peak = self.peak_allocated.map_or(String::new(), |p| format!("; peak allocated {}{plan}", gib(p)));
        format!(
            "GPU memory in use {} after the first step, {} after the last (at most {}){peak}",
            gib(self.first),
            gib(self.last),
            gib(self.max)
        )
    }
}

/// Logs the estimate (the memory plan), as a warning when it exceeds the
/// memory available.
pub fn warn_if_short(estimate: &Estimate) {
    match available_bytes() {
        Some(available) if estimate.total() > available => tracing::warn!(
            "this run may need up to {} but {} is available; lower per_device_train_batch_size, \
             local_rollout_forward_batch_size or response_length if it runs out of memory",
            estimate.describe(),
            gib(available)
        ),
        _ => tracing::info!("memory plan: {}", estimate.describe()),
    }
}

/// `MemAvailable` of /proc/meminfo (Linux), in bytes.
fn available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Bytes in GiB, as the `memory/*_gib` metrics log them.
pub fn in_gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Bytes as GiB.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", in_gib(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// A micro-batch holds each prompt once: k completions to a prompt when
    /// the mini-batch is the whole batch (a prompt more where a micro-batch
    /// cuts the completions of one), one each when it is shuffled.
    #[test]
    fn a_micro_batch_packs_each_prompt_once() {
        let sizes = |micro: usize, mini: usize| BatchSizes {
            micro,
            mini,
            batch: 256,
            prompts_per_batch: 64,
            k: 4,
            total_episodes: 256,
            world: 1,
            steps: 1,
            optimizer_steps: 1,
        };
        let packed = |micro, mini| MicroTokens::at_most(&sizes(micro, mini), 10, 100);
        assert_eq!(packed(64, 256), MicroTokens { tokens: 16 * 10 + 64 * 100, row: 410 });
        assert_eq!(packed(6, 256), MicroTokens { tokens: 3 * 10 + 6 * 100, row: 210 });
        assert_eq!(packed(2, 256), MicroTokens { tokens: 10 + 2 * 100, row: 210 });
        assert_eq!(packed(64, 128), MicroTokens { tokens: 64 * 10 + 64 * 100, row: 110 });
    }

    /// The sampling cache holds each prompt's slots once for its k rows,
    /// and keys and values as wide as the key/value heads (Llama's fixture:
    /// 2 of 4 heads of 8 features, hidden 32).
    #[test]
    fn the_kv_cache_counts_each_prompt_once_and_the_key_value_heads() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut cfg = TrainConfig::default();
        let model = ModelConfig::from_dir(&root.join("tests/fixtures/models/llama-causal")).unwrap();
        let kv_cache = |cfg: &TrainConfig| {
            let sizes = BatchSizes::for_world(cfg, Some(64), 1).unwrap();
            let held = Held {
                params: 1000,
                trainable: 1000,
                head_trains: true,
                reference: false,
                critic_params: 0,
                dtype: DType::F32,
            };
            let estimate = rloo_estimate(cfg, &sizes, (&model, Keeping::default()), held, 20);
            estimate.parts.iter().find(|(name, _)| *name == "KV cache").unwrap().1
        };
        let (k, response) = (cfg.rloo.k as u64, cfg.generation.response_length as u64);
        let per_slot = 2 * 2 * 16 * 4; // layers x keys and values x 2 heads of 8 x f32
        cfg.generation.local_rollout_forward_batch_size = 2 * cfg.rloo.k;
        assert_eq!(kv_cache(&cfg), (2 * 20 + 2 * k * response) * per_slot);
        // A chunk that may start inside a prompt's rows holds one prompt more.
        cfg.generation.local_rollout_forward_batch_size = 2 * cfg.rloo.k + 1;
        assert_eq!(kv_cache(&cfg), (3 * 20 + (2 * k + 1) * response) * per_slot);
    }

    /// The GPT-NeoX fixture, and its plan (1,000 parameters, 400 trained,
    /// the head among them or not, a reference) as a lookup of a part's
    /// bytes by name.
    fn neox_plan(head_trains: bool, dtype: DType) -> (ModelConfig, impl Fn(&str) -> u64) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let cfg = TrainConfig::default();
        let sizes = BatchSizes::for_world(&cfg, Some(64), 1).unwrap();
        let model = ModelConfig::from_dir(&root.join("tests/fixtures/models/gpt_neox-causal")).unwrap();
        let held = Held { params: 1000, trainable: 400, head_trains, reference: true, critic_params: 0, dtype };
        let estimate = rloo_estimate(&cfg, &sizes, (&model, Keeping::default()), held, 20);
        (model, move |part: &str| estimate.parts.iter().find(|(name, _)| *name == part).unwrap().1)
    }

    #[test]
    fn bf16_halves_what_the_networks_hold_and_keeps_split_masters() {
        let ((_, f32), (_, bf16)) = (neox_plan(true, DType::F32), neox_plan(true, DType::BF16));
        // 400 weights train: their masters' low halves and a word of carries a 32.
        assert_eq!((f32("weights"), bf16("weights")), (4000, 2000 + 400 * 2 + 13 * 4));
        assert_eq!((f32("reference"), bf16("reference")), (4000, 2000));
        for halved in ["KV cache", "activations"] {
            assert_eq!(f32(halved), 2 * bf16(halved), "{halved}");
        }
        for same in ["gradients", "optimizer state", "logits", "attention masks"] {
            assert_eq!(f32(same), bf16(same), "{same}");
        }
    }

    /// A trained LM head's gradient: its f32 sum over the chunks of logits
    /// and one chunk's term in the compute dtype; none for a frozen head.
    #[test]
    fn a_trained_head_counts_its_gradient_over_the_chunks() {
        let head = |trains: bool| neox_plan(trains, DType::BF16).1("head gradient");
        let (model, _) = neox_plan(true, DType::BF16);
        let (v, h) = (model.vocab_size() as u64, model.hidden_size() as u64);
        assert_eq!((head(true), head(false)), (v * h * (4 + 2), 0));
    }
}
