//! Checkpoints: `<output_dir>/checkpoint-<step>/` holds a Hugging Face model
//! directory plus what a resume needs (optimizer moments, the f32 master
//! copy of weights stored in a narrower dtype, the step, the resolved
//! config). Each is written under a temporary name and renamed into place,
//! so a crash never leaves a half-written checkpoint that a resume would
//! pick up. Everything else a run draws at random derives from (seed, step).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::optim::AdamW;
use crate::error::{read_json, Error, Result};
use crate::io::{write_atomic, write_dir_atomic};
use crate::model::save::write_tensors;
use crate::model::{Model, ModelConfig};

pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// Progress through the run, saved with each checkpoint.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    /// Rollout steps completed.
    pub step: usize,
    /// Completions trained on.
    pub episode: usize,
    pub optimizer_step: usize,
    pub total_steps: usize,
    /// Digest of the run's tokenized training data (`crate::data::token_digest`).
    #[serde(default)]
    pub prompts_digest: String,
    /// Optimizer steps skipped for a non-finite loss or gradient so far.
    #[serde(default)]
    pub skipped_steps: usize,
    /// The processes of the data-parallel job that saved it (0 or 1: one).
    #[serde(default, skip_serializing_if = "one_process")]
    pub world_size: usize,
}

fn one_process(world_size: &usize) -> bool {
    *world_size <= 1
}

pub fn checkpoint_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(format!("checkpoint-{step}"))
}

/// A trained model and its optimizer, saved in a checkpoint's directory
/// (`subdir` ""; the policy) or a sub-directory of it (`critic`).
pub struct Part<'a> {
    pub subdir: &'static str,
    pub model: &'a Model,
    pub optimizer: &'a AdamW,
}

/// The run's resolved configuration as a checkpoint keeps it: its file
/// name and its TOML.
pub struct SavedConfig<'a> {
    pub file: &'static str,
    pub toml: &'a str,
}

/// Saves every part and the state, all or nothing.
pub fn save(dir: &Path, parts: &[Part], state: &TrainerState, config: &SavedConfig) -> Result<()> {
    let state_json = serde_json::to_vec_pretty(state).map_err(|e| Error::Invalid(e.to_string()))?;
    write_dir_atomic(dir, |tmp| {
        for part in parts {
            let mut tensors: Vec<(String, Tensor)> = part.optimizer.state_tensors();
            for p in part.model.params().trainable() {
                if p.stored_dtype != DType::F32 {
                    tensors.push((format!("master.{}", p.name), p.master()?));
                }
            }
            let at = tmp.join(part.subdir);
            part.model.save_files(&at)?;
            write_tensors(&at.join(OPTIMIZER_FILE), &tensors, None)?;
        }
        write_atomic(&tmp.join(config.file), config.toml.as_bytes())?;
        // Written last: a directory with this file is complete.
        write_atomic(&tmp.join(STATE_FILE), &state_json)
    })
}

/// The checkpoint `--resume_from_checkpoint` names: a directory, or
/// "latest", the newest complete one in `output_dir` (none: start fresh).
pub fn to_resume(spec: &str, output_dir: &Path) -> Option<PathBuf> {
    if spec != "latest" {
        return Some(PathBuf::from(spec));
    }
    let found = latest(output_dir);
    if found.is_none() {
        tracing::info!("no checkpoint in {} to resume from; starting fresh", output_dir.display());
    }
    found
}

/// Refuses a checkpoint saved under a configuration that computes a
/// different run: `now` against the `config_file` saved in `dir`, which
/// may differ only in the `changeable` keys (logged).
pub fn check_config<T: Serialize + serde::de::DeserializeOwned>(
    dir: &Path,
    config_file: &str,
    now: &T,
    changeable: &[&str],
) -> Result<()> {
    let saved_path = dir.join(config_file);
    if !saved_path.is_file() {
        return Err(Error::bad_file(dir, format!("not a complete checkpoint: {config_file} is missing")));
    }
    let saved: T = crate::train::config::load_toml(Some(&saved_path), &[], |_, _| Ok(()))?;
    match crate::train::config::changes_since(&saved, now, changeable) {
        Ok(allowed) if allowed.is_empty() => Ok(()),
        Ok(allowed) => {
            tracing::info!("resuming with changed options: {}", allowed.join("; "));
            Ok(())
        }
        Err(refused) => Err(Error::Invalid(format!(
            "cannot resume from {}: these options differ from the checkpoint's and would change the run:\n  {}\n\
             resume with the options of {} or start a new run in another output directory",
            dir.display(),
            refused.join("\n  "),
            saved_path.display()
        ))),
    }
}

