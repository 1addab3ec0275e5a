//! The `[[reward]]` tables of a config file: one table per reward source,
//! told apart by `type`, and [`build`], which validates them and loads what
//! they name into a [`RewardSet`].
//!
//! ```toml
//! [[reward]]
//! type = "model"          # a *ForSequenceClassification checkpoint
//! path = "runs/rm"        # directory or hub id
//! weight = 1.0
//! batch_size = 16
//!
//! [[reward]]
//! type = "lexicon"
//! name = "sentiment"      # optional; defaults to the type
//! positive = ["great", "good"]
//! negative = ["bad", "boring"]
//! weight = 0.5
//! ```
//!
//! Sources outside the trainer:
//!
//! ```toml
//! [[reward]]
//! type = "command"        # a process speaking JSON lines on stdin/stdout
//! command = ["python3", "score.py"]
//!
//! [[reward]]
//! type = "http"           # POST {"prompts", "completions", "rows"}
//! url = "http://127.0.0.1:8000/score"
//! api_key_env = "SCORER_TOKEN"
//!
//! [[reward]]
//! type = "judge"          # an OpenAI-compatible chat endpoint
//! url = "http://127.0.0.1:8000/v1"
//! model = "nvidia/Llama-3_3-Nemotron-Super-49B-GenRM-Multilingual"
//! mode = "pairwise"
//! ```
//!
//! Every table takes `name` (used in the metrics as `rewards/<name>/mean`;
//! default: the type; names must be unique) and `weight` (default 1.0; the
//! score is `sum_j weight_j * reward_j`). Unknown keys are errors, so that a
//! misspelt option never silently falls back to its default. Relative file
//! paths are read from the current directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use super::combine::RewardSet;
use super::command::{CommandSource, Launch};
use super::http::HttpSource;
use super::judge::{Judge, JudgeMode, JudgeSettings, JudgeSource, Pairs};
use super::model::RewardModel;
use super::rules::{read_word_list, Count, ExactMatch, LengthUnit, Lexicon, Needle};
use super::RewardSource;
use crate::error::{Error, Result};
use crate::service::{Client, Retry};

/// The values of `type`, in the order of [`RewardSpec`]'s variants.
pub const REWARD_TYPES: &[&str] = &["model", "length", "count", "lexicon", "exact_match", "command", "http", "judge"];

/// One `[[reward]]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RewardSpec {
    /// A reward model's score.
    Model(ModelSpec),
    /// The completion's length, or its distance to a target length.
    Length(LengthSpec),
    /// Occurrences of a regex or substring.
    Count(CountSpec),
    /// Positive minus negative words.
    Lexicon(LexiconSpec),
    /// 1 when the completion equals a dataset column, else 0.
    ExactMatch(ExactMatchSpec),
    /// A process that scores batches over JSON lines.
    Command(CommandSpec),
    /// A scoring service over HTTP.
    Http(HttpSpec),
    /// An LLM judge behind an OpenAI-compatible chat endpoint.
    Judge(JudgeSpec),
}

fn one() -> f32 {
    1.0
}

fn default_batch_size() -> usize {
    8
}

/// `type = "model"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Metric name; default `model`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// A `*ForSequenceClassification` model directory with `num_labels = 1`,
    /// or a hub id (`owner/name[@revision]`) in the local cache.
    pub path: String,
    /// Sequences per forward pass.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
}

/// `type = "length"`: `scale * len`, or `scale * -|len - target|`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LengthSpec {
    /// Metric name; default `length`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// `tokens` (policy tokens, the default) or `chars`.
    #[serde(default)]
    pub unit: LengthUnit,
    /// When set, the reward is minus the distance to this length.
    pub target: Option<f32>,
    /// Multiplies the length (or the distance).
    #[serde(default = "one")]
    pub scale: f32,
}

