//! A study's `[eval]`: each finished run's policy samples held-out prompts,
//! the completions are scored, and each reward's mean and each share (for
//! example of positive reviews) join the report's table.
//!
//! ```toml
//! [eval]
//! prompts = "data/eval_prompts.jsonl"
//! samples_per_prompt = 4
//! rank_by = "positive"          # the verdict's measure
//! [[eval.reward]]               # default: the runs' own rewards
//! type = "lexicon"
//! name = "praise"
//! positive = ["great", "superb"]
//! [[eval.share]]
//! name = "positive"
//! above = { praise = 0.5 }
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::DType;
use serde::{Deserialize, Serialize};

use crate::data::prompts::PromptDataset;
use crate::data::{DatasetSpec, Tokenizer};
use crate::error::{Error, Result};
use crate::eval::{evaluate_model, EvalOptions, Share};
use crate::model::{parse_device, Model};
use crate::reward::{build, RewardSpec};
use crate::train::rl::prompt_spec;
use crate::train::TrainConfig;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StudyEval {
    /// Held-out rows, read like the training prompts (`[data]`'s column or template).
    pub prompts: String,
    /// The split read from a dataset directory or hub dataset.
    #[serde(default = "test_split")]
    pub split: String,
    /// Use only the first N rows.
    pub take: Option<usize>,
    #[serde(default = "four")]
    pub samples_per_prompt: usize,
    /// Default: the run's `generation.response_length`.
    pub max_new_tokens: Option<usize>,
    /// Default: the run's `generation.temperature`.
    pub temperature: Option<f64>,
    /// The same for every run, so that arms are compared on the same draws.
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "sixty_four")]
    pub batch_size: usize,
    /// The measure (a reward's or a share's name) the verdict ranks arms
    /// by; default: the final training reward.
    pub rank_by: Option<String>,
    /// Default: the runs' own rewards.
    #[serde(default)]
    pub reward: Vec<RewardSpec>,
    #[serde(default)]
    pub share: Vec<Share>,
}

fn test_split() -> String {
    "test".into()
}

fn four() -> usize {
    4
}

fn sixty_four() -> usize {
    64
}

/// One column of the evaluation.
#[derive(Debug, Clone, PartialEq)]
pub enum Measure {
    /// A reward's mean score.
    Mean(String),
    /// A share of completions, in [0, 1].
    Share(String),
}

impl Measure {
    pub fn name(&self) -> &str {
        match self {
            Measure::Mean(n) | Measure::Share(n) => n,
        }
    }
}

impl StudyEval {
    fn rewards<'a>(&'a self, cfg: &'a TrainConfig) -> &'a [RewardSpec] {
        if self.reward.is_empty() {
            &cfg.reward
        } else {
            &self.reward
        }
    }

    /// The columns, in the report's order: rewards, then shares.
    pub fn measures(&self, cfg: &TrainConfig) -> Vec<Measure> {
        let means = self.rewards(cfg).iter().map(|r| Measure::Mean(r.name().to_string()));
        means.chain(self.share.iter().map(|s| Measure::Share(s.name.clone()))).collect()
    }

    /// Checks what can be checked before any run: sizes, names and thresholds.
    pub fn validate(&self, cfg: &TrainConfig) -> Result<()> {
        if self.samples_per_prompt == 0 || self.batch_size == 0 || self.max_new_tokens == Some(0) {
            return Err(Error::Invalid("samples_per_prompt, batch_size and max_new_tokens must be at least 1".into()));
        }
        let measures = self.measures(cfg);
        let names: Vec<&str> = measures.iter().map(Measure::name).collect();
        if let Some(twice) = names.iter().enumerate().find(|(i, n)| names[..*i].contains(n)) {
            return Err(Error::Invalid(format!("two evaluation measures are named {:?}", twice.1)));
        }
        let sources: Vec<&str> = self.rewards(cfg).iter().map(RewardSpec::name).collect();
        self.share.iter().try_for_each(|s| s.validate(&sources))?;
        match &self.rank_by {
            Some(r) if !names.contains(&r.as_str()) => {
                Err(Error::Invalid(format!("rank_by {r:?} is not a measure of [eval] (they are {})", names.join(", "))))
            }
            _ => Ok(()),
        }
    }

    /// Samples the prompts with the policy saved in `run_dir` and measures
    /// the completions; a measure nothing scored is `None`.
    pub fn evaluate(&self, cfg: &TrainConfig, run_dir: &Path) -> Result<BTreeMap<String, Option<f64>>> {
        let device = parse_device(&cfg.model.device)?;
        let policy = Model::load(run_dir, &device)?;
        let tokenizer = Tokenizer::from_dir(run_dir)?;
        let source = DatasetSpec { take: self.take, ..DatasetSpec::named(&self.prompts).with_split(&self.split) };
        let prompts = PromptDataset::load(&source, &prompt_spec(cfg, policy.config()), &tokenizer)?;
        let rewards = build(self.rewards(cfg), &device, DType::F32)?;
        let opts = EvalOptions {
            samples_per_prompt: self.samples_per_prompt,
            max_new_tokens: self.max_new_tokens.unwrap_or(cfg.generation.response_length),
            temperature: self.temperature.unwrap_or(cfg.generation.temperature),
            seed: self.seed,
            batch_size: self.batch_size,
        };
        let report = evaluate_model("policy", &policy, &tokenizer, &prompts, &rewards, None, &opts, &device)?;
        let mut out: BTreeMap<String, Option<f64>> =
            report.rewards.iter().map(|(name, spread)| (name.clone(), spread.map(|s| s.mean))).collect();
        for share in &self.share {
            out.insert(share.name.clone(), Some(share.of(&report.scores)?));
        }
        Ok(out)
    }
}
