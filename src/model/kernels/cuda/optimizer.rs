//! The optimizer's launches: AdamW per parameter and over many in one
//! launch (`adamw.cuh`, masters whole or split), the gradients' sums of
//! squares in one launch (`squares.cuh`) and the non-finite check
//! (`finite.cuh`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, Layout, Result};
use half::bf16;

use super::{addresses, blocks_for, locked, typed, view, view_mut, In};
use crate::model::kernels::{AdamWParam, AdamWStep, SplitMaster};

/// AdamW's moment update in place: `x = beta x + (1 - beta) g` (or g^2).
pub fn adamw_moment(
    x: &mut CudaStorage,
    x_l: &Layout,
    g: &CudaStorage,
    g_l: &Layout,
    beta: f32,
    squared: bool,
) -> Result<()> {
    let dev = x.device.clone();
    let gs = view::<f32>(g, g_l)?;
    let n = gs.len();
    let mut xs = view_mut::<f32>(x, x_l)?;
    let func = kernel!(dev, "adamw_moment")?;
    let sq = squared as i32;
    let mut args = func.builder();
    args.arg(&mut xs).arg(&gs).arg(&n).arg(&beta).arg(&sq);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(blocks_for(n)) }.w()?;
    Ok(())
}

/// AdamW's weight update in place from the moments.
pub fn adamw_update(w: &mut CudaStorage, w_l: &Layout, (m, m_l): In, (v, v_l): In, step: AdamWStep) -> Result<()> {
    let dev = w.device.clone();
    let (ms, vs) = (view::<f32>(m, m_l)?, view::<f32>(v, v_l)?);
    let n = ms.len();
    let mut ws = view_mut::<f32>(w, w_l)?;
    let func = kernel!(dev, "adamw_update")?;
    let (lr_step, inv_sqrt_bias2) = (step.lr / step.bias1, 1.0 / step.bias2.sqrt());
    let mut args = func.builder();
    args.arg(&mut ws).arg(&ms).arg(&vs).arg(&n).arg(&lr_step).arg(&inv_sqrt_bias2).arg(&step.eps).arg(&step.decay);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(blocks_for(n)) }.w()?;
    Ok(())
}

/// One parameter's operands in [`adamw_multi`]'s table, as `AdamWTensor`
/// in `adamw.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AdamWTensor {
    w: u64,
    low: u64,
    up: u64,
    m: u64,
    v: u64,
    g: u64,
    n: u64,
    decay: f32,
    pad: f32,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for AdamWTensor {}

