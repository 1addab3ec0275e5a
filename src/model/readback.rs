//! Values left on the device for the host, read back together. Each read
//! waits for the device to finish what is queued, so a training step
//! queues its diagnostics as it goes and reads them in one transfer where
//! it needs them (the end of an optimizer step), not one by one.

use candle_core::{DType, Result, Tensor};

/// Tensors queued for one read.
#[derive(Default)]
pub struct Readback {
    parts: Vec<Tensor>,
    /// Each queued tensor's element count, in queue order.
    lengths: Vec<usize>,
}

/// Where a queued tensor's values are in the read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot(usize);

/// The values of every queued tensor, as f32, flattened.
pub struct HostValues {
    values: Vec<f32>,
    /// `starts[i]..starts[i + 1]` are slot `i`'s values.
    starts: Vec<usize>,
}

impl Readback {
    /// Queues `t` (any shape, detached, as f32).
    pub fn push(&mut self, t: &Tensor) -> Result<Slot> {
        let flat = t.detach().flatten_all()?;
        let flat = if flat.dtype() == DType::F32 { flat } else { flat.to_dtype(DType::F32)? };
        self.lengths.push(flat.elem_count());
        if flat.elem_count() > 0 {
            self.parts.push(flat);
        }
        Ok(Slot(self.lengths.len() - 1))
    }

    /// Every queued tensor's values in one transfer; the queue is emptied.
    pub fn read(&mut self) -> Result<HostValues> {
        let values = match self.parts.len() {
            0 => Vec::new(),
            1 => self.parts[0].to_vec1()?,
            _ => Tensor::cat(&self.parts, 0)?.to_vec1()?,
        };
        let mut starts = vec![0];
        for len in self.lengths.drain(..) {
            starts.push(starts.last().unwrap() + len);
        }
        self.parts.clear();
        Ok(HostValues { values, starts })
    }
}

impl HostValues {
    pub fn get(&self, slot: Slot) -> &[f32] {
        &self.values[self.starts[slot.0]..self.starts[slot.0 + 1]]
    }

    /// The one value of a queued scalar.
    pub fn scalar(&self, slot: Slot) -> f32 {
        let values = self.get(slot);
        assert_eq!(values.len(), 1, "slot {} holds {} values, not a scalar", slot.0, values.len());
        values[0]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn one_read_returns_each_queued_tensor_in_its_slot() {
        let dev = Device::Cpu;
        let mut rb = Readback::default();
        let a = rb.push(&Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &dev).unwrap()).unwrap();
        let empty = rb.push(&Tensor::zeros(0, DType::F32, &dev).unwrap()).unwrap();
        let b = rb.push(&Tensor::new(5f32, &dev).unwrap().to_dtype(DType::BF16).unwrap()).unwrap();
        let host = rb.read().unwrap();
        assert_eq!(host.get(a), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(host.get(empty), &[] as &[f32]);
        assert_eq!(host.scalar(b), 5.0);
        // The queue starts over.
        let c = rb.push(&Tensor::new(&[7f32], &dev).unwrap()).unwrap();
        assert_eq!(rb.read().unwrap().get(c), &[7.0]);
        assert!(rb.read().unwrap().values.is_empty());
    }
}
