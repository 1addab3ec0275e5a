//! Launches the CUDA kernels of `kernels.cu` (compiled by the build script
//! into a fatbin: machine code for the build's GPU, PTX for later ones) for
//! the ops beside this module: their `cuda_fwd` hooks call
//! these. Inputs are read where they lie (contiguous views), outputs are new
//! buffers on the inputs' stream.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape};
use half::bf16;

use super::sdpa::OutRows;
use super::AttentionKernels;

pub mod gemm;

const KERNELS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));

/// The kernel `$name` on device `$dev`, its module loaded once per device.
macro_rules! kernel {
    ($dev:expr, $name:expr) => {
        $dev.get_or_load_custom_func_image($name, "rloo", KERNELS)
    };
}

/// An input: its storage and where its elements lie.
pub(crate) type In<'a> = (&'a CudaStorage, &'a Layout);

/// The contiguous elements of an input.
fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(s.as_cuda_slice::<T>()?.slice(start..end)),
        None => candle_core::bail!("CUDA kernel: input of shape {:?} is not contiguous", l.dims()),
    }
}

/// The elements of an input from its first on, for a kernel that walks it
/// by its own strides, which may leave gaps (a cache's spare slots, the
/// other heads of a fused projection).
fn from_first<'a, T: CudaDType>((s, l): In<'a>) -> Result<CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

/// A null pointer, for a kernel's optional pointer argument.
const NULL: u64 = 0;

/// One block per row of `width` elements: a multiple of 32 threads, at most 1024.
fn per_row(rows: usize, width: usize) -> LaunchConfig {
    let threads = (width.div_ceil(32) * 32).clamp(32, 1024) as u32;
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// A warp a row, `NORM_WARPS` (norms.cuh) rows a block.
fn warp_rows(rows: usize) -> LaunchConfig {
    const NORM_WARPS: usize = 8;
    LaunchConfig {
        grid_dim: (rows.div_ceil(NORM_WARPS).max(1) as u32, 1, 1),
        block_dim: (32 * NORM_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Enough blocks of 256 threads for `n` elements, striding beyond 65536 blocks.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// A thread per 8 of `n` elements, for the kernels of `elementwise.cuh`.
fn by_eight(n: usize) -> LaunchConfig {
    elementwise(n.div_ceil(8))
}

/// `$run::<f32>(..)` or `$run::<bf16>(..)` by `$dtype` (after [`typed`]
/// has refused any other dtype).
macro_rules! by_dtype {
    ($dtype:expr, $run:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            DType::F32 => $run::<f32>($($arg),*),
            _ => $run::<bf16>($($arg),*),
        }
    };
}

/// The name of `kernel`'s instance for `dtype`: `<kernel>_f32` or `<kernel>_bf16`.
fn typed(kernel: &str, dtype: DType) -> Result<String> {
    match dtype {
        DType::F32 => Ok(format!("{kernel}_f32")),
        DType::BF16 => Ok(format!("{kernel}_bf16")),
        other => candle_core::bail!("CUDA kernels take f32 or bf16, not {other:?}"),
    }
}

/// A norm's forward: `x` (N, H) with its per-feature `params` (weight, and
/// bias for LayerNorm), in x's dtype.
pub fn norm_fwd(kernel: &str, x: &CudaStorage, x_l: &Layout, params: &[In], eps: f32) -> Result<CudaStorage> {
    let h = params.first().map_or(0, |(_, l)| l.shape().elem_count());
    let name = match norm_chunks_held(h, std::iter::once((x, x_l)).chain(params.iter().copied())) {
        Some(c) => format!("{kernel}_wide{c}"),
        None => kernel.to_string(),
    };
    by_dtype!(x.dtype(), norm_fwd_as(&typed(&name, x.dtype())?, x, x_l, params, &[eps]))
}

/// Two LayerNorms of the rows of `x` (N, H) in one launch
/// (`layer_norm_pair_fwd_wide`, norms.cuh): `params` the first's weight and
/// bias, then the second's, `eps` theirs; the two outputs (2, N, H) in x's
/// dtype, each the same as [`norm_fwd`]'s. Only where the forward holds a
/// row's chunks (`_wide`).
pub fn layer_norm_pair(
    x: &CudaStorage,
    x_l: &Layout,
    params: &[In; 4],
    (eps1, eps2): (f32, f32),
) -> Result<CudaStorage> {
    let h = params[0].1.shape().elem_count();
    let Some(held) = norm_chunks_held(h, std::iter::once((x, x_l)).chain(params.iter().copied())) else {
        candle_core::bail!("a LayerNorm pair over rows of {h} that are not whole 16-byte loads");
    };
    let name = typed(&format!("layer_norm_pair_fwd_wide{held}"), x.dtype())?;
    by_dtype!(x.dtype(), norm_fwd_as(&name, x, x_l, params, &[eps1, eps2]))
}

/// Whether an input's first element lies on 16 bytes (its buffer does: the
/// pool's allocations are aligned far beyond), for kernels that move 16
/// bytes a load.
fn on_16((s, l): In) -> bool {
    (l.start_offset() * s.dtype().size_in_bytes()).is_multiple_of(16)
}

/// The chunks of 8 features a lane of a norm's forward holds (`_wide<C>`,
/// norms.cuh), a power of two up to 16: where `h` is a whole number of 8s
/// up to 4,096 and every input's rows lie on 16 bytes; None otherwise.
fn norm_chunks_held<'a>(h: usize, inputs: impl IntoIterator<Item = In<'a>>) -> Option<usize> {
    let held = h.div_ceil(8 * 32).next_power_of_two();
    (h.is_multiple_of(8) && held <= 16 && inputs.into_iter().all(on_16)).then_some(held)
}

/// A norm forward's kernel `name` over x and its `params`: one output of
/// x's size for each of `eps` (a norm's, or a pair's two), one after the other.
fn norm_fwd_as<T: CudaDType + DeviceRepr>(
    name: &str,
    x: &CudaStorage,
    x_l: &Layout,
    params: &[In],
    eps: &[f32],
) -> Result<CudaStorage> {
    let dev = x.device.clone();
    let xs = view::<T>(x, x_l)?;
    let ps = params.iter().map(|(s, l)| view::<T>(s, l)).collect::<Result<Vec<_>>>()?;
    let h = ps[0].len();
    let n = xs.len() / h;
    // Safety: every element is written by the kernel.
    let mut y = unsafe { dev.alloc::<T>(eps.len() * xs.len()) }?;
    let func = kernel!(dev, name)?;
    let mut args = func.builder();
    args.arg(&xs);
    for p in &ps {
        args.arg(p);
    }
    let (n32, h32) = (n as i32, h as i32);
    args.arg(&mut y).arg(&n32).arg(&h32);
    for e in eps {
        args.arg(e);
    }
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(warp_rows(n)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev))
}

/// A norm's backward from x, weight and d y (N, H): d x (N, H) in x's
/// dtype, and each row's part of d weight, f32 (N, H).
pub fn norm_bwd(
    kernel: &str,
    (x, x_l): In,
    (w, w_l): In,
    (g, g_l): In,
    eps: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    fn run<T: CudaDType + DeviceRepr>(
        name: &str,
        (x, x_l): In,
        (w, w_l): In,
        (g, g_l): In,
        eps: f32,
    ) -> Result<(CudaStorage, CudaStorage)> {
        let dev = x.device.clone();
        let (xs, ws, gs) = (view::<T>(x, x_l)?, view::<T>(w, w_l)?, view::<T>(g, g_l)?);
        let (h, n) = (ws.len(), xs.len() / ws.len());
        if gs.len() != n * h {
            candle_core::bail!("{name}: a gradient of {} elements for {n} rows of {h}", gs.len());
        }
        // Safety: every element of both is written by the kernel.
        let (mut dx, mut dw) = unsafe { (dev.alloc::<T>(n * h)?, dev.alloc::<f32>(n * h)?) };
        let func = kernel!(dev, name)?;
        let (n32, h32) = (n as i32, h as i32);
        let mut args = func.builder();
        args.arg(&xs).arg(&ws).arg(&gs).arg(&mut dx).arg(&mut dw).arg(&n32).arg(&h32).arg(&eps);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(warp_rows(n)) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(dx, dev.clone()), CudaStorage::wrap_cuda_slice(dw, dev)))
    }
    by_dtype!(x.dtype(), run(&typed(kernel, x.dtype())?, (x, x_l), (w, w_l), (g, g_l), eps))
}