/// AdamW over many parameters in one launch (`adamw_many` has checked
/// that every operand is on this GPU, contiguous and of its dtype, and the
/// masters all f32 or all split): a table of their addresses goes to the
/// device, and each parameter gets a row of blocks. The weights and
/// moments are written in place through their addresses, in the stream's
/// order like every other op.
pub fn adamw_multi(params: &[AdamWParam]) -> Result<()> {
    let Some(first) = params.first() else { return Ok(()) };
    let candle_core::Device::Cuda(dev) = first.w.device() else {
        candle_core::bail!("adamw_multi: the parameters are not on a GPU")
    };
    let stream = dev.cuda_stream();
    let moments = locked(params.iter().flat_map(|p| [p.g, &*p.m, &*p.v]));
    let (moments, moment_reads) = addresses::<f32, _>("adamw_multi", &moments, &stream)?;
    let weights = locked(params.iter().map(|p| p.w.as_tensor()));
    let splits: Vec<&SplitMaster> = params.iter().filter_map(|p| p.split).collect();
    let (lows, ups) =
        (locked(splits.iter().map(|s| s.low.as_tensor())), locked(splits.iter().map(|s| s.up.as_tensor())));
    let split = !splits.is_empty();
    let (weights, weight_reads) = match split {
        true => addresses::<bf16, _>("adamw_multi", &weights, &stream)?,
        false => addresses::<f32, _>("adamw_multi", &weights, &stream)?,
    };
    let (lows, low_reads) = addresses::<i16, _>("adamw_multi", &lows, &stream)?;
    let (ups, up_reads) = addresses::<u32, _>("adamw_multi", &ups, &stream)?;
    let table: Vec<AdamWTensor> = params
        .iter()
        .enumerate()
        .zip(moments.chunks(3))
        .map(|((i, p), a)| AdamWTensor {
            w: weights[i],
            low: lows.get(i).copied().unwrap_or(0),
            up: ups.get(i).copied().unwrap_or(0),
            m: a[1],
            v: a[2],
            g: a[0],
            n: p.w.elem_count() as u64,
            decay: p.step.decay,
            pad: 0.0,
        })
        .collect();
    let table = dev.clone_htod(&table)?;
    let s = first.step;
    let (lr_step, inv_sqrt_bias2) = (s.lr / s.bias1, 1.0 / s.bias2.sqrt());
    let longest = params.iter().map(|p| p.w.elem_count()).max().unwrap_or(1);
    let cfg = LaunchConfig {
        grid_dim: (longest.div_ceil(256).clamp(1, 1024) as u32, params.len() as u32, 1),
        // Whole warps: a split master's warp writes a word of its carries.
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let func = kernel!(dev, if split { "adamw_multi_split" } else { "adamw_multi" })?;
    let mut args = func.builder();
    args.arg(&table).arg(&s.beta1).arg(&s.beta2).arg(&lr_step).arg(&inv_sqrt_bias2).arg(&s.eps);
    // Safety: the argument list matches the kernel's signature, and the
    // table's addresses stay allocated (locked) until the launch is queued.
    unsafe { args.launch(cfg) }.w()?;
    drop((moment_reads, weight_reads, low_reads, up_reads));
    Ok(())
}

/// One tensor in [`sum_squares_multi`]'s table, as `SquaresTensor` in
/// `kernels.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SquaresTensor {
    x: u64,
    n: u64,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for SquaresTensor {}

/// Blocks summing each tensor in [`sum_squares_multi`].
const SQUARES_BLOCKS: usize = 64;

/// Each tensor's sum of squares, in f64, from one launch (`sums_of_squares`
/// has checked that every tensor is f32, contiguous and on this GPU) and
/// one read of the blocks' partial sums, added in order here.
pub fn sum_squares_multi(ts: &[&candle_core::Tensor]) -> Result<Vec<f64>> {
    let Some(first) = ts.first() else { return Ok(Vec::new()) };
    let candle_core::Device::Cuda(dev) = first.device() else {
        candle_core::bail!("sum_squares_multi: the tensors are not on a GPU")
    };
    let stream = dev.cuda_stream();
    let locked: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let (addresses, reads) = addresses::<f32, _>("sum_squares_multi", &locked, &stream)?;
    let table: Vec<SquaresTensor> =
        ts.iter().zip(addresses).map(|(t, x)| SquaresTensor { x, n: t.elem_count() as u64 }).collect();
    let table = dev.clone_htod(&table)?;
    // Safety: every element is written by the kernel.
    let mut partial = unsafe { dev.alloc::<f64>(ts.len() * SQUARES_BLOCKS) }?;
    let cfg = LaunchConfig {
        grid_dim: (SQUARES_BLOCKS as u32, ts.len() as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let func = kernel!(dev, "sum_squares_multi")?;
    let mut args = func.builder();
    args.arg(&table).arg(&mut partial);
    // Safety: the argument list matches the kernel's signature, and the
    // table's addresses stay allocated (locked) until the launch is queued.
    unsafe { args.launch(cfg) }.w()?;
    drop(reads);
    let partial = dev.clone_dtoh(&partial)?;
    Ok(partial.chunks(SQUARES_BLOCKS).map(|blocks| blocks.iter().sum()).collect())
}

/// Blocks of `non_finite` at most: enough to keep an H100's
/// multiprocessors busy, few enough flags to read back (4 KB).
const FINITE_BLOCKS: usize = 1024;

/// Whether any element of `x` (f32 or bf16) is NaN or infinite: one launch
/// over it, then one read of its blocks' flags.
pub fn any_non_finite((x, x_l): In) -> Result<bool> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In) -> Result<bool> {
        let dev = x.device.clone();
        let xs = view::<T>(x, x_l)?;
        let n = xs.len();
        let blocks = n.div_ceil(8 * 256).clamp(1, FINITE_BLOCKS);
        // Safety: every block writes its flag.
        let mut flags = unsafe { dev.alloc::<f32>(blocks) }?;
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs).arg(&n).arg(&mut flags);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok(dev.clone_dtoh(&flags)?.iter().any(|&f| f != 0.0))
    }
    by_dtype!(x.dtype(), run(&typed("non_finite", x.dtype())?, (x, x_l)))
}
