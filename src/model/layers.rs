//! Pieces every architecture assembles: the per-forward attention context
//! (mask bias, rotary tables), multi-head self-attention over a cache, and
//! the embedding lookup.

use std::sync::{Arc, OnceLock};

use candle_core::{DType, Result, Tensor};

use super::batch::{attention_spans, causal_bias, key_mask, shared_prefix_bias, Inputs};
use super::cache::KvCache;
use super::kernels::{self, decode_attention, Remake};
use super::lora::Adapter;
use super::ops::Activation;
use super::rope::Rope;
use super::weights::Weights;
use crate::error::Result as LoadResult;

/// Computed once per forward pass and shared by all layers.
pub struct Context {
    /// (B, 1, T, S) additive attention bias, made when a layer asks for it
    /// (on a GPU, the flash kernels read spans instead, and the decoding
    /// kernels the key mask).
    bias: OnceLock<Tensor>,
    /// The pass's inputs, which the bias and the spans are made from.
    inputs: Inputs,
    /// Each query's runs of keys on the GPU, made when the flash kernels
    /// first ask for them (None where they are more than two).
    spans: OnceLock<Option<kernels::DeviceSpans>>,
    /// Whether the flash kernels may read spans: whole sequences on a GPU,
    /// `RLOO_ATTENTION_MASK=spans`.
    spans_chosen: bool,
    /// The slots the pass attends over: with a cache whose slots are fixed,
    /// fewer than the key mask covers.
    slots: usize,
    /// (B, 1, T, R) rotary tables, for architectures with rotary embeddings.
    pub rotary: Option<(Tensor, Tensor)>,
    /// The key mask over all S slots, stored into the cache at the end
    /// (and read by the CUDA decoding kernel).
    key_mask: Tensor,
    /// The same mask on the host, for the fused CPU decoding kernel (one
    /// new token per row with a cache).
    decode_mask: Option<Vec<f32>>,
    /// Bias and rotary tables on the host, for the fused attention kernel
    /// (whole sequences without a cache, on the CPU).
    whole: Option<kernels::AttentionInputs>,
    /// Rotary tables on the host, for the rotary kernel (with a cache, on
    /// the CPU).
    rotary_host: Option<kernels::RotaryTables>,
    /// For a decoding step (a cache, one new token per row): the kernel it
    /// attends with (None: the composition), and whether a GPU rotates and
    /// appends its heads in one launch (`RLOO_DECODE_ATTENTION` and the
    /// kernel's blocks, `RLOO_DECODE_APPEND`, read once per pass).
    decode_kernel: Option<kernels::DecodeKernel>,
    fused_append: bool,
    /// On a GPU, whether attention takes its heads straight from a fused
    /// projection (`RLOO_ATTENTION_HEADS`): whole sequences in the fused
    /// attention, a prefill's heads cut and rotated in one launch.
    fused_heads: bool,
}

impl Context {
    pub fn new(inputs: &Inputs, cache: Option<&KvCache>, rope: Option<(&Rope, &Tensor)>) -> Result<Self> {
        let key_mask = key_mask(inputs, cache)?;
        let slots = match cache {
            Some(cache) if cache.fixed_slot().is_some() => cache.len() + inputs.seq_len(),
            _ => key_mask.dim(1)?,
        };
        let spans_chosen = cache.is_none() && key_mask.device().is_cuda() && kernels::attention_spans_chosen()?;
        let rotary = match rope {
            Some((rope, inv_freq)) => Some(rope.cos_sin(inv_freq, &inputs.positions)?),
            None => None,
        };
        let decode_mask = match cache {
            Some(_) if inputs.seq_len() == 1 && key_mask.device().is_cpu() => Some(key_mask.flatten_all()?.to_vec1()?),
            _ => None,
        };
        // The CPU's attention kernel reads the bias at once.
        let bias = OnceLock::new();
        let whole = match cache {
            None if kernels::fused(&key_mask) => {
                let made = make_bias(inputs.segments.as_deref(), &key_mask, slots, inputs.seq_len())?;
                let whole = kernels::AttentionInputs::new(&made, rotary.as_ref())?;
                let _ = bias.set(made);
                Some(whole)
            }
            _ => None,
        };
        let rotary_host = match (&rotary, cache) {
            (Some((cos, sin)), Some(_)) if kernels::fused(cos) => Some(kernels::RotaryTables::new(cos, sin)?),
            _ => None,
        };
        let decoding = cache.is_some() && inputs.seq_len() == 1;
        let decode_kernel = match decoding {
            true => match kernels::decode_attention_choice()? {
                kernels::DecodeAttention::Composed => None,
                chosen => Some(kernels::DecodeKernel::from_env(chosen == kernels::DecodeAttention::Lanes)?),
            },
            false => None,
        };
        let fused_append = decoding && kernels::decode_append_fused()?;
        let fused_heads = kernels::attention_heads_fused()?;
        Ok(Self {
            bias,
            inputs: inputs.clone(),
            spans: OnceLock::new(),
            spans_chosen,
            slots,
            rotary,
            key_mask,
            decode_mask,
            whole,
            rotary_host,
            decode_kernel,
            fused_append,
            fused_heads,
        })
    }

