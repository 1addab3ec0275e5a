//! Qwen2 / Qwen2.5: the Llama decoder with biases on the query, key and
//! value projections (transformers `models/qwen2/modeling_qwen2.py`).
//! `config.json` has Llama's keys; sliding-window attention is not supported.

use super::llama::{Member, Variant};

pub const QWEN2: Member =
    Member { model_type: "qwen2", class_stem: "Qwen2", variant: Variant { qkv_bias: true, qk_norm: false } };
