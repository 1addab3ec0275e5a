//! `generation_config.json`: the sampling defaults and stop tokens a model
//! ships with (transformers' `GenerationConfig`).
//!
//! Only the fields rloo uses are typed; the whole object is kept so that
//! saving writes back every key, known or not, in its original order.

use std::path::Path;

use serde_json::{Map, Value};

use crate::data::prompt::describe_json;
use crate::error::{read_json, Error, Result};
use crate::io::write_atomic;

/// The file name transformers uses.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// The typed view of `generation_config.json`. Every field is optional: an
/// absent key (or `null`) is `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// Stop tokens. The file holds an int or a list of ints (Llama 3 lists
    /// `<|end_of_text|>`, `<|eom_id|>` and `<|eot_id|>`).
    pub eos_token_id: Option<Vec<u32>>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_k: Option<u32>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub max_new_tokens: Option<u32>,
    pub repetition_penalty: Option<f64>,
    /// The object as read, for [`save`](Self::save).
    raw: Map<String, Value>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; `Ok(None)` when the file is absent.
    /// Unknown keys are kept but not interpreted.
    pub fn from_dir(dir: &Path) -> Result<Option<GenerationConfig>> {
        let path = dir.join(GENERATION_CONFIG_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        match read_json::<Value>(&path)? {
            Value::Object(raw) => Self::from_map(raw, &path).map(Some),
            other => Err(Error::bad_file(&path, format!("expected a JSON object, got {}", describe_json(&other)))),
        }
    }

    /// Interprets an already-parsed object; `path` names it in errors.
    pub fn from_map(raw: Map<String, Value>, path: &Path) -> Result<GenerationConfig> {
        let f = Fields { raw: &raw, path };
        Ok(GenerationConfig {
            eos_token_id: f.eos("eos_token_id")?,
            bos_token_id: f.int("bos_token_id")?,
            pad_token_id: f.int("pad_token_id")?,
            do_sample: f.bool("do_sample")?,
            temperature: f.float("temperature")?,
            top_k: f.int("top_k")?,
            top_p: f.float("top_p")?,
            min_p: f.float("min_p")?,
            max_new_tokens: f.int("max_new_tokens")?,
            repetition_penalty: f.float("repetition_penalty")?,
            raw,
        })
    }

    /// The stop token ids (empty when none are set).
    pub fn eos_token_ids(&self) -> &[u32] {
        self.eos_token_id.as_deref().unwrap_or(&[])
    }

    /// The JSON object to save: the keys as read, with the typed fields
    /// written over them (a field set to `None` removes its key). A single
    /// stop token is written as an int unless the file held a list.
    pub fn to_json(&self) -> Map<String, Value> {
        let mut out = self.raw.clone();
        let mut set = |key: &str, value: Option<Value>| match value {
            Some(v) => {
                out.insert(key.to_string(), v);
            }
            None => {
                out.remove(key);
            }
        };
        let eos = self.eos_token_id.as_ref().map(|ids| {
            let was_list = matches!(self.raw.get("eos_token_id"), Some(Value::Array(_)));
            match ids.as_slice() {
                [one] if !was_list => Value::from(*one),
                _ => Value::from(ids.clone()),
            }
        });
        set("eos_token_id", eos);
        set("bos_token_id", self.bos_token_id.map(Value::from));
        set("pad_token_id", self.pad_token_id.map(Value::from));
        set("do_sample", self.do_sample.map(Value::from));
        set("temperature", self.temperature.map(Value::from));
        set("top_k", self.top_k.map(Value::from));
        set("top_p", self.top_p.map(Value::from));
        set("min_p", self.min_p.map(Value::from));
        set("max_new_tokens", self.max_new_tokens.map(Value::from));
        set("repetition_penalty", self.repetition_penalty.map(Value::from));
        out
    }

    /// Writes `dir/generation_config.json` atomically, indented as
    /// transformers writes it.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let mut text = serde_json::to_string_pretty(&Value::Object(self.to_json())).expect("a JSON map serialises");
        text.push('\n');
        write_atomic(&dir.join(GENERATION_CONFIG_FILE), text.as_bytes())
    }
}

