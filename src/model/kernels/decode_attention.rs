//! A fused attention kernel for one decoding step on the CPU: every query
//! row attends over its cache slice directly, with no copies of the cache,
//! no repeated key/value heads and no per-head matmul dispatch. Sampling
//! only: it has no backward (candle reports an error if one is asked for),
//! and the training path never calls it.

use candle_core::{Layout, Result, Storage, Tensor};
use rayon::prelude::*;

use super::math::{axpy, dot, exp, max, with_avx2};
use crate::model::cache::LayerKv;

/// q: (B, H, 1, D); `kv`: the layer's cache, read in place whatever its
/// strides; `key_mask`: (B, S) over all its slots, shared ones first.
/// Returns (B, H, 1, D).
pub fn decode_attention(q: &Tensor, kv: &LayerKv, key_mask: &[f32], scale: f64) -> Result<Tensor> {
    let q = q.contiguous()?;
    let [b, h, t, d] = *q.dims() else { candle_core::bail!("decode-attention: q must be 4-d") };
    if t != 1 {
        candle_core::bail!("decode-attention: one query per row, got {t}");
    }
    let (q_guard, q_layout) = q.storage_and_layout();
    let (k_guard, k_layout) = kv.keys.storage_and_layout();
    let (v_guard, v_layout) = kv.values.storage_and_layout();
    let own = Part::new((&k_guard, k_layout), (&v_guard, v_layout))?;
    let shared_guards = kv.shared.as_ref().map(|s| (s.keys.storage_and_layout(), s.values.storage_and_layout()));
    let shared = match &shared_guards {
        Some(((kg, kl), (vg, vl))) => Some(Part::new((kg, kl), (vg, vl))?),
        None => None,
    };
    let shared_rows = kv.shared.as_ref().map_or(&[][..], |s| s.rows);
    let s = shared.as_ref().map_or(0, |p| p.len) + own.len;
    if key_mask.len() != b * s {
        candle_core::bail!("decode-attention: key mask has {} entries, expected {}", key_mask.len(), b * s);
    }
    let q = host(&q_guard, q_layout)?;
    let n_rep = h / own.heads;
    let scale = scale as f32;
    let mut out = vec![0f32; b * h * d];
    out.par_chunks_mut(d).enumerate().for_each_init(
        || vec![0f32; s],
        |scores, (row, out)| {
            let (bi, kv_head) = (row / h, row % h / n_rep);
            let front = match &shared {
                Some(part) => part.segment(shared_rows[bi] as usize, kv_head),
                None => Segment::EMPTY,
            };
            let head = Head {
                q: &q[row * d..(row + 1) * d],
                segments: [front, own.segment(bi, kv_head)],
                mask: &key_mask[bi * s..(bi + 1) * s],
            };
            // A head size known at compile time lets the loops over it unroll.
            with_avx2(
                #[inline(always)]
                || match d {
                    32 => head.attend(32, scale, scores, out),
                    64 => head.attend(64, scale, scores, out),
                    128 => head.attend(128, scale, scores, out),
                    _ => head.attend(d, scale, scores, out),
                },
            )
        },
    );
    Tensor::from_vec(out, (b, h, 1, d), kv.keys.device())
}

/// The f32 elements of a CPU tensor from its first one on.
fn host<'a>(storage: &'a Storage, layout: &Layout) -> Result<&'a [f32]> {
    match storage {
        Storage::Cpu(cpu) => Ok(&cpu.as_slice::<f32>()?[layout.start_offset()..]),
        _ => candle_core::bail!("decode-attention runs on the CPU"),
    }
}

/// Keys and values (rows, Hkv, len, D) of one part of the cache.
struct Part<'a> {
    k: &'a [f32],
    v: &'a [f32],
    k_strides: [usize; 3],
    v_strides: [usize; 3],
    heads: usize,
    len: usize,
}

impl<'a> Part<'a> {
    fn new(k: (&'a Storage, &Layout), v: (&'a Storage, &Layout)) -> Result<Self> {
        let [_, heads, len, _] = *k.1.dims() else { candle_core::bail!("decode-attention: keys must be 4-d") };
        let (ks, vs) = (k.1.stride(), v.1.stride());
        if ks[3] != 1 || vs[3] != 1 {
            candle_core::bail!("decode-attention: the cache's head dimension must be contiguous");
        }
        Ok(Self {
            k: host(k.0, k.1)?,
            v: host(v.0, v.1)?,
            k_strides: [ks[0], ks[1], ks[2]],
            v_strides: [vs[0], vs[1], vs[2]],
            heads,
            len,
        })
    }

    fn segment(&self, row: usize, head: usize) -> Segment<'a> {
        let (ks, vs) = (self.k_strides, self.v_strides);
        Segment {
            k: &self.k[row * ks[0] + head * ks[1]..],
            k_stride: ks[2],
            v: &self.v[row * vs[0] + head * vs[1]..],
            v_stride: vs[2],
            len: self.len,
        }
    }
}

/// One head's keys in a part of the cache: key j at `k[j * k_stride..]`.
struct Segment<'a> {
    k: &'a [f32],
    k_stride: usize,
    v: &'a [f32],
    v_stride: usize,
    len: usize,
}

impl Segment<'_> {
    const EMPTY: Self = Segment { k: &[], k_stride: 0, v: &[], v_stride: 0, len: 0 };
}

