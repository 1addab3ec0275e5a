//! `rloo merge`: a LoRA adapter merged into its base, as a full model.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use rloo::model::{parse_device, Model};

/// Merge a PEFT LoRA adapter into its base model and save the full model
/// (each adapted weight becomes W + scale * B A, as PEFT's merge_and_unload),
/// loadable by transformers and vLLM without peft.
#[derive(Debug, Args)]
pub struct MergeArgs {
    /// The adapter directory (adapter_config.json, adapter_model.safetensors).
    #[arg(long)]
    adapter: PathBuf,
    /// The base model [default: the adapter's base_model_name_or_path].
    #[arg(long)]
    base: Option<PathBuf>,
    /// Where the merged model goes.
    #[arg(long)]
    output: PathBuf,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: String,
}

pub fn run(a: MergeArgs) -> Result<()> {
    let device = parse_device(&a.device)?;
    let model = Model::load_adapter(&a.adapter, a.base.as_deref(), &device)
        .with_context(|| format!("loading the adapter {}", a.adapter.display()))?;
    model.save_merged(&a.output)?;
    eprintln!(
        "merged {} into {} -> {}",
        a.adapter.display(),
        model.lora().map_or("".into(), |(_, b)| b.display().to_string()),
        a.output.display()
    );
    Ok(())
}