/// `type = "count"`: matches of `pattern` or `substring`, capped at `max`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CountSpec {
    /// Metric name; default `count`.
    pub name: Option<String>,
    /// Weight in the total score (negative to penalise).
    #[serde(default = "one")]
    pub weight: f32,
    /// A regular expression (Rust `regex` syntax).
    pub pattern: Option<String>,
    /// Literal text; give this or `pattern`.
    pub substring: Option<String>,
    /// Match regardless of case.
    #[serde(default)]
    pub case_insensitive: bool,
    /// Count at most this many matches.
    pub max: Option<u32>,
}

/// `type = "lexicon"`: `#positive - #negative` words.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LexiconSpec {
    /// Metric name; default `lexicon`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// Positive words, inline.
    #[serde(default)]
    pub positive: Vec<String>,
    /// Negative words, inline.
    #[serde(default)]
    pub negative: Vec<String>,
    /// A file of positive words, one per line (`#`/`;` comment lines).
    pub positive_file: Option<PathBuf>,
    /// A file of negative words, one per line.
    pub negative_file: Option<PathBuf>,
    /// Divide by the number of words in the completion.
    #[serde(default)]
    pub normalize: bool,
}

/// `type = "exact_match"`: 1.0 when the completion's answer equals the
/// row's `column`, else 0.0; rows without the column are unscorable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExactMatchSpec {
    /// Metric name; default `exact_match`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// The dataset column holding the reference answer.
    pub column: String,
    /// Compare lower-cased.
    #[serde(default)]
    pub case_insensitive: bool,
    /// Compare only the text after the last occurrence of this marker
    /// (GSM8K's `####`).
    pub marker: Option<String>,
    /// Compare only the last number (as a number).
    #[serde(default)]
    pub last_number: bool,
}

fn default_command_timeout() -> f64 {
    300.0
}

fn default_timeout() -> f64 {
    60.0
}

fn default_judge_timeout() -> f64 {
    300.0
}

fn default_max_failure_rate() -> f64 {
    0.1
}

fn default_retries() -> u32 {
    3
}

fn default_backoff() -> f64 {
    1.0
}

fn default_concurrency() -> usize {
    8
}

fn default_http_batch_size() -> usize {
    32
}

fn default_max_tokens() -> u32 {
    1024
}

/// `type = "command"`: a long-running process scoring over JSON lines
/// (see `reward::command`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandSpec {
    /// Metric name; default `command`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// The program and its arguments, e.g. `["python3", "score.py"]`.
    pub command: Vec<String>,
    /// Working directory of the process; default: the current one.
    pub cwd: Option<PathBuf>,
    /// Variables added to the process's environment (it inherits rloo's;
    /// keep secrets there rather than here, since this table is saved with
    /// the run).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Samples per request line; default: all the samples of a step.
    pub batch_size: Option<usize>,
    /// Seconds to wait for an answer line before the process is stopped and
    /// the batch fails.
    #[serde(default = "default_command_timeout")]
    pub timeout_s: f64,
    /// The share of a step's samples that may fail before the run stops.
    #[serde(default = "default_max_failure_rate")]
    pub max_failure_rate: f64,
}

/// `type = "http"`: a scoring service (see `reward::http`; `rloo reward
/// serve` is one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSpec {
    /// Metric name; default `http`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// Where batches are POSTed, e.g. `http://10.0.0.5:8000/score`.
    pub url: String,
    /// Samples per request.
    #[serde(default = "default_http_batch_size")]
    pub batch_size: usize,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// The environment variable holding a bearer token (the token itself is
    /// never written anywhere).
    pub api_key_env: Option<String>,
    /// Requests in flight at once.
    #[serde(default = "default_concurrency")]
    pub max_concurrency: usize,
    /// Seconds per attempt, from connecting to the end of the answer.
    #[serde(default = "default_timeout")]
    pub timeout_s: f64,
    /// Attempts after the first, on connection errors, timeouts, 429 and 5xx.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// Seconds before the first retry; doubled for each next one, jittered.
    #[serde(default = "default_backoff")]
    pub backoff_s: f64,
    /// The share of a step's samples that may fail before the run stops.
    #[serde(default = "default_max_failure_rate")]
    pub max_failure_rate: f64,
}

