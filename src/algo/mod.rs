//! The numbers of RLOO (docs/algorithm.md) and PPO: advantages, KL, the
//! clipped policy and value losses, GAE, as pure functions with worked
//! examples.

pub mod advantage;
pub mod groups;
pub mod kl;
pub mod loss;
pub mod ppo;

pub use advantage::{advantages, returns_and_advantages, whiten, Advantages, Baseline, ReturnOptions, ScaleRewards};
pub use groups::Grouped;
pub use kl::{kl_per_token, sequence_kl, KlEstimator, KlPlacement};
pub use loss::{
    loss_denominator, masked_mean_loss, policy_loss, Aggregation, ClipRange, LossDiagnostics, LossStats, PolicyLoss,
    QueuedLossStats, RatioLevel,
};
