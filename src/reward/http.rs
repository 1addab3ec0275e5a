//! `type = "http"`: a scoring service. Each batch of `batch_size` samples is
//! one POST of `{"prompts": [...], "completions": [...], "rows": [...]}`
//! (prompts as text or `{"role", "content"}` message lists), answered by
//! `{"scores": [...]}` or OpenRLHF's `{"rewards": [...]}`; `null` is "no
//! score". `rloo reward serve` speaks this protocol.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use super::config::{one, RewardTable};
use super::remote::{
    batch_json, default_backoff, default_concurrency, default_max_failure_rate, default_retries, reach_of, read_scores,
    CallStats, FailureBudget, Reach, Tally,
};
use super::{RewardSource, Sample};
use crate::error::{Error, Result};
use crate::service::{in_parallel, Client};

fn default_timeout() -> f64 {
    60.0
}

fn default_http_batch_size() -> usize {
    32
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

impl RewardTable for HttpSpec {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn weight(&self) -> f32 {
        self.weight
    }

    fn build(&self, name: String, _device: &Device, _dtype: DType) -> Result<Box<dyn RewardSource>> {
        if self.batch_size == 0 {
            return Err(Error::Invalid("batch_size must be at least 1".into()));
        }
        let reach = self.reach();
        Ok(Box::new(HttpSource::new(
            name,
            &self.url,
            reach.client()?,
            self.batch_size,
            self.max_concurrency,
            self.max_failure_rate,
        )))
    }
}

impl HttpSpec {
    fn reach(&self) -> Reach<'_> {
        reach_of!(self)
    }
}

pub struct HttpSource {
    name: String,
    url: String,
    client: Client,
    batch_size: usize,
    max_concurrency: usize,
    budget: FailureBudget,
}

impl HttpSource {
    pub fn new(
        name: impl Into<String>,
        url: &str,
        client: Client,
        batch_size: usize,
        max_concurrency: usize,
        max_failure_rate: f64,
    ) -> HttpSource {
        let name = name.into();
        HttpSource {
            budget: FailureBudget::new(&name, url, max_failure_rate),
            name,
            url: url.to_string(),
            client,
            batch_size: batch_size.max(1),
            max_concurrency,
        }
    }
}

impl RewardSource for HttpSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, samples: &[Sample]) -> Result<Vec<Option<f32>>> {
        let batches: Vec<&[Sample]> = samples.chunks(self.batch_size).collect();
        let answers = in_parallel(&batches, self.max_concurrency, |batch| {
            let started = Instant::now();
            let scores = self
                .client
                .post_json(&self.url, &batch_json(batch))
                .map_err(|e| e.to_string())
                .and_then(|answer| read_scores(&answer, batch.len()));
            (scores, started.elapsed().as_secs_f64())
        });
        let mut tally = Tally::new(samples.len());
        for ((answer, secs), batch) in answers.into_iter().zip(&batches) {
            tally.add(answer, batch.len(), secs);
        }
        tally.settle(&self.budget)
    }

    fn call_stats(&self) -> Option<CallStats> {
        self.budget.take()
    }
}