/// (N, 2) [log-prob of the target, entropy] per row of logits (N, V), f32
/// or bf16, at temperature 1 / inv_t.
pub fn token_logprobs((logits, l_l): In, (targets, t_l): In, inv_t: f32) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(
        name: &str,
        (logits, l_l): In,
        (targets, t_l): In,
        inv_t: f32,
    ) -> Result<CudaStorage> {
        let dev = logits.device.clone();
        let (z, t) = (view::<T>(logits, l_l)?, view::<u32>(targets, t_l)?);
        let (n, v) = (t.len(), z.len() / t.len().max(1));
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<f32>(2 * n) }?;
        let func = kernel!(dev, name)?;
        let v32 = v as i32;
        let mut args = func.builder();
        args.arg(&z).arg(&t).arg(&mut out).arg(&v32).arg(&inv_t);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(per_row(n, v)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed("token_logprobs_fwd", logits.dtype())?;
    by_dtype!(logits.dtype(), run(&name, (logits, l_l), (targets, t_l), inv_t))
}

/// Turns `logits` (N, V), f32 or bf16, into their gradient in place, from
/// the gradient (N, 2) f32 of [`token_logprobs`]'s output.
pub fn token_logprobs_grad(
    logits: &mut CudaStorage,
    l_l: &Layout,
    (targets, t_l): In,
    (grad, g_l): In,
    inv_t: f32,
) -> Result<()> {
    fn run<T: CudaDType + DeviceRepr>(
        name: &str,
        logits: &mut CudaStorage,
        l_l: &Layout,
        (targets, t_l): In,
        (grad, g_l): In,
        inv_t: f32,
    ) -> Result<()> {
        let dev = logits.device.clone();
        let (t, g) = (view::<u32>(targets, t_l)?, view::<f32>(grad, g_l)?);
        let mut z = view_mut::<T>(logits, l_l)?;
        let (n, v) = (t.len(), z.len() / t.len().max(1));
        let func = kernel!(dev, name)?;
        let v32 = v as i32;
        let mut args = func.builder();
        args.arg(&mut z).arg(&t).arg(&g).arg(&v32).arg(&inv_t);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(per_row(n, v)) }.w()?;
        Ok(())
    }
    let name = typed("token_logprobs_bwd", logits.dtype())?;
    by_dtype!(logits.dtype(), run(&name, logits, l_l, (targets, t_l), (grad, g_l), inv_t))
}

/// The race sampler's picks (`generate::race`): (R, 3) u32 [token, log-prob
/// bits, entropy bits] from logits (R, V) in f32 or bf16 (read as their f32
/// cast), the rows' settings (R, 9) u32 and their seen bits (R or 1, width)
/// u32.
pub fn race_pick((logits, l_l): In, (params, p_l): In, (seen, s_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType>(name: &str, (logits, l_l): In, (params, p_l): In, (seen, s_l): In) -> Result<CudaStorage> {
        let dev = logits.device.clone();
        let (rows, v) = l_l.shape().dims2()?;
        let (z, p, s) = (view::<T>(logits, l_l)?, view::<u32>(params, p_l)?, view::<u32>(seen, s_l)?);
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<u32>(3 * rows) }?;
        let func = kernel!(dev, name)?;
        let (width, v32) = (s_l.shape().dims2()?.1 as i32, v as i32);
        let mut args = func.builder();
        args.arg(&z).arg(&p).arg(&s).arg(&width).arg(&mut out).arg(&v32);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(per_row(rows, v)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed("race_pick", logits.dtype())?;
    by_dtype!(logits.dtype(), run(&name, (logits, l_l), (params, p_l), (seen, s_l)))
}

/// The contiguous elements of an in-place operand.
fn view_mut<'a, T: CudaDType>(
    s: &'a mut CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaViewMut<'a, T>> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(s.as_cuda_slice_mut::<T>()?.slice_mut(start..end)),
        None => candle_core::bail!("CUDA kernel: in-place operand of shape {:?} is not contiguous", l.dims()),
    }
}

/// AdamW's moment update in place: `x = beta x + (1 - beta) g` (or g^2).
pub fn adamw_moment(
    x: &mut CudaStorage,
    x_l: &Layout,
    g: &CudaStorage,
    g_l: &Layout,
    beta: f32,
    squared: bool,
) -> Result<()> {
    let dev = x.device.clone();
    let gs = view::<f32>(g, g_l)?;
    let n = gs.len();
    let mut xs = view_mut::<f32>(x, x_l)?;
    let func = kernel!(dev, "adamw_moment")?;
    let sq = squared as i32;
    let mut args = func.builder();
    args.arg(&mut xs).arg(&gs).arg(&n).arg(&beta).arg(&sq);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(elementwise(n)) }.w()?;
    Ok(())
}

/// AdamW's weight update in place from the moments.
pub fn adamw_update(
    w: &mut CudaStorage,
    w_l: &Layout,
    (m, m_l): In,
    (v, v_l): In,
    step: super::AdamWStep,
) -> Result<()> {
    let dev = w.device.clone();
    let (ms, vs) = (view::<f32>(m, m_l)?, view::<f32>(v, v_l)?);
    let n = ms.len();
    let mut ws = view_mut::<f32>(w, w_l)?;
    let func = kernel!(dev, "adamw_update")?;
    let (lr_step, inv_sqrt_bias2) = (step.lr / step.bias1, 1.0 / step.bias2.sqrt());
    let mut args = func.builder();
    args.arg(&mut ws).arg(&ms).arg(&vs).arg(&n).arg(&lr_step).arg(&inv_sqrt_bias2).arg(&step.eps).arg(&step.decay);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(elementwise(n)) }.w()?;
    Ok(())
}

/// The device addresses of the first elements of locked tensors of `T`,
/// for kernels that take operands by address (a table of them, or buffers
/// written in place); the guards keep the stream's order of their uses and
/// must live until the launch is queued.
fn addresses<'a, T: CudaDType + 'a, G: std::ops::Deref<Target = candle_core::Storage>>(
    op: &str,
    locked: &'a [(G, &'a Layout)],
    stream: &'a std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
) -> Result<(Vec<u64>, Vec<candle_core::cuda_backend::cudarc::driver::SyncOnDrop<'a>>)> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let mut addresses = Vec::with_capacity(locked.len());
    let mut reads = Vec::with_capacity(locked.len());
    for (storage, layout) in locked {
        let candle_core::Storage::Cuda(s) = &**storage else { candle_core::bail!("{op}: an operand is not on a GPU") };
        let Some((start, _)) = layout.contiguous_offsets() else {
            candle_core::bail!("{op}: an operand is not contiguous")
        };
        let (address, read) = s.as_cuda_slice::<T>()?.device_ptr(stream);
        addresses.push(address + (std::mem::size_of::<T>() * start) as u64);
        reads.push(read);
    }
    Ok((addresses, reads))
}

/// The storages of `ts`, locked, and their layouts, for [`addresses`].
fn locked<'a>(
    ts: impl IntoIterator<Item = &'a candle_core::Tensor>,
) -> Vec<(impl std::ops::Deref<Target = candle_core::Storage> + 'a, &'a Layout)> {
    ts.into_iter().map(|t| t.storage_and_layout()).collect()
}

/// One parameter's operands in [`adamw_multi`]'s table, as `AdamWTensor`
/// in `adamw.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AdamWTensor {
    w: u64,
    low: u64,
    up: u64,
    m: u64,
    v: u64,
    g: u64,
    n: u64,
    decay: f32,
    pad: f32,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for AdamWTensor {}

