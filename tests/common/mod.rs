//! Shared helpers for the integration tests: the committed fixtures and
//! tensor comparisons.
#![allow(dead_code)]

pub mod stub;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use candle_core::{Device, Tensor};

/// Every fixture model: six architectures, both heads each (OPT in two layouts).
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

/// A server process started by a test, killed when the test ends (also
/// when it fails).
pub struct Server {
    pub child: Child,
    /// `http://host:port`, as the server printed it.
    pub url: String,
    /// Everything the server has written to stderr so far.
    pub log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    /// Starts `command` (which must print `... http://ADDR ...` on stderr
    /// once it listens) and waits for that line.
    pub fn start(command: &mut Command) -> Server {
        let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let addr = loop {
            let mut line = String::new();
            if std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() == 0 {
                panic!("the server did not start:\n{}", log.lock().unwrap());
            }
            log.lock().unwrap().push_str(&line);
            if let Some(addr) = line.split("http://").nth(1).and_then(|s| s.split_whitespace().next()) {
                break addr.to_string();
            }
        };
        let url = format!("http://{addr}");
        // Keep draining stderr so the server never blocks on a full pipe.
        let kept = log.clone();
        std::thread::spawn(move || {
            let mut line = String::new();
            while std::io::BufRead::read_line(&mut stderr, &mut line).is_ok_and(|n| n > 0) {
                kept.lock().unwrap().push_str(&line);
                line.clear();
            }
        });
        Server { child, url, log }
    }

    /// `host:port`.
    pub fn addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
