//! A dense layer with a LoRA adapter and a frozen base, as one op:
//! `h W^T + b + s (dropout(h) A^T) B^T` with `h = act(x)` or `x`. The
//! composition keeps, for each layer, the dropped-out input and its mask,
//! the base's output, the adapter's output and its scaled copy; this op
//! keeps `x` and a byte per element of mask, and its backward makes the
//! rest again (the adapter's products are only r wide).

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::contiguous_f32;
use super::elementwise;
use super::linear::{dense, matmul, out_shape, Operand};
use crate::model::ops::Activation;

/// A dropout mask: which elements are kept, and the factor they are
/// scaled by (1 / keep probability).
pub struct Mask {
    pub keep: Vec<bool>,
    pub scale: f32,
}

impl Mask {
    /// The mask as a tensor of factors (0 or `scale`).
    pub fn to_tensor(&self, like: &Tensor) -> Result<Tensor> {
        let factors: Vec<f32> = self.keep.iter().map(|&k| if k { self.scale } else { 0.0 }).collect();
        Tensor::from_vec(factors, like.shape(), like.device())?.to_dtype(like.dtype())
    }

    fn apply<'a>(&self, h: &'a [f32]) -> Cow<'a, [f32]> {
        Cow::Owned(h.iter().zip(&self.keep).map(|(&h, &k)| if k { h * self.scale } else { 0.0 }).collect())
    }
}

/// The frozen base and the adapter's settings of one layer.
pub struct LoraLayer<'a> {
    pub weight: &'a Tensor,
    pub bias: Option<&'a Tensor>,
    /// (r, in) and (out, r)
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub scale: f64,
}

/// Whether [`lora_linear`] runs: f32 on the CPU, with the base frozen.
pub fn lora_runs(x: &Tensor, layer: &LoraLayer) -> bool {
    let frozen = |t: &Tensor| super::fused(t) && !t.track_op();
    super::fused(x)
        && super::fused(layer.a)
        && super::fused(layer.b)
        && frozen(layer.weight)
        && layer.bias.is_none_or(frozen)
}

/// The layer's output for `x` (..., in), applying `act` first when given.
/// Only for inputs where [`lora_runs`].
pub fn lora_linear(x: &Tensor, act: Option<Activation>, layer: &LoraLayer, mask: Option<Mask>) -> Result<Tensor> {
    if mask.as_ref().is_some_and(|m| m.keep.len() != x.elem_count()) {
        candle_core::bail!("lora: a dropout mask of another size than the input {:?}", x.dims());
    }
    let op = LoraLinear(Arc::new(Frozen {
        weight: layer.weight.clone(),
        bias: layer.bias.map(|b| b.contiguous()).transpose()?,
        scale: layer.scale as f32,
        act,
        mask,
    }));
    x.contiguous()?.apply_op3(&layer.a.contiguous()?, &layer.b.contiguous()?, op)
}

/// What the op holds besides its inputs `x`, `A` and `B`.
struct Frozen {
    weight: Tensor,
    bias: Option<Tensor>,
    scale: f32,
    act: Option<Activation>,
    mask: Option<Mask>,
}

impl Frozen {
    fn activated<'a>(&self, x: &'a [f32]) -> Cow<'a, [f32]> {
        match self.act {
            Some(act) => Cow::Owned(elementwise::apply(act, x)),
            None => Cow::Borrowed(x),
        }
    }

    fn dropped<'a>(&self, h: &'a [f32]) -> Cow<'a, [f32]> {
        match &self.mask {
            Some(mask) => mask.apply(h),
            None => Cow::Borrowed(h),
        }
    }

    /// `s dropout(h) A^T` (m, r).
    fn down(&self, dropped: &[f32], (m, k, r): (usize, usize, usize), a: Operand) -> Vec<f32> {
        let mut down = Vec::with_capacity(m * r);
        matmul(&mut down, false, m, r, k, Operand::rows(dropped, k), a.transposed());
        down.iter_mut().for_each(|d| *d *= self.scale);
        down
    }
}

struct LoraLinear(Arc<Frozen>);

/// Rows, input, output widths and rank of `x` (..., in) against `A` (r, in), `B` (out, r).
fn sizes(x_l: &Layout, a_l: &Layout, b_l: &Layout) -> Result<(usize, usize, usize, usize)> {
    let (&k, lead) = x_l.dims().split_last().unwrap_or((&0, &[]));
    let (&[r, a_k], &[n, b_r]) = (a_l.dims(), b_l.dims()) else {
        candle_core::bail!("lora: adapter matrices {:?} and {:?} must be 2-d", a_l.dims(), b_l.dims())
    };
    if a_k != k || b_r != r {
        candle_core::bail!("lora: input {:?}, A {:?} and B {:?} do not fit", x_l.dims(), a_l.dims(), b_l.dims());
    }
    Ok((lead.iter().product(), k, n, r))
}

