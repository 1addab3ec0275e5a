//! How a training forward keeps each layer's autograd graph, the largest
//! part of training memory.
//!
//! candle keeps a backward's whole graph alive until the backward ends, so
//! every layer's activations coexist with every parameter's gradient. Cut
//! at the layers, a network's backward frees each layer's activations once
//! it has gone through that layer ([`LayerGraphs::PerLayer`]), or keeps only
//! each layer's input and runs the layer again in the backward (gradient
//! checkpointing, [`LayerGraphs::Recomputed`]).
//!
//! A cut layer is one op over its input. Its backward backpropagates the
//! incoming gradient through the layer's own graph, returns the input's
//! gradient and gathers the parameters' gradients on the side (an op's
//! backward only returns gradients for its arguments);
//! [`LayerCuts::collect`] adds them to the outer backward's.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backprop::GradStore;
use candle_core::op::Op;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, TensorId, Var};

use super::lora::Dropout;
use crate::rng::Rng;

/// What a training forward keeps of each layer's graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerGraphs {
    /// One graph through every layer, freed when the backward ends.
    Whole,
    /// Each layer's graph, freed once the backward has gone through it.
    PerLayer,
    /// Only each layer's input; the backward runs the layer again
    /// (gradient checkpointing: one more forward for a fraction of the
    /// activations).
    Recomputed,
}

impl LayerGraphs {
    /// What trainers use: per layer, or recomputed with TRL's `gradient_checkpointing`.
    pub fn for_training(gradient_checkpointing: bool) -> Self {
        if gradient_checkpointing {
            Self::Recomputed
        } else {
            Self::PerLayer
        }
    }
}

/// A layer's forward on its input (B, T, H).
pub type Layer = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// The layer cuts of one network: the parameter gradients gathered by the
/// layers' backward passes, and the adapters' dropout, whose masks a
/// recomputation must draw again the same (as PyTorch's `preserve_rng_state`).
#[derive(Clone)]
pub struct LayerCuts {
    recompute: bool,
    grads: Arc<Mutex<Option<GradStore>>>,
    dropout: Option<Dropout>,
}

impl LayerCuts {
    /// None for [`LayerGraphs::Whole`], which cuts nothing.
    pub fn new(graphs: LayerGraphs, dropout: Option<Dropout>) -> Option<Self> {
        let recompute = match graphs {
            LayerGraphs::Whole => return None,
            LayerGraphs::PerLayer => false,
            LayerGraphs::Recomputed => true,
        };
        Some(Self { recompute, grads: Arc::default(), dropout })
    }

    /// `layer(x)` as one op whose backward goes through the layer.
    pub fn apply(&self, x: &Tensor, layer: Layer) -> Result<Tensor> {
        // The op is recorded only on an input that tracks gradients; the
        // first layer's input does not when the embedding is frozen (LoRA),
        // while the layer's own parameters still train.
        let x = if x.track_op() { x.clone() } else { x.share_as_var() };
        let (y, cut) = if self.recompute {
            let dropout = self.dropout.as_ref().map(Dropout::state);
            // Detached: the layer's graph, and every intermediate it holds,
            // is dropped here.
            let y = layer(&x.detach())?.contiguous()?.detach();
            (y, Cut { kept: Mutex::new(None), layer: Some((layer, dropout)), cuts: self.clone() })
        } else {
            let input = Var::from_tensor(&x.share_as_var())?;
            let y = layer(input.as_tensor())?.contiguous()?;
            let kept = Mutex::new(Some((input, y.clone())));
            (y, Cut { kept, layer: None, cuts: self.clone() })
        };
        // The op's output, the kept graph's and the next layer's input are
        // one storage: a layer's output is held once, not copied.
        Ok(y.share_as_op(Op::CustomOp1(x, Arc::new(Box::new(cut)))))
    }

    /// Adds the parameter gradients gathered since the last call to `grads`.
    pub fn collect(&self, grads: &mut GradStore) -> Result<()> {
        match self.grads.lock().unwrap_or_else(PoisonError::into_inner).take() {
            Some(side) => grads.extend(side),
            None => Ok(()),
        }
    }
}

/// One cut layer: an op whose output was computed beforehand, and whose
/// backward goes through the kept graph, or a recomputed one.
struct Cut {
    /// Per layer: the input leaf and the output with its graph, until the backward.
    kept: Mutex<Option<(Var, Tensor)>>,
    /// Recomputed: the layer, and the dropout stream where its forward started.
    layer: Option<(Layer, Option<Rng>)>,
    cuts: LayerCuts,
}

