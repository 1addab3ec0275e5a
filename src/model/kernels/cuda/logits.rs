//! Launches over the LM head's logits, a block a row: the log-prob of each
//! row's token and its entropy, their gradient written over the logits
//! (`logprobs.cuh`), and the race sampler's picks (`race.cuh`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, Layout, Result};

use super::{per_row, typed, view, view_mut, In};

/// (N, 2) [log-prob of the target, entropy] per row of logits (N, V), f32
/// or bf16, at temperature 1 / inv_t.
pub fn token_logprobs((logits, l_l): In, (targets, t_l): In, inv_t: f32) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(
        name: &str,
        (logits, l_l): In,
        (targets, t_l): In,
        inv_t: f32,
    ) -> Result<CudaStorage> {
        let dev = logits.device.clone();
        let (z, t) = (view::<T>(logits, l_l)?, view::<u32>(targets, t_l)?);
        let (n, v) = (t.len(), z.len() / t.len().max(1));
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<f32>(2 * n) }?;
        let func = kernel!(dev, name)?;
        let v32 = v as i32;
        let mut args = func.builder();
        args.arg(&z).arg(&t).arg(&mut out).arg(&v32).arg(&inv_t);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(per_row(n, v)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed("token_logprobs_fwd", logits.dtype())?;
    by_dtype!(logits.dtype(), run(&name, (logits, l_l), (targets, t_l), inv_t))
}

/// Turns `logits` (N, V), f32 or bf16, into their gradient in place, from
/// the gradient (N, 2) f32 of [`token_logprobs`]'s output.
pub fn token_logprobs_grad(
    logits: &mut CudaStorage,
    l_l: &Layout,
    (targets, t_l): In,
    (grad, g_l): In,
    inv_t: f32,
) -> Result<()> {
    fn run<T: CudaDType + DeviceRepr>(
        name: &str,
        logits: &mut CudaStorage,
        l_l: &Layout,
        (targets, t_l): In,
        (grad, g_l): In,
        inv_t: f32,
    ) -> Result<()> {
        let dev = logits.device.clone();
        let (t, g) = (view::<u32>(targets, t_l)?, view::<f32>(grad, g_l)?);
        let mut z = view_mut::<T>(logits, l_l)?;
        let (n, v) = (t.len(), z.len() / t.len().max(1));
        let func = kernel!(dev, name)?;
        let v32 = v as i32;
        let mut args = func.builder();
        args.arg(&mut z).arg(&t).arg(&g).arg(&v32).arg(&inv_t);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(per_row(n, v)) }.w()?;
        Ok(())
    }
    let name = typed("token_logprobs_bwd", logits.dtype())?;
    by_dtype!(logits.dtype(), run(&name, logits, l_l, (targets, t_l), (grad, g_l), inv_t))
}

/// The race sampler's picks (`generate::race`): (R, 3) u32 [token, log-prob
/// bits, entropy bits] from logits (R, V) in f32 or bf16 (read as their f32
/// cast), the rows' settings (R, 9) u32 and their seen bits (R or 1, width)
/// u32.
pub fn race_pick((logits, l_l): In, (params, p_l): In, (seen, s_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType>(name: &str, (logits, l_l): In, (params, p_l): In, (seen, s_l): In) -> Result<CudaStorage> {
        let dev = logits.device.clone();
        let (rows, v) = l_l.shape().dims2()?;
        let (z, p, s) = (view::<T>(logits, l_l)?, view::<u32>(params, p_l)?, view::<u32>(seen, s_l)?);
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<u32>(3 * rows) }?;
        let func = kernel!(dev, name)?;
        let (width, v32) = (s_l.shape().dims2()?.1 as i32, v as i32);
        let mut args = func.builder();
        args.arg(&z).arg(&p).arg(&s).arg(&width).arg(&mut out).arg(&v32);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(per_row(rows, v)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed("race_pick", logits.dtype())?;
    by_dtype!(logits.dtype(), run(&name, (logits, l_l), (params, p_l), (seen, s_l)))
}
