//! Attention's launches over whole sequences: the forward and the two
//! backward passes on the register-resident flash kernels (`flash.cuh`,
//! masked by a bias or by spans), the WMMA ones, or a block a row.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

use super::heads::{heads_split, HeadsDims};
use super::{allow_shared_memory, from_first, typed, view, In};
use crate::model::kernels::sdpa::OutRows;
use crate::model::kernels::AttentionKernels;

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
    pub(in crate::model::kernels) fn out_rows(self, rows: OutRows) -> Self {
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