/// AdamW over many parameters in one launch (`adamw_many` has checked
/// that every operand is on this GPU, contiguous and of its dtype, and the
/// masters all f32 or all split): a table of their addresses goes to the
/// device, and each parameter gets a row of blocks. The weights and
/// moments are written in place through their addresses, in the stream's
/// order like every other op.
pub fn adamw_multi(params: &[super::AdamWParam]) -> Result<()> {
    let Some(first) = params.first() else { return Ok(()) };
    let candle_core::Device::Cuda(dev) = first.w.device() else {
        candle_core::bail!("adamw_multi: the parameters are not on a GPU")
    };
    let stream = dev.cuda_stream();
    let moments = locked(params.iter().flat_map(|p| [p.g, &*p.m, &*p.v]));
    let (moments, moment_reads) = addresses::<f32, _>("adamw_multi", &moments, &stream)?;
    let weights = locked(params.iter().map(|p| p.w.as_tensor()));
    let splits: Vec<&super::SplitMaster> = params.iter().filter_map(|p| p.split).collect();
    let (lows, ups) =
        (locked(splits.iter().map(|s| s.low.as_tensor())), locked(splits.iter().map(|s| s.up.as_tensor())));
    let split = !splits.is_empty();
    let (weights, weight_reads) = match split {
        true => addresses::<bf16, _>("adamw_multi", &weights, &stream)?,
        false => addresses::<f32, _>("adamw_multi", &weights, &stream)?,
    };
    let (lows, low_reads) = addresses::<i16, _>("adamw_multi", &lows, &stream)?;
    let (ups, up_reads) = addresses::<u32, _>("adamw_multi", &ups, &stream)?;
    let table: Vec<AdamWTensor> = params
        .iter()
        .enumerate()
        .zip(moments.chunks(3))
        .map(|((i, p), a)| AdamWTensor {
            w: weights[i],
            low: lows.get(i).copied().unwrap_or(0),
            up: ups.get(i).copied().unwrap_or(0),
            m: a[1],
            v: a[2],
            g: a[0],
            n: p.w.elem_count() as u64,
            decay: p.step.decay,
            pad: 0.0,
        })
        .collect();
    let table = dev.clone_htod(&table)?;
    let s = first.step;
    let (lr_step, inv_sqrt_bias2) = (s.lr / s.bias1, 1.0 / s.bias2.sqrt());
    let longest = params.iter().map(|p| p.w.elem_count()).max().unwrap_or(1);
    let cfg = LaunchConfig {
        grid_dim: (longest.div_ceil(256).clamp(1, 1024) as u32, params.len() as u32, 1),
        // Whole warps: a split master's warp writes a word of its carries.
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let func = kernel!(dev, if split { "adamw_multi_split" } else { "adamw_multi" })?;
    let mut args = func.builder();
    args.arg(&table).arg(&s.beta1).arg(&s.beta2).arg(&lr_step).arg(&inv_sqrt_bias2).arg(&s.eps);
    // Safety: the argument list matches the kernel's signature, and the
    // table's addresses stay allocated (locked) until the launch is queued.
    unsafe { args.launch(cfg) }.w()?;
    drop((moment_reads, weight_reads, low_reads, up_reads));
    Ok(())
}

/// One tensor in [`sum_squares_multi`]'s table, as `SquaresTensor` in
/// `kernels.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SquaresTensor {
    x: u64,
    n: u64,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for SquaresTensor {}

/// Blocks summing each tensor in [`sum_squares_multi`].
const SQUARES_BLOCKS: usize = 64;

/// Each tensor's sum of squares, in f64, from one launch (`sums_of_squares`
/// has checked that every tensor is f32, contiguous and on this GPU) and
/// one read of the blocks' partial sums, added in order here.
pub fn sum_squares_multi(ts: &[&candle_core::Tensor]) -> Result<Vec<f64>> {
    let Some(first) = ts.first() else { return Ok(Vec::new()) };
    let candle_core::Device::Cuda(dev) = first.device() else {
        candle_core::bail!("sum_squares_multi: the tensors are not on a GPU")
    };
    let stream = dev.cuda_stream();
    let locked: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let (addresses, reads) = addresses::<f32, _>("sum_squares_multi", &locked, &stream)?;
    let table: Vec<SquaresTensor> =
        ts.iter().zip(addresses).map(|(t, x)| SquaresTensor { x, n: t.elem_count() as u64 }).collect();
    let table = dev.clone_htod(&table)?;
    // Safety: every element is written by the kernel.
    let mut partial = unsafe { dev.alloc::<f64>(ts.len() * SQUARES_BLOCKS) }?;
    let cfg = LaunchConfig {
        grid_dim: (SQUARES_BLOCKS as u32, ts.len() as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let func = kernel!(dev, "sum_squares_multi")?;
    let mut args = func.builder();
    args.arg(&table).arg(&mut partial);
    // Safety: the argument list matches the kernel's signature, and the
    // table's addresses stay allocated (locked) until the launch is queued.
    unsafe { args.launch(cfg) }.w()?;
    drop(reads);
    let partial = dev.clone_dtoh(&partial)?;
    Ok(partial.chunks(SQUARES_BLOCKS).map(|blocks| blocks.iter().sum()).collect())
}

/// Blocks of `non_finite` at most: enough to keep an H100's
/// multiprocessors busy, few enough flags to read back (4 KB).
const FINITE_BLOCKS: usize = 1024;

/// Whether any element of `x` (f32 or bf16) is NaN or infinite: one launch
/// over it, then one read of its blocks' flags.
pub fn any_non_finite((x, x_l): In) -> Result<bool> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In) -> Result<bool> {
        let dev = x.device.clone();
        let xs = view::<T>(x, x_l)?;
        let n = xs.len();
        let blocks = n.div_ceil(8 * 256).clamp(1, FINITE_BLOCKS);
        // Safety: every block writes its flag.
        let mut flags = unsafe { dev.alloc::<f32>(blocks) }?;
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs).arg(&n).arg(&mut flags);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok(dev.clone_dtoh(&flags)?.iter().any(|&f| f != 0.0))
    }
    by_dtype!(x.dtype(), run(&typed("non_finite", x.dtype())?, (x, x_l)))
}

/// `act` (0 GELU, 1 GELU tanh, 2 SiLU, 3 ReLU) elementwise over `x`, or its
/// backward `g * act'(x)` when `grad` is given; in x's dtype.
pub fn activation((x, x_l): In, grad: Option<In>, act: i32) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In, grad: Option<In>, act: i32) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let xs = view::<T>(x, x_l)?;
        let n = xs.len();
        let gs = grad.map(|(g, g_l)| view::<T>(g, g_l)).transpose()?;
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs);
        if let Some(gs) = &gs {
            args.arg(gs);
        }
        args.arg(&mut out).arg(&n).arg(&act);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed(if grad.is_some() { "activation_bwd" } else { "activation_fwd" }, x.dtype())?;
    by_dtype!(x.dtype(), run(&name, (x, x_l), grad, act))
}

/// The gradient (V, H) of an embedding table of `v` rows from its lookups'
/// gradient (N, H) at `ids` (N, u32), a block per row (embedding.cuh).
pub fn embedding_grad((g, g_l): In, (ids, ids_l): In, v: usize) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (g, g_l): In, (ids, ids_l): In, v: usize) -> Result<CudaStorage> {
        let dev = g.device.clone();
        let (gs, is) = (view::<T>(g, g_l)?, view::<u32>(ids, ids_l)?);
        let n = is.len();
        let h = gs.len() / n.max(1);
        if gs.len() != n * h {
            candle_core::bail!("embedding_grad: a gradient of {} elements for {n} ids", gs.len());
        }
        // Safety: every element is written by the kernel (each row's slabs cover its columns).
        let mut out = unsafe { dev.alloc::<T>(v * h) }?;
        let func = kernel!(dev, name)?;
        let (n32, h32) = (n as i32, h as i32);
        let mut args = func.builder();
        args.arg(&gs).arg(&is).arg(&mut out).arg(&n32).arg(&h32);
        const THREADS: usize = 256;
        const COLUMNS: usize = 4; // EMBEDDING_COLUMNS
        let slabs = h.div_ceil(THREADS * COLUMNS).max(1) as u32;
        let cfg =
            LaunchConfig { grid_dim: (v as u32, slabs, 1), block_dim: (THREADS as u32, 1, 1), shared_mem_bytes: 0 };
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(g.dtype(), run(&typed("embedding_grad", g.dtype())?, (g, g_l), (ids, ids_l), v))
}

/// `(x + a) + b` of three contiguous inputs of one size.
pub fn sum3((x, x_l): In, (a, a_l): In, (b, b_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In, (a, a_l): In, (b, b_l): In) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let (xs, as_, bs) = (view::<T>(x, x_l)?, view::<T>(a, a_l)?, view::<T>(b, b_l)?);
        let n = xs.len();
        if as_.len() != n || bs.len() != n {
            candle_core::bail!("sum3: inputs of {n}, {} and {} elements", as_.len(), bs.len());
        }
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs).arg(&as_).arg(&bs).arg(&mut out).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(x.dtype(), run(&typed("sum3", x.dtype())?, (x, x_l), (a, a_l), (b, b_l)))
}

/// `x + a`, both contiguous, of one size and dtype.
pub fn sum2((x, x_l): In, (a, a_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In, (a, a_l): In) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let (xs, as_) = (view::<T>(x, x_l)?, view::<T>(a, a_l)?);
        let n = xs.len();
        if as_.len() != n {
            candle_core::bail!("sum2: inputs of {n} and {} elements", as_.len());
        }
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs).arg(&as_).arg(&mut out).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(x.dtype(), run(&typed("sum2", x.dtype())?, (x, x_l), (a, a_l)))
}

/// The f32 `sum` plus `g` (f32 or bf16) cast up, both contiguous, of one size.
pub fn add_cast((sum, sum_l): In, (g, g_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (sum, sum_l): In, (g, g_l): In) -> Result<CudaStorage> {
        let dev = sum.device.clone();
        let (ss, gs) = (view::<f32>(sum, sum_l)?, view::<T>(g, g_l)?);
        let n = ss.len();
        if gs.len() != n {
            candle_core::bail!("add_cast: a sum of {n} elements and a gradient of {}", gs.len());
        }
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<f32>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&ss).arg(&gs).arg(&mut out).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(g.dtype(), run(&typed("add_cast", g.dtype())?, (sum, sum_l), (g, g_l)))
}

