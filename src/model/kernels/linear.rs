//! A dense layer, `x @ w^T + b`, as one op over the `gemm` crate. candle's
//! composition (reshape, matmul of a transposed view, reshape, bias) zero
//! fills every matmul output before overwriting it, and its backward adds
//! each of those five nodes' gradients into a zeroed buffer on one thread
//! and writes the weight's gradient through a transposed, strided copy.
//! Here the bias is the matmul's starting value and the backward writes
//! d x, d w and d b straight in their own layouts.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

use super::remade::{on_remade_input, on_remade_inputs2, on_remade_inputs3, Remake};
use super::{contiguous_f32, elementwise, rows_per_task, BwdOut3};
use crate::model::ops::{self, Activation};

/// `x @ w^T (+ b)` for `x` (..., in), a PyTorch-layout `w` (out, in) and
/// `b` (out,). `w` may also be the transposed view of an (in, out) tensor,
/// which the product reads in place.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let epilogue = b.is_some() && cuda_linear_runs(x, w, b) && dense_bias_epilogue()?;
    linear_with(x, w, b, epilogue)
}

/// Picks how a dense layer with a bias adds it on a GPU: `epilogue` (the
/// default; in bf16, cuBLASLt's product adds it as it writes the output,
/// and a LoRA adapter's product adds its part into the base layer's output
/// the same way) or `pass` (cuBLAS's product, then one pass over its
/// output, and the adapter's part scaled and added by passes of their own;
/// f32 always takes this way), to compare the two.
pub const DENSE_BIAS_VAR: &str = "RLOO_DENSE_BIAS";

/// Whether the epilogue is chosen; an unknown choice is an error.
pub fn dense_bias_epilogue() -> Result<bool> {
    let chosen = crate::model::device::variant(DENSE_BIAS_VAR, &["epilogue", "pass"]);
    Ok(chosen.map_err(candle_core::Error::msg)? == "epilogue")
}

/// Picks how a GPU makes its bf16 products: `heuristic` (the default:
/// cuBLASLt's first pick, and cuBLAS's product for a layer without a
/// bias), `tuned` (a shape's first product of at most 1,024 rows, a
/// decoding step's, also times cuBLASLt's other candidates and keeps the
/// fastest whose output has the default's bits; see `kernels/cuda/gemm.rs`)
/// or `rows` (a product of few rows whose tiles would not fill the GPU, a
/// decoding step's, by the kernel of `kernels/cuda/rows_gemm.cuh`, split
/// along k: other bits than cuBLAS's, the same run to run).
pub const GEMM_VAR: &str = "RLOO_GEMM";

/// The choices of [`GEMM_VAR`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub enum Gemm {
    Heuristic,
    Tuned,
    Rows,
}

/// The chosen way of making products; an unknown choice is an error.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn gemm_choice() -> Result<Gemm> {
    let chosen = crate::model::device::variant(GEMM_VAR, &["heuristic", "tuned", "rows"]);
    Ok(match chosen.map_err(candle_core::Error::msg)? {
        "tuned" => Gemm::Tuned,
        "rows" => Gemm::Rows,
        _ => Gemm::Heuristic,
    })
}

/// Whether `RLOO_GEMM=rows` has the rows kernel make `x @ w^T` (see
/// `cuda::rows_splits`), for `rloo check`; false off a GPU.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn rows_kernel_takes(x: &Tensor, w: &Tensor) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if super::on_cuda(&[x, w]) && w.rank() == 2 {
        let (x, (n, k)) = (x.contiguous()?, w.dims2()?);
        let rows = x.elem_count() / k.max(1);
        let ((xs, x_l), (ws, w_l)) = (x.storage_and_layout(), w.storage_and_layout());
        if let (candle_core::Storage::Cuda(xs), candle_core::Storage::Cuda(ws)) = (&*xs, &*ws) {
            let x_rows = Layout::contiguous_with_offset((rows, k), x_l.start_offset());
            return Ok(super::cuda::rows_splits((xs, &x_rows), (ws, w_l), (rows, k, n))?.is_some());
        }
    }
    Ok(false)
}

