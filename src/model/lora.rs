//! LoRA adapters as PEFT makes them: a dense layer `y = W x + b` gains
//! `scale * B (A x)` with `A` (r, in), `B` (out, r) and `scale = alpha / r`;
//! `W` stays frozen and only `A` and `B` (and the modules PEFT calls
//! `modules_to_save`, such as a reward model's score head) train. `B`
//! starts at zero, so an adapted model starts as its base.
//!
//! Adapter tensors are named as in PEFT's `adapter_model.safetensors`,
//! less its `base_model.model.` prefix: `<module>.lora_A.weight`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{Device, Result as TResult, Tensor};
use serde::{Deserialize, Serialize};

use super::arch::Architecture;
use super::kernels::{self, LoraLayer, Mask};
use super::ops::Activation;
use crate::error::{read_json, Error, Result};
use crate::rng::Rng;

/// The prefix PEFT puts before every tensor name of an adapter file.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// PEFT's `LoraConfig` fields that rloo reads and writes.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f64,
    pub dropout: f64,
    /// Which dense layers get adapters: a layer matches when its full name
    /// is one of these or ends with `.<name>` (PEFT's rule for a list);
    /// `all-linear` matches every dense layer but the output head.
    pub targets: Vec<String>,
    /// Modules trained in full beside the adapters (e.g. `score`).
    pub modules_to_save: Vec<String>,
}

impl LoraConfig {
    pub fn scale(&self) -> f64 {
        self.alpha / self.r as f64
    }

    /// Whether the dense layer with full name `module` gets an adapter.
    pub fn targets(&self, module: &str) -> bool {
        self.targets.iter().any(|t| t == "all-linear" || module == t || module.ends_with(&format!(".{t}")))
    }

    /// Whether a full (not adapted) tensor trains: one of `modules_to_save`.
    pub fn saves(&self, tensor: &str) -> bool {
        self.modules_to_save.iter().any(|m| tensor.starts_with(&format!("{m}.")) || tensor.contains(&format!(".{m}.")))
    }

    pub fn validate(&self) -> Result<()> {
        if self.r == 0 || !self.alpha.is_finite() || self.alpha <= 0.0 || self.targets.is_empty() {
            return Err(Error::Invalid(format!(
                "LoRA needs r >= 1, alpha > 0 and target modules (got r = {}, alpha = {}, {} targets)",
                self.r,
                self.alpha,
                self.targets.len()
            )));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::Invalid(format!("lora_dropout must be in [0, 1), got {}", self.dropout)));
        }
        Ok(())
    }
}

/// TRL's PEFT options (`use_peft` and `lora_*` of its `ModelConfig`), the
/// same for every trainer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeftOptions {
    /// Train LoRA adapters instead of the whole model.
    pub use_peft: bool,
    /// LoRA rank.
    pub lora_r: usize,
    /// LoRA alpha: the adapters are scaled by alpha / r.
    pub lora_alpha: f64,
    /// Dropout on the adapters' input while training (not in online RL, as in TRL).
    pub lora_dropout: f64,
    /// Module names that get adapters, or ["all-linear"] [none: PEFT's default for the architecture].
    pub lora_target_modules: Option<Vec<String>>,
}

impl Default for PeftOptions {
    fn default() -> Self {
        Self { use_peft: false, lora_r: 16, lora_alpha: 32.0, lora_dropout: 0.05, lora_target_modules: None }
    }
}

impl PeftOptions {
    /// The adapters to add to a model of architecture `arch` with
    /// `use_peft` (by default on PEFT's targets for it); `modules_to_save`
    /// train in full beside them (a reward model's `score`).
    pub fn lora(&self, arch: &dyn Architecture, modules_to_save: &[&str]) -> Result<Option<LoraConfig>> {
        if !self.use_peft {
            return Ok(None);
        }
        let targets = match &self.lora_target_modules {
            Some(t) => t.clone(),
            None => arch.lora_targets().iter().map(|t| t.to_string()).collect(),
        };
        let lora = LoraConfig {
            r: self.lora_r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            targets,
            modules_to_save: modules_to_save.iter().map(|m| m.to_string()).collect(),
        };
        lora.validate()?;
        Ok(Some(lora))
    }
}

