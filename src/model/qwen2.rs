//! Qwen2 / Qwen2.5: the Llama decoder with biases on the query, key and
//! value projections (transformers `models/qwen2/modeling_qwen2.py`).
//! `config.json` has Llama's keys; sliding-window attention is not supported.

use std::sync::Arc;

use serde_json::Value;

use super::arch::{raw_config, ArchConfig, Architecture};
use super::llama::{Llama, RawConfig, Variant};

#[derive(Debug)]
pub struct Qwen2;

impl Architecture for Qwen2 {
    fn model_type(&self) -> &'static str {
        "qwen2"
    }
    fn resolve(&self, raw: &Value) -> Result<Arc<dyn ArchConfig>, String> {
        Ok(Arc::new(raw_config::<RawConfig>(raw)?.resolve(Variant { qkv_bias: true, qk_norm: false })?))
    }
    fn class_stem(&self) -> &'static str {
        "Qwen2"
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
