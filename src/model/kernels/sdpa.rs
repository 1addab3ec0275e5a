//! Scaled dot-product attention over heads already rotated, q (B, H, T, D)
//! against k, v (B, Hkv, S, D) with an additive bias (B, 1, T, S): the CUDA
//! kernel on a GPU (no (T, S) scores or probabilities in global memory, the
//! backward recomputes them from each row's log-sum-exp), the composition of
//! candle ops elsewhere. Keys may be a view into a KV cache's buffers.

use std::sync::Mutex;

use candle_core::{CustomOp3, DType, Device, Layout, Result, Tensor};

#[cfg(feature = "cuda")]
use super::cuda::tensor_attention_fits;
use crate::model::device::variant;
use crate::model::ops;

/// Rows whose scores fit the kernel's shared memory (48 KiB of floats,
/// less the scratch); longer ones take the composition.
const MAX_KEYS: usize = 11_000;

/// Picks the GPU's kernels for whole sequences: `flash` (the default:
/// tiles on tensor cores with the scores in registers as mma.sync
/// fragments, in bf16 at head sizes 64, 128 and 256; the rows kernels
/// elsewhere), `tensor` (the same tiles through WMMA, scores staged in
/// shared memory) or `rows` (a block per query row, and per key row for
/// d k and d v).
pub const ATTENTION_VAR: &str = "RLOO_ATTENTION";

/// The GPU kernels [`ATTENTION_VAR`] picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernels {
    Rows,
    Tensor,
    Flash,
}

impl AttentionKernels {
    /// Whether these are tiles on tensor cores (bf16, head sizes 64, 128, 256).
    pub fn on_tensor_cores(self) -> bool {
        self != Self::Rows
    }

    /// How these kernels lay attention's output and read its gradient when
    /// the output goes to the output projection: the flash ones as the
    /// projection takes it, the others by head (transposed after).
    pub(super) fn projection_rows(self) -> OutRows {
        match self {
            Self::Flash => OutRows::ByToken,
            Self::Rows | Self::Tensor => OutRows::ByHead,
        }
    }
}

/// How attention's output and its gradient lie: (B, H, T, D) rows, which
/// every kernel takes, or (B, T, H, D), the output projection's input,
/// which the flash kernels also write and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OutRows {
    ByHead,
    ByToken,
}

/// The kernels chosen; an unknown choice is an error.
pub fn attention_kernels() -> Result<AttentionKernels> {
    match variant(ATTENTION_VAR, &["flash", "tensor", "rows"]).map_err(candle_core::Error::msg)? {
        "rows" => Ok(AttentionKernels::Rows),
        "tensor" => Ok(AttentionKernels::Tensor),
        _ => Ok(AttentionKernels::Flash),
    }
}

/// Picks what masks the flash kernels where each query sees at most two
/// runs of keys (a prompt and its own part, or one causal run): `spans`
/// (the default: the runs, 16 bytes a query, and only the tiles they
/// cover are visited) or `bias` (the (T, S) bias, every tile considered),
/// to compare them.
pub const ATTENTION_MASK_VAR: &str = "RLOO_ATTENTION_MASK";

/// Whether spans are chosen; an unknown choice is an error.
pub fn attention_spans_chosen() -> Result<bool> {
    Ok(variant(ATTENTION_MASK_VAR, &["spans", "bias"]).map_err(candle_core::Error::msg)? == "spans")
}

/// What masks attention over whole sequences: the additive bias (B, 1, T,
/// S), or, for the flash kernels, each query's runs of keys on the GPU.
#[derive(Clone)]
pub enum AttentionMask {
    Bias(Tensor),
    Spans(DeviceSpans),
}

/// [`crate::model::batch::AttentionSpans`] on a device: (B T, 4) and
/// (B blocks, 2) u32.
#[derive(Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct DeviceSpans {
    spans: Tensor,
    key_blocks: Tensor,
}

