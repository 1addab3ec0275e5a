//! A dense layer with a LoRA adapter and a frozen base, as one op:
//! `h W^T + b + s (dropout(h) A^T) B^T` with `h = act(x)` or `x`. The
//! composition keeps, for each layer, the dropped-out input and its mask,
//! the base's output, the adapter's output and its scaled copy; this op
//! keeps `x` and the mask's key, and its backward makes the rest again (the
//! adapter's products are only r wide). On the CPU in f32 through `gemm`; on
//! a GPU through cuBLAS, the mask drawn there by the same counter.

use std::borrow::Cow;
use std::sync::Arc;

use rayon::prelude::*;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::contiguous_f32;
use super::elementwise;
use super::linear::{dense, matmul, out_shape, weight_layout, Operand};
use super::remade::{on_remade_input, Remake};
use crate::model::ops::Activation;
use crate::rng::philox;

/// A dropout mask: element i is kept when the word Philox4x32-10 gives it
/// (counter (i / 4, 0, 0, 0) under `key`, word i % 4) falls below the keep
/// probability's share of 2^32, and scaled by 1 / keep probability. The CPU
/// and a GPU make the same mask from the key, element by element and in
/// any order, and a backward makes it again instead of keeping it.
#[derive(Debug, Clone, Copy)]
pub struct Mask {
    pub key: [u32; 2],
    /// Words below this are kept: round(keep probability x 2^32).
    pub threshold: u64,
    pub scale: f32,
}

impl Mask {
    /// The mask under `key` that drops elements with probability `p`.
    pub fn new(key: [u32; 2], p: f64) -> Self {
        let keep = 1.0 - p;
        Self { key, threshold: (keep * 4_294_967_296.0).round() as u64, scale: (1.0 / keep) as f32 }
    }

    /// Whether each of `len` elements is kept.
    pub fn kept(&self, len: usize) -> Vec<bool> {
        let mut kept = vec![false; len];
        kept.par_chunks_mut(1 << 14).enumerate().for_each(|(chunk, out)| {
            let first = chunk << 14;
            for (j, group) in out.chunks_mut(4).enumerate() {
                let block = ((first >> 2) + j) as u64;
                let words = philox([block as u32, (block >> 32) as u32, 0, 0], self.key);
                for (k, w) in group.iter_mut().zip(words) {
                    *k = (w as u64) < self.threshold;
                }
            }
        });
        kept
    }

    /// The mask as a tensor of factors (0 or `scale`) shaped like `like`.
    pub fn to_tensor(&self, like: &Tensor) -> Result<Tensor> {
        let factors: Vec<f32> =
            self.kept(like.elem_count()).into_iter().map(|k| if k { self.scale } else { 0.0 }).collect();
        Tensor::from_vec(factors, like.shape(), like.device())?.to_dtype(like.dtype())
    }

