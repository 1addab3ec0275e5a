//! `rloo pipeline`: the built-in task end to end (the default job).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use rloo::pipeline::{run as run_pipeline, PipelineOptions};

/// Run the whole pipeline on the built-in movie-review task: data,
/// tokenizer, a tiny policy from scratch, SFT, reward model, RLOO,
/// evaluation and a report. Finished stages are reused on a second run.
#[derive(Debug, Args)]
pub struct PipelineArgs {
    /// Where every stage and the report go.
    #[arg(long, default_value = "runs/pipeline")]
    out: PathBuf,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    /// A seconds-long version with tiny sizes (for tests).
    #[arg(long)]
    fast: bool,
    /// Then compare RLOO (k = 2 and 4; leave-one-out, batch-mean and no
    /// baseline) with PPO over two seeds, as `rloo study` does, in `<out>/study/`.
    #[arg(long)]
    study: bool,
}

pub fn run(a: PipelineArgs) -> Result<()> {
    let study = match a.study {
        true => Some(std::env::current_exe().context("cannot find the rloo binary to run the study's arms")?),
        false => None,
    };
    let opts = PipelineOptions { out: a.out, seed: a.seed, device: a.device, fast: a.fast, study };
    let report = run_pipeline(&opts).context("pipeline failed")?;
    println!("{}", std::fs::read_to_string(&report)?);
    eprintln!("report: {}", report.display());
    Ok(())
}
