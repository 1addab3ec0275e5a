//! What the sources outside the trainer share (a command, an HTTP service,
//! an LLM judge): the wire form of a sample, reading an answer's scores, and
//! the per-step failure budget with its metrics.
//!
//! A failure (no answer, an error status after the retries, an answer that
//! cannot be read) leaves the samples it covers without a score from the
//! source: unscorable, unless another source scores them (docs/algorithm.md
//! section 1). When more than `max_failure_rate` of a step's items fail, the
//! source stops the run with an error that names it, where it lives and the
//! last failure.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{json, Map, Value};

use super::Sample;
use crate::data::prompt::describe_json;
use crate::data::Prompt;
use crate::error::{Error, Result};
use crate::service::{Client, Retry};

/// One step's calls to a source.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CallStats {
    /// Items asked for: samples, or comparisons for a pairwise judge.
    pub items: usize,
    /// Items left without a score by a failed call or an unreadable answer.
    pub failures: usize,
    /// Seconds per call, retries included.
    pub latencies: Vec<f64>,
}

impl CallStats {
    /// `rewards/<name>/failures` and `rewards/<name>/latency_s/{p50,p95}`.
    pub fn metrics(&self, name: &str) -> Vec<(String, f32)> {
        let mut out = vec![(format!("rewards/{name}/failures"), self.failures as f32)];
        let mut sorted = self.latencies.clone();
        sorted.sort_by(f64::total_cmp);
        for (label, q) in [("p50", 0.5), ("p95", 0.95)] {
            if let Some(x) = crate::stats::percentile(&sorted, q) {
                out.push((format!("rewards/{name}/latency_s/{label}"), x as f32));
            }
        }
        out
    }
}

/// The failure budget of one source and the stats of its last step.
pub struct FailureBudget {
    /// `reward `name` (url or command)`, the start of every message.
    label: String,
    max_failure_rate: f64,
    last: Mutex<Option<CallStats>>,
}

impl FailureBudget {
    pub fn new(name: &str, target: &str, max_failure_rate: f64) -> FailureBudget {
        FailureBudget { label: format!("reward `{name}` ({target})"), max_failure_rate, last: Mutex::new(None) }
    }

    /// Records a step's calls; an error when more than the allowed share of
    /// its items failed, a warning when some did.
    pub fn settle(&self, stats: CallStats, unit: &str, last_error: Option<&str>) -> Result<()> {
        let (failed, items) = (stats.failures, stats.items);
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(stats);
        if failed == 0 {
            return Ok(());
        }
        let last = last_error.unwrap_or("-");
        if failed as f64 > self.max_failure_rate * items as f64 {
            return Err(Error::RewardService(format!(
                "{}: {failed} of {items} {unit} failed in one step, more than max_failure_rate = {}; \
                 last error: {last}",
                self.label, self.max_failure_rate
            )));
        }
        tracing::warn!(
            "{}: {failed} of {items} {unit} failed and get no score from it; last error: {last}",
            self.label
        );
        Ok(())
    }

    /// The stats of the last step, once.
    pub fn take(&self) -> Option<CallStats> {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The scores of one step's batches as they come back, with their stats.
pub struct Tally {
    scores: Vec<Option<f32>>,
    stats: CallStats,
    last_error: Option<String>,
}

impl Tally {
    pub fn new(items: usize) -> Tally {
        Tally {
            scores: Vec::with_capacity(items),
            stats: CallStats { items, ..CallStats::default() },
            last_error: None,
        }
    }

    /// Adds the next batch of `len` samples: its scores, or the failure
    /// that left them without one, and how long it took.
    pub fn add(&mut self, answer: std::result::Result<Vec<Option<f32>>, String>, len: usize, secs: f64) {
        self.stats.latencies.push(secs);
        match answer {
            Ok(scores) => self.scores.extend(scores),
            Err(e) => {
                self.stats.failures += len;
                self.scores.extend(std::iter::repeat_n(None, len));
                self.last_error = Some(e);
            }
        }
    }

    /// The scores, once the step is within `budget`.
    pub fn settle(self, budget: &FailureBudget) -> Result<Vec<Option<f32>>> {
        budget.settle(self.stats, "samples", self.last_error.as_deref())?;
        Ok(self.scores)
    }
}

/// A prompt as services receive it: the text, or the list of
/// `{"role", "content"}` messages.
pub fn prompt_json(prompt: &Prompt) -> Value {
    match prompt {
        Prompt::Text(t) => Value::String(t.clone()),
        Prompt::Messages(ms) => ms.iter().map(|m| json!({"role": m.role, "content": m.content})).collect(),
    }
}

/// `{"prompt", "completion", "row"}`: one sample of a command's request.
pub fn sample_json(sample: &Sample) -> Value {
    json!({"prompt": prompt_json(sample.prompt), "completion": sample.completion, "row": sample.row})
}

/// `{"prompts", "completions", "rows"}`: a batch as the `http` protocol
/// sends it.
pub fn batch_json(samples: &[Sample]) -> Value {
    let prompts: Vec<Value> = samples.iter().map(|s| prompt_json(s.prompt)).collect();
    let completions: Vec<&str> = samples.iter().map(|s| s.completion).collect();
    let rows: Vec<&Map<String, Value>> = samples.iter().map(|s| s.row).collect();
    json!({"prompts": prompts, "completions": completions, "rows": rows})
}

/// The scores of an answer `{"scores": [...]}` (or OpenRLHF's
/// `{"rewards": [...]}`): `n` numbers or nulls (null: no score).
pub fn read_scores(answer: &Value, n: usize) -> std::result::Result<Vec<Option<f32>>, String> {
    let list = answer.get("scores").or_else(|| answer.get("rewards")).ok_or_else(|| {
        format!("the answer has no \"scores\" list: {}", crate::service::client::quote(&answer.to_string()))
    })?;
    let Value::Array(items) = list else {
        return Err(format!("\"scores\" must be a list, got {}", describe_json(list)));
    };
    if items.len() != n {
        return Err(format!("expected {n} scores, got {}", items.len()));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::Null => Ok(None),
            Value::Number(x) => Ok(x.as_f64().map(|x| x as f32)),
            other => Err(format!("score {i} must be a number or null, got {}", describe_json(other))),
        })
        .collect()
}

pub(super) fn default_max_failure_rate() -> f64 {
    0.1
}

pub(super) fn default_retries() -> u32 {
    3
}

pub(super) fn default_backoff() -> f64 {
    1.0
}

pub(super) fn default_concurrency() -> usize {
    8
}

/// How to reach a service: what the `http` and `judge` tables share.
pub(super) struct Reach<'a> {
    pub(super) url: &'a str,
    pub(super) headers: &'a BTreeMap<String, String>,
    pub(super) api_key_env: &'a Option<String>,
    pub(super) max_concurrency: usize,
    pub(super) timeout_s: f64,
    pub(super) retries: u32,
    pub(super) backoff_s: f64,
    pub(super) max_failure_rate: f64,
}

