//! A fused attention kernel for one decoding step on the CPU: every query
//! row attends over its cache slice directly, with no copies of the cache,
//! no repeated key/value heads and no per-head matmul dispatch. Sampling
//! only: it has no backward (candle reports an error if one is asked for),
//! and the training path never calls it.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::math::{axpy, dot, exp, max, with_avx2};

struct DecodeAttention {
    scale: f32,
    /// (B, S) 1 for real cache slots, 0 for padding.
    key_mask: Vec<f32>,
}

/// q: (B, H, 1, D); k, v: (B, Hkv, S, D) views of the cache with any
/// strides; `key_mask`: (B, S) on the host. Returns (B, H, 1, D).
pub fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, key_mask: Vec<f32>, scale: f64) -> Result<Tensor> {
    q.contiguous()?.apply_op3_no_bwd(k, v, &DecodeAttention { scale: scale as f32, key_mask })
}

impl CustomOp3 for DecodeAttention {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        q_s: &CpuStorage,
        q_l: &Layout,
        k_s: &CpuStorage,
        k_l: &Layout,
        v_s: &CpuStorage,
        v_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (q, k, v) = (q_s.as_slice::<f32>()?, k_s.as_slice::<f32>()?, v_s.as_slice::<f32>()?);
        let [b, h, t, d] = q_l.dims() else { candle_core::bail!("decode-attention: q must be 4-d") };
        let (b, h, d) = (*b, *h, *d);
        if *t != 1 {
            candle_core::bail!("decode-attention: one query per row, got {t}");
        }
        let [_, h_kv, s, _] = k_l.dims() else { candle_core::bail!("decode-attention: k must be 4-d") };
        let (h_kv, s) = (*h_kv, *s);
        if self.key_mask.len() != b * s {
            candle_core::bail!("decode-attention: key mask has {} entries, expected {}", self.key_mask.len(), b * s);
        }
        let q = &q[q_l.start_offset()..];
        let (ks, vs) = (k_l.stride(), v_l.stride());
        let (k, v) = (&k[k_l.start_offset()..], &v[v_l.start_offset()..]);
        if ks[3] != 1 || vs[3] != 1 {
            candle_core::bail!("decode-attention: the cache's head dimension must be contiguous");
        }
        let n_rep = h / h_kv;
        let mut out = vec![0f32; b * h * d];
        out.par_chunks_mut(d).enumerate().for_each_init(
            || vec![0f32; s],
            |scores, (row, out)| {
                let (bi, hi) = (row / h, row % h);
                let kvh = hi / n_rep;
                let head = Head {
                    q: &q[row * d..(row + 1) * d],
                    k: &k[bi * ks[0] + kvh * ks[1]..],
                    k_stride: ks[2],
                    v: &v[bi * vs[0] + kvh * vs[1]..],
                    v_stride: vs[2],
                    mask: &self.key_mask[bi * s..(bi + 1) * s],
                };
                // A head size known at compile time lets the loops over it unroll.
                with_avx2(
                    #[inline(always)]
                    || match d {
                        32 => head.attend(32, self.scale, scores, out),
                        64 => head.attend(64, self.scale, scores, out),
                        128 => head.attend(128, self.scale, scores, out),
                        _ => head.attend(d, self.scale, scores, out),
                    },
                )
            },
        );
        Ok((CpuStorage::F32(out), Shape::from((b, h, 1, d))))
    }
}

/// One query head and the cache slice it reads: key j at `k[j * k_stride..]`.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    k_stride: usize,
    v: &'a [f32],
    v_stride: usize,
    mask: &'a [f32],
}

impl Head<'_> {
    /// Writes softmax(q K^T * scale) V into `out` (d,), over the keys the
    /// mask keeps; `scores` is scratch with one slot per key.
    #[inline(always)]
    fn attend(&self, d: usize, scale: f32, scores: &mut [f32], out: &mut [f32]) {
        for (j, score) in scores.iter_mut().enumerate() {
            *score = if self.mask[j] == 0.0 {
                f32::NEG_INFINITY
            } else {
                dot(self.q, &self.k[j * self.k_stride..j * self.k_stride + d]) * scale
            };
        }
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
        for (j, &p) in scores.iter().enumerate() {
            if p != 0.0 {
                axpy(out, p * inv_total, &self.v[j * self.v_stride..j * self.v_stride + d]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops;
    use candle_core::Device;

    #[test]
    fn matches_the_composed_attention_on_strided_caches_with_gqa() {
        let dev = Device::Cpu;
        let (b, h, h_kv, s, cap, d) = (2, 4, 2, 5, 8, 3);
        let q = Tensor::randn(0f32, 1.0, (b, h, 1, d), &dev).unwrap();
        // Caches with spare capacity, read through narrow views.
        let k_buf = Tensor::randn(0f32, 1.0, (b, h_kv, cap, d), &dev).unwrap();
        let v_buf = Tensor::randn(0f32, 1.0, (b, h_kv, cap, d), &dev).unwrap();
        let (k, v) = (k_buf.narrow(2, 0, s).unwrap(), v_buf.narrow(2, 0, s).unwrap());
        let mask = vec![0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0];
        let got = decode_attention(&q, &k, &v, mask.clone(), 0.5).unwrap();

        let bias = Tensor::from_vec(
            mask.iter().map(|&m| if m > 0.0 { 0.0 } else { -1e30 }).collect::<Vec<f32>>(),
            (b, 1, 1, s),
            &dev,
        )
        .unwrap();
        let k_rep = ops::repeat_kv(&k.contiguous().unwrap(), h / h_kv).unwrap();
        let v_rep = ops::repeat_kv(&v.contiguous().unwrap(), h / h_kv).unwrap();
        let want = ops::attention(&q, &k_rep, &v_rep, &bias, 0.5).unwrap();
        let diff =
            (got - want).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
    }
}
