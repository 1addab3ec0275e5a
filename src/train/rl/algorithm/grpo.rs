//! GRPO, as TRL's GRPOTrainer and verl define it (docs/algorithm.md
//! section 11): each completion's return against its prompt's mean,
//! divided by the standard deviation of its prompt's returns (or the
//! batch's, or not at all: `scale_rewards`), then the token-level clipped
//! loss averaged within each completion, then over completions (TRL's
//! `loss_type = "grpo"`).

use super::{needs_groups, per_sequence, Algorithm, Batch, Entry, LossShape, Start, Targets};
use crate::algo::{self, Advantages, Aggregation, Baseline, Grouped, KlPlacement, RatioLevel, ScaleRewards};
use crate::error::Result;
use crate::report::Metrics;
use crate::stats::{mean_std, Deviation};
use crate::train::config::TrainConfig;

pub const ENTRY: Entry = Entry {
    name: "grpo",
    aliases: &["group_norm"],
    about: "GRPO: each completion against its prompt's mean, over its prompt's spread",
    check,
    start,
};

const LOSS: LossShape = LossShape { ratio: RatioLevel::Token, aggregation: Aggregation::SequenceMean };

/// Added to the spread, as TRL does, so that a group of equal returns
/// gives advantages of 0 rather than 0 / 0.
const EPS: f64 = 1e-4;

fn check(cfg: &TrainConfig) -> std::result::Result<(), String> {
    needs_groups(cfg, "grpo")?;
    super::refuse_others_options(cfg, "grpo", &["rloo.scale_rewards"])?;
    super::refuse_loss_options(cfg, "grpo", LOSS)
}

struct Grpo {
    kl: (f32, KlPlacement),
    scale: ScaleRewards,
}

fn start(s: &Start) -> Result<Box<dyn Algorithm>> {
    let r = &s.cfg.rloo;
    Ok(Box::new(Grpo { kl: (r.kl_coef as f32, r.kl_placement), scale: r.scale_rewards }))
}

impl Algorithm for Grpo {
    fn loss(&self) -> LossShape {
        LOSS
    }

    fn targets(&self, batch: &Batch<'_>, metrics: &mut Metrics) -> Result<Targets> {
        group_targets(batch, self.kl, self.scale, metrics)
    }
}

/// GRPO's targets (Dr. GRPO's with `ScaleRewards::None`): one advantage
/// per completion, over its tokens.
pub fn group_targets(
    batch: &Batch<'_>,
    kl: (f32, KlPlacement),
    scale: ScaleRewards,
    metrics: &mut Metrics,
) -> Result<Targets> {
    let returns = returns(batch, kl);
    let adv = grpo_advantages(&returns, scale);
    set_group_metrics(&returns, &adv, metrics);
    Ok(Targets {
        advantages: per_sequence(adv.values.flat(), batch.mask.device())?,
        mask: batch.mask.clone(),
        returns: None,
        values: None,
    })
}

/// Each completion's return `R_i = s_i - beta KL_i` (`s_i` with the KL in
/// the loss), laid out by prompt.
pub fn returns(batch: &Batch<'_>, (beta, placement): (f32, KlPlacement)) -> Grouped<Option<f32>> {
    let returns = batch
        .scores
        .iter()
        .zip(batch.seq_kl)
        .map(|(s, kl)| match placement {
            KlPlacement::Reward => s.map(|s| s - beta * kl),
            KlPlacement::Loss => *s,
        })
        .collect();
    Grouped::new(batch.k, returns)
}

/// The mean return and the prompts whose group had fewer than two scorable members.
pub fn set_group_metrics(returns: &Grouped<Option<f32>>, adv: &Advantages, metrics: &mut Metrics) {
    let scored: Vec<f64> = returns.flat().iter().flatten().map(|&r| r as f64).collect();
    metrics.set("objective/rlhf_reward", crate::stats::mean(&scored).unwrap_or(f64::NAN));
    metrics.set("rloo/degenerate_groups", adv.degenerate_groups as f64);
}

