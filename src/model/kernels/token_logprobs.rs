//! Log-softmax, gather and entropy over the vocabulary in one pass: the
//! log-prob of each row's target token under `softmax(logits / T)` and the
//! entropy of that distribution, without materialising the (N, V)
//! log-softmax. That tensor and the ones its composition keeps for backward
//! dominate the memory of a training step on a large vocabulary.
//!
//! The backward pass recomputes the softmax from the logits and the saved
//! log-sum-exp instead of storing it: d logit_v = g / T * (1[v = target] - p_v).
//! The entropy is a metric and carries no gradient.

use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::math::{exp, with_avx2};
use super::rows_per_task;
use crate::model::ops;

/// logits: (N, V); `targets`: N token ids. Returns (logprobs, entropy), both
/// (N,); only the log-probs are differentiable.
pub fn token_logprobs(logits: &Tensor, targets: &[u32], temperature: f64) -> Result<(Tensor, Tensor)> {
    let (n, _) = logits.dims2()?;
    if targets.len() != n {
        candle_core::bail!("token-logprobs: {} targets for {n} rows", targets.len());
    }
    if !super::fused(logits) {
        return composed(logits, targets, temperature);
    }
    let op = TokenLogprobs { targets: targets.to_vec(), inv_temperature: (1.0 / temperature) as f32 };
    // (N, 2): [log-prob, entropy] per row.
    let out = logits.contiguous()?.apply_op1(op)?;
    Ok((out.narrow(1, 0, 1)?.squeeze(1)?, out.narrow(1, 1, 1)?.squeeze(1)?.detach()))
}

/// The same values from differentiable candle ops: any device and dtype.
fn composed(logits: &Tensor, targets: &[u32], temperature: f64) -> Result<(Tensor, Tensor)> {
    let logp = ops::log_softmax_last(&(logits / temperature)?)?;
    let ids = Tensor::from_slice(targets, (targets.len(), 1), logits.device())?;
    let logprobs = logp.gather(&ids, D::Minus1)?.squeeze(1)?;
    let logp = logp.detach();
    let entropy = (logp.exp()? * &logp)?.sum(D::Minus1)?.neg()?;
    Ok((logprobs, entropy))
}

struct TokenLogprobs {
    targets: Vec<u32>,
    inv_temperature: f32,
}

impl CustomOp1 for TokenLogprobs {
    fn name(&self) -> &'static str {
        "token-logprobs"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v, logits) = rows(storage, layout, "token-logprobs")?;
        let mut out = vec![0f32; n * 2];
        let per_task = rows_per_task(v);
        out.par_chunks_mut(2 * per_task).enumerate().for_each(|(task, out)| {
            with_avx2(
                #[inline(always)]
                || {
                    for (r, out) in out.chunks_mut(2).enumerate() {
                        let i = task * per_task + r;
                        let row = &logits[i * v..(i + 1) * v];
                        let (lse, entropy) = log_sum_exp_and_entropy(row, self.inv_temperature);
                        out[0] = row[self.targets[i] as usize] * self.inv_temperature - lse;
                        out[1] = entropy;
                    }
                },
            )
        });
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }

    fn bwd(&self, logits: &Tensor, out: &Tensor, grad_out: &Tensor) -> Result<Option<Tensor>> {
        let grad = TokenLogprobsGrad { targets: self.targets.clone(), inv_temperature: self.inv_temperature };
        let grad_logits = logits.apply_op3_no_bwd(&out.contiguous()?, &grad_out.contiguous()?, &grad)?;
        Ok(Some(grad_logits))
    }
}

/// (log-sum-exp, entropy) of `softmax(row * s)`, in two passes over the row.
#[inline(always)]
fn log_sum_exp_and_entropy(row: &[f32], s: f32) -> (f32, f32) {
    let max = max(row) * s;
    // With u = s x - max: S0 = sum e^u, S1 = sum u e^u; H = ln S0 - S1 / S0.
    // Eight partial sums, so the loop vectorises.
    let (mut s0, mut s1) = ([0f32; 8], [0f32; 8]);
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            let u = c[j] * s - max;
            let e = exp(u);
            s0[j] += e;
            s1[j] += u * e;
        }
    }
    for &x in tail {
        let u = x * s - max;
        let e = exp(u);
        s0[0] += e;
        s1[0] += u * e;
    }
    let (s0, s1): (f32, f32) = (s0.iter().sum(), s1.iter().sum());
    let ln_s0 = s0.ln();
    (max + ln_s0, ln_s0 - s1 / s0)
}

