//! The one command-line idiom of the commands that train (`train`, `sft`,
//! `reward train`): a TOML file, then `--set key=value`, then flags; later
//! ones win. Each flag names a config key (both spellings come from
//! `cli::both_spellings`), shows the config's default in `--help`, and the
//! options they share (device, batch, schedule, optimizer, run, PEFT) are
//! defined once here.

use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};

use rloo::train::config::parse_set;

/// How a flag's text becomes a TOML value.
#[derive(Clone, Copy)]
pub enum Kind {
    Str,
    Int,
    /// A number; written as an integer when it is one, so that integer keys take it too.
    Float,
    Bool,
    /// One or more words, as a TOML array of strings.
    Words,
    /// A switch (`--bf16`, `--bf16 false`) that sets the key to its first
    /// string when on and its second when off.
    Switch(&'static str, &'static str),
}

/// (flag, config key, kind, help). An empty key: the command reads the
/// flag itself. Keys of the shared groups are relative to a section.
pub type Flag = (&'static str, &'static str, Kind, &'static str);

pub const DEVICE: &[Flag] = &[("device", "device", Kind::Str, "cpu, cuda, cuda:N or auto")];

pub const PRECISION: &[Flag] = &[
    ("bf16", "dtype", Kind::Switch("bf16", "f32"), "bf16 mixed precision: bf16 weights and activations, f32 master weights, optimizer state, log-softmax and losses"),
    ("gradient_checkpointing", "gradient_checkpointing", Kind::Bool, "Keep only each layer's input in the forward pass and recompute the layer in the backward: less activation memory for one more forward"),
    ("zero_stage", "zero_stage", Kind::Int, "1: split AdamW's moments over the processes of a data-parallel job (ZeRO stage 1), each stepping its share of the weights; 0: every process holds them all"),
];

pub const BATCH: &[Flag] = &[
    (
        "per_device_train_batch_size",
        "per_device_train_batch_size",
        Kind::Int,
        "Examples per micro-batch (one forward/backward)",
    ),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", Kind::Int, "Micro-batches per optimizer step"),
    ("num_train_epochs", "num_train_epochs", Kind::Float, "Passes over the training data"),
];

pub const OPTIMIZER: &[Flag] = &[
    ("learning_rate", "learning_rate", Kind::Float, "AdamW learning rate"),
    ("lr_scheduler_type", "lr_scheduler_type", Kind::Str, "constant, linear or cosine"),
    ("warmup_steps", "warmup_steps", Kind::Int, "Warm-up optimizer steps (0: warmup_ratio)"),
    ("warmup_ratio", "warmup_ratio", Kind::Float, "Warm-up as a fraction of optimizer steps"),
    ("weight_decay", "weight_decay", Kind::Float, "AdamW weight decay (not on biases and norms)"),
    ("adam_beta1", "adam_beta1", Kind::Float, "AdamW beta1"),
    ("adam_beta2", "adam_beta2", Kind::Float, "AdamW beta2"),
    ("adam_epsilon", "adam_epsilon", Kind::Float, "AdamW epsilon"),
    ("max_grad_norm", "max_grad_norm", Kind::Float, "Clip gradients to this global norm (0: off)"),
];

pub const RUN: &[Flag] = &[
    ("output_dir", "output_dir", Kind::Str, "Where the model, checkpoints, metrics and the resolved config go"),
    ("seed", "seed", Kind::Int, "Seed of every random choice of the run"),
    ("logging_steps", "logging_steps", Kind::Int, "Log metrics every N steps"),
    ("overwrite_output_dir", "overwrite_output_dir", Kind::Bool, "Replace the outputs of a previous run in output_dir (refused without it)"),
    ("max_skipped_steps", "max_skipped_steps", Kind::Int, "Stop (with the last good weights saved) after N optimizer steps in a row skipped for a non-finite loss or gradient"),
];

/// Checkpoints and resuming, as every trainer has them.
pub const CHECKPOINTS: &[Flag] = &[
    ("save_steps", "save_steps", Kind::Int, "Checkpoint every N steps (0: only where the run stops)"),
    ("save_total_limit", "save_total_limit", Kind::Int, "Keep at most N checkpoints (0: all)"),
    (
        "resume_from_checkpoint",
        "resume_from_checkpoint",
        Kind::Str,
        "Checkpoint directory, or \"latest\" in output_dir",
    ),
    (
        "stop_after",
        "stop_after",
        Kind::Int,
        "Stop (with a checkpoint) after N steps of this invocation, to continue later with --resume_from_checkpoint",
    ),
];

/// TRL's PEFT flags; the keys are the same in every command.
pub const PEFT: &[Flag] = &[
    (
        "use_peft",
        "peft.use_peft",
        Kind::Bool,
        "Train LoRA adapters (saved in PEFT's format) instead of the whole model",
    ),
    ("lora_r", "peft.lora_r", Kind::Int, "LoRA rank"),
    ("lora_alpha", "peft.lora_alpha", Kind::Float, "LoRA alpha (adapters scaled by alpha / r)"),
    (
        "lora_dropout",
        "peft.lora_dropout",
        Kind::Float,
        "Dropout on the adapters' input while training (off in online RL, as in TRL)",
    ),
    (
        "lora_target_modules",
        "peft.lora_target_modules",
        Kind::Words,
        "Modules that get adapters, e.g. q_proj v_proj, or all-linear [none: PEFT's default for the architecture]",
    ),
];

/// A command's flags: groups of [`Flag`]s, each under a help heading and
/// with its keys under a section prefix.
pub struct Flags {
    flags: Vec<(&'static str, String, Kind, &'static str, &'static str)>,
}

impl Flags {
    pub fn new() -> Self {
        Self { flags: Vec::new() }
    }

    /// Adds `group` with its keys prefixed by `section` (e.g. "train.").
    pub fn with(self, heading: &'static str, section: &str, group: &[Flag]) -> Self {
        self.with_headings(move |_| heading, section, group)
    }

    /// Adds `group`, each flag under the heading `heading` gives its key.
    pub fn with_headings(mut self, heading: impl Fn(&str) -> &'static str, section: &str, group: &[Flag]) -> Self {
        for &(flag, key, kind, help) in group {
            let key = if key.is_empty() { String::new() } else { format!("{section}{key}") };
            self.flags.push((flag, key.clone(), kind, help, heading(&key)));
        }
        self
    }

    /// The command's arguments: `CONFIG.toml`, `--set`, `--print_config`
    /// and the flags, whose help shows the default read from `defaults`
    /// (the config's `Default` as TOML), so that `--help` cannot drift.
    pub fn augment(&self, cmd: Command, defaults: &toml::Value) -> Command {
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
                    .help("Override a config key (TOML value), e.g. --set learning_rate=1e-5"),
            )
            .arg(
                Arg::new("print_config")
                    .long("print_config")
                    .action(ArgAction::SetTrue)
                    .help("Print the resolved configuration and exit"),
            );
        for (flag, key, kind, help, heading) in &self.flags {
            let default = match kind {
                Kind::Switch(on, _) => (default_of(defaults, key) == format!("{on:?}")).to_string(),
                _ => default_of(defaults, key),
            };
            let mut arg = Arg::new(*flag)
                .long(*flag)
                .value_name(match kind {
                    Kind::Str => "TEXT",
                    Kind::Int => "N",
                    Kind::Float => "X",
                    Kind::Bool | Kind::Switch(..) => "BOOL",
                    Kind::Words => "NAME",
                })
                .help(if help.contains("[default") || help.contains("[none") {
                    help.to_string()
                } else {
                    format!("{help} [default: {default}]")
                })
                .help_heading(*heading);
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

    /// `--set` overrides, then the given flags as (key, value); one key set
    /// by two flags (two names of one setting) is an error naming both.
    /// `rename` may move a flag's key (e.g. by another flag's presence).
    pub fn overrides(
        &self,
        m: &ArgMatches,
        rename: impl Fn(&str, &str) -> String,
    ) -> Result<Vec<(String, toml::Value)>, clap::Error> {
        let mut overrides = Vec::new();
        for set in m.get_many::<String>("set").into_iter().flatten() {
            overrides.push(parse_set(set).map_err(|e| usage(format!("{e}")))?);
        }
        let mut set_by: Vec<(&str, String)> = Vec::new();
        for (flag, key, kind, _, _) in &self.flags {
            if !given(m, flag) || key.is_empty() {
                continue;
            }
            let value = match kind {
                Kind::Bool => toml::Value::Boolean(switch(m, flag)),
                Kind::Switch(on, off) => toml::Value::String(if switch(m, flag) { on } else { off }.to_string()),
                Kind::Words => toml::Value::Array(words(m, flag).into_iter().map(toml::Value::String).collect()),
                _ => typed(flag, m.get_one::<String>(flag).map_or("", String::as_str), *kind)?,
            };
            let key = rename(flag, key);
            if let Some((other, _)) = set_by.iter().find(|(_, k)| *k == key) {
                return Err(clap::Error::raw(
                    clap::error::ErrorKind::ArgumentConflict,
                    format!("--{other} and --{flag} are two names of one setting ({key}): give one"),
                ));
            }
            overrides.push((key.clone(), value));
            set_by.push((flag, key));
        }
        Ok(overrides)
    }
}

/// Whether `flag` was given on the command line.
pub fn given(m: &ArgMatches, flag: &str) -> bool {
    m.contains_id(flag) && m.value_source(flag) == Some(ValueSource::CommandLine)
}

/// A boolean flag's value (`--flag` alone is true).
pub fn switch(m: &ArgMatches, flag: &str) -> bool {
    *m.get_one::<bool>(flag).unwrap_or(&true)
}

/// A text flag's value.
pub fn text(m: &ArgMatches, flag: &str) -> Option<String> {
    m.get_one::<String>(flag).cloned()
}

/// A words flag's values.
pub fn words(m: &ArgMatches, flag: &str) -> Vec<String> {
    m.get_many::<String>(flag).into_iter().flatten().cloned().collect()
}

/// A usage error (exit code 2) with `msg`.
pub fn usage(msg: String) -> clap::Error {
    clap::Error::raw(clap::error::ErrorKind::InvalidValue, msg)
}

/// The config file given, and whether to print the resolved config.
pub fn config_file(m: &ArgMatches) -> (Option<PathBuf>, bool) {
    (m.get_one::<PathBuf>("config").cloned(), m.get_flag("print_config"))
}

fn default_of(defaults: &toml::Value, key: &str) -> String {
    let mut here = (!key.is_empty()).then_some(defaults);
    for part in key.split('.') {
        here = here.and_then(|v| v.get(part));
    }
    match here {
        Some(toml::Value::String(s)) if s.is_empty() => "none".into(),
        Some(toml::Value::String(s)) => format!("{s:?}"),
        Some(v) => v.to_string(),
        None => "none".into(),
    }
}

fn typed(flag: &str, text: &str, kind: Kind) -> Result<toml::Value, clap::Error> {
    let bad = |what: &str| usage(format!("--{flag}: expected {what}, got `{text}`"));
    Ok(match kind {
        Kind::Int => toml::Value::Integer(text.parse().map_err(|_| bad("an integer"))?),
        Kind::Float => match text.parse::<i64>() {
            Ok(n) => toml::Value::Integer(n),
            Err(_) => toml::Value::Float(text.parse().map_err(|_| bad("a number"))?),
        },
        Kind::Str | Kind::Bool | Kind::Words | Kind::Switch(..) => toml::Value::String(text.to_string()),
    })
}
