//! Models: shared tensor ops, the architectures, heads, loading and saving.

pub mod generation_config;
pub mod hub;