/// The newest complete checkpoint in `output_dir`, if any.
pub fn latest(output_dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(output_dir).ok()?;
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let step = e.file_name().to_str()?.strip_prefix("checkpoint-")?.parse::<usize>().ok()?;
            e.path().join(STATE_FILE).is_file().then(|| (step, e.path()))
        })
        .max_by_key(|(step, _)| *step)
        .map(|(_, path)| path)
}

/// A complete checkpoint's state.
pub fn load_state(dir: &Path) -> Result<TrainerState> {
    let state_path = dir.join(STATE_FILE);
    if !state_path.is_file() {
        return Err(Error::bad_file(dir, format!("not a complete checkpoint: {STATE_FILE} is missing")));
    }
    read_json(&state_path)
}

/// Loads the model saved as `subdir` of a checkpoint and restores its
/// optimizer, which has made `optimizer_step` steps, to compute in `dtype`.
pub fn load_part(
    dir: &Path,
    subdir: &str,
    expected: &ModelConfig,
    device: &Device,
    optimizer: &mut AdamW,
    optimizer_step: usize,
    dtype: DType,
) -> Result<Model> {
    let at = dir.join(subdir);
    check_saved_config(&at, expected)?;
    let model = Model::load(&at, device)?;
    same_model(model.config(), expected)?;
    let tensors = read_optimizer_file(&at, device)?;
    for p in model.params().iter() {
        if let Some(master) = tensors.get(&format!("master.{}", p.name)) {
            p.var.set(master)?;
        }
    }
    optimizer.load_state(tensors, optimizer_step, model.params())?;
    model.with_dtype(dtype, true)
}

/// Restores the part saved as `subdir` of a checkpoint into `model`, the
/// run's model as it was built at the start: the weights that train (by
/// name, from the f32 masters where kept) and the optimizer's state.
/// Unlike [`load_part`], the model keeps everything else the run built
/// (its parameters' order, adapters' dropout, layer graphs, compute
/// dtype). `load` reads the checkpoint's model as the run read its own.
pub fn restore_into(
    dir: &Path,
    subdir: &str,
    model: &Model,
    optimizer: &mut AdamW,
    optimizer_step: usize,
    load: impl FnOnce(&Path) -> Result<Model>,
) -> Result<()> {
    let at = dir.join(subdir);
    check_saved_config(&at, model.config())?;
    let saved = load(&at)?;
    same_model(saved.config(), model.config())?;
    let tensors = read_optimizer_file(&at, &model.device())?;
    for p in model.params().trainable() {
        let value = match (tensors.get(&format!("master.{}", p.name)), saved.params().get(&p.name)) {
            (Some(master), _) => master.clone(),
            (None, Some(weight)) => weight.var.as_tensor().clone(),
            (None, None) => return Err(Error::bad_file(&at, format!("the checkpoint has no weight {}", p.name))),
        };
        p.set_master(&value)?;
    }
    model.params().sync_compute()?;
    optimizer.load_state(tensors, optimizer_step, model.params())
}

/// Before the weights, so that the error names an edited config rather
/// than the tensors it leaves unused; an adapter's base is checked after.
fn check_saved_config(at: &Path, expected: &ModelConfig) -> Result<()> {
    match at.join("config.json").is_file() {
        true => same_model(&ModelConfig::from_dir(at)?, expected),
        false => Ok(()),
    }
}

fn read_optimizer_file(at: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let path = at.join(OPTIMIZER_FILE);
    candle_core::safetensors::load(&path, device)
        .map_err(|e| Error::bad_file(&path, format!("cannot read optimizer state: {e}")))
}

/// Errors unless a checkpoint's model is the run's.
fn same_model(saved: &ModelConfig, expected: &ModelConfig) -> Result<()> {
    let differences = saved.differences(expected);
    if differences.is_empty() {
        return Ok(());
    }
    Err(Error::bad_file(
        &saved.path,
        format!(
            "the checkpoint's model differs from the run's ({}): {}; a checkpoint resumes only the model it was \
             saved from",
            expected.path.display(),
            differences.join("; ")
        ),
    ))
}

/// Deletes the oldest checkpoints beyond `limit` (0: keep all).
pub fn prune(output_dir: &Path, limit: usize) -> Result<()> {
    if limit == 0 {
        return Ok(());
    }
    let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(output_dir)
        .map_err(|e| Error::io(output_dir, e))?
        .filter_map(|e| e.ok())
        .filter_map(|e| Some((e.file_name().to_str()?.strip_prefix("checkpoint-")?.parse().ok()?, e.path())))
        .collect();
    found.sort();
    let excess = found.len().saturating_sub(limit);
    for (_, path) in found.into_iter().take(excess) {
        std::fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
    }
    Ok(())
}