    /// The (B, 1, T, S) additive attention bias, made on first use.
    pub fn bias(&self) -> Result<&Tensor> {
        if let Some(bias) = self.bias.get() {
            return Ok(bias);
        }
        let bias = make_bias(self.inputs.segments.as_deref(), &self.key_mask, self.slots, self.inputs.seq_len())?;
        Ok(self.bias.get_or_init(|| bias))
    }

    /// Each query's runs of keys on the device, made on first use; None
    /// where they are more than two.
    fn spans(&self) -> Result<Option<&kernels::DeviceSpans>> {
        if let Some(spans) = self.spans.get() {
            return Ok(spans.as_ref());
        }
        let device = self.key_mask.device();
        let spans = attention_spans(&self.inputs).map(|s| kernels::DeviceSpans::new(&s, device)).transpose()?;
        Ok(self.spans.get_or_init(|| spans).as_ref())
    }

    /// What masks whole-sequence attention by the `chosen` kernels at head
    /// size `d` in `dtype`: the spans where those kernels read them, else
    /// the bias.
    fn mask(&self, chosen: kernels::AttentionKernels, dtype: DType, d: usize) -> Result<kernels::AttentionMask> {
        if self.spans_chosen && kernels::spans_taken(chosen, dtype, d) {
            if let Some(spans) = self.spans()? {
                return Ok(kernels::AttentionMask::Spans(spans.clone()));
            }
        }
        Ok(kernels::AttentionMask::Bias(self.bias()?.clone()))
    }

    /// Hands the key mask to the cache once every layer has appended.
    pub fn finish(&self, cache: Option<&mut KvCache>) {
        if let Some(cache) = cache {
            cache.finish_pass(self.key_mask.clone(), self.inputs.seq_len());
        }
    }
}

/// The (B, 1, T, S) bias of `queries` over the first `slots` of the key
/// mask, or of shared-prefix rows by their parts (`segments`).
fn make_bias(segments: Option<&[u32]>, key_mask: &Tensor, slots: usize, queries: usize) -> Result<Tensor> {
    match segments {
        Some(segments) => shared_prefix_bias(segments, key_mask.dim(0)?, queries, key_mask.device()),
        None => causal_bias(&key_mask.narrow(1, 0, slots)?, queries),
    }
}

/// Per-head projections entering attention, each (B, T, heads, D).
pub struct Qkv {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    /// The fused projection (B, T, W) they were cut from, if any, and where
    /// they sit in it: the fused kernel reads it directly.
    pub packed: Option<(Tensor, kernels::Packing)>,
}

