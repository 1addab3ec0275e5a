//! The Llama family: Llama, Qwen2 and Qwen3 share this decoder.
//!
//! Reference: transformers `models/llama/modeling_llama.py`,
//! `models/qwen2/modeling_qwen2.py`, `models/qwen3/modeling_qwen3.py`.
//! Pre-norm blocks with RMSNorm, rotary attention with grouped-query heads,
//! and a SwiGLU MLP. The members differ only in biases (Qwen2: q/k/v) and
//! per-head q/k RMSNorm (Qwen3); each member's `config.json` resolves into
//! [`Config`] in its own file. Not supported: sliding-window attention,
//! `pretraining_tp > 1`, rope types other than default, linear and llama3.

use std::sync::Arc;

use candle_core::{Result as TResult, Tensor};
use serde::Deserialize;
use serde_json::Value;

use super::arch::{raw_config, ArchConfig, Architecture, Dims, Keeping};
use super::batch::Inputs;
use super::cache::KvCache;
use super::kernels::{self, Remake};
use super::layers::{embed, self_attention, Context, Linear, Qkv};
use super::ops::Activation;
use super::rope::{RawRope, Rope};
use super::weights::Weights;
use crate::error::Result;

/// Resolved, validated hyper-parameters.
#[derive(Debug, Clone)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub act: Activation,
    pub rope: Rope,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// Qwen3's RMSNorm on each query and key head before rotary.
    pub qk_norm: bool,
    pub tie_word_embeddings: bool,
}

/// `config.json` keys common to the family, with transformers' defaults.
#[derive(Debug, Deserialize)]
pub struct RawConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub use_sliding_window: bool,
    pub pretraining_tp: Option<usize>,
    #[serde(flatten)]
    pub rope: RawRope,
}

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

/// How a family member departs from plain Llama.
#[derive(Debug, Clone, Copy)]
pub struct Variant {
    pub qkv_bias: bool,
    pub qk_norm: bool,
}

/// A member of the Llama family: its names and its [`Variant`]; its
/// tensors are laid out as Llama's.
#[derive(Debug)]
pub struct Member {
    pub model_type: &'static str,
    pub class_stem: &'static str,
    pub variant: Variant,
}

pub const LLAMA: Member =
    Member { model_type: "llama", class_stem: "Llama", variant: Variant { qkv_bias: false, qk_norm: false } };

impl Architecture for Member {
    fn model_type(&self) -> &'static str {
        self.model_type
    }
    fn resolve(&self, raw: &Value) -> std::result::Result<Arc<dyn ArchConfig>, String> {
        Ok(Arc::new(raw_config::<RawConfig>(raw)?.resolve(self.variant)?))
    }
    fn class_stem(&self) -> &'static str {
        self.class_stem
    }
    fn base_prefix(&self) -> &'static str {
        "model"
    }
    fn embedding_name(&self) -> &'static str {
        "embed_tokens.weight"
    }
    fn lora_targets(&self) -> &'static [&'static str] {
        &["q_proj", "v_proj"]
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
            kv_width: self.num_kv_heads * self.head_dim,
            tie_word_embeddings: self.tie_word_embeddings,
            max_positions: None,
        }
    }
    fn load_decoder(&self, base: &Weights) -> Result<Arc<dyn super::Decoder>> {
        Ok(Arc::new(Decoder::load(self, base)?))
    }
    fn kept_per_layer(&self, keeping: Keeping) -> f64 {
        let h = self.hidden_size as f64;
        let (q, kv, wide) = (
            (self.num_heads * self.head_dim) as f64 / h,
            (self.num_kv_heads * self.head_dim) as f64 / h,
            self.intermediate_size as f64 / h,
        );
        // The input, q, k and v, attention's output, the first residual sum,
        // and the MLP's gate and up projections unless the backward makes
        // them again (the activation and its product it makes again in any
        // case, with an adapter on the down projection too); Qwen3's q and
        // k before their norms. Adapters keep the norms' outputs, and their
        // gate and up projections are not made again.
        let gated = match keeping.mlp_input_remade && !keeping.lora {
            true => 0.0,
            false => 2.0 * wide,
        };
        let qk_norm = if self.qk_norm { q + kv } else { 0.0 };
        1.0 + q + 2.0 * kv + q + 1.0 + gated + qk_norm + keeping.norm_outputs(2)
    }
}

