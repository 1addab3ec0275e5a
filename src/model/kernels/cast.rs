//! Casts between f32 and bf16, and a scale in place, on the optimizer's
//! path: a gradient's first f32 sum (bf16 cast up), the compute copies
//! refreshed from the f32 masters after a step, and the sums scaled by
//! clipping. candle's casts load 2 bytes a thread on a GPU (bf16 to f32 ran
//! at about 0.6 TB/s) and, like its affine, write a new tensor that the
//! refresh then copies in; these take 8 elements a thread and write where
//! the result lives. The values are candle's, to the bit.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp1, InplaceOp2, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

/// `x` in `dtype`, without a graph. On a GPU, a contiguous bf16 `x` to f32
/// or f32 to bf16 goes through one kernel; anything else, and the CPU, is
/// candle's cast.
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if !(super::on_cuda(&[x]) && pair(x.dtype(), dtype) && x.is_contiguous()) {
        return x.detach().to_dtype(dtype);
    }
    x.detach().apply_op1_no_bwd(&Cast(dtype))
}

/// `x` cast to `dst`'s dtype and written over `dst`, whose storage stays
/// where it is (a network's compute copy of a weight, which a recorded
/// decoding step reads by its address): bf16 and f32 either way, of one
/// shape, `dst` contiguous, on the CPU or a GPU; else candle's cast, then
/// a copy into `dst`.
pub fn cast_into(dst: &Tensor, x: &Tensor) -> Result<()> {
    let takes = pair(x.dtype(), dst.dtype())
        && dst.is_contiguous()
        && dst.shape() == x.shape()
        && dst.device().same_device(x.device())
        && super::in_place_runs(dst.device());
    if !takes {
        return dst.slice_set(&x.to_dtype(dst.dtype())?, 0, 0);
    }
    dst.inplace_op2(&x.detach().contiguous()?, &CastInto)
}

/// `x * mul` written over `x`, whose storage no other tensor may share,
/// where it is contiguous f32 on the CPU or a GPU (candle's product by a
/// scalar is its affine with add 0: the same expression, the same bits);
/// else `x` becomes the new tensor candle's product makes.
pub fn scale_to(x: &mut Tensor, mul: f64) -> Result<()> {
    let takes = x.dtype() == DType::F32 && x.is_contiguous() && super::in_place_runs(x.device());
    if !takes {
        *x = (&*x * mul)?;
        return Ok(());
    }
    x.inplace_op1(&Affine { mul: mul as f32, add: 0.0 })
}

/// Whether the kernels cast `from` to `to`.
fn pair(from: DType, to: DType) -> bool {
    matches!((from, to), (DType::BF16, DType::F32) | (DType::F32, DType::BF16))
}

/// Elements per parallel task on the CPU.
const CHUNK: usize = 1 << 14;

/// The contiguous elements of an operand, from its layout.
fn span(l: &Layout, op: &str) -> Result<(usize, usize)> {
    l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{op}: a strided operand")))
}

struct Cast(DType);

impl CustomOp1 for Cast {
    fn name(&self) -> &'static str {
        "cast"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((x.to_dtype(l, self.0)?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::cast((x, l), self.0)?, l.shape().clone()))
    }
}

struct CastInto;

impl InplaceOp2 for CastInto {
    fn name(&self) -> &'static str {
        "cast-into"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout, x: &CpuStorage, x_l: &Layout) -> Result<()> {
        let ((start, end), (x_start, x_end)) = (span(dst_l, "cast-into")?, span(x_l, "cast-into")?);
        match (dst, x) {
            (CpuStorage::BF16(d), CpuStorage::F32(x)) => {
                convert(&mut d[start..end], &x[x_start..x_end], bf16::from_f32)
            }
            (CpuStorage::F32(d), CpuStorage::BF16(x)) => convert(&mut d[start..end], &x[x_start..x_end], bf16::to_f32),
            _ => candle_core::bail!("cast-into: bf16 to f32 or f32 to bf16 only"),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
    ) -> Result<()> {
        super::cuda::cast_into(dst, dst_l, (x, x_l))
    }
}

/// `dst[i] = f(x[i])` across threads.
fn convert<S: Copy + Sync, D: Send>(dst: &mut [D], x: &[S], f: impl Fn(S) -> D + Sync) {
    dst.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).for_each(|(d, x)| {
        for (d, &x) in d.iter_mut().zip(x) {
            *d = f(x);
        }
    });
}

/// `x * mul + add`, candle's affine, in place.
struct Affine {
    mul: f32,
    add: f32,
}

impl InplaceOp1 for Affine {
    fn name(&self) -> &'static str {
        "affine-in-place"
    }

    fn cpu_fwd(&self, x: &mut CpuStorage, l: &Layout) -> Result<()> {
        let (start, end) = span(l, "affine-in-place")?;
        let CpuStorage::F32(x) = x else { candle_core::bail!("affine-in-place: f32 only") };
        let (mul, add) = (self.mul, self.add);
        x[start..end].par_chunks_mut(CHUNK).for_each(|x| {
            for x in x {
                *x = *x * mul + add;
            }
        });
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        super::cuda::affine_in_place(x, l, self.mul, self.add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// Values that round both ways to bf16, ties included, tiny, huge, signed zeros and infinities.
    fn awkward(n: usize) -> Tensor {
        let mut v: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.731).sin() * 1e3).powi(3) / 7.0).collect();
        v[..8].copy_from_slice(&[
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            -3e38,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
        ]);
        Tensor::from_vec(v, (n / 5, 5), &Device::Cpu).unwrap()
    }

    #[test]
    fn casts_are_candles_to_the_bit() {
        let x = awkward(40_005);
        let down = x.to_dtype(DType::BF16).unwrap();
        assert_eq!(bits(&cast(&x, DType::BF16).unwrap()), bits(&down));
        assert_eq!(bits(&cast(&down, DType::F32).unwrap()), bits(&down.to_dtype(DType::F32).unwrap()));
        // In place, both ways, into storage that stays where it was.
        let into = Tensor::zeros(x.shape(), DType::BF16, &Device::Cpu).unwrap();
        cast_into(&into, &x).unwrap();
        assert_eq!(bits(&into), bits(&down));
        let wide = Tensor::zeros(x.shape(), DType::F32, &Device::Cpu).unwrap();
        cast_into(&wide, &down).unwrap();
        assert_eq!(bits(&wide), bits(&down.to_dtype(DType::F32).unwrap()));
        // A view from an offset casts its own elements.
        let view = x.narrow(0, 3, 100).unwrap();
        let into = Tensor::zeros(view.shape(), DType::BF16, &Device::Cpu).unwrap();
        cast_into(&into, &view).unwrap();
        assert_eq!(bits(&into), bits(&view.to_dtype(DType::BF16).unwrap()));
    }

    #[test]
    fn scale_in_place_is_candles_product() {
        let x = awkward(40_005);
        for mul in [0.37, -1.5, 1e-30] {
            let mut y = x.copy().unwrap();
            scale_to(&mut y, mul).unwrap();
            assert_eq!(bits(&y), bits(&(&x * mul).unwrap()), "times {mul}");
        }
        // A strided view is replaced, not written through.
        let before = bits(&x);
        let mut y = x.t().unwrap();
        scale_to(&mut y, 2.0).unwrap();
        assert_eq!(bits(&y), bits(&(&x.t().unwrap() * 2.0).unwrap()));
        assert_eq!(bits(&x), before);
    }
}