/// `g` (f32 or bf16) cast up and added into the f32 `sum` in place, both
/// contiguous, of one size.
pub fn add_cast_into(sum: &mut CudaStorage, sum_l: &Layout, (g, g_l): In) -> Result<()> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, sum: &mut CudaStorage, sum_l: &Layout, (g, g_l): In) -> Result<()> {
        let dev = sum.device.clone();
        let gs = view::<T>(g, g_l)?;
        let mut ss = view_mut::<f32>(sum, sum_l)?;
        let n = ss.len();
        if gs.len() != n {
            candle_core::bail!("add_cast_into: a sum of {n} elements and a gradient of {}", gs.len());
        }
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&mut ss).arg(&gs).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(by_eight(n)) }.w()?;
        Ok(())
    }
    by_dtype!(g.dtype(), run(&typed("add_cast_into", g.dtype())?, sum, sum_l, (g, g_l)))
}

/// The kernel casting `from` to `to`: `widen_bf16` (bf16 to f32) or
/// `narrow_bf16` (f32 to bf16).
fn cast_kernel(from: DType, to: DType) -> Result<&'static str> {
    match (from, to) {
        (DType::BF16, DType::F32) => Ok("widen_bf16"),
        (DType::F32, DType::BF16) => Ok("narrow_bf16"),
        _ => candle_core::bail!("cast kernels take bf16 to f32 or f32 to bf16, not {from:?} to {to:?}"),
    }
}

/// Launches a cast kernel (`cast_kernel`) over `n` elements.
fn launch_cast<S: DeviceRepr, D: DeviceRepr>(
    dev: &candle_core::CudaDevice,
    name: &str,
    x: &CudaView<S>,
    y: &mut CudaViewMut<D>,
    n: usize,
) -> Result<()> {
    let func = kernel!(dev, name)?;
    let mut args = func.builder();
    args.arg(x).arg(y).arg(&n);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(by_eight(n)) }.w()?;
    Ok(())
}

/// `x` (contiguous) in `to`: bf16 to f32 or f32 to bf16, in a new buffer.
pub fn cast((x, x_l): In, to: DType) -> Result<CudaStorage> {
    let (dev, name) = (x.device.clone(), cast_kernel(x.dtype(), to)?);
    let n = x_l.shape().elem_count();
    if to == DType::F32 {
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<f32>(n) }?;
        launch_cast(&dev, name, &view::<bf16>(x, x_l)?, &mut out.slice_mut(..), n)?;
        return Ok(CudaStorage::wrap_cuda_slice(out, dev));
    }
    // Safety: as above.
    let mut out = unsafe { dev.alloc::<bf16>(n) }?;
    launch_cast(&dev, name, &view::<f32>(x, x_l)?, &mut out.slice_mut(..), n)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `x` cast to `dst`'s dtype and written over it, both contiguous, of one size.
pub fn cast_into(dst: &mut CudaStorage, dst_l: &Layout, (x, x_l): In) -> Result<()> {
    let (dev, name) = (x.device.clone(), cast_kernel(x.dtype(), dst.dtype())?);
    let n = dst_l.shape().elem_count();
    if x_l.shape().elem_count() != n {
        candle_core::bail!("cast_into: {} elements into {n}", x_l.shape().elem_count());
    }
    match dst.dtype() {
        DType::F32 => launch_cast(&dev, name, &view::<bf16>(x, x_l)?, &mut view_mut::<f32>(dst, dst_l)?, n),
        _ => launch_cast(&dev, name, &view::<f32>(x, x_l)?, &mut view_mut::<bf16>(dst, dst_l)?, n),
    }
}

/// `x * mul + add` written over the contiguous f32 `x`.
pub fn affine_in_place(x: &mut CudaStorage, x_l: &Layout, mul: f32, add: f32) -> Result<()> {
    let dev = x.device.clone();
    let mut xs = view_mut::<f32>(x, x_l)?;
    let n = xs.len();
    let func = kernel!(dev, "affine_in_place_f32")?;
    let mut args = func.builder();
    args.arg(&mut xs).arg(&n).arg(&mul).arg(&add);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(by_eight(n)) }.w()?;
    Ok(())
}

/// `x` with `mask` applied: its kept elements scaled, the others 0.
pub fn dropout((x, x_l): In, mask: &super::Mask) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (x, x_l): In, mask: &super::Mask) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let xs = view::<T>(x, x_l)?;
        let n = xs.len();
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&xs).arg(&mut out).arg(&n).arg(&mask.key[0]).arg(&mask.key[1]);
        args.arg(&mask.threshold).arg(&mask.scale);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(elementwise(n.div_ceil(4))) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(x.dtype(), run(&typed("dropout", x.dtype())?, (x, x_l), mask))
}

/// `y` (rows, n) with `b` (n,) added to every row, in y's dtype.
pub fn bias_rows((y, y_l): In, (b, b_l): In) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (y, y_l): In, (b, b_l): In) -> Result<CudaStorage> {
        let dev = y.device.clone();
        let (ys, bs) = (view::<T>(y, y_l)?, view::<T>(b, b_l)?);
        let (n, len) = (bs.len(), ys.len());
        if n == 0 || len % n != 0 {
            candle_core::bail!("bias_rows: {len} elements are not rows of the bias's {n}");
        }
        let rows = len / n;
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(len) }?;
        let func = kernel!(dev, name)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256) as u32, rows.clamp(1, 65_535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = n as i32;
        let mut args = func.builder();
        args.arg(&ys).arg(&bs).arg(&mut out).arg(&rows).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed("bias_rows", y.dtype())?;
    by_dtype!(y.dtype(), run(&name, (y, y_l), (b, b_l)))
}

/// The f32 dot product of each row of `a` and `b` (rows of `d`).
pub fn row_dots((a, a_l): In, (b, b_l): In, d: usize) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(name: &str, (a, a_l): In, (b, b_l): In, d: usize) -> Result<CudaStorage> {
        let dev = a.device.clone();
        let (xs, ys) = (view::<T>(a, a_l)?, view::<T>(b, b_l)?);
        if d == 0 || xs.len() != ys.len() || xs.len() % d != 0 {
            candle_core::bail!("row_dots: {} and {} elements are not rows of {d}", xs.len(), ys.len());
        }
        let rows = xs.len() / d;
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<f32>(rows) }?;
        let func = kernel!(dev, name)?;
        // 8 warps per block, a warp per row.
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(8).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let d = d as i32;
        let mut args = func.builder();
        args.arg(&xs).arg(&ys).arg(&mut out).arg(&rows).arg(&d);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let name = typed("row_dots", a.dtype())?;
    by_dtype!(a.dtype(), run(&name, (a, a_l), (b, b_l), d))
}

