//! The algorithms on the shared step. Each is one file that says how a
//! scored rollout batch becomes what its loss weighs (advantages, and the
//! targets of anything else it trains), which policy loss it optimises,
//! what it trains besides the policy (PPO's critic), and which metrics it
//! adds. The step ([`super::Run`]) builds the one `train.algo` names from
//! [`REGISTRY`] and never asks which it is: adding an algorithm is its file
//! and a line there. docs/algorithm.md gives each one's formulas.

mod dr_grpo;
mod grpo;
mod ppo;
mod reinforce_plus_plus;
mod reinforce_plus_plus_baseline;
mod rloo;

use candle_core::{Device, Tensor};

use crate::algo::{Aggregation, RatioLevel};
use crate::error::{Error, Result};
use crate::model::readback::{HostValues, Readback};
use crate::model::scoring::Sequences;
use crate::model::{Model, ModelConfig};
use crate::report::Metrics;
use crate::train::config::TrainConfig;

/// The algorithms, by the name `train.algo` takes.
pub const REGISTRY: &[Entry] = &[
    rloo::ENTRY,
    grpo::ENTRY,
    dr_grpo::ENTRY,
    reinforce_plus_plus::ENTRY,
    reinforce_plus_plus_baseline::ENTRY,
    ppo::ENTRY,
];

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

/// A micro-batch's [`Tally`], once the step has read what it queued.
pub type PendingTally = Box<dyn FnOnce(&HostValues) -> Tally>;

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

    /// The sums in the order they were first added.
    pub fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.0.iter().map(|(_, v)| *v)
    }

    /// Replaces the sums, in the order of [`Tally::values`].
    pub fn set_values(&mut self, values: &[f64]) {
        for ((_, v), &new) in self.0.iter_mut().zip(values) {
            *v = new;
        }
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
    /// with the sums it reports, from values it queues on `readback`.
    fn extra_loss(&self, _micro: &Micro<'_>, _readback: &mut Readback) -> Result<Option<(Tensor, PendingTally)>> {
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

/// A batch's scorable completions as ragged per-token rows (each as long
/// as its completion), and back to (N, Tc) tensors: the per-token
/// algorithms work on these, and unscorable completions, which teach
/// nothing, leave their loss mask.
pub struct LiveRows {
    /// Unmasked tokens of every completion.
    lengths: Vec<usize>,
    /// The scorable completions.
    live: Vec<usize>,
    /// (N, Tc)
    shape: (usize, usize),
    device: Device,
}

impl LiveRows {
    pub fn new(scores: &[Option<f32>], mask: &Tensor) -> Result<LiveRows> {
        let lengths = mask.sum(1)?.to_vec1::<f32>()?.iter().map(|&l| l as usize).collect();
        let live = (0..scores.len()).filter(|&i| scores[i].is_some()).collect();
        Ok(LiveRows { lengths, live, shape: mask.dims2()?, device: mask.device().clone() })
    }

    pub fn live(&self) -> &[usize] {
        &self.live
    }

    /// The live rows of an (N, Tc) tensor, each cut to its completion.
    pub fn take(&self, t: &Tensor) -> Result<Vec<Vec<f32>>> {
        let rows: Vec<Vec<f32>> = t.to_vec2()?;
        Ok(self.live.iter().map(|&i| rows[i][..self.lengths[i]].to_vec()).collect())
    }

    /// Each live row filled with `value`.
    pub fn filled(&self, value: impl Fn(usize) -> f32) -> Vec<Vec<f32>> {
        self.live.iter().map(|&i| vec![value(i); self.lengths[i]]).collect()
    }

    /// Live rows back to (N, Tc), zero elsewhere.
    pub fn padded(&self, rows: Vec<Vec<f32>>) -> Result<Tensor> {
        let (n, width) = self.shape;
        let mut out = vec![Vec::new(); n];
        for (&i, row) in self.live.iter().zip(rows) {
            out[i] = row;
        }
        Ok(crate::algo::ppo::padded(&out, width, &self.device)?)
    }

    /// The completion mask of the live rows.
    pub fn mask(&self) -> Result<Tensor> {
        self.padded(self.filled(|_| 1.0))
    }
}

/// Refuses the options that shape RLOO's own advantages (`baseline`,
/// `normalize_advantage`), GRPO's (`scale_rewards`) and PPO's (`[ppo]`) in
/// another algorithm, which would ignore them.
pub fn refuse_others_options(cfg: &TrainConfig, name: &str, own: &[&str]) -> std::result::Result<(), String> {
    let r = &cfg.rloo;
    let set = [
        ("rloo.baseline", r.baseline != crate::algo::Baseline::default()),
        ("rloo.normalize_advantage", r.normalize_advantage),
        ("rloo.scale_rewards", r.scale_rewards != crate::algo::ScaleRewards::default()),
        ("the [ppo] options", cfg.ppo != crate::train::config::PpoSection::default()),
    ];
    match set.iter().find(|(key, on)| *on && !own.contains(key)) {
        Some((key, _)) => Err(format!("{key} does not apply to train.algo = \"{name}\"")),
        None => Ok(()),
    }
}

/// Refuses `ratio` and `aggregation` options other than the defaults in an
/// algorithm that defines its own loss.
pub fn refuse_loss_options(cfg: &TrainConfig, name: &str, own: LossShape) -> std::result::Result<(), String> {
    let r = &cfg.rloo;
    let defaults = crate::train::config::RlooSection::default();
    if (r.ratio, r.aggregation) != (defaults.ratio, defaults.aggregation)
        && (r.ratio, r.aggregation) != (own.ratio, own.aggregation)
    {
        return Err(format!(
            "train.algo = \"{name}\" optimises its own loss ({:?} ratio, {:?} aggregation): leave rloo.ratio and \
             rloo.aggregation unset",
            own.ratio, own.aggregation
        ));
    }
    Ok(())
}

/// Refuses fewer than two completions per prompt for an algorithm whose
/// baseline is its prompt's group.
pub fn needs_groups(cfg: &TrainConfig, name: &str) -> std::result::Result<(), String> {
    match cfg.rloo.k {
        k if k < 2 => Err(format!("rloo.k (--rloo_k) must be at least 2 for {name}'s group baseline, got {k}")),
        _ => Ok(()),
    }
}
