//! Tensor math shared by the architectures, written as compositions of candle
//! ops that all have a backward pass.
//!
//! candle's fused softmax, RMS and layer norms, rotary and scaled-dot-product
//! kernels have no backward and would silently cut the gradient, so the
//! training path never calls them; everything here differentiates.

use candle_core::{DType, Result, Tensor, D};

/// `x @ w^T + b` for `x` of shape (..., in) and a PyTorch-layout weight (out, in).
pub fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    // cuBLAS reads rows of a strided view (a gathered position) only when
    // they are packed; the CPU's gemm takes any strides.
    let x = if x.device().is_cpu() { x.clone() } else { x.contiguous()? };
    let y = match x.dims() {
        // (B, T, in) -> (B*T, in) so one matmul covers the batch.
        [b, t, _] => {
            let (b, t) = (*b, *t);
            x.reshape((b * t, ()))?.matmul(&weight.t()?)?.reshape((b, t, ()))?
        }
        _ => x.broadcast_matmul(&weight.t()?)?,
    };
    match bias {
        Some(bias) => y.broadcast_add(bias),
        None => Ok(y),
    }
}

/// `x` in f32 if it is a half-precision type: norms' statistics need it.
fn widened(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// LayerNorm over the last dimension: `(x - mean) / sqrt(var + eps) * w + b`,
/// computed in f32 (at least) whatever the input's dtype.
pub fn layernorm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let wide = widened(x)?;
    let centered = wide.broadcast_sub(&wide.mean_keepdim(D::Minus1)?)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    let (weight, bias) = (weight.to_dtype(wide.dtype())?, bias.to_dtype(wide.dtype())?);
    normed.broadcast_mul(&weight)?.broadcast_add(&bias)?.to_dtype(x.dtype())
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * w` (Llama,
/// Qwen), normalised in f32 (at least) and scaled in the input's dtype as
/// transformers does.
pub fn rmsnorm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let wide = widened(x)?;
    let ms = wide.sqr()?.mean_keepdim(D::Minus1)?;
    wide.broadcast_div(&(ms + eps)?.sqrt()?)?.to_dtype(x.dtype())?.broadcast_mul(weight)
}

/// Softmax over the last dimension. The max is subtracted for stability and
/// detached: softmax is shift-invariant, so the gradient is unchanged.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Log-softmax over the last dimension: `x - logsumexp(x)`.
pub fn log_softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)
}

/// The activation functions named by `hidden_act` / `activation_function`
/// (the CUDA kernels number them in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// Exact GELU with erf (`gelu`).
    Gelu,
    /// GELU's tanh approximation (`gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`).
    GeluTanh,
    /// `x * sigmoid(x)` (`silu`, `swish`).
    Silu,
    Relu,
}

impl Activation {
    pub fn from_hf(name: &str) -> Option<Self> {
        match name {
            "gelu" => Some(Self::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Some(Self::GeluTanh),
            "silu" | "swish" => Some(Self::Silu),
            "relu" => Some(Self::Relu),
            _ => None,
        }
    }

    pub const SUPPORTED: &'static str = "gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, silu, swish, relu";

    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Gelu => x.gelu_erf(),
            Self::GeluTanh => x.gelu(),
            Self::Silu => x.silu(),
            Self::Relu => x.relu(),
        }
    }
}

/// Rotates the first `cos.dim(-1)` features of each head by the position
/// angles (the "rotate half" layout of GPT-NeoX and Llama); the rest pass
/// through, which is partial rotary (`rotary_pct` < 1).
///
/// x: (B, H, T, D); cos, sin: (B, 1, T, R) with R <= D, R even.
pub fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (&cos.to_dtype(x.dtype())?, &sin.to_dtype(x.dtype())?);
    let head_dim = x.dim(D::Minus1)?;
    let rot = cos.dim(D::Minus1)?;
    let x_rot = x.narrow(D::Minus1, 0, rot)?;
    let half = rot / 2;
    let x1 = x_rot.narrow(D::Minus1, 0, half)?;
    let x2 = x_rot.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    let out = (x_rot.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?;
    if rot == head_dim {
        Ok(out)
    } else {
        let pass = x.narrow(D::Minus1, rot, head_dim - rot)?;
        Tensor::cat(&[&out, &pass], D::Minus1)
    }
}

/// Repeats each key/value head `n_rep` times for grouped-query attention.
/// (B, Hkv, S, D) -> (B, Hkv * n_rep, S, D)
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, h_kv, s, d) = x.dims4()?;
    x.unsqueeze(2)?.broadcast_as((b, h_kv, n_rep, s, d))?.reshape((b, h_kv * n_rep, s, d))
}

/// Scaled dot-product attention with an additive bias.
/// q: (B, H, T, D); k, v: (B, H, S, D); bias: (B, 1, T, S), 0 where allowed
/// and a large negative number elsewhere. Returns (B, H, T, D).
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor, bias: &Tensor, scale: f64) -> Result<Tensor> {
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let scores = scores.to_dtype(DType::F32)?.broadcast_add(bias)?;
    let probs = softmax_last(&scores)?.to_dtype(v.dtype())?;
    probs.matmul(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn t(v: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(v, shape, &Device::Cpu).unwrap()
    }

    fn close(a: &Tensor, b: &[f32]) {
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn softmax_and_log_softmax_match_definitions() {
        let x = t(&[1.0, 2.0, 3.0, 0.0, 0.0, 0.0], &[2, 3]);
        let e: Vec<f32> = [1.0f32, 2.0, 3.0].iter().map(|v| v.exp()).collect();
        let s: f32 = e.iter().sum();
        close(&softmax_last(&x).unwrap(), &[e[0] / s, e[1] / s, e[2] / s, 1. / 3., 1. / 3., 1. / 3.]);
        let l = (1.0f32 / 3.0).ln();
        close(&log_softmax_last(&x).unwrap(), &[(e[0] / s).ln(), (e[1] / s).ln(), (e[2] / s).ln(), l, l, l]);
    }

    #[test]
    fn norms_match_definitions() {
        let x = t(&[1.0, 2.0, 3.0, 4.0], &[1, 4]);
        let w = t(&[1.0, 1.0, 2.0, 2.0], &[4]);
        let b = t(&[0.0, 1.0, 0.0, 1.0], &[4]);
        // mean 2.5, var 1.25
        let sd = (1.25f32 + 1e-5).sqrt();
        close(
            &layernorm(&x, &w, &b, 1e-5).unwrap(),
            &[-1.5 / sd, -0.5 / sd + 1.0, 2.0 * 0.5 / sd, 2.0 * 1.5 / sd + 1.0],
        );
        let rms = (7.5f32 + 1e-6).sqrt();
        close(&rmsnorm(&x, &w, 1e-6).unwrap(), &[1.0 / rms, 2.0 / rms, 6.0 / rms, 8.0 / rms]);
    }

    #[test]
    fn rotary_rotates_pairs_and_passes_the_rest() {
        // One head, one position, D = 6, R = 4: pairs (0,2) and (1,3) rotate, 4..6 pass.
        let x = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[1, 1, 1, 6]);
        let (a, b) = (0.3f32, 0.7f32);
        let cos = t(&[a.cos(), b.cos(), a.cos(), b.cos()], &[1, 1, 1, 4]);
        let sin = t(&[a.sin(), b.sin(), a.sin(), b.sin()], &[1, 1, 1, 4]);
        let y = apply_rotary(&x, &cos, &sin).unwrap();
        close(
            &y,
            &[
                1.0 * a.cos() - 3.0 * a.sin(),
                2.0 * b.cos() - 4.0 * b.sin(),
                3.0 * a.cos() + 1.0 * a.sin(),
                4.0 * b.cos() + 2.0 * b.sin(),
                5.0,
                6.0,
            ],
        );
    }

    /// Central finite differences of `f` summed, in f64, against autograd.
    fn check_grad(f: impl Fn(&Tensor) -> Result<Tensor>, x0: &[f64], shape: &[usize]) {
        let var = Var::from_slice(x0, shape, &Device::Cpu).unwrap();
        let grads = f(var.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let g = grads.get(&var).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let h = 1e-6;
        for i in 0..x0.len() {
            let eval = |delta: f64| {
                let mut x = x0.to_vec();
                x[i] += delta;
                let x = Tensor::from_slice(&x, shape, &Device::Cpu).unwrap();
                f(&x).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
            };
            let fd = (eval(h) - eval(-h)) / (2.0 * h);
            assert!((fd - g[i]).abs() < 1e-6 * (1.0 + fd.abs()), "d/dx[{i}]: fd {fd} vs autograd {}", g[i]);
        }
    }

    #[test]
    fn compositions_have_exact_gradients() {
        let x: Vec<f64> = (0..12).map(|i| ((i * 7 % 5) as f64 - 2.0) * 0.37 + 0.1).collect();
        let dev = Device::Cpu;
        let w = Tensor::from_slice(&[0.5f64, -1.0, 2.0, 1.5], 4, &dev).unwrap();
        let b = Tensor::from_slice(&[0.1f64, 0.2, -0.3, 0.0], 4, &dev).unwrap();
        // Weight the outputs so the summed loss is not trivially constant.
        let mix = Tensor::from_slice(&(0..12).map(|i| i as f64 - 3.0).collect::<Vec<_>>(), (3, 4), &dev).unwrap();
        check_grad(|x| softmax_last(x)?.mul(&mix), &x, &[3, 4]);
        check_grad(|x| log_softmax_last(x)?.mul(&mix), &x, &[3, 4]);
        check_grad(|x| layernorm(x, &w, &b, 1e-5)?.mul(&mix), &x, &[3, 4]);
        check_grad(|x| rmsnorm(x, &w, 1e-6)?.mul(&mix), &x, &[3, 4]);
        for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu] {
            check_grad(|x| act.apply(x)?.mul(&mix), &x, &[3, 4]);
        }
    }
}
