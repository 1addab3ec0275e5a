//! The training loops and what they share: configuration, optimizer,
//! log-probs of completions, checkpoints.

pub mod config;
pub mod optim;

pub use config::{BatchSizes, TrainConfig};