/// Rotates x (B, H, T, D) by f32 tables (B, 1, T, R); `sign` -1 rotates back.
pub fn rotary((x, x_l): In, (cos, c_l): In, (sin, s_l): In, sign: f32) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(
        name: &str,
        (x, x_l): In,
        (cos, c_l): In,
        (sin, s_l): In,
        sign: f32,
    ) -> Result<CudaStorage> {
        let dev = x.device.clone();
        let &[_, h, t, d] = x_l.dims() else {
            candle_core::bail!("rotary: expected (B, H, T, D), got {:?}", x_l.dims())
        };
        let r = *c_l.dims().last().unwrap_or(&0);
        let (xs, cs, ss) = (view::<T>(x, x_l)?, view::<f32>(cos, c_l)?, view::<f32>(sin, s_l)?);
        let n = xs.len();
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let (h, t, d, r) = (h as i32, t as i32, d as i32, r as i32);
        let mut args = func.builder();
        args.arg(&xs).arg(&cs).arg(&ss).arg(&mut out).arg(&h).arg(&t).arg(&d).arg(&r).arg(&sign).arg(&n);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(elementwise(n)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(x.dtype(), run(&typed("rotary", x.dtype())?, (x, x_l), (cos, c_l), (sin, s_l), sign))
}

/// Where a fused q/k/v projection's heads lie, as `HeadsDims` in
/// `heads.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct HeadsDims {
    /// The projection's row (3 H D), and where each head's q, k and v
    /// start in it: head h's part p at h head_stride + offset[p].
    pub width: i64,
    pub head_stride: i64,
    pub offset: [i64; 3],
    pub batch: i32,
    pub h: i32,
    pub t: i32,
    pub d: i32,
    /// Rotated features of q and k (0: none).
    pub r: i32,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for HeadsDims {}

impl HeadsDims {
    /// Elements of the heads (3, B, H, T, D), as of the projection.
    fn len(&self) -> usize {
        3 * (self.batch as usize) * (self.h as usize) * (self.t as usize) * (self.d as usize)
    }
}

/// Whether the heads kernels may move 8 features at a time (`_wide`): D
/// and R / 2 whole 8s, and every row of `inputs` and the tables on 16 bytes.
fn heads_wide(a: &HeadsDims, inputs: &[In], tables: Option<(In, In)>) -> bool {
    let eights = [a.width, a.head_stride, a.offset[0], a.offset[1], a.offset[2], a.d as i64];
    eights.iter().all(|x| x % 8 == 0)
        && a.r % 16 == 0
        && inputs.iter().all(|&x| on_16(x))
        && tables.is_none_or(|(cos, sin)| on_16(cos) && on_16(sin))
}

/// `heads_split` (inputs: the projection) or `heads_merge` (d q, then d k
/// and d v stacked) over the f32 rotary tables (B, T, R), if any.
fn heads(kernel: &str, inputs: &[In], tables: Option<(In, In)>, a: HeadsDims) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(
        name: &str,
        inputs: &[In],
        tables: Option<(In, In)>,
        a: HeadsDims,
        wide: bool,
    ) -> Result<CudaStorage> {
        let dev = inputs[0].0.device.clone();
        let views = inputs.iter().map(|&(s, l)| view::<T>(s, l)).collect::<Result<Vec<_>>>()?;
        let tables = match tables {
            Some((cos, sin)) => Some((view::<f32>(cos.0, cos.1)?, view::<f32>(sin.0, sin.1)?)),
            None => None,
        };
        let n = a.len();
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        for v in &views {
            args.arg(v);
        }
        match &tables {
            Some((cos, sin)) => args.arg(cos).arg(sin),
            // With r = 0 the kernel reads no table.
            None => args.arg(&views[0]).arg(&views[0]),
        };
        args.arg(&mut out).arg(&a).arg(&n);
        // A thread per 8 features, or a warp per head row of d features.
        let threads = if wide { n / 8 } else { 32 * (n / a.d as usize) };
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(elementwise(threads)) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let (dtype, wide) = (inputs[0].0.dtype(), heads_wide(&a, inputs, tables));
    let name = typed(&format!("{kernel}{}", if wide { "_wide" } else { "" }), dtype)?;
    by_dtype!(dtype, run(&name, inputs, tables, a, wide))
}

/// The heads (3, B, H, T, D) of the projection `fused` (B, T, W), q and k
/// rotated by the tables.
pub fn heads_split(fused: In, tables: Option<(In, In)>, a: HeadsDims) -> Result<CudaStorage> {
    heads("heads_split", &[fused], tables, a)
}

/// The projection's gradient (B, T, W) from d q (B, H, T, D) and d k, d v
/// stacked (2, B, H, T, D), rotated back by the tables.
pub fn heads_merge(dq: In, dkv: In, tables: Option<(In, In)>, a: HeadsDims) -> Result<CudaStorage> {
    heads("heads_merge", &[dq, dkv], tables, a)
}

/// Attention over the heads of a fused projection, by the `kernels` given:
/// (output (B, T, H D) in the projection's dtype, log-sum-exp (B, H, T) f32).
pub fn qkv_attention_fwd(
    fused: In,
    tables: Option<(In, In)>,
    mask: MaskIn,
    a: HeadsDims,
    scale: f32,
    kernels: AttentionKernels,
) -> Result<(CudaStorage, CudaStorage)> {
    use candle_core::backend::BackendDevice;
    let qkv = heads_split(fused, tables, a)?;
    let (b, h, t, d) = (a.batch as usize, a.h as usize, a.t as usize, a.d as usize);
    let part = |p: usize| Layout::contiguous_with_offset((b, h, t, d), p * b * h * t * d);
    let (q_l, k_l, v_l) = (part(0), part(1), part(2));
    let layout = kernels.projection_rows();
    let dims = AttnDims::new([h, h, t, t, d], t * d, scale).out_rows(layout);
    let (out, lse) = attention_fwd((&qkv, &q_l), (&qkv, &k_l), (&qkv, &v_l), mask, dims, kernels)?;
    if layout == OutRows::ByToken {
        return Ok((out, lse));
    }
    // (B, H, T, D) -> (B, T, H, D), the output projection's input.
    // Safety: the copy below writes every element.
    let mut rows = unsafe { out.device().alloc_uninit(&Shape::from((b, t, h, d)), out.dtype()) }?;
    out.copy_strided_src(&mut rows, 0, &Layout::contiguous((b, h, t, d)).transpose(1, 2)?)?;
    Ok((rows, lse))
}

/// The sizes and strides of [`rotary_append`], as `AppendDims` in
/// `kernels.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AppendDims {
    /// The (row, head) strides of q, k and v.
    pub q_row: i64,
    pub q_head: i64,
    pub k_row: i64,
    pub k_head: i64,
    pub v_row: i64,
    pub v_head: i64,
    pub h: i32,
    pub h_kv: i32,
    pub d: i32,
    /// Rotated features (0: none).
    pub r: i32,
    /// The cache buffers' slots per head, and the one written.
    pub capacity: i32,
    pub slot: i32,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for AppendDims {}

/// A decoding step's rotary and cache append in one launch: q, k and v (B
/// rows of one token) read from their first elements with the strides of
/// `a`, the f32 tables (B, R) if any, and the cache's key and value buffers
/// (contiguous, B x Hkv x capacity x D) written in place at slot `a.slot`,
/// or at the slot `slot_at` (1,) u32 holds when given. Returns q rotated,
/// (B, H, 1, D). Eight features a thread in 16-byte loads where every row
/// lies on 16 bytes (`rotary_append_wide`, heads.cuh), else a thread a feature.
pub fn rotary_append(
    (q, k, v): (In, In, In),
    tables: Option<(In, In)>,
    cache: (&candle_core::Tensor, &candle_core::Tensor),
    slot_at: Option<In>,
    b: usize,
    a: AppendDims,
) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(
        name: &str,
        (q, k, v): (In, In, In),
        tables: Option<(In, In)>,
        (k_cache, v_cache): (&candle_core::Tensor, &candle_core::Tensor),
        slot_at: Option<In>,
        b: usize,
        a: AppendDims,
    ) -> Result<CudaStorage> {
        let dev = q.0.device.clone();
        let inputs_on_16 = [q, k, v].into_iter().chain(tables.into_iter().flat_map(|(c, s)| [c, s])).all(on_16);
        let (qs, ks, vs) = (from_first::<T>(q)?, from_first::<T>(k)?, from_first::<T>(v)?);
        let tables = match tables {
            Some((cos, sin)) => Some((view::<f32>(cos.0, cos.1)?, view::<f32>(sin.0, sin.1)?)),
            None => None,
        };
        let stream = dev.cuda_stream();
        let locked = [k_cache.storage_and_layout(), v_cache.storage_and_layout()];
        let (buffers, writes) = addresses::<T, _>("rotary_append", &locked, &stream)?;
        let n = b * (a.h * a.d) as usize;
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(n) }?;
        let whole_8s = [a.q_row, a.q_head, a.k_row, a.k_head, a.v_row, a.v_head].iter().all(|s| s % 8 == 0)
            && a.d % 8 == 0
            && a.r % 16 == 0;
        let wide = whole_8s && inputs_on_16 && buffers.iter().all(|address| address % 16 == 0);
        let name = match wide {
            true => name.replacen("rotary_append", "rotary_append_wide", 1),
            false => name.to_string(),
        };
        let func = kernel!(dev, &name)?;
        let mut args = func.builder();
        args.arg(&qs).arg(&ks).arg(&vs);
        match &tables {
            Some((cos, sin)) => args.arg(cos).arg(sin),
            // With r = 0 the kernel reads no table.
            None => args.arg(&qs).arg(&qs),
        };
        let slot_at = slot_at.map(|(s, l)| view::<u32>(s, l)).transpose()?;
        args.arg(&mut out).arg(&buffers[0]).arg(&buffers[1]);
        match &slot_at {
            Some(slot) => args.arg(slot),
            None => args.arg(&NULL),
        };
        args.arg(&a);
        let rows = b as i32;
        let cfg = match wide {
            true => {
                args.arg(&rows);
                by_eight(b * (a.h + a.h_kv) as usize * a.d as usize)
            }
            false => LaunchConfig {
                grid_dim: ((a.h + a.h_kv) as u32, b as u32, 1),
                block_dim: ((a.d as u32).div_ceil(32) * 32, 1, 1),
                shared_mem_bytes: 0,
            },
        };
        // Safety: the argument list matches the kernel's signature; the
        // buffers' addresses stay allocated (locked) until the launch is
        // queued, and the kernel writes only slot `a.slot` of each head.
        unsafe { args.launch(cfg) }.w()?;
        drop(writes);
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let dtype = q.0.dtype();
    by_dtype!(dtype, run(&typed("rotary_append", dtype)?, (q, k, v), tables, cache, slot_at, b, a))
}

/// The attention kernels' sizes, as `AttnDims` in `kernels.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub h: i32,
    pub h_kv: i32,
    pub t: i32,
    pub s: i32,
    pub d: i32,
    /// Elements between consecutive key/value heads.
    pub kv_stride: i64,
    pub scale: f32,
    /// Elements between the output's consecutive queries and heads, and its
    /// gradient's ([`OutRows`]).
    pub o_row: i64,
    pub o_head: i64,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for AttnDims {}

impl AttnDims {
    /// Heads h (q) and h_kv, queries t, keys s and head size d, keys and
    /// values `kv_stride` elements a head apart; the output by head.
    pub fn new([h, h_kv, t, s, d]: [usize; 5], kv_stride: usize, scale: f32) -> Self {
        let [h, h_kv, t, s, d] = [h, h_kv, t, s, d].map(|x| x as i32);
        Self { h, h_kv, t, s, d, kv_stride: kv_stride as i64, scale, o_row: 0, o_head: 0 }.out_rows(OutRows::ByHead)
    }

