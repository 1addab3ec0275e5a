//! `rloo train`: the RLOO (or PPO) trainer. Options come from a TOML file, then
//! `--set section.key=value`, then the flags below (TRL's RLOO script flags,
//! TRL 1.x's names, and one per remaining config key); later ones win.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{ArgMatches, Command};

use rloo::reward::config::{reward_funcs, ModelSpec};
use rloo::reward::RewardSpec;
use rloo::train::config::TrainConfig;
use rloo::train::rl::algorithm::REGISTRY;

use super::config_flags::{self, config_file, given, switch, text, usage, words, Flag, Flags, Kind};

/// The flags of `rloo train` beside the shared groups of [`config_flags`].
const FLAGS: &[Flag] = &[
    // TRL's RLOO script.
    ("model_name_or_path", "model.policy", Kind::Str, "Policy and tokenizer: a model directory or a cached hub id (the tokenizer only, when --sft_model_path is given)"),
    ("sft_model_path", "model.policy", Kind::Str, "The policy (and KL reference) to start from"),
    ("reward_model_path", "", Kind::Str, "A sequence-classification reward model, added as a [[reward]] of type \"model\" with weight 1"),
    ("dataset_name", "data.path", Kind::Str, "Prompts: a dataset file (JSONL, JSON, CSV, Parquet, Arrow; .gz/.zst), directory, datasets save or cached hub id"),
    ("dataset_config", "data.config", Kind::Str, "The dataset configuration (sub-directory), e.g. preference"),
    ("dataset_train_split", "data.split", Kind::Str, "The split read from a dataset directory or hub dataset"),
    ("dataset_test_split", "eval.split", Kind::Str, "Held-out prompts: this split (of --eval_dataset when given, else of --dataset_name), evaluated during training [default: none]"),
    ("eval_dataset", "eval.dataset", Kind::Str, "Held-out prompts from another dataset [split: --dataset_test_split, else test] [default: none]"),
    ("eval_strategy", "eval.strategy", Kind::Str, "\"steps\" (every --eval_steps) or \"no\" [default: steps with held-out prompts, else no]"),
    ("eval_steps", "eval.steps", Kind::Int, "Evaluate every N rollout steps, and after the last [default: total steps / num_sample_generations]"),
    ("eval_take", "eval.take", Kind::Int, "Use only the first N held-out prompts [default: all]"),
    ("dataset_filter", "data.filter", Kind::Str, "Keep rows this expression accepts, e.g. 'language == \"english\" and len(context) <= 4'"),
    ("total_episodes", "train.total_episodes", Kind::Int, "Completions to train on [none: num_train_epochs x prompts x k]"),
    ("max_steps", "train.max_steps", Kind::Int, "Optimizer steps to train for, rounded up to whole rollout batches (instead of --total_episodes)"),
    ("num_ppo_epochs", "rloo.num_ppo_epochs", Kind::Int, "Optimisation passes over each rollout batch"),
    ("num_mini_batches", "rloo.num_mini_batches", Kind::Int, "Mini-batches (optimizer steps) per pass; rollout batch = per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches"),
    ("rloo_k", "rloo.k", Kind::Int, "Completions sampled per prompt (k >= 2 for the group baselines; PPO and REINFORCE++: k >= 1)"),
    ("kl_coef", "rloo.kl_coef", Kind::Float, "KL coefficient beta (0: no reference model)"),
    ("cliprange", "rloo.cliprange", Kind::Float, "Clip range epsilon of the policy ratio"),
    ("response_length", "generation.response_length", Kind::Int, "Most new tokens per completion"),
    ("temperature", "generation.temperature", Kind::Float, "Sampling temperature (log-probs use the same)"),
    ("missing_eos_penalty", "rloo.missing_eos_penalty", Kind::Float, "Subtracted from the score of completions with no EOS"),
    ("stop_token", "generation.stop_token", Kind::Str, "\"eos\": completions end at EOS; \"none\": always response_length tokens"),
    ("local_rollout_forward_batch_size", "generation.local_rollout_forward_batch_size", Kind::Int, "Rows per forward pass when sampling and computing log-probs"),
    // TRL's PPO script.
    ("algo", "train.algo", Kind::Str, "The algorithm (its list is the registry's: see algorithm_help)"),
    ("advantage_estimator", "train.algo", Kind::Str, "OpenRLHF's name of --algo"),
    ("adv_estimator", "train.algo", Kind::Str, "verl's name of --algo (gae: ppo)"),
    ("scale_rewards", "rloo.scale_rewards", Kind::Str, "GRPO: what centred returns are divided by: the std of the prompt's (group), of the batch's (batch), or nothing (none)"),
    ("value_model_path", "ppo.value_model", Kind::Str, "PPO's critic: a sequence-classification model, \"reward\" or \"policy\" [none: the reward model if there is one, else the policy]"),
    ("vf_coef", "ppo.vf_coef", Kind::Float, "PPO: weight of the value loss"),
    ("cliprange_value", "ppo.cliprange_value", Kind::Float, "PPO: clip range of predicted values"),
    ("gamma", "ppo.gamma", Kind::Float, "PPO: discount"),
    ("lam", "ppo.lam", Kind::Float, "PPO: GAE lambda"),
    ("whiten_rewards", "ppo.whiten_rewards", Kind::Bool, "PPO: whiten per-token rewards before GAE"),
    ("critic_learning_rate", "ppo.critic_learning_rate", Kind::Float, "PPO: the critic's learning rate [none: learning_rate]"),
    ("init_kl_coeff", "rloo.kl_coef", Kind::Float, "The same as --kl_coef"),
    // TRL 1.x's RLOOConfig names.
    ("num_generations", "rloo.k", Kind::Int, "TRL 1.x's name of --rloo_k"),
    ("beta", "rloo.kl_coef", Kind::Float, "TRL 1.x's name of --kl_coef"),
    ("max_completion_length", "generation.response_length", Kind::Int, "TRL 1.x's name of --response_length"),
    ("num_iterations", "rloo.num_ppo_epochs", Kind::Int, "TRL 1.x's name of --num_ppo_epochs"),
    ("epsilon", "rloo.cliprange", Kind::Float, "TRL 1.x's name of --cliprange (the lower clip range)"),
    ("epsilon_high", "rloo.cliprange_high", Kind::Float, "Upper clip range: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"),
    ("normalize_advantages", "rloo.normalize_advantage", Kind::Bool, "TRL 1.x's name of --normalize_advantage"),
    ("steps_per_generation", "rloo.steps_per_generation", Kind::Int, "TRL 1.x: micro-batches per rollout batch, which is per_device_train_batch_size x steps_per_generation completions (instead of --num_mini_batches) [none: gradient_accumulation_steps]"),
    ("generation_batch_size", "rloo.generation_batch_size", Kind::Int, "TRL 1.x: completions per rollout batch (instead of --num_mini_batches or --steps_per_generation)"),
    ("mask_truncated_completions", "rloo.mask_truncated_completions", Kind::Bool, "Completions that hit the length limit without EOS take no part in the loss or the KL"),
    ("ref_reward_offload", "rloo.ref_reward_offload", Kind::Bool, "Move the reference and reward models to host memory while the policy trains, and back while it samples (OpenRLHF's name): their GPU memory is free for training"),
    ("reward_funcs", "", Kind::Words, "TRL 1.x: rewards added as [[reward]] tables, each a reward model (directory or cached hub id) or a built-in rule: length, exact_match (last number against the `answer` column)"),
    ("reward_weights", "", Kind::Words, "TRL 1.x: one weight per --reward_funcs entry [default: 1 each]"),
    ("fp16", "", Kind::Bool, "Refused: fp16 training needs loss scaling, which rloo does not do; use --bf16"),
    // Every other key.
    ("reference_model_path", "model.reference", Kind::Str, "KL reference model [none: the initial policy]"),
    ("prompt_column", "data.prompt_column", Kind::Str, "Column holding the prompt (string or chat messages)"),
    ("prompt_template", "data.template", Kind::Str, "Build prompts from columns instead, e.g. \"Summarize: {post}\""),
    ("chat", "data.chat", Kind::Bool, "Send text prompts as a user chat message (with the chat template)"),
    ("system_prompt", "data.system_prompt", Kind::Str, "System message put before chat prompts that have none"),
    ("take", "data.take", Kind::Int, "Use only the first N dataset rows"),
    ("shuffle", "data.shuffle", Kind::Bool, "Shuffle prompts every epoch"),
    ("max_prompt_length", "data.max_prompt_length", Kind::Int, "Longest prompt in tokens"),
    ("long_prompts", "data.long_prompts", Kind::Str, "skip or error for prompts over max_prompt_length"),
    ("filter_length", "data.filter_length", Kind::Bool, "Drop prompts longer than 0.9 x response_length tokens"),
    ("top_k", "generation.top_k", Kind::Int, "Top-k sampling (0: off)"),
    ("top_p", "generation.top_p", Kind::Float, "Nucleus sampling (1: off)"),
    ("min_p", "generation.min_p", Kind::Float, "Min-p sampling (0: off)"),
    ("repetition_penalty", "generation.repetition_penalty", Kind::Float, "transformers' repetition penalty when sampling (1: off; the old log-probs are then recomputed)"),
    ("stop_token_id", "generation.stop_token_id", Kind::Int, "An extra token id that ends completions"),
    ("kl_estimator", "rloo.kl_estimator", Kind::Str, "k1 (d), k2 (d^2/2) or k3 (exp(-d) - 1 + d)"),
    ("kl_placement", "rloo.kl_placement", Kind::Str, "reward (R = s - beta KL) or loss (beta KL added to the loss)"),
    ("baseline", "rloo.baseline", Kind::Str, "leave_one_out, group_mean, batch_mean or none"),
    ("ratio", "rloo.ratio", Kind::Str, "sequence or token importance ratio"),
    ("aggregation", "rloo.aggregation", Kind::Str, "sequence_mean or token_mean (token ratio only)"),
    ("normalize_advantage", "rloo.normalize_advantage", Kind::Bool, "Whiten advantages over the rollout batch"),
    ("normalize_reward", "rloo.normalize_reward", Kind::Bool, "Z-score scores over the rollout batch"),
    ("reward_clip_range", "rloo.reward_clip_range", Kind::Float, "Clip scores to [-r, r]"),
    ("recompute_old_logprobs", "rloo.recompute_old_logprobs", Kind::Bool, "Recompute the sampling policy's log-probs with a forward pass instead of keeping the sampler's"),
    ("report_to", "train.report_to", Kind::Words, "Where metrics go besides metrics.jsonl: tensorboard or none"),
    ("num_sample_generations", "train.num_sample_generations", Kind::Int, "Sample tables printed over the run"),
    ("num_completions_to_print", "train.num_completions_to_print", Kind::Int, "Rows of each printed sample table (one completion per prompt; samples.jsonl keeps them all)"),
];

