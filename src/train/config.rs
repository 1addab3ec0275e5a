//! The RLOO trainer's configuration: one serde tree, read from a TOML file,
//! patched by `--set section.key=value` and by the TRL-style flags, then
//! validated into the batch arithmetic the loop uses.
//!
//! Defaults follow TRL's RLOOConfig (docs/algorithm.md section 7) except where
//! a field's doc says otherwise.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::algo::{Aggregation, Baseline, KlEstimator, KlPlacement, RatioLevel, ScaleRewards};
use crate::error::{Error, Result};
use crate::model::lora::PeftOptions;
use crate::model::Precision;
use crate::reward::RewardSpec;

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

/// Evaluation during training: every `steps` rollout steps (and after the
/// last) the policy answers the held-out prompts once each, and their
/// rewards, KL, length, EOS share and win rate over the reference are
/// logged as `eval/...`; their sample table replaces the training one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// The held-out prompts' split (TRL's `dataset_test_split`), of
    /// `eval.dataset` when given, else of `data.path`.
    pub split: Option<String>,
    /// Held-out prompts from another dataset [split: eval.split, else "test"].
    pub dataset: Option<String>,
    /// Use only the first N held-out rows.
    pub take: Option<usize>,
    /// "no" or "steps" [default: "steps" with held-out prompts, else "no"].
    pub strategy: Option<EvalStrategy>,
    /// Evaluate every N rollout steps [default: as often as sample tables
    /// are printed, total steps / num_sample_generations].
    pub steps: Option<usize>,
}

/// When a run evaluates (TRL's `eval_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvalStrategy {
    No,
    Steps,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// The policy to train: a model directory or a hub id in the local cache.
    pub policy: String,
    /// The frozen KL reference [default: the policy's initial weights]. Not loaded when kl_coef = 0.
    pub reference: Option<String>,
    /// Where the tokenizer comes from [default: the policy].
    pub tokenizer: Option<String>,
    /// cpu, cuda, cuda:N, or auto (the first GPU when built with CUDA).
    pub device: String,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self { policy: String::new(), reference: None, tokenizer: None, device: "auto".into() }
    }
}

/// What happens to a prompt longer than `max_prompt_length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LongPrompts {
    /// Leave it out of the dataset, counted and logged.
    #[default]
    Skip,
    /// Stop with an error naming the row.
    Error,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// The prompts: a dataset file (JSONL, JSON, CSV, Parquet, Arrow, ...),
    /// a dataset directory or `datasets` save, or a hub dataset id.
    pub path: String,
    /// The configuration (sub-directory) of a dataset that has several.
    pub config: Option<String>,
    /// The split read from a dataset directory or hub dataset.
    pub split: String,
    /// Keep only the rows this expression accepts, e.g. `language == "english"`.
    pub filter: Option<String>,
    /// The column holding the prompt: a string, or a list of chat messages.
    pub prompt_column: String,
    /// Builds the prompt from other columns instead, e.g. "Summarize: {post}".
    pub template: Option<String>,
    /// Send templated prompts as a user chat message (rendered with the chat template).
    pub chat: bool,
    /// A system message put before chat prompts that have none.
    pub system_prompt: Option<String>,
    /// Use only the first N rows.
    pub take: Option<usize>,
    /// Shuffle the prompts every epoch (seeded).
    pub shuffle: bool,
    /// Longest prompt in tokens (none: no limit).
    pub max_prompt_length: Option<usize>,
    /// skip or error for prompts longer than max_prompt_length.
    pub long_prompts: LongPrompts,
    /// Drop prompts longer than 0.9 x generation.response_length tokens.
    pub filter_length: bool,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            path: String::new(),
            config: None,
            split: "train".into(),
            filter: None,
            prompt_column: "prompt".into(),
            template: None,
            chat: false,
            system_prompt: None,
            take: None,
            shuffle: true,
            max_prompt_length: None,
            long_prompts: LongPrompts::Skip,
            filter_length: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GenerationSection {
    /// Most new tokens per completion.
    pub response_length: usize,
    /// Sampling temperature; log-probs are taken at the same temperature.
    pub temperature: f64,
    /// Keep only the k most likely tokens when sampling (0: off).
    pub top_k: usize,
    /// Nucleus sampling threshold (1: off).
    pub top_p: f64,
    /// Min-p sampling threshold (0: off).
    pub min_p: f64,
    /// transformers' repetition penalty when sampling (1: off). The sampler
    /// then draws from another distribution than the policy's, so the old
    /// log-probs are recomputed with a forward pass.
    pub repetition_penalty: f64,
    /// "eos" stops completions at the EOS ids; "none" always generates
    /// response_length tokens (TRL's default, which trains on text past the end).
    pub stop_token: String,
    /// An extra token id that ends completions.
    pub stop_token_id: Option<u32>,
    /// Rows per forward pass when sampling and computing log-probs.
    pub local_rollout_forward_batch_size: usize,
}

