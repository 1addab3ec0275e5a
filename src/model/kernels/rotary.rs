//! Rotary position embeddings in rotate-half layout, in place over each
//! head's first R features, forward and backward (the backward rotates by
//! the opposite angle: the rotation's transpose). Used where q and k go
//! through the cache; whole-sequence attention rotates inside its kernel.

use std::sync::Arc;

use candle_core::op::Op;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::contiguous_f32;

/// Host copies of the (B, T, R) cos and sin tables of one forward pass.
#[derive(Clone, Default)]
pub struct RotaryTables {
    pub cos: Arc<Vec<f32>>,
    pub sin: Arc<Vec<f32>>,
    /// R, even; 0 for no rotation.
    pub dim: usize,
}

impl RotaryTables {
    /// From (B, 1, T, R) tables.
    pub fn new(cos: &Tensor, sin: &Tensor) -> Result<Self> {
        let host = |t: &Tensor| -> Result<Arc<Vec<f32>>> { Ok(Arc::new(t.flatten_all()?.to_vec1()?)) };
        Ok(Self { cos: host(cos)?, sin: host(sin)?, dim: cos.dim(3)? })
    }

    /// Rotates the first R features of one head's row `x` at table row
    /// `at` (b * T + t); `inverse` rotates back.
    #[inline(always)]
    pub fn rotate(&self, x: &mut [f32], at: usize, inverse: bool) {
        let r = self.dim;
        if r == 0 {
            return;
        }
        let (cos, sin) = (&self.cos[at * r..(at + 1) * r], &self.sin[at * r..(at + 1) * r]);
        let half = r / 2;
        let sign = if inverse { -1.0 } else { 1.0 };
        for i in 0..half {
            let (x1, x2) = (x[i], x[i + half]);
            x[i] = x1 * cos[i] - sign * x2 * sin[i];
            x[i + half] = x2 * cos[i + half] + sign * x1 * sin[i + half];
        }
    }
}

/// x: (B, H, T, D) with D >= R. Returns x with each head rotated.
pub fn rotary(x: &Tensor, tables: &RotaryTables) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Rotary { tables: tables.clone(), inverse: false })
}

/// x (B, H, T, D) rotated by the (B, 1, T, R) tables where they lie: the
/// CUDA kernel on a GPU, the composition elsewhere (the CPU kernel reads
/// host tables: [`rotary`]).
pub fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if !super::on_cuda(&[x]) {
        return crate::model::ops::apply_rotary(x, cos, sin);
    }
    let table = |t: &Tensor| t.to_dtype(candle_core::DType::F32)?.contiguous();
    let (cos, sin) = (table(cos)?, table(sin)?);
    // The backward rotates the gradient back and reads no value of x: the
    // node keeps only its place.
    let values = x.detach().contiguous()?.apply_op3(&cos, &sin, RotaryOnDevice { sign: 1.0 })?;
    let op = |p: &[Tensor]| Op::CustomOp3(p[0].clone(), cos, sin, Arc::new(Box::new(RotaryOnDevice { sign: 1.0 })));
    super::elementwise::on_places(values, &[x], op)
}

/// The CUDA kernel's op: x, cos, sin -> x rotated; `sign` -1 rotates back.
struct RotaryOnDevice {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    sign: f32,
}

impl candle_core::CustomOp3 for RotaryOnDevice {
    fn name(&self) -> &'static str {
        "rotary-on-device"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    super::cuda_only_cpu_fwd!(3);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        cos: &candle_core::CudaStorage,
        cos_l: &Layout,
        sin: &candle_core::CudaStorage,
        sin_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::rotary((x, x_l), (cos, cos_l), (sin, sin_l), self.sign)?, x_l.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let back = RotaryOnDevice { sign: -self.sign };
        Ok((Some(grad.contiguous()?.apply_op3_no_bwd(cos, sin, &back)?), None, None))
    }
}

struct Rotary {
    tables: RotaryTables,
    inverse: bool,
}

impl CustomOp1 for Rotary {
    fn name(&self) -> &'static str {
        "rotary"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s, l)?;
        let &[b, h, t, d] = l.dims() else { candle_core::bail!("rotary: expected (B, H, T, D), got {:?}", l.dims()) };
        if self.tables.dim > d || self.tables.cos.len() != b * t * self.tables.dim {
            candle_core::bail!("rotary: tables of {} for {b} x {t} positions of {d} features", self.tables.cos.len());
        }
        let mut out = x.to_vec();
        out.par_chunks_mut(t * d).enumerate().for_each(|(bh, head)| {
            let bi = bh / h;
            for (ti, row) in head.chunks_mut(d).enumerate() {
                self.tables.rotate(row, bi * t + ti, self.inverse);
            }
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let back = Rotary { tables: self.tables.clone(), inverse: !self.inverse };
        Ok(Some(grad.contiguous()?.apply_op1(back)?))
    }
}
