//! `config.json`: dispatch on `model_type` to an architecture's raw config,
//! and on `architectures[0]` to a head.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{gpt2, gpt_neox, llama, qwen2, qwen3};
use crate::error::{read_json, Error, Result};

pub const SUPPORTED_MODEL_TYPES: &[&str] = &["gpt_neox", "llama", "qwen2", "qwen3", "gpt2"];

/// What sits on top of the decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadKind {
    /// `*ForCausalLM` / `GPT2LMHeadModel`: next-token logits.
    CausalLm,
    /// `*ForSequenceClassification`: a `score` projection read at the last
    /// real token (reward models use `num_labels = 1`).
    SequenceClassification { num_labels: usize },
}

#[derive(Debug, Clone)]
pub enum ArchConfig {
    GptNeox(gpt_neox::Config),
    /// Llama, Qwen2 and Qwen3.
    Llama(llama::Config),
    Gpt2(gpt2::Config),
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub model_type: String,
    pub head: HeadKind,
    pub arch: ArchConfig,
    /// `config.json` as read, written back when saving.
    pub raw: Value,
    pub path: PathBuf,
}

impl ModelConfig {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        if !path.is_file() {
            return Err(Error::bad_file(dir, "not a model directory: config.json is missing"));
        }
        Self::from_value(read_json(&path)?, &path)
    }

    pub fn from_value(raw: Value, path: &Path) -> Result<Self> {
        let bad = |msg: String| Error::bad_config(path, msg);
        let model_type =
            raw.get("model_type").and_then(Value::as_str).ok_or_else(|| bad("no `model_type` key".into()))?.to_string();
        let arch = match model_type.as_str() {
            "gpt_neox" => ArchConfig::GptNeox(raw_config::<gpt_neox::RawConfig>(&raw, path)?.resolve().map_err(bad)?),
            "llama" => ArchConfig::Llama(
                raw_config::<llama::RawConfig>(&raw, path)?
                    .resolve(llama::Variant { qkv_bias: false, qk_norm: false })
                    .map_err(bad)?,
            ),
            "qwen2" => ArchConfig::Llama(qwen2::resolve(&raw_config(&raw, path)?).map_err(bad)?),
            "qwen3" => ArchConfig::Llama(qwen3::resolve(&raw_config(&raw, path)?).map_err(bad)?),
            "gpt2" => ArchConfig::Gpt2(raw_config::<gpt2::RawConfig>(&raw, path)?.resolve().map_err(bad)?),
            other => {
                return Err(bad(format!(
                    "model_type `{other}` is not supported (supported: {})",
                    SUPPORTED_MODEL_TYPES.join(", ")
                )))
            }
        };
        let head = head_kind(&raw).map_err(bad)?;
        Ok(Self { model_type, head, arch, raw, path: path.to_path_buf() })
    }

    pub fn vocab_size(&self) -> usize {
        match &self.arch {
            ArchConfig::GptNeox(c) => c.vocab_size,
            ArchConfig::Llama(c) => c.vocab_size,
            ArchConfig::Gpt2(c) => c.vocab_size,
        }
    }

    pub fn hidden_size(&self) -> usize {
        match &self.arch {
            ArchConfig::GptNeox(c) => c.hidden_size,
            ArchConfig::Llama(c) => c.hidden_size,
            ArchConfig::Gpt2(c) => c.hidden_size,
        }
    }

    pub fn num_layers(&self) -> usize {
        match &self.arch {
            ArchConfig::GptNeox(c) => c.num_layers,
            ArchConfig::Llama(c) => c.num_layers,
            ArchConfig::Gpt2(c) => c.num_layers,
        }
    }

    pub fn tie_word_embeddings(&self) -> bool {
        match &self.arch {
            ArchConfig::GptNeox(c) => c.tie_word_embeddings,
            ArchConfig::Llama(c) => c.tie_word_embeddings,
            ArchConfig::Gpt2(c) => c.tie_word_embeddings,
        }
    }

    /// Longest sequence the position embeddings allow (`None`: rotary, unbounded).
    pub fn max_positions(&self) -> Option<usize> {
        match &self.arch {
            ArchConfig::Gpt2(c) => Some(c.max_positions),
            _ => None,
        }
    }

    /// The positions the model was trained for: GPT-2's learned positions,
    /// or `max_position_embeddings` of a rotary model, which runs past it
    /// without error but not as trained.
    pub fn context_length(&self) -> Option<usize> {
        self.max_positions()
            .or_else(|| self.raw.get("max_position_embeddings").and_then(Value::as_u64).map(|n| n as usize))
    }

    /// The module holding the decoder in HF checkpoints.
    pub fn base_prefix(&self) -> &'static str {
        match &self.arch {
            ArchConfig::GptNeox(_) => "gpt_neox",
            ArchConfig::Llama(_) => "model",
            ArchConfig::Gpt2(_) => "transformer",
        }
    }

    /// The token-embedding tensor under the base prefix.
    pub fn embedding_name(&self) -> &'static str {
        match &self.arch {
            ArchConfig::GptNeox(_) => "embed_in.weight",
            ArchConfig::Llama(_) => "embed_tokens.weight",
            ArchConfig::Gpt2(_) => "wte.weight",
        }
    }

    /// The untied LM-head weight at the root.
    pub fn lm_head_name(&self) -> &'static str {
        match &self.arch {
            ArchConfig::GptNeox(_) => "embed_out.weight",
            _ => "lm_head.weight",
        }
    }

    /// The transformers class for `architectures` when saving.
    pub fn class_name(&self) -> String {
        let stem = match self.model_type.as_str() {
            "gpt_neox" => "GPTNeoX",
            "llama" => "Llama",
            "qwen2" => "Qwen2",
            "qwen3" => "Qwen3",
            "gpt2" => "GPT2",
            other => other,
        };
        match (self.head, stem) {
            (HeadKind::CausalLm, "GPT2") => "GPT2LMHeadModel".into(),
            (HeadKind::CausalLm, _) => format!("{stem}ForCausalLM"),
            (HeadKind::SequenceClassification { .. }, _) => {
                format!("{stem}ForSequenceClassification")
            }
        }
    }

    /// `config.json` for saving: the original keys with `architectures` set
    /// to this head's class.
    pub fn to_json(&self) -> Value {
        let mut raw = self.raw.clone();
        if let Value::Object(map) = &mut raw {
            map.insert("architectures".into(), Value::Array(vec![Value::String(self.class_name())]));
            if let HeadKind::SequenceClassification { num_labels } = self.head {
                // transformers reads the label count from id2label: keep the two in step.
                let labels =
                    |f: &dyn Fn(usize) -> (String, Value)| -> Value { Value::Object((0..num_labels).map(f).collect()) };
                map.insert("id2label".into(), labels(&|i| (i.to_string(), format!("LABEL_{i}").into())));
                map.insert("label2id".into(), labels(&|i| (format!("LABEL_{i}"), i.into())));
                map.insert("num_labels".into(), num_labels.into());
            }
        }
        raw
    }
}

