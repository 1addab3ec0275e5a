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
    // The backward adds a tensor's gradients with the kernel where it runs.
    candle_core::backprop::set_gradient_sum(crate::model::kernels::sum2);
    let keep = keep_freed_memory()?;
    let events = buffer_events()?;
    profiled_phase()?;
    // Read where the kernels run: refused here, before any work, on every device.
    let invalid = |e: candle_core::Error| Error::Invalid(e.to_string());
    crate::model::kernels::attention_kernels().map_err(invalid)?;
    crate::model::kernels::attention_heads_fused().map_err(invalid)?;
    crate::model::kernels::attention_spans_chosen().map_err(invalid)?;
    crate::model::kernels::decode_attention_choice().map_err(invalid)?;
    crate::model::kernels::decode_append_fused().map_err(invalid)?;
    crate::model::kernels::decode_split_keys().map_err(invalid)?;
    crate::model::kernels::decode_heads_grouped().map_err(invalid)?;
    crate::model::kernels::decode_rows().map_err(invalid)?;
    crate::generate::clock::decode_timing()?;
    crate::model::kernels::dense_bias_epilogue().map_err(invalid)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = &device {
        let gpu = |e: String| Error::Invalid(format!("--device {name}: {e}"));
        if keep {
            pool_keeps_freed_memory(dev).map_err(gpu)?;
        }
        if !events {
            no_buffer_events(dev).map_err(gpu)?;
        }
    }
    let _ = (keep, events);
    Ok(device)
}

/// Picks whether each GPU buffer carries the two CUDA events cudarc gives
/// it for ordering work across streams: `off` (the default; rloo puts a
/// device's work on one stream, where they order nothing, and two events
/// are made and destroyed per tensor) or `on`, for comparison.
pub const CUDA_EVENTS_VAR: &str = "RLOO_CUDA_EVENTS";

fn buffer_events() -> Result<bool> {
    Ok(variant(CUDA_EVENTS_VAR, &["off", "on"]).map_err(Error::Invalid)? == "on")
}

/// Buffers made from now on carry no events. cudarc records them only once
/// a context has several streams of its own, and then they are needed.
#[cfg(feature = "cuda")]
fn no_buffer_events(dev: &candle_core::CudaDevice) -> std::result::Result<(), String> {
    if dev.cuda_stream().context().is_in_multi_stream_mode() {
        return Err(format!("{CUDA_EVENTS_VAR}=off needs a device on one stream"));
    }
    // Safety: the context has no stream of its own besides the one its
    // tensors use, so no buffer's use needs ordering against another's.
    unsafe { dev.disable_event_tracking() };
    Ok(())
}

/// Picks what a GPU's allocation pool does with the memory of freed
/// tensors: `keep` it for the next allocations (the default), or `release`
/// it to the driver at every synchronisation, as the driver does unless
/// told otherwise, for comparison.
pub const CUDA_POOL_VAR: &str = "RLOO_CUDA_POOL";

fn keep_freed_memory() -> Result<bool> {
    Ok(variant(CUDA_POOL_VAR, &["keep", "release"]).map_err(Error::Invalid)? == "keep")
}

/// Names the phase of a training step during which a CUDA profiler that
/// waits for the program's word (Nsight Compute's `--profile-from-start
/// off`) records: `generation`, `scoring` (the reward and the reference's
/// forward passes) or `training`; `off`, the default, records nothing.
pub const CUDA_PROFILE_VAR: &str = "RLOO_CUDA_PROFILE";

/// The phases [`CUDA_PROFILE_VAR`] can name, `off` first.
pub const PROFILED_PHASES: [&str; 4] = ["off", "generation", "scoring", "training"];

fn profiled_phase() -> Result<&'static str> {
    variant(CUDA_PROFILE_VAR, &PROFILED_PHASES).map_err(Error::Invalid)
}

/// Runs `f`, the step's `phase`, with the CUDA profiler recording when
/// [`CUDA_PROFILE_VAR`] names it and `device` is a GPU.
pub fn in_profiled_phase<T>(device: &Device, phase: &str, f: impl FnOnce() -> T) -> T {
    debug_assert!(PROFILED_PHASES.contains(&phase));
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(dev), Ok(chosen)) = (device, profiled_phase()) {
        use candle_core::cuda_backend::cudarc::driver::Profiler;
        if chosen == phase && dev.cuda_stream().context().bind_to_thread().is_ok() {
            // Stops recording when dropped, after f.
            let _recording = Profiler::new().ok();
            return f();
        }
    }
    let _ = (device, phase);
    f()
}

/// Which of `choices` the variable `var` picks, for the variables that
/// choose between ways of computing the same thing: the first when it is
/// unset or empty; any other value is an error naming the choices.
pub fn variant(var: &str, choices: &[&'static str]) -> std::result::Result<&'static str, String> {
    let value = std::env::var(var).unwrap_or_default();
    match choices.iter().find(|c| **c == value) {
        Some(c) => Ok(c),
        None if value.is_empty() => Ok(choices[0]),
        None => Err(format!("{var}={value}: expected {}", choices.join(" or "))),
    }
}

/// Every read of a value to the host synchronises, and a pool left at the
/// driver's default would then unmap all of its free memory, so that the
/// next step maps it again, allocation by allocation. Kept, it grows to
/// the run's peak and stays there, as PyTorch's caching allocator does.
#[cfg(feature = "cuda")]
fn pool_keeps_freed_memory(dev: &candle_core::CudaDevice) -> std::result::Result<(), String> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let mut threshold = u64::MAX;
    // Safety: the attribute's value is a u64, as the driver reads it.
    let ok = default_pool(dev).is_some_and(|pool| unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        ) == sys::CUresult::CUDA_SUCCESS
    });
    if ok {
        Ok(())
    } else {
        Err("could not set the allocation pool's release threshold".into())
    }
}

/// The device's default allocation pool, every tensor's source, with its
/// context bound to this thread.
#[cfg(feature = "cuda")]
pub(crate) fn default_pool(
    dev: &candle_core::CudaDevice,
) -> Option<candle_core::cuda_backend::cudarc::driver::sys::CUmemoryPool> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().ok()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // Safety: the out-pointer is a local of the type the driver writes; the
    // device is the bound context's.
    let ok = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS };
    ok.then_some(pool)
}

/// Whether `device`'s stream is being recorded into a CUDA graph: work
/// whose launch depends on the host's values at the time would replay
/// them.
pub fn recording(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use candle_core::cuda_backend::cudarc::driver::sys::CUstreamCaptureStatus;
        return dev
            .cuda_stream()
            .capture_status()
            .is_ok_and(|s| s != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE);
    }
    let _ = device;
    false
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
