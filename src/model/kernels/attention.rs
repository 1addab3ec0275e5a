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
//! Each query visits only the keys its bias lets it see, as runs of
//! consecutive keys: half the keys under causality, and far fewer in rows
//! packed around a shared prompt. The backward pass recomputes the
//! probabilities instead of storing them, and un-rotates the query and key
//! gradients: rotate-half is orthogonal.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::contiguous_f32;
use super::math::{axpy, exp, with_avx2};
use super::rotary::RotaryTables;

/// Host copies of what every layer of one forward pass shares.
#[derive(Clone)]
pub struct AttentionInputs {
    /// (B, T, S) additive bias: 0 where a query may see a key.
    pub bias: Arc<Vec<f32>>,
    /// The keys each query sees, from the bias.
    visible: Arc<Visible>,
    pub rotary: RotaryTables,
}

impl AttentionInputs {
    /// From the (B, 1, T, S) bias and optional (B, 1, T, R) rotary tables.
    pub fn new(bias: &Tensor, rotary: Option<&(Tensor, Tensor)>) -> Result<Self> {
        let rotary = match rotary {
            Some((cos, sin)) => RotaryTables::new(cos, sin)?,
            None => RotaryTables::default(),
        };
        let s = bias.dims().last().copied().unwrap_or(0);
        let bias: Vec<f32> = bias.flatten_all()?.to_vec1()?;
        Ok(Self { visible: Arc::new(Visible::new(&bias, s)), bias: Arc::new(bias), rotary })
    }

    /// The runs of keys query `ti` of row `bi` sees, as [start, end) ranges.
    #[inline(always)]
    fn runs(&self, dims: Dims, bi: usize, ti: usize) -> &[(usize, usize)] {
        self.visible.runs(bi * dims.t + ti)
    }
}

/// Per query, the maximal runs of keys its bias does not mask.
struct Visible {
    /// Query q's runs are `runs[starts[q]..starts[q + 1]]`.
    starts: Vec<usize>,
    runs: Vec<(usize, usize)>,
}

impl Visible {
    /// From a bias of rows of `s` keys. A key is masked when its bias is
    /// below -1e29 (the mask's -1e30): its probability is exactly 0.
    fn new(bias: &[f32], s: usize) -> Self {
        let mut starts = vec![0];
        let mut runs = Vec::new();
        for row in bias.chunks(s.max(1)) {
            let mut j = 0;
            while j < row.len() {
                if row[j] < -1e29 {
                    j += 1;
                    continue;
                }
                let start = j;
                while j < row.len() && row[j] >= -1e29 {
                    j += 1;
                }
                runs.push((start, j));
            }
            starts.push(runs.len());
        }
        Self { starts, runs }
    }

    #[inline(always)]
    fn runs(&self, query: usize) -> &[(usize, usize)] {
        &self.runs[self.starts[query]..self.starts[query + 1]]
    }
}

/// q: (B, T, H, D); k, v: (B, T, Hkv, D) with H a multiple of Hkv. Returns
/// (B, T, H * D).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, inputs: &AttentionInputs, scale: f64) -> Result<Tensor> {
    let (b, t, h, d) = q.dims4()?;
    let h_kv = k.dim(2)?;
    let dims = Dims::new(b, t, h, h_kv, d, inputs.rotary.dim)?;
    let views = [View::heads(h, d), View::heads(h_kv, d), View::heads(h_kv, d)];
    let op = Attention { inputs: inputs.clone(), scale: scale as f32, dims, views };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)?.reshape((b, t, h * d))
}

/// Where q, k and v sit in a fused projection (B, T, W): head `h` of q is
/// at `q + h * head_stride` in each token's W features (likewise k, v).
#[derive(Debug, Clone, Copy)]
pub struct Packing {
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub head_stride: usize,
}

/// [`attention`] reading q, k and v straight from the fused projection
/// `qkv` (B, T, W) of `heads` heads of `head_dim` features: no split, no
/// copies, one gradient tensor.
pub fn attention_packed(
    qkv: &Tensor,
    packing: Packing,
    heads: usize,
    head_dim: usize,
    inputs: &AttentionInputs,
    scale: f64,
) -> Result<Tensor> {
    let (b, t, w) = qkv.dims3()?;
    let dims = Dims::new(b, t, heads, heads, head_dim, inputs.rotary.dim)?;
    let view = |offset| View { offset, token_stride: w, head_stride: packing.head_stride };
    let views = [view(packing.q), view(packing.k), view(packing.v)];
    let op = Attention { inputs: inputs.clone(), scale: scale as f32, dims, views };
    qkv.contiguous()?.apply_op1(Packed(op))?.reshape((b, t, heads * head_dim))
}

