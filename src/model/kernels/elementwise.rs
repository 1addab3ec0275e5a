//! Activations with their backward passes (candle's activation gradients
//! are chains of five to ten whole-tensor ops), and residual sums and
//! copies whose nodes keep none of their inputs.

use std::sync::Arc;

use candle_core::op::{BinaryOp, Op};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, InplaceOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::contiguous_f32;
use super::math::{erf, exp, with_avx2};
use crate::model::ops::Activation;

/// The activation applied elementwise.
pub fn activation(x: &Tensor, act: Activation) -> Result<Tensor> {
    if !super::runs(&[x]) {
        return act.apply(x);
    }
    x.contiguous()?.apply_op1(Act(act))
}

/// `x + a`, a residual's sum (a block's input or running sum, and a
/// branch's output). An addition's backward reads no value, so the node
/// records its inputs' places in the graph without their values: the
/// branch's output is not kept for the backward, as in PyTorch.
pub fn residual(x: &Tensor, a: &Tensor) -> Result<Tensor> {
    on_places(sum2(x, a)?, &[x, a], |p| Op::Binary(p[0].clone(), p[1].clone(), BinaryOp::Add))
}

/// `x + a` without a graph: on a GPU, for contiguous tensors of one shape
/// and dtype (f32 or bf16), one pass of 16-byte loads (candle's addition
/// loads 2 bytes a thread: a 410m backward's sums of a layer input's
/// gradients ran at about 1.2 TB/s); otherwise candle's addition. The same
/// values either way. The backward adds a tensor's gradients with it
/// (`candle_core::backprop::set_gradient_sum`).
pub fn sum2(x: &Tensor, a: &Tensor) -> Result<Tensor> {
    let (x, a) = (x.detach(), a.detach());
    if !(super::on_cuda(&[&x, &a]) && x.shape() == a.shape() && x.is_contiguous() && a.is_contiguous()) {
        return x + a;
    }
    x.apply_op2_no_bwd(&a, &Sum2)
}

/// `t` laid out contiguously, where the node keeps none of `t`'s values (a
/// copy's backward reads none; candle's copy keeps them, and with them
/// whatever `t` is a view of): heads transposed out of a projection's
/// output do not keep it.
pub fn contiguous(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t.clone());
    }
    on_places(t.detach().contiguous()?, &[t], |p| Op::Copy(p[0].clone()))
}

/// `(x + a) + b` as one node (a parallel residual: the block's input, its
/// attention's and its MLP's outputs), the same values as the two
/// additions, to the bit; like [`residual`], it keeps none of them.
pub fn sum3(x: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !(super::runs(&[x, a, b]) && x.shape() == a.shape() && x.shape() == b.shape()) {
        return residual(&residual(x, a)?, b);
    }
    let [xc, ac, bc] = [x, a, b].map(|t| t.detach().contiguous());
    let sum = xc?.apply_op3(&ac?, &bc?, Sum3)?;
    on_places(sum, &[x, a, b], |p| Op::CustomOp3(p[0].clone(), p[1].clone(), p[2].clone(), Arc::new(Box::new(Sum3))))
}

/// `sum + g` in f32 for an f32 `sum` and `g` of its shape, `g` cast up
/// first: a gradient added into its f32 sum in one pass and one tensor
/// (candle's cast, then its addition, take two of each), the same values.
/// Without a graph; any other dtypes add as candle does.
pub fn add_cast(sum: &Tensor, g: &Tensor) -> Result<Tensor> {
    if !add_cast_takes(sum, g) {
        return sum + g.to_dtype(sum.dtype())?;
    }
    sum.detach().contiguous()?.apply_op2_no_bwd(&g.detach().contiguous()?, &AddCast)
}

/// [`add_cast`] written over `sum`, whose storage no other tensor may
/// share, where it is contiguous: no second buffer of the sum's size (the
/// LM head's gradient summed over chunks of logits is 0.4 GB at 1B); else
/// `sum` becomes a new tensor.
pub fn add_cast_to(sum: &mut Tensor, g: &Tensor) -> Result<()> {
    if !(add_cast_takes(sum, g) && sum.is_contiguous()) {
        *sum = add_cast(sum, g)?;
        return Ok(());
    }
    sum.inplace_op2(&g.detach().contiguous()?, &AddCast)
}

/// Whether [`AddCast`] adds `g` into `sum`: an f32 sum, a gradient of its
/// shape in f32 or bf16, both on the CPU or a GPU.
fn add_cast_takes(sum: &Tensor, g: &Tensor) -> bool {
    sum.dtype() == DType::F32
        && matches!(g.dtype(), DType::F32 | DType::BF16)
        && sum.shape() == g.shape()
        && sum.device().same_device(g.device())
        && super::in_place_runs(sum.device())
}

