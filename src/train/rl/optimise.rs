//! The optimisation of a step: `num_ppo_epochs` passes over the rollout in
//! seeded shuffled mini-batches, each one optimizer step accumulated over
//! micro-batches: the clipped policy loss the algorithm shapes, over its
//! per-completion or per-token advantages, the KL loss where it is placed
//! there, and the algorithm's own terms (PPO's value loss), whose
//! gradients reach what it trains beside the policy. The losses'
//! diagnostics stay on the device until the optimizer step, which reads
//! them to the host at once.

use std::time::Instant;

use candle_core::Tensor;

use super::algorithm::{Micro, PendingTally, Tally, Targets};
use super::{Optimizers, Run};
use crate::algo::{self, KlPlacement, LossStats, QueuedLossStats};
use crate::dist::Communicator;
use crate::error::Result;
use crate::model::readback::{HostValues, Readback, Slot};
use crate::model::scoring::{completion_logprobs, Sequences, TokenLogprobs};
use crate::report::Metrics;
use crate::rng::streams;
use crate::rng::Rng;
use crate::train::checkpoint::TrainerState;
use crate::train::memory::{in_gib, in_use_bytes};
use crate::train::optim::{learning_rate, GradAccumulator, StepGuard};

/// Loss diagnostics summed over a step's optimisation.
#[derive(Default)]
pub(super) struct TrainStats {
    pub loss: LossStats,
    /// The sums of the algorithm's own loss terms.
    pub extra: Tally,
    pub entropy_sum: f64,
    pub tokens: f64,
    pub grad_norm: f64,
    pub skipped_steps: usize,
    /// Seconds of the training phase's parts, each timed to the end of its
    /// device work: forward passes and losses, backward passes (with the
    /// gradients' accumulation), and updates (exchange, clipping, optimizer).
    pub seconds: TrainSeconds,
    /// Memory held through the phase, where the device can say.
    pub held: Option<Held>,
}

/// Memory held as the training phase began, at the end of its first
/// micro-batch's forward (the difference is the activations a forward keeps
/// for its backward) and at most at the end of any micro-batch's forward
/// (the gradients summed so far on top).
#[derive(Debug, Clone, Copy)]
pub struct Held {
    before: u64,
    first_forward: Option<u64>,
    after_forward: u64,
}

impl Held {
    fn new(before: u64) -> Self {
        Self { before, first_forward: None, after_forward: before }
    }

    fn forward_ended(&mut self, now: u64) {
        self.first_forward.get_or_insert(now);
        self.after_forward = self.after_forward.max(now);
    }
}

#[derive(Default, Clone, Copy)]
pub(super) struct TrainSeconds {
    pub forward: f64,
    pub backward: f64,
    pub update: f64,
    /// Of `forward` and `backward`, the seconds until the host had queued
    /// their work; on a GPU the rest is the wait for the device (on the CPU
    /// there is no rest).
    pub forward_queued: f64,
    pub backward_queued: f64,
}

/// What one micro-batch queued for the host, read at its mini-batch's end.
struct QueuedMicro {
    loss: Slot,
    policy: QueuedLossStats,
    /// The sum of its tokens' entropies, and its token count.
    entropy: Slot,
    tokens: Slot,
    extra: Option<PendingTally>,
}

impl TrainStats {
    /// Adds a mini-batch's micro-batches, in their order; returns the sum
    /// of their losses.
    fn add(&mut self, queued: Vec<QueuedMicro>, host: &HostValues) -> f64 {
        let mut loss_sum = 0f64;
        for q in queued {
            loss_sum += host.scalar(q.loss) as f64;
            self.loss.add(&q.policy.stats(host));
            self.entropy_sum += host.scalar(q.entropy) as f64;
            self.tokens += host.scalar(q.tokens) as f64;
            if let Some(extra) = q.extra {
                self.extra.merge(&extra(host));
            }
        }
        loss_sum
    }