impl DeviceSpans {
    pub fn new(s: &crate::model::batch::AttentionSpans, device: &Device) -> Result<Self> {
        let flat = |rows: &[u32], width: usize| Tensor::from_slice(rows, (rows.len() / width, width), device);
        Ok(Self { spans: flat(s.spans.as_flattened(), 4)?, key_blocks: flat(s.key_blocks.as_flattened(), 2)? })
    }
}

impl AttentionMask {
    /// The mask as the kernels read it: a bias in f32, contiguous.
    pub(super) fn for_kernels(&self) -> Result<Self> {
        Ok(match self {
            Self::Bias(bias) => Self::Bias(bias.to_dtype(DType::F32)?.contiguous()?),
            spans => spans.clone(),
        })
    }

    /// `f` over the mask's GPU storages.
    #[cfg(feature = "cuda")]
    pub(super) fn on_gpu<R>(&self, f: impl FnOnce(super::cuda::MaskIn) -> Result<R>) -> Result<R> {
        use candle_core::Storage::Cuda;
        match self {
            Self::Bias(bias) => {
                let (storage, l) = bias.storage_and_layout();
                match &*storage {
                    Cuda(b) => f(super::cuda::MaskIn::Bias((b, l))),
                    _ => candle_core::bail!("attention: the bias is not on the GPU"),
                }
            }
            Self::Spans(s) => {
                let ((sg, sl), (kg, kl)) = (s.spans.storage_and_layout(), s.key_blocks.storage_and_layout());
                match (&*sg, &*kg) {
                    (Cuda(spans), Cuda(blocks)) => {
                        f(super::cuda::MaskIn::Spans { spans: (spans, sl), key_blocks: (blocks, kl) })
                    }
                    _ => candle_core::bail!("attention: the spans are not on the GPU"),
                }
            }
        }
    }
}

/// Whether the `chosen` kernels read spans for head size `d` in `dtype`
/// (on a GPU): the flash ones, where they take the inputs.
pub fn spans_taken(chosen: AttentionKernels, dtype: DType, d: usize) -> bool {
    chosen == AttentionKernels::Flash && dtype == DType::BF16 && tensor_attention_fits(d)
}

/// Returns (B, H, T, D).
pub fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    sdpa_with(q, k, v, &AttentionMask::Bias(bias.clone()), scale, attention_kernels()?)
}

/// [`sdpa`] under `mask` with the GPU kernels given (spans: the flash ones).
pub fn sdpa_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
    kernels: AttentionKernels,
) -> Result<Tensor> {
    Ok(sdpa_laid_out(q, k, v, mask, scale, kernels, OutRows::ByHead)?.0)
}

/// [`sdpa_with`] with each token's heads side by side, (B, T, H * D), as
/// the output projection takes them: the flash kernels write it so, where
/// the others' output is transposed after.
pub fn sdpa_merged(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
    kernels: AttentionKernels,
) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    match sdpa_laid_out(q, k, v, mask, scale, kernels, OutRows::ByToken)? {
        (out, OutRows::ByToken) => out.reshape((b, t, h * d)),
        (out, OutRows::ByHead) => out.transpose(1, 2)?.reshape((b, t, h * d)),
    }
}

/// The output as `rows` asks where the kernels that run write it so (the
/// flash ones), else (B, H, T, D); and how it lies.
fn sdpa_laid_out(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    scale: f64,
    kernels: AttentionKernels,
    rows: OutRows,
) -> Result<(Tensor, OutRows)> {
    let (_, h, t, d) = q.dims4()?;
    let (_, h_kv, s, _) = k.dims4()?;
    let Some(kernels) = kernels_taking(kernels, q.dtype(), d, t, s).filter(|_| super::on_cuda(&[q, k, v])) else {
        let AttentionMask::Bias(bias) = mask else {
            candle_core::bail!("sdpa: attention over spans runs on a GPU's flash kernels only")
        };
        let n_rep = h / h_kv;
        let out = ops::attention(q, &ops::repeat_kv(k, n_rep)?, &ops::repeat_kv(v, n_rep)?, bias, scale)?;
        return Ok((out, OutRows::ByHead));
    };
    let (k, v) = (cache_layout(k)?, cache_layout(v)?);
    let rows = match rows {
        OutRows::ByToken => kernels.projection_rows(),
        OutRows::ByHead => OutRows::ByHead,
    };
    let op = Sdpa { mask: mask.for_kernels()?, scale: scale as f32, kernels, rows, lse: Mutex::new(None) };
    Ok((q.contiguous()?.apply_op3(&k, &v, op)?, rows))
}