/// [`linear`] with the way a GPU adds the bias named: `epilogue`, in the
/// product's epilogue (bf16 only), else a pass of its own.
pub fn linear_with(x: &Tensor, w: &Tensor, b: Option<&Tensor>, epilogue: bool) -> Result<Tensor> {
    if cuda_linear_runs(x, w, b) {
        return cuda_linear(x, None, w, b, epilogue);
    }
    if !(super::fused(x) && super::fused(w) && b.is_none_or(super::fused)) {
        return ops::linear(x, w, b);
    }
    let (x, w) = (x.contiguous()?, weight_layout(w)?);
    match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, Linear),
        None => x.apply_op2(&w, Linear),
    }
}

/// `act(u) @ w^T (+ b)`, keeping only `u` for the backward, which
/// recomputes `act(u)`: an MLP's widest activation is never stored.
pub fn activation_linear(u: &Tensor, act: Activation, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if cuda_linear_runs(u, w, b) {
        return cuda_linear(u, Some(act), w, b, dense_bias_epilogue()?);
    }
    if !(super::fused(u) && super::fused(w) && b.is_none_or(super::fused)) {
        return linear(&super::activation(u, act)?, w, b);
    }
    let (u, w) = (u.contiguous()?, weight_layout(w)?);
    match b {
        Some(b) => u.apply_op3(&w, &b.contiguous()?, ActivationLinear(act)),
        None => u.apply_op2(&w, ActivationLinear(act)),
    }
}

/// [`linear`] where the training graph keeps only `x`'s place and the
/// backward makes `x` again with `remake` (a norm's output, see
/// [`super::rms_norm_remake`]): the same values and gradients. As
/// [`linear`] where `x` has no graph or the op does not run.
pub fn linear_remade(x: &Tensor, w: &Tensor, b: Option<&Tensor>, remake: Remake) -> Result<Tensor> {
    let w_l = weight_layout(w)?;
    let b = b.map(Tensor::contiguous).transpose()?;
    let b = b.as_ref();
    if x.track_op() && cuda_linear_runs(x, w, b) {
        let op = CudaLinear::new(x, None, b.is_some() && dense_bias_epilogue()?);
        return on_remade_x(|| op, (x, &w_l, b), remake);
    }
    if x.track_op() && super::fused(x) && super::fused(w) && b.is_none_or(super::fused) {
        return on_remade_x(|| Linear, (x, &w_l, b), remake);
    }
    linear(x, w, b)
}

/// A dense layer's `op` on x, w and any bias, the graph keeping only x's
/// place, which `remake` makes again.
fn on_remade_x<O>(op: impl Fn() -> O, (x, w, b): (&Tensor, &Tensor, Option<&Tensor>), remake: Remake) -> Result<Tensor>
where
    O: CustomOp2 + CustomOp3 + Send + Sync + 'static,
{
    match b {
        Some(b) => on_remade_inputs3(op, [x, w, b], [Some(remake), None, None]),
        None => on_remade_inputs2(op, [x, w], [Some(remake), None]),
    }
}

/// [`activation_linear`] with a bias, where the training graph keeps only
/// `u`'s place and the backward makes `u` again with `remake` (an MLP's
/// wide input, see [`super::remade`]): the same values and gradients. As
/// [`activation_linear`] where `u` has no graph or the op does not run.
pub fn activation_linear_remade(u: &Tensor, act: Activation, w: &Tensor, b: &Tensor, remake: Remake) -> Result<Tensor> {
    let (w_l, b) = (weight_layout(w)?, b.contiguous()?);
    if u.track_op() && cuda_linear_runs(u, w, Some(&b)) {
        let op = CudaLinear::new(u, Some(act), dense_bias_epilogue()?);
        return on_remade_input(|| op, [u, &w_l, &b], remake);
    }
    if u.track_op() && super::fused(u) && super::fused(w) && super::fused(&b) {
        return on_remade_input(|| ActivationLinear(act), [u, &w_l, &b], remake);
    }
    activation_linear(u, act, w, Some(&b))
}

