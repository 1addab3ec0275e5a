//! A decoding step's attention over the KV cache (`decode.cuh`): a block
//! per (row, head), or a lane per key with a prompt's rows or a key/value
//! head's query heads in one block, its keys split for long contexts.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Result};

use super::{from_first, multiprocessors, typed, view, In, NULL};

/// The sizes and strides of [`decode_attention`], as `DecodeDims` in
/// `kernels.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DecodeDims {
    pub h: i32,
    pub h_kv: i32,
    pub d: i32,
    /// Shared slots in front of each row's own (0 when none).
    pub p: i32,
    pub s_own: i32,
    /// The key mask's row stride, at least p + s_own.
    pub mask_row: i64,
    pub own_row: i64,
    pub own_head: i64,
    pub shared_row: i64,
    pub shared_head: i64,
    pub scale: f32,
    /// Slots per split of the keys, 0 when they are not split.
    pub chunk: i32,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for DecodeDims {}

/// What a block of the decoding kernel with a lane per key takes: query
/// heads of one key/value head, and rows that continue one shared row; and
/// whether it reads value rows packed into loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LanesBlock {
    pub heads: u32,
    pub rows: u32,
    pub packed: bool,
}

/// The blocks of the decoding kernel that [`decode_attention`] launches
/// (for `dtype`, `d` and `lanes`) which the GPU runs at once: its
/// multiprocessors times the blocks each holds, by the kernel's registers
/// and shared memory. Asked of the driver once per device and kernel, not
/// at every layer of every step.
pub fn decode_blocks_at_once(
    dev: &candle_core::CudaDevice,
    dtype: DType,
    d: usize,
    lanes: Option<LanesBlock>,
) -> Result<usize> {
    use candle_core::cuda_backend::DeviceId;
    use std::sync::Mutex;
    static AT_ONCE: Mutex<Vec<((DeviceId, String), usize)>> = Mutex::new(Vec::new());
    let key = (dev.id(), decode_kernel(dtype, d, lanes)?);
    if let Some((_, n)) = AT_ONCE.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(k, _)| *k == key) {
        return Ok(*n);
    }
    let func = kernel!(dev, &key.1)?;
    let per_multiprocessor = func.occupancy_max_active_blocks_per_multiprocessor(DECODE_THREADS, 0, None).w()?;
    let n = multiprocessors(dev)? * per_multiprocessor as usize;
    AT_ONCE.lock().unwrap_or_else(|e| e.into_inner()).push((key, n));
    Ok(n)
}

/// The name of [`decode_attention`]'s kernel.
fn decode_kernel(dtype: DType, d: usize, lanes: Option<LanesBlock>) -> Result<String> {
    let name = match lanes {
        // 32 lanes of 1, 2, 4 or 8 features cover the head.
        Some(LanesBlock { heads, rows, packed }) => {
            let values = if packed { "_packed" } else { "" };
            format!("decode_attention_lanes_{}_g{heads}_r{rows}{values}", d.div_ceil(32).next_power_of_two())
        }
        None => format!("decode_attention_{}", d / 32),
    };
    typed(&name, dtype)
}

/// Threads per (row, head) block: `DECODE_WARPS` warps in `kernels.cu`.
const DECODE_THREADS: u32 = 8 * 32;

/// A decoding step's attention (B, H, 1, D) from q, each row's own keys and
/// values (views into the cache's buffers), the shared keys, values and
/// each row's shared row, if any, and the key mask (B, S) f32. With
/// `slot_at`, (1,) u32, each row's own slots are the first `slot_at + 1`
/// rather than `a.s_own`. `lanes`: the kernel with a lane per key, taking
/// that many query heads of a key/value head and rows of a prompt per
/// block (else a warp per key, a block per query head). With `splits` > 1 each (row, head)'s keys
/// are split in `a.chunk` slots, a block each, and their parts combined by
/// a second launch.
pub fn decode_attention(
    q: In,
    (k, v): (In, In),
    shared: Option<(In, In, In)>,
    mask: In,
    slot_at: Option<In>,
    (a, splits): (DecodeDims, u32),
    lanes: Option<LanesBlock>,
) -> Result<CudaStorage> {
    #[allow(clippy::too_many_arguments)]
    fn run<T: CudaDType + DeviceRepr>(
        (name, combine): (&str, &str),
        q: In,
        (k, v): (In, In),
        shared: Option<(In, In, In)>,
        mask: In,
        slot_at: Option<In>,
        (a, splits): (DecodeDims, u32),
        queries_per_block: u32,
    ) -> Result<CudaStorage> {
        let dev = q.0.device.clone();
        let qs = view::<T>(q.0, q.1)?;
        let (ks, vs) = (from_first::<T>(k)?, from_first::<T>(v)?);
        let ms = view::<f32>(mask.0, mask.1)?;
        let shared = match shared {
            Some((sk, sv, rows)) => {
                Some((view::<T>(sk.0, sk.1)?, view::<T>(sv.0, sv.1)?, view::<u32>(rows.0, rows.1)?))
            }
            None => None,
        };
        let blocks = (qs.len() / a.d as usize) as u32;
        // Safety: every element is written by the kernels.
        let mut out = unsafe { dev.alloc::<T>(qs.len()) }?;
        let mut parts = match splits > 1 {
            true => Some(unsafe { dev.alloc::<f32>((blocks * splits) as usize * (a.d as usize + 2)) }?),
            false => None,
        };
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&qs).arg(&ks).arg(&vs);
        match &shared {
            Some((sk, sv, rows)) => args.arg(sk).arg(sv).arg(rows),
            // Without shared slots (p = 0) the kernel reads none of these.
            None => args.arg(&ks).arg(&vs).arg(&ms),
        };
        let slot_at = slot_at.map(|(s, l)| view::<u32>(s, l)).transpose()?;
        args.arg(&ms);
        match &slot_at {
            Some(slot) => args.arg(slot),
            None => args.arg(&NULL),
        };
        args.arg(&mut out);
        match &mut parts {
            Some(parts) => args.arg(parts),
            None => args.arg(&NULL),
        };
        args.arg(&a);
        let grid_dim = (blocks / queries_per_block, splits, 1);
        let cfg = LaunchConfig { grid_dim, block_dim: (DECODE_THREADS, 1, 1), shared_mem_bytes: 0 };
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        if let Some(parts) = &parts {
            let func = kernel!(dev, combine)?;
            let mut args = func.builder();
            let (splits, d) = (splits as i32, a.d);
            args.arg(parts).arg(&splits).arg(&d).arg(&mut out);
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
            // Safety: the argument list matches the kernel's signature.
            unsafe { args.launch(cfg) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let dtype = q.0.dtype();
    let (name, combine) = (decode_kernel(dtype, a.d as usize, lanes)?, typed("decode_splits", dtype)?);
    let queries_per_block = lanes.map_or(1, |l| l.heads * l.rows);
    by_dtype!(dtype, run((&name, &combine), q, (k, v), shared, mask, slot_at, (a, splits), queries_per_block))
}