/// The GPU kernels that take `t` queries over `s` keys of head size `d` in
/// `dtype`, of the `chosen` ones: those on tensor cores where they run,
/// else the rows kernels while a row of scores fits shared memory; None
/// where only the composition does.
pub(super) fn kernels_taking(
    chosen: AttentionKernels,
    dtype: DType,
    d: usize,
    t: usize,
    s: usize,
) -> Option<AttentionKernels> {
    if chosen.on_tensor_cores() && dtype == DType::BF16 && tensor_attention_fits(d) {
        Some(chosen)
    } else {
        (s <= MAX_KEYS && t <= MAX_KEYS / 2).then_some(AttentionKernels::Rows)
    }
}

#[cfg(not(feature = "cuda"))]
fn tensor_attention_fits(_: usize) -> bool {
    false
}

/// `x` itself when its heads are evenly spaced rows of D features (a
/// contiguous tensor, or the filled slots of a cache buffer), else a copy.
fn cache_layout(x: &Tensor) -> Result<Tensor> {
    if head_stride(x.layout()).is_some() {
        Ok(x.clone())
    } else {
        x.contiguous()
    }
}

/// The elements between consecutive heads of a (B, Hkv, S, D) layout whose
/// rows are packed, if it is one.
fn head_stride(l: &Layout) -> Option<usize> {
    match (l.dims(), l.stride()) {
        ([_, h, _, d], [sb, sh, sr, 1]) if *sr == *d && *sb == h * sh => Some(*sh),
        _ => None,
    }
}

struct Sdpa {
    mask: AttentionMask,
    scale: f32,
    /// The rows kernels where the tiled ones do not take the inputs.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    kernels: AttentionKernels,
    /// How the output and its gradient lie.
    rows: OutRows,
    /// Each row's log-sum-exp (B, H, T), kept by the forward for the backward.
    lse: Mutex<Option<Tensor>>,
}

impl CustomOp3 for Sdpa {
    fn name(&self) -> &'static str {
        "sdpa"
    }

    super::cuda_only_cpu_fwd!(3);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let dims = attn_dims(q_l, k_l, v_l, self.scale)?.out_rows(self.rows);
        let (out, lse) = self
            .mask
            .on_gpu(|mask| super::cuda::attention_fwd((q, q_l), (k, k_l), (v, v_l), mask, dims, self.kernels))?;
        let (b, h, t) = (q_l.dims()[0], q_l.dims()[1], q_l.dims()[2]);
        let lse = Tensor::from_storage(
            candle_core::Storage::Cuda(lse),
            (b, h, t),
            candle_core::op::BackpropOp::none(),
            false,
        );
        *self.lse.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(lse);
        let d = q_l.dims()[3];
        let shape = match self.rows {
            OutRows::ByHead => q_l.shape().clone(),
            OutRows::ByToken => candle_core::Shape::from((b, t, h, d)),
        };
        Ok((out, shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(lse) = self.lse.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() else {
            candle_core::bail!("sdpa: backward without a forward")
        };
        let grad = grad.contiguous()?;
        let di = row_dots(&grad, &out.contiguous()?)?;
        // The kernels read di in (B, H, T) order.
        let di = match self.rows {
            OutRows::ByHead => di,
            OutRows::ByToken => di.transpose(1, 2)?.contiguous()?,
        };
        let state = GradState {
            mask: self.mask.clone(),
            lse,
            grad,
            di,
            scale: self.scale,
            kernels: self.kernels,
            grad_rows: self.rows,
        };
        let (dq, dkv) = state.grads(q, k, v)?;
        Ok((Some(dq), Some(dkv.get(0)?), Some(dkv.get(1)?)))
    }
}