/// Typed reads of the fields of one object, with errors naming file and key.
struct Fields<'a> {
    raw: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.raw.get(key).filter(|v| !v.is_null())
    }

    fn err(&self, key: &str, expected: &str, got: &Value) -> Error {
        Error::bad_file(self.path, format!("{key}: expected {expected}, got {}", describe_json(got)))
    }

    fn int<T: TryFrom<u64>>(&self, key: &str) -> Result<Option<T>> {
        self.get(key)
            .map(|v| {
                v.as_u64().and_then(|n| T::try_from(n).ok()).ok_or_else(|| self.err(key, "a non-negative integer", v))
            })
            .transpose()
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        self.get(key).map(|v| v.as_f64().ok_or_else(|| self.err(key, "a number", v))).transpose()
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key).map(|v| v.as_bool().ok_or_else(|| self.err(key, "true or false", v))).transpose()
    }

    fn eos(&self, key: &str) -> Result<Option<Vec<u32>>> {
        const EXPECTED: &str = "a token id or a list of token ids";
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let id = |x: &Value| x.as_u64().and_then(|n| u32::try_from(n).ok());
        match v {
            Value::Array(items) => items
                .iter()
                .map(|x| id(x).ok_or_else(|| self.err(key, EXPECTED, v)))
                .collect::<Result<Vec<_>>>()
                .map(Some),
            _ => id(v).map(|n| Some(vec![n])).ok_or_else(|| self.err(key, EXPECTED, v)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn write(dir: &Path, value: Value) {
        std::fs::write(dir.join(GENERATION_CONFIG_FILE), value.to_string()).unwrap();
    }

    #[test]
    fn absent_file_is_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(GenerationConfig::from_dir(dir.path()).unwrap(), None);
    }

    #[test]
    fn single_eos_id_becomes_a_one_element_list() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            json!({"bos_token_id": 151643, "eos_token_id": 151645, "do_sample": true,
                   "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05,
                   "transformers_version": "4.45.0"}),
        );
        let g = GenerationConfig::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(g.eos_token_ids(), [151645]);
        assert_eq!(g.bos_token_id, Some(151643));
        assert_eq!(g.do_sample, Some(true));
        assert_eq!(g.temperature, Some(0.7));
        assert_eq!(g.top_k, Some(20));
        assert_eq!(g.top_p, Some(0.8));
        assert_eq!(g.min_p, None);
        assert_eq!(g.repetition_penalty, Some(1.05));
        assert_eq!(g.pad_token_id, None);
    }

    #[test]
    fn list_of_eos_ids_is_kept_in_order() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            json!({"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                   "temperature": 1, "pad_token_id": null}),
        );
        let g = GenerationConfig::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(g.eos_token_ids(), [128001, 128008, 128009]);
        assert_eq!(g.temperature, Some(1.0), "an int temperature is a number");
        assert_eq!(g.pad_token_id, None, "null is unset");
    }

    #[test]
    fn wrong_types_name_file_key_and_value() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), json!({"eos_token_id": [1, "two"]}));
        let err = GenerationConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: eos_token_id: expected a token id or a list of token ids, got a list of 2 items",
                dir.path().join(GENERATION_CONFIG_FILE).display()
            )
        );
        write(dir.path(), json!({"top_k": -1}));
        let err = GenerationConfig::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.ends_with("top_k: expected a non-negative integer, got a number (-1)"), "{err}");
    }

    #[test]
    fn save_keeps_unknown_keys_and_the_eos_form() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            json!({"_from_model_config": true, "eos_token_id": 2, "max_new_tokens": 64,
                   "transformers_version": "4.51.0"}),
        );
        let mut g = GenerationConfig::from_dir(dir.path()).unwrap().unwrap();
        g.temperature = Some(0.5);
        g.max_new_tokens = None;
        let out = tempfile::tempdir().unwrap();
        g.save(out.path()).unwrap();
        let text = std::fs::read_to_string(out.path().join(GENERATION_CONFIG_FILE)).unwrap();
        let saved: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            saved,
            json!({"_from_model_config": true, "eos_token_id": 2,
                   "transformers_version": "4.51.0", "temperature": 0.5})
        );
        assert!(text.ends_with("}\n"));
        let again = GenerationConfig::from_dir(out.path()).unwrap().unwrap();
        assert_eq!(again.eos_token_ids(), [2]);
        assert_eq!(again.temperature, Some(0.5));
    }
}
