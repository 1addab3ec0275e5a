//! Choosing where tensors live: `cpu`, `cuda[:N]`, or `auto` (the first GPU
//! when rloo was built with the `cuda` feature and one is present).

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub fn parse_device(name: &str) -> Result<Device> {
    let cuda = |ordinal: usize| Device::new_cuda(ordinal).map_err(|e| Error::Invalid(format!("--device {name}: {e}")));
    let device = match name {
        "cpu" => Device::Cpu,
        "auto" => Device::cuda_if_available(0).unwrap_or(Device::Cpu),
        "cuda" | "gpu" => cuda(0)?,
        _ => match name.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => cuda(ordinal)?,
            _ => {
                return Err(Error::Invalid(format!(
                    "--device `{name}` is not a device (expected cpu, auto, cuda or cuda:N)"
                )))
            }
        },
    };
    let keep = keep_freed_memory()?;
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(dev), true) = (&device, keep) {
        pool_keeps_freed_memory(dev).map_err(|e| Error::Invalid(format!("--device {name}: {e}")))?;
    }
    let _ = keep;
    Ok(device)
}

/// Picks what a GPU's allocation pool does with the memory of freed
/// tensors: `keep` it for the next allocations (the default), or `release`
/// it to the driver at every synchronisation, as the driver does unless
/// told otherwise, for comparison.
pub const CUDA_POOL_VAR: &str = "RLOO_CUDA_POOL";

fn keep_freed_memory() -> Result<bool> {
    match std::env::var(CUDA_POOL_VAR).ok().as_deref() {
        None | Some("" | "keep") => Ok(true),
        Some("release") => Ok(false),
        Some(other) => Err(Error::Invalid(format!("{CUDA_POOL_VAR}={other}: expected keep or release"))),
    }
}

/// Every read of a value to the host synchronises, and a pool left at the
/// driver's default would then unmap all of its free memory, so that the
/// next step maps it again, allocation by allocation. Kept, it grows to
/// the run's peak and stays there, as PyTorch's caching allocator does.
#[cfg(feature = "cuda")]
fn pool_keeps_freed_memory(dev: &candle_core::CudaDevice) -> std::result::Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // Safety: the pool is the bound context's device's default pool, and
    // the attribute's value is a u64, as the driver reads it.
    let ok = unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS
            && sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            ) == sys::CUresult::CUDA_SUCCESS
    };
    if ok {
        Ok(())
    } else {
        Err("could not set the allocation pool's release threshold".into())
    }
}

/// The dtype a model computes in: `f32`, or `bf16` mixed precision (bf16
/// weights and activations; f32 master weights, optimizer state,
/// log-softmax and losses).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    #[serde(alias = "float32", alias = "fp32")]
    F32,
    #[serde(alias = "bfloat16")]
    Bf16,
}

impl Precision {
    /// From a `--bf16` switch.
    pub fn from_bf16(bf16: bool) -> Self {
        if bf16 {
            Self::Bf16
        } else {
            Self::F32
        }
    }

    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_or_are_explained() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        let err = parse_device("tpu").unwrap_err().to_string();
        assert!(err.contains("`tpu`") && err.contains("cuda:N"), "{err}");
    }
}
