//! Whole-sequence attention on a GPU straight from a fused q/k/v
//! projection (B, T, 3 H D), as GPT-NeoX and GPT-2 compute one: a launch
//! cuts the heads out of it, rotating q and k; the attention kernels run on
//! them; the output comes back as (B, T, H D), the output projection's
//! input. The heads are not kept: the backward cuts them again from the
//! projection, which the graph holds anyway, runs the attention's backward
//! and writes the projection's gradient in one launch.
//!
//! The composition it replaces keeps six more tensors of the layer's size
//! for the backward (q, k and v transposed, q and k rotated, the output
//! before its transpose), and its backward adds three zero-padded
//! concatenations of the projection's size (one per narrowed part) and
//! their sums. Chosen with `RLOO_ATTENTION_HEADS=fused`.

use std::sync::Mutex;

use candle_core::{CustomOp1, CustomOp2, DType, Result, Tensor};
#[cfg(feature = "cuda")]
use candle_core::{Layout, Shape};

use super::sdpa::{kernels_taking, row_dots, GradState, OutRows};
use super::{AttentionKernels, AttentionMask, Packing};
use crate::model::device::variant;

/// Picks how attention over whole sequences gets its heads from a fused
/// projection on a GPU: `fused` (the default: [`qkv_attention`]) or
/// `composed` (transposed copies and rotations, op by op), to compare the
/// two.
pub const ATTENTION_HEADS_VAR: &str = "RLOO_ATTENTION_HEADS";

/// Whether the fused heads are chosen; an unknown choice is an error.
pub fn attention_heads_fused() -> Result<bool> {
    Ok(variant(ATTENTION_HEADS_VAR, &["fused", "composed"]).map_err(candle_core::Error::msg)? == "fused")
}

/// Attention (B, T, heads * d) over the fused projection `fused` (B, T, W)
/// laid out by `packing`, q and k rotated by `rotary`'s (B, 1, T, R)
/// tables, under `mask` (a bias (B, 1, T, T), or spans for the flash
/// kernels), by the `chosen` kernels where they take it (else the rows
/// ones, as [`super::sdpa_with`]). None where it does not run: off a GPU,
/// a projection that is not exactly the three parts, or sizes no attention
/// kernel takes.
#[allow(clippy::too_many_arguments)]
pub fn qkv_attention(
    fused: &Tensor,
    packing: Packing,
    heads: usize,
    d: usize,
    rotary: Option<&(Tensor, Tensor)>,
    mask: &AttentionMask,
    scale: f64,
    chosen: AttentionKernels,
) -> Result<Option<Tensor>> {
    if !super::on_cuda(&[fused]) {
        return Ok(None);
    }
    let (b, t, width) = fused.dims3()?;
    let r = rotary.map_or(Ok(0), |(cos, _)| cos.dim(3))?;
    let tiled = tiles_the_row(packing, heads, d, width) && r <= d && r % 2 == 0;
    let (Some(kernels), true) = (kernels_taking(chosen, fused.dtype(), d, t, t), tiled) else { return Ok(None) };
    let dims = Dims { b, t, heads, d, r, width, packing };
    let tables = f32_tables(rotary, r)?;
    let op =
        QkvAttention { dims, tables, mask: mask.for_kernels()?, scale: scale as f32, kernels, lse: Mutex::new(None) };
    Ok(Some(fused.contiguous()?.apply_op1(op)?))
}

