//! GPT-NeoX (Pythia).
//!
//! Reference: transformers `models/gpt_neox/modeling_gpt_neox.py`.
//! LayerNorm blocks with a fused query/key/value projection, partial rotary
//! embeddings (`rotary_pct` / `partial_rotary_factor`) and either parallel
//! (`x + attn(ln1(x)) + mlp(ln2(x))`) or sequential residuals.

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
use super::rope::{RawRope, Rope};
use super::weights::Weights;
use crate::error::Result;

#[derive(Debug, Clone)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub layer_norm_eps: f64,
    pub act: Activation,
    pub rope: Rope,
    pub use_parallel_residual: bool,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
}

/// `config.json` keys with transformers' `GPTNeoXConfig` defaults.
#[derive(Debug, Deserialize)]
pub struct RawConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "yes")]
    pub use_parallel_residual: bool,
    #[serde(default = "yes")]
    pub attention_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(flatten)]
    pub rope: RawRope,
}

fn default_eps() -> f64 {
    1e-5
}
fn default_act() -> String {
    "gelu".into()
}
fn yes() -> bool {
    true
}

#[derive(Debug)]
pub struct GptNeox;

impl Architecture for GptNeox {
    fn model_type(&self) -> &'static str {
        "gpt_neox"
    }
    fn resolve(&self, raw: &Value) -> std::result::Result<Arc<dyn ArchConfig>, String> {
        Ok(Arc::new(raw_config::<RawConfig>(raw)?.resolve()?))
    }
    fn class_stem(&self) -> &'static str {
        "GPTNeoX"
    }
    fn base_prefix(&self) -> &'static str {
        "gpt_neox"
    }
    fn embedding_name(&self) -> &'static str {
        "embed_in.weight"
    }
    fn lm_head_name(&self) -> &'static str {
        "embed_out.weight"
    }
    fn lora_targets(&self) -> &'static [&'static str] {
        &["query_key_value"]
    }
}

impl ArchConfig for Config {
    fn dims(&self) -> Dims {
        Dims {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            head_width: self.hidden_size,
            num_layers: self.num_layers,
            head_dim: self.head_dim,
            kv_width: self.hidden_size,
            tie_word_embeddings: self.tie_word_embeddings,
            max_positions: None,
        }
    }
    fn load_decoder(&self, base: &Weights) -> Result<Arc<dyn super::Decoder>> {
        Ok(Arc::new(Decoder::load(self, base)?))
    }
    fn kept_per_layer(&self, keeping: Keeping) -> f64 {
        let wide = self.intermediate_size as f64 / self.hidden_size as f64;
        let remade = keeping.mlp_input_remade && !keeping.lora;
        // The input, the fused projection, attention's output and the MLP's
        // wide input (each norm is one op with its dense layer, and keeps
        // nothing of its own, unless the layer has an adapter or, before
        // attention, no bias); a sequential residual's first sum.
        let sequential = if self.use_parallel_residual { 0.0 } else { 1.0 };
        let norm_outputs = match (keeping.lora, self.attention_bias) {
            (true, _) => 2.0,
            (false, true) => 0.0,
            (false, false) => 1.0,
        };
        1.0 + 3.0 + 1.0 + if remade { 0.0 } else { wide } + sequential + norm_outputs
    }
}

impl RawConfig {
    pub fn resolve(&self) -> std::result::Result<Config, String> {
        let heads = self.num_attention_heads;
        if heads == 0 || !self.hidden_size.is_multiple_of(heads) {
            return Err(format!("hidden_size={} is not a multiple of num_attention_heads={heads}", self.hidden_size));
        }
        let head_dim = self.hidden_size / heads;
        let act = Activation::from_hf(&self.hidden_act).ok_or_else(|| {
            format!("hidden_act `{}` is not supported (supported: {})", self.hidden_act, Activation::SUPPORTED)
        })?;
        Ok(Config {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: heads,
            head_dim,
            layer_norm_eps: self.layer_norm_eps,
            act,
            // GPTNeoXConfig's rotary_emb_base default.
            rope: self.rope.resolve(head_dim, 10_000.0)?,
            use_parallel_residual: self.use_parallel_residual,
            attention_bias: self.attention_bias,
            tie_word_embeddings: self.tie_word_embeddings,
        })
    }
}

struct Block {
    input_layernorm: LayerNorm,
    post_attention_layernorm: LayerNorm,
    query_key_value: Linear,
    dense: Linear,
    dense_h_to_4h: Linear,
    dense_4h_to_h: Linear,
}

pub struct Decoder {
    cfg: Config,
    embed_in: Tensor,
    layers: Vec<Block>,
    final_layer_norm: LayerNorm,
    inv_freq: Tensor,
}

