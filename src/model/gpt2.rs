//! GPT-2.
//!
//! Reference: transformers `models/gpt2/modeling_gpt2.py`.
//! Learned absolute positions, pre-norm LayerNorm blocks, and `Conv1D`
//! projections whose weights are stored transposed, (in, out), unlike
//! `nn.Linear`'s (out, in): they are loaded with their stored shape and
//! used through a transposed view. The original `gpt2` checkpoints store
//! the base model without the `transformer.` prefix; both layouts load.
//! Not supported: cross-attention (`add_cross_attention`).

use std::sync::Arc;

use candle_core::{Result as TResult, Tensor, D};
use serde::Deserialize;
use serde_json::Value;

use super::arch::{raw_config, ArchConfig, Architecture, Dims, Keeping};
use super::batch::Inputs;
use super::cache::KvCache;
use super::kernels;
use super::layers::{embed, self_attention, Context, LayerNorm, Linear, Qkv};
use super::ops::Activation;
use super::weights::Weights;
use crate::error::Result;

#[derive(Debug, Clone)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub inner_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub max_positions: usize,
    pub layer_norm_eps: f64,
    pub act: Activation,
    pub scale_attn_weights: bool,
    pub scale_attn_by_inverse_layer_idx: bool,
    pub tie_word_embeddings: bool,
}

/// `config.json` keys with transformers' `GPT2Config` defaults.
#[derive(Debug, Deserialize)]
pub struct RawConfig {
    #[serde(default = "default_vocab")]
    pub vocab_size: usize,
    #[serde(default = "default_n_embd")]
    pub n_embd: usize,
    #[serde(default = "default_n_layer")]
    pub n_layer: usize,
    #[serde(default = "default_n_head")]
    pub n_head: usize,
    pub n_inner: Option<usize>,
    #[serde(default = "default_n_positions")]
    pub n_positions: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_act")]
    pub activation_function: String,
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub add_cross_attention: bool,
}

fn default_vocab() -> usize {
    50257
}
fn default_n_embd() -> usize {
    768
}
fn default_n_layer() -> usize {
    12
}
fn default_n_head() -> usize {
    12
}
fn default_n_positions() -> usize {
    1024
}
fn default_eps() -> f64 {
    1e-5
}
fn default_act() -> String {
    "gelu_new".into()
}
fn yes() -> bool {
    true
}

#[derive(Debug)]
pub struct Gpt2;

impl Architecture for Gpt2 {
    fn model_type(&self) -> &'static str {
        "gpt2"
    }
    fn resolve(&self, raw: &Value) -> std::result::Result<Arc<dyn ArchConfig>, String> {
        Ok(Arc::new(raw_config::<RawConfig>(raw)?.resolve()?))
    }
    fn class_stem(&self) -> &'static str {
        "GPT2"
    }
    fn causal_lm_class(&self) -> String {
        "GPT2LMHeadModel".into()
    }
    fn base_prefix(&self) -> &'static str {
        "transformer"
    }
    fn embedding_name(&self) -> &'static str {
        "wte.weight"
    }
    fn lora_targets(&self) -> &'static [&'static str] {
        &["c_attn"]
    }
    fn conv1d_weights(&self) -> bool {
        true
    }
}

impl ArchConfig for Config {
    fn dims(&self) -> Dims {
        Dims {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            head_width: self.hidden_size,
            num_layers: self.num_layers,
            head_dim: self.hidden_size / self.num_heads,
            kv_width: self.hidden_size,
            tie_word_embeddings: self.tie_word_embeddings,
            max_positions: Some(self.max_positions),
        }
    }
    fn load_decoder(&self, base: &Weights) -> Result<Arc<dyn super::Decoder>> {
        Ok(Arc::new(Decoder::load(self, base)?))
    }
    fn kept_per_layer(&self, keeping: Keeping) -> f64 {
        let wide = self.inner_size as f64 / self.hidden_size as f64;
        let remade = keeping.mlp_input_remade && !keeping.lora;
        // The input, the fused projection, attention's output, the first
        // residual sum and the MLP's wide input (each norm is one op with
        // its dense layer).
        1.0 + 3.0 + 1.0 + 1.0 + if remade { 0.0 } else { wide } + keeping.norm_outputs(2)
    }
}

impl RawConfig {
    pub fn resolve(&self) -> std::result::Result<Config, String> {
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!("n_embd={} is not a multiple of n_head={}", self.n_embd, self.n_head));
        }
        if self.add_cross_attention {
            return Err("add_cross_attention=true is not supported".into());
        }
        let act = Activation::from_hf(&self.activation_function).ok_or_else(|| {
            format!(
                "activation_function `{}` is not supported (supported: {})",
                self.activation_function,
                Activation::SUPPORTED
            )
        })?;
        Ok(Config {
            vocab_size: self.vocab_size,
            hidden_size: self.n_embd,
            inner_size: self.n_inner.unwrap_or(4 * self.n_embd),
            num_layers: self.n_layer,
            num_heads: self.n_head,
            max_positions: self.n_positions,
            layer_norm_eps: self.layer_norm_epsilon,
            act,
            scale_attn_weights: self.scale_attn_weights,
            scale_attn_by_inverse_layer_idx: self.scale_attn_by_inverse_layer_idx,
            tie_word_embeddings: self.tie_word_embeddings,
        })
    }
}

