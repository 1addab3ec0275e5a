//! `rloo check`: is this build right on this device? Every kernel against
//! the CPU kernel it stands for, the committed fixtures of every
//! architecture (logits, scores, KV-cache decoding, gradients) against
//! transformers' outputs, and greedy generation against transformers'
//! tokens (with a LoRA adapter, against the CPU's), its steps recorded as
//! CUDA graphs on a GPU. One table, one verdict: a user can run it on their
//! own GPU.

mod kernels;
pub mod parity;

use std::fmt::Write as _;
use std::path::Path;

use candle_core::{DType, Device};

use crate::generate::fixed::{recordings, Recordings};

pub use kernels::{check_kernels, check_tensor_attention};
pub use parity::{max_diff, max_diff_masked, relative_error, Fixture};

/// The fixture models the parity checks load: six architectures, both heads
/// each, and OPT's post-norm layout with projected embeddings.
pub const FIXTURE_MODELS: &[&str] = &[
    "gpt_neox-causal",
    "gpt_neox-seqcls",
    "llama-causal",
    "llama-seqcls",
    "qwen2-causal",
    "qwen2-seqcls",
    "qwen3-causal",
    "qwen3-seqcls",
    "gpt2-causal",
    "gpt2-seqcls",
    "opt-causal",
    "opt-postnorm-causal",
    "opt-seqcls",
];

/// The causal fixtures with a PEFT adapter (`fixtures/adapters/<name>`).
pub const ADAPTER_FIXTURES: &[&str] = &["gpt_neox-causal", "llama-causal", "gpt2-causal", "opt-postnorm-causal"];

/// Logits and scores agree with transformers' f32 outputs to this much.
pub const LOGIT_TOLERANCE: f32 = 1e-4;
/// Gradients agree to this much, relative to each one's largest magnitude.
pub const GRADIENT_TOLERANCE: f32 = 1e-4;

/// One measured comparison.
#[derive(Debug, Clone)]
pub struct Check {
    pub group: &'static str,
    pub name: String,
    pub dtype: DType,
    /// Error of the value (forward).
    pub value: f32,
    /// Worst error of the gradients, where there are gradients.
    pub gradient: Option<f32>,
    pub tolerance: f32,
    /// Why the comparison could not run.
    pub error: Option<String>,
}

impl Check {
    pub fn new(
        group: &'static str,
        name: &str,
        dtype: DType,
        value: f32,
        gradient: Option<f32>,
        tolerance: f32,
    ) -> Self {
        Self { group, name: name.into(), dtype, value, gradient, tolerance, error: None }
    }

    /// A check that could not run: it fails, and its row shows the first
    /// line of the error, without the backtrace candle may add below it.
    pub fn failed(group: &'static str, name: &str, dtype: DType, error: impl std::fmt::Display) -> Self {
        let error = error.to_string().lines().next().unwrap_or_default().to_string();
        Self { error: Some(error), ..Self::new(group, name, dtype, f32::NAN, None, 0.0) }
    }

    pub fn passed(&self) -> bool {
        let within = |e: f32| e.is_finite() && e <= self.tolerance;
        self.error.is_none() && within(self.value) && self.gradient.is_none_or(within)
    }
}

/// Tolerances of the fixture checks in `dtype`: (logits and scores,
/// gradients). In bf16, an error relative to the reference's largest
/// magnitude (at least 1) is measured instead of an absolute one.
/// transformers' own bf16 run is off its f32 reference by up to 4.2e-2 in
/// the logits (qwen3-causal) and 5.6e-2 in the gradients (gpt_neox-seqcls)
/// on these fixtures. ReLU MLPs (OPT) get a wider gradient tolerance: a
/// pre-activation within bf16's rounding of 0 switches its unit's whole
/// gradient row, and transformers' own bf16 autocast is off by 0.19 to 0.56
/// in `fc1`'s gradient on the OPT fixtures.
fn fixture_tolerances(dtype: DType, relu: bool) -> (f32, f32) {
    match dtype {
        DType::F32 => (LOGIT_TOLERANCE, GRADIENT_TOLERANCE),
        _ if relu => (6e-2, 3e-1),
        _ => (6e-2, 1e-1),
    }
}

/// The fixture parity of every architecture on `device`, in each of `dtypes`.
/// Greedy generation must give transformers' tokens in f32; bf16 rounding
/// may flip near-ties, so it is not compared there. In f32 the causal
/// fixtures with an adapter also decode greedily on `device` as on the
/// CPU; on a GPU their decoding steps must have been recorded.
pub fn check_fixtures(fixtures: &Path, device: &Device, dtypes: &[DType]) -> Vec<Check> {
    let mut out = Vec::new();
    for &dtype in dtypes {
        for &name in FIXTURE_MODELS {
            if let Err(e) = fixture_checks(fixtures, name, device, dtype, &mut out) {
                out.push(Check::failed("fixture", name, dtype, e));
            }
        }
    }
    if dtypes.contains(&DType::F32) {
        for &name in ADAPTER_FIXTURES {
            let before = recordings();
            let what = format!("{name} adapter greedy");
            out.push(match parity::adapter_greedy_mismatches(fixtures, name, device) {
                Ok((wrong, rows)) => {
                    let what = format!("{what} ({rows} prompts)");
                    Check::new("fixture", &what, DType::F32, wrong as f32 / rows as f32, None, 0.0)
                }
                Err(e) => Check::failed("fixture", &what, DType::F32, e),
            });
            out.extend(recorded_row(device, &format!("{name} adapter steps recorded"), &before));
        }
    }
    out
}

