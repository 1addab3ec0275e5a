//! The algorithms on the shared step. Each is one file that says how a
//! scored rollout batch becomes what its loss weighs (advantages, and the
//! targets of anything else it trains), which policy loss it optimises,
//! what it trains besides the policy (PPO's critic), and which metrics it
//! adds. The step ([`super::Run`]) builds the one `train.algo` names from
//! [`REGISTRY`] and never asks which it is: adding an algorithm is its file
//! and a line there. docs/algorithm.md gives each one's formulas.

mod ppo;
mod rloo;

use candle_core::{Device, Tensor};

use crate::algo::{Aggregation, RatioLevel};
use crate::error::{Error, Result};
use crate::model::scoring::Sequences;
use crate::model::{Model, ModelConfig};
use crate::report::Metrics;
use crate::train::config::TrainConfig;

/// The algorithms, by the name `train.algo` takes.
pub const REGISTRY: &[Entry] = &[rloo::ENTRY, ppo::ENTRY];

/// An algorithm's registry line.
pub struct Entry {
    /// `train.algo`'s value for it (verl's `adv_estimator` name where it has one).
    pub name: &'static str,
    /// Other names it goes by (TRL's, verl's, OpenRLHF's).
    pub aliases: &'static [&'static str],
    /// What it is, in a few words, for `--help` and errors.
    pub about: &'static str,
    /// Refuses options it cannot run with, naming them.
    pub check: fn(&TrainConfig) -> std::result::Result<(), String>,
    /// Builds it for a run.
    pub start: fn(&Start) -> Result<Box<dyn Algorithm>>,
}

/// The registry line of `name` (or one of its aliases).
pub fn find(name: &str) -> std::result::Result<&'static Entry, String> {
    REGISTRY.iter().find(|e| e.name == name || e.aliases.contains(&name)).ok_or_else(|| {
        let known: Vec<String> = REGISTRY.iter().map(|e| format!("{} ({})", e.name, e.about)).collect();
        format!("train.algo: `{name}` is not an algorithm rloo has; it has {}", known.join(", "))
    })
}

/// What building an algorithm may read.
pub struct Start<'a> {
    pub cfg: &'a TrainConfig,
    pub policy_dir: &'a std::path::Path,
    pub policy: &'a ModelConfig,
    pub device: &'a Device,
}

/// The scored rollout batch an algorithm turns into [`Targets`].
pub struct Batch<'a> {
    /// Completions per prompt: row `i` belongs to prompt `i / k`.
    pub k: usize,
    /// Shaped scores (`None`: unscorable).
    pub scores: &'a [Option<f32>],
    /// KL to the reference per token (N, Tc), when there is a reference.
    pub token_kl: Option<&'a Tensor>,
    /// KL per completion (zeros without a reference).
    pub seq_kl: &'a [f32],
    /// The completion mask (N, Tc).
    pub mask: &'a Tensor,
    /// What [`Algorithm::rollout_values`] gave.
    pub values: Option<&'a Tensor>,
}

/// What a step's loss weighs.
pub struct Targets {
    /// Per completion (N,), or per token (N, Tc).
    pub advantages: Tensor,
    /// The tokens that enter the loss (N, Tc).
    pub mask: Tensor,
    /// Per-token returns and the values they were computed with, for an
    /// algorithm that trains a value model.
    pub returns: Option<Tensor>,
    pub values: Option<Tensor>,
}

/// The clipped policy loss an algorithm optimises (docs/algorithm.md section 4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossShape {
    pub ratio: RatioLevel,
    pub aggregation: Aggregation,
}

/// One micro-batch of the optimisation, for loss terms beside the policy's.
pub struct Micro<'a> {
    /// Its completions.
    pub part: &'a Sequences<'a>,
    /// Its rows of a rollout tensor (N, Tc), cut to its width.
    pub rows: &'a dyn Fn(&Tensor) -> Result<Tensor>,
    pub targets: &'a Targets,
    /// Its loss mask (rows of [`Targets::mask`]).
    pub mask: &'a Tensor,
    /// What the mini-batch's loss is divided by.
    pub denominator: f64,
    pub device: &'a Device,
}

/// A model an algorithm trains beside the policy.
pub struct Trained<'a> {
    /// Where checkpoints and the output keep it.
    pub subdir: &'static str,
    pub model: &'a Model,
    pub learning_rate: f64,
}

/// Named sums that an algorithm's loss terms add up over a step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally(Vec<(&'static str, f64)>);

impl Tally {
    pub fn add(&mut self, name: &'static str, value: f64) {
        match self.0.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 += value,
            None => self.0.push((name, value)),
        }
    }

    pub fn merge(&mut self, other: &Tally) {
        for &(name, value) in &other.0 {
            self.add(name, value);
        }
    }

    pub fn get(&self, name: &str) -> f64 {
        self.0.iter().find(|(n, _)| *n == name).map_or(0.0, |(_, v)| *v)
    }
}

/// What an algorithm adds to the shared step.
pub trait Algorithm: Send + Sync {
    /// The policy loss it optimises.
    fn loss(&self) -> LossShape;

    /// Forward passes over the rollout beside the policy's and the
    /// reference's, without gradients (PPO: the critic's values).
    fn rollout_values(&self, _seqs: &Sequences, _device: &Device, _chunk: usize) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// What the loss weighs, from the scored batch; sets its metrics.
    fn targets(&self, batch: &Batch<'_>, metrics: &mut Metrics) -> Result<Targets>;

    /// Loss terms beside the policy's on one micro-batch (PPO: the value
    /// loss), differentiable in the models of [`trained`](Self::trained),
    /// with the sums it reports.
    fn extra_loss(&self, _micro: &Micro<'_>) -> Result<Option<(Tensor, Tally)>> {
        Ok(None)
    }

    /// The models it trains beside the policy.
    fn trained(&self) -> Vec<Trained<'_>> {
        Vec::new()
    }

    /// The same, to be replaced by a checkpoint's.
    fn trained_mut(&mut self) -> Vec<&mut Model> {
        Vec::new()
    }

    /// Its metrics from the sums of a step's [`extra_loss`](Self::extra_loss).
    fn record(&self, _tally: &Tally, _metrics: &mut Metrics) {}
}

/// Builds the algorithm `cfg.train.algo` names.
pub fn start(start: &Start) -> Result<Box<dyn Algorithm>> {
    let entry = find(&start.cfg.train.algo).map_err(Error::Invalid)?;
    (entry.start)(start)
}

/// Per-completion advantages as the (N,) tensor the loss reads.
pub fn per_sequence(values: &[f32], device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_vec(values.to_vec(), values.len(), device)?)
}
