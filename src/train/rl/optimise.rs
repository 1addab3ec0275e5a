//! The optimisation of a step: `num_ppo_epochs` passes over the rollout in
//! seeded shuffled mini-batches, each one optimizer step accumulated over
//! micro-batches: the clipped policy loss (with RLOO's per-sequence or
//! PPO's per-token advantages), the KL loss where it is placed there, and
//! PPO's value loss, whose gradients reach the critic.

use candle_core::Tensor;

use super::ppo::Targets;
use super::{Optimizers, Run};
use crate::algo::ppo::{value_loss, ValueStats};
use crate::algo::{self, Aggregation, KlPlacement, LossStats, RatioLevel};
use crate::error::Result;
use crate::generate::rng::streams;
use crate::generate::Rng;
use crate::model::scoring::{completion_logprobs, Sequences, TokenLogprobs};
use crate::report::Metrics;
use crate::train::checkpoint::TrainerState;
use crate::train::optim::{learning_rate, GradAccumulator, StepGuard};

/// What the policy loss weighs each completion (or token) by.
pub(super) enum Advantages {
    /// RLOO: one advantage per completion, (N,).
    Sequences(Tensor),
    /// PPO: per-token advantages with the critic's targets.
    Tokens(Targets),
}

/// Loss diagnostics summed over a step's optimisation.
#[derive(Default)]
pub(super) struct TrainStats {
    pub loss: LossStats,
    pub value: ValueStats,
    pub entropy_sum: f64,
    pub tokens: f64,
    pub grad_norm: f64,
    pub skipped_steps: usize,
}

impl TrainStats {
    /// TRL's names; the value metrics when there is a critic.
    pub fn record(&self, m: &mut Metrics, critic: bool) {
        m.set("policy/approxkl_avg", self.loss.approxkl());
        m.set("policy/clipfrac_avg", self.loss.clipfrac());
        m.set("loss/policy_avg", self.loss.loss_mean());
        m.set("val/ratio", self.loss.ratio_mean());
        m.set("val/ratio_var", self.loss.ratio_var());
        m.set("policy/entropy_avg", self.entropy_sum / self.tokens.max(1.0));
        m.set("grad_norm", self.grad_norm);
        m.set("train/skipped_steps", self.skipped_steps as f64);
        if critic {
            m.set("loss/value_avg", self.value.loss_mean());
            m.set("val/clipfrac_avg", self.value.clipfrac());
            m.set("val/vpred", self.value.vpred_mean());
            m.set("val/error", self.value.error_mean());
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
        advantages: &Advantages,
        optimizers: &mut Optimizers,
        state: &mut TrainerState,
        guard: &mut StepGuard,
    ) -> Result<TrainStats> {
        let cfg = &self.cfg;
        let sizes = self.sizes;
        // PPO: a token ratio averaged over the mini-batch's tokens, as TRL's PPOTrainer.
        let (ratio, aggregation, loss_mask, adv) = match advantages {
            Advantages::Sequences(adv) => (cfg.rloo.ratio, cfg.rloo.aggregation, &old.mask, adv),
            Advantages::Tokens(t) => (RatioLevel::Token, Aggregation::TokenMean, &t.mask, &t.advantages),
        };
        let critic = match (advantages, &self.critic) {
            (Advantages::Tokens(targets), Some(critic)) => Some((critic, targets)),
            _ => None,
        };
        let mut stats = TrainStats::default();
        let mut grads = GradAccumulator::default();
        for epoch in 0..cfg.rloo.num_ppo_epochs {
            let order = Rng::stream(cfg.train.seed, &[streams::MINIBATCH_ORDER, step as u64, epoch as u64])
                .permutation(seqs.len());
            for mini in order.chunks(sizes.mini) {
                let mini_mask = rows_of(loss_mask, mini)?;
                let denominator = algo::loss_denominator(&mini_mask, ratio, aggregation)?;
                grads.clear();
                let mut loss_sum = 0f64;
                for micro in mini.chunks(sizes.micro) {
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
                    if let Some((critic, targets)) = critic {
                        let vpred = critic.values_for_training(&part, &self.device)?;
                        let (values, returns) = (narrow(&targets.values)?, narrow(&targets.returns)?);
                        let v = value_loss(&vpred, &values, &returns, &mask, cfg.ppo.cliprange_value, denominator)?;
                        loss = (loss + (v.loss * cfg.ppo.vf_coef)?)?;
                        stats.value.add(&v.stats);
                    }
                    loss_sum += loss.to_scalar::<f32>()? as f64;
                    stats.loss.add(&out.stats);
                    stats.entropy_sum += (&now.entropy * &mask)?.sum_all()?.to_scalar::<f32>()? as f64;
                    stats.tokens += mask.sum_all()?.to_scalar::<f32>()? as f64;
                    let mut models = vec![&self.policy];
                    models.extend(critic.map(|(critic, _)| &critic.model));
                    let backward = crate::model::backward(&loss, &models)?;
                    grads.add(self.policy.params(), &backward)?;
                    if let Some((critic, _)) = critic {
                        grads.add(critic.model.params(), &backward)?;
                    }
                }
                if denominator == 0.0 {
                    // Every completion of the mini-batch is masked: nothing to learn,
                    // and a step would still move the weights through weight decay.
                    stats.skipped_steps += 1;
                    continue;
                }
                // One norm over the policy's and the critic's gradients, as TRL clips its
                // policy-and-value wrapper.
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
                if let (Some((critic, _)), Some(optimizer)) = (critic, &mut optimizers.critic) {
                    let base = cfg.ppo.critic_learning_rate.unwrap_or(cfg.train.learning_rate);
                    optimizer.step(critic.model.params(), &grads, lr(base))?;
                }
                state.optimizer_step += 1;
            }
        }
        Ok(stats)
    }
}

/// Rows `idx` of a tensor (N, ...) in that order.
fn rows_of(t: &Tensor, idx: &[usize]) -> Result<Tensor> {
    let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
    Ok(t.index_select(&Tensor::from_vec(ids, idx.len(), t.device())?, 0)?)
}