/// Rotary, cache, grouped-query repeat and scaled dot-product attention.
/// Returns (B, T, H * D), ready for the output projection.
pub fn self_attention(
    qkv: Qkv,
    ctx: &Context,
    cache: Option<&mut KvCache>,
    layer: usize,
    scale: f64,
) -> Result<Tensor> {
    let (b, t, n_heads, d) = qkv.q.dims4()?;
    // bf16 on the CPU goes through the f32 kernel with its inputs cast up:
    // the composition would keep (B, H, T, S) scores and their softmax.
    let cpu_bf16 = qkv.q.device().is_cpu() && qkv.q.dtype() == DType::BF16;
    if let (Some(whole), None, true) = (&ctx.whole, &cache, kernels::fused(&qkv.q) || cpu_bf16) {
        let f32 = |x: &Tensor| x.to_dtype(DType::F32);
        let out = match &qkv.packed {
            Some((fused, packing)) => kernels::attention_packed(&f32(fused)?, *packing, n_heads, d, whole, scale)?,
            None => kernels::attention(&f32(&qkv.q)?, &f32(&qkv.k)?, &f32(&qkv.v)?, whole, scale)?,
        };
        return out.to_dtype(qkv.q.dtype());
    }
    if let (Some((fused, packing)), None, true) = (&qkv.packed, &cache, ctx.fused_heads) {
        let (rotary, chosen) = (ctx.rotary.as_ref(), kernels::attention_kernels()?);
        let mask = ctx.mask(chosen, fused.dtype(), d)?;
        if let Some(out) = kernels::qkv_attention(fused, *packing, n_heads, d, rotary, &mask, scale, chosen)? {
            return Ok(out);
        }
    }
    let (q, k, v) = match cache {
        Some(cache) => {
            // On a GPU, one launch can rotate and append a decoding step's heads.
            let fused = match ctx.fused_append {
                true => kernels::rotary_append_cuda((&qkv.q, &qkv.k, &qkv.v), ctx.rotary.as_ref(), cache, layer)?,
                false => None,
            };
            let (q, kv) = match fused {
                Some(appended) => appended,
                None => {
                    let (q, k, v) = rotated_heads(&qkv, ctx)?;
                    (q, cache.append(layer, &k, &v)?)
                }
            };
            if let Some(kernel) = ctx.decode_kernel {
                let out = match &ctx.decode_mask {
                    Some(mask) if kernels::fused(&q) => Some(decode_attention(&q, &kv, mask, scale)?),
                    _ => kernels::decode_attention_cuda(&q, &kv, &ctx.key_mask, scale, kernel)?,
                };
                if let Some(out) = out {
                    return out.transpose(1, 2)?.reshape((b, t, n_heads * d));
                }
            }
            if super::device::recording(q.device()) {
                candle_core::bail!(
                    "a recorded decoding step would attend over the slots it was recorded with: \
                     recording needs a decoding attention kernel (RLOO_DECODE_ATTENTION=lanes or fused)"
                );
            }
            let (k, v) = kv.whole()?;
            (q, k, v)
        }
        None => rotated_heads(&qkv, ctx)?,
    };
    let chosen = kernels::attention_kernels()?;
    kernels::sdpa_merged(&q, &k, &v, &ctx.mask(chosen, q.dtype(), d)?, scale, chosen)
}

/// q, k and v as (B, H, T, D), q and k rotated.
fn rotated_heads(qkv: &Qkv, ctx: &Context) -> Result<(Tensor, Tensor, Tensor)> {
    // Without a graph (a prefill), one launch cuts them from a fused projection.
    if let Some((fused, packing)) = qkv.packed.as_ref().filter(|(f, _)| ctx.fused_heads && !f.track_op()) {
        let (_, _, heads, d) = qkv.q.dims4()?;
        if let Some(heads) = kernels::qkv_heads(fused, *packing, heads, d, ctx.rotary.as_ref())? {
            return Ok(heads);
        }
    }
    // (B, T, H, D) -> (B, H, T, D), keeping nothing of the projections.
    let mut q = kernels::contiguous(&qkv.q.transpose(1, 2)?)?;
    let mut k = kernels::contiguous(&qkv.k.transpose(1, 2)?)?;
    let v = kernels::contiguous(&qkv.v.transpose(1, 2)?)?;
    if let (Some(tables), true) = (&ctx.rotary_host, kernels::fused(&q)) {
        q = kernels::rotary(&q, tables)?;
        k = kernels::rotary(&k, tables)?;
    } else if let Some((cos, sin)) = &ctx.rotary {
        q = kernels::rotate(&q, cos, sin)?;
        k = kernels::rotate(&k, cos, sin)?;
    }
    Ok((q, k, v))
}

/// Looks up token embeddings: ids (B, T) -> (B, T, H).
pub fn embed(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (b, t) = ids.dims2()?;
    let hidden = table.dim(1)?;
    kernels::gather_rows(table, &ids.flatten_all()?)?.reshape((b, t, hidden))
}