/// [`CudaLinear`] on `act(x)` when `act` is given, the bias in the
/// product's epilogue when `epilogue` (bf16 only).
fn cuda_linear(x: &Tensor, act: Option<Activation>, w: &Tensor, b: Option<&Tensor>, epilogue: bool) -> Result<Tensor> {
    let (x, w, op) = (x.contiguous()?, weight_layout(w)?, CudaLinear::new(x, act, epilogue));
    match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, op),
        None => x.apply_op2(&w, op),
    }
}

/// Whether [`CudaLinear`] takes these operands: on a GPU, a weight (n, k),
/// a bias (n,) if any, rows to multiply.
fn cuda_linear_runs(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> bool {
    let on_gpu = match b {
        Some(b) => super::on_cuda(&[x, w, b]) && w.rank() == 2 && b.dims() == [w.dims()[0]],
        None => super::on_cuda(&[x, w]) && w.rank() == 2,
    };
    on_gpu && x.dims().last() == Some(&w.dims()[1]) && x.elem_count() > 0
}

/// A dense layer on a GPU, as one op: cuBLAS's product, then any bias
/// added to every row in one pass (candle's broadcast add works each
/// element's index out through the broadcast strides, 4 to 5 times a
/// plain add's time there). One node keeps only x and w for the backward,
/// where the composition also kept the product before its bias (an
/// activation of the output's size), and its backward writes d x, d w and
/// d b without the composition's reshape and transpose nodes, each of which
/// added its gradient into a zeroed buffer (and, without a bias, took d w
/// through a transposed copy). `epilogue`: the product adds the bias
/// itself (cuBLASLt, bf16). `act`: the product is of `act(x)`, made in the
/// forward and again in the backward and never kept: an MLP's widest
/// activation (four times the hidden size) is not stored.
#[derive(Clone, Copy)]
struct CudaLinear {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    epilogue: bool,
    act: Option<Activation>,
}

impl CudaLinear {
    /// The epilogue only where it is asked for and `x` is bf16.
    fn new(x: &Tensor, act: Option<Activation>, epilogue: bool) -> Self {
        Self { epilogue: epilogue && x.dtype() == candle_core::DType::BF16, act }
    }

    #[cfg(feature = "cuda")]
    fn forward(
        &self,
        (x, x_l): (&candle_core::CudaStorage, &Layout),
        (w, w_l): (&candle_core::CudaStorage, &Layout),
        b: Option<(&candle_core::CudaStorage, &Layout)>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, k, n) = sizes("cuda-linear", x_l, w_l)?;
        // x is contiguous (the caller made it so): one (rows, k) matrix whatever its rank.
        let x_rows = Layout::contiguous_with_offset((rows, k), x_l.start_offset());
        let out = cuda_dense((x, &x_rows), self.act, (w, w_l), b, (rows, k, n), self.epilogue)?;
        Ok((out, out_shape(x_l, n)))
    }

    /// d x, d w (where `w` trains) and d b (where a bias trains).
    fn grads(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>, grad: &Tensor) -> Result<BwdOut3> {
        let (n, k) = w.dims2()?;
        let rows = x.elem_count() / k;
        let g = grad.reshape((rows, n))?;
        // A frozen weight (a base weight under LoRA) records no graph and
        // gets no gradient: a product as large as the forward's saved.
        let dw = match w.track_op() {
            true => {
                let input = match self.act {
                    Some(act) => elementwise::without_graph(x, act)?,
                    None => x.clone(),
                };
                Some(g.t()?.matmul(&input.reshape((rows, k))?)?)
            }
            false => None,
        };
        let dx = g.matmul(w)?.reshape(x.shape())?;
        let dx = match self.act {
            Some(act) => elementwise::grad_without_graph(x, &dx, act)?,
            None => dx,
        };
        let db = match b.filter(|b| b.track_op()) {
            Some(_) => Some(row_sums(&g)?.reshape(n)?),
            None => None,
        };
        Ok((Some(dx), dw, db))
    }
}