/// `values`, computed without a graph, as the output of `op` on the places
/// of `args` (see [`Tensor::without_values`]), for an op whose backward
/// reads none of their values; without a graph when no argument has one.
pub(super) fn on_places(values: Tensor, args: &[&Tensor], op: impl FnOnce(&[Tensor]) -> Op) -> Result<Tensor> {
    if !args.iter().any(|t| t.track_op()) {
        return Ok(values);
    }
    let places = args.iter().map(|t| t.without_values()).collect::<Result<Vec<_>>>()?;
    Ok(values.share_as_op(op(&places)))
}

/// `act` applied to each of `x`.
pub(super) fn apply(act: Activation, x: &[f32]) -> Vec<f32> {
    match act {
        Activation::Gelu => map(x, gelu_erf),
        Activation::GeluTanh => map(
            x,
            #[inline(always)]
            |x| gelu_tanh(x).0,
        ),
        Activation::Silu => map(
            x,
            #[inline(always)]
            |x| x / (1.0 + exp(-x)),
        ),
        Activation::Relu => map(
            x,
            #[inline(always)]
            |x| x.max(0.0),
        ),
    }
}

/// `act(x)`, recording no backward: for a backward that makes it again.
pub(super) fn without_graph(x: &Tensor, act: Activation) -> Result<Tensor> {
    x.apply_op1_no_bwd(&Act(act))
}

/// `d y * act'(x)`, recording no backward.
pub(super) fn grad_without_graph(x: &Tensor, grad: &Tensor, act: Activation) -> Result<Tensor> {
    x.apply_op2_no_bwd(&grad.contiguous()?, &ActGrad(act))
}

/// `g * act'(x)` elementwise.
pub(super) fn apply_grad(act: Activation, x: &[f32], g: &[f32]) -> Vec<f32> {
    match act {
        // d/dx x Phi(x) = Phi(x) + x phi(x)
        Activation::Gelu => map2(
            x,
            g,
            #[inline(always)]
            |x, g| {
                let cdf = 0.5 * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2));
                g * (cdf + x * exp(-0.5 * x * x) * INV_SQRT_2PI)
            },
        ),
        Activation::GeluTanh => map2(
            x,
            g,
            #[inline(always)]
            |x, g| g * gelu_tanh(x).1,
        ),
        // d/dx x s(x) = s(x) (1 + x (1 - s(x)))
        Activation::Silu => map2(
            x,
            g,
            #[inline(always)]
            |x, g| {
                let s = sigmoid(x);
                g * s * (1.0 + x * (1.0 - s))
            },
        ),
        Activation::Relu => map2(
            x,
            g,
            #[inline(always)]
            |x, g| if x > 0.0 { g } else { 0.0 },
        ),
    }
}

/// Elementwise over `x` in parallel chunks. Callers mark `f`
/// `#[inline(always)]`: only inlined into the AVX2 loop is it compiled
/// with AVX2; left to the optimiser, it can stay a plain call (several
/// times slower), depending on how the rest of the crate compiles.
fn map(x: &[f32], f: impl Fn(f32) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(o, x)| {
        with_avx2(
            #[inline(always)]
            || {
                for (o, &x) in o.iter_mut().zip(x) {
                    *o = f(x);
                }
            },
        )
    });
    out
}

/// `f(x, y)` elementwise over two slices of equal length, in parallel
/// chunks; `f` is `#[inline(always)]` as in [`map`].
fn map2<Y: Copy + Sync>(x: &[f32], y: &[Y], f: impl Fn(f32, Y) -> f32 + Sync) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK).zip(y.par_chunks(CHUNK))).for_each(|(o, (x, y))| {
        with_avx2(
            #[inline(always)]
            || {
                for ((o, &x), &y) in o.iter_mut().zip(x).zip(y) {
                    *o = f(x, y);
                }
            },
        )
    });
    out
}

/// `sum[i] += cast(g[i])`, as [`map2`] would make `sum[i] + cast(g[i])`.
fn add_into<G: Copy + Sync>(sum: &mut [f32], g: &[G], cast: impl Fn(G) -> f32 + Sync) {
    sum.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(s, g)| {
        with_avx2(
            #[inline(always)]
            || {
                for (s, &g) in s.iter_mut().zip(g) {
                    *s += cast(g);
                }
            },
        )
    });
}

/// Elements per parallel task of the elementwise kernels.
const CHUNK: usize = 1 << 14;

struct Act(Activation);

impl CustomOp1 for Act {
    fn name(&self) -> &'static str {
        "activation"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(apply(self.0, contiguous_f32(s, l)?)), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::activation((s, l), None, self.0 as i32)?, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad_without_graph(x, grad, self.0)?))
    }
}