/// `A_i = (R_i - mean_g) / (std + 1e-4)`: the mean of i's group, and the
/// unbiased standard deviation of its group's returns (`group`), of the
/// batch's (`batch`), or none (`none`: Dr. GRPO's advantage). Over scorable
/// returns only; an unscorable sample, and every member of a group with
/// fewer than two scorable ones, gets 0.
pub fn grpo_advantages(returns: &Grouped<Option<f32>>, scale: ScaleRewards) -> Advantages {
    let mut adv = algo::advantages(returns, Baseline::GroupMean);
    let spread = |xs: &[f64]| mean_std(xs, Deviation::Sample).map_or(0.0, |(_, std)| std);
    let scorable = |group: &[Option<f32>]| group.iter().flatten().map(|&r| r as f64).collect::<Vec<_>>();
    let batch_std = spread(&scorable(returns.flat()));
    let scaled: Vec<f32> = returns
        .groups()
        .zip(adv.values.groups())
        .flat_map(|(group, centred)| {
            let std = match scale {
                ScaleRewards::Group => Some(spread(&scorable(group))),
                ScaleRewards::Batch => Some(batch_std),
                ScaleRewards::None => None,
            };
            centred.iter().map(move |&a| std.map_or(a, |std| (a as f64 / (std + EPS)) as f32))
        })
        .collect();
    adv.values = Grouped::new(returns.k(), scaled);
    adv
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/algorithm.md's returns: one row per sample, one column per prompt.
    fn worked_example() -> Grouped<Option<f32>> {
        let by_sample = [[1.0, 2.0, 3.0], [2.0, 3.0, 4.0], [5.0, 6.0, 7.0], [8.0, 9.0, 10.0]];
        Grouped::new(4, (0..3).flat_map(|p| by_sample.iter().map(move |row| Some(row[p]))).collect())
    }

    fn close(got: f32, want: f64) {
        assert!((got as f64 - want).abs() < 1e-5, "{got} vs {want}");
    }

    #[test]
    fn group_scaling_matches_the_worked_example() {
        // Prompt 0: [1, 2, 5, 8], mean 4, unbiased std sqrt(30 / 3) = 3.16228.
        let adv = grpo_advantages(&worked_example(), ScaleRewards::Group);
        close(adv.values.group(0)[0], -3.0 / (10f64.sqrt() + 1e-4));
        close(adv.values.group(0)[3], 4.0 / (10f64.sqrt() + 1e-4));
        // Every group has the same spread of [0, 1, 4, 7] around its mean.
        close(adv.values.group(2)[2], 1.0 / (10f64.sqrt() + 1e-4));
        assert_eq!(adv.degenerate_groups, 0);
    }

    #[test]
    fn batch_and_no_scaling() {
        // The batch's 12 returns: mean 5, unbiased variance (34 + 30 + 34) / 11.
        let std = (98.0f64 / 11.0).sqrt();
        let adv = grpo_advantages(&worked_example(), ScaleRewards::Batch);
        close(adv.values.group(0)[0], -3.0 / (std + 1e-4));
        let adv = grpo_advantages(&worked_example(), ScaleRewards::None);
        assert_eq!(adv.values.group(1)[3], 9.0 - 5.0);
    }

    #[test]
    fn equal_returns_unscorable_samples_and_lone_members_get_zero() {
        let r =
            Grouped::new(3, vec![Some(2.0), Some(2.0), Some(2.0), Some(1.0), None, Some(3.0), Some(4.0), None, None]);
        let adv = grpo_advantages(&r, ScaleRewards::Group);
        assert_eq!(adv.values.group(0), &[0.0, 0.0, 0.0], "no spread: no signal, and no 0 / 0");
        // [1, -, 3]: mean 2, std sqrt(2).
        close(adv.values.group(1)[0], -1.0 / (2f64.sqrt() + 1e-4));
        assert_eq!(adv.values.group(1)[1], 0.0);
        assert_eq!(adv.values.group(2), &[0.0, 0.0, 0.0]);
        assert_eq!(adv.degenerate_groups, 1);
    }
}
