//! The LM head, log-softmax, gather and entropy as one op: from hidden
//! states, the log-prob of each row's target token under
//! `softmax(h w^T / T)` and the entropy of that distribution, without the
//! (N, V) log-softmax or its composition's intermediates, which dominate the
//! memory of a training step on a large vocabulary.
//!
//! The rows go through in chunks of at most [`LOGITS_CHUNK_BYTES`] of
//! logits, so a pass over many tokens never holds all of its (N, V) logits:
//! a reference pass over 256 completions of 128 tokens at Pythia's 50,304
//! words would need 6.6 GB for them. When the logits fit one chunk the
//! forward pass keeps them for the backward; otherwise the backward
//! computes each chunk's again. The backward turns a chunk's logits in
//! place into d logit_v = g / T * (1[v = target] - p_v) and multiplies out
//! d h and, summed over the chunks in order, d w: the (N, V) gradient never
//! enters candle's gradient store, which would zero a buffer of that size
//! and add it in on one thread. The entropy is a metric and carries no
//! gradient.
//!
//! That is the f32 CPU kernel. On a GPU and in other dtypes the same
//! chunks go through candle's matrix products (and, on a GPU, a kernel for
//! the log-softmax, gather and entropy that reads the logits in the
//! product's dtype, and one that turns them into d logits in place); a
//! training pass computes each chunk's logits again in its backward, and
//! adds each chunk's d w into their f32 sum in place.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, InplaceOp3, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::linear::{matmul, Operand};
use super::math::{exp, max, with_avx2};
use super::{contiguous_f32, rows_per_task};
use crate::model::ops;

/// The most logits (f32) one chunk of rows computes at once.
pub const LOGITS_CHUNK_BYTES: usize = 256 << 20;

/// Rows per chunk at a vocabulary of `v` words.
pub fn logits_chunk_rows(v: usize) -> usize {
    (LOGITS_CHUNK_BYTES / 4 / v.max(1)).max(1)
}

/// `hidden`: (N, H); `head`: the (V, H) LM head; `targets`: N token ids.
/// Returns (logprobs, entropy), both (N,); only the log-probs are differentiable.
pub fn token_logprobs(hidden: &Tensor, head: &Tensor, targets: &[u32], temperature: f64) -> Result<(Tensor, Tensor)> {
    let (n, _) = hidden.dims2()?;
    if targets.len() != n {
        candle_core::bail!("token-logprobs: {} targets for {n} rows", targets.len());
    }
    let cuda = super::on_cuda(&[hidden, head]);
    if !cuda && super::fused(hidden) && super::fused(head) {
        return fused(hidden, head, targets, temperature, logits_chunk_rows(head.dim(0)?));
    }
    let rows = logits_chunk_rows(head.dim(0)?);
    if hidden.track_op() || head.track_op() {
        return recomputed(hidden, head, targets, temperature, rows);
    }
    op_by_op(hidden, head, targets, temperature, rows)
}

/// Other devices and dtypes in a training pass: the forward goes `rows`
/// rows at a time with no graph, and one op over (hidden, head) carries its
/// values and, in the backward, computes each chunk's logits again. No pass
/// holds more than a chunk of logits or of their gradient, at the cost of
/// one more LM-head product.
fn recomputed(
    hidden: &Tensor,
    head: &Tensor,
    targets: &[u32],
    temperature: f64,
    rows: usize,
) -> Result<(Tensor, Tensor)> {
    let (logprobs, entropy) = op_by_op(&hidden.detach(), &head.detach(), targets, temperature, rows)?;
    let op = Recomputed {
        values: Tensor::stack(&[&logprobs, &entropy], 1)?,
        targets: targets.to_vec(),
        inv_temperature: (1.0 / temperature) as f32,
        rows: rows.max(1),
    };
    // (N, 2): [log-prob, entropy] per row.
    let out = hidden.apply_op2(head, op)?;
    Ok((out.narrow(1, 0, 1)?.squeeze(1)?, out.narrow(1, 1, 1)?.squeeze(1)?.detach()))
}

/// The values (N, 2) f32 of a pass [`recomputed`] has made, with the
/// backward that computes its logits again.
struct Recomputed {
    values: Tensor,
    targets: Vec<u32>,
    inv_temperature: f32,
    rows: usize,
}

