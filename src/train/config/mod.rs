//! The RLOO trainer's configuration: one serde tree, read from a TOML file,
//! patched by `--set section.key=value` and by the TRL-style flags, then
//! validated into the batch arithmetic the loop uses.
//!
//! Defaults follow TRL's RLOOConfig (docs/algorithm.md section 7) except where
//! a field's doc says otherwise. The sections are in `sections`, the file and
//! `--set` handling in `file`, the range checks in `ranges`, what a resume
//! may change in `resume` and the batch arithmetic in `batch`.

mod batch;
mod file;
mod ranges;
mod resume;
mod sections;

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use batch::BatchSizes;
pub use file::{load_toml, parse_set, to_toml};
pub use ranges::{check_optimizer, finite, in_range, non_negative, positive, Bound, OptimizerOptions};
pub use resume::{changes_since, CHANGEABLE_ON_RESUME, CONFIG_FILE};
pub use sections::*;

use crate::algo::{Aggregation, RatioLevel};
use crate::error::{Error, Result};
use crate::model::lora::PeftOptions;
use crate::reward::RewardSpec;
use Bound::{Closed, Open};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub model: ModelSection,
    pub data: DataSection,
    pub generation: GenerationSection,
    pub rloo: RlooSection,
    /// PPO's own options (`train.algo = "ppo"`); PPO shares k, kl_coef,
    /// kl_estimator, cliprange, the epochs, mini-batches and score shaping
    /// with `[rloo]`.
    pub ppo: PpoSection,
    /// LoRA adapters instead of full training (TRL's `use_peft` and `lora_*`);
    /// the KL reference is the policy without them.
    pub peft: PeftOptions,
    pub train: TrainSection,
    /// Evaluation on held-out prompts during the run.
    pub eval: EvalSection,
    /// Reward sources, summed with their weights (`[[reward]]` tables).
    pub reward: Vec<RewardSpec>,
}

impl TrainConfig {
    /// Reads a TOML file, applies `overrides` (dotted path, value) in order,
    /// and deserialises; unknown keys are errors naming their path.
    pub fn load(file: Option<&Path>, overrides: &[(String, toml::Value)]) -> Result<Self> {
        let overrides: Vec<(String, toml::Value)> =
            overrides.iter().map(|(key, value)| (file::canonical_key(key), value.clone())).collect();
        load_toml(file, &overrides, file::rename_trl_names)
    }

    /// Deserialises a TOML table; errors name `source` and the key's path.
    pub fn from_table(table: toml::Table, source: &Path) -> Result<Self> {
        file::from_table(table, source)
    }

    /// The resolved configuration as TOML, written next to the outputs.
    pub fn to_toml(&self) -> String {
        to_toml(self)
    }

