//! OPT (`facebook/opt-125m` ... `opt-66b`).
//!
//! Reference: transformers `models/opt/modeling_opt.py`.
//! Learned absolute positions stored with an offset of 2 (row `p + 2` holds
//! position `p`), LayerNorm blocks that are pre-norm, or post-norm when
//! `do_layer_norm_before` is false (opt-350m), and separate q/k/v
//! projections. When `word_embed_proj_dim` differs from `hidden_size`
//! (opt-350m), tokens embed at the smaller width, `project_in` widens them
//! and `project_out` narrows the final states back for the heads. The
//! decoder sits under `model.decoder.`; base-model checkpoints store it
//! under `decoder.`. Not supported: `layer_norm_elementwise_affine = false`.

use std::sync::Arc;

use candle_core::{Result as TResult, Tensor};
use serde::Deserialize;
use serde_json::Value;

use super::arch::{raw_config, ArchConfig, Architecture, Dims, Keeping};
use super::batch::Inputs;
use super::cache::KvCache;
use super::kernels::{self, Remake};
use super::layers::{embed, self_attention, Context, LayerNorm, Linear, Qkv};
use super::ops::Activation;
use super::weights::Weights;
use crate::error::Result;

/// Rows of the position table before position 0.
const POSITION_OFFSET: usize = 2;
/// `nn.LayerNorm`'s default, which OPT keeps.
const LAYER_NORM_EPS: f64 = 1e-5;

#[derive(Debug)]
pub struct Opt;

impl Architecture for Opt {
    fn model_type(&self) -> &'static str {
        "opt"
    }
    fn resolve(&self, raw: &Value) -> std::result::Result<Arc<dyn ArchConfig>, String> {
        Ok(Arc::new(raw_config::<RawConfig>(raw)?.resolve()?))
    }
    fn class_stem(&self) -> &'static str {
        "OPT"
    }
    fn base_prefix(&self) -> &'static str {
        "model.decoder"
    }
    fn embedding_name(&self) -> &'static str {
        "embed_tokens.weight"
    }
    fn lora_targets(&self) -> &'static [&'static str] {
        &["q_proj", "v_proj"]
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub ffn_dim: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub max_positions: usize,
    /// Pre-norm blocks (and a final LayerNorm); post-norm when false.
    pub pre_norm: bool,
    pub final_layer_norm: bool,
    /// The embedding and head width (`word_embed_proj_dim`).
    pub embed_dim: usize,
    pub act: Activation,
    pub bias: bool,
    pub tie_word_embeddings: bool,
}

/// `config.json` keys with transformers' `OPTConfig` defaults.
#[derive(Debug, Deserialize)]
pub struct RawConfig {
    #[serde(default = "default_vocab")]
    pub vocab_size: usize,
    #[serde(default = "default_hidden")]
    pub hidden_size: usize,
    #[serde(default = "default_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "default_ffn")]
    pub ffn_dim: usize,
    #[serde(default = "default_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "yes")]
    pub do_layer_norm_before: bool,
    #[serde(default)]
    pub _remove_final_layer_norm: bool,
    pub word_embed_proj_dim: Option<usize>,
    #[serde(default = "default_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "default_act")]
    pub activation_function: String,
    #[serde(default = "yes")]
    pub enable_bias: bool,
    #[serde(default = "yes")]
    pub layer_norm_elementwise_affine: bool,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

fn default_vocab() -> usize {
    50272
}
fn default_hidden() -> usize {
    768
}
fn default_layers() -> usize {
    12
}
fn default_ffn() -> usize {
    3072
}
fn default_positions() -> usize {
    2048
}
fn default_heads() -> usize {
    12
}
fn default_act() -> String {
    "relu".into()
}
fn yes() -> bool {
    true
}

impl RawConfig {
    pub fn resolve(&self) -> std::result::Result<Config, String> {
        let heads = self.num_attention_heads;
        if heads == 0 || !self.hidden_size.is_multiple_of(heads) {
            return Err(format!("hidden_size={} is not a multiple of num_attention_heads={heads}", self.hidden_size));
        }
        if !self.layer_norm_elementwise_affine {
            return Err("layer_norm_elementwise_affine=false is not supported".into());
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
            hidden_size: self.hidden_size,
            ffn_dim: self.ffn_dim,
            num_layers: self.num_hidden_layers,
            num_heads: heads,
            max_positions: self.max_position_embeddings,
            pre_norm: self.do_layer_norm_before,
            final_layer_norm: self.do_layer_norm_before && !self._remove_final_layer_norm,
            embed_dim: self.word_embed_proj_dim.unwrap_or(self.hidden_size),
            act,
            bias: self.enable_bias,
            tie_word_embeddings: self.tie_word_embeddings,
        })
    }
}

