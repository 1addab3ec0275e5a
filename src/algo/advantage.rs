//! Baselines and advantages (docs/algorithm.md section 3).

use serde::{Deserialize, Serialize};

use super::groups::Grouped;
use super::kl::KlPlacement;

/// What is subtracted from a sample's return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Baseline {
    /// The mean return of the other scorable completions of the same prompt (RLOO).
    #[default]
    LeaveOneOut,
    /// The mean return of the prompt's scorable completions, itself included.
    GroupMean,
    /// The mean return of every scorable completion of the rollout batch.
    BatchMean,
    /// No baseline: vanilla REINFORCE.
    None,
}

/// What GRPO divides a completion's centred return by (TRL's
/// `scale_rewards`): the standard deviation of its prompt's returns, of the
/// batch's, or nothing (Dr. GRPO's advantage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRewards {
    #[default]
    Group,
    Batch,
    None,
}

/// Advantages with the number of prompts whose group had fewer than two
/// scorable members (their advantages are all 0).
#[derive(Debug, Clone, PartialEq)]
pub struct Advantages {
    pub values: Grouped<f32>,
    pub degenerate_groups: usize,
}

/// Advantage of every sample from its return `R` (`None`: unscorable).
///
/// `leave_one_out`: `b_i = (sum_{j scorable} R_j - R_i) / (n - 1)` over the
/// `n` scorable members of i's group, `A_i = R_i - b_i`
/// (`= n/(n-1) * (R_i - mean)`). Unscorable samples get `A = 0` and are in
/// no baseline; a group with `n < 2` gets `A = 0` for every member.
pub fn advantages(returns: &Grouped<Option<f32>>, baseline: Baseline) -> Advantages {
    let mut degenerate_groups = 0;
    let scorable: Vec<f64> = returns.flat().iter().flatten().map(|&r| r as f64).collect();
    let batch_mean = crate::stats::mean(&scorable).unwrap_or(0.0);
    let mut values = Vec::with_capacity(returns.len());
    for group in returns.groups() {
        let n = group.iter().flatten().count();
        let sum: f64 = group.iter().flatten().map(|&r| r as f64).sum();
        if n < 2 {
            degenerate_groups += 1;
        }
        for r in group {
            let a = match (r, baseline) {
                (None, _) => 0.0,
                (Some(_), Baseline::LeaveOneOut | Baseline::GroupMean) if n < 2 => 0.0,
                (Some(r), Baseline::LeaveOneOut) => *r as f64 - (sum - *r as f64) / (n - 1) as f64,
                (Some(r), Baseline::GroupMean) => *r as f64 - sum / n as f64,
                (Some(r), Baseline::BatchMean) => *r as f64 - batch_mean,
                (Some(r), Baseline::None) => *r as f64,
            };
            values.push(a as f32);
        }
    }
    Advantages { values: Grouped::new(returns.k(), values), degenerate_groups }
}

/// Whitens advantages over the rollout batch: `(A - mean) / (std + 1e-8)`,
/// with the unbiased std as `torch.std` computes it. Only the `included`
/// samples (scorable ones) enter the statistics and change; the rest stay 0.
pub fn whiten(values: &mut [f32], included: &[bool]) {
    let xs: Vec<f64> = values.iter().zip(included).filter(|(_, &i)| i).map(|(&v, _)| v as f64).collect();
    if xs.len() < 2 {
        return;
    }
    let (mean, std) = crate::stats::mean_std(&xs, crate::stats::Deviation::Sample).expect("two or more values");
    for (v, &inc) in values.iter_mut().zip(included) {
        if inc {
            *v = ((*v as f64 - mean) / (std + 1e-8)) as f32;
        }
    }
}

/// How a step's returns and advantages are formed.
#[derive(Debug, Clone, Copy)]
pub struct ReturnOptions {
    /// beta.
    pub kl_coef: f32,
    pub kl_placement: KlPlacement,
    pub baseline: Baseline,
    /// Whiten the advantages over the batch.
    pub normalize: bool,
}

