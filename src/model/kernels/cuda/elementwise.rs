//! Elementwise launches (`elementwise.cuh`, 8 elements a thread where they
//! can): activations, sums, casts, dropout, a bias added to rows, rows'
//! dot products, and an embedding table's gradient (`embedding.cuh`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};
use half::bf16;

use super::{blocks_for, by_eight, typed, view, view_mut, In};
use crate::model::kernels::Mask;

/// `act` (0 GELU, 1 GELU tanh, 2 SiLU, 3 ReLU) elementwise over `x`, or its
/// backward `g * act'(x)` when `grad` is given; in x's dtype.
pub fn activation((x, x_l): In, grad: Option<In>, act: i32) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In, grad: Option<In>, act: i32) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let xs = view::<T>(x, x_l)?;
        let n = xs.len();
        let gs = grad.map(|(g, g_l)| view::<T>(g, g_l)).transpose()?;
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs);
        if let Some(gs) = &gs {
            args.arg(gs);
        }
        args.arg(&mut out).arg(&n).arg(&act);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed(if grad.is_some() { "activation_bwd" } else { "activation_fwd" }, x.dtype())?;
    by_dtype!(x.dtype(), run(&name, (x, x_l), grad, act))
}

/// The gradient (V, H) of an embedding table of `v` rows from its lookups'
/// gradient (N, H) at `ids` (N, u32), a block per row (embedding.cuh).
pub fn embedding_grad((g, g_l): In, (ids, ids_l): In, v: usize) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (g, g_l): In, (ids, ids_l): In, v: usize) -> Result<CudaStorage> {
        let dev = g.device.clone();
        let (gs, is) = (view::<T>(g, g_l)?, view::<u32>(ids, ids_l)?);
        let n = is.len();
        let h = gs.len() / n.max(1);
        if gs.len() != n * h {
            candle_core::bail!("embedding_grad: a gradient of {} elements for {n} ids", gs.len());
        }
        // Safety: every element is written by the kernel (each row's slabs cover its columns).
        let mut out = unsafe { dev.alloc::<T>(v * h) }?;
        let func = kernel!(dev, name)?;
        let (n32, h32) = (n as i32, h as i32);
        let mut args = func.builder();
        args.arg(&gs).arg(&is).arg(&mut out).arg(&n32).arg(&h32);
        const THREADS: usize = 256;
        const COLUMNS: usize = 4; // EMBEDDING_COLUMNS
        let slabs = h.div_ceil(THREADS * COLUMNS).max(1) as u32;
        let cfg =
            LaunchConfig { grid_dim: (v as u32, slabs, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(g.dtype(), run(&typed("embedding_grad", g.dtype())?, (g, g_l), (ids, ids_l), v))
}

/// `(x + a) + b` of three contiguous inputs of one size.
pub fn sum3((x, x_l): In, (a, a_l): In, (b, b_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In, (a, a_l): In, (b, b_l): In) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let (xs, as_, bs) = (view::<T>(x, x_l)?, view::<T>(a, a_l)?, view::<T>(b, b_l)?);
        let n = xs.len();
        if as_.len() != n || bs.len() != n {
            candle_core::bail!("sum3: inputs of {n}, {} and {} elements", as_.len(), bs.len());
        }
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs).arg(&as_).arg(&bs).arg(&mut out).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(x.dtype(), run(&typed("sum3", x.dtype())?, (x, x_l), (a, a_l), (b, b_l)))
}

/// `x + a`, both contiguous, of one size and dtype.
pub fn sum2((x, x_l): In, (a, a_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In, (a, a_l): In) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let (xs, as_) = (view::<T>(x, x_l)?, view::<T>(a, a_l)?);
        let n = xs.len();
        if as_.len() != n {
            candle_core::bail!("sum2: inputs of {n} and {} elements", as_.len());
        }
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs).arg(&as_).arg(&mut out).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(x.dtype(), run(&typed("sum2", x.dtype())?, (x, x_l), (a, a_l)))
}

/// The f32 `sum` plus `g` (f32 or bf16) cast up, both contiguous, of one size.
pub fn add_cast((sum, sum_l): In, (g, g_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (sum, sum_l): In, (g, g_l): In) -> Result<CudaStorage> {
        let dev = sum.device.clone();
        let (ss, gs) = (view::<f32>(sum, sum_l)?, view::<T>(g, g_l)?);
        let n = ss.len();
        if gs.len() != n {
            candle_core::bail!("add_cast: a sum of {n} elements and a gradient of {}", gs.len());
        }
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<f32>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&ss).arg(&gs).arg(&mut out).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(g.dtype(), run(&typed("add_cast", g.dtype())?, (sum, sum_l), (g, g_l)))
}

/// `g` (f32 or bf16) cast up and added into the f32 `sum` in place, both
/// contiguous, of one size.
pub fn add_cast_into(sum: &mut CudaStorage, sum_l: &Layout, (g, g_l): In) -> Result<()> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, sum: &mut CudaStorage, sum_l: &Layout, (g, g_l): In) -> Result<()> {
        let dev = sum.device.clone();
        let gs = view::<T>(g, g_l)?;
        let mut ss = view_mut::<f32>(sum, sum_l)?;
        let n = ss.len();
        if gs.len() != n {
            candle_core::bail!("add_cast_into: a sum of {n} elements and a gradient of {}", gs.len());
        }
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&mut ss).arg(&gs).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(())
    }
    by_dtype!(g.dtype(), run(&typed("add_cast_into", g.dtype())?, sum, sum_l, (g, g_l)))
}