/// One query head and the cache it reads: its shared slots, then its own.
struct Head<'a> {
    q: &'a [f32],
    segments: [Segment<'a>; 2],
    mask: &'a [f32],
}

impl Head<'_> {
    /// Writes softmax(q K^T * scale) V into `out` (d,), over the keys the
    /// mask keeps; `scores` is scratch with one slot per key.
    #[inline(always)]
    fn attend(&self, d: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) {
        let mut j = 0;
        for seg in &self.segments {
            for i in 0..seg.len {
                scores[j] = if self.mask[j] == 0.0 {
                    f32::NEG_INFINITY
                } else {
                    dot(self.q, &seg.k[i * seg.k_stride..i * seg.k_stride + d]) * scale
                };
                j += 1;
            }
        }
        let scores = &mut scores[..j];
        let top = max(scores);
        if top == f32::NEG_INFINITY {
            return; // no real key (cannot happen for a real token): output 0
        }
        // exp(-inf) = 0 for masked keys. Eight partial sums, so the loop vectorises.
        let mut totals = [0f32; 8];
        for block in scores.chunks_mut(8) {
            for (score, total) in block.iter_mut().zip(&mut totals) {
                *score = exp(*score - top);
                *total += *score;
            }
        }
        let inv_total = 1.0 / totals.iter().sum::<f32>();
        let out = &mut out[..d];
        let mut weights = scores.iter();
        for seg in &self.segments {
            for (i, &p) in (0..seg.len).zip(&mut weights) {
                if p != 0.0 {
                    axpy(out, p * inv_total, &seg.v[i * seg.v_stride..i * seg.v_stride + d]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cache::SharedKv;
    use crate::model::ops;
    use candle_core::Device;

    /// The composed attention over every slot of `kv`.
    fn composed(q: &Tensor, kv: &LayerKv, mask: &[f32], scale: f64) -> Tensor {
        let (k, v) = kv.whole().unwrap();
        let (b, h, s) = (q.dim(0).unwrap(), q.dim(1).unwrap(), k.dim(2).unwrap());
        let bias: Vec<f32> = mask.iter().map(|&m| if m > 0.0 { 0.0 } else { -1e30 }).collect();
        let bias = Tensor::from_vec(bias, (b, 1, 1, s), q.device()).unwrap();
        let n_rep = h / k.dim(1).unwrap();
        let k = ops::repeat_kv(&k.contiguous().unwrap(), n_rep).unwrap();
        let v = ops::repeat_kv(&v.contiguous().unwrap(), n_rep).unwrap();
        ops::attention(q, &k, &v, &bias, scale).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn matches_the_composed_attention_on_strided_caches_with_gqa() {
        let dev = Device::Cpu;
        let (b, h, h_kv, s, cap, d) = (2, 4, 2, 5, 8, 3);
        let q = Tensor::randn(0f32, 1.0, (b, h, 1, d), &dev).unwrap();
        // Caches with spare capacity, read through narrow views.
        let k_buf = Tensor::randn(0f32, 1.0, (b, h_kv, cap, d), &dev).unwrap();
        let v_buf = Tensor::randn(0f32, 1.0, (b, h_kv, cap, d), &dev).unwrap();
        let (keys, values) = (k_buf.narrow(2, 0, s).unwrap(), v_buf.narrow(2, 0, s).unwrap());
        let kv = LayerKv { keys, values, shared: None };
        let mask = vec![0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0];
        let got = decode_attention(&q, &kv, &mask, 0.5).unwrap();
        let diff = max_diff(&got, &composed(&q, &kv, &mask, 0.5));
        assert!(diff < 1e-5, "{diff}");
    }

    #[test]
    fn rows_read_their_shared_slots_then_their_own() {
        let dev = Device::Cpu;
        let (b, h, h_kv, p, s_own, cap, d) = (3, 4, 2, 4, 2, 6, 32);
        let q = Tensor::randn(0f32, 1.0, (b, h, 1, d), &dev).unwrap();
        // Two shared rows, the first left-padded; rows 0 and 2 continue shared row 1.
        let shared_k = Tensor::randn(0f32, 1.0, (2, h_kv, p, d), &dev).unwrap();
        let shared_v = Tensor::randn(0f32, 1.0, (2, h_kv, p, d), &dev).unwrap();
        let rows = [1u32, 0, 1];
        let k_buf = Tensor::randn(0f32, 1.0, (b, h_kv, cap, d), &dev).unwrap();
        let v_buf = Tensor::randn(0f32, 1.0, (b, h_kv, cap, d), &dev).unwrap();
        let kv = LayerKv {
            keys: k_buf.narrow(2, 0, s_own).unwrap(),
            values: v_buf.narrow(2, 0, s_own).unwrap(),
            shared: Some(SharedKv { keys: &shared_k, values: &shared_v, rows: &rows }),
        };
        #[rustfmt::skip]
        let mask = vec![
            1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
            0.0, 1.0, 1.0, 1.0, 1.0, 1.0,
            1.0, 1.0, 1.0, 1.0, 1.0, 0.0,
        ];
        let got = decode_attention(&q, &kv, &mask, 0.3).unwrap();
        let diff = max_diff(&got, &composed(&q, &kv, &mask, 0.3));
        assert!(diff < 1e-5, "{diff}");
    }
}