/// Returns `R_i = s_i - beta * KL_i` (KL in the reward; `R = s` when the
/// KL goes to the loss) and their advantages over each prompt's group,
/// whitened over the batch when asked. `scores` and `seq_kl` are laid out
/// `[prompts][k]`.
pub fn returns_and_advantages(
    scores: &[Option<f32>],
    seq_kl: &[f32],
    k: usize,
    opts: &ReturnOptions,
) -> (Vec<Option<f32>>, Advantages) {
    let returns: Vec<Option<f32>> = scores
        .iter()
        .zip(seq_kl)
        .map(|(s, kl)| match opts.kl_placement {
            KlPlacement::Reward => s.map(|s| s - opts.kl_coef * kl),
            KlPlacement::Loss => *s,
        })
        .collect();
    let mut adv = advantages(&Grouped::new(k, returns.clone()), opts.baseline);
    if opts.normalize {
        let scorable: Vec<bool> = returns.iter().map(Option::is_some).collect();
        let mut values = adv.values.into_flat();
        whiten(&mut values, &scorable);
        adv.values = Grouped::new(k, values);
    }
    (returns, adv)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/algorithm.md's worked example, given as TRL lays it out: row = sample
    /// index, column = prompt.
    fn worked_example() -> Grouped<Option<f32>> {
        let by_sample = [[1.0, 2.0, 3.0], [2.0, 3.0, 4.0], [5.0, 6.0, 7.0], [8.0, 9.0, 10.0]];
        // [k][prompts] -> [prompts][k]
        let data = (0..3).flat_map(|p| by_sample.iter().map(move |row| Some(row[p]))).collect();
        Grouped::new(4, data)
    }

    #[test]
    fn leave_one_out_matches_the_worked_example() {
        let adv = advantages(&worked_example(), Baseline::LeaveOneOut);
        assert!((adv.values.group(0)[0] - (1.0 - (2.0 + 5.0 + 8.0) / 3.0)).abs() < 1e-6);
        assert!((adv.values.group(0)[0] + 4.0).abs() < 1e-6);
        assert!((adv.values.group(1)[2] - 1.333_333_3).abs() < 1e-5);
        assert_eq!(adv.degenerate_groups, 0);
        // A_i = k/(k-1) * (R_i - mean) for every sample.
        for (p, group) in worked_example().groups().enumerate() {
            let mean: f32 = group.iter().flatten().sum::<f32>() / 4.0;
            for (j, r) in group.iter().enumerate() {
                assert!((adv.values.group(p)[j] - 4.0 / 3.0 * (r.unwrap() - mean)).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn other_baselines() {
        let r = worked_example();
        let g = advantages(&r, Baseline::GroupMean);
        assert!((g.values.group(0)[0] - (1.0 - 4.0)).abs() < 1e-6);
        let b = advantages(&r, Baseline::BatchMean);
        let mean = (6.0 + 9.0 + 18.0 + 27.0) / 12.0;
        assert!((b.values.group(0)[0] - (1.0 - mean)).abs() < 1e-6);
        let n = advantages(&r, Baseline::None);
        assert_eq!(n.values.group(2)[3], 10.0);
    }

    #[test]
    fn unscorable_samples_get_zero_and_stay_out_of_baselines() {
        let r = Grouped::new(3, vec![Some(1.0), None, Some(4.0), Some(2.0), None, None]);
        let adv = advantages(&r, Baseline::LeaveOneOut);
        // Group 0: scorable {1, 4}: A = 1 - 4 = -3 and 4 - 1 = 3.
        assert_eq!(adv.values.group(0), &[-3.0, 0.0, 3.0]);
        // Group 1 has one scorable sample: everything 0, and it is counted.
        assert_eq!(adv.values.group(1), &[0.0, 0.0, 0.0]);
        assert_eq!(adv.degenerate_groups, 1);
    }

    #[test]
    fn whitening_uses_only_included_samples() {
        let mut v = vec![1.0, 0.0, 3.0, 5.0];
        whiten(&mut v, &[true, false, true, true]);
        // mean 3, unbiased std 2
        assert!((v[0] + 1.0).abs() < 1e-6 && v[1] == 0.0 && v[2].abs() < 1e-6 && (v[3] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn returns_and_advantages_of_the_worked_example() {
        let scores: Vec<Option<f32>> = worked_example().into_flat();
        let opts = ReturnOptions {
            kl_coef: 0.5,
            kl_placement: KlPlacement::Reward,
            baseline: Baseline::LeaveOneOut,
            normalize: false,
        };
        let (returns, adv) = returns_and_advantages(&scores, &[0.0; 12], 4, &opts);
        assert_eq!(returns, scores);
        assert!((adv.values.group(0)[0] + 4.0).abs() < 1e-6);
        assert!((adv.values.group(1)[2] - 1.333_333).abs() < 1e-5);
        // KL in the reward: R = s - beta * KL.
        let kl: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let (returns, _) = returns_and_advantages(&scores, &kl, 4, &opts);
        assert_eq!(returns[5], Some(3.0 - 0.5 * 5.0));
        let loss_placed = ReturnOptions { kl_placement: KlPlacement::Loss, ..opts };
        assert_eq!(returns_and_advantages(&scores, &kl, 4, &loss_placed).0, scores);
    }
}
