//! Evaluation on held-out prompts: sample from one or two models, score
//! the completions with the reward sources, measure completion lengths and
//! the KL to a reference model, and the win rate of model A over model B
//! (or over a reference answer) as judged by a reward model or an LLM judge.

use std::collections::BTreeMap;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use crate::data::prompts::PromptDataset;
use crate::data::Tokenizer;
use crate::error::{Error, Result};
use crate::generate::{GenerateOptions, Sampler, Sampling, Stepping, StopCriteria};
use crate::model::scoring::completion_logprobs_chunked;
use crate::model::{HeadKind, Model, Network};
use crate::reward::judge::{Ask, Judge};
use crate::reward::RewardSet;
use crate::rollout::Rollout;

#[derive(Debug, Clone)]
pub struct EvalOptions {
    pub samples_per_prompt: usize,
    pub max_new_tokens: usize,
    pub temperature: f64,
    pub seed: u64,
    pub batch_size: usize,
}

/// Mean and population standard deviation.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Spread {
    pub mean: f64,
    pub std: f64,
}

impl Spread {
    pub fn of(xs: impl IntoIterator<Item = f64>) -> Option<Self> {
        let xs: Vec<f64> = xs.into_iter().collect();
        let (mean, std) = crate::stats::mean_std(&xs, crate::stats::Deviation::Population)?;
        Some(Self { mean, std })
    }
}

/// One model's results.
#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    pub model: String,
    /// The weighted total of the reward sources.
    pub reward: Option<Spread>,
    /// Each source's own scores.
    pub rewards: Vec<(String, Option<Spread>)>,
    /// Each source's score of every completion, in the rollout's order.
    #[serde(skip)]
    pub scores: Vec<(String, Vec<Option<f32>>)>,
    /// The weighted total of every completion, in the rollout's order.
    #[serde(skip)]
    pub totals: Vec<Option<f32>>,
    pub length: Option<Spread>,
    /// Share of completions that ended with EOS.
    pub eos_rate: f64,
    /// Sequence KL to the reference (k1, at the sampling temperature).
    pub kl: Option<Spread>,
    /// The completions, over every prompt in order.
    #[serde(skip)]
    pub rollout: Rollout,
}

/// Samples, scores and measures one model on the prompts.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_model(
    name: &str,
    model: &Model,
    tokenizer: &Tokenizer,
    prompts: &PromptDataset,
    rewards: &RewardSet,
    reference: Option<&Model>,
    opts: &EvalOptions,
    device: &Device,
) -> Result<ModelReport> {
    check_models(model, tokenizer, reference, opts)?;
    let stop = StopCriteria::model_eos_ids(model.dir(), tokenizer)?;
    let sampling =
        if opts.temperature > 0.0 { Sampling::temperature(opts.temperature as f32) } else { Sampling::greedy() };
    let gen_opts = GenerateOptions {
        max_new_tokens: opts.max_new_tokens,
        num_return_sequences: opts.samples_per_prompt,
        sampling,
        repetition_penalty: 1.0,
        stop: StopCriteria { token_ids: stop, strings: vec![] },
        batch_size: opts.batch_size,
        sampler: Sampler::from_env(device)?,
        stepping: Stepping::from_env(device)?,
        seed: opts.seed,
        prompt_offset: 0,
        max_positions: model.config().max_positions(),
    };
    let rows = (0..prompts.len()).collect();
    let rollout = Rollout::sample(model.frozen(), prompts, rows, &gen_opts, tokenizer, device)?;
    let reference = reference.map(|r| (model.frozen(), r.frozen(), opts.temperature.max(1e-6)));
    measure(name, rollout, prompts, rewards, reference, device, opts.batch_size)
}