/// Dropout on an adapter's input: each value is kept with probability
/// `1 - p` and scaled by `1 / (1 - p)`. The masks come from one stream
/// drawn in the order the layers run, so a run is reproducible.
#[derive(Clone)]
pub struct Dropout {
    p: f64,
    rng: Arc<Mutex<Rng>>,
}

impl Dropout {
    pub fn new(p: f64, seed: u64) -> Self {
        let rng = Rng::stream(seed, &[crate::rng::streams::LORA_DROPOUT]);
        Self { p, rng: Arc::new(Mutex::new(rng)) }
    }

    /// Where the mask stream stands.
    pub fn state(&self) -> Rng {
        self.rng.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Moves the mask stream to `state`, returning where it stood.
    pub fn replace_state(&self, state: Rng) -> Rng {
        std::mem::replace(&mut *self.rng.lock().unwrap_or_else(PoisonError::into_inner), state)
    }

    /// The next mask: its key is the stream's next word.
    fn mask(&self) -> Mask {
        let word = self.rng.lock().unwrap_or_else(PoisonError::into_inner).next_u64();
        Mask::new([word as u32, (word >> 32) as u32], self.p)
    }
}

/// The names of a module's two adapter tensors.
pub fn adapter_names(module: &str) -> (String, String) {
    (format!("{module}.lora_A.weight"), format!("{module}.lora_B.weight"))
}

/// Whether a tensor name is an adapter's.
pub fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// What building a network needs to attach adapters: the config, and
/// either the random stream new `A` matrices are drawn from or the saved
/// adapter tensors (by name, less PEFT's prefix) not attached yet.
pub struct AdapterPlan {
    pub config: LoraConfig,
    rng: RefCell<Rng>,
    saved: Option<RefCell<HashMap<String, Tensor>>>,
    /// Dropout for the adapters of a training network.
    pub dropout: Option<Dropout>,
}

impl AdapterPlan {
    /// New adapters: `A` drawn from `seed`, `B` = 0.
    pub fn new(config: LoraConfig, seed: u64) -> Self {
        let rng = Rng::stream(seed, &[crate::rng::streams::LORA_INIT]);
        Self { config, rng: RefCell::new(rng), saved: None, dropout: None }
    }

    /// Saved adapters.
    pub fn saved(config: LoraConfig, tensors: HashMap<String, Tensor>) -> Self {
        Self { saved: Some(RefCell::new(tensors)), ..Self::new(config, 0) }
    }

    /// The initial value of adapter tensor `name` (r, in) or (out, r): the
    /// saved one, or new as PEFT initialises them: `A` kaiming-uniform with
    /// `a = sqrt(5)` (uniform in ±1/sqrt(in)), `B` zeros.
    pub fn initial(&self, name: &str, shape: (usize, usize), device: &Device) -> Result<Tensor> {
        if let Some(saved) = &self.saved {
            return saved.borrow_mut().remove(name).ok_or_else(|| Error::Weights {
                msg: format!("the adapter has no `{PEFT_PREFIX}{name}`, which its target modules ask for"),
            });
        }
        let values = if name.ends_with(".lora_A.weight") {
            let bound = 1.0 / (shape.1 as f64).sqrt();
            let mut rng = self.rng.borrow_mut();
            (0..shape.0 * shape.1).map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32).collect()
        } else {
            vec![0.0; shape.0 * shape.1]
        };
        Ok(Tensor::from_vec(values, shape, device)?)
    }

    /// Saved adapter tensors no module took: the adapter does not fit the base.
    pub fn unused(&self) -> Vec<String> {
        let mut names: Vec<String> = self.saved.as_ref().map_or(vec![], |s| s.borrow().keys().cloned().collect());
        names.sort();
        names
    }
}