/// q, k and v (B, H, T, D) cut from the fused projection `fused` (B, T, W)
/// laid out by `packing` in one launch, q and k rotated by `rotary`'s
/// tables, without a graph (a prefill's): the values of the transposed
/// copies and rotations op by op (the rotary kernel and this one rotate a
/// feature with the same function), where those took five launches. None
/// off a GPU or for a projection that is not exactly the three parts.
pub fn qkv_heads(
    fused: &Tensor,
    packing: Packing,
    heads: usize,
    d: usize,
    rotary: Option<&(Tensor, Tensor)>,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    if !super::on_cuda(&[fused]) {
        return Ok(None);
    }
    let (b, t, width) = fused.dims3()?;
    let r = rotary.map_or(Ok(0), |(cos, _)| cos.dim(3))?;
    if !(tiles_the_row(packing, heads, d, width) && r <= d && r % 2 == 0) {
        return Ok(None);
    }
    let dims = Dims { b, t, heads, d, r, width, packing };
    let qkv = fused.detach().contiguous()?.apply_op1_no_bwd(&Split { dims, tables: f32_tables(rotary, r)? })?;
    Ok(Some((qkv.get(0)?, qkv.get(1)?, qkv.get(2)?)))
}

/// The rotary tables in f32, contiguous, where `r` features rotate.
fn f32_tables(rotary: Option<&(Tensor, Tensor)>, r: usize) -> Result<Option<(Tensor, Tensor)>> {
    let table = |x: &Tensor| x.to_dtype(DType::F32)?.contiguous();
    match rotary {
        Some((cos, sin)) if r > 0 => Ok(Some((table(cos)?, table(sin)?))),
        _ => Ok(None),
    }
}

/// Whether the parts of `packing` cover a row of `width` exactly once.
fn tiles_the_row(p: Packing, heads: usize, d: usize, width: usize) -> bool {
    if width != 3 * heads * d {
        return false;
    }
    let mut seen = vec![false; width];
    for h in 0..heads {
        for offset in [p.q, p.k, p.v] {
            for e in 0..d {
                match seen.get_mut(h * p.head_stride + offset + e) {
                    Some(slot) if !*slot => *slot = true,
                    _ => return false,
                }
            }
        }
    }
    true
}

#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Dims {
    b: usize,
    t: usize,
    heads: usize,
    d: usize,
    r: usize,
    width: usize,
    packing: Packing,
}

#[cfg(feature = "cuda")]
impl Dims {
    fn kernel(&self) -> super::cuda::HeadsDims {
        let p = self.packing;
        super::cuda::HeadsDims {
            width: self.width as i64,
            head_stride: p.head_stride as i64,
            offset: [p.q as i64, p.k as i64, p.v as i64],
            batch: self.b as i32,
            h: self.heads as i32,
            t: self.t as i32,
            d: self.d as i32,
            r: self.r as i32,
        }
    }
}

/// The (cos, sin) f32 tables' storages, for a kernel's arguments.
#[cfg(feature = "cuda")]
fn with_tables<R>(
    tables: &Option<(Tensor, Tensor)>,
    f: impl FnOnce(Option<((&candle_core::CudaStorage, &Layout), (&candle_core::CudaStorage, &Layout))>) -> Result<R>,
) -> Result<R> {
    let Some((cos, sin)) = tables else { return f(None) };
    let ((cos_s, cos_l), (sin_s, sin_l)) = (cos.storage_and_layout(), sin.storage_and_layout());
    match (&*cos_s, &*sin_s) {
        (candle_core::Storage::Cuda(c), candle_core::Storage::Cuda(s)) => f(Some(((c, cos_l), (s, sin_l)))),
        _ => candle_core::bail!("qkv-attention: the rotary tables are not on the GPU"),
    }
}

struct QkvAttention {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    dims: Dims,
    tables: Option<(Tensor, Tensor)>,
    mask: AttentionMask,
    scale: f32,
    kernels: AttentionKernels,
    /// Each row's log-sum-exp (B, H, T), kept by the forward for the backward.
    lse: Mutex<Option<Tensor>>,
}