fn raw_config<T: serde::de::DeserializeOwned>(raw: &Value, path: &Path) -> Result<T> {
    serde_json::from_value(raw.clone()).map_err(|e| Error::bad_config(path, e.to_string()))
}

/// The head named by `architectures[0]` (a causal LM when absent);
/// transformers' `num_labels` comes from `id2label` when present (its
/// default has two labels). Other heads (token classification, question
/// answering, ...) are errors rather than read as a causal LM.
fn head_kind(raw: &Value) -> std::result::Result<HeadKind, String> {
    let class = raw.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str).unwrap_or("");
    if class.ends_with("ForSequenceClassification") {
        let num_labels = raw
            .get("id2label")
            .and_then(Value::as_object)
            .map(|m| m.len())
            .or_else(|| raw.get("num_labels").and_then(Value::as_u64).map(|n| n as usize))
            .unwrap_or(2);
        Ok(HeadKind::SequenceClassification { num_labels })
    } else if class.is_empty() || class.ends_with("ForCausalLM") || class.ends_with("LMHeadModel") {
        Ok(HeadKind::CausalLm)
    } else {
        Err(format!(
            "architectures[0] = `{class}` is not supported: rloo loads causal LMs (`*ForCausalLM`, \
             `GPT2LMHeadModel`) and reward models (`*ForSequenceClassification`)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn load(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_value(v, Path::new("config.json"))
    }

    #[test]
    fn unknown_model_types_list_the_supported_ones() {
        let err = load(json!({"model_type": "mamba"})).unwrap_err().to_string();
        assert!(err.contains("config.json") && err.contains("`mamba`") && err.contains("gpt_neox, llama"), "{err}");
    }

    #[test]
    fn indivisible_kv_heads_are_rejected_with_both_numbers() {
        let err = load(json!({"model_type": "llama", "vocab_size": 10, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 3}))
        .unwrap_err()
        .to_string();
        assert!(err.contains("num_key_value_heads=3") && err.contains("num_attention_heads=8"), "{err}");
    }

    #[test]
    fn heads_follow_architectures() {
        let cfg = load(json!({"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"],
            "id2label": {"0": "LABEL_0"}}))
        .unwrap();
        assert_eq!(cfg.head, HeadKind::SequenceClassification { num_labels: 1 });
        assert_eq!(cfg.class_name(), "GPT2ForSequenceClassification");
        let cfg = load(json!({"model_type": "gpt2"})).unwrap();
        assert_eq!(cfg.head, HeadKind::CausalLm);
        assert_eq!(cfg.class_name(), "GPT2LMHeadModel");
        let err = load(json!({"model_type": "gpt_neox", "architectures": ["GPTNeoXForTokenClassification"],
            "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 16}))
        .unwrap_err()
        .to_string();
        assert!(err.contains("`GPTNeoXForTokenClassification` is not supported"), "{err}");
    }
}
