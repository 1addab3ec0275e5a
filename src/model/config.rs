//! `config.json`: dispatch on `model_type` to an architecture of the
//! registry, and on `architectures[0]` to a head.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::arch::{self, ArchConfig, Architecture, Dims};
use crate::error::{read_json, Error, Result};

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
pub struct ModelConfig {
    pub head: HeadKind,
    pub arch: &'static dyn Architecture,
    /// The architecture's resolved config, which builds its decoder.
    pub resolved: Arc<dyn ArchConfig>,
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
            raw.get("model_type").and_then(Value::as_str).ok_or_else(|| bad("no `model_type` key".into()))?;
        let arch = arch::find(model_type).ok_or_else(|| {
            bad(format!("model_type `{model_type}` is not supported (supported: {})", arch::supported()))
        })?;
        let resolved = arch.resolve(&raw).map_err(bad)?;
        let head = head_kind(&raw).map_err(bad)?;
        Ok(Self { head, arch, resolved, raw, path: path.to_path_buf() })
    }

    fn dims(&self) -> Dims {
        self.resolved.dims()
    }

    pub fn vocab_size(&self) -> usize {
        self.dims().vocab_size
    }

    pub fn hidden_size(&self) -> usize {
        self.dims().hidden_size
    }

    /// The width the LM and score heads read.
    pub fn head_width(&self) -> usize {
        self.dims().head_width
    }

    pub fn num_layers(&self) -> usize {
        self.dims().num_layers
    }

    pub fn head_dim(&self) -> usize {
        self.dims().head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.dims().kv_width
    }

    /// Per layer and token, what a training forward keeps, in tensors of
    /// the hidden size ([`ArchConfig::kept_per_layer`]).
    pub fn kept_per_layer(&self, keeping: arch::Keeping) -> f64 {
        self.resolved.kept_per_layer(keeping)
    }

    pub fn tie_word_embeddings(&self) -> bool {
        self.dims().tie_word_embeddings
    }

    /// Longest sequence the position embeddings allow (`None`: rotary, unbounded).
    pub fn max_positions(&self) -> Option<usize> {
        self.dims().max_positions
    }

    /// The positions the model was trained for: learned positions, or
    /// `max_position_embeddings` of a rotary model, which runs past it
    /// without error but not as trained.
    pub fn context_length(&self) -> Option<usize> {
        self.max_positions()
            .or_else(|| self.raw.get("max_position_embeddings").and_then(Value::as_u64).map(|n| n as usize))
    }

    /// The transformers class for `architectures` when saving.
    pub fn class_name(&self) -> String {
        match self.head {
            HeadKind::CausalLm => self.arch.causal_lm_class(),
            HeadKind::SequenceClassification { .. } => format!("{}ForSequenceClassification", self.arch.class_stem()),
        }
    }

    /// The `config.json` keys whose values differ from `other`'s, as
    /// `key: ours vs theirs`; keys that say where the file came from rather
    /// than what the model computes are left out.
    pub fn differences(&self, other: &ModelConfig) -> Vec<String> {
        const PROVENANCE: [&str; 4] = ["_name_or_path", "transformers_version", "torch_dtype", "dtype"];
        let (ours, theirs) = (self.to_json(), other.to_json());
        let empty = serde_json::Map::new();
        let (a, b) = (ours.as_object().unwrap_or(&empty), theirs.as_object().unwrap_or(&empty));
        let show = |v: Option<&Value>| v.map_or("absent".to_string(), Value::to_string);
        let mut keys: Vec<&String> = a.keys().collect();
        keys.extend(b.keys().filter(|k| !a.contains_key(*k)));
        keys.into_iter()
            .filter(|k| !PROVENANCE.contains(&k.as_str()) && a.get(*k) != b.get(*k))
            .map(|k| format!("{k}: {} vs {}", show(a.get(k)), show(b.get(k))))
            .collect()
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
        assert!(
            err.contains("config.json")
                && err.contains("`mamba`")
                && err.contains("gpt_neox, llama, qwen2, qwen3, gpt2, opt"),
            "{err}"
        );
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