impl RawConfig {
    pub fn resolve(&self, variant: Variant) -> std::result::Result<Config, String> {
        let heads = self.num_attention_heads;
        let kv_heads = self.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(format!("num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"));
        }
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if self.hidden_size.is_multiple_of(heads) => self.hidden_size / heads,
            None => {
                return Err(format!(
                    "hidden_size={} is not a multiple of num_attention_heads={heads} and head_dim is not set",
                    self.hidden_size
                ))
            }
        };
        if self.use_sliding_window {
            return Err("use_sliding_window=true is not supported".into());
        }
        if self.pretraining_tp.unwrap_or(1) != 1 {
            return Err("pretraining_tp > 1 is not supported".into());
        }
        let act = Activation::from_hf(&self.hidden_act).ok_or_else(|| {
            format!("hidden_act `{}` is not supported (supported: {})", self.hidden_act, Activation::SUPPORTED)
        })?;
        Ok(Config {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            rms_norm_eps: self.rms_norm_eps,
            act,
            rope: self.rope.resolve(head_dim, 10_000.0)?,
            qkv_bias: variant.qkv_bias || self.attention_bias,
            o_bias: self.attention_bias,
            mlp_bias: self.mlp_bias,
            qk_norm: variant.qk_norm,
            tie_word_embeddings: self.tie_word_embeddings,
        })
    }
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// (q_norm, k_norm) weights of shape (D,), Qwen3 only.
    qk_norm: Option<(Tensor, Tensor)>,
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

struct Block {
    input_layernorm: Tensor,
    self_attn: Attention,
    post_attention_layernorm: Tensor,
    mlp: Mlp,
}

pub struct Decoder {
    cfg: Config,
    embed_tokens: Tensor,
    layers: Vec<Block>,
    norm: Tensor,
    inv_freq: Tensor,
}