fn cpu(t: &Tensor) -> Result<(impl std::ops::Deref<Target = Storage> + '_, &Layout)> {
    let (storage, layout) = t.storage_and_layout();
    if !matches!(&*storage, Storage::Cpu(_)) {
        candle_core::bail!("lora: a frozen tensor is not on the CPU");
    }
    Ok((storage, layout))
}

fn cpu_storage(storage: &Storage) -> &CpuStorage {
    match storage {
        Storage::Cpu(s) => s,
        _ => unreachable!("checked by `cpu`"),
    }
}

impl CustomOp3 for LoraLinear {
    fn name(&self) -> &'static str {
        "lora-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        a: &CpuStorage,
        a_l: &Layout,
        b: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let f = &self.0;
        let (m, k, n, r) = sizes(x_l, a_l, b_l)?;
        let (w, w_l) = cpu(&f.weight)?;
        let bias = f.bias.as_ref().map(cpu).transpose()?;
        let bias = bias.as_ref().map(|(b, b_l)| contiguous_f32(cpu_storage(b), b_l)).transpose()?;
        let h = f.activated(contiguous_f32(x, x_l)?);
        let mut y = dense(&h, x_l, Operand::weight(cpu_storage(&w), w_l)?, w_l, bias)?;
        let down = f.down(&f.dropped(&h), (m, k, r), Operand::weight(a, a_l)?);
        matmul(&mut y, true, m, n, r, Operand::rows(&down, r), Operand::weight(b, b_l)?.transposed());
        Ok((CpuStorage::F32(y), out_shape(x_l, n)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (r, k) = a.dims2()?;
        let n = b.dim(0)?;
        let m = x.elem_count() / k.max(1);
        let grads = grad.contiguous()?.apply_op3_no_bwd(x, a, &LoraGrad { frozen: self.0.clone(), b: b.clone() })?;
        let dx = grads.narrow(0, 0, m * k)?.reshape(x.shape())?;
        let da = grads.narrow(0, m * k, r * k)?.reshape((r, k))?;
        let db = grads.narrow(0, m * k + r * k, n * r)?.reshape((n, r))?;
        Ok((Some(dx), Some(da), Some(db)))
    }
}

/// (d y, x, A) -> [d x (m k); d A (r k); d B (n r)], flat.
struct LoraGrad {
    frozen: Arc<Frozen>,
    b: Tensor,
}

impl CustomOp3 for LoraGrad {
    fn name(&self) -> &'static str {
        "lora-linear-grad"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        g_l: &Layout,
        x: &CpuStorage,
        x_l: &Layout,
        a: &CpuStorage,
        a_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let f = &self.frozen;
        let (b_guard, b_l) = cpu(&self.b)?;
        let (m, k, n, r) = sizes(x_l, a_l, b_l)?;
        let (g, x) = (contiguous_f32(g, g_l)?, contiguous_f32(x, x_l)?);
        let (a, b) = (Operand::weight(a, a_l)?, Operand::weight(cpu_storage(&b_guard), b_l)?);
        let (w, w_l) = cpu(&f.weight)?;
        let w = Operand::weight(cpu_storage(&w), w_l)?;
        let h = f.activated(x);
        let dropped = f.dropped(&h);
        let down = f.down(&dropped, (m, k, r), a);
        // d down (m, r) = s g B
        let mut d_down = Vec::with_capacity(m * r);
        matmul(&mut d_down, false, m, r, n, Operand::rows(g, n), b);
        d_down.iter_mut().for_each(|d| *d *= f.scale);

        let mut out = Vec::with_capacity(m * k + r * k + n * r);
        // d h (m, k) = g W + mask * (d down A)
        matmul(&mut out, false, m, k, n, Operand::rows(g, n), w);
        match &f.mask {
            None => matmul(&mut out, true, m, k, r, Operand::rows(&d_down, r), a),
            Some(mask) => {
                let mut through = Vec::with_capacity(m * k);
                matmul(&mut through, false, m, k, r, Operand::rows(&d_down, r), a);
                for ((o, t), keep) in out.iter_mut().zip(through).zip(&mask.keep) {
                    if *keep {
                        *o += t * mask.scale;
                    }
                }
            }
        }
        if let Some(act) = f.act {
            let dx = elementwise::apply_grad(act, x, &out);
            out.copy_from_slice(&dx);
        }
        // d A (r, k) = d down^T dropout(h); d B (n, r) = g^T (s dropout(h) A^T)
        matmul(&mut out, false, r, k, m, Operand { data: &d_down, row: 1, col: r }, Operand::rows(&dropped, k));
        matmul(&mut out, false, n, r, m, Operand { data: g, row: 1, col: n }, Operand::rows(&down, r));
        let len = out.len();
        Ok((CpuStorage::F32(out), Shape::from(len)))
    }
}
