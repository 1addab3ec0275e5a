//! Whether a tensor holds NaN or an infinity, read where it lies in one
//! pass (a model's weights are checked so as they load): on the CPU a scan
//! of its elements, on a GPU one kernel and a read of its blocks' flags;
//! other dtypes and strided views through the composition (`x * 0` is 0
//! for finite x and NaN otherwise, summed).

use candle_core::{CpuStorage, DType, Result, Storage, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

pub fn any_non_finite(t: &Tensor) -> Result<bool> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let Some((start, end)) = layout.contiguous_offsets() {
            match &*storage {
                Storage::Cpu(CpuStorage::F32(v)) => return Ok(any_not(&v[start..end], f32::is_finite)),
                Storage::Cpu(CpuStorage::BF16(v)) => return Ok(any_not(&v[start..end], bf16::is_finite)),
                Storage::Cpu(CpuStorage::F16(v)) => return Ok(any_not(&v[start..end], f16::is_finite)),
                Storage::Cpu(CpuStorage::F64(v)) => return Ok(any_not(&v[start..end], f64::is_finite)),
                #[cfg(feature = "cuda")]
                Storage::Cuda(s) if matches!(t.dtype(), DType::F32 | DType::BF16) => {
                    return super::cuda::any_non_finite((s, layout))
                }
                _ => {}
            }
        }
    }
    Ok((t * 0.0)?.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?.is_nan())
}

/// Whether any of `xs` fails `finite`, in chunks across threads.
fn any_not<T: Copy + Sync>(xs: &[T], finite: impl Fn(T) -> bool + Sync) -> bool {
    xs.par_chunks(1 << 16).any(|chunk| !chunk.iter().all(|&x| finite(x)))
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::any_non_finite;

    /// Every dtype the weights load in, a bad value at the first and the
    /// last element and past the first chunk, from a view's offset and
    /// through a strided view (the composition).
    #[test]
    fn finds_each_non_finite_value_wherever_it_lies() {
        let n = (1 << 16) + 37;
        for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let clean: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e4).collect();
            let t = Tensor::from_slice(&clean, n, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            assert!(!any_non_finite(&t).unwrap(), "{dtype:?}: finite values");
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in [0, n - 1, (1 << 16) + 5] {
                    let mut v = clean.clone();
                    v[at] = bad;
                    let t = Tensor::from_slice(&v, n, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                    assert!(any_non_finite(&t).unwrap(), "{dtype:?}: {bad} at {at}");
                    let after = t.narrow(0, at.min(n - 2) + 1, n - at.min(n - 2) - 1).unwrap();
                    assert_eq!(any_non_finite(&after).unwrap(), at == n - 1, "{dtype:?}: a view past {at}");
                    let strided = t.narrow(0, 0, n - 1).unwrap().reshape(((n - 1) / 2, 2)).unwrap().t().unwrap();
                    assert!(!strided.is_contiguous());
                    assert_eq!(any_non_finite(&strided).unwrap(), at < n - 1, "{dtype:?}: strided, {bad} at {at}");
                }
            }
        }
    }
}
