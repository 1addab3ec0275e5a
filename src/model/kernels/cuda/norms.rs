//! The norms' launches (`norms.cuh`): a LayerNorm's or an RMSNorm's
//! forward a warp a row, in 16-byte loads where the rows allow, two
//! LayerNorms of the same rows in one launch, and the backward.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, Layout, Result};

use super::{on_16, typed, view, warp_rows, In};

/// A norm's forward: `x` (N, H) with its per-feature `params` (weight, and
/// bias for LayerNorm), in x's dtype.
pub fn norm_fwd(kernel: &str, x: &CudaStorage, x_l: &Layout, params: &[In], eps: f32) -> Result<CudaStorage> {
    let h = params.first().map_or(0, |(_, l)| l.shape().elem_count());
    let name = match norm_chunks_held(h, std::iter::once((x, x_l)).chain(params.iter().copied())) {
        Some(c) => format!("{kernel}_wide{c}"),
        None => kernel.to_string(),
    };
    by_dtype!(x.dtype(), norm_fwd_as(&typed(&name, x.dtype())?, x, x_l, params, &[eps]))
}

/// Two LayerNorms of the rows of `x` (N, H) in one launch
/// (`layer_norm_pair_fwd_wide`, norms.cuh): `params` the first's weight and
/// bias, then the second's, `eps` theirs; the two outputs (2, N, H) in x's
/// dtype, each the same as [`norm_fwd`]'s. Only where the forward holds a
/// row's chunks (`_wide`).
pub fn layer_norm_pair(
    x: &CudaStorage,
    x_l: &Layout,
    params: &[In; 4],
    (eps1, eps2): (f32, f32),
) -> Result<CudaStorage> {
    let h = params[0].1.shape().elem_count();
    let Some(held) = norm_chunks_held(h, std::iter::once((x, x_l)).chain(params.iter().copied())) else {
        candle_core::bail!("a LayerNorm pair over rows of {h} that are not whole 16-byte loads");
    };
    let name = typed(&format!("layer_norm_pair_fwd_wide{held}"), x.dtype())?;
    by_dtype!(x.dtype(), norm_fwd_as(&name, x, x_l, params, &[eps1, eps2]))
}

/// The chunks of 8 features a lane of a norm's forward holds (`_wide<C>`,
/// norms.cuh), a power of two up to 16: where `h` is a whole number of 8s
/// up to 4,096 and every input's rows lie on 16 bytes; None otherwise.
fn norm_chunks_held<'a>(h: usize, inputs: impl IntoIterator<Item = In<'a>>) -> Option<usize> {
    let held = h.div_ceil(8 * 32).next_power_of_two();
    (h.is_multiple_of(8) && held <= 16 && inputs.into_iter().all(on_16)).then_some(held)
}

/// A norm forward's kernel `name` over x and its `params`: one output of
/// x's size for each of `eps` (a norm's, or a pair's two), one after the other.
fn norm_fwd_as<T: CudaDType + DeviceRepr>(
    name: &str,
    x: &CudaStorage,
    x_l: &Layout,
    params: &[In],
    eps: &[f32],
) -> Result<CudaStorage> {
    let dev = x.device.clone();
    let xs = view::<T>(x, x_l)?;
    let ps = params.iter().map(|(s, l)| view::<T>(s, l)).collect::<Result<Vec<_>>>()?;
    let h = ps[0].len();
    let n = xs.len() / h;
    // Safety: every element is written by the kernel.
    let mut y = unsafe { dev.alloc::<T>(eps.len() * xs.len()) }?;
    let func = kernel!(dev, name)?;
    let mut args = func.builder();
    args.arg(&xs);
    for p in &ps {
        args.arg(p);
    }
    let (n32, h32) = (n as i32, h as i32);
    args.arg(&mut y).arg(&n32).arg(&h32);
    for e in eps {
        args.arg(e);
    }
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(warp_rows(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// A norm's backward from x, weight and d y (N, H): d x (N, H) in x's
/// dtype, and each row's part of d weight, f32 (N, H).
pub fn norm_bwd(
    kernel: &str,
    (x, x_l): In,
    (w, w_l): In,
    (g, g_l): In,
    eps: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    fn run<T: CudaDType + DeviceRepr>(
        name: &str,
        (x, x_l): In,
        (w, w_l): In,
        (g, g_l): In,
        eps: f32,
    ) -> Result<(CudaStorage, CudaStorage)> {
        let dev = x.device.clone();
        let (xs, ws, gs) = (view::<T>(x, x_l)?, view::<T>(w, w_l)?, view::<T>(g, g_l)?);
        let (h, n) = (ws.len(), xs.len() / ws.len());
        if gs.len() != n * h {
            candle_core::bail!("{name}: a gradient of {} elements for {n} rows of {h}", gs.len());
        }
        // Safety: every element of both is written by the kernel.
        let (mut dx, mut dw) = unsafe { (dev.alloc::<T>(n * h)?, dev.alloc::<f32>(n * h)?) };
        let func = kernel!(dev, name)?;
        let (n32, h32) = (n as i32, h as i32);
        let mut args = func.builder();
        args.arg(&xs).arg(&ws).arg(&gs).arg(&mut dx).arg(&mut dw).arg(&n32).arg(&h32).arg(&eps);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(warp_rows(n)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(dx, dev.clone()), CudaStorage::wrap_cuda_slice(dw, dev)))
    }
    by_dtype!(x.dtype(), run(&typed(kernel, x.dtype())?, (x, x_l), (w, w_l), (g, g_l), eps))
}