impl CustomOp2 for CudaLinear {
    fn name(&self) -> &'static str {
        "cuda-linear"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    super::cuda_only_cpu_fwd!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        w: &candle_core::CudaStorage,
        w_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.forward((x, x_l), (w, w_l), None)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.grads(x, w, None, grad)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for CudaLinear {
    fn name(&self) -> &'static str {
        "cuda-linear"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    super::cuda_only_cpu_fwd!(3);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_l: &Layout,
        w: &candle_core::CudaStorage,
        w_l: &Layout,
        b: &candle_core::CudaStorage,
        b_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.forward((x, x_l), (w, w_l), Some((b, b_l)))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, b: &Tensor, _: &Tensor, grad: &Tensor) -> Result<BwdOut3> {
        self.grads(x, w, Some(b), grad)
    }
}

/// `act(x) (rows, k) @ w^T (+ b)` on a GPU (x itself without `act`):
/// `act` in a pass of its own, cuBLAS's product, then any bias in a pass of
/// its own, or in cuBLASLt's epilogue when `epilogue` (bf16); with
/// `RLOO_GEMM=rows`, a product the rows kernel takes, activation and bias
/// and all.
#[cfg(feature = "cuda")]
pub(super) fn cuda_dense(
    (x, x_l): (&candle_core::CudaStorage, &Layout),
    act: Option<Activation>,
    (w, w_l): (&candle_core::CudaStorage, &Layout),
    b: Option<(&candle_core::CudaStorage, &Layout)>,
    (rows, k, n): (usize, usize, usize),
    epilogue: bool,
) -> Result<candle_core::CudaStorage> {
    use candle_core::backend::BackendStorage;
    let gemm = gemm_choice()?;
    if gemm == Gemm::Rows {
        if let Some(out) = super::cuda::rows_product((x, x_l), act, (w, w_l), b, (rows, k, n))? {
            return Ok(out);
        }
    }
    let activated;
    let (x, x_l) = match act {
        Some(act) => {
            activated = (super::cuda::activation((x, x_l), None, act as i32)?, Layout::contiguous((rows, k)));
            (&activated.0, &activated.1)
        }
        None => (x, x_l),
    };
    let tuned = gemm == Gemm::Tuned;
    let w_t = w_l.transpose(0, 1)?;
    let cublas = || x.matmul(w, (1, rows, n, k), x_l, &w_t);
    match b {
        Some(b) if epilogue => super::cuda::linear_bias_epilogue((x, x_l), (w, w_l), b, (rows, k, n), tuned),
        Some(b) => super::cuda::bias_rows((&cublas()?, &Layout::contiguous((rows, n))), b),
        None if tuned && x.dtype() == candle_core::DType::BF16 => {
            super::cuda::gemm::plain((x, x_l), (w, w_l), (rows, k, n), cublas)
        }
        None => cublas(),
    }
}

/// d input, d w (where `w` trains) and d b (when `bias`) of
/// `input @ w^T (+ b)` for d y `grad`: the CPU kernel's products on the
/// CPU (f32), candle's (on a GPU, cuBLAS's) elsewhere.
pub(super) fn product_grads(
    input: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    bias: bool,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    if input.device().is_cpu() {
        return grads(input, w, grad, bias);
    }
    let (n, k) = w.dims2()?;
    let g = grad.contiguous()?.reshape(((), n))?;
    let dw = match w.track_op() {
        true => Some(g.t()?.matmul(&input.reshape(((), k))?)?),
        false => None,
    };
    let db = match bias {
        true => Some(row_sums(&g)?.reshape(n)?),
        false => None,
    };
    Ok((g.matmul(w)?.reshape(input.shape())?, dw, db))
}

