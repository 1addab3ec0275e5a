//! The training loops and what they share: configuration, optimizer,
//! log-probs of completions, checkpoints, the output directory and stop signals.

pub mod checkpoint;
pub mod config;
pub mod harness;
pub mod memory;
pub mod optim;
pub mod reward_model;
pub mod rl;
pub mod run_dir;
pub mod sft;
pub mod stop;
pub mod supervised;

pub use config::{BatchSizes, TrainConfig};
