//! rloo: RLHF for Hugging Face causal language models.
//!
//! The crate follows the path of one rollout batch: `data` turns rows into
//! token ids, `model` runs the networks (forward, log-probs, training
//! path, loading and saving Hugging Face directories), `reward` scores
//! completions, `service` talks HTTP to what lives outside; `rng` is the seeded
//! generator and the named streams every random choice draws from; `dist`
//! joins the processes of a data-parallel job. The `rloo` binary is a thin
//! command line over it.

pub mod algo;
pub mod check;
pub mod data;
pub mod dist;
pub mod error;
pub mod eval;
pub mod generate;
pub mod heap;
pub mod io;
pub mod model;
pub mod pipeline;
pub mod report;
pub mod reward;
pub mod rng;
pub mod rollout;
pub mod serve;
pub mod service;
pub mod stats;
pub mod study;
pub mod task;
pub mod train;

pub use error::{Error, Result};

#[global_allocator]
static ALLOCATOR: heap::Counting = heap::Counting;