/// Train a policy with REINFORCE Leave-One-Out (or PPO).
#[derive(Debug)]
pub struct TrainArgs {
    config: Option<PathBuf>,
    overrides: Vec<(String, toml::Value)>,
    /// Added to the config's rewards, not replacing them.
    reward_model_path: Option<String>,
    /// TRL 1.x's `reward_funcs` and `reward_weights`, added the same way.
    reward_funcs: Vec<String>,
    reward_weights: Option<Vec<f32>>,
    print_config: bool,
}

/// Every flag of `rloo train`: its own, then the groups all trainers share.
fn flags() -> Flags {
    Flags::new()
        .with_headings(section_heading, "", FLAGS)
        .with("Model", "model.", config_flags::DEVICE)
        .with("Training", "train.", config_flags::PRECISION)
        .with("Training", "train.", config_flags::BATCH)
        .with("Training", "train.", config_flags::OPTIMIZER)
        .with("Training", "train.", config_flags::RUN)
        .with("Training", "train.", config_flags::CHECKPOINTS)
        .with("PEFT", "", config_flags::PEFT)
}

/// `--algo`'s help: every algorithm of the registry, as it has them.
fn algorithm_help() -> String {
    let names: Vec<String> = REGISTRY
        .iter()
        .map(|e| match e.aliases {
            [] => format!("{} ({})", e.name, e.about),
            aliases => format!("{} or {} ({})", e.name, aliases.join(" or "), e.about),
        })
        .collect();
    format!("The algorithm (docs/algorithm.md): {} [default: \"rloo\"]", names.join("; "))
}