/// A dense layer with a PyTorch-layout weight (out, in), and optionally a
/// LoRA adapter.
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub adapter: Option<Adapter>,
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias, adapter: None }
    }

    pub fn with_adapter(mut self, adapter: Option<Adapter>) -> Self {
        self.adapter = adapter;
        self
    }

    /// Loads `name.weight` (out, in) and, when `bias`, `name.bias` (out,),
    /// and the layer's adapter when `w`'s plan targets it.
    pub fn load(w: &Weights, name: &str, out_dim: usize, in_dim: usize, bias: bool) -> LoadResult<Self> {
        let adapter = w.adapter(name, out_dim, in_dim)?;
        let w = w.pp(name);
        let bias = if bias { Some(w.get("bias", out_dim)?) } else { None };
        Ok(Self::new(w.get("weight", (out_dim, in_dim))?, bias).with_adapter(adapter))
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.adapter {
            Some(adapter) => adapter.forward(x, None, &self.weight, self.bias.as_ref()),
            None => kernels::linear(x, &self.weight, self.bias.as_ref()),
        }
    }

    /// `forward(norm(x))`, where the training graph keeps `x` alone (a
    /// layer with a bias and no adapter).
    pub fn forward_normed(&self, norm: &LayerNorm, x: &Tensor) -> Result<Tensor> {
        match (&self.adapter, &self.bias) {
            (None, Some(b)) => kernels::norm_linear(x, (&norm.weight, &norm.bias, norm.eps), &self.weight, b),
            _ => self.forward(&norm.forward(x)?),
        }
    }

    /// `down.forward_activated(self.forward_normed(norm, x), act)`: an MLP
    /// after its norm. With `RLOO_MLP_INPUT=remade` the training graph keeps
    /// neither the norm's output nor the wide input (layers with biases
    /// and no adapters): the backward makes the wide input again from `x`.
    pub fn forward_normed_mlp(&self, norm: &LayerNorm, x: &Tensor, down: &Linear, act: Activation) -> Result<Tensor> {
        let wide = self.forward_normed(norm, x)?;
        let (None, None, Some(b), Some(down_b)) = (&self.adapter, &down.adapter, &self.bias, &down.bias) else {
            return down.forward_activated(&wide, act);
        };
        let norm = (&norm.weight, &norm.bias, norm.eps);
        match kernels::norm_linear_remake(x, norm, &self.weight, b)? {
            Some(remake) if kernels::mlp_input_remade()? => {
                kernels::activation_linear_remade(&wide, act, &down.weight, down_b, remake)
            }
            _ => down.forward_activated(&wide, act),
        }
    }

    /// `forward(x)` for `x` a norm's output that `normed` makes again: the
    /// training graph keeps only its place (a layer without an adapter).
    pub fn forward_remade(&self, x: &Tensor, normed: Option<&Remake>) -> Result<Tensor> {
        match (&self.adapter, normed) {
            (None, Some(normed)) => kernels::linear_remade(x, &self.weight, self.bias.as_ref(), normed.clone()),
            _ => self.forward(x),
        }
    }

    /// What makes [`Self::forward_remade`]'s values again, without a graph
    /// (a layer without an adapter, on an input that `normed` makes again).
    pub fn remake(&self, normed: Option<&Remake>) -> Option<Remake> {
        let (None, Some(normed)) = (&self.adapter, normed) else { return None };
        let (normed, w, b) = (normed.clone(), self.weight.detach(), self.bias.as_ref().map(Tensor::detach));
        Some(Arc::new(move || kernels::linear(&normed()?, &w, b.as_ref())))
    }

    /// `forward(act(gate) * up)`, where the training graph keeps `gate` and
    /// `up` alone (a layer with no bias), or with `remakes` only their
    /// places, the backward making them again (a layer with no adapter).
    pub fn forward_gated(
        &self,
        gate: &Tensor,
        up: &Tensor,
        act: Activation,
        remakes: Option<(Remake, Remake)>,
    ) -> Result<Tensor> {
        match (&self.adapter, &self.bias, remakes) {
            (None, None, Some(remakes)) => kernels::gated_linear_remade(gate, up, act, &self.weight, remakes),
            (None, None, None) => kernels::gated_linear(gate, up, act, &self.weight),
            (Some(adapter), None, _) => {
                let (product, remake) = kernels::gated_product(gate, up, act)?;
                adapter.forward_remade(&product, &self.weight, None, remake)
            }
            _ => self.forward(&(kernels::activation(gate, act)? * up)?),
        }
    }

    /// `forward(act(u))`, where the training graph keeps `u` alone.
    pub fn forward_activated(&self, u: &Tensor, act: Activation) -> Result<Tensor> {
        match &self.adapter {
            Some(adapter) => adapter.forward(u, Some(act), &self.weight, self.bias.as_ref()),
            None => kernels::activation_linear(u, act, &self.weight, self.bias.as_ref()),
        }
    }
}

/// LayerNorm with weight and bias (GPT-NeoX, GPT-2).
pub struct LayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    pub eps: f64,
}

impl LayerNorm {
    /// Loads `weight` and `bias` of shape (dim,) under `w`.
    pub fn load(w: &Weights, dim: usize, eps: f64) -> LoadResult<Self> {
        Ok(Self { weight: w.get("weight", dim)?, bias: w.get("bias", dim)?, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        kernels::layer_norm(x, &self.weight, &self.bias, self.eps)
    }

    /// What makes `forward(x)` again for a backward that keeps only its
    /// place (see [`Linear::forward_remade`]); None without a graph.
    pub fn remake(&self, x: &Tensor) -> Option<Remake> {
        kernels::layer_norm_remake(x, &self.weight, &self.bias, self.eps)
    }
}
