//! Fused CPU kernels, as candle custom ops. Each replaces a chain of small
//! candle ops (one allocation and one pass over memory per op) with one
//! multi-threaded pass, and each is tested against the differentiable
//! composition in [`super::ops`] it stands for.
//!
//! Kernels used by training carry their own backward pass; the others are
//! for sampling only and refuse one. On other devices and dtypes the entry
//! points fall back to the compositions.

mod adamw;
mod attention;
mod cast;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod decode_attention;
mod elementwise;
mod embedding;
mod finite;
mod gated;
mod linear;
mod lora;
pub(crate) mod math;
mod norm;
mod norm_linear;
mod qkv_attention;
mod remade;
mod rotary;
mod sdpa;
mod split_master;
mod squares;
mod token_logprobs;

pub use adamw::{adamw, adamw_many, AdamWParam, AdamWStep, ADAMW_VAR};
pub use attention::{attention, attention_packed, AttentionInputs, Packing};
pub use cast::{cast, cast_into, scale_to};
pub use decode_attention::{
    decode_append_fused, decode_attention, decode_attention_choice, decode_attention_cuda, decode_heads_grouped,
    decode_rows, decode_split_keys, rotary_append_cuda, DecodeAttention, DecodeKernel, DecodeRows,
};
pub use elementwise::{activation, add_cast, add_cast_to, contiguous, residual, sum2, sum3};
pub use embedding::gather_rows;
pub use finite::any_non_finite;
pub use gated::{gated_linear, gated_linear_remade, gated_product};
pub use linear::{
    activation_linear, activation_linear_remade, dense_bias_epilogue, linear, linear_remade, linear_with,
    rows_kernel_takes, DENSE_BIAS_VAR, GEMM_VAR,
};
pub use lora::{lora_forward, lora_forward_remade, LoraLayer, Mask};
pub use norm::{layer_norm, layer_norm_pair, layer_norm_remake, rms_norm, rms_norm_remake};
pub use norm_linear::{norm_linear, norm_linear_remake};
pub use qkv_attention::{attention_heads_fused, qkv_attention, qkv_heads, ATTENTION_HEADS_VAR};
pub use remade::{mlp_input_remade, Remake, MLP_INPUT_VAR};
pub use rotary::{rotary, rotate, RotaryTables};
pub use sdpa::{
    attention_kernels, attention_spans_chosen, sdpa, sdpa_merged, sdpa_with, spans_taken, AttentionKernels,
    AttentionMask, DeviceSpans, ATTENTION_MASK_VAR, ATTENTION_VAR,
};
pub use split_master::{masters_split, split_master_bytes, SplitMaster, MASTERS_VAR};
pub use squares::sums_of_squares;
pub use token_logprobs::{logits_chunk_rows, token_logprobs};

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

/// What the backward of an op of three inputs gives: each input's gradient, if any.
type BwdOut3 = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// The `cpu_fwd` of an op of 1, 2 or 3 inputs that runs on CUDA only.
macro_rules! cuda_only_cpu_fwd {
    (1) => { super::cuda_only_cpu_fwd!(candle_core::CustomOp1: _a); };
    (2) => { super::cuda_only_cpu_fwd!(candle_core::CustomOp2: _a _b); };
    (3) => { super::cuda_only_cpu_fwd!(candle_core::CustomOp3: _a _b _c); };
    // One storage and its layout per input.
    ($op:path: $($input:ident)+) => {
        fn cpu_fwd(
            &self,
            $($input: &candle_core::CpuStorage, _: &candle_core::Layout,)+
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            candle_core::bail!("{} runs on CUDA only", <Self as $op>::name(self))
        }
    };
}
use cuda_only_cpu_fwd;

/// Whether the fused CPU kernels can run on `t`.
pub fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// Whether the CUDA kernels can run on all of `ts`: tensors of one dtype,
/// f32 or bf16, on a GPU (and rloo built with CUDA).
pub fn on_cuda(ts: &[&Tensor]) -> bool {
    let dtype = ts.first().map(|t| t.dtype());
    cfg!(feature = "cuda")
        && matches!(dtype, Some(DType::F32 | DType::BF16))
        && ts.iter().all(|t| t.device().is_cuda() && Some(t.dtype()) == dtype)
}

/// Whether the kernels that write in place run on `device`: the CPU, or a
/// GPU where rloo is built with CUDA.
fn in_place_runs(device: &candle_core::Device) -> bool {
    device.is_cpu() || (cfg!(feature = "cuda") && device.is_cuda())
}

/// Whether a kernel with both implementations runs on `ts` (else its
/// composition does).
fn runs(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| fused(t)) || on_cuda(ts)
}

/// Runs `f` on `t`'s CPU storage, lent mutably, and its layout: candle
/// lends a storage mutably only to an in-place op, so `f` runs as one
/// (nested, to write several tensors in one pass).
fn cpu_storage_mut<R>(t: &Tensor, f: impl FnOnce(&mut CpuStorage, &Layout) -> Result<R>) -> Result<R> {
    struct Lend<F, R>(std::cell::RefCell<Option<F>>, std::cell::RefCell<Option<R>>);
    impl<F: FnOnce(&mut CpuStorage, &Layout) -> Result<R>, R> candle_core::InplaceOp1 for Lend<F, R> {
        fn name(&self) -> &'static str {
            "lend-storage"
        }

        fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
            let Some(f) = self.0.borrow_mut().take() else { candle_core::bail!("lend-storage: lent twice") };
            *self.1.borrow_mut() = Some(f(storage, layout)?);
            Ok(())
        }
    }
    let lend = Lend(Some(f).into(), None.into());
    t.inplace_op1(&lend)?;
    lend.1.into_inner().ok_or_else(|| candle_core::Error::msg("lend-storage: not lent"))
}

/// The f32 elements of a contiguous input.
fn contiguous_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&storage.as_slice::<f32>()?[start..end]),
        None => candle_core::bail!("fused kernel: input of shape {:?} is not contiguous", layout.dims()),
    }
}

/// The elements of a contiguous operand written in place.
fn contiguous_mut<'a, T>(data: &'a mut [T], layout: &Layout) -> Result<&'a mut [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&mut data[start..end]),
        None => candle_core::bail!("fused kernel: operand of shape {:?} is not contiguous", layout.dims()),
    }
}

/// Rows of `width` elements per parallel task: about 16K elements, enough
/// work to amortise a task's dispatch.
fn rows_per_task(width: usize) -> usize {
    (16_384 / width.max(1)).max(1)
}

#[cfg(test)]
mod tests;

/// Normal samples for the kernels' tests from a generator seeded by the
/// test's name (libtest runs each test on a thread named after it), so that
/// a test sees the same inputs on every run and a failure repeats.
#[cfg(test)]
fn test_randn(shape: &[usize], mean: f32, std: f32) -> Tensor {
    thread_local! {
        static RNG: std::cell::RefCell<crate::rng::Rng> = {
            let name = std::thread::current().name().unwrap_or_default().bytes().map(u64::from).collect::<Vec<_>>();
            std::cell::RefCell::new(crate::rng::Rng::stream(0, &name))
        };
    }
    RNG.with(|rng| rng.borrow_mut().normal_tensor(shape, mean, std))
}
