//! Self-attention over a whole sequence (no cache): rotary embeddings,
//! scaled dot products with an additive bias, softmax and the weighted sum
//! of values, forward and backward, one task per (row, key/value head).
//!
//! The composition takes about thirty candle ops per layer (transposes,
//! copies, a rotate-half of q and k, two batched matmuls of many tiny
//! matrices, the softmax chain), and its backward about twice that, each
//! with its own allocation and gradient accumulation. Heads here are a few
//! dozen positions by a few dozen features, so plain loops do.
//!
//! The backward pass recomputes the probabilities instead of storing them,
//! and un-rotates the query and key gradients: rotate-half is orthogonal.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::contiguous_f32;
use super::math::{exp, with_avx2};

/// Host copies of what every layer of one forward pass shares.
#[derive(Clone)]
pub struct AttentionInputs {
    /// (B, T, S) additive bias: 0 where a query may see a key.
    pub bias: Arc<Vec<f32>>,
    /// (B, T, R) rotary tables in rotate-half layout, R = 0 for none.
    pub cos: Arc<Vec<f32>>,
    pub sin: Arc<Vec<f32>>,
    pub rotary_dim: usize,
}

impl AttentionInputs {
    /// From the (B, 1, T, S) bias and optional (B, 1, T, R) rotary tables.
    pub fn new(bias: &Tensor, rotary: Option<&(Tensor, Tensor)>) -> Result<Self> {
        let host = |t: &Tensor| -> Result<Arc<Vec<f32>>> { Ok(Arc::new(t.flatten_all()?.to_vec1()?)) };
        let (cos, sin, rotary_dim) = match rotary {
            Some((cos, sin)) => (host(cos)?, host(sin)?, cos.dim(3)?),
            None => (Arc::default(), Arc::default(), 0),
        };
        Ok(Self { bias: host(bias)?, cos, sin, rotary_dim })
    }
}

/// q: (B, T, H, D); k, v: (B, T, Hkv, D) with H a multiple of Hkv. Returns
/// (B, T, H * D).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, inputs: &AttentionInputs, scale: f64) -> Result<Tensor> {
    let (b, t, h, d) = q.dims4()?;
    let op = Attention { inputs: inputs.clone(), scale: scale as f32 };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)?.reshape((b, t, h * d))
}

struct Attention {
    inputs: AttentionInputs,
    scale: f32,
}

/// Sizes of one call.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    h: usize,
    h_kv: usize,
    d: usize,
    r: usize,
}

impl Dims {
    fn new(q: &Layout, k: &Layout, r: usize) -> Result<Self> {
        let (&[b, t, h, d], &[_, _, h_kv, _]) = (q.dims(), k.dims()) else {
            candle_core::bail!("attention: q and k must be 4-d, got {:?} and {:?}", q.dims(), k.dims())
        };
        if h % h_kv != 0 || r > d || r % 2 != 0 {
            candle_core::bail!("attention: {h} query heads over {h_kv} key heads, rotary {r} of {d}");
        }
        Ok(Self { b, t, h, h_kv, d, r })
    }
}

impl Attention {
    /// Rotates the first R features of `x` (D,) at row `bi`, position `ti`;
    /// `inverse` rotates back (the transpose, for gradients).
    #[inline(always)]
    fn rotate(&self, x: &mut [f32], dims: Dims, bi: usize, ti: usize, inverse: bool) {
        let r = dims.r;
        if r == 0 {
            return;
        }
        let at = (bi * dims.t + ti) * r;
        let (cos, sin) = (&self.inputs.cos[at..at + r], &self.inputs.sin[at..at + r]);
        let half = r / 2;
        let sign = if inverse { -1.0 } else { 1.0 };
        for i in 0..half {
            let (x1, x2) = (x[i], x[i + half]);
            x[i] = x1 * cos[i] - sign * x2 * sin[i];
            x[i + half] = x2 * cos[i + half] + sign * x1 * sin[i + half];
        }
    }

    /// The (T, D) slice of head `hi` of row `bi` from a (B, T, heads, D)
    /// tensor, rotated when asked.
    fn head(&self, x: &[f32], heads: usize, dims: Dims, bi: usize, hi: usize, rotate: bool) -> Vec<f32> {
        let d = dims.d;
        let mut out = vec![0f32; dims.t * d];
        for ti in 0..dims.t {
            let at = ((bi * dims.t + ti) * heads + hi) * d;
            let row = &mut out[ti * d..(ti + 1) * d];
            row.copy_from_slice(&x[at..at + d]);
            if rotate {
                self.rotate(row, dims, bi, ti, false);
            }
        }
        out
    }

