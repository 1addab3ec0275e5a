//! Shared helpers for the integration tests: the committed fixtures and
//! tensor comparisons.
#![allow(dead_code)]

pub mod stub;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{Device, Tensor};

/// Every fixture model: five architectures, two heads each.
pub const MODELS: &[&str] = rloo::check::FIXTURE_MODELS;

/// Runs the built `rloo` binary.
pub fn rloo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rloo")).args(args).output().unwrap()
}

/// The output of a run that must succeed.
pub fn ok(out: Output) -> Output {
    assert!(out.status.success(), "rloo failed:\n{}", String::from_utf8_lossy(&out.stderr));
    out
}

/// The stderr of a run that must fail.
pub fn err(out: Output) -> String {
    assert!(!out.status.success(), "rloo should have failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn model_dir(name: &str) -> PathBuf {
    fixtures().join("models").join(name)
}

/// The reference tensors transformers produced for a fixture model.
pub fn reference(name: &str) -> HashMap<String, Tensor> {
    let path = fixtures().join("reference").join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn is_causal(name: &str) -> bool {
    name.ends_with("-causal")
}

/// Max |a - b| over entries where `mask` (broadcast from the leading dims) is 1.
pub fn max_diff_masked(a: &Tensor, b: &Tensor, mask: &Tensor) -> f32 {
    rloo::check::max_diff_masked(a, b, mask).unwrap()
}

pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    rloo::check::max_diff(a, b).unwrap()
}
