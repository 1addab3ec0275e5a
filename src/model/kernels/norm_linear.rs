//! A layer norm and the dense layer it feeds, as one op while the layer
//! trains: `LN(x) W^T + b` keeps only `x` (which a block keeps anyway, for
//! its residual), where the two ops also kept the norm's output, a tensor
//! of the layer's size per norm; the backward makes it again (one pass over
//! x). The norm's weight and bias and the layer's bias reach the op as one
//! vector, their concatenation in the graph, since a candle op takes three
//! inputs; the backward hands each its part. On the CPU the values and
//! gradients are the two ops', to the bit.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

use super::linear::{dense, dense_bias_epilogue, out_shape, product_grads, sizes, weight_layout, Operand};
use super::norm::{layer_norm_grads, layer_norm_rows, layer_norm_without_graph};
use super::remade::Remake;
use super::{contiguous_f32, fused, on_cuda};

/// `layer_norm(x, norm weight, norm bias, eps) @ w^T + b` for `x` (..., in)
/// and a PyTorch-layout `w` (out, in): one op where `w` trains (on the CPU
/// in f32, or on a GPU), else the two.
pub fn norm_linear(x: &Tensor, norm: (&Tensor, &Tensor, f64), w: &Tensor, b: &Tensor) -> Result<Tensor> {
    if !runs_as_op(x, norm, w, b)? {
        let (norm_w, norm_b, eps) = norm;
        return super::linear(&super::layer_norm(x, norm_w, norm_b, eps)?, w, Some(b));
    }
    apply(x, norm, w, b)
}

/// What makes [`norm_linear`]'s values again, without a graph, for a
/// backward that did not keep them (see `kernels::activation_linear_remade`):
/// None where it does not run as one op.
pub fn norm_linear_remake(x: &Tensor, norm: (&Tensor, &Tensor, f64), w: &Tensor, b: &Tensor) -> Result<Option<Remake>> {
    if !runs_as_op(x, norm, w, b)? {
        return Ok(None);
    }
    let (x, norm_w, norm_b, w, b) = (x.detach(), norm.0.detach(), norm.1.detach(), w.detach(), b.detach());
    let eps = norm.2;
    Ok(Some(Arc::new(move || apply(&x, (&norm_w, &norm_b, eps), &w, &b))))
}

/// Whether the two run as one op: where `w` trains, on the CPU in f32 or
/// on a GPU.
fn runs_as_op(x: &Tensor, norm: (&Tensor, &Tensor, f64), w: &Tensor, b: &Tensor) -> Result<bool> {
    let (norm_w, norm_b, _) = norm;
    let k = x.dim(D::Minus1)?;
    let fits = w.rank() == 2
        && w.dim(1)? == k
        && norm_w.dims() == [k]
        && norm_b.dims() == [k]
        && b.dims() == [w.dim(0)?]
        && x.elem_count() > 0;
    let all = [x, norm_w, norm_b, w, b];
    Ok(fits && w.track_op() && (all.iter().all(|t| fused(t)) || on_cuda(&all)))
}

/// The op on `x` as it is shaped: its output has no reshape node, whose
/// argument would keep the values for a graph that records only their
/// place (`Tensor::without_values`).
fn apply(x: &Tensor, norm: (&Tensor, &Tensor, f64), w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (norm_w, norm_b, eps) = norm;
    let epilogue = x.device().is_cuda() && x.dtype() == DType::BF16 && dense_bias_epilogue()?;
    let vectors = Tensor::cat(&[norm_w, norm_b, b], 0)?;
    x.contiguous()?.apply_op3(&weight_layout(w)?, &vectors, NormLinear { eps: eps as f32, epilogue })
}

/// x (..., in), the weight, and [norm weight; norm bias; bias].
struct NormLinear {
    eps: f32,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    epilogue: bool,
}

impl CustomOp3 for NormLinear {
    fn name(&self) -> &'static str {
        "norm-linear"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, k, n) = sizes(self.name(), x_l, w_l)?;
        let v = contiguous_f32(v, v_l)?;
        let y = layer_norm_rows(contiguous_f32(x, x_l)?, &v[..k], &v[k..2 * k], self.eps);
        let out = dense(&y, x_l, Operand::weight(w, w_l)?, w_l, Some(&v[2 * k..2 * k + n]))?;
        Ok((CpuStorage::F32(out), out_shape(x_l, n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        w: &candle_core::CudaStorage,
        w_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (m, k, n) = sizes(self.name(), x_l, w_l)?;
        let at = v_l.start_offset();
        let part = |offset: usize, len: usize| Layout::contiguous_with_offset(len, at + offset);
        let norm = [(v, &part(0, k)), (v, &part(k, k))];
        let y = super::cuda::norm_fwd("layer_norm_fwd", x, x_l, &norm, self.eps)?;
        let (y_l, bias_l) = (Layout::contiguous((m, k)), part(2 * k, n));
        let out = super::linear::cuda_dense((&y, &y_l), None, (w, w_l), Some((v, &bias_l)), (m, k, n), self.epilogue)?;
        Ok((out, out_shape(x_l, n)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        v: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (k, n) = (x.dim(D::Minus1)?, w.dim(0)?);
        let (x_rows, v) = (x.detach().reshape(((), k))?, v.detach());
        let (norm_w, norm_b) = (v.narrow(0, 0, k)?, v.narrow(0, k, k)?);
        let y = layer_norm_without_graph(&x_rows, &norm_w, &norm_b, self.eps)?;
        let (dy, dw, Some(db)) = product_grads(&y, w, &grad.reshape(((), n))?, true)? else {
            candle_core::bail!("norm-linear: no bias gradient")
        };
        drop(y);
        let (dx, d_norm_w, d_norm_b) = layer_norm_grads(&x_rows, &norm_w, &dy, self.eps)?;
        Ok((Some(dx.reshape(x.shape())?), dw, Some(Tensor::cat(&[&d_norm_w, &d_norm_b, &db], 0)?)))
    }
}