    fn apply<'a>(&self, h: &'a [f32]) -> Cow<'a, [f32]> {
        Cow::Owned(self.scaled(h, &self.kept(h.len())))
    }

    /// `h` with the elements `kept` says kept, scaled, and the others 0.
    fn scaled(&self, h: &[f32], kept: &[bool]) -> Vec<f32> {
        h.iter().zip(kept).map(|(&h, &k)| if k { h * self.scale } else { 0.0 }).collect()
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

/// Whether [`lora_linear`] runs: f32 on the CPU, or on a GPU, with the
/// base frozen.
pub fn lora_runs(x: &Tensor, layer: &LoraLayer) -> bool {
    let mut all = vec![x, layer.a, layer.b, layer.weight];
    all.extend(layer.bias);
    let device = all.iter().all(|t| super::fused(t)) || super::on_cuda(&all);
    device && !layer.weight.track_op() && layer.bias.is_none_or(|b| !b.track_op())
}

/// The layer's output for `x` (..., in), applying `act` first when given:
/// [`lora_linear`] where it runs, else candle's ops.
pub fn lora_forward(x: &Tensor, act: Option<Activation>, layer: &LoraLayer, mask: Option<Mask>) -> Result<Tensor> {
    if lora_runs(x, layer) {
        return lora_linear(x, act, layer, mask);
    }
    let h = match act {
        Some(act) => super::activation(x, act)?,
        None => x.clone(),
    };
    let dropped = match &mask {
        Some(mask) => (&h * mask.to_tensor(&h)?)?,
        None => h.clone(),
    };
    let delta = (super::linear(&super::linear(&dropped, layer.a, None)?, layer.b, None)? * layer.scale)?;
    super::linear(&h, layer.weight, layer.bias)? + delta
}

/// The layer's output for `x` (..., in), applying `act` first when given.
/// Only for inputs where [`lora_runs`].
pub fn lora_linear(x: &Tensor, act: Option<Activation>, layer: &LoraLayer, mask: Option<Mask>) -> Result<Tensor> {
    let op = LoraLinear::new(layer, act, mask)?;
    x.contiguous()?.apply_op3(&layer.a.contiguous()?, &layer.b.contiguous()?, op)
}

/// [`lora_forward`] without an activation, where the training graph keeps
/// only the place of `x`, which the backward makes again with `remake`
/// (a gated MLP's product, from the gate and up projections that its own
/// op keeps): the same values and gradients. [`lora_forward`] where there
/// is no remake, `x` has no graph or the op does not run.
pub fn lora_forward_remade(
    x: &Tensor,
    layer: &LoraLayer,
    mask: Option<Mask>,
    remake: Option<Remake>,
) -> Result<Tensor> {
    match remake {
        Some(remake) if x.track_op() && lora_runs(x, layer) => {
            let op = LoraLinear::new(layer, None, mask)?;
            on_remade_input(|| LoraLinear(op.0.clone()), [x, &layer.a.contiguous()?, &layer.b.contiguous()?], remake)
        }
        _ => lora_forward(x, None, layer, mask),
    }
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

    /// d x, d A and d B by candle's products (on a GPU, cuBLAS's), with
    /// `act(x)` and its dropped-out copy made again:
    /// d down = s g B; d h = g W + dropout(d down A); d A = d down^T dropout(h);
    /// d B = g^T (s dropout(h) A^T).
    fn grads_by_products(&self, x: &Tensor, a: &Tensor, b: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (a, b) = (a.detach(), b.detach());
        let (k, n) = (a.dim(1)?, b.dim(0)?);
        let m = x.elem_count() / k.max(1);
        let x_rows = x.detach().reshape((m, k))?;
        let g = grad.contiguous()?.reshape((m, n))?;
        let h = match self.act {
            Some(act) => elementwise::without_graph(&x_rows, act)?,
            None => x_rows.clone(),
        };
        let dropped = match &self.mask {
            Some(mask) => h.apply_op1_no_bwd(&Dropped(*mask))?,
            None => h,
        };
        let scale = self.scale as f64;
        let down = (dropped.matmul(&a.t()?)? * scale)?;
        let d_down = (g.matmul(&b)? * scale)?;
        let db = g.t()?.matmul(&down)?;
        let da = d_down.t()?.matmul(&dropped)?;
        drop(dropped);
        let through = d_down.matmul(&a)?;
        let through = match &self.mask {
            Some(mask) => through.apply_op1_no_bwd(&Dropped(*mask))?,
            None => through,
        };
        let dh = (g.matmul(&self.weight)? + through)?;
        let dx = match self.act {
            Some(act) => elementwise::grad_without_graph(&x_rows, &dh, act)?,
            None => dh,
        };
        Ok((dx.reshape(x.shape())?, da, db))
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

impl LoraLinear {
    fn new(layer: &LoraLayer, act: Option<Activation>, mask: Option<Mask>) -> Result<Self> {
        Ok(Self(Arc::new(Frozen {
            weight: weight_layout(layer.weight)?,
            bias: layer.bias.map(|b| b.contiguous()).transpose()?,
            scale: layer.scale as f32,
            act,
            mask,
        })))
    }
}

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

    fn bwd_reads_res(&self) -> bool {
        false
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

    /// The same products through cuBLAS; the activated and dropped-out
    /// inputs, the base's output and the adapter's live only in here.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        a: &candle_core::CudaStorage,
        a_l: &Layout,
        b: &candle_core::CudaStorage,
        b_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let f = &self.0;
        let (m, k, n, r) = sizes(x_l, a_l, b_l)?;
        let (x_rows, rows_of) =
            (Layout::contiguous_with_offset((m, k), x_l.start_offset()), Layout::contiguous((m, k)));
        let activated = f.act.map(|act| super::cuda::activation((x, &x_rows), None, act as i32)).transpose()?;
        let (h, h_l) = match &activated {
            Some(h) => (h, &rows_of),
            None => (x, &x_rows),
        };
        let (w, w_l) = f.weight.storage_and_layout();
        let Storage::Cuda(w) = &*w else { candle_core::bail!("lora: the frozen weight is not on the GPU") };
        let bias = f.bias.as_ref().map(Tensor::storage_and_layout);
        let bias = match &bias {
            Some((storage, layout)) => match &**storage {
                Storage::Cuda(b) => Some((b, *layout)),
                _ => candle_core::bail!("lora: the frozen bias is not on the GPU"),
            },
            None => None,
        };
        // In bf16 with the epilogues chosen, the base product adds the bias
        // and the adapter's product adds into the base's output.
        let epilogue = x.dtype() == candle_core::DType::BF16 && super::linear::dense_bias_epilogue()?;
        let out_l = Layout::contiguous((m, n));
        let mut y = super::linear::cuda_dense((h, h_l), None, (w, w_l), bias, (m, k, n), epilogue)?;
        let dropped = f.mask.as_ref().map(|mask| super::cuda::dropout((h, h_l), mask)).transpose()?;
        let (dropped, dropped_l) = match &dropped {
            Some(d) => (d, &rows_of),
            None => (h, h_l),
        };
        let down_l = Layout::contiguous((m, r));
        let down = super::linear::cuda_dense((dropped, dropped_l), None, (a, a_l), None, (m, k, r), false)?;
        if epilogue {
            super::cuda::add_product(
                &mut y,
                (&down, &down_l),
                (b, b_l),
                f.scale,
                (m, r, n),
                super::linear::gemm_choice()? == super::linear::Gemm::Tuned,
            )?;
            return Ok((y, out_shape(x_l, n)));
        }
        let down = down.affine(&down_l, f.scale as f64, 0.0)?;
        let delta = down.matmul(b, (1, m, n, r), &down_l, &b_l.transpose(0, 1)?)?;
        Ok((y.binary_impl::<candle_core::op::Add>(&delta, &out_l, &out_l)?, out_shape(x_l, n)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if x.device().is_cuda() {
            let (dx, da, db) = self.0.grads_by_products(x, a, b, grad)?;
            return Ok((Some(dx), Some(da), Some(db)));
        }
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

/// A dropout mask applied, recording no backward (a backward applies it
/// to the gradient itself).
struct Dropped(Mask);

impl candle_core::CustomOp1 for Dropped {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(self.0.apply(contiguous_f32(x, l)?).into_owned()), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, x: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::dropout((x, l), &self.0)?, l.shape().clone()))
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
        // The mask, drawn once for the input and for its gradient.
        let drawn = f.mask.map(|mask| (mask, mask.kept(m * k)));
        let dropped = match &drawn {
            Some((mask, kept)) => Cow::Owned(mask.scaled(&h, kept)),
            None => Cow::Borrowed(&*h),
        };
        let down = f.down(&dropped, (m, k, r), a);
        // d down (m, r) = s g B
        let mut d_down = Vec::with_capacity(m * r);
        matmul(&mut d_down, false, m, r, n, Operand::rows(g, n), b);
        d_down.iter_mut().for_each(|d| *d *= f.scale);

        let mut out = Vec::with_capacity(m * k + r * k + n * r);
        // d h (m, k) = g W + mask * (d down A)
        matmul(&mut out, false, m, k, n, Operand::rows(g, n), w);
        match &drawn {
            None => matmul(&mut out, true, m, k, r, Operand::rows(&d_down, r), a),
            Some((mask, kept)) => {
                let mut through = Vec::with_capacity(m * k);
                matmul(&mut through, false, m, k, r, Operand::rows(&d_down, r), a);
                for ((o, t), &keep) in out.iter_mut().zip(through).zip(kept) {
                    if keep {
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

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::*;

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        crate::rng::Rng::new(seed).normal_tensor(shape, 0.0, 1.0)
    }

    /// The backward a GPU runs (candle's products, the mask applied by
    /// `Dropped`) gives the CPU kernel's gradients.
    #[test]
    fn the_backward_by_products_gives_the_kernels_gradients() {
        let (w, bias) = (randn(&[24, 40], 1), randn(&[24], 2));
        let var = |shape: &[usize], seed| Var::from_tensor(&randn(shape, seed)).unwrap();
        let (x, a, b) = (var(&[2, 30, 40], 3), var(&[4, 40], 4), var(&[24, 4], 5));
        let grad = randn(&[2, 30, 24], 6);
        for act in [None, Some(Activation::Gelu)] {
            let frozen = Frozen {
                weight: w.clone(),
                bias: Some(bias.clone()),
                scale: 2.0,
                act,
                mask: Some(Mask::new([9, 1], 0.3)),
            };
            let layer = LoraLayer { weight: &w, bias: Some(&bias), a: a.as_tensor(), b: b.as_tensor(), scale: 2.0 };
            let y = lora_linear(x.as_tensor(), act, &layer, frozen.mask).unwrap();
            let grads = (y * &grad).unwrap().sum_all().unwrap().backward().unwrap();
            let (dx, da, db) = frozen.grads_by_products(x.as_tensor(), a.as_tensor(), b.as_tensor(), &grad).unwrap();
            for (name, got, var) in [("x", dx, &x), ("A", da, &a), ("B", db, &b)] {
                let want = grads.get(var).unwrap();
                let err = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(err <= 1e-5 * scale, "{act:?}: d {name} off by {err} of {scale}");
            }
        }
    }
}