impl CustomOp2 for Recomputed {
    fn name(&self) -> &'static str {
        "token-logprobs-recomputed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let (storage, layout) = self.values.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cpu(values) => Ok((values.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("token-logprobs: the values are not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (storage, layout) = self.values.storage_and_layout();
        match &*storage {
            candle_core::Storage::Cuda(values) => Ok((values.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("token-logprobs: the values are not on the GPU"),
        }
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        head: &Tensor,
        _out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let head_trains = head.track_op();
        let (hidden, head) = (hidden.detach(), head.detach());
        let n = hidden.dim(0)?;
        let grad_out = grad_out.to_dtype(DType::F32)?.contiguous()?;
        let mut d_hidden = Vec::with_capacity(n.div_ceil(self.rows));
        let mut d_head: Option<Tensor> = None;
        for start in (0..n).step_by(self.rows) {
            let len = self.rows.min(n - start);
            let part = hidden.narrow(0, start, len)?;
            let targets = &self.targets[start..start + len];
            let d_logits = self.logits_grad(&part, &head, targets, &grad_out.narrow(0, start, len)?)?;
            d_hidden.push(d_logits.matmul(&head)?);
            if head_trains {
                // Summed over the chunks in f32, in order.
                let d = d_logits.t()?.matmul(&part)?;
                match &mut d_head {
                    Some(sum) => super::add_cast_to(sum, &d)?,
                    // The product's own buffer (or its f32 copy): the sum is
                    // the only tensor on it once d goes.
                    None => d_head = Some(d.to_dtype(DType::F32)?),
                }
            }
        }
        let d_head = d_head.map(|d| d.to_dtype(head.dtype())).transpose()?;
        Ok((Some(Tensor::cat(&d_hidden, 0)?), d_head))
    }
}

impl Recomputed {
    /// d logits (n, V) in the hidden states' dtype,
    /// g / T * (1[v = target] - p_v), from one chunk's rows of hidden
    /// states (n, H) and of d out (n, 2), whose entropy column has no
    /// gradient. On a GPU the logits become their gradient in place, the
    /// same bits: the chunk is one (n, V) buffer in that dtype, where in
    /// bf16 an f32 copy of the logits, their f32 gradient and its cast held
    /// five times as much.
    fn logits_grad(&self, part: &Tensor, head: &Tensor, targets: &[u32], grad_out: &Tensor) -> Result<Tensor> {
        let logits = ops::linear(part, head, None)?;
        if super::on_cuda(&[&logits]) && matches!(logits.dtype(), DType::F32 | DType::BF16) {
            let op = LogitsLogprobsGrad { inv_temperature: self.inv_temperature };
            let ids = Tensor::from_slice(targets, targets.len(), logits.device())?;
            // The product's own buffer, which no other tensor holds.
            let logits = logits.contiguous()?;
            logits.inplace_op3(&ids, grad_out, &op)?;
            return Ok(logits);
        }
        let logits = logits.to_dtype(DType::F32)?;
        let inv_t = self.inv_temperature as f64;
        let probs = ops::softmax_last(&(logits * inv_t)?)?;
        let scaled = (grad_out.narrow(1, 0, 1)? * inv_t)?;
        let ids = Tensor::from_slice(targets, (targets.len(), 1), part.device())?;
        probs.broadcast_mul(&scaled)?.neg()?.scatter_add(&ids, &scaled, 1)?.to_dtype(part.dtype())
    }
}

/// Other devices and dtypes: the logits op by op, `rows` rows at a time.
fn op_by_op(
    hidden: &Tensor,
    head: &Tensor,
    targets: &[u32],
    temperature: f64,
    rows: usize,
) -> Result<(Tensor, Tensor)> {
    let (n, cuda) = (targets.len(), super::on_cuda(&[hidden, head]));
    let op = LogitsLogprobs { inv_temperature: (1.0 / temperature) as f32 };
    let mut parts = (Vec::new(), Vec::new());
    for start in (0..n).step_by(rows.max(1)) {
        let (hidden, targets) = (hidden.narrow(0, start, rows.min(n - start))?, &targets[start..(start + rows).min(n)]);
        let logits = ops::linear(&hidden, head, None)?;
        let (logprobs, entropy) = if cuda {
            let ids = Tensor::from_slice(targets, targets.len(), hidden.device())?;
            // The kernel reads bf16 logits as they are: no f32 copy twice their size.
            let logits = match logits.dtype() {
                DType::F32 | DType::BF16 => logits,
                _ => logits.to_dtype(DType::F32)?,
            };
            let out = logits.apply_op2(&ids, op.clone())?;
            (out.narrow(1, 0, 1)?.squeeze(1)?, out.narrow(1, 1, 1)?.squeeze(1)?.detach())
        } else {
            composed(&logits, targets, temperature)?
        };
        parts.0.push(logprobs);
        parts.1.push(entropy);
    }
    Ok((Tensor::cat(&parts.0, 0)?, Tensor::cat(&parts.1, 0)?))
}

/// The CPU kernel, `chunk_rows` rows at a time.
fn fused(
    hidden: &Tensor,
    head: &Tensor,
    targets: &[u32],
    temperature: f64,
    chunk_rows: usize,
) -> Result<(Tensor, Tensor)> {
    let op = TokenLogprobs {
        targets: targets.to_vec(),
        inv_temperature: (1.0 / temperature) as f32,
        chunk_rows: chunk_rows.max(1),
        keep_logits: hidden.track_op() || head.track_op(),
        logits: Mutex::new(None),
    };
    // (N, 2): [log-prob, entropy] per row.
    let out = hidden.contiguous()?.apply_op2(&head.contiguous()?, op)?;
    Ok((out.narrow(1, 0, 1)?.squeeze(1)?, out.narrow(1, 1, 1)?.squeeze(1)?.detach()))
}

/// The same values from differentiable candle ops on the logits: any device and dtype.
fn composed(logits: &Tensor, targets: &[u32], temperature: f64) -> Result<(Tensor, Tensor)> {
    let logp = ops::log_softmax_last(&(logits.to_dtype(candle_core::DType::F32)? / temperature)?)?;
    let ids = Tensor::from_slice(targets, (targets.len(), 1), logits.device())?;
    let logprobs = logp.gather(&ids, D::Minus1)?.squeeze(1)?;
    let logp = logp.detach();
    let entropy = (logp.exp()? * &logp)?.sum(D::Minus1)?.neg()?;
    Ok((logprobs, entropy))
}

/// On the GPU, from f32 or bf16 logits (N, V) and target ids (N,): (N, 2) [log-prob,
/// entropy] in one pass per row, the (N, V) log-softmax of the composition
/// never stored. Without a backward: [`Recomputed`] has it.
#[derive(Clone)]
struct LogitsLogprobs {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    inv_temperature: f32,
}

impl CustomOp2 for LogitsLogprobs {
    fn name(&self) -> &'static str {
        "logits-logprobs"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("logits-logprobs runs on CUDA only (the CPU kernel starts from hidden states)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        logits_l: &Layout,
        targets: &candle_core::CudaStorage,
        targets_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::token_logprobs((logits, logits_l), (targets, targets_l), self.inv_temperature)?;
        Ok((out, Shape::from((targets_l.shape().elem_count(), 2))))
    }
}

/// (logits, targets, d out (N, 2)): the logits become d logits in place, on the GPU.
struct LogitsLogprobsGrad {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    inv_temperature: f32,
}

impl InplaceOp3 for LogitsLogprobsGrad {
    fn name(&self) -> &'static str {
        "logits-logprobs-grad"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        candle_core::bail!("logits-logprobs-grad runs on CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &mut candle_core::CudaStorage,
        logits_l: &Layout,
        targets: &candle_core::CudaStorage,
        targets_l: &Layout,
        grad: &candle_core::CudaStorage,
        grad_l: &Layout,
    ) -> Result<()> {
        super::cuda::token_logprobs_grad(logits, logits_l, (targets, targets_l), (grad, grad_l), self.inv_temperature)
    }
}

struct TokenLogprobs {
    targets: Vec<u32>,
    inv_temperature: f32,
    chunk_rows: usize,
    /// Whether a backward pass may follow, so the logits are worth keeping
    /// (when they fit one chunk).
    keep_logits: bool,
    logits: Mutex<Option<Vec<f32>>>,
}

/// Checks `hidden` (N, H) against `head` (V, H); returns (N, H, V).
fn sizes(h_l: &Layout, w_l: &Layout) -> Result<(usize, usize, usize)> {
    match (h_l.dims(), w_l.dims()) {
        ([n, h], [v, w_h]) if h == w_h => Ok((*n, *h, *v)),
        (h, w) => candle_core::bail!("token-logprobs: hidden states {h:?} do not fit a head of {w:?}"),
    }
}

/// Appends the (n, V) logits `hidden @ head^T` of n rows to `logits`.
fn chunk_logits(logits: &mut Vec<f32>, hidden: &[f32], head: &[f32], (n, h, v): (usize, usize, usize)) {
    matmul(logits, false, n, v, h, Operand { data: hidden, row: h, col: 1 }, Operand { data: head, row: 1, col: h });
}

impl CustomOp2 for TokenLogprobs {
    fn name(&self) -> &'static str {
        "token-logprobs"
    }