impl Decoder {
    /// `w` points at the base model (`gpt_neox.`).
    pub fn load(cfg: &Config, w: &Weights) -> Result<Self> {
        let h = cfg.hidden_size;
        let bias = cfg.attention_bias;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let lw = w.pp("layers").pp(i);
            let (aw, mw) = (lw.pp("attention"), lw.pp("mlp"));
            layers.push(Block {
                input_layernorm: LayerNorm::load(&lw.pp("input_layernorm"), h, cfg.layer_norm_eps)?,
                post_attention_layernorm: LayerNorm::load(&lw.pp("post_attention_layernorm"), h, cfg.layer_norm_eps)?,
                query_key_value: Linear::load(&aw, "query_key_value", 3 * h, h, bias)?,
                dense: Linear::load(&aw, "dense", h, h, bias)?,
                dense_h_to_4h: Linear::load(&mw, "dense_h_to_4h", cfg.intermediate_size, h, true)?,
                dense_4h_to_h: Linear::load(&mw, "dense_4h_to_h", h, cfg.intermediate_size, true)?,
            });
        }
        let embed_in = w.get("embed_in.weight", (cfg.vocab_size, h))?;
        Ok(Self {
            cfg: cfg.clone(),
            inv_freq: cfg.rope.inv_freq_tensor(embed_in.device())?,
            embed_in,
            layers,
            final_layer_norm: LayerNorm::load(&w.pp("final_layer_norm"), h, cfg.layer_norm_eps)?,
        })
    }

    /// Attention on the input norm of `x` (made already where `normed`).
    fn attention(
        &self,
        blk: &Block,
        x: &Tensor,
        normed: Option<&Tensor>,
        ctx: &Context,
        cache: Option<&mut KvCache>,
        layer: usize,
    ) -> TResult<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (heads, d) = (self.cfg.num_heads, self.cfg.head_dim);
        // The fused projection is laid out per head: (B, T, H, 3 * D) = [q | k | v].
        let fused = match normed {
            Some(normed) => blk.query_key_value.forward(normed)?,
            None => blk.query_key_value.forward_normed(&blk.input_layernorm, x)?,
        };
        let qkv = fused.reshape((b, t, heads, 3 * d))?;
        let qkv = Qkv {
            q: qkv.narrow(D::Minus1, 0, d)?,
            k: qkv.narrow(D::Minus1, d, d)?,
            v: qkv.narrow(D::Minus1, 2 * d, d)?,
            packed: Some((fused, kernels::Packing { q: 0, k: d, v: 2 * d, head_stride: 3 * d })),
        };
        let out = self_attention(qkv, ctx, cache, layer, 1.0 / (d as f64).sqrt())?;
        blk.dense.forward(&out)
    }

    /// The MLP on the post-attention norm of `x` (made already where `normed`).
    fn mlp(&self, blk: &Block, x: &Tensor, normed: Option<&Tensor>) -> TResult<Tensor> {
        match normed {
            Some(normed) => blk.dense_4h_to_h.forward_activated(&blk.dense_h_to_4h.forward(normed)?, self.cfg.act),
            None => {
                blk.dense_h_to_4h.forward_normed_mlp(&blk.post_attention_layernorm, x, &blk.dense_4h_to_h, self.cfg.act)
            }
        }
    }
}

impl super::Decoder for Decoder {
    fn context(&self, inputs: &Inputs, cache: Option<&KvCache>) -> TResult<Context> {
        Context::new(inputs, cache, Some((&self.cfg.rope, &self.inv_freq)))
    }

    fn embed(&self, inputs: &Inputs) -> TResult<Tensor> {
        embed(&self.embed_in, &inputs.ids)
    }

    fn block(&self, layer: usize, x: &Tensor, ctx: &Context, cache: Option<&mut KvCache>) -> TResult<Tensor> {
        let blk = &self.layers[layer];
        if !self.cfg.use_parallel_residual {
            let attn = self.attention(blk, x, None, ctx, cache, layer)?;
            let x = kernels::residual(x, &attn)?;
            let mlp = self.mlp(blk, &x, None)?;
            return kernels::residual(&x, &mlp);
        }
        // Both branches norm the same x: without a graph, one pass makes both.
        let (ln1, ln2) = (&blk.input_layernorm, &blk.post_attention_layernorm);
        let pair = kernels::layer_norm_pair(x, (&ln1.weight, &ln1.bias, ln1.eps), (&ln2.weight, &ln2.bias, ln2.eps))?;
        let (normed_1, normed_2) = pair.as_ref().map(|(a, b)| (a, b)).unzip();
        let attn = self.attention(blk, x, normed_1, ctx, cache, layer)?;
        let mlp = self.mlp(blk, x, normed_2)?;
        kernels::sum3(x, &attn, &mlp)
    }

    fn final_norm(&self, x: &Tensor) -> TResult<Tensor> {
        self.final_layer_norm.forward(x)
    }

    fn embedding(&self) -> &Tensor {
        &self.embed_in
    }

    fn num_layers(&self) -> usize {
        self.cfg.num_layers
    }
}