/// `type = "judge"`: an LLM judge (see `reward::judge`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JudgeSpec {
    /// Metric name; default `judge`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// The API base, e.g. `http://127.0.0.1:8000/v1`; requests go to
    /// `<url>/chat/completions`.
    pub url: String,
    /// The model name the server expects.
    pub model: String,
    /// The environment variable holding the API key (sent as a bearer
    /// token; never written anywhere).
    pub api_key_env: Option<String>,
    /// A system message, sent before the rendered template.
    pub system: Option<String>,
    /// The user message, with `{prompt}`, `{completion}` (pointwise) or
    /// `{completion_1}`, `{completion_2}` (pairwise) and `{column}` fields;
    /// default: a 1-to-5 helpfulness rating in the GenRM convention.
    pub template: Option<String>,
    /// A regex whose first group (pointwise) or first two groups (pairwise)
    /// are the scores; default: `\boxed{s}` or `\boxed{s1, s2}`.
    pub score_pattern: Option<String>,
    /// `pointwise` (one completion per request) or `pairwise` (GenRM).
    #[serde(default)]
    pub mode: JudgeMode,
    /// Pairwise: `round_robin` (k comparisons per group) or `all`
    /// (k (k - 1)).
    #[serde(default)]
    pub pairs: Pairs,
    #[serde(default)]
    pub temperature: f64,
    /// The longest answer, in the judge's tokens.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Requests in flight at once.
    #[serde(default = "default_concurrency")]
    pub max_concurrency: usize,
    /// Seconds per attempt.
    #[serde(default = "default_judge_timeout")]
    pub timeout_s: f64,
    /// Attempts after the first, on connection errors, timeouts, 429 and 5xx.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// Seconds before the first retry; doubled for each next one, jittered.
    #[serde(default = "default_backoff")]
    pub backoff_s: f64,
    /// The share of a step's requests that may fail before the run stops.
    #[serde(default = "default_max_failure_rate")]
    pub max_failure_rate: f64,
}

/// How to reach a service: what the `http` and `judge` tables share.
struct Reach<'a> {
    url: &'a str,
    headers: &'a BTreeMap<String, String>,
    api_key_env: &'a Option<String>,
    max_concurrency: usize,
    timeout_s: f64,
    retries: u32,
    backoff_s: f64,
    max_failure_rate: f64,
}

impl Reach<'_> {
    /// Checks the options and makes the client.
    fn client(&self) -> Result<Client> {
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) {
            return Err(Error::Invalid(format!("url `{}` must start with http:// or https://", self.url)));
        }
        if self.max_concurrency == 0 {
            return Err(Error::Invalid("max_concurrency must be at least 1".into()));
        }
        let timeout = seconds("timeout_s", self.timeout_s)?;
        let backoff = if self.backoff_s == 0.0 { Duration::ZERO } else { seconds("backoff_s", self.backoff_s)? };
        check_failure_rate(self.max_failure_rate)?;
        let token = match self.api_key_env {
            Some(var) => Some(
                std::env::var(var)
                    .map_err(|_| Error::Invalid(format!("api_key_env: the environment variable `{var}` is not set")))?,
            ),
            None => None,
        };
        let headers: Vec<(String, String)> = self.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        Ok(Client::new(timeout, &headers, token.as_deref(), Retry { retries: self.retries, backoff }))
    }
}

fn seconds(key: &str, s: f64) -> Result<Duration> {
    if s.is_finite() && s > 0.0 && s < 1e9 {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(Error::Invalid(format!("{key} must be a number of seconds > 0, got {s}")))
    }
}

fn check_failure_rate(rate: f64) -> Result<()> {
    if (0.0..=1.0).contains(&rate) {
        Ok(())
    } else {
        Err(Error::Invalid(format!("max_failure_rate must be in [0, 1], got {rate}")))
    }
}