/// The sum over the rows of `g` (rows, n), as (1, n): a product with a row
/// of ones, which cuBLAS reads in order, where candle's sum over the first
/// dimension strides across them.
pub(super) fn row_sums(g: &Tensor) -> Result<Tensor> {
    Tensor::ones((1, g.dim(0)?), g.dtype(), g.device())?.matmul(g)
}

/// `w` row-major or the transposed view of a row-major tensor, which the
/// products read in place.
pub(super) fn weight_layout(w: &Tensor) -> Result<Tensor> {
    if w.is_contiguous() || w.t()?.is_contiguous() {
        Ok(w.clone())
    } else {
        w.contiguous()
    }
}

struct Linear;

/// Rows, input and output widths of `x` (..., in) against `w` (out, in).
pub(super) fn sizes(op: &str, x_l: &Layout, w_l: &Layout) -> Result<(usize, usize, usize)> {
    let (&k, lead) = x_l.dims().split_last().unwrap_or((&0, &[]));
    let [n, w_k] = w_l.dims() else { candle_core::bail!("{op}: the weight must be 2-d, got {:?}", w_l.dims()) };
    if *w_k != k {
        candle_core::bail!("{op}: input {:?} does not match weight {:?}", x_l.dims(), w_l.dims());
    }
    Ok((lead.iter().product(), k, *n))
}

/// The output shape: `x`'s with the last dimension `n`.
pub(super) fn out_shape(x_l: &Layout, n: usize) -> Shape {
    let mut dims = x_l.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = n;
    }
    Shape::from(dims)
}

impl Linear {
    fn forward(
        &self,
        x: &[f32],
        x_l: &Layout,
        w: Operand,
        w_l: &Layout,
        b: Option<&[f32]>,
    ) -> Result<(CpuStorage, Shape)> {
        let y = dense(x, x_l, w, w_l, b)?;
        Ok((CpuStorage::F32(y), out_shape(x_l, w_l.dims()[0])))
    }
}

/// The row-major (m, n) values of `x @ w^T (+ b)` for `x` (..., in) and
/// `w` (out, in).
pub(super) fn dense(x: &[f32], x_l: &Layout, w: Operand, w_l: &Layout, b: Option<&[f32]>) -> Result<Vec<f32>> {
    let (m, k, n) = sizes("linear", x_l, w_l)?;
    let mut y = Vec::with_capacity(m * n);
    if let Some(b) = b {
        if b.len() != n {
            candle_core::bail!("linear: bias of {} for {n} outputs", b.len());
        }
        for _ in 0..m {
            y.extend_from_slice(b);
        }
    }
    // y (m, n) = x (m, k) @ w^T (k, n).
    matmul(&mut y, b.is_some(), m, n, k, Operand { data: x, row: k, col: 1 }, w.transposed());
    Ok(y)
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    fn cpu_fwd(&self, x: &CpuStorage, x_l: &Layout, w: &CpuStorage, w_l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(contiguous_f32(x, x_l)?, x_l, Operand::weight(w, w_l)?, w_l, None)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = grads(x, w, grad, false)?;
        Ok((Some(dx), dw))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
        b: &CpuStorage,
        b_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let b = contiguous_f32(b, b_l)?;
        self.forward(contiguous_f32(x, x_l)?, x_l, Operand::weight(w, w_l)?, w_l, Some(b))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = grads(x, w, grad, true)?;
        Ok((Some(dx), dw, db))
    }
}

#[derive(Clone, Copy)]
struct ActivationLinear(Activation);

impl ActivationLinear {
    fn forward(&self, u: &CpuStorage, u_l: &Layout, w: &CpuStorage, w_l: &Layout, b: Option<&[f32]>) -> FwdResult {
        let h = elementwise::apply(self.0, contiguous_f32(u, u_l)?);
        Linear.forward(&h, u_l, Operand::weight(w, w_l)?, w_l, b)
    }