    /// The same with the output and its gradient laid out as `rows`.
    pub(super) fn out_rows(self, rows: OutRows) -> Self {
        let (h, t, d) = (self.h as i64, self.t as i64, self.d as i64);
        let (o_row, o_head) = match rows {
            OutRows::ByHead => (d, t * d),
            OutRows::ByToken => (h * d, d),
        };
        Self { o_row, o_head, ..self }
    }

    fn by_head(&self) -> bool {
        let by_head = self.out_rows(OutRows::ByHead);
        (self.o_row, self.o_head) == (by_head.o_row, by_head.o_head)
    }
}

/// The three attention passes: the forward, d q, and d k with d v.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Queries,
    Keys,
}

/// The WMMA kernels' tiles by head size, as `ATTENTION_TC` in
/// `kernels.cu` instantiates them: (warps, the other side's tile) of the
/// forward and d q kernels, then of the d k, d v kernel.
fn tensor_tiles(d: usize) -> Option<[(usize, usize); 2]> {
    match d {
        64 | 128 => Some([(4, 64), (4, 64)]),
        256 => Some([(4, 32), (2, 32)]),
        _ => None,
    }
}

/// The register-resident kernels' tiles by head size, as `fa::Tiles` in
/// `flash.cuh`: the key tile of the forward and d q kernels, the query tile
/// of the d k, d v kernel, and whether that one gives d k and d v blocks of
/// their own. Blocks are four warps over 64 rows.
fn flash_tiles(d: usize) -> Option<(usize, usize, bool)> {
    match d {
        64 => Some((64, 64, false)),
        128 => Some((64, 32, false)),
        256 => Some((32, 16, true)),
        _ => None,
    }
}

/// Whether the tensor-core attention kernels take head size `d`.
pub fn tensor_attention_fits(d: usize) -> bool {
    tensor_tiles(d).is_some()
}

/// The shared memory a WMMA kernel lays out: `fwd_bytes`, `bwd_q_bytes`
/// and `bwd_kv_bytes` in `kernels.cu`.
fn tensor_bytes(pass: Pass, d: usize, warps: usize, tile: usize) -> usize {
    let (ld_bf, ld_f) = (|c: usize| c + 8, |c: usize| c + 4);
    let rows = 16 * warps;
    match pass {
        Pass::Forward => {
            2 * (rows + 2 * tile) * ld_bf(d) + 8 * rows * ld_f(tile) + 2 * rows * ld_bf(tile) + 4 * rows * ld_f(d)
        }
        Pass::Queries => {
            2 * (2 * rows + 2 * tile) * ld_bf(d) + 12 * rows * ld_f(tile) + 2 * rows * ld_bf(tile) + 4 * rows * ld_f(d)
        }
        Pass::Keys => {
            2 * (2 * rows + 2 * tile) * ld_bf(d)
                + 12 * rows * ld_f(tile)
                + 4 * rows * ld_bf(tile)
                + 8 * rows * ld_f(d)
                + 8 * tile
        }
    }
}

/// The shared memory a register-resident kernel lays out: `fa::fwd_bytes`,
/// `fa::bwd_q_bytes` and `fa::bwd_kv_bytes` in `flash.cuh`.
fn flash_bytes(pass: Pass, d: usize, tile: usize) -> usize {
    let row = 2 * (d + 8);
    match pass {
        Pass::Forward => (64 + 2 * tile) * row,
        Pass::Queries => (2 * 64 + 2 * tile) * row,
        Pass::Keys => (2 * 64 + 2 * tile) * row + 8 * tile,
    }
}

/// The shared memory a flash kernel over spans lays out:
/// `fa::fwd_spans_bytes`, `fa::bwd_q_spans_bytes` and
/// `fa::bwd_kv_spans_bytes` in `flash.cuh` (a span is 16 bytes).
fn flash_spans_bytes(pass: Pass, d: usize, tile: usize) -> usize {
    let row = 2 * (d + 8);
    match pass {
        Pass::Forward => (64 + 4 * tile) * row + 64 * 16,
        Pass::Queries => (2 * 64 + 4 * tile) * row + 64 * 16,
        Pass::Keys => (2 * 64 + 4 * tile) * row + 2 * tile * (8 + 16),
    }
}

/// What masks the attention kernels: the (B, T, S) f32 bias, or each
/// query's runs of keys and each block of 64 keys' queries (u32, as
/// `batch::AttentionSpans` holds them), which the flash kernels over spans read.
#[derive(Clone, Copy)]
pub enum MaskIn<'a> {
    Bias(In<'a>),
    Spans { spans: In<'a>, key_blocks: In<'a> },
}

/// A mask's device views.
enum MaskViews<'a> {
    Bias(CudaView<'a, f32>),
    Spans(CudaView<'a, u32>, CudaView<'a, u32>),
}

impl<'a> MaskIn<'a> {
    fn views(self) -> Result<MaskViews<'a>> {
        Ok(match self {
            MaskIn::Bias(b) => MaskViews::Bias(view(b.0, b.1)?),
            MaskIn::Spans { spans, key_blocks } => {
                MaskViews::Spans(view(spans.0, spans.1)?, view(key_blocks.0, key_blocks.1)?)
            }
        })
    }
}

impl MaskViews<'_> {
    /// The kernel's mask arguments of `pass`: the bias, or the spans (and,
    /// for d k and d v, the key blocks' queries).
    fn args<'b>(&'b self, args: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'b>, pass: Pass) {
        match self {
            MaskViews::Bias(bias) => args.arg(bias),
            MaskViews::Spans(spans, _) if pass != Pass::Keys => args.arg(spans),
            MaskViews::Spans(spans, key_blocks) => args.arg(spans).arg(key_blocks),
        };
    }
}

/// The kernel of `pass` and its launch over `batch` sequences: a tiled one
/// on tensor cores (bf16, a head size of [`tensor_attention_fits`]) unless
/// `kernels` are the rows ones, which take a block per query (or key) row;
/// the flash ones over spans where `spans`.
fn attention_kernel(
    pass: Pass,
    a: &AttnDims,
    batch: usize,
    dtype: DType,
    kernels: AttentionKernels,
    spans: bool,
) -> Result<(String, LaunchConfig)> {
    let (h, h_kv, t, s, d) = (a.h as usize, a.h_kv as usize, a.t as usize, a.s as usize, a.d as usize);
    let stem = match pass {
        Pass::Forward => "fwd",
        Pass::Queries => "bwd_q",
        Pass::Keys => "bwd_kv",
    };
    if spans && kernels != AttentionKernels::Flash {
        candle_core::bail!("attention over spans runs on the flash kernels only, not {kernels:?}")
    }
    if !a.by_head() && kernels != AttentionKernels::Flash {
        candle_core::bail!("an output by token is written by the flash kernels only, not {kernels:?}")
    }
    if kernels == AttentionKernels::Rows {
        let (blocks, floats) = match pass {
            Pass::Forward | Pass::Queries => (batch * h * t, s + 32),
            Pass::Keys => (batch * h_kv * s, 2 * (t + d)),
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (floats * 4) as u32,
        };
        return Ok((typed(&format!("attention_{stem}"), dtype)?, cfg));
    }
    let (Some(tiles), Some(flash), DType::BF16) = (tensor_tiles(d), flash_tiles(d), dtype) else {
        candle_core::bail!("the tensor-core attention takes bf16 and head sizes 64, 128 or 256, not {dtype:?} and {d}")
    };
    let (rows, heads) = match pass {
        Pass::Forward | Pass::Queries => (t, h),
        Pass::Keys => (s, h_kv),
    };
    if kernels == AttentionKernels::Flash {
        let (key_tile, query_tile, split) = flash;
        let (tile, parts) = match pass {
            Pass::Forward | Pass::Queries => (key_tile, 1),
            Pass::Keys => (query_tile, if split { 2 } else { 1 }),
        };
        let (family, bytes) = match spans {
            true => ("fs", flash_spans_bytes(pass, d, tile)),
            false => ("fa", flash_bytes(pass, d, tile)),
        };
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(64) as u32, (batch * heads) as u32, parts),
            block_dim: (128, 1, 1),
            shared_mem_bytes: bytes as u32,
        };
        return Ok((format!("attention_{family}_{stem}_{d}"), cfg));
    }
    let (warps, tile) = match pass {
        Pass::Forward | Pass::Queries => tiles[0],
        Pass::Keys => tiles[1],
    };
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(16 * warps) as u32, (batch * heads) as u32, 1),
        block_dim: (32 * warps as u32, 1, 1),
        shared_mem_bytes: tensor_bytes(pass, d, warps, tile) as u32,
    };
    Ok((format!("attention_tc_{stem}_{d}"), cfg))
}