/// The kernel casting `from` to `to`: `widen_bf16` (bf16 to f32) or
/// `narrow_bf16` (f32 to bf16).
fn cast_kernel(from: DType, to: DType) -> Result<&'static str> {
    match (from, to) {
        (DType::BF16, DType::F32) => Ok("widen_bf16"),
        (DType::F32, DType::BF16) => Ok("narrow_bf16"),
        _ => candle_core::bail!("cast kernels take bf16 to f32 or f32 to bf16, not {from:?} to {to:?}"),
    }
}

/// Launches a cast kernel (`cast_kernel`) over `n` elements.
fn launch_cast<S: DeviceRepr, D: DeviceRepr>(
    dev: &candle_core::CudaDevice,
    name: &str,
    x: &CudaView<S>,
    y: &mut CudaViewMut<D>,
    n: usize,
) -> Result<()> {
    let func = kernel!(dev, name)?;
    let mut args = func.builder();
    args.arg(x).arg(y).arg(&n);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(by_eight(n)) }.w()?;
    Ok(())
}

/// `x` (contiguous) in `to`: bf16 to f32 or f32 to bf16, in a new buffer.
pub fn cast((x, x_l): In, to: DType) -> Result<CudaStorage> {
    let (dev, name) = (x.device.clone(), cast_kernel(x.dtype(), to)?);
    let n = x_l.shape().elem_count();
    if to == DType::F32 {
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<f32>(n) }?;
        launch_cast(&dev, name, &view::<bf16>(x, x_l)?, &mut out.slice_mut(..), n)?;
        return Ok(CudaStorage::wrap_cuda_slice(out, dev));
    }
    // Safety: as above.
    let mut out = unsafe { dev.alloc::<bf16>(n) }?;
    launch_cast(&dev, name, &view::<f32>(x, x_l)?, &mut out.slice_mut(..), n)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `x` cast to `dst`'s dtype and written over it, both contiguous, of one size.
pub fn cast_into(dst: &mut CudaStorage, dst_l: &Layout, (x, x_l): In) -> Result<()> {
    let (dev, name) = (x.device.clone(), cast_kernel(x.dtype(), dst.dtype())?);
    let n = dst_l.shape().elem_count();
    if x_l.shape().elem_count() != n {
        candle_core::bail!("cast_into: {} elements into {n}", x_l.shape().elem_count());
    }
    match dst.dtype() {
        DType::F32 => launch_cast(&dev, name, &view::<bf16>(x, x_l)?, &mut view_mut::<f32>(dst, dst_l)?, n),
        _ => launch_cast(&dev, name, &view::<f32>(x, x_l)?, &mut view_mut::<bf16>(dst, dst_l)?, n),
    }
}

/// `x * mul + add` written over the contiguous f32 `x`.
pub fn affine_in_place(x: &mut CudaStorage, x_l: &Layout, mul: f32, add: f32) -> Result<()> {
    let dev = x.device.clone();
    let mut xs = view_mut::<f32>(x, x_l)?;
    let n = xs.len();
    let func = kernel!(dev, "affine_in_place_f32")?;
    let mut args = func.builder();
    args.arg(&mut xs).arg(&n).arg(&mul).arg(&add);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(by_eight(n)) }.w()?;
    Ok(())
}

/// `x` with `mask` applied: its kept elements scaled, the others 0.
pub fn dropout((x, x_l): In, mask: &Mask) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In, mask: &Mask) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let xs = view::<T>(x, x_l)?;
        let n = xs.len();
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs).arg(&mut out).arg(&n).arg(&mask.key[0]).arg(&mask.key[1]);
        args.arg(&mask.threshold).arg(&mask.scale);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(blocks_for(n.div_ceil(4))) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(x.dtype(), run(&typed("dropout", x.dtype())?, (x, x_l), mask))
}

/// `y` (rows, n) with `b` (n,) added to every row, in y's dtype.
pub fn bias_rows((y, y_l): In, (b, b_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (y, y_l): In, (b, b_l): In) -> Result<CudaStorage> {
        let dev = y.device.clone();
        let (ys, bs) = (view::<T>(y, y_l)?, view::<T>(b, b_l)?);
        let (n, len) = (bs.len(), ys.len());
        if n == 0 || len % n != 0 {
            candle_core::bail!("bias_rows: {len} elements are not rows of the bias's {n}");
        }
        let rows = len / n;
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(len) }?;
        let func = kernel!(dev, name)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256) as u32, rows.clamp(1, 65_535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = n as i32;
        let mut args = func.builder();
        args.arg(&ys).arg(&bs).arg(&mut out).arg(&rows).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed("bias_rows", y.dtype())?;
    by_dtype!(y.dtype(), run(&name, (y, y_l), (b, b_l)))
}

/// The f32 dot product of each row of `a` and `b` (rows of `d`).
pub fn row_dots((a, a_l): In, (b, b_l): In, d: usize) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (a, a_l): In, (b, b_l): In, d: usize) -> Result<CudaStorage> {
        let dev = a.device.clone();
        let (xs, ys) = (view::<T>(a, a_l)?, view::<T>(b, b_l)?);
        if d == 0 || xs.len() != ys.len() || xs.len() % d != 0 {
            candle_core::bail!("row_dots: {} and {} elements are not rows of {d}", xs.len(), ys.len());
        }
        let rows = xs.len() / d;
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<f32>(rows) }?;
        let func = kernel!(dev, name)?;
        // 8 warps per block, a warp per row.
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(8).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let d = d as i32;
        let mut args = func.builder();
        args.arg(&xs).arg(&ys).arg(&mut out).arg(&rows).arg(&d);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed("row_dots", a.dtype())?;
    by_dtype!(a.dtype(), run(&name, (a, a_l), (b, b_l), d))
}
