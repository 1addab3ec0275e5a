//! REINFORCE++ (Hu 2025; OpenRLHF's and verl's `reinforce_plus_plus`,
//! docs/algorithm.md section 11): PPO's per-token credit without a critic.
//! Each token's reward is `-beta kl_t` with the score added at the last
//! token (no KL when it goes to the loss); a token's return is the sum of
//! the rewards from it to the end; the returns, whitened over every token
//! of the batch, are the advantages of the token-level clipped loss.

use super::{Algorithm, Batch, Entry, LiveRows, LossShape, Start, Targets};
use crate::algo::ppo::{token_rewards, whiten_tokens};
use crate::algo::{Aggregation, KlPlacement, RatioLevel};
use crate::error::Result;
use crate::report::Metrics;
use crate::train::config::TrainConfig;

pub const ENTRY: Entry = Entry {
    name: "reinforce_plus_plus",
    aliases: &["reinforce++"],
    about: "REINFORCE++: per-token returns with the KL in each token's reward, whitened over the batch",
    check,
    start,
};

const LOSS: LossShape = LossShape { ratio: RatioLevel::Token, aggregation: Aggregation::TokenMean };

fn check(cfg: &TrainConfig) -> std::result::Result<(), String> {
    if cfg.rloo.k == 0 {
        return Err("rloo.k (--rloo_k) must be at least 1".into());
    }
    super::refuse_others_options(cfg, "reinforce_plus_plus", &[])?;
    super::refuse_loss_options(cfg, "reinforce_plus_plus", LOSS)
}

struct ReinforcePlusPlus {
    /// beta, with the KL in the token rewards; 0 with the KL in the loss.
    beta: f32,
}

fn start(s: &Start) -> Result<Box<dyn Algorithm>> {
    let r = &s.cfg.rloo;
    let beta = if r.kl_placement == KlPlacement::Reward { r.kl_coef as f32 } else { 0.0 };
    Ok(Box::new(ReinforcePlusPlus { beta }))
}

impl Algorithm for ReinforcePlusPlus {
    fn loss(&self) -> LossShape {
        LOSS
    }

    fn targets(&self, batch: &Batch<'_>, metrics: &mut Metrics) -> Result<Targets> {
        let rows = LiveRows::new(batch.scores, batch.mask)?;
        let kl = match batch.token_kl {
            Some(kl) => rows.take(kl)?,
            None => rows.filled(|_| 0.0),
        };
        let scores: Vec<f32> = rows.live().iter().map(|&i| batch.scores[i].expect("live rows are scored")).collect();
        let rewards = token_rewards(&scores, &kl, self.beta);
        let sums: Vec<f64> = rewards.iter().map(|r| r.iter().map(|&x| x as f64).sum()).collect();
        metrics.set("objective/rlhf_reward", crate::stats::mean(&sums).unwrap_or(f64::NAN));
        let mut advantages = returns_to_go(&rewards);
        whiten_tokens(&mut advantages, true);
        Ok(Targets { advantages: rows.padded(advantages)?, mask: rows.mask()?, returns: None, values: None })
    }
}

/// `G_t = r_t + G_{t+1}`, from the last token back: each token's reward and
/// all that follow it in its completion.
pub fn returns_to_go(rewards: &[Vec<f32>]) -> Vec<Vec<f32>> {
    rewards
        .iter()
        .map(|r| {
            let mut g = r.clone();
            for t in (0..g.len().saturating_sub(1)).rev() {
                g[t] += g[t + 1];
            }
            g
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/algorithm.md's REINFORCE++ example: two completions of 3 and 2
    /// tokens, scores 1 and 0, beta 0.1, per-token KL [1, 0, 2] and [-1, 1].
    #[test]
    fn returns_to_go_then_whitening_match_the_worked_example() {
        let rewards = token_rewards(&[1.0, 0.0], &[vec![1.0, 0.0, 2.0], vec![-1.0, 1.0]], 0.1);
        assert_eq!(rewards, [vec![-0.1, 0.0, 0.8], vec![0.1, -0.1]]);
        let g = returns_to_go(&rewards);
        let want: [&[f32]; 2] = [&[0.7, 0.8, 0.8], &[0.0, -0.1]];
        for (row, want) in g.iter().zip(want) {
            for (a, b) in row.iter().zip(want) {
                assert!((a - b).abs() < 1e-6, "{g:?}");
            }
        }
        // Whitened over the five tokens: mean 0.44, unbiased std sqrt(0.812 / 4) = 0.45056.
        let mut adv = g;
        whiten_tokens(&mut adv, true);
        let std = ((0.0676 + 0.1296 * 2.0 + 0.1936 + 0.2916) / 4.0f64).sqrt();
        assert!((adv[0][0] as f64 - (0.7 - 0.44) / std).abs() < 1e-5, "{adv:?}");
        assert!((adv[1][1] as f64 - (-0.1 - 0.44) / std).abs() < 1e-5, "{adv:?}");
    }
}
