//! Products of few rows (`rows_gemm.cuh`, `RLOO_GEMM=rows`): a decoding
//! step's, which cuBLAS's tiles would not spread over the GPU, split along
//! k so that every multiprocessor takes a block.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Result};
use half::bf16;

use super::{allow_shared_memory, multiprocessors, on_16, view, In, NULL};

/// The sizes of a product of [`rows_product`], as `RowsGemmDims` in `rows_gemm.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RowsGemmDims {
    m: i32,
    n: i32,
    k: i32,
    splits: i32,
    /// The activation of x (`Activation`'s order), -1 for none.
    act: i32,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for RowsGemmDims {}

/// A block's tile of the rows kernel (rows, outputs), its chunk of k, and
/// its shared memory (three stages of both tiles' chunks, rows padded by 8).
const ROWS_TILE: (usize, usize) = (128, 64);
const ROWS_CHUNK: usize = 32;
const ROWS_SMEM: usize = 3 * (ROWS_TILE.0 + ROWS_TILE.1) * (ROWS_CHUNK + 8) * 2;
/// The fewest chunks of k a slice takes.
const ROWS_SLICE_CHUNKS: usize = 4;

/// The slices of k [`rows_product`] takes `x (rows, k) @ w^T` in, or None
/// where it does not take it: operands not bf16, rows not on 16 bytes, w
/// not a row-major (n, k), or more tiles than the GPU has multiprocessors
/// (a large product, which cuBLAS's large tiles serve better: the rows
/// kernel's small ones read x again for every 64 outputs).
pub fn rows_splits(x: In, w: In, (rows, k, n): (usize, usize, usize)) -> Result<Option<usize>> {
    let bf16 = x.0.dtype() == DType::BF16 && w.0.dtype() == DType::BF16;
    let row_major = w.1.is_contiguous() && w.1.dims() == [n, k];
    if !(bf16 && row_major && k.is_multiple_of(8) && on_16(x) && on_16(w)) || rows == 0 || n == 0 {
        return Ok(None);
    }
    let tiles = rows.div_ceil(ROWS_TILE.0) * n.div_ceil(ROWS_TILE.1);
    let multiprocessors = multiprocessors(&x.0.device)?;
    if tiles > multiprocessors {
        return Ok(None);
    }
    // Slices enough for a block on every multiprocessor, each of a few chunks.
    let most = (k.div_ceil(ROWS_CHUNK) / ROWS_SLICE_CHUNKS).max(1);
    Ok(Some(multiprocessors.div_ceil(tiles).min(most)))
}

/// `act(x) (rows, k) @ w^T (+ b)` (x itself without `act`) in bf16 by the
/// rows kernel (`rows_gemm.cuh`), for x contiguous, w a row-major (n, k)
/// and b (n,); None where [`rows_splits`] says it does not take the product.
pub fn rows_product(
    x: In,
    act: Option<crate::model::ops::Activation>,
    w: In,
    b: Option<In>,
    (rows, k, n): (usize, usize, usize),
) -> Result<Option<CudaStorage>> {
    let Some(splits) = rows_splits(x, w, (rows, k, n))? else { return Ok(None) };
    if b.is_some_and(|b| b.0.dtype() != DType::BF16) {
        return Ok(None);
    }
    let dev = x.0.device.clone();
    let (xs, weights) = (view::<bf16>(x.0, x.1)?, view::<bf16>(w.0, w.1)?);
    let bs = b.map(|(b, b_l)| view::<bf16>(b, b_l)).transpose()?;
    let grid = (rows.div_ceil(ROWS_TILE.0), n.div_ceil(ROWS_TILE.1));
    // Safety: the kernel writes every element of y; it reads only the sums
    // its blocks wrote of the workspace.
    let mut y = unsafe { dev.alloc::<bf16>(rows * n) }?;
    let mut sums = unsafe { dev.alloc::<f32>(if splits > 1 { splits * rows * n } else { 1 }) }?;
    let mut counts = dev.alloc_zeros::<u32>(grid.0 * grid.1)?;
    let cfg = LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, splits as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: ROWS_SMEM as u32,
    };
    let func = kernel!(dev, "rows_gemm_bf16")?;
    allow_shared_memory(&func, &cfg)?;
    let act = act.map_or(-1, |a| a as i32);
    let dims = RowsGemmDims { m: rows as i32, n: n as i32, k: k as i32, splits: splits as i32, act };
    let mut args = func.builder();
    args.arg(&xs).arg(&weights);
    match &bs {
        Some(b) => args.arg(b),
        None => args.arg(&NULL),
    };
    args.arg(&mut y).arg(&mut sums).arg(&mut counts).arg(&dims);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(cfg) }.w()?;
    Ok(Some(CudaStorage::wrap_cuda_slice(y, dev)))
}