    /// Softmax probabilities (T, T) of rotated `q` (T, D) against the
    /// transposed rotated keys `k_t` (D, T).
    #[inline(always)]
    fn probs(&self, q: &[f32], k_t: &[f32], dims: Dims, bi: usize) -> Vec<f32> {
        let (t, d) = (dims.t, dims.d);
        let bias = &self.inputs.bias[bi * t * t..(bi + 1) * t * t];
        let mut p = vec![0f32; t * t];
        for i in 0..t {
            let row = &mut p[i * t..(i + 1) * t];
            row_times(row, &q[i * d..(i + 1) * d], k_t);
            let mut max = f32::NEG_INFINITY;
            for (s, b) in row.iter_mut().zip(&bias[i * t..(i + 1) * t]) {
                *s = *s * self.scale + b;
                max = max.max(*s);
            }
            let mut total = 0f32;
            for s in row.iter_mut() {
                *s = exp(*s - max);
                total += *s;
            }
            let inv = 1.0 / total;
            row.iter_mut().for_each(|s| *s *= inv);
        }
        p
    }
}

/// `out = x M` for a row `x` (D,) and `m_t` (D, T) row-major: T-wide
/// multiply-adds, which vectorise (a dot product's reduction would not).
#[inline(always)]
fn row_times(out: &mut [f32], x: &[f32], m_t: &[f32]) {
    let t = out.len();
    out.fill(0.0);
    for (xd, m_row) in x.iter().zip(m_t.chunks_exact(t)) {
        axpy(out, *xd, m_row);
    }
}

/// (T, D) -> (D, T).
fn transpose(x: &[f32], t: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; t * d];
    for i in 0..t {
        for j in 0..d {
            out[j * t + i] = x[i * d + j];
        }
    }
    out
}

