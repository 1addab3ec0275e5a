//! `rloo study`: a grid of trainer configurations over seeds, and one report.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use rloo::study::{summarise, write_report, Study};

/// Train every arm of a study file with every seed (each in its own
/// process; finished runs are kept, interrupted ones resume), then write
/// `study.md` with a table per arm and overlaid reward, KL and reward-KL
/// charts with the seeds' spread.
#[derive(Debug, Args)]
pub struct StudyArgs {
    /// The study: a train configuration with `seeds`, `output_dir` and `[[arm]]` tables.
    study: PathBuf,
    /// Only write the report from the runs already finished.
    #[arg(long)]
    report_only: bool,
}

pub fn run(a: StudyArgs) -> Result<()> {
    let study = Study::load(&a.study)?;
    let exe = std::env::current_exe().context("cannot find the rloo binary to run the arms")?;
    let records = if a.report_only { study.finished()? } else { study.run(&exe)? };
    let arms = summarise(&study, &records)?;
    let report = write_report(&study, &arms)?.path;
    print!("{}", std::fs::read_to_string(&report)?);
    eprintln!("report: {}", report.display());
    Ok(())
}
