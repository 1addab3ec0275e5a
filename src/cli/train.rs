//! `rloo train`: the RLOO (or PPO) trainer. Options come from a TOML file, then
//! `--set section.key=value`, then the flags below (TRL's RLOO script flags
//! plus one per remaining config key); later ones win.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Arg, ArgAction, ArgMatches, Command};

use rloo::reward::config::ModelSpec;
use rloo::reward::RewardSpec;
use rloo::train::config::{parse_set, TrainConfig};
use rloo::train::memory;

/// How a flag's text becomes a TOML value.
#[derive(Clone, Copy)]
enum Kind {
    Str,
    Int,
    Float,
    Bool,
    /// One or more words, as a TOML array of strings.
    Words,
    /// A switch (`--bf16`, `--bf16 false`) that sets the key to its first
    /// string when on and its second when off.
    Switch(&'static str, &'static str),
}

/// (flag, config key, kind, help). The help's default is read from
/// `TrainConfig::default()`, so `--help` cannot drift from the code.
const FLAGS: &[(&str, &str, Kind, &str)] = &[
    // TRL's RLOO script.
    ("model_name_or_path", "model.policy", Kind::Str, "Policy and tokenizer: a model directory or a cached hub id (the tokenizer only, when --sft_model_path is given)"),
    ("sft_model_path", "model.policy", Kind::Str, "The policy (and KL reference) to start from"),
    ("reward_model_path", "", Kind::Str, "A sequence-classification reward model, added as a [[reward]] of type \"model\" with weight 1"),
    ("dataset_name", "data.path", Kind::Str, "Prompts: a dataset file (JSONL, JSON, CSV, Parquet, Arrow; .gz/.zst), directory, datasets save or cached hub id"),
    ("dataset_config", "data.config", Kind::Str, "The dataset configuration (sub-directory), e.g. preference"),
    ("dataset_train_split", "data.split", Kind::Str, "The split read from a dataset directory or hub dataset"),
    ("dataset_filter", "data.filter", Kind::Str, "Keep rows this expression accepts, e.g. 'language == \"english\" and len(context) <= 4'"),
    ("output_dir", "train.output_dir", Kind::Str, "Where checkpoints, the final model, metrics and samples go"),
    ("learning_rate", "train.learning_rate", Kind::Float, "AdamW learning rate"),
    ("per_device_train_batch_size", "train.per_device_train_batch_size", Kind::Int, "Completions per micro-batch (one forward/backward)"),
    ("gradient_accumulation_steps", "train.gradient_accumulation_steps", Kind::Int, "Micro-batches per optimizer step"),
    ("total_episodes", "train.total_episodes", Kind::Int, "Completions to train on [none: num_train_epochs x prompts x k]"),
    ("num_ppo_epochs", "rloo.num_ppo_epochs", Kind::Int, "Optimisation passes over each rollout batch"),
    ("num_mini_batches", "rloo.num_mini_batches", Kind::Int, "Mini-batches (optimizer steps) per pass; rollout batch = per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches"),
    ("rloo_k", "rloo.k", Kind::Int, "Completions sampled per prompt (k >= 2; PPO: k >= 1)"),
    ("kl_coef", "rloo.kl_coef", Kind::Float, "KL coefficient beta (0: no reference model)"),
    ("cliprange", "rloo.cliprange", Kind::Float, "Clip range epsilon of the policy ratio"),
    ("response_length", "generation.response_length", Kind::Int, "Most new tokens per completion"),
    ("temperature", "generation.temperature", Kind::Float, "Sampling temperature (log-probs use the same)"),
    ("missing_eos_penalty", "rloo.missing_eos_penalty", Kind::Float, "Subtracted from the score of completions with no EOS"),
    ("stop_token", "generation.stop_token", Kind::Str, "\"eos\": completions end at EOS; \"none\": always response_length tokens"),
    ("local_rollout_forward_batch_size", "generation.local_rollout_forward_batch_size", Kind::Int, "Rows per forward pass when sampling and computing log-probs"),
    ("seed", "train.seed", Kind::Int, "Seed of sampling, shuffling and mini-batch order"),
    // TRL's PPO script.
    ("algo", "train.algo", Kind::Str, "rloo, or ppo (a critic, GAE and a clipped value loss)"),
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
    ("mask_truncated_completions", "rloo.mask_truncated_completions", Kind::Bool, "Completions that hit the length limit without EOS take no part in the loss or the KL"),
    // TRL's model flags for PEFT.
    ("use_peft", "peft.use_peft", Kind::Bool, "Train LoRA adapters (PEFT format) instead of the whole policy; the KL reference is the policy without them"),
    ("lora_r", "peft.lora_r", Kind::Int, "LoRA rank"),
    ("lora_alpha", "peft.lora_alpha", Kind::Float, "LoRA alpha (adapters scaled by alpha / r)"),
    ("lora_dropout", "peft.lora_dropout", Kind::Float, "LoRA dropout, saved in the adapter (off in online training, as in TRL)"),
    ("lora_target_modules", "peft.lora_target_modules", Kind::Words, "Modules that get adapters, e.g. q_proj v_proj, or all-linear [none: PEFT's default for the architecture]"),
    // Every other key.
    ("reference_model_path", "model.reference", Kind::Str, "KL reference model [none: the initial policy]"),
    ("device", "model.device", Kind::Str, "cpu, cuda, cuda:N or auto"),
    ("gradient_checkpointing", "train.gradient_checkpointing", Kind::Bool, "Keep only each layer's input in the forward pass and recompute the layer in the backward: less activation memory for one more forward"),
    ("bf16", "train.dtype", Kind::Switch("bf16", "f32"), "bf16 mixed precision: bf16 weights and activations, f32 master weights, optimizer state, log-softmax and losses"),
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
    ("num_train_epochs", "train.num_train_epochs", Kind::Float, "Passes over the prompts when total_episodes is not set"),
    ("lr_scheduler_type", "train.lr_scheduler_type", Kind::Str, "constant, linear or cosine"),
    ("warmup_steps", "train.warmup_steps", Kind::Int, "Warm-up optimizer steps"),
    ("warmup_ratio", "train.warmup_ratio", Kind::Float, "Warm-up as a fraction of optimizer steps"),
    ("weight_decay", "train.weight_decay", Kind::Float, "AdamW weight decay (not on biases and norms)"),
    ("adam_beta1", "train.adam_beta1", Kind::Float, "AdamW beta1"),
    ("adam_beta2", "train.adam_beta2", Kind::Float, "AdamW beta2"),
    ("adam_epsilon", "train.adam_epsilon", Kind::Float, "AdamW epsilon"),
    ("max_grad_norm", "train.max_grad_norm", Kind::Float, "Clip gradients to this global norm (0: off)"),
    ("logging_steps", "train.logging_steps", Kind::Int, "Log metrics every N steps"),
    ("report_to", "train.report_to", Kind::Words, "Where metrics go besides metrics.jsonl: tensorboard or none"),
    ("save_steps", "train.save_steps", Kind::Int, "Checkpoint every N steps (0: only at the end)"),
    ("save_total_limit", "train.save_total_limit", Kind::Int, "Keep at most N checkpoints (0: all)"),
    ("num_sample_generations", "train.num_sample_generations", Kind::Int, "Sample tables printed over the run"),
    ("resume_from_checkpoint", "train.resume_from_checkpoint", Kind::Str, "Checkpoint directory, or \"latest\" in output_dir"),
    ("stop_after", "train.stop_after", Kind::Int, "Stop (with a checkpoint) after N rollout steps of this invocation, to continue later with --resume_from_checkpoint"),
    ("overwrite_output_dir", "train.overwrite_output_dir", Kind::Bool, "Replace the checkpoints and logs of a previous run in output_dir (refused without it, unless resuming)"),
    ("max_skipped_steps", "train.max_skipped_steps", Kind::Int, "Stop (with a checkpoint of the last good weights) after N optimizer steps in a row skipped for a non-finite loss or gradient or a rollout with no scorable sample"),
];

