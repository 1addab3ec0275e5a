//! Models: the architectures (one file each), the tensor ops they share
//! (differentiable, for the training path), loading and saving Hugging Face
//! directories.

pub mod arch;
pub mod batch;
pub mod cache;
pub mod config;
pub mod device;
pub mod generation_config;
pub mod gpt2;
pub mod gpt_neox;
pub mod hub;
pub mod kernels;
pub mod layer_graphs;
pub mod layers;
pub mod llama;
pub mod lora;
pub mod network;
pub mod ops;
pub mod opt;
pub mod park;
pub mod qwen2;
pub mod qwen3;
pub mod readback;
pub mod rope;
pub mod save;
pub mod scoring;
pub mod weights;

pub use batch::{Inputs, PadSide};
pub use cache::KvCache;
pub use config::{HeadKind, ModelConfig};
pub use device::{parse_device, Precision};
pub use generation_config::GenerationConfig;
pub use network::{backward, next_token_logprobs, Decoder, Model, Network, Placement};
pub use weights::{Param, ParamStore};
