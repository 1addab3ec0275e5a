//! Qwen3: the Llama decoder with an RMSNorm on every query and key head
//! before rotary, an explicit `head_dim`, and biases only when
//! `attention_bias` is set (transformers `models/qwen3/modeling_qwen3.py`).

use std::sync::Arc;

use serde_json::Value;

use super::arch::{raw_config, ArchConfig, Architecture};
use super::llama::{Llama, RawConfig, Variant};

#[derive(Debug)]
pub struct Qwen3;

impl Architecture for Qwen3 {
    fn model_type(&self) -> &'static str {
        "qwen3"
    }
    fn resolve(&self, raw: &Value) -> Result<Arc<dyn ArchConfig>, String> {
        Ok(Arc::new(raw_config::<RawConfig>(raw)?.resolve(Variant { qkv_bias: false, qk_norm: true })?))
    }
    fn class_stem(&self) -> &'static str {
        "Qwen3"
    }
    fn base_prefix(&self) -> &'static str {
        Llama.base_prefix()
    }
    fn embedding_name(&self) -> &'static str {
        Llama.embedding_name()
    }
    fn lora_targets(&self) -> &'static [&'static str] {
        Llama.lora_targets()
    }
}