impl Default for GenerationSection {
    fn default() -> Self {
        Self {
            response_length: 53,
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            stop_token: "eos".into(),
            stop_token_id: None,
            local_rollout_forward_batch_size: 64,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlooSection {
    /// Completions per prompt (k >= 2; PPO: k >= 1).
    pub k: usize,
    /// KL coefficient beta; 0 loads no reference model.
    pub kl_coef: f64,
    pub kl_estimator: KlEstimator,
    pub kl_placement: KlPlacement,
    pub baseline: Baseline,
    pub ratio: RatioLevel,
    pub aggregation: Aggregation,
    /// Clip range epsilon: the ratio is clipped to [1 - eps, 1 + eps_high].
    pub cliprange: f64,
    /// The upper clip range (DAPO's clip-higher); none: `cliprange`.
    pub cliprange_high: Option<f64>,
    /// Optimisation passes over each rollout batch.
    pub num_ppo_epochs: usize,
    /// Mini-batches per pass (one optimizer step each).
    pub num_mini_batches: usize,
    /// TRL 1.x's rollout size, in micro-batches: the rollout batch is
    /// per_device_train_batch_size x steps_per_generation completions
    /// (instead of num_mini_batches).
    pub steps_per_generation: Option<usize>,
    /// TRL 1.x's rollout size in completions (instead of num_mini_batches
    /// or steps_per_generation).
    pub generation_batch_size: Option<usize>,
    /// Whiten advantages over the rollout batch (RLOO).
    pub normalize_advantage: bool,
    /// What GRPO divides centred returns by: group, batch or none.
    pub scale_rewards: ScaleRewards,
    /// Subtracted from the score of completions without an EOS token.
    pub missing_eos_penalty: Option<f64>,
    /// Z-score the scores over the rollout batch.
    pub normalize_reward: bool,
    /// Clip scores to [-r, r] (after normalisation).
    pub reward_clip_range: Option<f64>,
    /// Recompute the sampling policy's log-probs with a forward pass instead
    /// of keeping the sampler's. Both are the same policy's log-probs and
    /// agree to float rounding; the sampler's save a forward pass per step.
    pub recompute_old_logprobs: bool,
    /// Completions that reach the length limit without EOS take no part in
    /// the loss (nor in the KL), as TRL 1.x's `mask_truncated_completions`.
    pub mask_truncated_completions: bool,
}

impl TrainSection {
    /// Whether TensorBoard event files are written.
    pub fn tensorboard(&self) -> bool {
        self.report_to.iter().any(|s| s == "tensorboard" || s == "all")
    }
}

impl RlooSection {
    /// The score shaping these options ask for (checked by `TrainConfig::validate`).
    pub fn shaping(&self) -> crate::reward::Shaping {
        crate::reward::Shaping {
            missing_eos_penalty: self.missing_eos_penalty.map(|p| p as f32),
            normalize: self.normalize_reward,
            clip: self.reward_clip_range.map(|r| [-r as f32, r as f32]),
        }
    }

    /// The ratio's clip range.
    pub fn clip_range(&self) -> crate::algo::ClipRange {
        crate::algo::ClipRange { low: self.cliprange, high: self.cliprange_high.unwrap_or(self.cliprange) }
    }

    /// The options of [`algo::returns_and_advantages`](crate::algo::returns_and_advantages).
    pub fn return_options(&self) -> crate::algo::ReturnOptions {
        crate::algo::ReturnOptions {
            kl_coef: self.kl_coef as f32,
            kl_placement: self.kl_placement,
            baseline: self.baseline,
            normalize: self.normalize_advantage,
        }
    }
}

impl Default for RlooSection {
    fn default() -> Self {
        Self {
            k: 2,
            kl_coef: 0.05,
            kl_estimator: KlEstimator::K1,
            kl_placement: KlPlacement::Reward,
            baseline: Baseline::LeaveOneOut,
            ratio: RatioLevel::Sequence,
            aggregation: Aggregation::SequenceMean,
            cliprange: 0.2,
            cliprange_high: None,
            num_ppo_epochs: 4,
            num_mini_batches: 1,
            steps_per_generation: None,
            generation_batch_size: None,
            normalize_advantage: false,
            scale_rewards: ScaleRewards::Group,
            missing_eos_penalty: None,
            normalize_reward: false,
            reward_clip_range: None,
            recompute_old_logprobs: false,
            mask_truncated_completions: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PpoSection {
    /// Where the critic starts: a sequence-classification model directory,
    /// "reward" (the one reward model of `[[reward]]`) or "policy" (a new
    /// value head on the policy) [default: "reward" when there is exactly
    /// one reward model, else "policy"].
    pub value_model: Option<String>,
    /// Weight of the value loss.
    pub vf_coef: f64,
    /// Clip range of the predicted values around the rollout's values.
    pub cliprange_value: f64,
    /// Discount.
    pub gamma: f64,
    /// GAE's lambda.
    pub lam: f64,
    /// Whiten the per-token rewards over the batch before GAE.
    pub whiten_rewards: bool,
    /// The critic's learning rate [default: train.learning_rate].
    pub critic_learning_rate: Option<f64>,
}

impl Default for PpoSection {
    fn default() -> Self {
        Self {
            value_model: None,
            vf_coef: 0.1,
            cliprange_value: 0.2,
            gamma: 1.0,
            lam: 0.95,
            whiten_rewards: false,
            critic_learning_rate: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    Constant,
    #[default]
    Linear,
    Cosine,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainSection {
    /// The algorithm, by its name in `train::rl::algorithm::REGISTRY`.
    pub algo: String,
    /// Checkpoints, the final model, metrics and samples go here.
    pub output_dir: String,
    pub learning_rate: f64,
    /// Completions per micro-batch (one forward/backward).
    pub per_device_train_batch_size: usize,
    /// Micro-batches accumulated per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Completions to train on [default: num_train_epochs x prompts x k].
    pub total_episodes: Option<usize>,
    /// Optimizer steps to train for (TRL's `max_steps`), instead of
    /// total_episodes: rounded up to whole rollout batches.
    pub max_steps: Option<usize>,
    /// Passes over the prompts when total_episodes is not set.
    pub num_train_epochs: f64,
    pub lr_scheduler_type: Schedule,
    /// Warm-up optimizer steps (overrides warmup_ratio when > 0).
    pub warmup_steps: usize,
    /// Warm-up as a fraction of all optimizer steps.
    pub warmup_ratio: f64,
    /// AdamW decoupled weight decay (not applied to biases and norm weights).
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    /// Clip gradients to this global norm (0: off).
    pub max_grad_norm: f64,
    /// f32, or bf16 mixed precision (f32 master weights and optimizer state).
    pub dtype: Precision,
    /// Keep only each layer's input in the forward pass and recompute the
    /// layer in the backward.
    pub gradient_checkpointing: bool,
    pub seed: u64,
    /// Log metrics every N rollout steps.
    pub logging_steps: usize,
    /// Save a checkpoint every N rollout steps (0: only at the end).
    pub save_steps: usize,
    /// Keep at most this many checkpoints (0: all).
    pub save_total_limit: usize,
    /// Times over the run a table of sample completions is printed.
    pub num_sample_generations: usize,
    /// Rows of each printed table (all are kept in `samples.jsonl`).
    pub num_completions_to_print: usize,
    /// Where metrics go besides `metrics.jsonl`: "tensorboard" (also
    /// "all"), or "none".
    pub report_to: Vec<String>,
    /// A checkpoint directory to continue from, or "latest" for the newest in output_dir.
    pub resume_from_checkpoint: Option<String>,
    /// Stop after this many rollout steps of this invocation, with a
    /// checkpoint, to continue later with resume_from_checkpoint.
    pub stop_after: Option<usize>,
    /// Replace the checkpoints and logs of a previous run in output_dir
    /// (without it, a directory holding a run is refused unless resuming).
    pub overwrite_output_dir: bool,
    /// Stop the run, with a checkpoint of the last good weights, after this
    /// many optimizer steps in a row skipped (a non-finite loss or gradient, or
    /// a rollout with no scorable sample).
    pub max_skipped_steps: usize,
}

impl Default for TrainSection {
    fn default() -> Self {
        Self {
            algo: "rloo".into(),
            output_dir: "runs/rloo".into(),
            learning_rate: 3e-6,
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 1,
            total_episodes: None,
            max_steps: None,
            num_train_epochs: 1.0,
            lr_scheduler_type: Schedule::Linear,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            dtype: Precision::F32,
            gradient_checkpointing: false,
            seed: 42,
            logging_steps: 1,
            save_steps: 100,
            save_total_limit: 3,
            num_sample_generations: 10,
            num_completions_to_print: 8,
            report_to: vec!["tensorboard".into()],
            resume_from_checkpoint: None,
            stop_after: None,
            overwrite_output_dir: false,
            max_skipped_steps: 10,
        }
    }
}

impl TrainConfig {
    /// Reads a TOML file, applies `overrides` (dotted path, value) in order,
    /// and deserialises; unknown keys are errors naming their path.
    pub fn load(file: Option<&Path>, overrides: &[(String, toml::Value)]) -> Result<Self> {
        let overrides: Vec<(String, toml::Value)> =
            overrides.iter().map(|(key, value)| (canonical_key(key), value.clone())).collect();
        load_toml(file, &overrides, rename_trl_names)
    }

    /// Deserialises a TOML table; errors name `source` and the key's path.
    pub fn from_table(table: toml::Table, source: &Path) -> Result<Self> {
        from_table(table, source)
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
        if self.reward.is_empty() {
            return bad("no reward: add a [[reward]] table (or --reward_model_path)".into());
        }
        BatchSizes::new(self, None).map(|_| ())
    }
}

/// Keys a resumed run may change: where and how often it reports and
/// saves, and how it uses the machine. Any other change would make the
/// resumed run a different run than the one its checkpoint belongs to.
/// The resolved configuration, saved in the output directory and in each checkpoint.
pub const CONFIG_FILE: &str = "rloo_config.toml";

pub const CHANGEABLE_ON_RESUME: &[&str] = &[
    "eval.split",
    "eval.dataset",
    "eval.take",
    "eval.strategy",
    "eval.steps",
    "model.device",
    "generation.local_rollout_forward_batch_size",
    "train.output_dir",
    "train.logging_steps",
    "train.save_steps",
    "train.save_total_limit",
    "train.num_sample_generations",
    "train.num_completions_to_print",
    "train.resume_from_checkpoint",
    "train.stop_after",
    "train.overwrite_output_dir",
    "train.max_skipped_steps",
];

impl TrainConfig {
    /// The differences from the configuration a checkpoint was saved with
    /// (see [`changes_since`]).
    pub fn changes_since(&self, saved: &TrainConfig) -> std::result::Result<Vec<String>, Vec<String>> {
        changes_since(saved, self, CHANGEABLE_ON_RESUME)
    }
}

/// The differences between the configuration a checkpoint was saved with
/// and the run's, as `key: saved -> now`: `Ok` with the changes a resume
/// may make (those `changeable` names; to log), or `Err` with those it may not.
pub fn changes_since<T: Serialize>(
    saved: &T,
    now: &T,
    changeable: &[&str],
) -> std::result::Result<Vec<String>, Vec<String>> {
    let (old, new) = (flat_keys(saved), flat_keys(now));
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    let (mut allowed, mut refused) = (Vec::new(), Vec::new());
    for key in keys {
        let (was, is) = (old.get(key), new.get(key));
        if was == is {
            continue;
        }
        let show = |v: Option<&String>| v.cloned().unwrap_or_else(|| "unset".into());
        let line = format!("{key}: {} -> {}", show(was), show(is));
        if changeable.contains(&key.as_str()) {
            allowed.push(line);
        } else {
            refused.push(line);
        }
    }
    if refused.is_empty() {
        Ok(allowed)
    } else {
        Err(refused)
    }
}

/// `section.key -> value` for every set key; `[[reward]]` is one key.
fn flat_keys<T: Serialize>(cfg: &T) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    if let Ok(toml::Value::Table(top)) = toml::Value::try_from(cfg) {
        for (section, value) in top {
            match value {
                toml::Value::Table(keys) => {
                    for (key, v) in keys {
                        out.insert(format!("{section}.{key}"), v.to_string());
                    }
                }
                other => {
                    out.insert(section, other.to_string());
                }
            }
        }
    }
    out
}

/// AdamW and clipping options, named as every trainer spells them.
#[derive(Debug, Clone, Copy)]
pub struct OptimizerOptions {
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
}

impl TrainSection {
    pub fn optimizer_options(&self) -> OptimizerOptions {
        OptimizerOptions {
            adam_beta1: self.adam_beta1,
            adam_beta2: self.adam_beta2,
            adam_epsilon: self.adam_epsilon,
            weight_decay: self.weight_decay,
            max_grad_norm: self.max_grad_norm,
        }
    }
}

/// Ranges that keep AdamW's update finite (a zero epsilon divides by zero
/// for a parameter whose gradient is zero); `section` prefixes the option
/// names in errors (`train.`, or none).
pub fn check_optimizer(section: &str, o: &OptimizerOptions) -> Result<()> {
    let name = |key: &str| format!("{section}{key}");
    in_range(&name("adam_beta1"), o.adam_beta1, Closed(0.0), Open(1.0))?;
    in_range(&name("adam_beta2"), o.adam_beta2, Closed(0.0), Open(1.0))?;
    positive(&name("adam_epsilon"), o.adam_epsilon)?;
    non_negative(&name("weight_decay"), o.weight_decay)?;
    non_negative(&name("max_grad_norm"), o.max_grad_norm)
}

/// One end of an allowed range of a numeric option.
#[derive(Debug, Clone, Copy)]
pub enum Bound {
    Open(f64),
    Closed(f64),
}
use Bound::{Closed, Open};

/// `value` must be finite and within `[lo, hi]` (or open at either end);
/// the error names the option and the range.
pub fn in_range(name: &str, value: f64, lo: Bound, hi: Bound) -> Result<()> {
    let ok_lo = match lo {
        Open(l) => value > l,
        Closed(l) => value >= l,
    };
    let ok_hi = match hi {
        Open(h) => value < h,
        Closed(h) => value <= h,
    };
    if value.is_finite() && ok_lo && ok_hi {
        return Ok(());
    }
    let range = match (lo, hi) {
        (Open(l), Open(h)) if l == f64::NEG_INFINITY && h == f64::INFINITY => "a finite number".to_string(),
        (Open(l), Open(h)) if h == f64::INFINITY => format!("> {l}"),
        (Closed(l), Open(h)) if h == f64::INFINITY => format!(">= {l}"),
        _ => {
            let (open, l) = match lo {
                Open(l) => ('(', l),
                Closed(l) => ('[', l),
            };
            let (close, h) = match hi {
                Open(h) => (')', h),
                Closed(h) => (']', h),
            };
            format!("in {open}{l}, {h}{close}")
        }
    };
    Err(Error::Invalid(format!("{name} must be {range}, got {value}")))
}

pub fn positive(name: &str, value: f64) -> Result<()> {
    in_range(name, value, Open(0.0), Open(f64::INFINITY))
}

pub fn non_negative(name: &str, value: f64) -> Result<()> {
    in_range(name, value, Closed(0.0), Open(f64::INFINITY))
}

pub fn finite(name: &str, value: f64) -> Result<()> {
    in_range(name, value, Open(f64::NEG_INFINITY), Open(f64::INFINITY))
}

/// A resolved configuration as TOML, as the commands print and save it.
pub fn to_toml<T: serde::Serialize>(cfg: &T) -> String {
    toml::to_string_pretty(cfg).unwrap_or_else(|e| format!("# cannot serialise config: {e}\n"))
}

/// A configuration from a TOML file (`prepare`d, e.g. renaming keys) with
/// `overrides` (dotted path, value) applied in order; unknown keys are
/// errors naming their path. Every command that trains loads its options so.
pub fn load_toml<T: serde::de::DeserializeOwned>(
    file: Option<&Path>,
    overrides: &[(String, toml::Value)],
    prepare: fn(&mut toml::Table, &Path) -> Result<()>,
) -> Result<T> {
    let mut table = match file {
        Some(path) => {
            let text = crate::error::read_to_string(path)?;
            let mut table = text.parse::<toml::Table>().map_err(|e| Error::bad_config(path, e.to_string()))?;
            prepare(&mut table, path)?;
            table
        }
        None => toml::Table::new(),
    };
    for (key, value) in overrides {
        set_path(&mut table, key, value.clone())?;
    }
    let source = file.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("command line"));
    from_table(table, &source)
}

fn from_table<T: serde::de::DeserializeOwned>(table: toml::Table, source: &Path) -> Result<T> {
    serde_path_to_error::deserialize(toml::Value::Table(table))
        .map_err(|e| Error::bad_config(source, format!("{}: {}", e.path(), e.inner())))
}

/// Sets `a.b.c = value` in a TOML table, creating tables on the way.
fn set_path(table: &mut toml::Table, key: &str, value: toml::Value) -> Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    let (last, sections) = parts.split_last().ok_or_else(|| Error::Invalid(format!("empty key in --set {key}")))?;
    let mut here = table;
    for part in sections {
        let entry = here.entry(part.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        here = entry.as_table_mut().ok_or_else(|| Error::Invalid(format!("--set {key}: `{part}` is not a section")))?;
    }
    here.insert(last.to_string(), value);
    Ok(())
}

/// Parses the value of `--set key=value`: TOML syntax (numbers, booleans,
/// quoted strings, arrays), falling back to a bare string.
pub fn parse_set(arg: &str) -> Result<(String, toml::Value)> {
    let (key, raw) =
        arg.split_once('=').ok_or_else(|| Error::Invalid(format!("--set expects section.key=value, got `{arg}`")))?;
    let value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    Ok((key.trim().to_string(), value))
}

/// TRL 1.x's names of settings that rloo keeps under TRL 0.x's: (section,
/// TRL 1.x name, key). Both are accepted in files and in `--set`.
const TRL_NAMES: &[(&str, &str, &str)] = &[
    ("rloo", "num_generations", "k"),
    ("rloo", "beta", "kl_coef"),
    ("rloo", "num_iterations", "num_ppo_epochs"),
    ("rloo", "epsilon", "cliprange"),
    ("rloo", "epsilon_high", "cliprange_high"),
    ("rloo", "normalize_advantages", "normalize_advantage"),
    ("generation", "max_completion_length", "response_length"),
];

/// `section.key` with a TRL 1.x key replaced by rloo's.
fn canonical_key(path: &str) -> String {
    TRL_NAMES
        .iter()
        .find(|(section, name, _)| path.strip_prefix(section).and_then(|r| r.strip_prefix('.')) == Some(name))
        .map_or_else(|| path.to_string(), |(section, _, key)| format!("{section}.{key}"))
}

/// Renames a file's TRL 1.x keys to rloo's; one setting under both names is
/// an error naming both.
fn rename_trl_names(table: &mut toml::Table, path: &Path) -> Result<()> {
    for (section, name, key) in TRL_NAMES {
        let Some(toml::Value::Table(t)) = table.get_mut(*section) else { continue };
        let Some(value) = t.remove(*name) else { continue };
        if t.contains_key(*key) {
            return Err(Error::bad_config(
                path,
                format!("[{section}] sets both `{key}` and `{name}`, two names of one setting: give one"),
            ));
        }
        t.insert(key.to_string(), value);
    }
    Ok(())
}

/// The rollout batch in completions, and how it was reached. TRL 0.x sizes
/// it in optimizer steps (`num_mini_batches` mini-batches of
/// per_device_train_batch_size x gradient_accumulation_steps); TRL 1.x in
/// micro-batches (`steps_per_generation`, by default
/// gradient_accumulation_steps: one optimizer step) or in completions
/// (`generation_batch_size`). Either way it must split into whole optimizer steps.
fn rollout_batch(cfg: &TrainConfig, micro: usize, mini: usize) -> Result<(usize, String)> {
    let r = &cfg.rloo;
    let ga = cfg.train.gradient_accumulation_steps;
    let (batch, how) = match (r.steps_per_generation, r.generation_batch_size) {
        (Some(_), Some(_)) => {
            return Err(Error::Invalid(
                "rloo.steps_per_generation and rloo.generation_batch_size both size the rollout batch: give one".into(),
            ))
        }
        (None, None) => {
            let how = format!(
                "per_device_train_batch_size {micro} x gradient_accumulation_steps {ga} x num_mini_batches {}",
                r.num_mini_batches
            );
            return Ok((mini * r.num_mini_batches, how));
        }
        (Some(steps), None) => {
            (micro * steps, format!("per_device_train_batch_size {micro} x steps_per_generation {steps}"))
        }
        (None, Some(n)) => (n, format!("generation_batch_size {n}")),
    };
    if r.num_mini_batches != 1 {
        return Err(Error::Invalid(format!(
            "rloo.num_mini_batches = {} (TRL 0.x) and {} (TRL 1.x) both size the rollout batch: give one",
            r.num_mini_batches,
            if r.steps_per_generation.is_some() { "rloo.steps_per_generation" } else { "rloo.generation_batch_size" }
        )));
    }
    if batch == 0 || batch % mini != 0 {
        return Err(Error::Invalid(format!(
            "the rollout batch of {batch} completions ({how}) is not a whole number of optimizer steps of \
             per_device_train_batch_size {micro} x gradient_accumulation_steps {ga} = {mini} completions"
        )));
    }
    Ok((batch, how))
}

/// TRL's batch arithmetic, resolved once:
/// completions per rollout = per_device_train_batch_size x
/// gradient_accumulation_steps x num_mini_batches, made of
/// `batch / k` prompts; each optimizer step sees one mini-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSizes {
    pub micro: usize,
    pub mini: usize,
    pub batch: usize,
    pub prompts_per_batch: usize,
    pub k: usize,
    pub total_episodes: usize,
    /// Rollout steps (batches).
    pub steps: usize,
    /// Optimizer steps over the run.
    pub optimizer_steps: usize,
}

impl BatchSizes {
    /// `num_prompts` (the dataset size) sets the default total_episodes.
    pub fn new(cfg: &TrainConfig, num_prompts: Option<usize>) -> Result<Self> {
        let t = &cfg.train;
        let k = cfg.rloo.k;
        let micro = t.per_device_train_batch_size;
        let mini = micro * t.gradient_accumulation_steps;
        let (batch, how) = rollout_batch(cfg, micro, mini)?;
        if batch % k != 0 {
            return Err(Error::Invalid(format!(
                "the rollout batch of {batch} completions ({how}) is not a multiple of rloo_k = {k}"
            )));
        }
        let optimizer_steps_per_batch = cfg.rloo.num_ppo_epochs * (batch / mini);
        let total_episodes = match (t.total_episodes, t.max_steps, num_prompts) {
            (Some(_), Some(_), _) => {
                return Err(Error::Invalid(
                    "train.total_episodes and train.max_steps both set the run's length: give one".into(),
                ))
            }
            (Some(n), None, _) => n,
            (None, Some(steps), _) => steps.div_ceil(optimizer_steps_per_batch.max(1)) * batch,
            (None, None, Some(p)) => (t.num_train_epochs * (p * k) as f64).round() as usize,
            (None, None, None) => batch,
        };
        if total_episodes < batch {
            return Err(Error::Invalid(format!(
                "total_episodes = {total_episodes} is less than one rollout batch of {batch} completions"
            )));
        }
        let steps = total_episodes.div_ceil(batch);
        Ok(Self {
            micro,
            mini,
            batch,
            prompts_per_batch: batch / k,
            k,
            total_episodes,
            steps,
            optimizer_steps: steps * optimizer_steps_per_batch,
        })
    }

    /// TRL 1.x's names of the same sizes.
    pub fn describe_trl_1x(&self) -> String {
        format!(
            "generation_batch_size {} = per_device_train_batch_size {} x steps_per_generation {}",
            self.batch,
            self.micro,
            self.batch / self.micro
        )
    }

    pub fn describe(&self, epochs: usize) -> String {
        format!(
            "{} steps of {} completions ({} prompts x k={}), {} epoch(s) x {} mini-batch(es) of {} \
             = {} micro-batch(es) of {}; {} optimizer steps, {} episodes",
            self.steps,
            self.batch,
            self.prompts_per_batch,
            self.k,
            epochs,
            self.batch / self.mini,
            self.mini,
            self.mini / self.micro,
            self.micro,
            self.optimizer_steps,
            self.total_episodes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(overrides: &[&str]) -> Result<TrainConfig> {
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
    fn batch_arithmetic_is_trls() {
        let c = with(&[
            "train.per_device_train_batch_size=4",
            "train.gradient_accumulation_steps=2",
            "rloo.num_mini_batches=2",
            "rloo.k=4",
            "rloo.num_ppo_epochs=1",
        ])
        .unwrap();
        let b = BatchSizes::new(&c, Some(100)).unwrap();
        assert_eq!((b.micro, b.mini, b.batch, b.prompts_per_batch), (4, 8, 16, 4));
        assert_eq!(b.total_episodes, 400);
        assert_eq!(b.steps, 25);
        assert_eq!(b.optimizer_steps, 50);
        let c = with(&["rloo.k=3"]).unwrap();
        let err = BatchSizes::new(&c, Some(10)).unwrap_err().to_string();
        assert!(err.contains("not a multiple of rloo_k = 3"), "{err}");
    }

    /// TRL 1.x sizes the same rollout in micro-batches or completions: 4
    /// completions a micro-batch, 2 per optimizer step, 4 micro-batches =
    /// 16 completions = TRL 0.x's 2 mini-batches.
    #[test]
    fn trl_1x_batch_arithmetic_gives_the_same_rollouts() {
        let base = ["train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=2", "rloo.k=4"];
        let sizes = |extra: &str| BatchSizes::new(&with(&[&base[..], &[extra]].concat()).unwrap(), Some(100));
        let old = sizes("rloo.num_mini_batches=2").unwrap();
        assert_eq!(sizes("rloo.steps_per_generation=4").unwrap(), old);
        assert_eq!(sizes("rloo.generation_batch_size=16").unwrap(), old);
        assert_eq!(
            old.describe_trl_1x(),
            "generation_batch_size 16 = per_device_train_batch_size 4 x steps_per_generation 4"
        );
        // TRL 1.x's default, steps_per_generation = gradient_accumulation_steps, is 0.x's one mini-batch.
        assert_eq!(sizes("rloo.steps_per_generation=2").unwrap(), sizes("rloo.num_mini_batches=1").unwrap());
        let err = sizes("rloo.steps_per_generation=3").unwrap_err().to_string();
        assert!(err.contains("12 completions (per_device_train_batch_size 4 x steps_per_generation 3) is not a whole number of optimizer steps"), "{err}");
        let both = with(&[&base[..], &["rloo.steps_per_generation=4", "rloo.num_mini_batches=2"]].concat()).unwrap();
        let err = BatchSizes::new(&both, None).unwrap_err().to_string();
        assert!(err.contains("rloo.num_mini_batches = 2 (TRL 0.x) and rloo.steps_per_generation (TRL 1.x)"), "{err}");
        // max_steps counts optimizer steps: 2 per rollout, so 5 take 3 rollouts.
        let c = with(
            &[&base[..], &["train.max_steps=5", "rloo.generation_batch_size=16", "rloo.num_ppo_epochs=1"]].concat(),
        );
        let b = BatchSizes::new(&c.unwrap(), Some(100)).unwrap();
        assert_eq!((b.steps, b.optimizer_steps, b.total_episodes), (3, 6, 48));
        let both = with(&[&base[..], &["train.max_steps=5", "train.total_episodes=64"]].concat()).unwrap();
        assert!(BatchSizes::new(&both, None).unwrap_err().to_string().contains("give one"));
        let both =
            with(&[&base[..], &["rloo.steps_per_generation=4", "rloo.generation_batch_size=16"]].concat()).unwrap();
        assert!(BatchSizes::new(&both, None).unwrap_err().to_string().contains("give one"));
    }

    #[test]
    fn resume_accepts_reporting_changes_and_refuses_the_rest() {
        let saved = with(&["rloo.k=4", "data.path=a.jsonl", "train.save_steps=10"]).unwrap();
        let now = with(&["rloo.k=4", "data.path=a.jsonl", "train.save_steps=5", "train.resume_from_checkpoint=latest"])
            .unwrap();
        assert_eq!(
            now.changes_since(&saved).unwrap(),
            ["train.resume_from_checkpoint: unset -> \"latest\"", "train.save_steps: 10 -> 5"]
        );
        let now = with(&["rloo.k=2", "data.path=b.jsonl", "train.seed=7", "train.learning_rate=1e-3"]).unwrap();
        let refused = now.changes_since(&saved).unwrap_err();
        assert_eq!(
            refused,
            [
                "data.path: \"a.jsonl\" -> \"b.jsonl\"",
                "rloo.k: 4 -> 2",
                "train.learning_rate: 0.000003 -> 0.001",
                "train.seed: 42 -> 7"
            ]
        );
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