impl RewardSpec {
    /// The `type` value.
    pub fn type_name(&self) -> &'static str {
        match self {
            RewardSpec::Model(_) => "model",
            RewardSpec::Length(_) => "length",
            RewardSpec::Count(_) => "count",
            RewardSpec::Lexicon(_) => "lexicon",
            RewardSpec::ExactMatch(_) => "exact_match",
            RewardSpec::Command(_) => "command",
            RewardSpec::Http(_) => "http",
            RewardSpec::Judge(_) => "judge",
        }
    }

    /// The metric name: `name`, or the type.
    pub fn name(&self) -> &str {
        let name = match self {
            RewardSpec::Model(s) => &s.name,
            RewardSpec::Length(s) => &s.name,
            RewardSpec::Count(s) => &s.name,
            RewardSpec::Lexicon(s) => &s.name,
            RewardSpec::ExactMatch(s) => &s.name,
            RewardSpec::Command(s) => &s.name,
            RewardSpec::Http(s) => &s.name,
            RewardSpec::Judge(s) => &s.name,
        };
        name.as_deref().unwrap_or(self.type_name())
    }

    pub fn weight(&self) -> f32 {
        match self {
            RewardSpec::Model(s) => s.weight,
            RewardSpec::Length(s) => s.weight,
            RewardSpec::Count(s) => s.weight,
            RewardSpec::Lexicon(s) => s.weight,
            RewardSpec::ExactMatch(s) => s.weight,
            RewardSpec::Command(s) => s.weight,
            RewardSpec::Http(s) => s.weight,
            RewardSpec::Judge(s) => s.weight,
        }
    }

    /// The source this table describes; reward models are loaded onto
    /// `device`. Errors carry no table prefix ([`build`] adds it).
    fn source(&self, device: &Device) -> Result<Box<dyn RewardSource>> {
        let name = self.name().to_string();
        Ok(match self {
            RewardSpec::Model(s) => {
                if s.batch_size == 0 {
                    return Err(Error::Invalid("batch_size must be at least 1".into()));
                }
                Box::new(RewardModel::load(name, &s.path, device, s.batch_size)?)
            }
            RewardSpec::Length(s) => {
                finite("scale", s.scale)?;
                if let Some(t) = s.target {
                    if !(t.is_finite() && t >= 0.0) {
                        return Err(Error::Invalid(format!("target must be a length >= 0, got {t}")));
                    }
                }
                Box::new(super::rules::Length::new(name, s.unit, s.target, s.scale))
            }
            RewardSpec::Count(s) => {
                let needle = match (&s.pattern, &s.substring) {
                    (Some(p), None) => Needle::Pattern(p.clone()),
                    (None, Some(t)) => Needle::Substring(t.clone()),
                    (Some(_), Some(_)) => {
                        return Err(Error::Invalid(
                            "give either `pattern` (a regex) or `substring` (literal text), \
                             not both"
                                .into(),
                        ))
                    }
                    (None, None) => {
                        return Err(Error::Invalid(
                            "give `pattern` (a regex) or `substring` (literal text) to count".into(),
                        ))
                    }
                };
                Box::new(Count::new(name, &needle, s.case_insensitive, s.max)?)
            }
            RewardSpec::Lexicon(s) => {
                let mut positive = s.positive.clone();
                let mut negative = s.negative.clone();
                if let Some(path) = &s.positive_file {
                    positive.extend(read_list("positive_file", path)?);
                }
                if let Some(path) = &s.negative_file {
                    negative.extend(read_list("negative_file", path)?);
                }
                Box::new(Lexicon::new(name, &positive, &negative, s.normalize)?)
            }
            RewardSpec::ExactMatch(s) => {
                Box::new(ExactMatch::new(name, s.column.clone(), s.case_insensitive, s.marker.clone(), s.last_number)?)
            }
            RewardSpec::Command(s) => {
                if s.batch_size == Some(0) {
                    return Err(Error::Invalid("batch_size must be at least 1".into()));
                }
                check_failure_rate(s.max_failure_rate)?;
                let launch = Launch {
                    argv: s.command.clone(),
                    cwd: s.cwd.clone(),
                    env: s.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                };
                let timeout = seconds("timeout_s", s.timeout_s)?;
                Box::new(CommandSource::start(name, launch, s.batch_size, timeout, s.max_failure_rate)?)
            }
            RewardSpec::Http(s) => {
                if s.batch_size == 0 {
                    return Err(Error::Invalid("batch_size must be at least 1".into()));
                }
                let reach = s.reach();
                Box::new(HttpSource::new(
                    name,
                    &s.url,
                    reach.client()?,
                    s.batch_size,
                    s.max_concurrency,
                    s.max_failure_rate,
                ))
            }
            RewardSpec::Judge(s) => Box::new(JudgeSource::new(name, s.judge()?, s.pairs, s.max_failure_rate)),
        })
    }
}

