//! The weights of a model nothing trains, moved off a GPU while nothing
//! reads them and copied back before they are read again: the reference
//! and the reward model spend an RLOO step's training phase in host memory
//! (`ref_reward_offload`, as OpenRLHF names it), and come back while the
//! policy samples, on a stream of their own.
//!
//! A parked tensor keeps its shape over an empty storage; every tensor
//! sharing that storage (a network's detached copies, a transposed view)
//! sees the same. Its values wait in host memory: page-locked on a GPU,
//! copied there at the first parking and kept (nothing changes them), so
//! that parking again only frees the device's buffers. Every reader asks
//! [`Parking::resident`] first, which brings back what is parked, or makes
//! the device's work wait for the copies under way.
//!
//! On the CPU the storages are moved aside and back, which saves nothing
//! but runs the same steps, so that a run that parks is checked there.

use std::sync::Mutex;

use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor};

use crate::error::{Error, Result};

/// Where a model's weights are.
#[derive(Default)]
pub struct Parking {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// One tensor per storage, with its values in host memory where kept.
    slots: Vec<Slot>,
    place: Place,
}

#[derive(Default)]
enum Place {
    #[default]
    Resident,
    Parked,
    /// Copied back on a stream of their own: the device's work waits for
    /// the event before it reads them.
    #[cfg(feature = "cuda")]
    Arriving(gpu::Arrival),
}

struct Slot {
    tensor: Tensor,
    host: Option<Host>,
}

/// A storage's values off the device.
enum Host {
    /// The storage itself, moved aside.
    Cpu(CpuStorage),
    #[cfg(feature = "cuda")]
    Pinned(gpu::Pinned),
}

impl Parking {
    /// Frees the device memory of `tensors` (each storage once), keeping
    /// their values in host memory. Nothing may read them until
    /// [`resident`](Self::resident). `what` names the model in the log
    /// line of the first parking.
    pub fn park(&self, what: &str, tensors: impl FnOnce() -> Vec<Tensor>) -> Result<()> {
        let mut state = self.lock();
        match state.place {
            Place::Parked => return Ok(()),
            #[cfg(feature = "cuda")]
            // The copies under way write into the buffers about to be freed.
            Place::Arriving(_) => state.arrive()?,
            Place::Resident => {}
        }
        if state.slots.is_empty() {
            state.slots = distinct_storages(tensors());
            let bytes: usize =
                state.slots.iter().map(|s| s.tensor.elem_count() * s.tensor.dtype().size_in_bytes()).sum();
            let gib = bytes as f64 / (1u64 << 30) as f64;
            tracing::info!(
                "{what}: {} tensors ({gib:.2} GiB) held in host memory while nothing reads them",
                state.slots.len()
            );
        }
        for slot in &mut state.slots {
            slot.park()?;
        }
        state.place = Place::Parked;
        Ok(())
    }

    /// Starts bringing back what is parked; on a GPU the copies run beside
    /// the device's work until [`resident`](Self::resident).
    pub fn begin_return(&self) -> Result<()> {
        let mut state = self.lock();
        if matches!(state.place, Place::Parked) {
            state.place = state.bring_back()?;
        }
        Ok(())
    }

    /// Makes the weights readable: brings back what is parked and orders
    /// the device's work after the copies.
    pub fn resident(&self) -> Result<()> {
        let mut state = self.lock();
        if matches!(state.place, Place::Parked) {
            state.place = state.bring_back()?;
        }
        state.arrive()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    fn bring_back(&mut self) -> Result<Place> {
        #[cfg(feature = "cuda")]
        if let Some(device) = self.slots.first().map(|s| s.tensor.device().clone()).filter(|d| d.is_cuda()) {
            return Ok(Place::Arriving(gpu::bring_back(&device, &self.slots)?));
        }
        for slot in &mut self.slots {
            match slot.host.take() {
                Some(Host::Cpu(storage)) => drop(swap_storage(&slot.tensor, Storage::Cpu(storage))?),
                _ => return Err(broken("a parked CPU tensor without its values")),
            }
        }
        Ok(Place::Resident)
    }

    /// Orders the device's work after the copies under way, if any.
    fn arrive(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Place::Arriving(arrival) = std::mem::take(&mut self.place) {
            arrival.wait()?;
        }
        Ok(())
    }
}

impl Slot {
    fn park(&mut self) -> Result<()> {
        let device = self.tensor.device().clone();
        match &device {
            candle_core::Device::Cpu => {
                let held = swap_storage(&self.tensor, Storage::Cpu(empty_cpu(self.tensor.dtype())?))?;
                let Storage::Cpu(held) = held else { return Err(broken("a CPU tensor held a device's storage")) };
                self.host = Some(Host::Cpu(held));
            }
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(dev) => {
                if self.host.is_none() {
                    self.host = Some(Host::Pinned(gpu::Pinned::copy_of(&self.tensor)?));
                }
                // Freed in the stream's order, after the work that reads it.
                drop(swap_storage(&self.tensor, Storage::Cuda(gpu::empty(dev, self.tensor.dtype())?))?);
            }
            other => return Err(Error::Invalid(format!("weights on {other:?} cannot be moved to host memory"))),
        }
        Ok(())
    }
}

/// One tensor of each storage among `tensors`, in their order.
fn distinct_storages(tensors: Vec<Tensor>) -> Vec<Slot> {
    let mut seen = std::collections::HashSet::new();
    tensors
        .into_iter()
        .filter(|t| seen.insert(&*t.storage_and_layout().0 as *const Storage as usize))
        .map(|tensor| Slot { tensor, host: None })
        .collect()
}

fn empty_cpu(dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::BF16 => CpuStorage::BF16(Vec::new()),
        DType::F16 => CpuStorage::F16(Vec::new()),
        DType::F32 => CpuStorage::F32(Vec::new()),
        DType::F64 => CpuStorage::F64(Vec::new()),
        other => return Err(unsupported(other)),
    })
}

