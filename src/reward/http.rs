//! `type = "http"`: a scoring service. Each batch of `batch_size` samples is
//! one POST of `{"prompts": [...], "completions": [...], "rows": [...]}`
//! (prompts as text or `{"role", "content"}` message lists), answered by
//! `{"scores": [...]}` or OpenRLHF's `{"rewards": [...]}`; `null` is "no
//! score". `rloo reward serve` speaks this protocol.

use std::time::Instant;

use super::remote::{batch_json, read_scores, CallStats, FailureBudget, Tally};
use super::{RewardSource, Sample};
use crate::error::Result;
use crate::service::{in_parallel, Client};

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