    fn cpu_fwd(&self, h_s: &CpuStorage, h_l: &Layout, w_s: &CpuStorage, w_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, h, v) = sizes(h_l, w_l)?;
        let (hidden, head) = (contiguous_f32(h_s, h_l)?, contiguous_f32(w_s, w_l)?);
        let mut out = vec![0f32; n * 2];
        let chunk = self.chunk_rows;
        let mut logits = Vec::with_capacity(chunk.min(n) * v);
        let per_task = rows_per_task(v);
        for (c, out) in out.chunks_mut(2 * chunk).enumerate() {
            let (first, rows) = (c * chunk, out.len() / 2);
            logits.clear();
            chunk_logits(&mut logits, &hidden[first * h..(first + rows) * h], head, (rows, h, v));
            out.par_chunks_mut(2 * per_task).enumerate().for_each(|(task, out)| {
                with_avx2(
                    #[inline(always)]
                    || {
                        for (r, out) in out.chunks_mut(2).enumerate() {
                            let i = task * per_task + r;
                            let row = &logits[i * v..(i + 1) * v];
                            let (lse, entropy) = log_sum_exp_and_entropy(row, self.inv_temperature);
                            out[0] = row[self.targets[first + i] as usize] * self.inv_temperature - lse;
                            out[1] = entropy;
                        }
                    },
                )
            });
        }
        if self.keep_logits && n <= chunk {
            *self.logits.lock().unwrap_or_else(|e| e.into_inner()) = Some(logits);
        }
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        head: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, h) = hidden.dims2()?;
        let v = head.dim(0)?;
        let grad = TokenLogprobsGrad {
            targets: self.targets.clone(),
            inv_temperature: self.inv_temperature,
            chunk_rows: self.chunk_rows,
            out: out.flatten_all()?.to_vec1()?,
            grad_out: grad_out.flatten_all()?.to_vec1()?,
            // A second backward pass over the same graph recomputes them.
            logits: Mutex::new(self.logits.lock().unwrap_or_else(|e| e.into_inner()).take()),
            head_grad: head.track_op(),
        };
        let all = hidden.apply_op2_no_bwd(head, &grad)?;
        let d_hidden = all.narrow(0, 0, n * h)?.reshape((n, h))?;
        let d_head = if grad.head_grad { Some(all.narrow(0, n * h, v * h)?.reshape((v, h))?) } else { None };
        Ok((Some(d_hidden), d_head))
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