    /// The sums over every process's share of the step.
    fn sum_over(&mut self, comm: &dyn Communicator) -> Result<()> {
        let l = &mut self.loss;
        let mut sums = vec![
            l.terms,
            l.clipped,
            l.ratio_sum,
            l.ratio_sq_sum,
            l.sequences,
            l.approxkl_sum,
            l.loss_sum,
            self.entropy_sum,
            self.tokens,
        ];
        sums.extend(self.extra.values());
        comm.all_reduce_sum_f64(&mut sums)?;
        let [terms, clipped, ratio_sum, ratio_sq_sum, sequences, approxkl_sum, loss_sum, entropy_sum, tokens] =
            sums[..9]
        else {
            unreachable!("nine sums")
        };
        *l = LossStats { terms, clipped, ratio_sum, ratio_sq_sum, sequences, approxkl_sum, loss_sum };
        (self.entropy_sum, self.tokens) = (entropy_sum, tokens);
        self.extra.set_values(&sums[9..]);
        Ok(())
    }

    /// TRL's names.
    pub fn record(&self, m: &mut Metrics) {
        m.set("policy/approxkl_avg", self.loss.approxkl());
        m.set("policy/clipfrac_avg", self.loss.clipfrac());
        m.set("loss/policy_avg", self.loss.loss_mean());
        m.set("val/ratio", self.loss.ratio_mean());
        m.set("val/ratio_var", self.loss.ratio_var());
        m.set("policy/entropy_avg", self.entropy_sum / self.tokens.max(1.0));
        m.set("grad_norm", self.grad_norm);
        m.set("train/skipped_steps", self.skipped_steps as f64);
        if let Some(held) = self.held {
            m.set("memory/held_before_training_gib", in_gib(held.before));
            m.set("memory/held_after_forward_gib", in_gib(held.after_forward));
            if let Some(first) = held.first_forward {
                m.set("memory/activations_gib", in_gib(first.saturating_sub(held.before)));
            }
        }
    }
}