/// One dense layer's adapter.
pub struct Adapter {
    /// (r, in)
    pub a: Tensor,
    /// (out, r)
    pub b: Tensor,
    pub scale: f64,
    pub dropout: Option<Dropout>,
}

impl Adapter {
    /// `h W^T + b + scale * B (A dropout(h))` for the frozen base `weight`
    /// and `bias`, where `h` is `act(x)` or `x` (..., in).
    pub fn forward(
        &self,
        x: &Tensor,
        act: Option<Activation>,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> TResult<Tensor> {
        let mask = self.dropout.as_ref().map(Dropout::mask);
        let layer = LoraLayer { weight, bias, a: &self.a, b: &self.b, scale: self.scale };
        kernels::lora_forward(x, act, &layer, mask)
    }

    /// [`Self::forward`] without an activation, where the training graph
    /// keeps only the place of `x`, which `remake` makes again for the
    /// backward (where there is one).
    pub fn forward_remade(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        remake: Option<kernels::Remake>,
    ) -> TResult<Tensor> {
        let mask = self.dropout.as_ref().map(Dropout::mask);
        let layer = LoraLayer { weight, bias, a: &self.a, b: &self.b, scale: self.scale };
        kernels::lora_forward_remade(x, &layer, mask, remake)
    }
}

/// The files of a PEFT adapter directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// What an adapter directory's `adapter_config.json` says.
pub struct AdapterFile {
    pub config: LoraConfig,
    /// `base_model_name_or_path`: the model it was trained on.
    pub base: String,
    /// `task_type`: `SEQ_CLS` for a reward model.
    pub task_type: Option<String>,
}

/// Reads an adapter directory's `adapter_config.json`.
pub fn read_adapter_config(dir: &Path) -> Result<AdapterFile> {
    let path = dir.join(ADAPTER_CONFIG);
    let raw: serde_json::Value = read_json(&path)?;
    let bad = |msg: String| Error::bad_config(&path, msg);
    let get = |key: &str| raw.get(key).filter(|v| !v.is_null());
    if get("peft_type").and_then(|v| v.as_str()) != Some("LORA") {
        return Err(bad(format!("only LoRA adapters are read, not peft_type {:?}", get("peft_type"))));
    }
    for (key, plain) in [
        ("use_dora", serde_json::json!(false)),
        ("use_rslora", serde_json::json!(false)),
        ("bias", serde_json::json!("none")),
        ("lora_bias", serde_json::json!(false)),
        ("rank_pattern", serde_json::json!({})),
        ("alpha_pattern", serde_json::json!({})),
    ] {
        if get(key).is_some_and(|v| *v != plain) {
            return Err(bad(format!("`{key}` = {} is not supported (only {plain})", get(key).expect("checked"))));
        }
    }
    if get("layers_to_transform").is_some() {
        return Err(bad("`layers_to_transform` is not supported".into()));
    }
    let number = |key: &str| get(key).and_then(|v| v.as_f64()).ok_or_else(|| bad(format!("no number `{key}`")));
    let targets = match get("target_modules") {
        Some(serde_json::Value::Array(names)) => {
            names.iter().map(|n| n.as_str().map(str::to_string)).collect::<Option<Vec<_>>>()
        }
        Some(serde_json::Value::String(s)) if s == "all-linear" => Some(vec![s.clone()]),
        Some(serde_json::Value::String(s)) => {
            return Err(bad(format!("target_modules as a regular expression ({s:?}) is not supported; list the names")))
        }
        _ => None,
    }
    .ok_or_else(|| bad("target_modules must be a list of module names".into()))?;
    let modules_to_save = match get("modules_to_save") {
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| bad(format!("modules_to_save: {e}")))?,
        None => vec![],
    };
    let config = LoraConfig {
        r: number("r")? as usize,
        alpha: number("lora_alpha")?,
        dropout: get("lora_dropout").and_then(|v| v.as_f64()).unwrap_or(0.0),
        targets,
        modules_to_save,
    };
    config.validate().map_err(|e| bad(e.to_string()))?;
    let base = get("base_model_name_or_path")
        .and_then(|v| v.as_str())
        .ok_or_else(|| bad("no `base_model_name_or_path`: give the base model".into()))?;
    let task_type = get("task_type").and_then(|v| v.as_str()).map(str::to_string);
    Ok(AdapterFile { config, base: base.to_string(), task_type })
}

