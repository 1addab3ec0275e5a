//! LayerNorm and RMSNorm over the last dimension, forward and backward, one
//! pass over the rows each (the compositions in `ops` take nine and five
//! candle ops forward and several times that backward).
//!
//! The backward kernel returns d input, d weight (and d bias) stacked in
//! one (N + 2, H) tensor, split by views: candle's custom ops have one
//! output. The CUDA kernels (f32 and bf16, arithmetic in f32) write d input
//! in the input's dtype and each row's part of d weight in f32, summed over
//! rows afterwards.
//! The statistics of each row are recomputed rather than stored.

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::remade::Remake;

use super::math::{sum_of, with_avx2};
use super::{contiguous_f32, rows_per_task, BwdOut3};
use crate::model::ops;

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension,
/// as `x` is shaped (see [`rms_norm`]).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if !super::runs(&[x, weight, bias]) {
        return ops::layernorm(x, weight, bias, eps);
    }
    x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, LayerNorm { eps: eps as f32 })
}

/// The LayerNorms `first` and `second` (weight, bias, eps) of the same `x`,
/// as a parallel-residual layer takes before its attention and its MLP: on
/// a GPU, for a forward that records no graph, one pass over x's rows (its
/// moments taken once), each output the same as [`layer_norm`]'s. None
/// where that does not run (on the CPU, with a graph, rows not of whole
/// 16-byte loads): then the two alone.
pub fn layer_norm_pair(
    x: &Tensor,
    first: (&Tensor, &Tensor, f64),
    second: (&Tensor, &Tensor, f64),
) -> Result<Option<(Tensor, Tensor)>> {
    let all = [x, first.0, first.1, second.0, second.1];
    if !super::on_cuda(&all) || all.iter().any(|t| t.track_op()) {
        return Ok(None);
    }
    let [x, w1, b1, w2, b2] = all.map(Tensor::contiguous);
    let (x, w1, b1, w2, b2) = (x?, w1?, b1?, w2?, b2?);
    let h = x.dim(candle_core::D::Minus1)?;
    let size = x.dtype().size_in_bytes();
    let on_16 = |t: &Tensor| (t.layout().start_offset() * size).is_multiple_of(16);
    // Whole 16-byte loads (the forward that holds a row's chunks, up to
    // 4,096 features), and rows of whole 256 bytes, so that the second
    // output lies as aligned as a buffer of its own for the products that
    // read it (their plans go by alignment).
    let fits = h.is_multiple_of(8)
        && h <= 4096
        && (h * size).is_multiple_of(256)
        && [&w1, &b1, &w2, &b2].iter().all(|p| p.dims() == [h] && on_16(p))
        && on_16(&x);
    if !fits {
        return Ok(None);
    }
    let op = LayerNormPair { eps: (first.2 as f32, second.2 as f32), second: (w2, b2) };
    let both = x.apply_op3_no_bwd(&w1, &b1, &op)?;
    Ok(Some((both.get(0)?, both.get(1)?)))
}

/// [`layer_norm_pair`]'s op on (x, first weight, first bias); it holds the second's.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct LayerNormPair {
    eps: (f32, f32),
    second: (Tensor, Tensor),
}

impl CustomOp3 for LayerNormPair {
    fn name(&self) -> &'static str {
        "layer-norm-pair"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("a LayerNorm pair runs on a GPU")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        w: &CudaStorage,
        w_l: &Layout,
        b: &CudaStorage,
        b_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let ((w2, w2_l), (b2, b2_l)) = (self.second.0.storage_and_layout(), self.second.1.storage_and_layout());
        let (candle_core::Storage::Cuda(w2), candle_core::Storage::Cuda(b2)) = (&*w2, &*b2) else {
            candle_core::bail!("a LayerNorm pair: the second norm's weights are not on the GPU")
        };
        let params = [(w, w_l), (b, b_l), (w2, w2_l), (b2, b2_l)];
        let mut dims = vec![2];
        dims.extend_from_slice(x_l.dims());
        Ok((super::cuda::layer_norm_pair(x, x_l, &params, self.eps)?, Shape::from(dims)))
    }
}