impl Run {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn optimise(
        &self,
        step: usize,
        seqs: &Sequences,
        old: &TokenLogprobs,
        reference: Option<&Tensor>,
        targets: &Targets,
        optimizers: &mut Optimizers,
        state: &mut TrainerState,
        guard: &mut StepGuard,
    ) -> Result<TrainStats> {
        let cfg = &self.cfg;
        let sizes = self.sizes;
        let shape = self.algorithm.loss();
        let (ratio, aggregation) = (shape.ratio, shape.aggregation);
        let (loss_mask, adv) = (&targets.mask, &targets.advantages);
        let trained = self.algorithm.trained();
        let mut models = vec![&self.policy];
        models.extend(trained.iter().map(|t| t.model));
        let mut stats = TrainStats::default();
        let mut grads = GradAccumulator::default();
        let mut readback = Readback::default();
        // Each completion's loss tokens, read once: the mini-batches' denominators.
        let lengths: Vec<f32> = loss_mask.sum(1)?.to_vec1()?;
        stats.held = in_use_bytes(&self.device).map(Held::new);
        let world = self.comm.world();
        for epoch in 0..cfg.rloo.num_ppo_epochs {
            let order = Rng::stream(cfg.train.seed, &[streams::MINIBATCH_ORDER, step as u64, epoch as u64])
                .permutation(seqs.len());
            for mini in order.chunks(sizes.mini) {
                // The same mini-batch, its gradient the same sum in another
                // order, with each prompt's completions side by side so that
                // a micro-batch computes the prompt once for all of them.
                let mini = &seqs.grouped_order(mini);
                let mini_lengths: Vec<f32> = mini.iter().map(|&i| lengths[i]).collect();
                let response_length = cfg.generation.response_length;
                let denominator = algo::loss_denominator(&mini_lengths, ratio, aggregation, response_length);
                grads.clear();
                let mut queued = Vec::new();
                // Each process takes its share of the mini-batch; the loss's
                // denominator is the whole mini-batch's, so the summed
                // gradients are one process's.
                let share = mini.len() / world.size;
                for micro in mini[world.rank * share..(world.rank + 1) * share].chunks(sizes.micro) {
                    let started = Instant::now();
                    let part = seqs.select(micro);
                    let now =
                        completion_logprobs(self.policy.network(), &part, cfg.generation.temperature, &self.device)?;
                    let width = part.completion_width();
                    let narrow = |t: &Tensor| -> Result<Tensor> { Ok(rows_of(t, micro)?.narrow(1, 0, width)?) };
                    let (lp_old, mask) = (narrow(&old.logprobs)?, narrow(loss_mask)?);
                    // Per completion (N,), or per token (N, Tc).
                    let adv = if adv.rank() == 1 { rows_of(adv, micro)? } else { narrow(adv)? };
                    let out = algo::policy_loss(
                        &now.logprobs,
                        &lp_old,
                        &mask,
                        &adv,
                        cfg.rloo.clip_range(),
                        ratio,
                        aggregation,
                        denominator,
                    )?;
                    let mut loss = out.loss;
                    if let (KlPlacement::Loss, Some(lp_ref)) = (cfg.rloo.kl_placement, reference) {
                        // beta * mean_t kl_t on the current policy, aggregated like the policy loss.
                        let kl = algo::kl_per_token(&now.logprobs, &narrow(lp_ref)?, cfg.rloo.kl_estimator)?;
                        let kl_loss = algo::masked_mean_loss(&kl, &mask, ratio, aggregation, denominator)?;
                        loss = (loss + (kl_loss * cfg.rloo.kl_coef)?)?;
                    }
                    let micro =
                        Micro { part: &part, rows: &narrow, targets, mask: &mask, denominator, device: &self.device };
                    let mut extra = None;
                    if let Some((extra_loss, tally)) = self.algorithm.extra_loss(&micro, &mut readback)? {
                        loss = (loss + extra_loss)?;
                        extra = Some(tally);
                    }
                    queued.push(QueuedMicro {
                        loss: readback.push(&loss)?,
                        policy: out.diagnostics.queue(&mut readback)?,
                        entropy: readback.push(&(&now.entropy * &mask)?.sum_all()?)?,
                        tokens: readback.push(&mask.sum_all()?)?,
                        extra,
                    });
                    stats.seconds.forward_queued += started.elapsed().as_secs_f64();
                    self.device.synchronize()?;
                    stats.seconds.forward += started.elapsed().as_secs_f64();
                    if let (Some(held), Some(now)) = (&mut stats.held, in_use_bytes(&self.device)) {
                        held.forward_ended(now);
                    }
                    let started = Instant::now();
                    let backward = crate::model::backward(&loss, &models)?;
                    for model in &models {
                        grads.add(model.params(), &backward)?;
                    }
                    stats.seconds.backward_queued += started.elapsed().as_secs_f64();
                    self.device.synchronize()?;
                    stats.seconds.backward += started.elapsed().as_secs_f64();
                }
                let started = Instant::now();
                // The mini-batch's diagnostics, in one read.
                let mut loss_sum = stats.add(queued, &readback.read()?);
                if world.joined {
                    let stores: Vec<_> = models.iter().map(|m| m.params()).collect();
                    let mut sum = [loss_sum];
                    grads.all_reduce(&stores, &*self.comm, &mut sum)?;
                    loss_sum = sum[0];
                }
                if denominator == 0.0 {
                    // Every completion of the mini-batch is masked: nothing to learn,
                    // and a step would still move the weights through weight decay.
                    stats.skipped_steps += 1;
                    continue;
                }
                // One norm over the gradients of every trained model, as TRL clips
                // its policy-and-value wrapper.
                stats.grad_norm = grads.clip(cfg.train.max_grad_norm)?;
                if !guard.check(state.optimizer_step, loss_sum, stats.grad_norm) {
                    stats.skipped_steps += 1;
                    if guard.exhausted() {
                        return Ok(stats);
                    }
                    continue;
                }
                let lr = |base: f64| {
                    let t = &cfg.train;
                    learning_rate(base, t.lr_scheduler_type, state.optimizer_step, sizes.optimizer_steps, self.warmup)
                };
                optimizers.policy.step(self.policy.params(), &grads, lr(cfg.train.learning_rate))?;
                for (t, optimizer) in trained.iter().zip(&mut optimizers.trained) {
                    optimizer.step(t.model.params(), &grads, lr(t.learning_rate))?;
                }
                self.device.synchronize()?;
                stats.seconds.update += started.elapsed().as_secs_f64();
                state.optimizer_step += 1;
            }
        }
        if world.joined {
            stats.sum_over(&*self.comm)?;
        }
        Ok(stats)
    }
}

/// Rows `idx` of a tensor (N, ...) in that order.
fn rows_of(t: &Tensor, idx: &[usize]) -> Result<Tensor> {
    let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
    Ok(t.index_select(&Tensor::from_vec(ids, idx.len(), t.device())?, 0)?)
}