/// The backward kernel: (logits, forward output, its gradient) -> d logits.
struct TokenLogprobsGrad {
    targets: Vec<u32>,
    inv_temperature: f32,
}

impl CustomOp3 for TokenLogprobsGrad {
    fn name(&self) -> &'static str {
        "token-logprobs-grad"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        logits_l: &Layout,
        out: &CpuStorage,
        out_l: &Layout,
        grad_out: &CpuStorage,
        grad_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v, logits) = rows(logits, logits_l, "token-logprobs-grad")?;
        let out = &out.as_slice::<f32>()?[out_l.start_offset()..];
        let grad_out = &grad_out.as_slice::<f32>()?[grad_l.start_offset()..];
        let s = self.inv_temperature;
        let mut grad = vec![0f32; n * v];
        let per_task = rows_per_task(v);
        grad.par_chunks_mut(v * per_task).enumerate().for_each(|(task, grad)| {
            for (r, grad) in grad.chunks_mut(v).enumerate() {
                let i = task * per_task + r;
                let g = grad_out[2 * i];
                if g == 0.0 {
                    continue; // masked positions: the buffer is already zero
                }
                let row = &logits[i * v..(i + 1) * v];
                let target = self.targets[i] as usize;
                let lse = row[target] * s - out[2 * i];
                let gs = g * s;
                with_avx2(
                    #[inline(always)]
                    || {
                        for (d, &x) in grad.iter_mut().zip(row) {
                            *d = -gs * exp(x * s - lse);
                        }
                    },
                );
                grad[target] += gs;
            }
        });
        Ok((CpuStorage::F32(grad), Shape::from((n, v))))
    }
}

/// The largest element (-inf for an empty row), with eight running maxima
/// so the loop vectorises.
#[inline(always)]
fn max(row: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            m[j] = m[j].max(c[j]);
        }
    }
    tail.iter().chain(&m).fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// The (N, V) contiguous f32 rows of a 2-d input.
fn rows<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<(usize, usize, &'a [f32])> {
    let [n, v] = layout.dims() else { candle_core::bail!("{op}: expected 2-d logits, got {:?}", layout.dims()) };
    Ok((*n, *v, super::contiguous_f32(storage, layout)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
    }

    #[test]
    fn matches_the_composition_in_value_and_gradient() {
        let dev = Device::Cpu;
        let (n, v) = (7, 300);
        let logits = (Tensor::randn(0f32, 3.0, (n, v), &dev).unwrap() + 5.0).unwrap();
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % v as u32).collect();
        // Weights per row, one of them zero as for a masked position.
        let w = Tensor::from_vec(vec![1.0f32, -2.0, 0.5, 0.0, 3.0, -1.0, 0.25], n, &dev).unwrap();
        for temperature in [1.0, 0.7] {
            let var = Var::from_tensor(&logits).unwrap();
            let (lp, ent) = token_logprobs(var.as_tensor(), &targets, temperature).unwrap();
            let (lp_ref, ent_ref) = composed(&logits, &targets, temperature).unwrap();
            assert!(max_abs_diff(&lp, &lp_ref) < 2e-5, "logprobs");
            assert!(max_abs_diff(&ent, &ent_ref) < 2e-5, "entropy");

            let grad = lp.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
            let got = grad.get(&var).unwrap();
            let var_ref = Var::from_tensor(&logits).unwrap();
            let (lp_ref, _) = composed(var_ref.as_tensor(), &targets, temperature).unwrap();
            let grad_ref = lp_ref.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
            let want = grad_ref.get(&var_ref).unwrap();
            // Gradients reach 3 / 0.7 here: 5e-6 is float rounding.
            assert!(max_abs_diff(got, want) < 5e-6, "gradient at T={temperature}: {}", max_abs_diff(got, want));
        }
    }

    #[test]
    fn entropy_has_no_gradient() {
        let var = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 10), &Device::Cpu).unwrap()).unwrap();
        let (_, ent) = token_logprobs(var.as_tensor(), &[1, 2, 3], 1.0).unwrap();
        let grads = ent.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(&var).is_none());
    }

    #[test]
    fn a_wrong_number_of_targets_is_an_error() {
        let logits = Tensor::zeros((3, 10), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = token_logprobs(&logits, &[1, 2], 1.0).unwrap_err().to_string();
        assert!(err.contains("2 targets for 3 rows"), "{err}");
    }
}
