//! A decoding step recorded as a CUDA graph and replayed: the step's
//! several hundred kernel launches (and their allocations from the pool)
//! become one launch, so that a step costs its kernels' time, not the
//! host's. What is recorded must launch the same work on the same buffers
//! at every replay: [`FixedBatch`](super::fixed::FixedBatch) sees to that.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::cudarc::driver::CudaGraph;
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Device, Tensor};

use crate::error::Result;

/// Runs `f` with candle keeping on the device the kernel parameters it
/// uploads (shapes and strides of strided ops), so that a recording of the
/// same work finds them there: uploads cannot be recorded.
pub fn keeping_uploads<T>(device: &Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _kept = device.as_cuda_device()?.enable_cuda_graph_htod_cache();
    f()
}

/// Says once per run that decoding steps are launched from the host, and why.
pub fn unrecorded(cause: &crate::error::Error) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        tracing::warn!("decoding steps are launched from the host, not recorded as a CUDA graph: {cause}")
    });
}

/// A recorded step and the buffer its logits are written to.
pub struct StepGraph {
    graph: CudaGraph,
    /// (B, V), allocated before the recording so that it outlives it.
    logits: Tensor,
}

impl StepGraph {
    /// Records `step`, which gives the (B, V) logits of `shape` in `dtype`,
    /// after one run of the same step through [`keeping_uploads`]. Nothing
    /// recorded runs until [`replay`](Self::replay).
    pub fn record(
        device: &Device,
        shape: (usize, usize),
        dtype: DType,
        step: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Self> {
        let logits = Tensor::zeros(shape, dtype, device)?;
        let stream = device.as_cuda_device()?.cuda_stream();
        let recorded = keeping_uploads(device, || {
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).w()?;
            // Every tensor the step makes is freed within the recording.
            let written = step().and_then(|out| Ok(logits.slice_set(&out, 0, 0)?));
            // The recording ends whatever happened, so the stream takes work again.
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).w();
            written?;
            Ok(graph?)
        })?;
        let Some(graph) = recorded else {
            return Err(candle_core::Error::msg("recording the decoding step gave no graph").into());
        };
        graph.upload().w()?;
        Ok(Self { graph, logits })
    }

    /// Runs the recorded step: its logits, valid until the next replay.
    pub fn replay(&self) -> Result<Tensor> {
        self.graph.launch().w()?;
        Ok(self.logits.clone())
    }
}