/// What makes [`layer_norm`]'s values again, as [`rms_norm_remake`] does.
pub fn layer_norm_remake(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Option<Remake> {
    let all = [x, weight, bias];
    if !(super::runs(&all) && all.iter().any(|t| t.track_op())) {
        return None;
    }
    let [x, weight, bias] = all.map(Tensor::detach);
    Some(Arc::new(move || layer_norm(&x, &weight, &bias, eps)))
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dimension, as `x` is
/// shaped: no reshape node keeps the output, so that the ops it feeds may
/// keep only its place and make it again ([`rms_norm_remake`]).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if !super::runs(&[x, weight]) {
        return ops::rmsnorm(x, weight, eps);
    }
    x.contiguous()?.apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })
}

/// What makes [`rms_norm`]'s values again, without a graph, for a backward
/// that did not keep them (see `kernels::linear_remade`): None where
/// neither input records a graph, or the op does not run.
pub fn rms_norm_remake(x: &Tensor, weight: &Tensor, eps: f64) -> Option<Remake> {
    if !(super::runs(&[x, weight]) && (x.track_op() || weight.track_op())) {
        return None;
    }
    let (x, weight) = (x.detach(), weight.detach());
    Some(Arc::new(move || rms_norm(&x, &weight, eps)))
}

/// Mean and 1 / std of a row.
#[inline(always)]
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = sum_of(row, |x| x) / n;
    let var = sum_of(row, |x| (x - mean) * (x - mean)) / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// 1 / sqrt(mean(x^2) + eps) of a row.
#[inline(always)]
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    1.0 / (sum_of(row, |x| x * x) / row.len() as f32 + eps).sqrt()
}

