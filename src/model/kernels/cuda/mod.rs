//! Launches the CUDA kernels of `kernels.cu` (compiled by the build script
//! into a fatbin: machine code for the build's GPU, PTX for later ones) for
//! the ops beside this module: their `cuda_fwd` hooks call these. A module
//! here for each family of kernels, beside this one's helpers. Inputs are
//! read where they lie (contiguous views), outputs are new buffers on the
//! inputs' stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaView, CudaViewMut, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};

pub mod gemm;

const KERNELS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));

/// The kernel `$name` on device `$dev`, its module loaded once per device.
macro_rules! kernel {
    ($dev:expr, $name:expr) => {
        $dev.get_or_load_custom_func_image($name, "rloo", $crate::model::kernels::cuda::KERNELS)
    };
}

/// An input: its storage and where its elements lie.
pub(crate) type In<'a> = (&'a CudaStorage, &'a Layout);

/// The contiguous elements of an input.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(s.as_cuda_slice::<T>()?.slice(start..end)),
        None => candle_core::bail!("CUDA kernel: input of shape {:?} is not contiguous", l.dims()),
    }
}

/// The elements of an input from its first on, for a kernel that walks it
/// by its own strides, which may leave gaps (a cache's spare slots, the
/// other heads of a fused projection).
fn from_first<'a, T: CudaDType>((s, l): In<'a>) -> Result<CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

/// A null pointer, for a kernel's optional pointer argument.
const NULL: u64 = 0;

/// One block per row of `width` elements: a multiple of 32 threads, at most 1024.
fn per_row(rows: usize, width: usize) -> LaunchConfig {
    let threads = (width.div_ceil(32) * 32).clamp(32, 1024) as u32;
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// A warp a row, `NORM_WARPS` (norms.cuh) rows a block.
fn warp_rows(rows: usize) -> LaunchConfig {
    const NORM_WARPS: usize = 8;
    LaunchConfig {
        grid_dim: (rows.div_ceil(NORM_WARPS).max(1) as u32, 1, 1),
        block_dim: (32 * NORM_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Enough blocks of 256 threads for `n` elements, striding beyond 65536 blocks.
fn blocks_for(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// A thread per 8 of `n` elements, for the kernels of `elementwise.cuh`.
fn by_eight(n: usize) -> LaunchConfig {
    blocks_for(n.div_ceil(8))
}

/// `$run::<f32>(..)` or `$run::<bf16>(..)` by `$dtype` (after [`typed`]
/// has refused any other dtype).
macro_rules! by_dtype {
    ($dtype:expr, $run:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            candle_core::DType::F32 => $run::<f32>($($arg),*),
            _ => $run::<half::bf16>($($arg),*),
        }
    };
}

/// The name of `kernel`'s instance for `dtype`: `<kernel>_f32` or `<kernel>_bf16`.
fn typed(kernel: &str, dtype: DType) -> Result<String> {
    match dtype {
        DType::F32 => Ok(format!("{kernel}_f32")),
        DType::BF16 => Ok(format!("{kernel}_bf16")),
        other => candle_core::bail!("CUDA kernels take f32 or bf16, not {other:?}"),
    }
}

/// Whether an input's first element lies on 16 bytes (its buffer does: the
/// pool's allocations are aligned far beyond), for kernels that move 16
/// bytes a load.
fn on_16((s, l): In) -> bool {
    (l.start_offset() * s.dtype().size_in_bytes()).is_multiple_of(16)
}

/// The contiguous elements of an in-place operand.
fn view_mut<'a, T: CudaDType>(s: &'a mut CudaStorage, l: &Layout) -> Result<CudaViewMut<'a, T>> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(s.as_cuda_slice_mut::<T>()?.slice_mut(start..end)),
        None => candle_core::bail!("CUDA kernel: in-place operand of shape {:?} is not contiguous", l.dims()),
    }
}

/// The device addresses of the first elements of locked tensors of `T`,
/// for kernels that take operands by address (a table of them, or buffers
/// written in place); the guards keep the stream's order of their uses and
/// must live until the launch is queued.
fn addresses<'a, T: CudaDType + 'a, G: std::ops::Deref<Target = candle_core::Storage>>(
    op: &str,
    locked: &'a [(G, &'a Layout)],
    stream: &'a std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
) -> Result<(Vec<u64>, Vec<candle_core::cuda_backend::cudarc::driver::SyncOnDrop<'a>>)> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let mut addresses = Vec::with_capacity(locked.len());
    let mut reads = Vec::with_capacity(locked.len());
    for (storage, layout) in locked {
        let candle_core::Storage::Cuda(s) = &**storage else { candle_core::bail!("{op}: an operand is not on a GPU") };
        let Some((start, _)) = layout.contiguous_offsets() else {
            candle_core::bail!("{op}: an operand is not contiguous")
        };
        let (address, read) = s.as_cuda_slice::<T>()?.device_ptr(stream);
        addresses.push(address + (std::mem::size_of::<T>() * start) as u64);
        reads.push(read);
    }
    Ok((addresses, reads))
}

/// The storages of `ts`, locked, and their layouts, for [`addresses`].
fn locked<'a>(
    ts: impl IntoIterator<Item = &'a candle_core::Tensor>,
) -> Vec<(impl std::ops::Deref<Target = candle_core::Storage> + 'a, &'a Layout)> {
    ts.into_iter().map(|t| t.storage_and_layout()).collect()
}

/// Lets `func` take `cfg`'s shared memory (above the 48 KiB a kernel gets
/// unasked).
fn allow_shared_memory(func: &CudaFunction, cfg: &LaunchConfig) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
    if cfg.shared_mem_bytes > 48 * 1024 {
        let attribute = CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        func.set_attribute(attribute, cfg.shared_mem_bytes as i32).w()?;
    }
    Ok(())
}

/// The device's multiprocessors, asked of the driver once per device.
fn multiprocessors(dev: &candle_core::CudaDevice) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    use candle_core::cuda_backend::DeviceId;
    use std::sync::Mutex;
    static KNOWN: Mutex<Vec<(DeviceId, usize)>> = Mutex::new(Vec::new());
    if let Some((_, n)) = KNOWN.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(id, _)| *id == dev.id()) {
        return Ok(*n);
    }
    let context = dev.cuda_stream().context().clone();
    let n = context.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()? as usize;
    KNOWN.lock().unwrap_or_else(|e| e.into_inner()).push((dev.id(), n));
    Ok(n)
}

// After the macros, which they use.
mod attention;
mod decode;
mod elementwise;
mod heads;
mod logits;
mod norms;
mod optimizer;
mod rows_gemm;

pub use attention::{
    attention_bwd, attention_fwd, qkv_attention_fwd, tensor_attention_fits, AttnDims, AttnInputs, MaskIn,
};
pub use decode::{decode_attention, decode_blocks_at_once, DecodeDims, LanesBlock};
pub use elementwise::{
    activation, add_cast, add_cast_into, affine_in_place, bias_rows, cast, cast_into, dropout, embedding_grad,
    row_dots, sum2, sum3,
};
pub use gemm::{add_product, linear_bias_epilogue};
pub use heads::{heads_merge, heads_split, rotary, rotary_append, AppendDims, HeadsDims};
pub use logits::{race_pick, token_logprobs, token_logprobs_grad};
pub use norms::{layer_norm_pair, norm_bwd, norm_fwd};
pub use optimizer::{adamw_moment, adamw_multi, adamw_update, any_non_finite, sum_squares_multi};
pub use rows_gemm::{rows_product, rows_splits};
