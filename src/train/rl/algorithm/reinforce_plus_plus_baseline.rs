//! REINFORCE++-baseline (Hu 2025; verl's `reinforce_plus_plus_baseline`,
//! OpenRLHF's `reinforce_baseline`, docs/algorithm.md section 11): each
//! completion's return less its prompt's mean return, put on every one of
//! its tokens, whitened over every token of the batch; the token-level
//! clipped loss.

use super::grpo::{returns, set_group_metrics};
use super::{needs_groups, Algorithm, Batch, Entry, LiveRows, LossShape, Start, Targets};
use crate::algo::ppo::whiten_tokens;
use crate::algo::{self, Aggregation, Baseline, KlPlacement, RatioLevel};
use crate::error::Result;
use crate::report::Metrics;
use crate::train::config::TrainConfig;

pub const ENTRY: Entry = Entry {
    name: "reinforce_plus_plus_baseline",
    aliases: &["reinforce_baseline"],
    about: "REINFORCE++-baseline: the prompt's mean as baseline, whitened over the batch's tokens",
    check,
    start,
};

const LOSS: LossShape = LossShape { ratio: RatioLevel::Token, aggregation: Aggregation::TokenMean };

fn check(cfg: &TrainConfig) -> std::result::Result<(), String> {
    needs_groups(cfg, "reinforce_plus_plus_baseline")?;
    super::refuse_others_options(cfg, "reinforce_plus_plus_baseline", &[])?;
    super::refuse_loss_options(cfg, "reinforce_plus_plus_baseline", LOSS)
}

struct ReinforcePlusPlusBaseline {
    kl: (f32, KlPlacement),
}

fn start(s: &Start) -> Result<Box<dyn Algorithm>> {
    Ok(Box::new(ReinforcePlusPlusBaseline { kl: (s.cfg.rloo.kl_coef as f32, s.cfg.rloo.kl_placement) }))
}

impl Algorithm for ReinforcePlusPlusBaseline {
    fn loss(&self) -> LossShape {
        LOSS
    }

    fn targets(&self, batch: &Batch<'_>, metrics: &mut Metrics) -> Result<Targets> {
        let returns = returns(batch, self.kl);
        let centred = algo::advantages(&returns, Baseline::GroupMean);
        set_group_metrics(&returns, &centred, metrics);
        let rows = LiveRows::new(batch.scores, batch.mask)?;
        let mut advantages = rows.filled(|i| centred.values.flat()[i]);
        whiten_tokens(&mut advantages, true);
        Ok(Targets { advantages: rows.padded(advantages)?, mask: rows.mask()?, returns: None, values: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::Grouped;

    /// docs/algorithm.md's example: prompt 0's returns [1, 3] over 2 and 1
    /// tokens, prompt 1's [2, 2] over 1 and 2 tokens.
    #[test]
    fn group_mean_on_every_token_then_whitening_match_the_worked_example() {
        let returns = Grouped::new(2, vec![Some(1.0), Some(3.0), Some(2.0), Some(2.0)]);
        let centred = algo::advantages(&returns, Baseline::GroupMean);
        assert_eq!(centred.values.flat(), &[-1.0, 1.0, 0.0, 0.0]);
        let lengths = [2, 1, 1, 2];
        let mut tokens: Vec<Vec<f32>> = centred.values.flat().iter().zip(lengths).map(|(&a, n)| vec![a; n]).collect();
        whiten_tokens(&mut tokens, true);
        // Six tokens [-1, -1, 1, 0, 0, 0]: mean -1/6, unbiased variance (25/36 * 2 + 49/36 + 3 * 1/36) / 5.
        let (mean, std) = (-1.0 / 6.0, ((25.0 * 2.0 + 49.0 + 3.0) / 36.0 / 5.0f64).sqrt());
        assert!((tokens[0][1] as f64 - (-1.0 - mean) / std).abs() < 1e-5, "{tokens:?}");
        assert!((tokens[1][0] as f64 - (1.0 - mean) / std).abs() < 1e-5, "{tokens:?}");
        assert!((tokens[3][1] as f64 - (0.0 - mean) / std).abs() < 1e-5, "{tokens:?}");
    }
}