impl Cut {
    /// The layer's input leaf and output with its graph: kept, or recomputed
    /// on `x` with the dropout masks its forward drew.
    fn graph(&self, x: &Tensor) -> Result<(Var, Tensor)> {
        let Some((layer, start)) = &self.layer else {
            let kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner).take();
            return kept
                .ok_or_else(|| candle_core::Error::Msg("layer cut: a second backward through one graph".into()));
        };
        let input = Var::from_tensor(&x.share_as_var())?;
        // The stream moves on from where the whole forward left it, not
        // from this replay.
        let resume = self.cuts.dropout.as_ref().zip(start.clone()).map(|(d, start)| (d, d.replace_state(start)));
        let y = layer(input.as_tensor());
        if let Some((d, state)) = resume {
            d.replace_state(state);
        }
        Ok((input, y?))
    }
}

impl CustomOp1 for Cut {
    fn name(&self) -> &'static str {
        "layer-cut"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("layer cut: the output is the layer's, made before the op")
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (input, y) = self.graph(x)?;
        let mut grads = y.apply_op2(grad, Seed)?.backward()?;
        // Gradients that still record ops would keep this layer's graph, and
        // so its activations, alive through the rest of the backward.
        let ids: Vec<TensorId> = grads.get_ids().copied().collect();
        for id in ids {
            if let Some(g) = grads.get_id(id).map(Tensor::detach) {
                grads.insert_id(id, g);
            }
        }
        let dx = grads.remove(input.as_tensor());
        let mut side = self.cuts.grads.lock().unwrap_or_else(PoisonError::into_inner);
        match side.as_mut() {
            Some(side) => side.extend(grads)?,
            None => *side = Some(grads),
        }
        Ok(dx)
    }
}

/// A backward's root that hands `grad` to `y` as its gradient: `Seed(y,
/// grad)` stands for `sum(y * grad)` without computing it (a product and a
/// whole-tensor sum per layer, then their backward), whose gradient for `y`
/// is `grad` all the same.
struct Seed;

impl CustomOp2 for Seed {
    fn name(&self) -> &'static str {
        "backward-seed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let dev = y.device().clone();
        let zero = dev.alloc_zeros::<f32>(1)?;
        Ok((candle_core::CudaStorage::wrap_cuda_slice(zero, dev), Shape::from(())))
    }

    fn bwd(&self, _: &Tensor, grad: &Tensor, _: &Tensor, _: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Storage};

    use super::*;

    /// Where a CPU tensor's values start.
    fn address(t: &Tensor) -> usize {
        let (storage, layout) = t.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => s.as_slice::<f32>().unwrap()[layout.start_offset()..].as_ptr() as usize,
            _ => unreachable!("a CPU tensor"),
        }
    }

    /// A cut holds a layer's input and output once: the layer reads the
    /// previous output's storage, and the op hands on the layer's own, in
    /// both kinds of cut; the gradients are the uncut graph's.
    #[test]
    fn cut_layers_share_their_inputs_and_outputs_storage() {
        let w = Var::new(&[1.5f32, -2.0, 0.5], &Device::Cpu).unwrap();
        for graphs in [LayerGraphs::PerLayer, LayerGraphs::Recomputed] {
            let cuts = LayerCuts::new(graphs, None).unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let layer: Layer = {
                let (w, seen) = (w.clone(), seen.clone());
                Arc::new(move |x: &Tensor| {
                    let y = x.broadcast_mul(w.as_tensor())?.tanh()?;
                    seen.lock().unwrap().push((address(x), address(&y)));
                    Ok(y)
                })
            };
            let x = Tensor::new(&[[0.3f32, -0.7, 1.1], [2.0, 0.1, -0.4]], &Device::Cpu).unwrap();
            let h = cuts.apply(&x, layer.clone()).unwrap();
            let out = cuts.apply(&h, layer.clone()).unwrap();
            let (first, second) = {
                let seen = seen.lock().unwrap();
                (seen[0], seen[1])
            };
            assert_eq!(first.0, address(&x), "{graphs:?}: the first layer's input was copied");
            assert_eq!(first.1, address(&h), "{graphs:?}: the first layer's output was copied");
            assert_eq!(second.0, address(&h), "{graphs:?}: the second layer's input was copied");
            assert_eq!(second.1, address(&out), "{graphs:?}: the second layer's output was copied");

            let mut grads = out.sum_all().unwrap().backward().unwrap();
            cuts.collect(&mut grads).unwrap();
            let whole = layer(&layer(&x).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            let (cut, uncut) = (grads.get(w.as_tensor()).unwrap(), whole.get(w.as_tensor()).unwrap());
            assert_eq!(cut.to_vec1::<f32>().unwrap(), uncut.to_vec1::<f32>().unwrap(), "{graphs:?}");
        }
    }
}