/// Scores and measures sampled completions; with `reference` (the
/// sampling network, the reference and the temperature), their sequence
/// KL (k1) to the reference.
pub fn measure(
    name: &str,
    rollout: Rollout,
    prompts: &PromptDataset,
    rewards: &RewardSet,
    reference: Option<(&Network, &Network, f64)>,
    device: &Device,
    batch_size: usize,
) -> Result<ModelReport> {
    let scores = rewards.score(&rollout.samples(prompts))?;
    let ended = rollout.ended_with_eos();
    let kl = match reference {
        Some((model, reference, t)) => {
            let seqs = rollout.sequences(prompts);
            let lp = completion_logprobs_chunked(model, &seqs, t, device, batch_size)?;
            let lp_ref = completion_logprobs_chunked(reference, &seqs, t, device, batch_size)?;
            let kls = (lp.logprobs - lp_ref.logprobs)?.sum(1)?.to_vec1::<f32>()?.into_iter().map(f64::from);
            Spread::of(kls)
        }
        None => None,
    };
    Ok(ModelReport {
        model: name.to_string(),
        reward: Spread::of(scores.total.iter().flatten().map(|&s| s as f64)),
        rewards: scores
            .per_source
            .iter()
            .map(|(n, s)| (n.clone(), Spread::of(s.iter().flatten().map(|&x| x as f64))))
            .collect(),
        scores: scores.per_source,
        totals: scores.total,
        length: Spread::of(rollout.completions.flat().iter().map(|c| c.tokens.len() as f64)),
        eos_rate: ended.iter().filter(|&&e| e).count() as f64 / ended.len().max(1) as f64,
        kl,
        rollout,
    })
}

/// The share of completions whose scores pass thresholds, e.g. positive
/// reviews as those with praise and no criticism:
/// `above = { praise = 0.5 }, below = { criticism = 0.5 }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Share {
    pub name: String,
    /// Reward source name -> the score a completion must exceed.
    #[serde(default)]
    pub above: BTreeMap<String, f64>,
    /// Reward source name -> the score a completion must stay under.
    #[serde(default)]
    pub below: BTreeMap<String, f64>,
}

impl Share {
    /// Checks that it has a condition and names only the given sources.
    pub fn validate(&self, sources: &[&str]) -> Result<()> {
        if self.above.is_empty() && self.below.is_empty() {
            return Err(Error::Invalid(format!("share {:?}: give `above` or `below` thresholds", self.name)));
        }
        match self.above.keys().chain(self.below.keys()).find(|k| !sources.contains(&k.as_str())) {
            Some(k) => Err(Error::Invalid(format!(
                "share {:?}: no reward named {k:?} (the rewards are {})",
                self.name,
                sources.join(", ")
            ))),
            None => Ok(()),
        }
    }

    /// The share of completions that every named source scored, strictly
    /// above each `above` and below each `below` threshold; `scores` are
    /// each source's scores of the completions (`ModelReport::scores`).
    pub fn of(&self, scores: &[(String, Vec<Option<f32>>)]) -> Result<f64> {
        let names: Vec<&str> = scores.iter().map(|(n, _)| n.as_str()).collect();
        self.validate(&names)?;
        let source = |name: &str| &scores.iter().find(|(n, _)| n == name).expect("validated").1;
        // (scores, threshold, whether a score must be above it), resolved once.
        let conditions: Vec<(&Vec<Option<f32>>, f64, bool)> = (self.above.iter().map(|(n, t)| (source(n), *t, true)))
            .chain(self.below.iter().map(|(n, t)| (source(n), *t, false)))
            .collect();
        let passes = |i: usize| {
            conditions
                .iter()
                .all(|(s, t, above)| s[i].map(f64::from).is_some_and(|s| if *above { s > *t } else { s < *t }))
        };
        let n = scores.first().map_or(0, |(_, s)| s.len());
        Ok((0..n).filter(|&i| passes(i)).count() as f64 / n.max(1) as f64)
    }
}