/// `adapter_config.json` as PEFT writes it, for `task_type` (`CAUSAL_LM` or
/// `SEQ_CLS`) on `base`; `fan_in_fan_out` for GPT-2's transposed `Conv1D`.
pub fn adapter_config_json(
    config: &LoraConfig,
    base: &str,
    task_type: &str,
    fan_in_fan_out: bool,
) -> serde_json::Value {
    let modules_to_save = (!config.modules_to_save.is_empty()).then_some(&config.modules_to_save);
    let targets: serde_json::Value = match config.targets.as_slice() {
        [all] if all == "all-linear" => all.clone().into(),
        names => names.into(),
    };
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "modules_to_save": modules_to_save,
        "fan_in_fan_out": fan_in_fan_out,
        "bias": "none",
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropout_zeroes_a_share_p_and_scales_the_rest_reproducibly() {
        let x = Tensor::ones(10_000, candle_core::DType::F32, &Device::Cpu).unwrap();
        let draw = || {
            let mask = Dropout::new(0.25, 7).mask();
            (&x * mask.to_tensor(&x).unwrap()).unwrap().to_vec1::<f32>().unwrap()
        };
        let y = draw();
        let zeros = y.iter().filter(|&&v| v == 0.0).count() as f64 / y.len() as f64;
        assert!((zeros - 0.25).abs() < 0.02, "{zeros}");
        assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
        assert_eq!(y, draw(), "the same seed draws the same masks");
        let dropout = Dropout::new(0.25, 7);
        assert_ne!(dropout.mask().kept(64), dropout.mask().kept(64), "each mask is drawn anew");
    }

    /// Element i's fate is its own Philox word's, whatever the mask's length
    /// (the rule the GPU's kernel follows).
    #[test]
    fn a_mask_keeps_each_element_by_its_own_counter() {
        let mask = kernels::Mask::new([0xdead_beef, 42], 0.1);
        let long = mask.kept(70_001);
        assert_eq!(&long[..37], &mask.kept(37)[..]);
        for i in [0usize, 1, 5, 16_383, 16_384, 16_390, 70_000] {
            let word = crate::rng::philox([(i / 4) as u32, 0, 0, 0], mask.key)[i % 4];
            assert_eq!(long[i], (word as u64) < mask.threshold, "element {i}");
        }
    }

    #[test]
    fn peft_options_give_pefts_defaults_and_check_their_values() {
        let on = PeftOptions { use_peft: true, ..PeftOptions::default() };
        let llama = crate::model::arch::find("llama").unwrap();
        let lora = on.lora(llama, &["score"]).unwrap().unwrap();
        assert_eq!(
            (lora.r, lora.scale(), lora.targets.as_slice()),
            (16, 2.0, &["q_proj".to_string(), "v_proj".into()][..])
        );
        assert!(lora.targets("model.layers.0.self_attn.q_proj") && !lora.targets("model.layers.0.self_attn.k_proj"));
        assert!(lora.saves("score.weight") && !lora.saves("model.norm.weight"));
        assert!(PeftOptions::default().lora(llama, &[]).unwrap().is_none());
        let err = PeftOptions { lora_r: 0, ..on.clone() }.lora(llama, &[]).unwrap_err().to_string();
        assert!(err.contains("r >= 1"), "{err}");
    }
}
