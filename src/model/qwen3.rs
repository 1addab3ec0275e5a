//! Qwen3: the Llama decoder with an RMSNorm on every query and key head
//! before rotary, an explicit `head_dim`, and biases only when
//! `attention_bias` is set (transformers `models/qwen3/modeling_qwen3.py`).

use super::llama::{Member, Variant};

pub const QWEN3: Member =
    Member { model_type: "qwen3", class_stem: "Qwen3", variant: Variant { qkv_bias: false, qk_norm: true } };