/// Win rate of A over B: the share of (prompt, sample) pairs where the
/// reward source named `judge` (one of the rewards both reports were
/// scored with) scores A's completion higher; ties count one half.
pub fn win_rate(judge: &str, a: &ModelReport, b: &ModelReport) -> Result<f64> {
    if a.rollout.len() != b.rollout.len() {
        return Err(Error::Invalid("the two models have different numbers of samples".into()));
    }
    let scores = |r: &ModelReport| -> Result<Vec<Option<f32>>> {
        let found = r.scores.iter().find(|(n, _)| n == judge);
        found
            .map(|(_, s)| s.clone())
            .ok_or_else(|| Error::Invalid(format!("no reward named {judge:?} scored {}", r.model)))
    };
    win_share(&scores(a)?, &scores(b)?).ok_or_else(|| Error::Invalid("the judge scored no pair of completions".into()))
}

/// The share of pairs (`a[i]`, `b[i]`) both scored where `a`'s score is
/// higher, ties counting one half; `None` when no pair is scored.
pub fn win_share(a: &[Option<f32>], b: &[Option<f32>]) -> Option<f64> {
    let outcomes: Vec<f64> = a
        .iter()
        .zip(b)
        .filter_map(|(x, y)| match (x, y) {
            (Some(x), Some(y)) if x > y => Some(1.0),
            (Some(x), Some(y)) if x < y => Some(0.0),
            (Some(_), Some(_)) => Some(0.5),
            _ => None,
        })
        .collect();
    crate::stats::mean(&outcomes)
}

/// What would otherwise fail late or measure nothing: a model that cannot
/// generate, a tokenizer or reference that does not fit it, no samples.
/// (Prompts are checked against the context when loaded:
/// `PromptDataset::from_prompt_column`.)
fn check_models(model: &Model, tokenizer: &Tokenizer, reference: Option<&Model>, opts: &EvalOptions) -> Result<()> {
    if model.head() != HeadKind::CausalLm {
        return Err(Error::bad_file(
            model.dir(),
            "a reward (sequence-classification) model cannot generate; evaluate a causal LM and give reward models as rewards",
        ));
    }
    tokenizer.check_model(model.config())?;
    if let Some(r) = reference {
        let (v, rv) = (model.config().vocab_size(), r.config().vocab_size());
        if r.head() != HeadKind::CausalLm || v != rv {
            return Err(Error::Invalid(format!(
                "the reference {} does not fit {}: it must be a causal LM over the same {v} tokens (it has {rv})",
                r.dir().display(),
                model.dir().display()
            )));
        }
    }
    if opts.samples_per_prompt == 0 || opts.batch_size == 0 || opts.max_new_tokens == 0 {
        return Err(Error::Invalid("samples per prompt, batch size and max new tokens must be at least 1".into()));
    }
    Ok(())
}

/// What model A's completions are judged against.
pub enum Opponent<'a> {
    /// Model B's completion of the same prompt and sample.
    Model(&'a ModelReport),
    /// A reference answer in this dataset column (e.g. TL;DR's human summaries).
    Column(&'a str),
}

/// The win rate of A as a pairwise judge sees it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct JudgedWinRate {
    /// The share of read verdicts that prefer A; ties count one half.
    pub win_rate: f64,
    /// Pairs of completions compared (each asked in both orders).
    pub pairs: usize,
    /// Verdicts read (at most two per pair).
    pub verdicts: usize,
    /// Answers without a match of the score pattern (excluded).
    pub unparsable: usize,
    /// Requests that got no answer (excluded).
    pub failed: usize,
    /// Samples whose row has no reference in the column (not compared).
    pub missing_reference: usize,
}