impl HttpSpec {
    fn reach(&self) -> Reach<'_> {
        Reach {
            url: &self.url,
            headers: &self.headers,
            api_key_env: &self.api_key_env,
            max_concurrency: self.max_concurrency,
            timeout_s: self.timeout_s,
            retries: self.retries,
            backoff_s: self.backoff_s,
            max_failure_rate: self.max_failure_rate,
        }
    }
}

impl JudgeSpec {
    fn reach(&self) -> Reach<'_> {
        Reach {
            url: &self.url,
            headers: &self.headers,
            api_key_env: &self.api_key_env,
            max_concurrency: self.max_concurrency,
            timeout_s: self.timeout_s,
            retries: self.retries,
            backoff_s: self.backoff_s,
            max_failure_rate: self.max_failure_rate,
        }
    }

    /// The judge this table describes (also what `rloo eval --judge` asks).
    pub fn judge(&self) -> Result<Judge> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::Invalid(format!("temperature must be >= 0, got {}", self.temperature)));
        }
        if self.max_tokens == 0 {
            return Err(Error::Invalid("max_tokens must be at least 1".into()));
        }
        Judge::new(
            self.reach().client()?,
            JudgeSettings {
                url: self.url.clone(),
                model: self.model.clone(),
                system: self.system.clone(),
                template: self.template.clone(),
                score_pattern: self.score_pattern.clone(),
                temperature: self.temperature,
                max_tokens: self.max_tokens,
                max_concurrency: self.max_concurrency,
                mode: self.mode,
            },
        )
    }
}

fn finite(key: &str, x: f32) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(Error::Invalid(format!("{key} must be a finite number, got {x}")))
    }
}

fn read_list(key: &str, path: &Path) -> Result<Vec<String>> {
    read_word_list(path).map_err(|e| Error::Invalid(format!("{key}: {e}")))
}

/// Checks a metric name: it becomes a path segment of `rewards/<name>/mean`.
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "name `{name}` must be non-empty and use only ASCII letters, digits, `_`, `-` and \
             `.` (it becomes part of the metric names rewards/<name>/mean and /std)"
        )))
    }
}

/// The built-in rule rewards `--reward_funcs` names, each with its default
/// options: `length` (the completion's length in tokens) and `exact_match`
/// (the last number of the completion against the last number of the row's
/// `answer` column, as in GSM8K).
pub const BUILTIN_REWARD_FUNCS: &[&str] = &["length", "exact_match"];