impl CustomOp1 for QkvAttention {
    fn name(&self) -> &'static str {
        "qkv-attention"
    }

    super::cuda_only_cpu_fwd!(1);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, fused: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let Dims { b, t, heads, d, .. } = self.dims;
        let (out, lse) = self.mask.on_gpu(|mask| {
            with_tables(&self.tables, |tables| {
                super::cuda::qkv_attention_fwd((fused, l), tables, mask, self.dims.kernel(), self.scale, self.kernels)
            })
        })?;
        let lse = Tensor::from_storage(
            candle_core::Storage::Cuda(lse),
            (b, heads, t),
            candle_core::op::BackpropOp::none(),
            false,
        );
        *self.lse.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(lse);
        Ok((out, Shape::from((b, t, heads * d))))
    }

    fn bwd(&self, fused: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let Some(lse) = self.lse.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() else {
            candle_core::bail!("qkv-attention: backward without a forward")
        };
        let Dims { b, t, heads, d, .. } = self.dims;
        let qkv = fused.apply_op1_no_bwd(&Split { dims: self.dims, tables: self.tables.clone() })?;
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let by_head = |x: &Tensor| x.reshape((b, t, heads, d));
        let grad = by_head(&grad.contiguous()?)?;
        // Over the (B, T, H) rows as they lie, then in the kernels' (B, H, T) order.
        let di = row_dots(&grad, &by_head(out)?)?.transpose(1, 2)?.contiguous()?;
        let grad_rows = self.kernels.projection_rows();
        let grad = match grad_rows {
            OutRows::ByToken => grad,
            OutRows::ByHead => grad.transpose(1, 2)?.contiguous()?,
        };
        let state =
            GradState { mask: self.mask.clone(), lse, grad, di, scale: self.scale, kernels: self.kernels, grad_rows };
        let (dq, dkv) = state.grads(&q, &k, &v)?;
        Ok(Some(dq.apply_op2_no_bwd(&dkv, &Merge { dims: self.dims, tables: self.tables.clone() })?))
    }
}

/// The heads (3, B, H, T, D) of the projection, q and k rotated.
struct Split {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    dims: Dims,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tables: Option<(Tensor, Tensor)>,
}

impl CustomOp1 for Split {
    fn name(&self) -> &'static str {
        "qkv-heads-split"
    }

    super::cuda_only_cpu_fwd!(1);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, fused: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let Dims { b, t, heads, d, .. } = self.dims;
        let out = with_tables(&self.tables, |tables| super::cuda::heads_split((fused, l), tables, self.dims.kernel()))?;
        Ok((out, Shape::from(vec![3, b, heads, t, d])))
    }
}

/// The projection's gradient (B, T, W) from d q and d k, d v stacked.
struct Merge {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    dims: Dims,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tables: Option<(Tensor, Tensor)>,
}

impl CustomOp2 for Merge {
    fn name(&self) -> &'static str {
        "qkv-heads-merge"
    }

    super::cuda_only_cpu_fwd!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dq: &candle_core::CudaStorage,
        dq_l: &Layout,
        dkv: &candle_core::CudaStorage,
        dkv_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let Dims { b, t, width, .. } = self.dims;
        let out = with_tables(&self.tables, |tables| {
            super::cuda::heads_merge((dq, dq_l), (dkv, dkv_l), tables, self.dims.kernel())
        })?;
        Ok((out, Shape::from((b, t, width))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_packings_that_tile_the_row_once_are_taken() {
        // GPT-NeoX: each head's [q | k | v]; GPT-2: [Q | K | V].
        let neox = Packing { q: 0, k: 8, v: 16, head_stride: 24 };
        let gpt2 = Packing { q: 0, k: 32, v: 64, head_stride: 8 };
        assert!(tiles_the_row(neox, 4, 8, 96));
        assert!(tiles_the_row(gpt2, 4, 8, 96));
        // A wider row (another part), overlapping parts, parts past the row.
        assert!(!tiles_the_row(neox, 4, 8, 104));
        assert!(!tiles_the_row(Packing { q: 0, k: 0, v: 16, head_stride: 24 }, 4, 8, 96));
        assert!(!tiles_the_row(Packing { q: 0, k: 8, v: 16, head_stride: 32 }, 4, 8, 96));
    }
}