struct Sum2;

impl CustomOp2 for Sum2 {
    fn name(&self) -> &'static str {
        "sum2"
    }

    super::cuda_only_cpu_fwd!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        a: &candle_core::CudaStorage,
        a_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::sum2((x, x_l), (a, a_l))?, x_l.shape().clone()))
    }
}

struct Sum3;

impl CustomOp3 for Sum3 {
    fn name(&self) -> &'static str {
        "sum3"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        a: &CpuStorage,
        a_l: &Layout,
        b: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, a, b) = (contiguous_f32(x, x_l)?, contiguous_f32(a, a_l)?, contiguous_f32(b, b_l)?);
        let mut out = map2(
            x,
            a,
            #[inline(always)]
            |x, a| x + a,
        );
        out.par_chunks_mut(CHUNK)
            .zip(b.par_chunks(CHUNK))
            .for_each(|(o, b)| o.iter_mut().zip(b).for_each(|(o, b)| *o += b));
        Ok((CpuStorage::F32(out), x_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        a: &candle_core::CudaStorage,
        a_l: &Layout,
        b: &candle_core::CudaStorage,
        b_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::sum3((x, x_l), (a, a_l), (b, b_l))?, x_l.shape().clone()))
    }

    fn bwd(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone()), Some(grad.clone())))
    }
}

/// [`add_cast`]'s op: (f32 sum, g) -> sum + f32(g).
struct AddCast;

impl CustomOp2 for AddCast {
    fn name(&self) -> &'static str {
        "add-cast"
    }

    fn cpu_fwd(&self, s: &CpuStorage, s_l: &Layout, g: &CpuStorage, g_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let sum = contiguous_f32(s, s_l)?;
        let (start, end) =
            g_l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("add-cast: g strided".into()))?;
        let out = match g {
            CpuStorage::F32(g) => map2(sum, &g[start..end], |s, g| s + g),
            CpuStorage::BF16(g) => map2(sum, &g[start..end], |s, g| s + g.to_f32()),
            _ => candle_core::bail!("add-cast: a gradient neither f32 nor bf16"),
        };
        Ok((CpuStorage::F32(out), s_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        s_l: &Layout,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::add_cast((s, s_l), (g, g_l))?, s_l.shape().clone()))
    }
}

impl InplaceOp2 for AddCast {
    fn name(&self) -> &'static str {
        "add-cast-to"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, s_l: &Layout, g: &CpuStorage, g_l: &Layout) -> Result<()> {
        let (Some((start, end)), Some((g_start, g_end))) = (s_l.contiguous_offsets(), g_l.contiguous_offsets()) else {
            candle_core::bail!("add-cast-to: a strided operand");
        };
        let CpuStorage::F32(sum) = s else { candle_core::bail!("add-cast-to: a sum that is not f32") };
        let sum = &mut sum[start..end];
        match g {
            CpuStorage::F32(g) => add_into(sum, &g[g_start..g_end], |g| g),
            CpuStorage::BF16(g) => add_into(sum, &g[g_start..g_end], |g| g.to_f32()),
            _ => candle_core::bail!("add-cast-to: a gradient neither f32 nor bf16"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &mut candle_core::CudaStorage,
        s_l: &Layout,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
    ) -> Result<()> {
        super::cuda::add_cast_into(s, s_l, (g, g_l))
    }
}

/// (x, d y) -> d x = d y * act'(x).
struct ActGrad(Activation);

impl CustomOp2 for ActGrad {
    fn name(&self) -> &'static str {
        "activation-grad"
    }

    fn cpu_fwd(&self, x: &CpuStorage, x_l: &Layout, g: &CpuStorage, g_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, g) = (contiguous_f32(x, x_l)?, contiguous_f32(g, g_l)?);
        let out = apply_grad(self.0, x, g);
        Ok((CpuStorage::F32(out), x_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::activation((x, x_l), Some((g, g_l)), self.0 as i32)?, x_l.shape().clone()))
    }
}

const INV_SQRT_2PI: f32 = 0.398_942_3;

/// Exact GELU: `x Phi(x)`.
#[inline(always)]
fn gelu_erf(x: f32) -> f32 {
    (erf(x * std::f32::consts::FRAC_1_SQRT_2) + 1.0) * 0.5 * x
}

/// GELU's tanh approximation and its derivative.
#[inline(always)]
fn gelu_tanh(x: f32) -> (f32, f32) {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
                                // tanh y = 1 - 2 / (e^{2y} + 1)
    let t = 1.0 - 2.0 / (exp(2.0 * C * x * (1.0 + 0.044715 * x * x)) + 1.0);
    let dt = (1.0 - t * t) * C * (1.0 + 3.0 * 0.044715 * x * x);
    (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * dt)
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}
