//! AdamW's update in place, in parallel passes: candle's composition takes
//! a dozen whole-tensor ops per parameter, each allocating its result, and
//! a copy back into the parameter.

use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Storage, Tensor, Var};
use half::bf16;
use rayon::prelude::*;

use super::math::with_avx2;
use super::split_master::{update_split, SplitMaster};

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
    let f32_kernel = all.iter().all(|t| t.dtype() == DType::F32) && super::runs(&all);
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
/// [`adamw`], in order: a split master on the CPU in place, elsewhere
/// joined for it and split after.
pub fn adamw_many(params: &mut [AdamWParam]) -> Result<()> {
    #[cfg(feature = "cuda")]
    if one_launch(params)? {
        return super::cuda::adamw_multi(params);
    }
    for p in params.iter_mut() {
        match p.split {
            None => adamw(p.w, p.g, p.m, p.v, p.step)?,
            Some(split) if split_in_place(p, split) => adamw_split(p, split)?,
            Some(split) => {
                let master = Var::from_tensor(&split.join(p.w.as_tensor())?)?;
                adamw(&master, p.g, p.m, p.v, p.step)?;
                split.set(p.w, master.as_tensor())?;
            }
        }
    }
    Ok(())
}

/// Whether [`adamw_split`] can update `p`: its operands on the CPU, as
/// they are kept, contiguous, the gradient and moments of its shape (a
/// split's parts are of it by construction).
fn split_in_place(p: &AdamWParam, split: &SplitMaster) -> bool {
    let kept = |t: &Tensor, dtype: DType| t.device().is_cpu() && t.dtype() == dtype && t.is_contiguous();
    kept(p.w, DType::BF16)
        && kept(&split.low, DType::I16)
        && kept(&split.up, DType::U32)
        && [p.g, &*p.m, &*p.v].iter().all(|t| kept(t, DType::F32) && t.shape() == p.w.shape())
}

/// [`adamw`] over a split master on the CPU, in place: the moments as it
/// updates them, then one pass that joins each element's master, updates
/// it with the same arithmetic and splits it again.
fn adamw_split(p: &mut AdamWParam, split: &SplitMaster) -> Result<()> {
    p.m.inplace_op2(p.g, &Moment { beta: p.step.beta1, squared: false })?;
    p.v.inplace_op2(p.g, &Moment { beta: p.step.beta2, squared: true })?;
    let ((m, m_l), (v, v_l)) = (p.m.storage_and_layout(), p.v.storage_and_layout());
    let (Storage::Cpu(m), Storage::Cpu(v)) = (&*m, &*v) else { candle_core::bail!("adamw: moments off the CPU") };
    let (m, v, rule) = (super::contiguous_f32(m, m_l)?, super::contiguous_f32(v, v_l)?, WeightRule::new(p.step));
    super::cpu_storage_mut(p.w, |hi, hi_l| {
        super::cpu_storage_mut(&split.low, |low, low_l| {
            super::cpu_storage_mut(&split.up, |up, up_l| {
                let (CpuStorage::BF16(hi), CpuStorage::I16(low), CpuStorage::U32(up)) = (hi, low, up) else {
                    candle_core::bail!("adamw: a split master is not bf16, i16 and u32")
                };
                let hi: &mut [bf16] = super::contiguous_mut(hi, hi_l)?;
                let (low, up) = (super::contiguous_mut(low, low_l)?, super::contiguous_mut(up, up_l)?);
                update_split(hi, low, up, [m, v], |w, m, v| rule.apply(w, m, v));
                Ok(())
            })
        })
    })
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
    match s {
        CpuStorage::F32(data) => super::contiguous_mut(data, l),
        _ => candle_core::bail!("adamw: operand {:?} is not f32", l.dims()),
    }
}

/// A step's update of a weight from its moments, its divisions done once.
#[derive(Clone, Copy)]
struct WeightRule {
    decay: f32,
    step: f32,
    inv_sqrt_bias2: f32,
    eps: f32,
}

impl WeightRule {
    fn new(s: AdamWStep) -> Self {
        Self { decay: s.decay, step: s.lr / s.bias1, inv_sqrt_bias2: 1.0 / s.bias2.sqrt(), eps: s.eps }
    }

    #[inline(always)]
    fn apply(self, w: f32, m: f32, v: f32) -> f32 {
        self.decay * w - self.step * m / (v.sqrt() * self.inv_sqrt_bias2 + self.eps)
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
        let rule = WeightRule::new(self.0);
        w.par_chunks_mut(CHUNK).zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK))).for_each(|(w, (m, v))| {
            with_avx2(
                #[inline(always)]
                || {
                    for ((w, &m), &v) in w.iter_mut().zip(m).zip(v) {
                        *w = rule.apply(*w, m, v);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn bits<T: candle_core::WithDType>(t: &Tensor, to: impl Fn(T) -> u32) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<T>().unwrap().into_iter().map(to).collect()
    }

    fn same_bits(a: Vec<u32>, b: Vec<u32>, what: &str) {
        let first = a.iter().zip(&b).position(|(a, b)| a != b);
        assert!(a.len() == b.len() && first.is_none(), "{what} differ, first at element {first:?}");
    }

    /// The in-place pass over a split master gives the f32 kernel's
    /// masters and moments to the bit, over three tasks of elements, a last
    /// word of carries cut short and masters that start at ties.
    #[test]
    fn adamw_over_a_split_master_in_place_is_the_f32_kernels_to_the_bit() {
        let shape = (37, 1000);
        let mut start =
            super::super::test_randn(&[37, 1000], 0.0, 0.05).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, tie) in [0x3f80_8000u32, 0x3f81_8000, 0xbc00_8000, 0x3f7f_8000].iter().cycle().take(200).enumerate() {
            start[97 * i] = f32::from_bits(*tie);
        }
        let start = Tensor::from_vec(start, shape, &candle_core::Device::Cpu).unwrap();
        let whole = Var::from_tensor(&start).unwrap();
        let (hi, split) = SplitMaster::split(&start).unwrap();
        let hi = Var::from_tensor(&hi).unwrap();
        let zeros = || start.zeros_like().unwrap();
        let (mut m, mut v, mut m_split, mut v_split) = (zeros(), zeros(), zeros(), zeros());
        for t in 1..=3 {
            let g = super::super::test_randn(&[37, 1000], 0.0, 0.01);
            // The betas many language models train with.
            let (beta1, beta2) = (0.9f32, 0.95f32);
            let (bias1, bias2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
            let step = AdamWStep { beta1, beta2, eps: 1e-8, lr: 3e-3, bias1, bias2, decay: 1.0 - 3e-4 };
            let mut params = [
                AdamWParam { w: &whole, split: None, g: &g, m: &mut m, v: &mut v, step },
                AdamWParam { w: &hi, split: Some(&split), g: &g, m: &mut m_split, v: &mut v_split, step },
            ];
            assert!(split_in_place(&params[1], &split));
            adamw_many(&mut params).unwrap();
        }
        let f32_bits = |t: &Tensor| bits(t, f32::to_bits);
        same_bits(f32_bits(&m_split), f32_bits(&m), "first moments");
        same_bits(f32_bits(&v_split), f32_bits(&v), "second moments");
        same_bits(f32_bits(&split.join(&hi).unwrap()), f32_bits(&whole), "masters");
        let bf16_bits = |t: &Tensor| bits(t, |h: bf16| h.to_bits() as u32);
        same_bits(bf16_bits(&hi), bf16_bits(&whole.to_dtype(DType::BF16).unwrap()), "bf16 copies");
    }
}
