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
mod decode_attention;
mod elementwise;
mod linear;
pub(crate) mod math;
mod norm;
mod rotary;
mod token_logprobs;

pub use adamw::{adamw, AdamWStep};
pub use attention::{attention, attention_packed, AttentionInputs, Packing};
pub use decode_attention::decode_attention;
pub use elementwise::activation;
pub use linear::linear;
pub use norm::{layer_norm, rms_norm};
pub use rotary::{rotary, RotaryTables};
pub use token_logprobs::token_logprobs;

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

/// Whether the fused CPU kernels can run on `t`.
pub fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// The f32 elements of a contiguous input.
fn contiguous_f32<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&storage.as_slice::<f32>()?[start..end]),
        None => candle_core::bail!("fused kernel: input of shape {:?} is not contiguous", layout.dims()),
    }
}

/// Rows of `width` elements per parallel task: about 16K elements, enough
/// work to amortise a task's dispatch.
fn rows_per_task(width: usize) -> usize {
    (16_384 / width.max(1)).max(1)
}

#[cfg(test)]
mod tests;