/// di = rowsum(d out * out) over the last dimension, in f32: the softmax
/// backward's correction.
pub(super) fn row_dots(grad: &Tensor, out: &Tensor) -> Result<Tensor> {
    grad.apply_op2_no_bwd(out, &RowDots)
}

/// The f32 dot products of two tensors' last dimensions, in one launch
/// (where casts, a product and a sum took four).
struct RowDots;

impl candle_core::CustomOp2 for RowDots {
    fn name(&self) -> &'static str {
        "row-dots"
    }

    super::cuda_only_cpu_fwd!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        a_l: &Layout,
        b: &candle_core::CudaStorage,
        b_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let (&d, lead) = a_l.dims().split_last().unwrap_or((&0, &[]));
        Ok((super::cuda::row_dots((a, a_l), (b, b_l), d)?, candle_core::Shape::from(lead.to_vec())))
    }
}

/// What the backward kernels read beside q, k and v.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) struct GradState {
    pub mask: AttentionMask,
    pub lse: Tensor,
    pub grad: Tensor,
    pub di: Tensor,
    pub scale: f32,
    pub kernels: AttentionKernels,
    /// How `grad` lies.
    pub grad_rows: OutRows,
}

impl GradState {
    /// d q (B, H, T, D), and d k, d v stacked (2, B, Hkv, S, D).
    pub fn grads(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let dq = q.apply_op3_no_bwd(k, v, &SdpaGrad { state: self, keys: false })?;
        let dkv = q.apply_op3_no_bwd(k, v, &SdpaGrad { state: self, keys: true })?;
        Ok((dq, dkv))
    }
}

/// d q (`keys` false), or d k then d v stacked (2, B, Hkv, S, D).
struct SdpaGrad<'a> {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    state: &'a GradState,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    keys: bool,
}

impl CustomOp3 for SdpaGrad<'_> {
    fn name(&self) -> &'static str {
        "sdpa-grad"
    }

    super::cuda_only_cpu_fwd!(3);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        q_l: &Layout,
        k: &candle_core::CudaStorage,
        k_l: &Layout,
        v: &candle_core::CudaStorage,
        v_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let s = self.state;
        let dims = attn_dims(q_l, k_l, v_l, s.scale)?.out_rows(s.grad_rows);
        let guards = [&s.lse, &s.grad, &s.di].map(|t| t.storage_and_layout());
        let on_gpu = guards
            .iter()
            .map(|(storage, layout)| match &**storage {
                candle_core::Storage::Cuda(c) => Ok((c, *layout)),
                _ => candle_core::bail!("sdpa-grad: an input is not on the GPU"),
            })
            .collect::<Result<Vec<_>>>()?;
        let out = s.mask.on_gpu(|mask| {
            let inputs = super::cuda::AttnInputs {
                q: (q, q_l),
                k: (k, k_l),
                v: (v, v_l),
                mask,
                lse: on_gpu[0],
                grad: on_gpu[1],
                di: on_gpu[2],
            };
            super::cuda::attention_bwd(&inputs, dims, self.keys, s.kernels)
        })?;
        let shape = match self.keys {
            true => candle_core::Shape::from([&[2][..], k_l.dims()].concat()),
            false => q_l.shape().clone(),
        };
        Ok((out, shape))
    }
}

#[cfg(feature = "cuda")]
fn attn_dims(q_l: &Layout, k_l: &Layout, v_l: &Layout, scale: f32) -> Result<super::cuda::AttnDims> {
    let (&[_, h, t, d], &[_, h_kv, s, _]) = (q_l.dims(), k_l.dims()) else {
        candle_core::bail!("sdpa: q and k must be 4-d")
    };
    let kv_stride = match (head_stride(k_l), head_stride(v_l)) {
        (Some(k), Some(v)) if k == v && k_l.dims() == v_l.dims() => k,
        _ => candle_core::bail!("sdpa: keys {k_l:?} and values {v_l:?} are not packed rows of one layout"),
    };
    Ok(super::cuda::AttnDims::new([h, h_kv, t, s, d], kv_stride, scale))
}