/// The backward kernel: (hidden, head) -> [d hidden (N H); d head (V H)], flat.
struct TokenLogprobsGrad {
    targets: Vec<u32>,
    inv_temperature: f32,
    chunk_rows: usize,
    /// The forward output and its gradient, (N, 2) each, on the host.
    out: Vec<f32>,
    grad_out: Vec<f32>,
    logits: Mutex<Option<Vec<f32>>>,
    /// Whether the head trains (a frozen one, as under LoRA, gets no d head).
    head_grad: bool,
}

impl CustomOp2 for TokenLogprobsGrad {
    fn name(&self) -> &'static str {
        "token-logprobs-grad"
    }

    fn cpu_fwd(&self, h_s: &CpuStorage, h_l: &Layout, w_s: &CpuStorage, w_l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, h, v) = sizes(h_l, w_l)?;
        let (hidden, head) = (contiguous_f32(h_s, h_l)?, contiguous_f32(w_s, w_l)?);
        let chunk = self.chunk_rows;
        let kept = self.logits.lock().unwrap_or_else(|e| e.into_inner()).take();
        let mut d_logits = kept.unwrap_or_else(|| Vec::with_capacity(chunk.min(n) * v));
        let mut d_hidden = Vec::with_capacity(n * h);
        let mut d_head = Vec::with_capacity(if self.head_grad { v * h } else { 0 });
        for first in (0..n).step_by(chunk) {
            let rows = chunk.min(n - first);
            let hidden = &hidden[first * h..(first + rows) * h];
            if d_logits.len() != rows * v {
                d_logits.clear();
                chunk_logits(&mut d_logits, hidden, head, (rows, h, v));
            }
            self.logits_to_grad(&mut d_logits, first, v);
            // d hidden (n, H) = d logits (n, V) @ head (V, H).
            let d_logits_op = Operand { data: &d_logits, row: v, col: 1 };
            matmul(&mut d_hidden, false, rows, h, v, d_logits_op, Operand { data: head, row: h, col: 1 });
            if self.head_grad {
                // d head (V, H) += d logits^T (V, n) @ hidden (n, H), chunk after chunk.
                let d_logits_t = Operand { data: &d_logits, row: 1, col: v };
                matmul(&mut d_head, first > 0, v, h, rows, d_logits_t, Operand { data: hidden, row: h, col: 1 });
            }
            d_logits.clear();
        }
        d_hidden.extend_from_slice(&d_head);
        let len = d_hidden.len();
        Ok((CpuStorage::F32(d_hidden), Shape::from(len)))
    }
}