impl clap::Args for TrainArgs {
    fn augment_args(cmd: Command) -> Command {
        let defaults = toml::Value::try_from(TrainConfig::default()).expect("the default config serialises");
        flags().augment(cmd, &defaults).mut_arg("algo", |a| a.help(algorithm_help()))
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

fn section_heading(key: &str) -> &'static str {
    match key.split('.').next() {
        Some("model") | Some("") => "Model",
        Some("data") => "Data",
        Some("generation") => "Generation",
        Some("rloo") => "RLOO",
        Some("ppo") => "PPO",
        Some("peft") => "PEFT",
        Some("eval") => "Evaluation",
        _ => "Training",
    }
}

impl clap::FromArgMatches for TrainArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        // With --sft_model_path, --model_name_or_path names only the tokenizer (as in TRL).
        let sft_model = given(m, "sft_model_path");
        let overrides = flags().overrides(m, |flag, key| match flag {
            "model_name_or_path" if sft_model => "model.tokenizer".into(),
            _ => key.to_string(),
        })?;
        if given(m, "fp16") && switch(m, "fp16") {
            return Err(usage(
                "--fp16: rloo computes in f32 or in bf16 mixed precision; fp16 training needs loss scaling, \
                 which rloo does not do: use --bf16"
                    .into(),
            ));
        }
        let number =
            |x: &String| x.parse::<f32>().map_err(|_| usage(format!("--reward_weights: expected numbers, got `{x}`")));
        let reward_weights = match words(m, "reward_weights") {
            w if w.is_empty() => None,
            w => Some(w.iter().map(number).collect::<Result<Vec<f32>, _>>()?),
        };
        let (config, print_config) = config_file(m);
        Ok(Self {
            config,
            overrides,
            reward_model_path: text(m, "reward_model_path"),
            reward_funcs: words(m, "reward_funcs"),
            reward_weights,
            print_config,
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

pub fn run(args: TrainArgs) -> Result<()> {
    let mut cfg = TrainConfig::load(args.config.as_deref(), &args.overrides)?;
    if let Some(path) = &args.reward_model_path {
        cfg.reward.push(RewardSpec::Model(ModelSpec { name: None, weight: 1.0, path: path.clone(), batch_size: 8 }));
    }
    if !args.reward_funcs.is_empty() || args.reward_weights.is_some() {
        cfg.reward.extend(reward_funcs(&args.reward_funcs, args.reward_weights.as_deref())?);
    }
    if args.print_config {
        cfg.validate()?;
        print!("{}", cfg.to_toml());
        return Ok(());
    }
    let summary = rloo::train::rl::train(&cfg).context("training failed")?;
    if !summary.world.is_main() {
        return Ok(());
    }
    eprintln!("trained {} steps ({} episodes) -> {}", summary.steps, summary.episodes, summary.output_dir.display());
    let t = &summary.timing;
    let which = if t.after_first { ", after the first" } else { "" };
    eprintln!("time {} (mean of {} steps{which})", t.describe(), t.steps);
    if let Some(line) = summary.memory.describe() {
        eprintln!("{line}");
    }
    if let Some(device) = summary.device_memory {
        eprintln!("{}", device.describe());
    }
    Ok(())
}