/// Lets `func` take `cfg`'s shared memory (above the 48 KiB a kernel gets
/// unasked).
fn allow_shared_memory(func: &CudaFunction, cfg: &LaunchConfig) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
    if cfg.shared_mem_bytes > 48 * 1024 {
        let attribute = CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        func.set_attribute(attribute, cfg.shared_mem_bytes as i32).w()?;
    }
    Ok(())
}

/// (output (B, H, T, D) in q's dtype, log-sum-exp (B, H, T) f32), by the
/// `kernels` given.
pub fn attention_fwd(
    q: In,
    k: In,
    v: In,
    mask: MaskIn,
    a: AttnDims,
    kernels: AttentionKernels,
) -> Result<(CudaStorage, CudaStorage)> {
    fn run<T: CudaDType + DeviceRepr>(
        q: In,
        k: In,
        v: In,
        mask: MaskIn,
        a: AttnDims,
        kernels: AttentionKernels,
    ) -> Result<(CudaStorage, CudaStorage)> {
        let dev = q.0.device.clone();
        let qs = view::<T>(q.0, q.1)?;
        let (ks, vs) = (from_first::<T>(k)?, from_first::<T>(v)?);
        let rows = qs.len() / a.d as usize;
        let spans = matches!(mask, MaskIn::Spans { .. });
        let batch = rows / (a.h * a.t) as usize;
        let (name, cfg) = attention_kernel(Pass::Forward, &a, batch, q.0.dtype(), kernels, spans)?;
        // Safety: every element is written by the kernel.
        let (mut out, mut lse) = unsafe { (dev.alloc::<T>(qs.len())?, dev.alloc::<f32>(rows)?) };
        let func = kernel!(dev, &name)?;
        allow_shared_memory(&func, &cfg)?;
        let masks = mask.views()?;
        let mut args = func.builder();
        args.arg(&qs).arg(&ks).arg(&vs);
        masks.args(&mut args, Pass::Forward);
        args.arg(&mut out).arg(&mut lse).arg(&a);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), CudaStorage::wrap_cuda_slice(lse, dev)))
    }
    by_dtype!(q.0.dtype(), run(q, k, v, mask, a, kernels))
}

/// Everything the attention backward kernels read.
pub struct AttnInputs<'a> {
    pub q: In<'a>,
    pub k: In<'a>,
    pub v: In<'a>,
    pub mask: MaskIn<'a>,
    pub lse: In<'a>,
    pub grad: In<'a>,
    pub di: In<'a>,
}

/// d q (B, H, T, D), or d k and d v stacked (2, B, Hkv, S, D) (`keys`), by
/// the `kernels` given.
pub fn attention_bwd(x: &AttnInputs, a: AttnDims, keys: bool, kernels: AttentionKernels) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr>(
        x: &AttnInputs,
        a: AttnDims,
        keys: bool,
        kernels: AttentionKernels,
    ) -> Result<CudaStorage> {
        let dev = x.q.0.device.clone();
        let qs = view::<T>(x.q.0, x.q.1)?;
        let (ks, vs) = (from_first::<T>(x.k)?, from_first::<T>(x.v)?);
        let (masks, ls, gs, ds) = (
            x.mask.views()?,
            view::<f32>(x.lse.0, x.lse.1)?,
            view::<T>(x.grad.0, x.grad.1)?,
            view::<f32>(x.di.0, x.di.1)?,
        );
        let (b, d) = (qs.len() / (a.h * a.t * a.d) as usize, a.d as usize);
        let (pass, len) = match keys {
            true => (Pass::Keys, 2 * b * (a.h_kv * a.s) as usize * d),
            false => (Pass::Queries, qs.len()),
        };
        let spans = matches!(x.mask, MaskIn::Spans { .. });
        let (name, cfg) = attention_kernel(pass, &a, b, x.q.0.dtype(), kernels, spans)?;
        // Safety: every element is written by the kernel.
        let mut out = unsafe { dev.alloc::<T>(len) }?;
        let func = kernel!(dev, &name)?;
        allow_shared_memory(&func, &cfg)?;
        let mut args = func.builder();
        args.arg(&qs).arg(&ks).arg(&vs);
        masks.args(&mut args, pass);
        args.arg(&ls).arg(&gs).arg(&ds).arg(&mut out).arg(&a);
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    by_dtype!(x.q.0.dtype(), run(x, a, keys, kernels))
}

/// `x @ w^T + b` in bf16 for x (rows, k) contiguous, w (n, k) row-major or
/// the transposed view of a row-major (k, n), and b (n,): one cuBLASLt
/// product that adds the bias in its epilogue, where cuBLAS's product and
/// [`bias_rows`] are two launches and a round trip of the output through
/// memory. `tuned`: see [`gemm`].
pub fn linear_bias_epilogue(
    x: In,
    w: In,
    b: In,
    (rows, k, n): (usize, usize, usize),
    tuned: bool,
) -> Result<CudaStorage> {
    let dev = x.0.device.clone();
    // Safety: the product writes every element.
    let mut out = unsafe { dev.alloc::<bf16>(rows * n) }?;
    gemm::product(x, w, Some(b), &mut out, (rows, k, n), (1.0, 0.0), tuned)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `y += scale * down @ b^T` in bf16, in place, for y (rows, n) and down
/// (rows, r) contiguous and b (n, r) row-major: a LoRA adapter's part added
/// into its base layer's output by the product itself (cuBLASLt reads y as
/// its C), where a scaling, a product and an addition took three launches
/// and two tensors of y's size. `tuned`: see [`gemm`].
pub fn add_product(
    y: &mut CudaStorage,
    down: In,
    b: In,
    scale: f32,
    (rows, r, n): (usize, usize, usize),
    tuned: bool,
) -> Result<()> {
    gemm::product(down, b, None, y.as_cuda_slice_mut::<bf16>()?, (rows, r, n), (scale, 1.0), tuned)
}

/// The device's multiprocessors, asked of the driver once per device.
fn multiprocessors(dev: &candle_core::CudaDevice) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    use candle_core::cuda_backend::DeviceId;
    use std::sync::Mutex;
    static KNOWN: Mutex<Vec<(DeviceId, usize)>> = Mutex::new(Vec::new());
    if let Some((_, n)) = KNOWN.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(id, _)| *id == dev.id()) {
        return Ok(*n);
    }
    let context = dev.cuda_stream().context().clone();
    let n = context.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()? as usize;
    KNOWN.lock().unwrap_or_else(|e| e.into_inner()).push((dev.id(), n));
    Ok(n)
}

/// The sizes of a product of [`rows_product`], as `RowsGemmDims` in `rows_gemm.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RowsGemmDims {
    m: i32,
    n: i32,
    k: i32,
    splits: i32,
    /// The activation of x (`Activation`'s order), -1 for none.
    act: i32,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for RowsGemmDims {}

/// A block's tile of the rows kernel (rows, outputs), its chunk of k, and
/// its shared memory (three stages of both tiles' chunks, rows padded by 8).
const ROWS_TILE: (usize, usize) = (128, 64);
const ROWS_CHUNK: usize = 32;
const ROWS_SMEM: usize = 3 * (ROWS_TILE.0 + ROWS_TILE.1) * (ROWS_CHUNK + 8) * 2;
/// The fewest chunks of k a slice takes.
const ROWS_SLICE_CHUNKS: usize = 4;

/// The slices of k [`rows_product`] takes `x (rows, k) @ w^T` in, or None
/// where it does not take it: operands not bf16, rows not on 16 bytes, w
/// not a row-major (n, k), or more tiles than the GPU has multiprocessors
/// (a large product, which cuBLAS's large tiles serve better: the rows
/// kernel's small ones read x again for every 64 outputs).
pub fn rows_splits(x: In, w: In, (rows, k, n): (usize, usize, usize)) -> Result<Option<usize>> {
    let bf16 = x.0.dtype() == DType::BF16 && w.0.dtype() == DType::BF16;
    let row_major = w.1.is_contiguous() && w.1.dims() == [n, k];
    if !(bf16 && row_major && k.is_multiple_of(8) && on_16(x) && on_16(w)) || rows == 0 || n == 0 {
        return Ok(None);
    }
    let tiles = rows.div_ceil(ROWS_TILE.0) * n.div_ceil(ROWS_TILE.1);
    let multiprocessors = multiprocessors(&x.0.device)?;
    if tiles > multiprocessors {
        return Ok(None);
    }
    // Slices enough for a block on every multiprocessor, each of a few chunks.
    let most = (k.div_ceil(ROWS_CHUNK) / ROWS_SLICE_CHUNKS).max(1);
    Ok(Some(multiprocessors.div_ceil(tiles).min(most)))
}

