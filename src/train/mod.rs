//! The training loops and what they share: configuration, optimizer,
//! log-probs of completions, checkpoints.

pub mod checkpoint;
pub mod config;
pub mod optim;
pub mod reward_model;
pub mod rloo;
pub mod sft;

pub use config::{BatchSizes, TrainConfig};