impl TokenLogprobsGrad {
    /// Turns the logits of the rows from `first` on into their gradient, in place.
    fn logits_to_grad(&self, logits: &mut [f32], first: usize, v: usize) {
        let s = self.inv_temperature;
        let per_task = rows_per_task(v);
        logits.par_chunks_mut(v * per_task).enumerate().for_each(|(task, rows)| {
            for (r, row) in rows.chunks_mut(v).enumerate() {
                let i = first + task * per_task + r;
                let g = self.grad_out[2 * i];
                if g == 0.0 {
                    row.fill(0.0); // a masked position
                    continue;
                }
                let target = self.targets[i] as usize;
                let lse = row[target] * s - self.out[2 * i];
                let gs = g * s;
                with_avx2(
                    #[inline(always)]
                    || {
                        for x in row.iter_mut() {
                            *x = -gs * exp(*x * s - lse);
                        }
                    },
                );
                row[target] += gs;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::test_randn;
    use candle_core::{Device, Var};

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
    }

    #[test]
    fn matches_the_composition_in_value_and_gradient() {
        let dev = Device::Cpu;
        let (n, h, v) = (7, 12, 300);
        let hidden = test_randn(&[n, h], 0.0, 1.0);
        let head = (test_randn(&[v, h], 0.0, 0.8) + 0.1).unwrap();
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % v as u32).collect();
        // Weights per row, one of them zero as for a masked position.
        let w = Tensor::from_vec(vec![1.0f32, -2.0, 0.5, 0.0, 3.0, -1.0, 0.25], n, &dev).unwrap();
        let run = |fused: bool, temperature: f64| {
            let (hv, wv) = (Var::from_tensor(&hidden).unwrap(), Var::from_tensor(&head).unwrap());
            let (lp, ent) = if fused {
                token_logprobs(hv.as_tensor(), wv.as_tensor(), &targets, temperature).unwrap()
            } else {
                composed(&ops::linear(hv.as_tensor(), wv.as_tensor(), None).unwrap(), &targets, temperature).unwrap()
            };
            let grads = lp.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
            (lp, ent, grads.get(&hv).unwrap().clone(), grads.get(&wv).unwrap().clone())
        };
        for temperature in [1.0, 0.7] {
            let (lp, ent, dh, dw) = run(true, temperature);
            let (lp_ref, ent_ref, dh_ref, dw_ref) = run(false, temperature);
            assert!(max_abs_diff(&lp, &lp_ref) < 2e-5, "logprobs");
            assert!(max_abs_diff(&ent, &ent_ref) < 2e-5, "entropy");
            assert!(max_abs_diff(&dh, &dh_ref) < 2e-5, "d hidden at T={temperature}: {}", max_abs_diff(&dh, &dh_ref));
            assert!(max_abs_diff(&dw, &dw_ref) < 2e-5, "d head at T={temperature}: {}", max_abs_diff(&dw, &dw_ref));
        }
    }

    #[test]
    fn chunks_of_rows_give_the_whole_passs_values_and_gradients() {
        let dev = Device::Cpu;
        let (n, h, v) = (7, 12, 300);
        let hidden = test_randn(&[n, h], 0.0, 1.0);
        let head = test_randn(&[v, h], 0.0, 0.8);
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 53 + 5) % v as u32).collect();
        let w = Tensor::from_vec(vec![0.5f32, 0.0, -1.0, 2.0, 1.0, 0.0, -0.5], n, &dev).unwrap();
        let run = |chunk_rows: usize| {
            let (hv, wv) = (Var::from_tensor(&hidden).unwrap(), Var::from_tensor(&head).unwrap());
            let (lp, ent) = fused(hv.as_tensor(), wv.as_tensor(), &targets, 0.9, chunk_rows).unwrap();
            let grads = lp.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
            (lp, ent, grads.get(&hv).unwrap().clone(), grads.get(&wv).unwrap().clone())
        };
        let whole = run(n);
        for chunk_rows in [1, 3] {
            let chunked = run(chunk_rows);
            // To rounding: the matrix products block differently by rows.
            assert!(max_abs_diff(&chunked.0, &whole.0) < 1e-5, "logprobs in chunks of {chunk_rows}");
            assert!(max_abs_diff(&chunked.1, &whole.1) < 1e-5, "entropy in chunks of {chunk_rows}");
            assert!(max_abs_diff(&chunked.2, &whole.2) < 1e-5, "d hidden in chunks of {chunk_rows}");
            assert!(max_abs_diff(&chunked.3, &whole.3) < 1e-5, "d head in chunks of {chunk_rows}");
        }
    }

