//! The sections of `rloo train`'s configuration, with TRL's defaults.

use serde::{Deserialize, Serialize};

use super::OptimizerOptions;
use crate::algo::{Aggregation, Baseline, KlEstimator, KlPlacement, RatioLevel, ScaleRewards};
use crate::model::Precision;

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
    /// Move the reference and the reward models to host memory for the
    /// training phase and back while the policy samples (OpenRLHF's
    /// `ref_reward_offload`): their device memory is free for training.
    pub ref_reward_offload: bool,
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
            ref_reward_offload: false,
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
    /// 1: AdamW's moments split over the processes (ZeRO stage 1); 0: not.
    pub zero_stage: u8,
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
            zero_stage: 0,
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
