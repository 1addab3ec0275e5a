//! The generation engine: batched sampling with a KV cache.

pub mod engine;
pub mod rng;
pub mod sampling;

pub use engine::{generate, Completion, FinishReason, GenerateOptions, StopCriteria};
pub use rng::Rng;
pub use sampling::Sampling;