/// The error for weights of a dtype that cannot be parked.
fn unsupported(dtype: DType) -> Error {
    Error::Invalid(format!("weights of dtype {dtype:?} cannot be moved to host memory"))
}

/// Puts `new` in place of `t`'s storage (for every tensor sharing it) and
/// gives back the one it held.
fn swap_storage(t: &Tensor, new: Storage) -> Result<Storage> {
    let swap = Swap(Mutex::new(Some(new)));
    t.inplace_op1(&swap)?;
    let held = swap.0.into_inner().unwrap_or_else(|e| e.into_inner());
    held.ok_or_else(|| broken("a storage swap gave nothing back"))
}

/// A state this module's own steps should never reach.
fn broken(what: &str) -> Error {
    candle_core::Error::msg(format!("moving weights to host memory: {what}")).into()
}

/// Holds the storage to put in, then the one taken out.
struct Swap(Mutex<Option<Storage>>);

impl Swap {
    fn exchange<S>(
        &self,
        s: &mut S,
        unwrap: impl Fn(Storage) -> Option<S>,
        wrap: impl Fn(S) -> Storage,
    ) -> candle_core::Result<()> {
        let mut held = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut other) = held.take().and_then(unwrap) else {
            candle_core::bail!("swap-storage: a storage of another device")
        };
        std::mem::swap(s, &mut other);
        *held = Some(wrap(other));
        Ok(())
    }
}