/// TRL 1.x's `reward_funcs` and `reward_weights` as `[[reward]]` tables:
/// each function is a built-in rule's name or a reward model (a directory
/// or a cached hub id), named by its last path component as TRL logs it;
/// weights default to 1.
pub fn reward_funcs(funcs: &[String], weights: Option<&[f32]>) -> Result<Vec<RewardSpec>> {
    if let Some(w) = weights.filter(|w| w.len() != funcs.len()) {
        return Err(Error::Invalid(format!(
            "--reward_weights gives {} weights for {} --reward_funcs: give one per function",
            w.len(),
            funcs.len()
        )));
    }
    let mut specs = Vec::with_capacity(funcs.len());
    for (i, func) in funcs.iter().enumerate() {
        let weight = weights.map_or(1.0, |w| w[i]);
        let spec = match func.as_str() {
            "length" => RewardSpec::Length(LengthSpec {
                name: None,
                weight,
                unit: LengthUnit::default(),
                target: None,
                scale: 1.0,
            }),
            "exact_match" => RewardSpec::ExactMatch(ExactMatchSpec {
                name: None,
                weight,
                column: "answer".into(),
                case_insensitive: false,
                marker: None,
                last_number: true,
            }),
            path if Path::new(path).exists() || path.contains('/') => {
                let name = path.trim_end_matches('/').rsplit('/').next().unwrap_or(path);
                RewardSpec::Model(ModelSpec {
                    name: Some(name.to_string()),
                    weight,
                    path: path.to_string(),
                    batch_size: default_batch_size(),
                })
            }
            other => {
                return Err(Error::Invalid(format!(
                    "--reward_funcs: `{other}` is neither a built-in rule ({}) nor a reward model directory",
                    BUILTIN_REWARD_FUNCS.join(", ")
                )))
            }
        };
        specs.push(spec);
    }
    Ok(specs)
}

