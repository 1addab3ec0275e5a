//! Dr. GRPO ("Understanding R1-Zero-Like Training", Liu et al. 2025; TRL's
//! `loss_type = "dr_grpo"`, docs/algorithm.md section 11): GRPO without its
//! two length and difficulty biases. A completion's advantage is its return
//! less its prompt's mean, not divided by the prompt's spread, and the
//! token terms are summed and divided by a constant (the mini-batch's
//! completions x `response_length`) rather than averaged within each
//! completion.

use super::grpo::group_targets;
use super::{needs_groups, Algorithm, Batch, Entry, LossShape, Start, Targets};
use crate::algo::{Aggregation, KlPlacement, RatioLevel, ScaleRewards};
use crate::error::Result;
use crate::report::Metrics;
use crate::train::config::TrainConfig;

pub const ENTRY: Entry = Entry {
    name: "dr_grpo",
    aliases: &[],
    about: "Dr. GRPO: GRPO without the spread scaling, its token terms over a constant",
    check,
    start,
};

const LOSS: LossShape = LossShape { ratio: RatioLevel::Token, aggregation: Aggregation::TokenSumNorm };

fn check(cfg: &TrainConfig) -> std::result::Result<(), String> {
    needs_groups(cfg, "dr_grpo")?;
    super::refuse_others_options(cfg, "dr_grpo", &[])?;
    super::refuse_loss_options(cfg, "dr_grpo", LOSS)
}

struct DrGrpo {
    kl: (f32, KlPlacement),
}

fn start(s: &Start) -> Result<Box<dyn Algorithm>> {
    Ok(Box::new(DrGrpo { kl: (s.cfg.rloo.kl_coef as f32, s.cfg.rloo.kl_placement) }))
}

impl Algorithm for DrGrpo {
    fn loss(&self) -> LossShape {
        LOSS
    }

    fn targets(&self, batch: &Batch<'_>, metrics: &mut Metrics) -> Result<Targets> {
        group_targets(batch, self.kl, ScaleRewards::None, metrics)
    }
}