impl InplaceOp1 for Swap {
    fn name(&self) -> &'static str {
        "swap-storage"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        self.exchange(s, |s| if let Storage::Cpu(s) = s { Some(s) } else { None }, Storage::Cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, _: &Layout) -> candle_core::Result<()> {
        self.exchange(s, |s| if let Storage::Cuda(s) = s { Some(s) } else { None }, Storage::Cuda)
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;

    use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::{CudaDevice, CudaStorage, DType, Storage, Tensor};
    use half::{bf16, f16};

    use super::{broken, swap_storage, unsupported, Host, Slot};
    use crate::error::Result;

    /// A storage's values in page-locked host memory, which the device
    /// copies from without the host's help.
    pub enum Pinned {
        BF16(PinnedHostSlice<bf16>),
        F16(PinnedHostSlice<f16>),
        F32(PinnedHostSlice<f32>),
    }

    /// Copies back under way: the event their stream records after them.
    pub struct Arrival {
        stream: Arc<CudaStream>,
        done: CudaEvent,
    }

    impl Arrival {
        /// Makes the device's work wait for the copies.
        pub fn wait(self) -> Result<()> {
            self.stream.wait(&self.done).w()?;
            Ok(())
        }
    }

    impl Pinned {
        /// The values of `t`'s whole storage, copied in the device's stream
        /// order (after the work that writes them).
        pub fn copy_of(t: &Tensor) -> Result<Self> {
            fn run<T: CudaDType + DeviceRepr>(s: &CudaStorage) -> Result<PinnedHostSlice<T>> {
                let slice = s.as_cuda_slice::<T>()?;
                let stream = s.device.cuda_stream();
                // Safety: the copy below writes every element.
                let mut host = unsafe { stream.context().alloc_pinned::<T>(slice.len()) }.w()?;
                stream.memcpy_dtoh(slice, &mut host).w()?;
                Ok(host)
            }
            let (storage, _) = t.storage_and_layout();
            let Storage::Cuda(s) = &*storage else { return Err(broken("a GPU tensor held a CPU storage")) };
            Ok(match t.dtype() {
                DType::BF16 => Pinned::BF16(run(s)?),
                DType::F16 => Pinned::F16(run(s)?),
                DType::F32 => Pinned::F32(run(s)?),
                other => return Err(unsupported(other)),
            })
        }
    }

    /// A storage of one element (an allocation of none may fail), to stand
    /// for a parked one.
    pub fn empty(dev: &CudaDevice, dtype: DType) -> Result<CudaStorage> {
        use candle_core::backend::BackendDevice;
        // Safety: nothing reads it: every reader of a parked tensor waits for its return.
        Ok(unsafe { dev.alloc_uninit(&candle_core::Shape::from(1), dtype) }?)
    }

    /// Gives each slot a new buffer, allocated in the device's stream
    /// order, and fills them from host memory on a stream of their own, so
    /// that the copies run beside the device's work.
    pub fn bring_back(device: &candle_core::Device, slots: &[Slot]) -> Result<Arrival> {
        let dev = device.as_cuda_device()?;
        let main = dev.cuda_stream();
        let copies = copy_stream(dev)?;
        let mut buffers = Vec::with_capacity(slots.len());
        for slot in slots.iter() {
            let Some(Host::Pinned(host)) = &slot.host else {
                return Err(broken("a parked GPU tensor without its values"));
            };
            // Safety: the copies below write every element before anything reads them.
            buffers.push(unsafe {
                match host {
                    Pinned::BF16(h) => Buffer::BF16(main.alloc::<bf16>(h.len()).w()?),
                    Pinned::F16(h) => Buffer::F16(main.alloc::<f16>(h.len()).w()?),
                    Pinned::F32(h) => Buffer::F32(main.alloc::<f32>(h.len()).w()?),
                }
            });
        }
        // The buffers exist once the device's stream reaches their allocation.
        copies.join(&main).w()?;
        for (slot, buffer) in slots.iter().zip(buffers) {
            let storage = match (&slot.host, buffer) {
                (Some(Host::Pinned(Pinned::BF16(h))), Buffer::BF16(b)) => fill(&copies, h, b, dev)?,
                (Some(Host::Pinned(Pinned::F16(h))), Buffer::F16(b)) => fill(&copies, h, b, dev)?,
                (Some(Host::Pinned(Pinned::F32(h))), Buffer::F32(b)) => fill(&copies, h, b, dev)?,
                _ => return Err(broken("a buffer of another dtype than its values")),
            };
            drop(swap_storage(&slot.tensor, Storage::Cuda(storage))?);
        }
        let done = copies.record_event(None).w()?;
        Ok(Arrival { stream: main, done })
    }

    enum Buffer {
        BF16(CudaSlice<bf16>),
        F16(CudaSlice<f16>),
        F32(CudaSlice<f32>),
    }

    fn fill<T: CudaDType + DeviceRepr>(
        copies: &Arc<CudaStream>,
        host: &PinnedHostSlice<T>,
        mut buffer: CudaSlice<T>,
        dev: &CudaDevice,
    ) -> Result<CudaStorage> {
        copies.memcpy_htod(host, &mut buffer).w()?;
        // The buffer is freed in the device's stream order, where it was made.
        Ok(CudaStorage::wrap_cuda_slice(buffer, dev.clone()))
    }

    /// The device's stream for copies back, made on first use.
    fn copy_stream(dev: &CudaDevice) -> Result<Arc<CudaStream>> {
        use candle_core::cuda_backend::DeviceId;
        use std::sync::Mutex;
        static STREAMS: Mutex<Vec<(DeviceId, Arc<CudaStream>)>> = Mutex::new(Vec::new());
        let mut streams = STREAMS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, s)) = streams.iter().find(|(id, _)| *id == dev.id()) {
            return Ok(s.clone());
        }
        let stream = dev.cuda_stream().context().new_stream().w()?;
        streams.push((dev.id(), stream.clone()));
        Ok(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn held(t: &Tensor) -> usize {
        match &*t.storage_and_layout().0 {
            Storage::Cpu(s) => s.as_slice::<f32>().unwrap().len(),
            _ => unreachable!(),
        }
    }

    /// Every tensor on a parked storage (a detached copy, a transposed view)
    /// loses its values and gets the same bits back.
    #[test]
    fn parked_storages_come_back_to_every_tensor_sharing_them() {
        let w = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap().affine(0.37, -1.1).unwrap().reshape((3, 4)).unwrap();
        let (view, copy) = (w.t().unwrap(), w.detach());
        let other = Tensor::new(&[2.5f32, -0.5], &Device::Cpu).unwrap();
        let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
        let before = x.matmul(&view).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();

        let parking = Parking::default();
        parking.park("test", || vec![w.clone(), view.clone(), copy.clone(), other.clone()]).unwrap();
        assert_eq!(parking.lock().slots.len(), 2, "one slot per storage");
        assert!(matches!(parking.lock().place, Place::Parked));
        assert_eq!((held(&w), held(&view), held(&copy), held(&other)), (0, 0, 0, 0));
        // Parking again, and starting the return twice, change nothing.
        parking.park("test", Vec::new).unwrap();
        parking.begin_return().unwrap();
        parking.begin_return().unwrap();
        parking.resident().unwrap();
        assert!(matches!(parking.lock().place, Place::Resident));
        assert_eq!((held(&w), held(&copy), held(&other)), (12, 12, 2));
        let after = x.matmul(&view).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(
            before.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            after.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(other.to_vec1::<f32>().unwrap(), [2.5, -0.5]);

        // Parked a second time and read back through `resident` alone.
        parking.park("test", Vec::new).unwrap();
        assert_eq!(held(&copy), 0);
        parking.resident().unwrap();
        assert_eq!(
            copy.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            w.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
}