    /// d u, d w and d b, from `act(u)` made again.
    fn grads(
        &self,
        u: &Tensor,
        w: &Tensor,
        grad: &Tensor,
        bias: bool,
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let h = elementwise::without_graph(u, self.0)?;
        let (dh, dw, db) = grads(&h, w, grad, bias)?;
        drop(h);
        Ok((elementwise::grad_without_graph(u, &dh, self.0)?, dw, db))
    }
}

impl CustomOp2 for ActivationLinear {
    fn name(&self) -> &'static str {
        "activation-linear"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    fn cpu_fwd(&self, u: &CpuStorage, u_l: &Layout, w: &CpuStorage, w_l: &Layout) -> FwdResult {
        self.forward(u, u_l, w, w_l, None)
    }

    fn bwd(&self, u: &Tensor, w: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (du, dw, _) = self.grads(u, w, grad, false)?;
        Ok((Some(du), dw))
    }
}

impl CustomOp3 for ActivationLinear {
    fn name(&self) -> &'static str {
        "activation-linear"
    }

    fn bwd_reads_res(&self) -> bool {
        false
    }

    fn cpu_fwd(
        &self,
        u: &CpuStorage,
        u_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
        b: &CpuStorage,
        b_l: &Layout,
    ) -> FwdResult {
        self.forward(u, u_l, w, w_l, Some(contiguous_f32(b, b_l)?))
    }

    fn bwd(
        &self,
        u: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (du, dw, db) = self.grads(u, w, grad, true)?;
        Ok((Some(du), dw, db))
    }
}

type FwdResult = Result<(CpuStorage, Shape)>;

/// d x, d w and (when `bias`) d b, computed in one buffer and returned as
/// views of it. A frozen weight (one that records no graph, such as a base
/// weight under LoRA) gets no d w, which saves a product as large as the
/// forward's.
pub(super) fn grads(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    bias: bool,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let (n, k) = w.dims2()?;
    let m = x.elem_count() / k.max(1);
    let weight = w.track_op();
    let all = grad.contiguous()?.apply_op3_no_bwd(x, w, &LinearGrad { weight, bias })?;
    let dx = all.narrow(0, 0, m * k)?.reshape(x.shape())?;
    let mut at = m * k;
    let dw = if weight {
        at += n * k;
        Some(all.narrow(0, m * k, n * k)?.reshape((n, k))?)
    } else {
        None
    };
    let db = if bias { Some(all.narrow(0, at, n)?) } else { None };
    Ok((dx, dw, db))
}

/// (d y, x, w) -> [d x (m k); d w (n k) when `weight`; d b (n) when `bias`], flat.
struct LinearGrad {
    weight: bool,
    bias: bool,
}

impl CustomOp3 for LinearGrad {
    fn name(&self) -> &'static str {
        "linear-grad"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        g_l: &Layout,
        x: &CpuStorage,
        x_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, x) = (contiguous_f32(g, g_l)?, contiguous_f32(x, x_l)?);
        let w = Operand::weight(w, w_l)?;
        let (m, k, n) = sizes("linear-grad", x_l, w_l)?;
        let len = m * k + if self.weight { n * k } else { 0 } + if self.bias { n } else { 0 };
        let mut out = Vec::with_capacity(len);
        // d x (m, k) = g (m, n) @ w (n, k).
        matmul(&mut out, false, m, k, n, Operand { data: g, row: n, col: 1 }, w);
        if self.weight {
            // d w (n, k) = g^T (n, m) @ x (m, k).
            let g_t = Operand { data: g, row: 1, col: n };
            matmul(&mut out, false, n, k, m, g_t, Operand { data: x, row: k, col: 1 });
        }
        if self.bias {
            out.extend(column_sums(g, n));
        }
        let len = out.len();
        Ok((CpuStorage::F32(out), Shape::from(len)))
    }
}