/// On a GPU, whether the decoding steps run since `before` were recorded
/// as CUDA graphs; the row names why not. None on the CPU, which records
/// nothing.
fn recorded_row(device: &Device, what: &str, before: &Recordings) -> Option<Check> {
    if !device.is_cuda() {
        return None;
    }
    let now = recordings();
    Some(match (now.failed - before.failed, now.recorded - before.recorded) {
        (0, 0) => Check::failed("fixture", what, DType::F32, "no decoding step was recorded"),
        (0, _) => Check::new("fixture", what, DType::F32, 0.0, None, 0.0),
        (failed, _) => {
            let cause = now.cause.unwrap_or_default();
            Check::failed("fixture", what, DType::F32, format!("{failed} batches launched from the host: {cause}"))
        }
    })
}

/// The checks of one fixture model in `dtype`, appended to `out`.
fn fixture_checks(
    fixtures: &Path,
    name: &str,
    device: &Device,
    dtype: DType,
    out: &mut Vec<Check>,
) -> crate::Result<()> {
    let fixture = Fixture::load(fixtures, name, device, dtype)?;
    let raw = &fixture.model.config().raw;
    let relu =
        ["activation_function", "hidden_act"].iter().any(|k| raw.get(k).and_then(|v| v.as_str()) == Some("relu"));
    let (logit_tol, grad_tol) = fixture_tolerances(dtype, relu);
    let scale = |key: &str| -> crate::Result<f32> {
        Ok(match dtype {
            DType::F32 => 1.0,
            _ => fixture.reference[key].abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1.0),
        })
    };
    let check = |what: &str, value: f32, gradient: Option<f32>, tolerance: f32| {
        Check::new("fixture", &format!("{name} {what}"), dtype, value, gradient, tolerance)
    };
    let logits = fixture.logits_error(fixture.model.network(), "left")? / scale("left.logits")?;
    let logits = logits.max(fixture.logits_error(fixture.model.frozen(), "right")? / scale("right.logits")?);
    out.push(check("logits", logits, None, logit_tol));
    if fixture.is_causal() {
        out.push(check("kv-cache decoding", fixture.kv_cache_error()? / scale("left.logits")?, None, logit_tol));
    } else {
        let scores = (fixture.scores_error("left")? / scale("left.scores")?)
            .max(fixture.scores_error("right")? / scale("right.scores")?);
        out.push(check("scores", scores, None, logit_tol));
    }
    let (n, gradient) = fixture.gradient_error()?;
    out.push(check(&format!("gradients ({n} tensors)"), 0.0, Some(gradient), grad_tol));
    if fixture.is_causal() && dtype == DType::F32 {
        let before = recordings();
        let (wrong, rows) = fixture.greedy_mismatches()?;
        // Token identity: the error is the share of rows that differ.
        out.push(check(&format!("greedy tokens ({rows} prompts)"), wrong as f32 / rows as f32, None, 0.0));
        out.extend(recorded_row(device, &format!("{name} steps recorded"), &before));
    }
    Ok(())
}

/// The checks as a table, then a verdict line.
pub fn table(device: &Device, checks: &[Check]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<8} {:<44} {:<5} {:>10} {:>10} {:>8}  result",
        "check", "what", "dtype", "value err", "grad err", "tol"
    );
    for c in checks {
        if let Some(e) = &c.error {
            let _ =
                writeln!(s, "{:<8} {:<44} {:<5} FAIL: {e}", c.group, c.name, format!("{:?}", c.dtype).to_lowercase());
            continue;
        }
        let grad = c.gradient.map_or("-".to_string(), |g| format!("{g:.2e}"));
        let verdict = if c.passed() { "ok" } else { "FAIL" };
        let dtype = format!("{:?}", c.dtype).to_lowercase();
        let _ = writeln!(
            s,
            "{:<8} {:<44} {:<5} {:>10.2e} {:>10} {:>8.0e}  {verdict}",
            c.group, c.name, dtype, c.value, grad, c.tolerance
        );
    }
    let failed = checks.iter().filter(|c| !c.passed()).count();
    let _ = writeln!(
        s,
        "{} checks on {}: {} passed, {failed} failed",
        checks.len(),
        describe(device),
        checks.len() - failed
    );
    s
}

/// The device in words.
pub fn describe(device: &Device) -> String {
    match device {
        Device::Cpu => "the CPU".into(),
        Device::Cuda(_) => "CUDA".into(),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU the f32 rows compare each kernel with itself; the bf16
    /// rows run the compositions in bf16 against the f32 kernels.
    #[test]
    fn every_kernel_passes_on_the_cpu_in_f32_and_bf16() {
        let checks = check_kernels(&Device::Cpu, &[DType::F32, DType::BF16]);
        let table = table(&Device::Cpu, &checks);
        assert!(checks.iter().all(Check::passed), "{table}");
        assert!(checks.iter().any(|c| c.dtype == DType::BF16 && c.value > 0.0), "bf16 differs from f32 somewhere");
    }

    #[test]
    fn a_check_that_could_not_run_fails_and_says_why() {
        // An error with a backtrace below it fills one row.
        let c = Check::failed("fixture", "llama-causal", DType::F32, "no such file\n   0: <unknown>\n   1: <unknown>");
        assert!(!c.passed());
        let table = table(&Device::Cpu, &[c]);
        assert!(table.contains("FAIL: no such file\n") && table.contains("0 passed, 1 failed"), "{table}");
        assert!(!table.contains("<unknown>"), "{table}");
    }
}