/// Sizes of one call.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    h: usize,
    h_kv: usize,
    d: usize,
}

impl Dims {
    fn new(b: usize, t: usize, h: usize, h_kv: usize, d: usize, r: usize) -> Result<Self> {
        if h_kv == 0 || !h.is_multiple_of(h_kv) || r > d || !r.is_multiple_of(2) {
            candle_core::bail!("attention: {h} query heads over {h_kv} key heads, rotary {r} of {d}");
        }
        Ok(Self { b, t, h, h_kv, d })
    }
}

/// Where one of q, k, v sits in its buffer: feature i of head `head` at
/// token (b, t) is at `offset + (b * T + t) * token_stride + head * head_stride + i`.
#[derive(Debug, Clone, Copy)]
struct View {
    offset: usize,
    token_stride: usize,
    head_stride: usize,
}

impl View {
    /// A contiguous (B, T, heads, D) tensor.
    fn heads(heads: usize, d: usize) -> Self {
        Self { offset: 0, token_stride: heads * d, head_stride: d }
    }

    fn at(&self, dims: Dims, bi: usize, ti: usize, head: usize) -> usize {
        self.offset + (bi * dims.t + ti) * self.token_stride + head * self.head_stride
    }
}

struct Attention {
    inputs: AttentionInputs,
    scale: f32,
    dims: Dims,
    /// Of q, k and v.
    views: [View; 3],
}

impl Attention {
    /// Rotates the first R features of `x` (D,) at row `bi`, position `ti`;
    /// `inverse` rotates back (the transpose, for gradients).
    #[inline(always)]
    fn rotate(&self, x: &mut [f32], bi: usize, ti: usize, inverse: bool) {
        self.inputs.rotary.rotate(x, bi * self.dims.t + ti, inverse);
    }