impl Decoder {
    /// `w` points at the base model (`model.` in `*ForCausalLM` checkpoints).
    pub fn load(cfg: &Config, w: &Weights) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (q_dim, kv_dim) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let lw = w.pp("layers").pp(i);
            let aw = lw.pp("self_attn");
            let qk_norm =
                if cfg.qk_norm { Some((aw.get("q_norm.weight", d)?, aw.get("k_norm.weight", d)?)) } else { None };
            let self_attn = Attention {
                q_proj: Linear::load(&aw, "q_proj", q_dim, h, cfg.qkv_bias)?,
                k_proj: Linear::load(&aw, "k_proj", kv_dim, h, cfg.qkv_bias)?,
                v_proj: Linear::load(&aw, "v_proj", kv_dim, h, cfg.qkv_bias)?,
                o_proj: Linear::load(&aw, "o_proj", h, q_dim, cfg.o_bias)?,
                qk_norm,
            };
            let mw = lw.pp("mlp");
            let i_size = cfg.intermediate_size;
            let mlp = Mlp {
                gate_proj: Linear::load(&mw, "gate_proj", i_size, h, cfg.mlp_bias)?,
                up_proj: Linear::load(&mw, "up_proj", i_size, h, cfg.mlp_bias)?,
                down_proj: Linear::load(&mw, "down_proj", h, i_size, cfg.mlp_bias)?,
            };
            layers.push(Block {
                input_layernorm: lw.get("input_layernorm.weight", h)?,
                self_attn,
                post_attention_layernorm: lw.get("post_attention_layernorm.weight", h)?,
                mlp,
            });
        }
        let embed_tokens = w.get("embed_tokens.weight", (cfg.vocab_size, h))?;
        Ok(Self {
            cfg: cfg.clone(),
            inv_freq: cfg.rope.inv_freq_tensor(embed_tokens.device())?,
            embed_tokens,
            layers,
            norm: w.get("norm.weight", h)?,
        })
    }

    /// Attention on `x`, a norm's output that `normed` makes again.
    fn attention(
        &self,
        a: &Attention,
        (x, normed): (&Tensor, Option<&Remake>),
        ctx: &Context,
        cache: Option<&mut KvCache>,
        layer: usize,
    ) -> TResult<Tensor> {
        let c = &self.cfg;
        let (b, t, _) = x.dims3()?;
        // (B, T, heads * D) -> (B, T, heads, D)
        let mut q = a.q_proj.forward_remade(x, normed)?.reshape((b, t, c.num_heads, c.head_dim))?;
        let mut k = a.k_proj.forward_remade(x, normed)?.reshape((b, t, c.num_kv_heads, c.head_dim))?;
        let v = a.v_proj.forward_remade(x, normed)?.reshape((b, t, c.num_kv_heads, c.head_dim))?;
        if let Some((qn, kn)) = &a.qk_norm {
            q = kernels::rms_norm(&q, qn, c.rms_norm_eps)?;
            k = kernels::rms_norm(&k, kn, c.rms_norm_eps)?;
        }
        let out = self_attention(Qkv { q, k, v, packed: None }, ctx, cache, layer, 1.0 / (c.head_dim as f64).sqrt())?;
        a.o_proj.forward(&out)
    }

    /// The MLP on `x`, a norm's output that `normed` makes again. With
    /// `RLOO_MLP_INPUT=remade` the training graph keeps neither the gate nor
    /// the up projection: the backward makes them again from the norm's input.
    fn mlp(&self, m: &Mlp, (x, normed): (&Tensor, Option<&Remake>)) -> TResult<Tensor> {
        let (gate, up) = (m.gate_proj.forward_remade(x, normed)?, m.up_proj.forward_remade(x, normed)?);
        let remakes = match (m.gate_proj.remake(normed), m.up_proj.remake(normed)) {
            (Some(gate), Some(up)) if kernels::mlp_input_remade()? => Some((gate, up)),
            _ => None,
        };
        m.down_proj.forward_gated(&gate, &up, self.cfg.act, remakes)
    }
}

impl super::Decoder for Decoder {
    fn context(&self, inputs: &Inputs, cache: Option<&KvCache>) -> TResult<Context> {
        Context::new(inputs, cache, Some((&self.cfg.rope, &self.inv_freq)))
    }

    fn embed(&self, inputs: &Inputs) -> TResult<Tensor> {
        embed(&self.embed_tokens, &inputs.ids)
    }

    fn block(&self, layer: usize, x: &Tensor, ctx: &Context, cache: Option<&mut KvCache>) -> TResult<Tensor> {
        let (block, eps) = (&self.layers[layer], self.cfg.rms_norm_eps);
        // Each norm's output, and what makes it again for the backward.
        let normed = |x: &Tensor, w: &Tensor| -> TResult<_> {
            Ok((kernels::rms_norm(x, w, eps)?, kernels::rms_norm_remake(x, w, eps)))
        };
        let (h, remake) = normed(x, &block.input_layernorm)?;
        let x = kernels::residual(x, &self.attention(&block.self_attn, (&h, remake.as_ref()), ctx, cache, layer)?)?;
        let (h, remake) = normed(&x, &block.post_attention_layernorm)?;
        kernels::residual(&x, &self.mlp(&block.mlp, (&h, remake.as_ref()))?)
    }

    fn final_norm(&self, x: &Tensor) -> TResult<Tensor> {
        kernels::rms_norm(x, &self.norm, self.cfg.rms_norm_eps)
    }

    fn embedding(&self) -> &Tensor {
        &self.embed_tokens
    }

    fn num_layers(&self) -> usize {
        self.cfg.num_layers
    }
}