    /// Checks values that no type can express; messages name the option.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::Invalid(msg));
        if self.model.policy.is_empty() {
            return bad("no policy: set model.policy (or --model_name_or_path / --sft_model_path)".into());
        }
        if self.data.path.is_empty() {
            return bad("no prompts: set data.path (or --dataset_name)".into());
        }
        super::rl::evaluation::validate(self).map_err(Error::Invalid)?;
        let algorithm = super::rl::algorithm::find(&self.train.algo).map_err(Error::Invalid)?;
        (algorithm.check)(self).map_err(Error::Invalid)?;
        let p = &self.ppo;
        non_negative("ppo.vf_coef", p.vf_coef)?;
        positive("ppo.cliprange_value", p.cliprange_value)?;
        in_range("ppo.gamma", p.gamma, Closed(0.0), Closed(1.0))?;
        in_range("ppo.lam", p.lam, Closed(0.0), Closed(1.0))?;
        if let Some(lr) = p.critic_learning_rate {
            positive("ppo.critic_learning_rate", lr)?;
        }
        let (g, r, t) = (&self.generation, &self.rloo, &self.train);
        positive("generation.temperature", g.temperature)?;
        in_range("generation.top_p", g.top_p, Open(0.0), Closed(1.0))?;
        in_range("generation.min_p", g.min_p, Closed(0.0), Open(1.0))?;
        positive("generation.repetition_penalty", g.repetition_penalty)?;
        positive("rloo.cliprange", r.cliprange)?;
        if let Some(high) = r.cliprange_high {
            positive("rloo.cliprange_high", high)?;
        }
        non_negative("rloo.kl_coef", r.kl_coef)?;
        if let Some(p) = r.missing_eos_penalty {
            finite("rloo.missing_eos_penalty", p)?;
        }
        if let Some(c) = r.reward_clip_range {
            positive("rloo.reward_clip_range", c)?;
        }
        positive("train.learning_rate", t.learning_rate)?;
        positive("train.num_train_epochs", t.num_train_epochs)?;
        check_optimizer("train.", &t.optimizer_options())?;
        in_range("train.warmup_ratio", t.warmup_ratio, Closed(0.0), Closed(1.0))?;
        if g.response_length == 0 {
            return bad("generation.response_length must be at least 1".into());
        }
        for sink in &self.train.report_to {
            if !matches!(sink.as_str(), "tensorboard" | "all" | "none") {
                return bad(format!(
                    "train.report_to: `{sink}` is not available here; use tensorboard or none \
                     (metrics.jsonl is always written)"
                ));
            }
        }
        if !matches!(g.stop_token.as_str(), "eos" | "none") {
            return bad(format!("generation.stop_token must be \"eos\" or \"none\", got {:?}", g.stop_token));
        }
        if r.ratio == RatioLevel::Sequence && r.aggregation != Aggregation::SequenceMean {
            return bad(format!(
                "rloo.aggregation = {} needs rloo.ratio = token",
                serde_json::to_value(r.aggregation).expect("a name").as_str().unwrap_or_default()
            ));
        }
        for (name, v) in [
            ("rloo.num_ppo_epochs", self.rloo.num_ppo_epochs),
            ("rloo.num_mini_batches", self.rloo.num_mini_batches),
            ("train.per_device_train_batch_size", self.train.per_device_train_batch_size),
            ("train.gradient_accumulation_steps", self.train.gradient_accumulation_steps),
            ("train.logging_steps", self.train.logging_steps),
            ("train.max_skipped_steps", self.train.max_skipped_steps),
            ("generation.local_rollout_forward_batch_size", self.generation.local_rollout_forward_batch_size),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if self.train.zero_stage > 1 {
            return bad(format!("train.zero_stage = {} is not one of 0 and 1", self.train.zero_stage));
        }
        if self.reward.is_empty() {
            return bad("no reward: add a [[reward]] table (or --reward_model_path)".into());
        }
        BatchSizes::new(self, None).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::Baseline;

    pub(super) fn with(overrides: &[&str]) -> Result<TrainConfig> {
        let sets: Vec<_> = overrides.iter().map(|s| parse_set(s).unwrap()).collect();
        TrainConfig::load(None, &sets)
    }

    #[test]
    fn defaults_follow_spec_section_6() {
        let c = TrainConfig::default();
        assert_eq!(
            (c.rloo.k, c.rloo.kl_coef, c.rloo.cliprange, c.rloo.num_ppo_epochs, c.rloo.num_mini_batches),
            (2, 0.05, 0.2, 4, 1)
        );
        assert_eq!((c.generation.temperature, c.generation.response_length), (0.7, 53));
    }

    #[test]
    fn set_overrides_reach_nested_keys_and_unknown_keys_are_named() {
        let c = with(&["rloo.k=4", "data.path=\"p.jsonl\"", "train.learning_rate=1e-5", "rloo.baseline=group_mean"])
            .unwrap();
        assert_eq!(c.rloo.k, 4);
        assert_eq!(c.data.path, "p.jsonl");
        assert_eq!(c.train.learning_rate, 1e-5);
        assert_eq!(c.rloo.baseline, Baseline::GroupMean);
        let err = with(&["rloo.kk=4"]).unwrap_err().to_string();
        assert!(err.contains("rloo") && err.contains("`kk`"), "{err}");
        let err = with(&["rloo.k=\"four\""]).unwrap_err().to_string();
        assert!(err.contains("rloo.k"), "{err}");
    }

    #[test]
    fn bare_strings_need_no_quotes() {
        assert_eq!(parse_set("data.path=runs/x.jsonl").unwrap().1, toml::Value::String("runs/x.jsonl".into()));
    }

    #[test]
    fn numeric_options_must_be_finite_and_in_range() {
        let base = ["model.policy=x", "data.path=y", "reward=[{type=\"length\"}]"];
        let err = |extra: &str| {
            let mut sets = base.to_vec();
            sets.push(extra);
            with(&sets).unwrap().validate().unwrap_err().to_string()
        };
        assert_eq!(err("train.learning_rate=nan"), "train.learning_rate must be > 0, got NaN");
        assert_eq!(err("train.learning_rate=inf"), "train.learning_rate must be > 0, got inf");
        assert_eq!(err("rloo.kl_coef=nan"), "rloo.kl_coef must be >= 0, got NaN");
        assert_eq!(err("train.adam_epsilon=0.0"), "train.adam_epsilon must be > 0, got 0");
        assert_eq!(err("train.adam_beta2=1.0"), "train.adam_beta2 must be in [0, 1), got 1");
        assert_eq!(err("train.warmup_ratio=1.5"), "train.warmup_ratio must be in [0, 1], got 1.5");
        assert_eq!(err("train.max_grad_norm=-1.0"), "train.max_grad_norm must be >= 0, got -1");
        assert_eq!(err("train.weight_decay=-0.1"), "train.weight_decay must be >= 0, got -0.1");
        assert_eq!(err("generation.top_p=0.0"), "generation.top_p must be in (0, 1], got 0");
        assert_eq!(err("generation.min_p=1.0"), "generation.min_p must be in [0, 1), got 1");
        assert_eq!(err("rloo.missing_eos_penalty=inf"), "rloo.missing_eos_penalty must be a finite number, got inf");
        with(&base).unwrap().validate().unwrap();
    }

    #[test]
    fn k_below_two_is_rejected() {
        let c = with(&["rloo.k=1", "model.policy=x", "data.path=y"]).unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("at least 2"));
    }

    #[test]
    fn an_algorithms_own_options_are_refused_by_the_others() {
        let err = |extra: &[&str]| {
            let c =
                with(&[&["model.policy=x", "data.path=y", "reward=[{type=\"length\"}]"][..], extra].concat()).unwrap();
            c.validate().err().map(|e| e.to_string())
        };
        assert_eq!(err(&["train.algo=\"grpo\"", "rloo.scale_rewards=\"batch\""]), None);
        assert_eq!(err(&["train.algo=\"ppo\"", "ppo.lam=0.9"]), None);
        let refused = err(&["train.algo=\"grpo\"", "rloo.baseline=\"batch_mean\""]).unwrap();
        assert!(refused.contains("rloo.baseline does not apply to train.algo = \"grpo\""), "{refused}");
        let refused = err(&["rloo.scale_rewards=\"none\""]).unwrap();
        assert!(refused.contains("rloo.scale_rewards"), "{refused}");
        let refused = err(&["train.algo=\"reinforce++\"", "ppo.vf_coef=0.5"]).unwrap();
        assert!(refused.contains("[ppo]"), "{refused}");
        let refused = err(&["train.algo=\"nope\""]).unwrap();
        assert!(refused.contains("nope") && refused.contains("dr_grpo"), "{refused}");
    }
}