    /// The keys query `ti` of row `bi` sees.
    #[inline(always)]
    fn visible(&self, bi: usize, ti: usize) -> impl Iterator<Item = usize> + '_ {
        self.inputs.runs(self.dims, bi, ti).iter().flat_map(|&(a, z)| a..z)
    }

    /// The (T, D) rows of head `hi` of row `bi` read through `view`,
    /// rotated when asked.
    #[inline(always)]
    fn head(&self, x: &[f32], view: View, bi: usize, hi: usize, rotate: bool) -> Vec<f32> {
        let Dims { t, d, .. } = self.dims;
        let mut out = vec![0f32; t * d];
        for ti in 0..t {
            let at = view.at(self.dims, bi, ti, hi);
            let row = &mut out[ti * d..(ti + 1) * d];
            row.copy_from_slice(&x[at..at + d]);
            if rotate {
                self.rotate(row, bi, ti, false);
            }
        }
        out
    }

    /// Softmax probabilities (T, T) of rotated `q` (T, D) against the
    /// transposed rotated keys `k_t` (D, T); 0 outside the visible runs.
    #[inline(always)]
    fn probs(&self, q: &[f32], k_t: &[f32], bi: usize) -> Vec<f32> {
        let Dims { t, d, .. } = self.dims;
        let bias = &self.inputs.bias[bi * t * t..(bi + 1) * t * t];
        let mut p = vec![0f32; t * t];
        for i in 0..t {
            let runs = self.inputs.runs(self.dims, bi, i);
            let row = &mut p[i * t..(i + 1) * t];
            let mut max = f32::NEG_INFINITY;
            for &(a, z) in runs {
                row_times(&mut row[a..z], a, &q[i * d..(i + 1) * d], k_t);
                for (s, b) in row[a..z].iter_mut().zip(&bias[i * t + a..i * t + z]) {
                    *s = *s * self.scale + b;
                    max = max.max(*s);
                }
            }
            let mut total = 0f32;
            for &(a, z) in runs {
                for s in &mut row[a..z] {
                    *s = exp(*s - max);
                    total += *s;
                }
            }
            let inv = 1.0 / total;
            for &(a, z) in runs {
                row[a..z].iter_mut().for_each(|s| *s *= inv);
            }
        }
        p
    }

    /// The attention output (B, T, H, D), one task per (row, kv head).
    fn forward(&self, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let Dims { b, t, h, h_kv, d, .. } = self.dims;
        let [qv, kv, vv] = self.views;
        let n_rep = h / h_kv;
        // Each task: its query heads' outputs, (n_rep, T, D).
        let parts: Vec<Vec<f32>> = (0..b * h_kv)
            .into_par_iter()
            .map(|task| {
                with_avx2(
                    #[inline(always)]
                    || {
                        let (bi, g) = (task / h_kv, task % h_kv);
                        let k_t = transpose(&self.head(k, kv, bi, g, true), t, d);
                        let vh = self.head(v, vv, bi, g, false);
                        let mut out = vec![0f32; n_rep * t * d];
                        for rep in 0..n_rep {
                            let qh = self.head(q, qv, bi, g * n_rep + rep, true);
                            let p = self.probs(&qh, &k_t, bi);
                            for i in 0..t {
                                let o = &mut out[(rep * t + i) * d..(rep * t + i + 1) * d];
                                for j in self.visible(bi, i) {
                                    axpy(o, p[i * t + j], &vh[j * d..(j + 1) * d]);
                                }
                            }
                        }
                        out
                    },
                )
            })
            .collect();
        let out_view = View::heads(h, d);
        let mut out = vec![0f32; b * t * h * d];
        for (task, part) in parts.iter().enumerate() {
            let (bi, g) = (task / h_kv, task % h_kv);
            for rep in 0..n_rep {
                for i in 0..t {
                    let at = out_view.at(self.dims, bi, i, g * n_rep + rep);
                    out[at..at + d].copy_from_slice(&part[(rep * t + i) * d..(rep * t + i + 1) * d]);
                }
            }
        }
        out
    }

    /// Gradients of q, k and v given d out (B, T, H * D), written through
    /// `out_views` into a zeroed buffer of `len` elements.
    fn backward(&self, q: &[f32], k: &[f32], v: &[f32], go: &[f32], out_views: [View; 3], len: usize) -> Vec<f32> {
        let Dims { b, t, h, h_kv, d, .. } = self.dims;
        let [qv, kv, vv] = self.views;
        let go_view = View::heads(h, d);
        let n_rep = h / h_kv;
        // Each task: dq of its query heads (n_rep, T, D), then dk and dv (T, D).
        let parts: Vec<Vec<f32>> = (0..b * h_kv)
            .into_par_iter()
            .map(|task| {
                with_avx2(
                    #[inline(always)]
                    || {
                        let (bi, g) = (task / h_kv, task % h_kv);
                        let kh = self.head(k, kv, bi, g, true);
                        let k_t = transpose(&kh, t, d);
                        let v_t = transpose(&self.head(v, vv, bi, g, false), t, d);
                        let mut part = vec![0f32; (n_rep + 2) * t * d];
                        let (dq_all, dkv) = part.split_at_mut(n_rep * t * d);
                        let (dk, dv) = dkv.split_at_mut(t * d);
                        let mut ds = vec![0f32; t * t];
                        for rep in 0..n_rep {
                            let hi = g * n_rep + rep;
                            let qh = self.head(q, qv, bi, hi, true);
                            let p = self.probs(&qh, &k_t, bi);
                            let dout = self.head(go, go_view, bi, hi, false);
                            // dV += P^T dO; dP = dO V^T; dS = P (dP - sum_j P dP).
                            // ds is 0 outside the visible runs, which are the
                            // same for every head of the row.
                            for i in 0..t {
                                let doi = &dout[i * d..(i + 1) * d];
                                let (pi, dsi) = (&p[i * t..(i + 1) * t], &mut ds[i * t..(i + 1) * t]);
                                let runs = self.inputs.runs(self.dims, bi, i);
                                let mut row_dot = 0f32;
                                for &(a, z) in runs {
                                    for j in a..z {
                                        axpy(&mut dv[j * d..(j + 1) * d], pi[j], doi);
                                    }
                                    row_times(&mut dsi[a..z], a, doi, &v_t);
                                    row_dot += pi[a..z].iter().zip(&dsi[a..z]).map(|(p, dp)| p * dp).sum::<f32>();
                                }
                                for &(a, z) in runs {
                                    for (s, &pij) in dsi[a..z].iter_mut().zip(&pi[a..z]) {
                                        *s = pij * (*s - row_dot) * self.scale;
                                    }
                                }
                            }
                            // dQ = dS K; dK += dS^T Q (both in rotated space).
                            let dq = &mut dq_all[rep * t * d..(rep + 1) * t * d];
                            for i in 0..t {
                                for j in self.visible(bi, i) {
                                    let s = ds[i * t + j];
                                    axpy(&mut dq[i * d..(i + 1) * d], s, &kh[j * d..(j + 1) * d]);
                                    axpy(&mut dk[j * d..(j + 1) * d], s, &qh[i * d..(i + 1) * d]);
                                }
                            }
                            for i in 0..t {
                                self.rotate(&mut dq[i * d..(i + 1) * d], bi, i, true);
                            }
                        }
                        for j in 0..t {
                            self.rotate(&mut dk[j * d..(j + 1) * d], bi, j, true);
                        }
                        part
                    },
                )
            })
            .collect();
        let [dq_view, dk_view, dv_view] = out_views;
        let mut out = vec![0f32; len];
        for (task, part) in parts.iter().enumerate() {
            let (bi, g) = (task / h_kv, task % h_kv);
            let (dq, dkv) = part.split_at(n_rep * t * d);
            let (dk, dv) = dkv.split_at(t * d);
            for i in 0..t {
                for rep in 0..n_rep {
                    let at = dq_view.at(self.dims, bi, i, g * n_rep + rep);
                    out[at..at + d].copy_from_slice(&dq[(rep * t + i) * d..(rep * t + i + 1) * d]);
                }
                let at = dk_view.at(self.dims, bi, i, g);
                out[at..at + d].copy_from_slice(&dk[i * d..(i + 1) * d]);
                let at = dv_view.at(self.dims, bi, i, g);
                out[at..at + d].copy_from_slice(&dv[i * d..(i + 1) * d]);
            }
        }
        out
    }
}