/// The sums of the columns of a row-major matrix `n` wide: each block of
/// rows is summed in parallel, then the blocks in order, so the rounding
/// depends on the shape alone and never on which thread finished first.
fn column_sums(g: &[f32], n: usize) -> Vec<f32> {
    let partial = |rows: &[f32]| {
        let mut acc = vec![0f32; n];
        for row in rows.chunks(n) {
            for (a, x) in acc.iter_mut().zip(row) {
                *a += x;
            }
        }
        acc
    };
    let blocks: Vec<Vec<f32>> = g.par_chunks(rows_per_task(n) * n).map(partial).collect();
    let mut sums = vec![0f32; n];
    for block in blocks {
        sums.iter_mut().zip(block).for_each(|(s, b)| *s += b);
    }
    sums
}

/// A matrix operand: element (i, j) is `data[i * row + j * col]`.
#[derive(Clone, Copy)]
pub(super) struct Operand<'a> {
    pub data: &'a [f32],
    pub row: usize,
    pub col: usize,
}

impl<'a> Operand<'a> {
    /// A row-major matrix `width` wide.
    pub fn rows(data: &'a [f32], width: usize) -> Self {
        Self { data, row: width, col: 1 }
    }

    /// A 2-d weight stored row-major or as the transposed view of a
    /// row-major tensor; other layouts are an error.
    pub fn weight(storage: &'a CpuStorage, layout: &Layout) -> Result<Self> {
        let data = &storage.as_slice::<f32>()?[layout.start_offset()..];
        let w = match (layout.dims(), layout.stride()) {
            ([_, k], [row, 1]) if row == k => Self { data, row: *row, col: 1 },
            ([n, _], [1, col]) if col == n => Self { data, row: 1, col: *col },
            (dims, stride) => candle_core::bail!("linear: weight {dims:?} with strides {stride:?}"),
        };
        Ok(w)
    }

    /// The same matrix read transposed.
    pub fn transposed(self) -> Self {
        Self { data: self.data, row: self.col, col: self.row }
    }

    fn covers(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.row + (cols - 1) * self.col < self.data.len()
    }
}

/// The row-major (m, n) product `lhs (m, k) @ rhs (k, n)`: added to the
/// last m n values of `dst` when `accumulate`, else appended to `dst`.
pub(super) fn matmul(dst: &mut Vec<f32>, accumulate: bool, m: usize, n: usize, k: usize, lhs: Operand, rhs: Operand) {
    assert!(lhs.covers(m, k) && rhs.covers(k, n), "matmul operands smaller than ({m}, {k}) @ ({k}, {n})");
    let base =
        if accumulate { dst.len().checked_sub(m * n).expect("matmul: fewer values than (m, n)") } else { dst.len() };
    dst.reserve(base + m * n - dst.len());
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 { Parallelism::Rayon(threads) } else { Parallelism::None };
    // Safety: the operands cover every index gemm reads (checked above) and
    // `dst` has room for m n values from `base`, all of which gemm writes,
    // reading them first only when accumulating onto initialised values.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(base),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.col as isize,
            lhs.row as isize,
            rhs.data.as_ptr(),
            rhs.col as isize,
            rhs.row as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
        dst.set_len(base + m * n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bias gradient is the same bits on every call and equals the
    /// blocks' sums added in order, however the threads interleave (a
    /// rayon `reduce` adds them in a tree shaped by work stealing).
    #[test]
    fn column_sums_add_the_blocks_in_a_fixed_order() {
        let n = 48;
        let rows = 40 * rows_per_task(n) + 7;
        let mut x = 1u64;
        let g: Vec<f32> = (0..rows * n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e3
            })
            .collect();
        let mut want = vec![0f32; n];
        for block in g.chunks(rows_per_task(n) * n) {
            let mut acc = vec![0f32; n];
            for row in block.chunks(n) {
                acc.iter_mut().zip(row).for_each(|(a, x)| *a += x);
            }
            want.iter_mut().zip(acc).for_each(|(w, a)| *w += a);
        }
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for _ in 0..20 {
            let got = pool.install(|| column_sums(&g, n));
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