/// Train a policy with REINFORCE Leave-One-Out (or PPO).
#[derive(Debug)]
pub struct TrainArgs {
    config: Option<PathBuf>,
    overrides: Vec<(String, toml::Value)>,
    /// Added to the config's rewards, not replacing them.
    reward_model_path: Option<String>,
    print_config: bool,
}

fn default_of(key: &str) -> String {
    let defaults = toml::Value::try_from(TrainConfig::default()).ok();
    let mut here = defaults.as_ref();
    for part in key.split('.') {
        here = here.and_then(|v| v.get(part));
    }
    match here {
        Some(toml::Value::String(s)) => format!("{s:?}"),
        Some(v) => v.to_string(),
        None => "none".into(),
    }
}

impl clap::Args for TrainArgs {
    fn augment_args(cmd: Command) -> Command {
        let mut cmd = cmd
            .arg(
                Arg::new("config")
                    .value_name("CONFIG.toml")
                    .value_parser(clap::value_parser!(PathBuf))
                    .help("TOML configuration file"),
            )
            .arg(
                Arg::new("set")
                    .long("set")
                    .value_name("SECTION.KEY=VALUE")
                    .action(ArgAction::Append)
                    .help("Override a config key (TOML value), e.g. --set rloo.k=4"),
            )
            .arg(
                Arg::new("print_config")
                    .long("print_config")
                    .alias("print-config")
                    .action(ArgAction::SetTrue)
                    .help("Print the resolved configuration and exit"),
            );
        for (flag, key, kind, help) in FLAGS {
            let default = if key.is_empty() { "none".to_string() } else { default_of(key) };
            let mut arg = Arg::new(*flag)
                .long(*flag)
                .alias(flag.replace('_', "-"))
                .value_name(match kind {
                    Kind::Str => "TEXT",
                    Kind::Int => "N",
                    Kind::Float => "X",
                    Kind::Bool | Kind::Switch(..) => "BOOL",
                    Kind::Words => "NAME",
                })
                .help(format!("{help} [default: {default}]"))
                .help_heading(if key.starts_with("model") || key.is_empty() { "Model" } else { section_heading(key) });
            match kind {
                Kind::Bool | Kind::Switch(..) => {
                    arg = arg.num_args(0..=1).default_missing_value("true").value_parser(clap::value_parser!(bool))
                }
                Kind::Words => arg = arg.num_args(1..),
                _ => {}
            }
            cmd = cmd.arg(arg);
        }
        cmd
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

fn section_heading(key: &str) -> &'static str {
    match key.split('.').next() {
        Some("data") => "Data",
        Some("generation") => "Generation",
        Some("rloo") => "RLOO",
        Some("ppo") => "PPO",
        Some("peft") => "PEFT",
        _ => "Training",
    }
}

impl clap::FromArgMatches for TrainArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut overrides = Vec::new();
        for set in m.get_many::<String>("set").into_iter().flatten() {
            overrides.push(
                parse_set(set).map_err(|e| clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!("{e}\n")))?,
            );
        }
        let given =
            |flag: &str| m.contains_id(flag) && m.value_source(flag) == Some(clap::parser::ValueSource::CommandLine);
        // Which flag set each key: two names of one setting are an error.
        let mut set_by: Vec<(&str, &str)> = Vec::new();
        for (flag, key, kind, _) in FLAGS {
            if !given(flag) || key.is_empty() {
                continue;
            }
            let value = match kind {
                Kind::Bool => toml::Value::Boolean(*m.get_one::<bool>(flag).unwrap_or(&true)),
                Kind::Switch(on, off) => {
                    toml::Value::String(if *m.get_one::<bool>(flag).unwrap_or(&true) { on } else { off }.to_string())
                }
                Kind::Words => toml::Value::Array(
                    m.get_many::<String>(flag).into_iter().flatten().map(|w| toml::Value::String(w.clone())).collect(),
                ),
                _ => {
                    let text = m.get_one::<String>(flag).cloned().unwrap_or_default();
                    typed(flag, &text, *kind)?
                }
            };
            // With --sft_model_path, --model_name_or_path names only the tokenizer (as in TRL).
            let key = if *flag == "model_name_or_path" && given("sft_model_path") { "model.tokenizer" } else { key };
            if let Some((other, _)) = set_by.iter().find(|(_, k)| *k == key) {
                return Err(clap::Error::raw(
                    clap::error::ErrorKind::ArgumentConflict,
                    format!("--{other} and --{flag} are two names of one setting ({key}): give one\n"),
                ));
            }
            set_by.push((flag, key));
            overrides.push((key.to_string(), value));
        }
        Ok(Self {
            config: m.get_one::<PathBuf>("config").cloned(),
            overrides,
            reward_model_path: m.get_one::<String>("reward_model_path").cloned(),
            print_config: m.get_flag("print_config"),
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

fn typed(flag: &str, text: &str, kind: Kind) -> Result<toml::Value, clap::Error> {
    let bad = |what: &str| {
        clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!("--{flag}: expected {what}, got `{text}`\n"))
    };
    Ok(match kind {
        Kind::Int => toml::Value::Integer(text.parse().map_err(|_| bad("an integer"))?),
        Kind::Float => toml::Value::Float(text.parse().map_err(|_| bad("a number"))?),
        Kind::Str | Kind::Bool | Kind::Words | Kind::Switch(..) => toml::Value::String(text.to_string()),
    })
}

pub fn run(args: TrainArgs) -> Result<()> {
    let mut cfg = TrainConfig::load(args.config.as_deref(), &args.overrides)?;
    if let Some(path) = &args.reward_model_path {
        cfg.reward.push(RewardSpec::Model(ModelSpec { name: None, weight: 1.0, path: path.clone(), batch_size: 8 }));
    }
    if args.print_config {
        cfg.validate()?;
        print!("{}", cfg.to_toml());
        return Ok(());
    }
    let summary = rloo::train::rl::train(&cfg).context("training failed")?;
    eprintln!("trained {} steps ({} episodes) -> {}", summary.steps, summary.episodes, summary.output_dir.display());
    let t = &summary.timing;
    let which = if t.after_first { ", after the first" } else { "" };
    eprintln!("time {} (mean of {} steps{which})", t.describe(), t.steps);
    if let (plan, Some(peak)) = summary.memory {
        let plan = plan.map_or(String::new(), |p| format!(" (planned at start-up: {})", memory::gib(p)));
        eprintln!("peak memory {}{plan}", memory::gib(peak));
    }
    if let Some(device) = summary.device_memory {
        eprintln!("{}", device.describe());
    }
    Ok(())
}
