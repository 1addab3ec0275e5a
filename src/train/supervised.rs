//! The loop that SFT and reward-model training share: epochs of seeded
//! shuffled optimizer steps, each accumulated over micro-batches, clipped,
//! scheduled and guarded against non-finite values; step metrics, the
//! held-out evaluation after each epoch, and the save on Ctrl-C or
//! divergence. What differs between the two is an [`Objective`].

use std::path::Path;

use candle_core::Tensor;

use super::config::Schedule;
use super::optim::{learning_rate, AdamW, GradAccumulator, StepGuard};
use super::stop;
use crate::error::Result;
use crate::generate::Rng;
use crate::model::{Model, Network};
use crate::report::{Metrics, MetricsSink};

/// The loop's options, as `sft` and `reward train` name them.
#[derive(Debug, Clone)]
pub struct LoopOptions {
    pub per_device_train_batch_size: usize,
    pub gradient_accumulation_steps: usize,
    pub num_train_epochs: usize,
    pub learning_rate: f64,
    pub lr_scheduler_type: Schedule,
    /// Warm-up as a fraction of all optimizer steps (rounded up).
    pub warmup_ratio: f64,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
    pub max_skipped_steps: usize,
    /// Log every N steps, and after every evaluation.
    pub logging_steps: usize,
    pub seed: u64,
    /// The random stream of each epoch's order (with the epoch + 1).
    pub order_stream: u64,
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

/// Trains `model` on `train` with `objective`, logging to `sinks`.
pub fn train_supervised<O: Objective>(
    model: &Model,
    train: &[O::Example],
    objective: &mut O,
    opts: &LoopOptions,
    sinks: &mut dyn MetricsSink,
    output_dir: &Path,
) -> Result<LoopSummary> {
    let mini = opts.per_device_train_batch_size * opts.gradient_accumulation_steps;
    let steps_per_epoch = train.len().div_ceil(mini);
    let total_steps = steps_per_epoch * opts.num_train_epochs;
    let warmup = (opts.warmup_ratio * total_steps as f64).ceil() as usize;
    let mut optimizer = AdamW::new(0.9, 0.999, 1e-8, opts.weight_decay);
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
                grads.add(model.params(), &loss.backward()?)?;
            }
            let grad_norm = grads.clip(opts.max_grad_norm)?;
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
            if step % opts.logging_steps.max(1) == 0 || evaluated.is_some() {
                sinks.log(step as u64, &m)?;
                sinks.flush()?;
            }
            stop::save_if_stopping(&guard, model, output_dir, step)?;
        }
    }
    Ok(LoopSummary { steps: step, last_loss })
}
