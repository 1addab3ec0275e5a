//! NCCL under the communicator on GPUs: tensors (the gradients) are summed
//! on the devices, over NVLink or the network; the small host buffers
//! (statistics, rollouts, NCCL's own unique id) still go through the TCP
//! star the ranks met on. NCCL refuses two ranks on one GPU.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::{Comm, Id, ReduceOp};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use super::{Communicator, World};
use crate::error::{Error, Result};

pub struct Nccl {
    star: Arc<dyn Communicator>,
    comm: Mutex<SendComm>,
}

/// NCCL lets a communicator be called from any thread as long as its calls
/// do not overlap; the mutex around it keeps them apart.
struct SendComm(Comm);
// Safety: see above; the communicator is only reached through the mutex.
unsafe impl Send for SendComm {}

impl Nccl {
    /// Rank 0 makes the job's NCCL id and the star hands it to the others;
    /// each rank then joins on its own GPU's stream.
    pub fn join(star: Arc<dyn Communicator>, device: &Device) -> Result<Nccl> {
        let Device::Cuda(cuda) = device else {
            return Err(Error::Dist("NCCL needs a CUDA device".into()));
        };
        let world = star.world();
        let nccl = |e| Error::Dist(format!("NCCL on rank {}: {e:?}", world.rank));
        let mine: Vec<u8> = match world.is_main() {
            true => Id::new().map_err(nccl)?.internal().iter().map(|&c| c as u8).collect(),
            false => Vec::new(),
        };
        let ids = star.all_gather(&mine)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        if ids[0].len() != internal.len() {
            return Err(Error::Dist(format!("rank 0 sent an NCCL id of {} bytes", ids[0].len())));
        }
        for (to, &from) in internal.iter_mut().zip(&ids[0]) {
            *to = from as std::ffi::c_char;
        }
        let comm = Comm::from_rank(cuda.cuda_stream(), world.rank, world.size, Id::uninit(internal)).map_err(nccl)?;
        tracing::info!("rank {} of {}: NCCL on {:?}", world.rank, world.size, device.location());
        Ok(Nccl { star, comm: Mutex::new(SendComm(comm)) })
    }
}

impl Communicator for Nccl {
    fn world(&self) -> World {
        self.star.world()
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()> {
        self.star.all_reduce_sum(data)
    }

    fn all_reduce_sum_f64(&self, data: &mut [f64]) -> Result<()> {
        self.star.all_reduce_sum_f64(data)
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.star.all_gather(mine)
    }

    fn all_reduce_tensor(&self, t: &Tensor) -> Result<Tensor> {
        if !t.device().is_cuda() {
            return self.star.all_reduce_tensor(t);
        }
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let sum = t.to_dtype(DType::F32)?.contiguous()?.apply_op1_no_bwd(&AllReduce(&comm.0))?;
        Ok(sum.to_dtype(t.dtype())?)
    }
}

/// The element-wise sum over the ranks of an f32 tensor, into a new buffer.
struct AllReduce<'a>(&'a Comm);

impl CustomOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL sums tensors on GPUs")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("NCCL all-reduce: the tensor is not contiguous")
        };
        let dev = s.device().clone();
        let x = s.as_cuda_slice::<f32>()?.slice(start..end);
        // Safety: NCCL writes every element.
        let mut out = unsafe { dev.alloc::<f32>(end - start) }?;
        self.0
            .all_reduce(&x, &mut out, &ReduceOp::Sum)
            .map_err(|e| candle_core::Error::Msg(format!("NCCL all-reduce: {e:?}")))?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), l.shape().clone()))
    }
}
