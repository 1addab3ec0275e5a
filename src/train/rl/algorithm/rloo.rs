//! RLOO (docs/algorithm.md sections 3 and 4): each completion's return
//! `R_i = s_i - beta KL_i` (`s_i` when the KL goes to the loss) against the
//! mean return of the other completions of its prompt (or the `baseline`
//! option's), whitened over the batch when asked; the clipped loss with the
//! `ratio` and `aggregation` options.

use super::{per_sequence, Algorithm, Batch, Entry, LossShape, Start, Targets};
use crate::algo::{self, ReturnOptions};
use crate::error::Result;
use crate::report::Metrics;
use crate::train::config::TrainConfig;

pub const ENTRY: Entry = Entry {
    name: "rloo",
    aliases: &[],
    about: "REINFORCE Leave-One-Out: each completion against the others of its prompt",
    check,
    start,
};

fn check(cfg: &TrainConfig) -> std::result::Result<(), String> {
    if cfg.rloo.k < 2 {
        return Err(format!("rloo.k (--rloo_k) must be at least 2 for a leave-one-out baseline, got {}", cfg.rloo.k));
    }
    super::refuse_others_options(cfg, "rloo", &["rloo.baseline", "rloo.normalize_advantage"])
}

struct Rloo {
    returns: ReturnOptions,
    loss: LossShape,
}

fn start(s: &Start) -> Result<Box<dyn Algorithm>> {
    let r = &s.cfg.rloo;
    Ok(Box::new(Rloo { returns: r.return_options(), loss: LossShape { ratio: r.ratio, aggregation: r.aggregation } }))
}

impl Algorithm for Rloo {
    fn loss(&self) -> LossShape {
        self.loss
    }

    fn targets(&self, batch: &Batch<'_>, metrics: &mut Metrics) -> Result<Targets> {
        let (returns, adv) = algo::returns_and_advantages(batch.scores, batch.seq_kl, batch.k, &self.returns);
        let rlhf = returns.iter().flatten().map(|&r| r as f64).collect::<Vec<_>>();
        metrics.set("objective/rlhf_reward", crate::stats::mean(&rlhf).unwrap_or(f64::NAN));
        metrics.set("rloo/degenerate_groups", adv.degenerate_groups as f64);
        Ok(Targets {
            advantages: per_sequence(adv.values.flat(), batch.mask.device())?,
            mask: batch.mask.clone(),
            returns: None,
            values: None,
        })
    }
}
