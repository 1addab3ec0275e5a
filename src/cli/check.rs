//! `rloo check`: checks this build on a device against the committed fixtures.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::DType;
use clap::Args;
use rloo::check;
use rloo::model::parse_device;

/// Check this build on a device: kernels against the CPU's, fixtures against transformers.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    /// The committed fixtures (models and transformers' reference outputs).
    #[arg(long, default_value = "tests/fixtures")]
    fixtures: PathBuf,
}

pub fn run(a: CheckArgs) -> Result<()> {
    let device = parse_device(&a.device)?;
    let dtypes = [DType::F32, DType::BF16];
    let mut checks = check::check_kernels(&device, &dtypes);
    checks.extend(check::check_fixtures(&a.fixtures, &device, &dtypes));
    checks.extend(check::check_tensor_attention(&device, &dtypes));
    print!("{}", check::table(&device, &checks));
    if checks.iter().any(|c| !c.passed()) {
        bail!("some checks failed on {}", check::describe(&device));
    }
    Ok(())
}
