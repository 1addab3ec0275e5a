//! A gated MLP's output layer, `(act(gate) * up) @ w^T`, as one op
//! (Llama, Qwen, Mistral: `down_proj` without a bias): it keeps `gate` and
//! `up`, where the composition also kept `act(gate)` and the product, two
//! more tensors of the MLP's width; the backward makes them again. With an
//! adapter on `down_proj`, the product alone is one op that keeps `gate`
//! and `up` ([`gated_product`]), and the adapter's op makes it again. On
//! the CPU the values and gradients are the composition's, to the bit.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::elementwise::{self, apply, grad_without_graph, without_graph};
use super::linear::{dense, out_shape, product_grads, sizes, weight_layout, Operand};
use super::remade::{on_remade_inputs3, Remake};
use super::{contiguous_f32, fused, on_cuda};
use crate::model::ops::Activation;

/// `(act(gate) * up) @ w^T` for `gate`, `up` (..., in) and a PyTorch-layout
/// `w` (out, in).
pub fn gated_linear(gate: &Tensor, up: &Tensor, act: Activation, w: &Tensor) -> Result<Tensor> {
    if !runs(gate, up, w)? {
        return super::linear(&(elementwise::activation(gate, act)? * up)?, w, None);
    }
    gate.contiguous()?.apply_op3(&up.contiguous()?, &weight_layout(w)?, Gated(act))
}

/// [`gated_linear`] where the training graph keeps only the places of
/// `gate` and `up`, which the backward makes again with `remakes` (from
/// the MLP's input, `RLOO_MLP_INPUT=remade`): the same values and
/// gradients. As [`gated_linear`] where neither has a graph or the op does
/// not run.
pub fn gated_linear_remade(
    gate: &Tensor,
    up: &Tensor,
    act: Activation,
    w: &Tensor,
    (remake_gate, remake_up): (Remake, Remake),
) -> Result<Tensor> {
    if !((gate.track_op() || up.track_op()) && runs(gate, up, w)?) {
        return gated_linear(gate, up, act, w);
    }
    let args = [gate, &up.contiguous()?, &weight_layout(w)?];
    on_remade_inputs3(|| Gated(act), args, [Some(remake_gate), Some(remake_up), None])
}

/// `act(gate) * up`, where the training graph keeps `gate` and `up` (the
/// composition also keeps `act(gate)`), with what makes its values again
/// from them, without a graph: for an op that would otherwise keep the
/// product (a `down_proj` with an adapter). Where the op does not run, the
/// composition, and no remake.
pub fn gated_product(gate: &Tensor, up: &Tensor, act: Activation) -> Result<(Tensor, Option<Remake>)> {
    let all = [gate, up];
    let runs = gate.shape() == up.shape() && (all.iter().all(|t| fused(t)) || on_cuda(&all));
    if !runs {
        return Ok(((elementwise::activation(gate, act)? * up)?, None));
    }
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    let product = gate.apply_op2(&up, GatedProduct(act))?;
    let (gate, up) = (gate.detach(), up.detach());
    let remake: Remake = Arc::new(move || gate.apply_op2_no_bwd(&up, &GatedProduct(act)));
    Ok((product, Some(remake)))
}

struct GatedProduct(Activation);

impl CustomOp2 for GatedProduct {
    fn name(&self) -> &'static str {
        "gated-product"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        gate_l: &Layout,
        up: &CpuStorage,
        up_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(product_cpu(self.0, (gate, gate_l), (up, up_l))?), gate_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gate: &candle_core::CudaStorage,
        gate_l: &Layout,
        up: &candle_core::CudaStorage,
        up_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((product_cuda(self.0, (gate, gate_l), (up, up_l))?, gate_l.shape().clone()))
    }

    fn bwd(&self, gate: &Tensor, up: &Tensor, _: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (gate, up) = (gate.detach(), up.detach());
        let (d_gate, d_up) = gate_and_up_grads(self.0, &gate, &up, &without_graph(&gate, self.0)?, grad)?;
        Ok((Some(d_gate), Some(d_up)))
    }
}

/// `act(gate) * up` on the CPU.
fn product_cpu(act: Activation, gate: (&CpuStorage, &Layout), up: (&CpuStorage, &Layout)) -> Result<Vec<f32>> {
    let mut h = apply(act, contiguous_f32(gate.0, gate.1)?);
    h.iter_mut().zip(contiguous_f32(up.0, up.1)?).for_each(|(h, u)| *h *= u);
    Ok(h)
}

/// `act(gate) * up` on a GPU, for a contiguous `gate`.
#[cfg(feature = "cuda")]
fn product_cuda(
    act: Activation,
    gate: (&candle_core::CudaStorage, &Layout),
    up: (&candle_core::CudaStorage, &Layout),
) -> Result<candle_core::CudaStorage> {
    use candle_core::backend::BackendStorage;
    let activated = super::cuda::activation(gate, None, act as i32)?;
    activated.binary_impl::<candle_core::op::Mul>(up.0, &Layout::contiguous(gate.1.shape()), up.1)
}

/// The gradients of `gate` and `up` from that of `act(gate) * up`, given
/// `activated`, `act(gate)`.
fn gate_and_up_grads(
    act: Activation,
    gate: &Tensor,
    up: &Tensor,
    activated: &Tensor,
    grad: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let d_up = (grad * activated)?;
    let d_gate = grad_without_graph(gate, &(grad * up)?, act)?;
    Ok((d_gate, d_up))
}

/// Whether the op runs: on the CPU in f32 or on a GPU, for a gate and an
/// up projection of one shape that `w` takes.
fn runs(gate: &Tensor, up: &Tensor, w: &Tensor) -> Result<bool> {
    let all = [gate, up, w];
    let fits = gate.shape() == up.shape() && w.rank() == 2 && gate.dims().last() == Some(&w.dim(1)?);
    Ok(fits && gate.elem_count() > 0 && (all.iter().all(|t| fused(t)) || on_cuda(&all)))
}

struct Gated(Activation);

impl CustomOp3 for Gated {
    fn name(&self) -> &'static str {
        "gated-linear"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    fn cpu_fwd(
        &self,
        gate: &CpuStorage,
        gate_l: &Layout,
        up: &CpuStorage,
        up_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, n) = sizes(self.name(), gate_l, w_l)?;
        let h = product_cpu(self.0, (gate, gate_l), (up, up_l))?;
        let out = dense(&h, gate_l, Operand::weight(w, w_l)?, w_l, None)?;
        Ok((CpuStorage::F32(out), out_shape(gate_l, n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gate: &candle_core::CudaStorage,
        gate_l: &Layout,
        up: &candle_core::CudaStorage,
        up_l: &Layout,
        w: &candle_core::CudaStorage,
        w_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, k, n) = sizes(self.name(), gate_l, w_l)?;
        let h = product_cuda(self.0, (gate, gate_l), (up, up_l))?;
        let rows = Layout::contiguous((m, k));
        Ok((super::linear::cuda_dense((&h, &rows), None, (w, w_l), None, (m, k, n), false)?, out_shape(gate_l, n)))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        w: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gate, up) = (gate.detach(), up.detach());
        let activated = without_graph(&gate, self.0)?;
        let h = (&activated * &up)?;
        let (dh, dw, _) = product_grads(&h, w, grad, false)?;
        drop(h);
        let (d_gate, d_up) = gate_and_up_grads(self.0, &gate, &up, &activated, &dh)?;
        Ok((Some(d_gate), Some(d_up), dw))
    }
}
