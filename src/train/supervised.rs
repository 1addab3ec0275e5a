//! The loop that SFT and reward-model training share: epochs of seeded
//! shuffled optimizer steps, each accumulated over micro-batches, clipped,
//! scheduled and guarded against non-finite values; step metrics, the
//! held-out evaluation after each epoch, and the save on Ctrl-C or
//! divergence, through the run [`Harness`]. What differs between the two is an [`Objective`].

use candle_core::Tensor;

use super::checkpoint::checkpoint_dir;
use super::config::{check_optimizer, in_range, positive, Bound, OptimizerOptions, Schedule};
use super::harness::{Harness, Stopping};
use super::optim::{learning_rate, warmup_steps, AdamW, GradAccumulator, StepGuard};
use crate::error::{Error, Result};
use crate::generate::Rng;
use crate::io::write_dir_atomic;
use crate::model::{Model, Network};
use crate::report::Metrics;

/// The loop's options, as `sft` and `reward train` name them.
#[derive(Debug, Clone)]
pub struct LoopOptions {
    pub per_device_train_batch_size: usize,
    pub gradient_accumulation_steps: usize,
    pub num_train_epochs: usize,
    pub learning_rate: f64,
    pub lr_scheduler_type: Schedule,
    /// Warm-up optimizer steps; 0: `warmup_ratio` of all steps (rounded up).
    pub warmup_steps: usize,
    pub warmup_ratio: f64,
    pub optimizer: OptimizerOptions,
    pub max_skipped_steps: usize,
    pub seed: u64,
    /// The random stream of each epoch's order (with the epoch + 1).
    pub order_stream: u64,
}

impl LoopOptions {
    /// Checks values that no type can express; messages name the option.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("per_device_train_batch_size", self.per_device_train_batch_size),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps),
            ("num_train_epochs", self.num_train_epochs),
        ] {
            if v == 0 {
                return Err(Error::Invalid(format!("{name} must be at least 1")));
            }
        }
        positive("learning_rate", self.learning_rate)?;
        in_range("warmup_ratio", self.warmup_ratio, Bound::Closed(0.0), Bound::Closed(1.0))?;
        check_optimizer("", &self.optimizer)
    }
}

/// A model to start from and training rows: the keys with no default.
pub fn require_model_and_data(model: &str, dataset: &crate::data::DatasetSpec) -> Result<()> {
    if model.is_empty() {
        return Err(Error::Invalid("no model to start from: set model (or --model / --model_name_or_path)".into()));
    }
    if dataset.name.is_empty() {
        return Err(Error::Invalid("no training rows: set dataset.name (or --dataset / --dataset_name)".into()));
    }
    Ok(())
}

/// Checks the data options both supervised trainers share: the longest
/// sequence and the held-out fraction.
pub fn validate_data(max_length: usize, eval_fraction: f64) -> Result<()> {
    in_range("max_length", max_length as f64, Bound::Closed(1.0), Bound::Open(f64::INFINITY))?;
    in_range("eval_fraction", eval_fraction, Bound::Closed(0.0), Bound::Open(1.0))
}

/// What a trainer puts into the loop.
pub trait Objective {
    type Example;

    /// The loss of `micro` as its share of the loss of the optimizer step
    /// over `step` (so that the shares add up to the step's loss however it
    /// is split), and a count that [`step_metrics`](Self::step_metrics)
    /// receives summed over the step.
    fn micro_loss(
        &mut self,
        net: &Network,
        micro: &[&Self::Example],
        step: &[&Self::Example],
    ) -> Result<(Tensor, usize)>;

    /// Adds the trainer's own metrics of an optimizer step over `step_len`
    /// examples (`count`: the summed counts of its micro-batches).
    fn step_metrics(&self, m: &mut Metrics, step_len: usize, count: usize, epoch_progress: f64);

    /// The held-out metrics after an epoch; `None` without held-out rows.
    fn evaluate(&mut self, net: &Network) -> Result<Option<Metrics>>;
}

/// How the loop ended.
#[derive(Debug, Clone)]
pub struct LoopSummary {
    pub steps: usize,
    /// The loss of the last optimizer step.
    pub last_loss: f64,
}

/// Trains `model` on `train` with `objective`, reporting through `harness`.
pub fn train_supervised<O: Objective>(
    model: &Model,
    train: &[O::Example],
    objective: &mut O,
    opts: &LoopOptions,
    harness: &mut Harness,
) -> Result<LoopSummary> {
    let mini = opts.per_device_train_batch_size * opts.gradient_accumulation_steps;
    let steps_per_epoch = train.len().div_ceil(mini);
    let total_steps = steps_per_epoch * opts.num_train_epochs;
    let warmup = warmup_steps(opts.warmup_steps, opts.warmup_ratio, total_steps);
    let o = &opts.optimizer;
    let mut optimizer = AdamW::new(o.adam_beta1, o.adam_beta2, o.adam_epsilon, o.weight_decay);
    let mut grads = GradAccumulator::default();
    let mut guard = StepGuard::new(opts.max_skipped_steps);
    let (mut step, mut skipped, mut last_loss) = (0usize, 0usize, f64::NAN);
    for epoch in 0..opts.num_train_epochs {
        let order = Rng::stream(opts.seed, &[opts.order_stream, epoch as u64 + 1]).permutation(train.len());
        for batch in order.chunks(mini) {
            let examples: Vec<&O::Example> = batch.iter().map(|&i| &train[i]).collect();
            grads.clear();
            let (mut loss_sum, mut count) = (0f64, 0usize);
            for micro in examples.chunks(opts.per_device_train_batch_size) {
                let (loss, n) = objective.micro_loss(model.network(), micro, &examples)?;
                loss_sum += loss.to_scalar::<f32>()? as f64;
                count += n;
                grads.add(model.params(), &crate::model::backward(&loss, &[model])?)?;
            }
            let grad_norm = grads.clip(o.max_grad_norm)?;
            let lr = learning_rate(opts.learning_rate, opts.lr_scheduler_type, step, total_steps, warmup);
            if guard.check(step, loss_sum, grad_norm) {
                optimizer.step(model.params(), &grads, lr)?;
            } else {
                skipped += 1;
            }
            step += 1;
            last_loss = loss_sum;
            let mut m = Metrics::new();
            m.set("train/loss", loss_sum);
            m.set("train/grad_norm", grad_norm);
            m.set("train/lr", lr);
            m.set("train/skipped_steps", skipped as f64);
            objective.step_metrics(&mut m, examples.len(), count, step as f64 / steps_per_epoch as f64);
            let evaluated = match step % steps_per_epoch == 0 {
                true => objective.evaluate(model.frozen())?,
                false => None,
            };
            for (name, value) in evaluated.iter().flat_map(Metrics::iter) {
                m.set(name, value);
            }
            harness.log(step, &m, evaluated.is_some())?;
            if let Some(stopping) = Stopping::now(&guard) {
                // These loops do not resume: the model so far is what is kept.
                let dir = checkpoint_dir(harness.output_dir(), step);
                write_dir_atomic(&dir, |tmp| model.save_files(tmp))?;
                let resume = "this command does not resume: run it again with --overwrite_output_dir to start over";
                return Err(stopping.error(&guard, step, &dir, resume));
            }
        }
    }
    Ok(LoopSummary { steps: step, last_loss })
}
