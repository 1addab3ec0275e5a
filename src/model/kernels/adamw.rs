//! AdamW's update in place, in parallel passes: candle's composition takes
//! a dozen whole-tensor ops per parameter, each allocating its result, and
//! a copy back into the parameter.

use candle_core::{CpuStorage, InplaceOp2, InplaceOp3, Layout, Result, Tensor, Var};
use rayon::prelude::*;

use super::math::with_avx2;
use super::split_master::SplitMaster;

/// The scalars of one AdamW step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub lr: f32,
    /// 1 - beta^t, the bias corrections of the two moments.
    pub bias1: f32,
    pub bias2: f32,
    /// The weight's factor before the update: 1 - lr * weight decay.
    pub decay: f32,
}

/// One AdamW step of `w` from the gradient `g`, as PyTorch's AdamW does:
/// the moments `m`, `v` and the weight are updated in place by the fused
/// kernel (f32, contiguous, on the CPU or a GPU), or replaced by the
/// composition's results otherwise.
pub fn adamw(w: &Var, g: &Tensor, m: &mut Tensor, v: &mut Tensor, step: AdamWStep) -> Result<()> {
    let all = [w.as_tensor(), g, m, v];
    let f32_kernel = all.iter().all(|t| t.dtype() == candle_core::DType::F32) && super::runs(&all);
    if f32_kernel && all.iter().all(|t| t.is_contiguous() && t.shape() == w.shape()) {
        m.inplace_op2(g, &Moment { beta: step.beta1, squared: false })?;
        v.inplace_op2(g, &Moment { beta: step.beta2, squared: true })?;
        return w.inplace_op3(m, v, &Update(step));
    }
    let (beta1, beta2) = (step.beta1 as f64, step.beta2 as f64);
    *m = ((&*m * beta1)? + (g * (1.0 - beta1))?)?;
    *v = ((&*v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
    let mut new_w = w.as_tensor().detach();
    if step.decay != 1.0 {
        new_w = (new_w * step.decay as f64)?;
    }
    let denom = ((v.sqrt()? / (step.bias2 as f64).sqrt())? + step.eps as f64)?;
    new_w = (new_w - ((&*m / denom)? * (step.lr / step.bias1) as f64)?)?;
    w.set(&new_w)
}

/// One parameter's part in an AdamW step over many.
pub struct AdamWParam<'a> {
    /// The f32 master, or with `split` the bf16 copy of a split one.
    pub w: &'a Var,
    pub split: Option<&'a SplitMaster>,
    pub g: &'a Tensor,
    pub m: &'a mut Tensor,
    pub v: &'a mut Tensor,
    pub step: AdamWStep,
}

/// How a GPU applies AdamW to many parameters: `multi` (the default) or
/// `per-tensor` (three launches per parameter, for comparison).
pub const ADAMW_VAR: &str = "RLOO_ADAMW";

/// AdamW steps of many parameters. On a GPU, when every operand is f32 (a
/// split master's parts as they are kept), contiguous and of its
/// parameter's shape, the masters all split or none, and the steps differ
/// in their weight decay at most, one launch updates every parameter with
/// the arithmetic of [`adamw`]'s kernels; otherwise each goes through
/// [`adamw`], in order, a split master joined for it and split after.
pub fn adamw_many(params: &mut [AdamWParam]) -> Result<()> {
    #[cfg(feature = "cuda")]
    if one_launch(params)? {
        return super::cuda::adamw_multi(params);
    }
    for p in params.iter_mut() {
        match p.split {
            None => adamw(p.w, p.g, p.m, p.v, p.step)?,
            Some(split) => {
                let master = Var::from_tensor(&split.join(p.w.as_tensor())?)?;
                adamw(&master, p.g, p.m, p.v, p.step)?;
                split.set(p.w, master.as_tensor())?;
            }
        }
    }
    Ok(())
}

/// Whether [`adamw_many`] can update `params` in one launch.
#[cfg(feature = "cuda")]
fn one_launch(params: &[AdamWParam]) -> Result<bool> {
    if crate::model::device::variant(ADAMW_VAR, &["multi", "per-tensor"]).map_err(candle_core::Error::msg)?
        == "per-tensor"
    {
        return Ok(false);
    }
    use candle_core::DType;
    let Some(first) = params.first() else { return Ok(false) };
    let kept = |t: &Tensor, dtype: DType| t.device().is_cuda() && t.dtype() == dtype && t.is_contiguous();
    // The launch's grid gives each parameter a row of blocks.
    Ok(params.len() < 65_536
        && params.iter().all(|p| {
            let w = p.w.as_tensor();
            let master = match p.split {
                None => kept(w, DType::F32),
                Some(s) => kept(w, DType::BF16) && kept(&s.low, DType::I16) && kept(&s.up, DType::U32),
            };
            AdamWStep { decay: first.step.decay, ..p.step } == first.step
                && p.split.is_some() == first.split.is_some()
                && master
                && [p.g, &*p.m, &*p.v].iter().all(|t| kept(t, DType::F32) && t.shape() == w.shape())
        }))
}

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// The contiguous f32 elements of an in-place operand.
fn slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((start, end))) => Ok(&mut data[start..end]),
        _ => candle_core::bail!("adamw: operand {:?} is not contiguous f32", l.dims()),
    }
}

/// `x = beta x + (1 - beta) g`, or `g^2` for the second moment.
struct Moment {
    beta: f32,
    squared: bool,
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout, g: &CpuStorage, g_l: &Layout) -> Result<()> {
        let (x, g) = (slice_mut(dst, dst_l)?, super::contiguous_f32(g, g_l)?);
        let (beta, rest, squared) = (self.beta, 1.0 - self.beta, self.squared);
        x.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(x, g)| {
            with_avx2(
                #[inline(always)]
                || {
                    for (x, &g) in x.iter_mut().zip(g) {
                        *x = beta * *x + rest * if squared { g * g } else { g };
                    }
                },
            )
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
    ) -> Result<()> {
        super::cuda::adamw_moment(dst, dst_l, g, g_l, self.beta, self.squared)
    }
}

/// `w = decay w - lr / bias1 * m / (sqrt(v) / sqrt(bias2) + eps)`.
struct Update(AdamWStep);

impl InplaceOp3 for Update {
    fn name(&self) -> &'static str {
        "adamw-update"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        m: &CpuStorage,
        m_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<()> {
        let w = slice_mut(dst, dst_l)?;
        let (m, v) = (super::contiguous_f32(m, m_l)?, super::contiguous_f32(v, v_l)?);
        let s = self.0;
        let (step, inv_sqrt_bias2) = (s.lr / s.bias1, 1.0 / s.bias2.sqrt());
        w.par_chunks_mut(CHUNK).zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK))).for_each(|(w, (m, v))| {
            with_avx2(
                #[inline(always)]
                || {
                    for ((w, &m), &v) in w.iter_mut().zip(m).zip(v) {
                        *w = s.decay * *w - step * m / (v.sqrt() * inv_sqrt_bias2 + s.eps);
                    }
                },
            )
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        m: &candle_core::CudaStorage,
        m_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<()> {
        super::cuda::adamw_update(dst, dst_l, (m, m_l), (v, v_l), self.0)
    }
}