/// `act(x) (rows, k) @ w^T (+ b)` (x itself without `act`) in bf16 by the
/// rows kernel (`rows_gemm.cuh`), for x contiguous, w a row-major (n, k)
/// and b (n,); None where [`rows_splits`] says it does not take the product.
pub fn rows_product(
    x: In,
    act: Option<crate::model::ops::Activation>,
    w: In,
    b: Option<In>,
    (rows, k, n): (usize, usize, usize),
) -> Result<Option<CudaStorage>> {
    let Some(splits) = rows_splits(x, w, (rows, k, n))? else { return Ok(None) };
    if b.is_some_and(|b| b.0.dtype() != DType::BF16) {
        return Ok(None);
    }
    let dev = x.0.device.clone();
    let (xs, weights) = (view::<bf16>(x.0, x.1)?, view::<bf16>(w.0, w.1)?);
    let bs = b.map(|(b, b_l)| view::<bf16>(b, b_l)).transpose()?;
    let grid = (rows.div_ceil(ROWS_TILE.0), n.div_ceil(ROWS_TILE.1));
    // Safety: the kernel writes every element of y; it reads only the sums
    // its blocks wrote of the workspace.
    let mut y = unsafe { dev.alloc::<bf16>(rows * n) }?;
    let mut sums = unsafe { dev.alloc::<f32>(if splits > 1 { splits * rows * n } else { 1 }) }?;
    let mut counts = dev.alloc_zeros::<u32>(grid.0 * grid.1)?;
    let cfg = LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, splits as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: ROWS_SMEM as u32,
    };
    let func = kernel!(dev, "rows_gemm_bf16")?;
    allow_shared_memory(&func, &cfg)?;
    let act = act.map_or(-1, |a| a as i32);
    let dims = RowsGemmDims { m: rows as i32, n: n as i32, k: k as i32, splits: splits as i32, act };
    let mut args = func.builder();
    args.arg(&xs).arg(&weights);
    match &bs {
        Some(b) => args.arg(b),
        None => args.arg(&NULL),
    };
    args.arg(&mut y).arg(&mut sums).arg(&mut counts).arg(&dims);
    // Safety: the argument list matches the kernel's signature.
    unsafe { args.launch(cfg) }.w()?;
    Ok(Some(CudaStorage::wrap_cuda_slice(y, dev)))
}

/// The sizes and strides of [`decode_attention`], as `DecodeDims` in
/// `kernels.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DecodeDims {
    pub h: i32,
    pub h_kv: i32,
    pub d: i32,
    /// Shared slots in front of each row's own (0 when none).
    pub p: i32,
    pub s_own: i32,
    /// The key mask's row stride, at least p + s_own.
    pub mask_row: i64,
    pub own_row: i64,
    pub own_head: i64,
    pub shared_row: i64,
    pub shared_head: i64,
    pub scale: f32,
    /// Slots per split of the keys, 0 when they are not split.
    pub chunk: i32,
}

// Safety: a plain C struct of numbers, passed by value.
unsafe impl DeviceRepr for DecodeDims {}

/// What a block of the decoding kernel with a lane per key takes: query
/// heads of one key/value head, and rows that continue one shared row; and
/// whether it reads value rows packed into loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LanesBlock {
    pub heads: u32,
    pub rows: u32,
    pub packed: bool,
}

/// The blocks of the decoding kernel that [`decode_attention`] launches
/// (for `dtype`, `d` and `lanes`) which the GPU runs at once: its
/// multiprocessors times the blocks each holds, by the kernel's registers
/// and shared memory. Asked of the driver once per device and kernel, not
/// at every layer of every step.
pub fn decode_blocks_at_once(
    dev: &candle_core::CudaDevice,
    dtype: DType,
    d: usize,
    lanes: Option<LanesBlock>,
) -> Result<usize> {
    use candle_core::cuda_backend::DeviceId;
    use std::sync::Mutex;
    static AT_ONCE: Mutex<Vec<((DeviceId, String), usize)>> = Mutex::new(Vec::new());
    let key = (dev.id(), decode_kernel(dtype, d, lanes)?);
    if let Some((_, n)) = AT_ONCE.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(k, _)| *k == key) {
        return Ok(*n);
    }
    let func = kernel!(dev, &key.1)?;
    let per_multiprocessor = func.occupancy_max_active_blocks_per_multiprocessor(DECODE_THREADS, 0, None).w()?;
    let n = multiprocessors(dev)? * per_multiprocessor as usize;
    AT_ONCE.lock().unwrap_or_else(|e| e.into_inner()).push((key, n));
    Ok(n)
}

/// The name of [`decode_attention`]'s kernel.
fn decode_kernel(dtype: DType, d: usize, lanes: Option<LanesBlock>) -> Result<String> {
    let name = match lanes {
        // 32 lanes of 1, 2, 4 or 8 features cover the head.
        Some(LanesBlock { heads, rows, packed }) => {
            let values = if packed { "_packed" } else { "" };
            format!("decode_attention_lanes_{}_g{heads}_r{rows}{values}", d.div_ceil(32).next_power_of_two())
        }
        None => format!("decode_attention_{}", d / 32),
    };
    typed(&name, dtype)
}

/// Threads per (row, head) block: `DECODE_WARPS` warps in `kernels.cu`.
const DECODE_THREADS: u32 = 8 * 32;

/// A decoding step's attention (B, H, 1, D) from q, each row's own keys and
/// values (views into the cache's buffers), the shared keys, values and
/// each row's shared row, if any, and the key mask (B, S) f32. With
/// `slot_at`, (1,) u32, each row's own slots are the first `slot_at + 1`
/// rather than `a.s_own`. `lanes`: the kernel with a lane per key, taking
/// that many query heads of a key/value head and rows of a prompt per
/// block (else a warp per key, a block per query head). With `splits` > 1 each (row, head)'s keys
/// are split in `a.chunk` slots, a block each, and their parts combined by
/// a second launch.
pub fn decode_attention(
    q: In,
    (k, v): (In, In),
    shared: Option<(In, In, In)>,
    mask: In,
    slot_at: Option<In>,
    (a, splits): (DecodeDims, u32),
    lanes: Option<LanesBlock>,
) -> Result<CudaStorage> {
    #[allow(clippy::too_many_arguments)]
    fn run<T: CudaDType + DeviceRepr>(
        (name, combine): (&str, &str),
        q: In,
        (k, v): (In, In),
        shared: Option<(In, In, In)>,
        mask: In,
        slot_at: Option<In>,
        (a, splits): (DecodeDims, u32),
        queries_per_block: u32,
    ) -> Result<CudaStorage> {
        let dev = q.0.device.clone();
        let qs = view::<T>(q.0, q.1)?;
        let (ks, vs) = (from_first::<T>(k)?, from_first::<T>(v)?);
        let ms = view::<f32>(mask.0, mask.1)?;
        let shared = match shared {
            Some((sk, sv, rows)) => {
                Some((view::<T>(sk.0, sk.1)?, view::<T>(sv.0, sv.1)?, view::<u32>(rows.0, rows.1)?))
            }
            None => None,
        };
        let blocks = (qs.len() / a.d as usize) as u32;
        // Safety: every element is written by the kernels.
        let mut out = unsafe { dev.alloc::<T>(qs.len()) }?;
        let mut parts = match splits > 1 {
            true => Some(unsafe { dev.alloc::<f32>((blocks * splits) as usize * (a.d as usize + 2)) }?),
            false => None,
        };
        let func = kernel!(dev, name)?;
        let mut args = func.builder();
        args.arg(&qs).arg(&ks).arg(&vs);
        match &shared {
            Some((sk, sv, rows)) => args.arg(sk).arg(sv).arg(rows),
            // Without shared slots (p = 0) the kernel reads none of these.
            None => args.arg(&ks).arg(&vs).arg(&ms),
        };
        let slot_at = slot_at.map(|(s, l)| view::<u32>(s, l)).transpose()?;
        args.arg(&ms);
        match &slot_at {
            Some(slot) => args.arg(slot),
            None => args.arg(&NULL),
        };
        args.arg(&mut out);
        match &mut parts {
            Some(parts) => args.arg(parts),
            None => args.arg(&NULL),
        };
        args.arg(&a);
        let grid_dim = (blocks / queries_per_block, splits, 1);
        let cfg = LaunchConfig { grid_dim, block_dim: (DECODE_THREADS, 1, 1), shared_mem_bytes: 0 };
        // Safety: the argument list matches the kernel's signature.
        unsafe { args.launch(cfg) }.w()?;
        if let Some(parts) = &parts {
            let func = kernel!(dev, combine)?;
            let mut args = func.builder();
            let (splits, d) = (splits as i32, a.d);
            args.arg(parts).arg(&splits).arg(&d).arg(&mut out);
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
            // Safety: the argument list matches the kernel's signature.
            unsafe { args.launch(cfg) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    let dtype = q.0.dtype();
    let (name, combine) = (decode_kernel(dtype, a.d as usize, lanes)?, typed("decode_splits", dtype)?);
    let queries_per_block = lanes.map_or(1, |l| l.heads * l.rows);
    by_dtype!(dtype, run((&name, &combine), q, (k, v), shared, mask, slot_at, (a, splits), queries_per_block))
}
