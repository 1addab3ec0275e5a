//! The launches that cut a fused q/k/v projection into its heads and join
//! their gradients back (`heads.cuh`), with the rotary embedding, and a
//! decoding step's rotary and cache append in one launch.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, Result};

use super::{addresses, blocks_for, by_eight, from_first, on_16, typed, view, In, NULL};

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
        unsafe { args.launch(blocks_for(n)) }.w()?;
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
        unsafe { args.launch(blocks_for(threads)) }.w()?;
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