/// Validates the `[[reward]]` tables and builds the weighted sources, loading
/// reward models onto `device`. Errors name the table (`reward #2`, counted
/// from 1 in file order) and the option at fault.
pub fn build(specs: &[RewardSpec], device: &Device) -> Result<RewardSet> {
    if specs.is_empty() {
        return Err(Error::Invalid(format!(
            "no reward: add at least one [[reward]] table with a type ({})",
            REWARD_TYPES.join(", ")
        )));
    }
    // Cheap checks on every table first, so that a typo in the last table is
    // reported before a reward model is loaded.
    for (i, spec) in specs.iter().enumerate() {
        let at = |msg: String| Error::Invalid(format!("reward #{} ({}): {msg}", i + 1, spec.type_name()));
        check_name(spec.name()).map_err(|e| at(e.to_string()))?;
        finite("weight", spec.weight()).map_err(|e| at(e.to_string()))?;
        if let Some(j) = specs[..i].iter().position(|s| s.name() == spec.name()) {
            return Err(at(format!(
                "name `{}` is already used by reward #{}; give one of them a distinct `name`",
                spec.name(),
                j + 1
            )));
        }
    }
    let mut set = RewardSet::new();
    for (i, spec) in specs.iter().enumerate() {
        let source = spec
            .source(device)
            .map_err(|e| Error::Invalid(format!("reward #{} ({} `{}`): {e}", i + 1, spec.type_name(), spec.name())))?;
        set.push(source, spec.weight())?;
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::test_support::*;
    use serde_json::{json, Value};

    #[test]
    fn reward_funcs_are_rules_by_name_and_models_by_path() {
        let funcs = ["length".to_string(), "exact_match".into(), "models/rm-a/".into(), "org/rm-b".into()];
        let specs = reward_funcs(&funcs, Some(&[0.1, 1.0, 2.0, -1.0])).unwrap();
        let names: Vec<&str> = specs.iter().map(RewardSpec::name).collect();
        assert_eq!(names, ["length", "exact_match", "rm-a", "rm-b"]);
        assert!(matches!(&specs[2], RewardSpec::Model(m) if m.path == "models/rm-a/" && m.weight == 2.0));
        assert!(matches!(&specs[0], RewardSpec::Length(l) if l.weight == 0.1));
        let err = reward_funcs(&funcs, Some(&[1.0])).unwrap_err().to_string();
        assert!(err.contains("1 weights for 4 --reward_funcs"), "{err}");
        let err = reward_funcs(&["lenght".into()], None).unwrap_err().to_string();
        assert!(err.contains("`lenght` is neither a built-in rule (length, exact_match)"), "{err}");
    }

    fn parse(v: Value) -> std::result::Result<Vec<RewardSpec>, String> {
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    fn build_err(v: Value) -> String {
        let specs = parse(v).unwrap();
        match build(&specs, &Device::Cpu) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn tables_parse_with_defaults() {
        let specs = parse(json!([
            {"type": "model", "path": "runs/rm"},
            {"type": "lexicon", "name": "sentiment", "positive": ["good"], "weight": 0.5},
            {"type": "length", "unit": "chars", "target": 100},
            {"type": "count", "substring": "!", "max": 3, "weight": -1},
            {"type": "exact_match", "column": "answer", "marker": "####", "last_number": true},
        ]))
        .unwrap();
        assert_eq!(
            specs[0],
            RewardSpec::Model(ModelSpec { name: None, weight: 1.0, path: "runs/rm".into(), batch_size: 8 })
        );
        assert_eq!(
            specs.iter().map(RewardSpec::name).collect::<Vec<_>>(),
            ["model", "sentiment", "length", "count", "exact_match"]
        );
        assert_eq!(specs.iter().map(RewardSpec::weight).collect::<Vec<_>>(), [1.0, 0.5, 1.0, -1.0, 1.0]);
        assert_eq!(
            specs[2],
            RewardSpec::Length(LengthSpec {
                name: None,
                weight: 1.0,
                unit: LengthUnit::Chars,
                target: Some(100.0),
                scale: 1.0
            })
        );
    }

    #[test]
    fn reward_types_are_the_variants_in_order() {
        for t in REWARD_TYPES {
            // Parsing may still fail on a missing required key.
            let err = parse(json!([{"type": t}])).err().unwrap_or_default();
            assert!(!err.contains("unknown variant"), "{t}: {err}");
        }
        let listed: Vec<String> = REWARD_TYPES.iter().map(|t| format!("`{t}`")).collect();
        assert_eq!(
            parse(json!([{"type": "nope"}])).unwrap_err(),
            format!("unknown variant `nope`, expected one of {}", listed.join(", "))
        );
    }

    #[test]
    fn unknown_types_and_keys_are_errors_that_list_the_known_ones() {
        assert_eq!(
            parse(json!([{"type": "sentiment"}])).unwrap_err(),
            "unknown variant `sentiment`, expected one of `model`, `length`, `count`, \
             `lexicon`, `exact_match`, `command`, `http`, `judge`"
        );
        assert_eq!(
            parse(json!([{"type": "lexicon", "postive": ["good"]}])).unwrap_err(),
            "unknown field `postive`, expected one of `name`, `weight`, `positive`, \
             `negative`, `positive_file`, `negative_file`, `normalize`"
        );
        assert_eq!(parse(json!([{"path": "rm"}])).unwrap_err(), "missing field `type`");
        assert_eq!(parse(json!([{"type": "exact_match"}])).unwrap_err(), "missing field `column`");
        assert_eq!(
            parse(json!([{"type": "length", "unit": "words"}])).unwrap_err(),
            "unknown variant `words`, expected `tokens` or `chars`"
        );
    }

    #[test]
    fn build_errors_name_the_table_and_the_option() {
        assert_eq!(
            build_err(json!([])),
            "no reward: add at least one [[reward]] table with a type (model, length, count, \
             lexicon, exact_match, command, http, judge)"
        );
        let err = build_err(json!([
            {"type": "length"},
            {"type": "count", "pattern": "(oops"}
        ]));
        assert!(err.starts_with("reward #2 (count `count`): pattern `(oops` is not a valid regex: "), "{err}");
        assert_eq!(
            build_err(json!([{"type": "count"}])),
            "reward #1 (count `count`): give `pattern` (a regex) or `substring` (literal text) \
             to count"
        );
        assert_eq!(
            build_err(json!([{"type": "count", "pattern": "a", "substring": "a"}])),
            "reward #1 (count `count`): give either `pattern` (a regex) or `substring` \
             (literal text), not both"
        );
        assert_eq!(
            build_err(json!([{"type": "length", "target": -3}])),
            "reward #1 (length `length`): target must be a length >= 0, got -3"
        );
        assert_eq!(
            build_err(json!([{"type": "model", "path": "x", "batch_size": 0}])),
            "reward #1 (model `model`): batch_size must be at least 1"
        );
    }

    #[test]
    fn duplicate_and_malformed_names_are_errors() {
        assert_eq!(
            build_err(json!([
                {"type": "length"},
                {"type": "count", "substring": "!"},
                {"type": "length", "unit": "chars"}
            ])),
            "reward #3 (length): name `length` is already used by reward #1; give one of them \
             a distinct `name`"
        );
        assert_eq!(
            build_err(json!([{"type": "length", "name": "a/b"}])),
            "reward #1 (length): name `a/b` must be non-empty and use only ASCII letters, \
             digits, `_`, `-` and `.` (it becomes part of the metric names rewards/<name>/mean \
             and /std)"
        );
    }

    #[test]
    fn duplicate_names_are_reported_before_any_model_is_loaded() {
        // The model path does not exist: the name clash must win.
        let err = build_err(json!([
            {"type": "model", "path": "/no/such/rm"},
            {"type": "model", "path": "/no/such/rm2"}
        ]));
        assert!(err.starts_with("reward #2 (model): name `model`"), "{err}");
    }

    #[test]
    fn missing_word_files_and_model_dirs_are_named() {
        let err = build_err(json!([
            {"type": "lexicon", "positive_file": "/no/such/pos.txt"}
        ]));
        assert!(err.starts_with("reward #1 (lexicon `lexicon`): positive_file: /no/such/pos.txt: "), "{err}");
        let err = build_err(json!([{"type": "model", "path": "./no/such/rm"}]));
        assert_eq!(
            err,
            "reward #1 (model `model`): ./no/such/rm: no such directory, and not a hub id of \
             the form owner/name[@revision]"
        );
    }

    #[test]
    fn a_causal_model_path_is_rejected_in_build() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gpt2-causal");
        let err = build_err(json!([{"type": "model", "path": dir}]));
        assert!(
            err.starts_with(&format!(
                "reward #1 (model `model`): {}: is a causal language model (GPT2LMHeadModel)",
                dir.display()
            )),
            "{err}"
        );
    }

    #[test]
    fn built_set_scores_with_weights_and_files() {
        let dir = tempfile::tempdir().unwrap();
        let neg = dir.path().join("neg.txt");
        std::fs::write(&neg, "; negative words\nbad\nboring\n").unwrap();
        let specs = parse(json!([
            {"type": "lexicon", "name": "sentiment", "positive": ["good"],
             "negative_file": neg, "weight": 0.5},
            {"type": "count", "name": "shouting", "substring": "!", "weight": -1},
            {"type": "length", "unit": "chars", "target": 4, "weight": 0.1}
        ]))
        .unwrap();
        let set = build(&specs, &Device::Cpu).unwrap();
        assert_eq!(set.names(), ["sentiment", "shouting", "length"]);
        assert_eq!(set.weights(), [0.5, -1.0, 0.1]);
        let owned = completions(&["good!", "bad, boring"]);
        let scores = set.score(&samples(&owned)).unwrap();
        // 0.5 * 1 - 1 * 1 + 0.1 * -1; 0.5 * -2 - 0 + 0.1 * -7.
        let want = [-0.6f32, -1.7];
        for (got, want) in scores.total.iter().zip(want) {
            assert!((got.unwrap() - want).abs() < 1e-6, "{:?}", scores.total);
        }
    }

    #[test]
    fn specs_round_trip_through_serialisation() {
        let specs = parse(json!([
            {"type": "exact_match", "name": "gsm8k", "column": "answer", "marker": "####"},
            {"type": "length", "target": 50, "scale": 0.01}
        ]))
        .unwrap();
        let back: Vec<RewardSpec> = serde_json::from_value(serde_json::to_value(&specs).unwrap()).unwrap();
        assert_eq!(back, specs);
    }
}