/// `out = x M[:, from..from + out.len()]` for a row `x` (D,) and `m_t`
/// (D, T) row-major: multiply-adds along the row, which vectorise (a dot
/// product's reduction would not).
#[inline(always)]
fn row_times(out: &mut [f32], from: usize, x: &[f32], m_t: &[f32]) {
    let t = m_t.len() / x.len().max(1);
    out.fill(0.0);
    for (xd, m_row) in x.iter().zip(m_t.chunks_exact(t)) {
        axpy(out, *xd, &m_row[from..from + out.len()]);
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
        let (q, k, v) = (contiguous_f32(q, q_l)?, contiguous_f32(k, k_l)?, contiguous_f32(v, v_l)?);
        Ok((CpuStorage::F32(self.forward(q, k, v)), q_l.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let Dims { h, h_kv, d, .. } = self.dims;
        let views = [
            View::heads(h, d),
            View { offset: nq, ..View::heads(h_kv, d) },
            View { offset: nq + nk, ..View::heads(h_kv, d) },
        ];
        let grad = grad.contiguous()?;
        let all = q.apply_op3_no_bwd(k, v, &Grad { fwd: self, grad: &grad, views, len: nq + 2 * nk })?;
        let dq = all.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = all.narrow(0, nq, nk)?.reshape(k.shape())?;
        let dv = all.narrow(0, nq + nk, nk)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The fused-projection form: one input holding q, k and v.
struct Packed(Attention);

impl CustomOp1 for Packed {
    fn name(&self) -> &'static str {
        "attention-packed"
    }

    fn cpu_fwd(&self, qkv: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(qkv, l)?;
        let Dims { b, t, h, d, .. } = self.0.dims;
        Ok((CpuStorage::F32(self.0.forward(x, x, x)), Shape::from((b, t, h, d))))
    }

    fn bwd(&self, qkv: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let op = Grad { fwd: &self.0, grad: &grad, views: self.0.views, len: qkv.elem_count() };
        Ok(Some(qkv.apply_op1_no_bwd(&op)?.reshape(qkv.shape())?))
    }
}

/// The backward kernel: (q, k, v) or the packed projection -> their
/// gradients laid out by `views` in one buffer of `len` elements.
struct Grad<'a> {
    fwd: &'a Attention,
    grad: &'a Tensor,
    views: [View; 3],
    len: usize,
}

impl Grad<'_> {
    fn run(&self, q: &[f32], k: &[f32], v: &[f32]) -> Result<CpuStorage> {
        let (storage, layout) = self.grad.storage_and_layout();
        let candle_core::Storage::Cpu(storage) = &*storage else {
            candle_core::bail!("attention-grad: the gradient is not on the CPU")
        };
        let go = contiguous_f32(storage, layout)?;
        Ok(CpuStorage::F32(self.fwd.backward(q, k, v, go, self.views, self.len)))
    }
}

impl CustomOp3 for Grad<'_> {
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
        let (q, k, v) = (contiguous_f32(q, q_l)?, contiguous_f32(k, k_l)?, contiguous_f32(v, v_l)?);
        Ok((self.run(q, k, v)?, Shape::from(self.len)))
    }
}

impl CustomOp1 for Grad<'_> {
    fn name(&self) -> &'static str {
        "attention-packed-grad"
    }

    fn cpu_fwd(&self, qkv: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(qkv, l)?;
        Ok((self.run(x, x, x)?, Shape::from(self.len)))
    }
}