    #[test]
    fn other_dtypes_give_the_same_values_a_chunk_of_rows_at_a_time() {
        let hidden = test_randn(&[7, 12], 0.0, 1.0).to_dtype(candle_core::DType::BF16).unwrap();
        let head = test_randn(&[300, 12], 0.0, 0.8).to_dtype(candle_core::DType::BF16).unwrap();
        let targets: Vec<u32> = (0..7).map(|i| (i * 41 + 3) % 300).collect();
        let (lp, ent) = op_by_op(&hidden, &head, &targets, 0.8, 7).unwrap();
        let (lp3, ent3) = op_by_op(&hidden, &head, &targets, 0.8, 3).unwrap();
        assert_eq!(lp3.dims(), [7]);
        assert!(max_abs_diff(&lp, &lp3) < 1e-5 && max_abs_diff(&ent, &ent3) < 1e-5);
    }

    #[test]
    fn a_training_pass_in_other_dtypes_recomputes_each_chunk_and_matches_the_kernel() {
        let dev = Device::Cpu;
        let (n, h, v) = (7, 12, 300);
        let hidden = test_randn(&[n, h], 0.0, 1.0);
        let head = test_randn(&[v, h], 0.0, 0.8);
        let targets: Vec<u32> = (0..n as u32).map(|i| (i * 29 + 7) % v as u32).collect();
        let w = Tensor::from_vec(vec![1.0f32, 0.0, -0.5, 2.0, 1.5, -1.0, 0.5], n, &dev).unwrap();
        let run = |dtype: candle_core::DType, chunk_rows: Option<usize>| {
            let on = |t: &Tensor| Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap();
            let (hv, wv) = (on(&hidden), on(&head));
            let (lp, ent) = match chunk_rows {
                Some(rows) => recomputed(hv.as_tensor(), wv.as_tensor(), &targets, 0.8, rows).unwrap(),
                None => token_logprobs(hv.as_tensor(), wv.as_tensor(), &targets, 0.8).unwrap(),
            };
            let grads = lp.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
            let f32 = |t: &Tensor| t.to_dtype(candle_core::DType::F32).unwrap();
            (lp, ent, f32(grads.get(&hv).unwrap()), f32(grads.get(&wv).unwrap()))
        };
        let kernel = run(candle_core::DType::F32, None);
        for chunk_rows in [1, 3, n] {
            let (lp, ent, dh, dw) = run(candle_core::DType::F32, Some(chunk_rows));
            assert!(max_abs_diff(&lp, &kernel.0) < 1e-5 && max_abs_diff(&ent, &kernel.1) < 1e-5);
            assert!(max_abs_diff(&dh, &kernel.2) < 1e-5, "d hidden in chunks of {chunk_rows}");
            assert!(max_abs_diff(&dw, &kernel.3) < 1e-5, "d head in chunks of {chunk_rows}");
        }
        // bf16 takes this path by default, to bf16's precision (relative
        // to each reference's largest magnitude).
        let (lp, _, dh, dw) = run(candle_core::DType::BF16, None);
        let relative = |a: &Tensor, b: &Tensor| {
            let a = a.to_dtype(candle_core::DType::F32).unwrap();
            max_abs_diff(&a, b) / b.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
        };
        assert!(relative(&lp, &kernel.0) < 3e-2, "bf16 logprobs: {}", relative(&lp, &kernel.0));
        assert!(relative(&dh, &kernel.2) < 3e-2, "bf16 d hidden: {}", relative(&dh, &kernel.2));
        assert!(relative(&dw, &kernel.3) < 3e-2, "bf16 d head: {}", relative(&dw, &kernel.3));
    }