impl ArchConfig for Config {
    fn dims(&self) -> Dims {
        Dims {
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            head_width: self.embed_dim,
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
        let wide = self.ffn_dim as f64 / self.hidden_size as f64;
        if !self.pre_norm {
            // The input, q, k and v, attention's output, the two residual
            // sums the norms read, the first norm's output (the MLP's input
            // and the second sum's) and the MLP's wide input.
            return 8.0 + wide;
        }
        // The input, q, k and v, attention's output, the first residual
        // sum and the MLP's wide input, unless the backward makes it again;
        // the norms' outputs where adapters keep them, or where the MLP's
        // norm is not one op with its dense layer (no bias).
        let mlp_norm_fused = !keeping.lora && self.bias;
        let wide = if keeping.mlp_input_remade && mlp_norm_fused { 0.0 } else { wide };
        let mlp_norm = if mlp_norm_fused { 0.0 } else { 1.0 };
        1.0 + 3.0 + 1.0 + 1.0 + wide + keeping.norm_outputs(1) + mlp_norm
    }
}

struct Block {
    self_attn_layer_norm: LayerNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    final_layer_norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

pub struct Decoder {
    cfg: Config,
    embed_tokens: Tensor,
    /// The position table from row [`POSITION_OFFSET`] on: row `p` is position `p`.
    positions: Tensor,
    /// (hidden, embed_dim) and (embed_dim, hidden) when the widths differ.
    project_in: Option<Linear>,
    project_out: Option<Linear>,
    final_layer_norm: Option<LayerNorm>,
    layers: Vec<Block>,
}

impl Decoder {
    /// `w` points at the decoder (`model.decoder.`).
    pub fn load(cfg: &Config, w: &Weights) -> Result<Self> {
        let (h, e, bias) = (cfg.hidden_size, cfg.embed_dim, cfg.bias);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let lw = w.pp("layers").pp(i);
            let aw = lw.pp("self_attn");
            layers.push(Block {
                self_attn_layer_norm: LayerNorm::load(&lw.pp("self_attn_layer_norm"), h, LAYER_NORM_EPS)?,
                q_proj: Linear::load(&aw, "q_proj", h, h, bias)?,
                k_proj: Linear::load(&aw, "k_proj", h, h, bias)?,
                v_proj: Linear::load(&aw, "v_proj", h, h, bias)?,
                out_proj: Linear::load(&aw, "out_proj", h, h, bias)?,
                final_layer_norm: LayerNorm::load(&lw.pp("final_layer_norm"), h, LAYER_NORM_EPS)?,
                fc1: Linear::load(&lw, "fc1", cfg.ffn_dim, h, bias)?,
                fc2: Linear::load(&lw, "fc2", h, cfg.ffn_dim, bias)?,
            });
        }
        let table = w.get("embed_positions.weight", (cfg.max_positions + POSITION_OFFSET, h))?;
        let projections = e != h;
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens: w.get("embed_tokens.weight", (cfg.vocab_size, e))?,
            positions: table.narrow(0, POSITION_OFFSET, cfg.max_positions)?,
            project_in: if projections { Some(Linear::load(w, "project_in", h, e, false)?) } else { None },
            project_out: if projections { Some(Linear::load(w, "project_out", e, h, false)?) } else { None },
            final_layer_norm: if cfg.final_layer_norm {
                Some(LayerNorm::load(&w.pp("final_layer_norm"), h, LAYER_NORM_EPS)?)
            } else {
                None
            },
            layers,
        })
    }

    /// Attention on `x`, a norm's output that `normed` makes again, if any.
    fn attention(
        &self,
        blk: &Block,
        (x, normed): (&Tensor, Option<&Remake>),
        ctx: &Context,
        cache: Option<&mut KvCache>,
        layer: usize,
    ) -> TResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let heads = self.cfg.num_heads;
        let d = h / heads;
        let split = |proj: &Linear| proj.forward_remade(x, normed)?.reshape((b, t, heads, d));
        let qkv = Qkv { q: split(&blk.q_proj)?, k: split(&blk.k_proj)?, v: split(&blk.v_proj)?, packed: None };
        blk.out_proj.forward(&self_attention(qkv, ctx, cache, layer, 1.0 / (d as f64).sqrt())?)
    }

    /// The MLP on the residual stream `x` (post-norm).
    fn mlp(&self, blk: &Block, x: &Tensor) -> TResult<Tensor> {
        blk.fc2.forward_activated(&blk.fc1.forward(x)?, self.cfg.act)
    }
}

impl super::Decoder for Decoder {
    fn context(&self, inputs: &Inputs, cache: Option<&KvCache>) -> TResult<Context> {
        Context::new(inputs, cache, None)
    }

    fn embed(&self, inputs: &Inputs) -> TResult<Tensor> {
        let tokens = embed(&self.embed_tokens, &inputs.ids)?;
        let tokens = match &self.project_in {
            Some(p) => p.forward(&tokens)?,
            None => tokens,
        };
        // A residual sum: the graph keeps neither lookup.
        kernels::residual(&tokens, &embed(&self.positions, &inputs.positions)?)
    }

    fn block(&self, layer: usize, x: &Tensor, ctx: &Context, cache: Option<&mut KvCache>) -> TResult<Tensor> {
        let blk = &self.layers[layer];
        if self.cfg.pre_norm {
            let norm = &blk.self_attn_layer_norm;
            let (h, normed) = (norm.forward(x)?, norm.remake(x));
            let x = kernels::residual(x, &self.attention(blk, (&h, normed.as_ref()), ctx, cache, layer)?)?;
            let mlp = blk.fc1.forward_normed_mlp(&blk.final_layer_norm, &x, &blk.fc2, self.cfg.act)?;
            kernels::residual(&x, &mlp)
        } else {
            let x = blk
                .self_attn_layer_norm
                .forward(&kernels::residual(x, &self.attention(blk, (x, None), ctx, cache, layer)?)?)?;
            blk.final_layer_norm.forward(&kernels::residual(&x, &self.mlp(blk, &x)?)?)
        }
    }

    /// The final LayerNorm (pre-norm models), then `project_out`.
    fn final_norm(&self, x: &Tensor) -> TResult<Tensor> {
        let x = match &self.final_layer_norm {
            Some(norm) => norm.forward(x)?,
            None => x.clone(),
        };
        match &self.project_out {
            Some(p) => p.forward(&x),
            None => Ok(x),
        }
    }

    fn embedding(&self) -> &Tensor {
        &self.embed_tokens
    }

    fn num_layers(&self) -> usize {
        self.cfg.num_layers
    }
}
