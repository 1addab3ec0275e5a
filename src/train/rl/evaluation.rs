//! Evaluation during training (TRL's `eval_strategy = "steps"`): after
//! the first rollout step, every `eval.steps`, and after the last, the policy answers each
//! held-out prompt once with the run's sampling options and a seed of its
//! own (the same at every evaluation, so that evaluations differ only by
//! the policy). The reward sources score the answers; the metrics are
//! logged as `eval/...`, and their sample table is the one printed. The
//! reference model's answers, drawn once at the start with the same seed,
//! give the win rate. Nothing here touches the run's random streams, so a
//! run trains to the same weights with or without evaluation.

use super::{setup::prompt_spec, Run};
use crate::data::prompts::PromptDataset;
use crate::data::DatasetSpec;
use crate::error::{Error, Result};
use crate::eval::{measure, win_share, ModelReport};
use crate::generate::GenerateOptions;
use crate::report::{Metrics, SampleTable};
use crate::rng::streams;
use crate::rng::Rng;
use crate::rollout::Rollout;
use crate::train::config::{EvalStrategy, TrainConfig};

pub(super) struct Evaluation {
    prompts: PromptDataset,
    /// Evaluate after every this many rollout steps.
    every: usize,
    generation: GenerateOptions,
    /// The reference's answers' total scores (none: the run has no reference).
    reference_scores: Option<Vec<Option<f32>>>,
}

/// The held-out prompts' source, if the run has any.
fn held_out_source(cfg: &TrainConfig) -> Option<DatasetSpec> {
    let e = &cfg.eval;
    let (name, config) = match (&e.dataset, &e.split) {
        (Some(other), _) => (other.clone(), None),
        (None, Some(_)) => (cfg.data.path.clone(), cfg.data.config.clone()),
        (None, None) => return None,
    };
    let split = e.split.clone().unwrap_or_else(|| "test".into());
    Some(DatasetSpec { name, config, split, filter: cfg.data.filter.clone(), take: e.take })
}

/// Checks the evaluation options; messages name the option.
pub fn validate(cfg: &TrainConfig) -> std::result::Result<(), String> {
    let e = &cfg.eval;
    if e.strategy == Some(EvalStrategy::Steps) && held_out_source(cfg).is_none() {
        return Err(
            "eval.strategy = \"steps\" needs held-out prompts: set --dataset_test_split or --eval_dataset".into()
        );
    }
    if e.steps == Some(0) || e.take == Some(0) {
        return Err("eval.steps and eval.take must be at least 1".into());
    }
    Ok(())
}

impl Evaluation {
    /// The run's evaluation; none when it does not evaluate.
    pub(super) fn start(run: &Run) -> Result<Option<Self>> {
        let cfg = &run.cfg;
        let Some(source) = held_out_source(cfg) else { return Ok(None) };
        if cfg.eval.strategy == Some(EvalStrategy::No) {
            return Ok(None);
        }
        let prompts = PromptDataset::load(&source, &prompt_spec(cfg, run.policy.config()), &run.tokenizer)?;
        if prompts.is_empty() {
            return Err(Error::Invalid(format!("no held-out prompts in {}", prompts.label)));
        }
        let rows: Vec<_> = prompts.rows.iter().map(|r| &r.row.fields).collect();
        run.rewards.check_rows(&rows)?;
        let table_every = run.sizes.steps / cfg.train.num_sample_generations.max(1);
        let every = cfg.eval.steps.unwrap_or(table_every).max(1);
        let mut generation = run.generation.clone();
        generation.num_return_sequences = 1;
        generation.seed = Rng::stream(cfg.train.seed, &[streams::EVAL_SAMPLING]).next_u64();
        tracing::info!("evaluating on {} held-out prompts from {} every {every} steps", prompts.len(), prompts.label);
        let mut evaluation = Self { prompts, every, generation, reference_scores: None };
        if let Some(reference) = &run.reference {
            let answers = evaluation.sample(run, reference.network(&run.policy)?)?;
            let scores = run.rewards.score(&answers.samples(&evaluation.prompts))?;
            evaluation.reference_scores = Some(scores.total);
        }
        Ok(Some(evaluation))
    }

    /// Whether the run evaluates after `step` (1-based) of `last`: after
    /// the first (as the first sample table is printed), every `every`, and
    /// after the last.
    pub(super) fn due(&self, step: usize, last: usize) -> bool {
        step == 1 || step.is_multiple_of(self.every) || step == last
    }

    fn sample(&self, run: &Run, network: &crate::model::Network) -> Result<Rollout> {
        let rows = (0..self.prompts.len()).collect();
        Rollout::sample(network, &self.prompts, rows, &self.generation, &run.tokenizer, &run.device)
    }

    /// Evaluates the policy: its metrics into `metrics`; gives its sample table.
    pub(super) fn evaluate(&self, run: &Run, metrics: &mut Metrics) -> Result<SampleTable> {
        let answers = self.sample(run, run.policy.frozen())?;
        let temperature = run.cfg.generation.temperature;
        let reference = match &run.reference {
            Some(r) => Some((run.policy.frozen(), r.network(&run.policy)?, temperature)),
            None => None,
        };
        let chunk = run.cfg.generation.local_rollout_forward_batch_size;
        let report = measure("policy", answers, &self.prompts, &run.rewards, reference, &run.device, chunk)?;
        self.log(&report, metrics);
        Ok(super::report::sample_table(&self.prompts, &report.rollout, &report.totals))
    }

    fn log(&self, r: &ModelReport, m: &mut Metrics) {
        if let Some(reward) = r.reward {
            m.set("eval/reward", reward.mean);
            m.set("eval/reward_std", reward.std);
        }
        if r.rewards.len() > 1 {
            for (name, spread) in &r.rewards {
                if let Some(s) = spread {
                    m.set(format!("eval/rewards/{name}/mean"), s.mean);
                }
            }
        }
        if let Some(kl) = r.kl {
            m.set("eval/kl", kl.mean);
        }
        if let Some(length) = r.length {
            m.set("eval/completions/mean_length", length.mean);
        }
        m.set("eval/completions/eos_rate", r.eos_rate);
        if let Some(win) = self.reference_scores.as_ref().and_then(|reference| win_share(&r.totals, reference)) {
            m.set("eval/win_rate", win);
        }
    }
}