/// Loads a `Conv1D` stored as (in, out) into a [`Linear`] holding the (out,
/// in) view, with its adapter when `w`'s plan targets it.
fn conv1d(w: &Weights, name: &str, in_dim: usize, out_dim: usize) -> Result<Linear> {
    let adapter = w.adapter(name, out_dim, in_dim)?;
    let w = w.pp(name);
    let linear = Linear::new(w.get("weight", (in_dim, out_dim))?.t()?, Some(w.get("bias", out_dim)?));
    Ok(linear.with_adapter(adapter))
}

struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
}

pub struct Decoder {
    cfg: Config,
    wte: Tensor,
    wpe: Tensor,
    layers: Vec<Block>,
    ln_f: LayerNorm,
}

impl Decoder {
    /// `w` points at the base model (`transformer.`, or the root for original checkpoints).
    pub fn load(cfg: &Config, w: &Weights) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.layer_norm_eps);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let lw = w.pp("h").pp(i);
            layers.push(Block {
                ln_1: LayerNorm::load(&lw.pp("ln_1"), h, eps)?,
                c_attn: conv1d(&lw.pp("attn"), "c_attn", h, 3 * h)?,
                attn_proj: conv1d(&lw.pp("attn"), "c_proj", h, h)?,
                ln_2: LayerNorm::load(&lw.pp("ln_2"), h, eps)?,
                c_fc: conv1d(&lw.pp("mlp"), "c_fc", h, cfg.inner_size)?,
                mlp_proj: conv1d(&lw.pp("mlp"), "c_proj", cfg.inner_size, h)?,
            });
        }
        Ok(Self {
            cfg: cfg.clone(),
            wte: w.get("wte.weight", (cfg.vocab_size, h))?,
            wpe: w.get("wpe.weight", (cfg.max_positions, h))?,
            layers,
            ln_f: LayerNorm::load(&w.pp("ln_f"), h, eps)?,
        })
    }

    /// Attention on the first norm of `x`.
    fn attention(
        &self,
        blk: &Block,
        x: &Tensor,
        ctx: &Context,
        cache: Option<&mut KvCache>,
        layer: usize,
    ) -> TResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let heads = self.cfg.num_heads;
        let d = h / heads;
        // c_attn gives [q | k | v] along the feature axis, each (B, T, H * D).
        let qkv = blk.c_attn.forward_normed(&blk.ln_1, x)?;
        let split = |i: usize| qkv.narrow(D::Minus1, i * h, h)?.reshape((b, t, heads, d));
        let mut scale = if self.cfg.scale_attn_weights { 1.0 / (d as f64).sqrt() } else { 1.0 };
        if self.cfg.scale_attn_by_inverse_layer_idx {
            scale /= (layer + 1) as f64;
        }
        let packing = kernels::Packing { q: 0, k: h, v: 2 * h, head_stride: d };
        let qkv_heads = Qkv { q: split(0)?, k: split(1)?, v: split(2)?, packed: Some((qkv.clone(), packing)) };
        let out = self_attention(qkv_heads, ctx, cache, layer, scale)?;
        blk.attn_proj.forward(&out)
    }
}

impl super::Decoder for Decoder {
    fn context(&self, inputs: &Inputs, cache: Option<&KvCache>) -> TResult<Context> {
        Context::new(inputs, cache, None)
    }

    fn embed(&self, inputs: &Inputs) -> TResult<Tensor> {
        // A residual sum: the graph keeps neither lookup.
        kernels::residual(&embed(&self.wte, &inputs.ids)?, &embed(&self.wpe, &inputs.positions)?)
    }

    fn block(&self, layer: usize, x: &Tensor, ctx: &Context, cache: Option<&mut KvCache>) -> TResult<Tensor> {
        let blk = &self.layers[layer];
        let x = kernels::residual(x, &self.attention(blk, x, ctx, cache, layer)?)?;
        let mlp = blk.c_fc.forward_normed_mlp(&blk.ln_2, &x, &blk.mlp_proj, self.cfg.act)?;
        kernels::residual(&x, &mlp)
    }

    fn final_norm(&self, x: &Tensor) -> TResult<Tensor> {
        self.ln_f.forward(x)
    }

    fn embedding(&self) -> &Tensor {
        &self.wte
    }

    fn num_layers(&self) -> usize {
        self.cfg.num_layers
    }
}