/// `out += w * x` for rows of equal length.
#[inline(always)]
fn axpy(out: &mut [f32], w: f32, x: &[f32]) {
    out.iter_mut().zip(x).for_each(|(o, x)| *o += w * x);
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = Dims::new(q_l, k_l, self.inputs.rotary_dim)?;
        let (q, k, v) = (contiguous_f32(q, q_l)?, contiguous_f32(k, k_l)?, contiguous_f32(v, v_l)?);
        let Dims { b, t, h, h_kv, d, .. } = dims;
        let n_rep = h / h_kv;
        // One task per (row, kv head): its query heads' outputs, (n_rep, T, D).
        let parts: Vec<Vec<f32>> = (0..b * h_kv)
            .into_par_iter()
            .map(|task| {
                with_avx2(
                    #[inline(always)]
                    || {
                        let (bi, g) = (task / h_kv, task % h_kv);
                        let k_t = transpose(&self.head(k, h_kv, dims, bi, g, true), t, d);
                        let vh = self.head(v, h_kv, dims, bi, g, false);
                        let mut out = vec![0f32; n_rep * t * d];
                        for rep in 0..n_rep {
                            let qh = self.head(q, h, dims, bi, g * n_rep + rep, true);
                            let p = self.probs(&qh, &k_t, dims, bi);
                            for i in 0..t {
                                let o = &mut out[(rep * t + i) * d..(rep * t + i + 1) * d];
                                for j in 0..t {
                                    axpy(o, p[i * t + j], &vh[j * d..(j + 1) * d]);
                                }
                            }
                        }
                        out
                    },
                )
            })
            .collect();
        let mut out = vec![0f32; b * t * h * d];
        for (task, part) in parts.iter().enumerate() {
            let (bi, g) = (task / h_kv, task % h_kv);
            for rep in 0..n_rep {
                for i in 0..t {
                    let at = ((bi * t + i) * h + g * n_rep + rep) * d;
                    out[at..at + d].copy_from_slice(&part[(rep * t + i) * d..(rep * t + i + 1) * d]);
                }
            }
        }
        Ok((CpuStorage::F32(out), q_l.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let all = q.apply_op3_no_bwd(k, v, &AttentionGrad { fwd: self, grad: &grad })?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let dq = all.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = all.narrow(0, nq, nk)?.reshape(k.shape())?;
        let dv = all.narrow(0, nq + nk, nk)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// (q, k, v) -> [dq; dk; dv] flattened, given d out.
struct AttentionGrad<'a> {
    fwd: &'a Attention,
    grad: &'a Tensor,
}

impl CustomOp3 for AttentionGrad<'_> {
    fn name(&self) -> &'static str {
        "attention-grad"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let fwd = self.fwd;
        let dims = Dims::new(q_l, k_l, fwd.inputs.rotary_dim)?;
        let (q, k, v) = (contiguous_f32(q, q_l)?, contiguous_f32(k, k_l)?, contiguous_f32(v, v_l)?);
        let (g_storage, g_layout) = self.grad.storage_and_layout();
        let candle_core::Storage::Cpu(g_storage) = &*g_storage else {
            candle_core::bail!("attention-grad: the gradient is not on the CPU")
        };
        let go = contiguous_f32(g_storage, g_layout)?;
        let Dims { b, t, h, h_kv, d, .. } = dims;
        let n_rep = h / h_kv;
        // One task per (row, kv head): dq of its query heads (n_rep, T, D),
        // then dk and dv of the head (T, D) each.
        let parts: Vec<Vec<f32>> = (0..b * h_kv)
            .into_par_iter()
            .map(|task| {
                with_avx2(
                    #[inline(always)]
                    || {
                        let (bi, g) = (task / h_kv, task % h_kv);
                        let kh = fwd.head(k, h_kv, dims, bi, g, true);
                        let k_t = transpose(&kh, t, d);
                        let v_t = transpose(&fwd.head(v, h_kv, dims, bi, g, false), t, d);
                        let mut part = vec![0f32; (n_rep + 2) * t * d];
                        let (dq_all, dkv) = part.split_at_mut(n_rep * t * d);
                        let (dk, dv) = dkv.split_at_mut(t * d);
                        let mut ds = vec![0f32; t * t];
                        for rep in 0..n_rep {
                            let hi = g * n_rep + rep;
                            let qh = fwd.head(q, h, dims, bi, hi, true);
                            let p = fwd.probs(&qh, &k_t, dims, bi);
                            let dout = fwd.head(go, h, dims, bi, hi, false);
                            // dV += P^T dO; dP = dO V^T; dS = P (dP - sum_j P dP).
                            for i in 0..t {
                                let doi = &dout[i * d..(i + 1) * d];
                                let (pi, dsi) = (&p[i * t..(i + 1) * t], &mut ds[i * t..(i + 1) * t]);
                                for (j, &pij) in pi.iter().enumerate() {
                                    axpy(&mut dv[j * d..(j + 1) * d], pij, doi);
                                }
                                row_times(dsi, doi, &v_t);
                                let row_dot: f32 = pi.iter().zip(dsi.iter()).map(|(p, dp)| p * dp).sum();
                                for (s, &pij) in dsi.iter_mut().zip(pi) {
                                    *s = pij * (*s - row_dot) * fwd.scale;
                                }
                            }
                            // dQ = dS K; dK += dS^T Q (both in rotated space).
                            let dq = &mut dq_all[rep * t * d..(rep + 1) * t * d];
                            for i in 0..t {
                                for j in 0..t {
                                    let s = ds[i * t + j];
                                    if s != 0.0 {
                                        axpy(&mut dq[i * d..(i + 1) * d], s, &kh[j * d..(j + 1) * d]);
                                        axpy(&mut dk[j * d..(j + 1) * d], s, &qh[i * d..(i + 1) * d]);
                                    }
                                }
                            }
                            for i in 0..t {
                                fwd.rotate(&mut dq[i * d..(i + 1) * d], dims, bi, i, true);
                            }
                        }
                        for j in 0..t {
                            fwd.rotate(&mut dk[j * d..(j + 1) * d], dims, bi, j, true);
                        }
                        part
                    },
                )
            })
            .collect();
        let (nq, nk) = (b * t * h * d, b * t * h_kv * d);
        let mut out = vec![0f32; nq + 2 * nk];
        let (dq_out, dkv_out) = out.split_at_mut(nq);
        let (dk_out, dv_out) = dkv_out.split_at_mut(nk);
        for (task, part) in parts.iter().enumerate() {
            let (bi, g) = (task / h_kv, task % h_kv);
            let (dq, dkv) = part.split_at(n_rep * t * d);
            let (dk, dv) = dkv.split_at(t * d);
            for i in 0..t {
                for rep in 0..n_rep {
                    let at = ((bi * t + i) * h + g * n_rep + rep) * d;
                    dq_out[at..at + d].copy_from_slice(&dq[(rep * t + i) * d..(rep * t + i + 1) * d]);
                }
                let at = ((bi * t + i) * h_kv + g) * d;
                dk_out[at..at + d].copy_from_slice(&dk[i * d..(i + 1) * d]);
                dv_out[at..at + d].copy_from_slice(&dv[i * d..(i + 1) * d]);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from(nq + 2 * nk)))
    }
}
