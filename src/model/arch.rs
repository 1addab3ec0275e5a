//! The architectures rloo loads, each behind [`Architecture`]: adding one is
//! a file implementing it and a line in [`REGISTRY`]. Nothing outside the
//! architecture's file names its tensors or reads its config keys.

use std::fmt::Debug;
use std::sync::Arc;

use serde_json::Value;

use super::network::Decoder;
use super::weights::Weights;
use super::{gpt2, gpt_neox, llama, opt, qwen2, qwen3};
use crate::error::Result;

/// Every supported `model_type`, in the order errors list them.
pub static REGISTRY: &[&dyn Architecture] =
    &[&gpt_neox::GptNeox, &llama::LLAMA, &qwen2::QWEN2, &qwen3::QWEN3, &gpt2::Gpt2, &opt::Opt];

/// The architecture whose `model_type` this is.
pub fn find(model_type: &str) -> Option<&'static dyn Architecture> {
    REGISTRY.iter().copied().find(|a| a.model_type() == model_type)
}

/// The supported `model_type`s, comma-separated.
pub fn supported() -> String {
    REGISTRY.iter().map(|a| a.model_type()).collect::<Vec<_>>().join(", ")
}

/// One architecture as transformers lays it out: how its `config.json`
/// resolves, where its tensors sit, and what its classes are called.
pub trait Architecture: Sync + Debug {
    /// `model_type` in `config.json`.
    fn model_type(&self) -> &'static str;
    /// Reads and validates `config.json` (an error says which key is wrong).
    fn resolve(&self, raw: &Value) -> std::result::Result<Arc<dyn ArchConfig>, String>;
    /// transformers' class-name stem: `{stem}ForCausalLM`, `{stem}ForSequenceClassification`.
    fn class_stem(&self) -> &'static str;
    /// The causal-LM class written into `architectures` when saving.
    fn causal_lm_class(&self) -> String {
        format!("{}ForCausalLM", self.class_stem())
    }
    /// The module holding the decoder in `*ForCausalLM` checkpoints
    /// (base-model checkpoints store it at the root instead).
    fn base_prefix(&self) -> &'static str;
    /// The token-embedding tensor under [`Architecture::base_prefix`].
    fn embedding_name(&self) -> &'static str;
    /// The untied LM-head weight at the root.
    fn lm_head_name(&self) -> &'static str {
        "lm_head.weight"
    }
    /// PEFT's default LoRA target modules
    /// (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
    fn lora_targets(&self) -> &'static [&'static str];
    /// Whether dense weights are stored (in, out), as GPT-2's `Conv1D`
    /// (PEFT's `fan_in_fan_out`).
    fn conv1d_weights(&self) -> bool {
        false
    }
}

/// A resolved config: the sizes the rest of rloo reads, and the decoder it builds.
pub trait ArchConfig: Send + Sync + Debug {
    fn dims(&self) -> Dims;
    /// Builds the decoder from the tensors under the base prefix.
    fn load_decoder(&self, base: &Weights) -> Result<Arc<dyn Decoder>>;
    /// Per layer and token, what a training forward keeps for its backward,
    /// in tensors of the hidden size (the memory plan's activations;
    /// `tests/heap.rs` measures each architecture's).
    fn kept_per_layer(&self, keeping: Keeping) -> f64;
}

/// What decides how much a training forward keeps, beside the shapes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Keeping {
    /// The dense layers have LoRA adapters (counted as if all had: an
    /// adapted layer is not one op with the norm before it or the
    /// activation after it, so more is kept).
    pub lora: bool,
    /// `RLOO_MLP_INPUT=remade`: the backward makes an MLP's wide input again.
    pub mlp_input_remade: bool,
    /// The attention kernels read each query's runs of keys (16 bytes a
    /// token) in place of the packed rows' f32 bias (a row's length a token).
    pub mask_spans: bool,
}

impl Keeping {
    /// The outputs of a layer's `norms` that its adapters keep (each feeds
    /// an adapted layer): all of them with adapters, else none.
    pub fn norm_outputs(&self, norms: usize) -> f64 {
        if self.lora {
            norms as f64
        } else {
            0.0
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    pub vocab_size: usize,
    /// The width of the residual stream.
    pub hidden_size: usize,
    /// The width the heads read: the hidden size, or OPT's `word_embed_proj_dim`.
    pub head_width: usize,
    pub num_layers: usize,
    /// Features of an attention head.
    pub head_dim: usize,
    /// Features a token's keys (and its values) take a layer: key/value
    /// heads x head size, the hidden size without grouped-query attention.
    pub kv_width: usize,
    pub tie_word_embeddings: bool,
    /// Longest sequence learned positions allow (`None`: rotary, unbounded).
    pub max_positions: Option<usize>,
}

/// Parses `config.json` into an architecture's raw config, its error as text.
pub fn raw_config<T: serde::de::DeserializeOwned>(raw: &Value) -> std::result::Result<T, String> {
    serde_json::from_value(raw.clone()).map_err(|e| e.to_string())
}