/// Applies `per_row(input row, output row)` to every row, in parallel.
fn map_rows(input: &[f32], h: usize, per_row: impl Fn(&[f32], &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = vec![0f32; input.len()];
    let chunk = rows_per_task(h) * h;
    out.par_chunks_mut(chunk).zip(input.par_chunks(chunk)).for_each(|(out, input)| {
        with_avx2(
            #[inline(always)]
            || {
                for (o, x) in out.chunks_mut(h).zip(input.chunks(h)) {
                    per_row(x, o);
                }
            },
        )
    });
    out
}

/// For every row i, `per_row(i, d input row, column sums)`, in parallel;
/// returns the d input rows followed by the `sums` column-sum rows.
fn grad_rows(n: usize, h: usize, sums: usize, per_row: impl Fn(usize, &mut [f32], &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = vec![0f32; (n + sums) * h];
    let per_task = rows_per_task(h);
    let partials: Vec<Vec<f32>> = out[..n * h]
        .par_chunks_mut(per_task * h)
        .enumerate()
        .map(|(task, dx)| {
            let mut acc = vec![0f32; sums * h];
            for (r, dx) in dx.chunks_mut(h).enumerate() {
                per_row(task * per_task + r, dx, &mut acc);
            }
            acc
        })
        .collect();
    let tail = &mut out[n * h..];
    for acc in partials {
        for (t, a) in tail.iter_mut().zip(acc) {
            *t += a;
        }
    }
    out
}

struct LayerNorm {
    eps: f32,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
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
        b: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, b) = (contiguous_f32(x, x_l)?, contiguous_f32(w, w_l)?, contiguous_f32(b, b_l)?);
        Ok((CpuStorage::F32(layer_norm_rows(x, w, b, self.eps)), x_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        x_l: &Layout,
        w: &CudaStorage,
        w_l: &Layout,
        b: &CudaStorage,
        b_l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        Ok((super::cuda::norm_fwd("layer_norm_fwd", x, x_l, &[(w, w_l), (b, b_l)], self.eps)?, x_l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _b: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<BwdOut3> {
        let h = w.elem_count();
        let (rows, grad) = (x.reshape(((), h))?, grad.contiguous()?.reshape(((), h))?);
        let (dx, dw, db) = layer_norm_grads(&rows, w, &grad, self.eps)?;
        Ok((Some(dx.reshape(x.shape())?), Some(dw), Some(db)))
    }
}

/// The layer norm of each row of `x` (rows of `w.len()`), in f32.
pub(super) fn layer_norm_rows(x: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    map_rows(x, w.len(), |x, y| {
        let (mean, rstd) = moments(x, eps);
        for (((y, x), w), b) in y.iter_mut().zip(x).zip(w).zip(b) {
            *y = (x - mean) * rstd * w + b;
        }
    })
}

/// [`layer_norm`] of rows `x` (N, H), recording no backward: for a
/// backward that makes the norm's output again.
pub(super) fn layer_norm_without_graph(x: &Tensor, w: &Tensor, b: &Tensor, eps: f32) -> Result<Tensor> {
    x.apply_op3_no_bwd(w, b, &LayerNorm { eps })
}

/// d x, d weight and d bias of a layer norm of rows `x` (N, H) for d y.
pub(super) fn layer_norm_grads(x: &Tensor, w: &Tensor, grad: &Tensor, eps: f32) -> Result<(Tensor, Tensor, Tensor)> {
    if x.device().is_cuda() {
        let (dx, dw, db) = gpu_grads("layer_norm_bwd", x, w, grad, eps, true)?;
        let db = db.ok_or_else(|| candle_core::Error::Msg("layer-norm: no bias gradient".into()))?;
        return Ok((dx, dw, db));
    }
    let n = x.dim(0)?;
    let all = x.apply_op3_no_bwd(w, &grad.contiguous()?, &LayerNormGrad { eps })?;
    Ok((all.narrow(0, 0, n)?, all.get(n)?, all.get(n + 1)?))
}

/// A norm's gradients on a GPU: the kernel writes d x in the input's dtype
/// and each row's part of d weight in f32, summed by a product with a row
/// of ones (`row_sums`); d bias, when asked, is d y's sum the same way.
fn gpu_grads(kernel: &str, x: &Tensor, w: &Tensor, grad: &Tensor, eps: f32, bias: bool) -> Result<BwdOut3Some> {
    #[cfg(feature = "cuda")]
    {
        use candle_core::{op::BackpropOp, Storage};
        let grad = grad.contiguous()?;
        let (dx, rows) = {
            let ((xs, x_l), (ws, w_l), (gs, g_l)) =
                (x.storage_and_layout(), w.storage_and_layout(), grad.storage_and_layout());
            let (Storage::Cuda(xs), Storage::Cuda(ws), Storage::Cuda(gs)) = (&*xs, &*ws, &*gs) else {
                candle_core::bail!("{kernel}: an input is not on the GPU")
            };
            super::cuda::norm_bwd(kernel, (xs, x_l), (ws, w_l), (gs, g_l), eps)?
        };
        let (n, h) = (x.dim(0)?, w.elem_count());
        let dx = Tensor::from_storage(Storage::Cuda(dx), x.shape(), BackpropOp::none(), false);
        let rows = Tensor::from_storage(Storage::Cuda(rows), (n, h), BackpropOp::none(), false);
        let column_sums = |t: &Tensor| super::linear::row_sums(t)?.reshape(h)?.to_dtype(w.dtype());
        let db = if bias { Some(column_sums(&grad)?) } else { None };
        Ok((dx, column_sums(&rows)?, db))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, w, grad, eps, bias);
        candle_core::bail!("{kernel} runs on CUDA only")
    }
}

/// d x, d weight and d bias (when asked).
type BwdOut3Some = (Tensor, Tensor, Option<Tensor>);

/// (x, weight, d y) -> [d x; d weight; d bias].
struct LayerNormGrad {
    eps: f32,
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, g) = (contiguous_f32(x, x_l)?, contiguous_f32(w, w_l)?, contiguous_f32(g, g_l)?);
        let h = w.len();
        let n = x.len() / h;
        // With x^ = (x - mean) rstd and g^ = g w:
        // dx = rstd (g^ - mean(g^) - x^ mean(g^ x^)); dw = sum g x^; db = sum g.
        let out = grad_rows(n, h, 2, |i, dx, acc| {
            let (x, g) = (&x[i * h..(i + 1) * h], &g[i * h..(i + 1) * h]);
            let (mean, rstd) = moments(x, self.eps);
            let (mut mean_g, mut mean_gx) = (0f32, 0f32);
            for j in 0..h {
                let xh = (x[j] - mean) * rstd;
                let gh = g[j] * w[j];
                mean_g += gh;
                mean_gx += gh * xh;
                acc[j] += g[j] * xh;
                acc[h + j] += g[j];
            }
            let (mean_g, mean_gx) = (mean_g / h as f32, mean_gx / h as f32);
            for j in 0..h {
                let xh = (x[j] - mean) * rstd;
                dx[j] = rstd * (g[j] * w[j] - mean_g - xh * mean_gx);
            }
        });
        Ok((CpuStorage::F32(out), Shape::from((n + 2, h))))
    }
}

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    fn cpu_fwd(&self, x: &CpuStorage, x_l: &Layout, w: &CpuStorage, w_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (contiguous_f32(x, x_l)?, contiguous_f32(w, w_l)?);
        let y = map_rows(x, w.len(), |x, y| {
            let r = inv_rms(x, self.eps);
            for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                *y = x * r * w;
            }
        });
        Ok((CpuStorage::F32(y), x_l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &CudaStorage, x_l: &Layout, w: &CudaStorage, w_l: &Layout) -> Result<(CudaStorage, Shape)> {
        Ok((super::cuda::norm_fwd("rms_norm_fwd", x, x_l, &[(w, w_l)], self.eps)?, x_l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let h = w.elem_count();
        let (rows, grad) = (x.reshape(((), h))?, grad.contiguous()?.reshape(((), h))?);
        if x.device().is_cuda() {
            let (dx, dw, _) = gpu_grads("rms_norm_bwd", &rows, w, &grad, self.eps, false)?;
            return Ok((Some(dx.reshape(x.shape())?), Some(dw)));
        }
        let n = rows.dim(0)?;
        let all = rows.apply_op3_no_bwd(w, &grad, &RmsNormGrad { eps: self.eps })?;
        Ok((Some(all.narrow(0, 0, n)?.reshape(x.shape())?), Some(all.get(n)?)))
    }
}

/// (x, weight, d y) -> [d x; d weight].
struct RmsNormGrad {
    eps: f32,
}

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "rms-norm-grad"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
        g: &CpuStorage,
        g_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, g) = (contiguous_f32(x, x_l)?, contiguous_f32(w, w_l)?, contiguous_f32(g, g_l)?);
        let h = w.len();
        let n = x.len() / h;
        // With x^ = x r and g^ = g w: dx = r (g^ - x^ mean(g^ x^)); dw = sum g x^.
        let out = grad_rows(n, h, 1, |i, dx, acc| {
            let (x, g) = (&x[i * h..(i + 1) * h], &g[i * h..(i + 1) * h]);
            let r = inv_rms(x, self.eps);
            let mut mean_gx = 0f32;
            for j in 0..h {
                mean_gx += g[j] * w[j] * x[j] * r;
                acc[j] += g[j] * x[j] * r;
            }
            let mean_gx = mean_gx / h as f32;
            for j in 0..h {
                dx[j] = r * (g[j] * w[j] - x[j] * r * mean_gx);
            }
        });
        Ok((CpuStorage::F32(out), Shape::from((n + 1, h))))
    }
}