/// The [`Reach`] of a table that names its options as [`Reach`] does
/// (`http`, `judge`).
macro_rules! reach_of {
    ($table:expr) => {
        Reach {
            url: &$table.url,
            headers: &$table.headers,
            api_key_env: &$table.api_key_env,
            max_concurrency: $table.max_concurrency,
            timeout_s: $table.timeout_s,
            retries: $table.retries,
            backoff_s: $table.backoff_s,
            max_failure_rate: $table.max_failure_rate,
        }
    };
}
pub(super) use reach_of;

impl Reach<'_> {
    /// Checks the options and makes the client.
    pub(super) fn client(&self) -> Result<Client> {
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

pub(super) fn seconds(key: &str, s: f64) -> Result<Duration> {
    if s.is_finite() && s > 0.0 && s < 1e9 {
        Ok(Duration::from_secs_f64(s))
    } else {
        Err(Error::Invalid(format!("{key} must be a number of seconds > 0, got {s}")))
    }
}

pub(super) fn check_failure_rate(rate: f64) -> Result<()> {
    if (0.0..=1.0).contains(&rate) {
        Ok(())
    } else {
        Err(Error::Invalid(format!("max_failure_rate must be in [0, 1], got {rate}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_are_read_from_either_key_and_checked() {
        assert_eq!(read_scores(&json!({"scores": [1, null, -2.5]}), 3), Ok(vec![Some(1.0), None, Some(-2.5)]));
        assert_eq!(read_scores(&json!({"rewards": [0.5]}), 1), Ok(vec![Some(0.5)]));
        assert_eq!(read_scores(&json!({"scores": [1]}), 2), Err("expected 2 scores, got 1".into()));
        assert_eq!(
            read_scores(&json!({"score": [1]}), 1),
            Err("the answer has no \"scores\" list: {\"score\":[1]}".into())
        );
        assert!(read_scores(&json!({"scores": [1, "2"]}), 2)
            .unwrap_err()
            .starts_with("score 1 must be a number or null"));
        assert!(read_scores(&json!({"scores": 3}), 1).unwrap_err().starts_with("\"scores\" must be a list"));
    }

    #[test]
    fn the_budget_warns_below_and_stops_above_the_rate() {
        let budget = FailureBudget::new("judge", "http://127.0.0.1:1/v1", 0.25);
        let stats = |failures| CallStats { items: 8, failures, latencies: vec![0.1, 0.3] };
        budget.settle(stats(2), "samples", Some("HTTP 500: boom")).unwrap();
        assert_eq!(budget.take().unwrap().failures, 2);
        assert_eq!(budget.take(), None);
        let err = budget.settle(stats(3), "samples", Some("HTTP 500: boom")).unwrap_err().to_string();
        assert_eq!(
            err,
            "reward `judge` (http://127.0.0.1:1/v1): 3 of 8 samples failed in one step, more than \
             max_failure_rate = 0.25; last error: HTTP 500: boom"
        );
        let m = stats(1).metrics("judge");
        assert_eq!(
            m,
            [
                ("rewards/judge/failures".to_string(), 1.0),
                ("rewards/judge/latency_s/p50".to_string(), 0.1),
                ("rewards/judge/latency_s/p95".to_string(), 0.3)
            ]
        );
    }
}