/// Asks the judge about every (A, opponent) pair in both orders, so that a
/// preference for the first (or second) position cancels out. Returns the
/// win rate and one JSON row per request for the record.
pub fn judged_win_rate(
    judge: &Judge,
    prompts: &PromptDataset,
    a: &ModelReport,
    opponent: Opponent,
) -> Result<(JudgedWinRate, Vec<serde_json::Value>)> {
    if let Opponent::Model(b) = opponent {
        if a.rollout.len() != b.rollout.len() {
            return Err(Error::Invalid("the two models have different numbers of samples".into()));
        }
    }
    let samples = a.rollout.completions.flat();
    let mut pairs: Vec<(usize, &str, String)> = Vec::new(); // (sample of A, A's text, opponent's text)
    let mut missing_reference = 0;
    for (i, (c, text)) in samples.iter().zip(&a.rollout.texts).enumerate() {
        let other = match &opponent {
            Opponent::Model(b) => Some(b.rollout.texts[i].clone()),
            Opponent::Column(col) => {
                prompts.rows[c.prompt_index].row.fields.get(*col).and_then(|v| v.as_str()).map(str::to_string)
            }
        };
        match other {
            Some(o) => pairs.push((i, text, o)),
            None => missing_reference += 1,
        }
    }
    if pairs.is_empty() {
        return Err(Error::Invalid("no pair to judge: no row has a reference answer in the column".into()));
    }
    let asks: Vec<Ask> = pairs
        .iter()
        .flat_map(|(i, ta, tb)| {
            let row = &prompts.rows[samples[*i].prompt_index];
            let ab = Ask { prompt: &row.prompt, row: &row.row.fields, completions: [*ta, tb.as_str()] };
            let ba = Ask { prompt: &row.prompt, row: &row.row.fields, completions: [tb.as_str(), *ta] };
            [ab, ba]
        })
        .collect();
    let verdicts = judge.verdicts(&asks);
    let (mut outcomes, mut unparsable, mut failed) = (Vec::new(), 0, 0);
    let mut record = Vec::with_capacity(verdicts.len());
    for (r, v) in verdicts.iter().enumerate() {
        let (i, a_first) = (pairs[r / 2].0, r % 2 == 0);
        let outcome = v.scores.as_ref().map(|s| {
            let (sa, sb) = if a_first { (s[0], s[1]) } else { (s[1], s[0]) };
            if sa > sb {
                1.0
            } else if sa < sb {
                0.0
            } else {
                0.5
            }
        });
        match (&v.answer, outcome) {
            (_, Some(o)) => outcomes.push(o),
            (Ok(_), None) => unparsable += 1,
            (Err(_), None) => failed += 1,
        }
        let c = &samples[i];
        record.push(serde_json::json!({
            "prompt_index": c.prompt_index,
            "sample_index": c.sample_index,
            "order": if a_first { "a_first" } else { "b_first" },
            "answer": v.answer.as_ref().ok(),
            "error": v.answer.as_ref().err(),
            "scores": v.scores,
            "a_wins": outcome,
        }));
    }
    if outcomes.is_empty() {
        return Err(Error::Invalid(format!(
            "the judge gave no readable verdict: {unparsable} answers without a score, {failed} failed requests"
        )));
    }
    let win_rate = crate::stats::mean(&outcomes).expect("checked non-empty");
    let summary =
        JudgedWinRate { win_rate, pairs: pairs.len(), verdicts: outcomes.len(), unparsable, failed, missing_reference };
    Ok((summary, record))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_counts_completions_passing_every_threshold() {
        let scores = vec![
            ("praise".to_string(), vec![Some(2.0), Some(1.0), Some(0.0), None]),
            ("criticism".to_string(), vec![Some(0.0), Some(1.0), Some(0.0), Some(0.0)]),
        ];
        let positive = Share {
            name: "positive".into(),
            above: [("praise".to_string(), 0.5)].into(),
            below: [("criticism".to_string(), 0.5)].into(),
        };
        // Only the first passes: the second criticises, the third does not
        // praise, the fourth was not scored for praise.
        assert_eq!(positive.of(&scores).unwrap(), 0.25);
        let unknown = Share { name: "x".into(), above: [("tone".to_string(), 0.0)].into(), below: BTreeMap::new() };
        let err = unknown.of(&scores).unwrap_err().to_string();
        assert!(err.contains("no reward named \"tone\"") && err.contains("praise, criticism"), "{err}");
        let empty = Share { name: "x".into(), above: BTreeMap::new(), below: BTreeMap::new() };
        assert!(empty.validate(&["praise"]).is_err());
    }
}