    #[test]
    fn a_second_backward_pass_recomputes_the_logits() {
        let hidden = Var::from_tensor(&test_randn(&[3, 4], 0.0, 1.0)).unwrap();
        let head = test_randn(&[10, 4], 0.0, 1.0);
        let (lp, _) = token_logprobs(hidden.as_tensor(), &head, &[1, 2, 3], 1.0).unwrap();
        let loss = lp.sum_all().unwrap();
        let first = loss.backward().unwrap().get(&hidden).unwrap().clone();
        let second = loss.backward().unwrap().get(&hidden).unwrap().clone();
        assert_eq!(max_abs_diff(&first, &second), 0.0);
    }

    #[test]
    fn a_frozen_head_gets_no_gradient_and_the_hidden_states_theirs() {
        let hidden = test_randn(&[5, 4], 0.0, 1.0);
        let head = test_randn(&[10, 4], 0.0, 1.0);
        let d_hidden = |head: &Tensor| {
            let var = Var::from_tensor(&hidden).unwrap();
            let (lp, _) = token_logprobs(var.as_tensor(), head, &[1, 2, 3, 4, 5], 0.8).unwrap();
            let grads = lp.sum_all().unwrap().backward().unwrap();
            (grads.get(&var).unwrap().clone(), grads.get(head).is_some())
        };
        let (frozen, frozen_has_grad) = d_hidden(&head);
        let trained = Var::from_tensor(&head).unwrap();
        let (with_head, trained_has_grad) = d_hidden(trained.as_tensor());
        assert!(!frozen_has_grad && trained_has_grad);
        assert_eq!(max_abs_diff(&frozen, &with_head), 0.0);
    }

    #[test]
    fn entropy_has_no_gradient() {
        let var = Var::from_tensor(&test_randn(&[3, 4], 0.0, 1.0)).unwrap();
        let head = test_randn(&[10, 4], 0.0, 1.0);
        let (_, ent) = token_logprobs(var.as_tensor(), &head, &[1, 2, 3], 1.0).unwrap();
        let grads = ent.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(&var).is_none());
    }

    #[test]
    fn a_wrong_number_of_targets_is_an_error() {
        let hidden = Tensor::zeros((3, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let head = Tensor::zeros((10, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = token_logprobs(&hidden, &head, &[1, 2], 1.0).unwrap_err().to_string();
        assert!(err.contains("2 targets for 3 rows"), "{err}");
    }
}
