//! The generation engine: batched sampling with a KV cache.

pub mod clock;
pub mod decoding;
pub mod engine;
pub mod fixed;
#[cfg(feature = "cuda")]
mod graph;
pub mod race;
pub mod sampling;

pub use engine::{generate, warm_up, Completion, FinishReason, GenerateOptions, StopCriteria};
pub use fixed::Stepping;
pub use race::Sampler;
pub use sampling::Sampling;
