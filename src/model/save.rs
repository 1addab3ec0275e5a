//! Saving a model as a Hugging Face directory that `transformers`, vLLM and
//! rloo load: `config.json`, `model.safetensors` (with the `{"format": "pt"}`
//! metadata transformers expects), the tokenizer files and the generation
//! config of the directory it came from.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;

use super::config::HeadKind;
use super::generation_config::GENERATION_CONFIG_FILE;
use super::lora::{adapter_config_json, adapter_names, is_adapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX};
use super::network::Model;
use super::weights::SINGLE_FILE;
use crate::data::copy_tokenizer_files;
use crate::error::{Error, Result};
use crate::io::{write_atomic, write_atomic_with, write_dir_atomic};

impl Model {
    /// Writes the model to `dir` atomically: a crash leaves either the old
    /// directory or the complete new one. Each tensor is saved in the dtype
    /// it was loaded in (tied LM heads are not written, as in transformers).
    pub fn save(&self, dir: &Path) -> Result<()> {
        write_dir_atomic(dir, |tmp| self.save_files(tmp))
    }

    /// Writes the model's files into an existing directory (for callers that
    /// add files of their own before an atomic rename, like checkpoints).
    /// A model with LoRA adapters is written as a PEFT adapter directory:
    /// `adapter_config.json` naming the base, and `adapter_model.safetensors`
    /// with what trains (adapters and `modules_to_save`) under PEFT's names.
    pub fn save_files(&self, dir: &Path) -> Result<()> {
        let (config_file, config, weights_file, tensors) = match self.lora() {
            None => {
                let tensors = self.params().iter().map(|p| (p.name.clone(), p));
                ("config.json", self.config().to_json(), SINGLE_FILE, tensors.collect::<Vec<_>>())
            }
            Some((lora, base)) => {
                let task = match self.head() {
                    HeadKind::CausalLm => "CAUSAL_LM",
                    HeadKind::SequenceClassification { .. } => "SEQ_CLS",
                };
                let config = adapter_config_json(lora, &base.display().to_string(), task, self.conv1d_weights());
                let tensors = self.params().trainable().map(|p| (format!("{PEFT_PREFIX}{}", p.name), p));
                (ADAPTER_CONFIG, config, ADAPTER_WEIGHTS, tensors.collect())
            }
        };
        let mut stored = Vec::with_capacity(tensors.len());
        for (name, p) in tensors {
            stored.push((name, p.master_in(p.stored_dtype)?.contiguous()?));
        }
        self.write_files(dir, (config_file, &config), weights_file, &stored, self.dir())
    }

    /// Writes a model with LoRA adapters as the full model they make: each
    /// adapted weight becomes `W + scale * B A` (PEFT's `merge_and_unload`),
    /// `modules_to_save` replace the base's, and the adapters are gone.
    pub fn save_merged(&self, dir: &Path) -> Result<()> {
        let Some((lora, base)) = self.lora() else {
            return Err(Error::Invalid(format!("{} has no LoRA adapters to merge", self.dir().display())));
        };
        // Conv1D weights are stored (in, out): their update is (B A)^T.
        let transposed = self.conv1d_weights();
        let mut stored = Vec::new();
        for p in self.params().iter().filter(|p| !is_adapter(&p.name)) {
            // In f32 whatever the model computes in (a frozen base may be bf16).
            let mut w = p.master()?.to_dtype(candle_core::DType::F32)?;
            if let Some(module) = p.name.strip_suffix(".weight") {
                let (a, b) = adapter_names(module);
                if let (Some(a), Some(b)) = (self.params().get(&a), self.params().get(&b)) {
                    let update = (b.master()?.matmul(&a.master()?)? * lora.scale())?;
                    w = (w + if transposed { update.t()? } else { update })?;
                }
            }
            stored.push((p.name.clone(), w.to_dtype(p.stored_dtype)?.contiguous()?));
        }
        // The tokenizer: the adapter's (trainers save it beside the adapter), else the base's.
        let files_from = if self.dir().join("tokenizer.json").is_file() { self.dir() } else { base };
        let config = self.config().to_json();
        write_dir_atomic(dir, |tmp| self.write_files(tmp, ("config.json", &config), SINGLE_FILE, &stored, files_from))
    }

    /// Whether the dense weights are GPT-2's `Conv1D`, stored (in, out)
    /// (PEFT's `fan_in_fan_out`).
    fn conv1d_weights(&self) -> bool {
        self.config().arch.conv1d_weights()
    }

    /// Writes a config and weights file, and carries over the tokenizer files
    /// and generation config of `source`.
    fn write_files(
        &self,
        dir: &Path,
        (config_file, config): (&str, &serde_json::Value),
        weights_file: &str,
        stored: &[(String, Tensor)],
        source: &Path,
    ) -> Result<()> {
        let config = serde_json::to_string_pretty(config)
            .map_err(|e| Error::Invalid(format!("cannot serialise {config_file}: {e}")))?;
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        write_atomic(&dir.join(config_file), config.as_bytes())?;
        write_tensors(&dir.join(weights_file), stored, Some(metadata))?;
        // Saving into the directory the files come from: they are already there
        // (and copying a file onto itself would empty it).
        let same = |a: &Path, b: &Path| a.canonicalize().ok().is_some_and(|a| Some(a) == b.canonicalize().ok());
        if same(source, dir) {
            return Ok(());
        }
        copy_tokenizer_files(source, dir)?;
        let generation = source.join(GENERATION_CONFIG_FILE);
        if generation.is_file() {
            std::fs::copy(&generation, dir.join(GENERATION_CONFIG_FILE)).map_err(|e| Error::io(&generation, e))?;
        }
        Ok(())
    }
}

/// Writes a safetensors file atomically, one tensor at a time: a model's
/// worth of bytes is never held in memory beside the model.
pub fn write_tensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    write_atomic_with(path, |tmp| {
        safetensors::tensor::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), metadata, tmp)
            .map_err(std::io::Error::other)
    })
}
