//! Attention of one decoding step, every query row over its cache slice
//! read where it lies (the slots it shares with other rows, then its own),
//! with no copies of the cache, no repeated key/value heads and no per-head
//! matmul dispatch: a multi-threaded CPU kernel, and a CUDA kernel on a GPU.
//! Sampling only: neither has a backward, and the training path never
//! calls them.

use candle_core::{Layout, Result, Storage, Tensor};
use rayon::prelude::*;

use super::math::{axpy, dot, exp, max, with_avx2};
use crate::model::cache::{KvCache, LayerKv};
use crate::model::device::variant;

/// Picks how a decoding step attends: `lanes` (the default: the kernels
/// here; on a GPU, a lane per key, any head size of whole 16-byte loads up
/// to 256, else a warp per key), `fused` (the kernels here; on a GPU, a
/// warp per key) or `composed` (the cache copied out whole, then the
/// attention every forward pass uses), to compare them.
pub const DECODE_ATTENTION_VAR: &str = "RLOO_DECODE_ATTENTION";

/// The ways [`DECODE_ATTENTION_VAR`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeAttention {
    /// The kernels, a warp per key on a GPU.
    Fused,
    /// The kernels, a lane per key on a GPU.
    Lanes,
    Composed,
}

/// The way chosen; an unknown choice is an error.
pub fn decode_attention_choice() -> Result<DecodeAttention> {
    match variant(DECODE_ATTENTION_VAR, &["lanes", "fused", "composed"]).map_err(candle_core::Error::msg)? {
        "fused" => Ok(DecodeAttention::Fused),
        "composed" => Ok(DecodeAttention::Composed),
        _ => Ok(DecodeAttention::Lanes),
    }
}

/// Picks how many query heads a block of the kernel with a lane per key
/// takes on a GPU: `grouped` (the default: those of one key/value head, as
/// many as its partial sums allow, so that each key and value read serves
/// them all) or `each` (a block per query head), to compare them.
pub const DECODE_HEADS_VAR: &str = "RLOO_DECODE_HEADS";

/// Whether query heads are grouped; an unknown choice is an error.
pub fn decode_heads_grouped() -> Result<bool> {
    Ok(variant(DECODE_HEADS_VAR, &["grouped", "each"]).map_err(candle_core::Error::msg)? == "grouped")
}

/// Picks how the kernel with a lane per key reads a pass's value rows on a
/// GPU: `packed` (the default: each row in 16-byte pieces over adjacent
/// lanes, as many rows a load as 32 lanes hold, where the head's bytes
/// make a power of two of pieces up to 32) or `rows` (a row a load, each
/// lane its features of it), to compare them. Packed, a decoding step at
/// 256 rows took 3.42 ms where a row a load took 3.80 at Pythia-410m's
/// shape, and 3.81 where it took 4.16 at Pythia-1B's (H200).
pub const DECODE_VALUES_VAR: &str = "RLOO_DECODE_VALUES";

/// Whether value rows are packed into loads; an unknown choice is an error.
pub fn decode_values_packed() -> Result<bool> {
    Ok(variant(DECODE_VALUES_VAR, &["packed", "rows"]).map_err(candle_core::Error::msg)? == "packed")
}

/// Whether a value row of `head_size` elements of `bytes` each splits into
/// 16-byte pieces that a warp's 32 lanes hold a whole number of rows of.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn packs(head_size: usize, bytes: usize) -> bool {
    let row = head_size * bytes;
    row.is_multiple_of(16) && 32 % (row / 16) == 0
}

/// The query heads a block of the kernel with a lane per key takes: the
/// most of 8, 4, 2 or 1 that divides the `group` of query heads sharing a
/// key/value head and whose partial sums fit a block ([`sums_fit`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn heads_per_block(group: usize, head_size: usize) -> usize {
    [8, 4, 2].into_iter().find(|&g| group.is_multiple_of(g) && sums_fit(g, head_size)).unwrap_or(1)
}

/// Whether a block of the kernel with a lane per key holds the partial
/// sums of `queries` queries: queries x 32 lanes x features per lane
/// within 512 floats per warp.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn sums_fit(queries: usize, head_size: usize) -> bool {
    queries * 32 * head_size.div_ceil(32).next_power_of_two() <= 512
}

/// Picks how many rows a block of the kernel with a lane per key takes on
/// a GPU: `each` (a block per row), `prompt` (the rows that continue one
/// shared row, the k completions of a prompt, up to 4 a block, so that each
/// shared key and value read serves them all) or `auto` (the default:
/// `prompt` up to a head size of [`PROMPT_ROWS_UP_TO`], `each` past it), to
/// compare them.
pub const DECODE_ROWS_VAR: &str = "RLOO_DECODE_ROWS";

/// The largest head size whose rows `auto` takes a prompt's to a block: at
/// 64 (Pythia-410m, 4 rows a block) a decoding step took 4.46 ms where a
/// block per row took 5.93; at 256 (Pythia-1B, 2 rows) 8.37 where it took
/// 5.40 (H200, 256 rows). Since the kernel's loads go several at a time,
/// with value rows a load, a prompt's rows took 3.81 and 3.73 ms where a
/// block per row took 3.69 and 4.13: a prompt's rows packed at 256 is
/// still to be measured.
const PROMPT_ROWS_UP_TO: usize = 64;

/// How many rows a block of the kernel with a lane per key takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeRows {
    Each,
    Prompt,
    Auto,
}

impl DecodeRows {
    /// Whether a block takes the rows of a prompt at head size `d`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn by_prompt(self, d: usize) -> bool {
        match self {
            Self::Each => false,
            Self::Prompt => true,
            Self::Auto => d <= PROMPT_ROWS_UP_TO,
        }
    }
}

/// The rows a block takes, as `RLOO_DECODE_ROWS` says; an unknown choice is an error.
pub fn decode_rows() -> Result<DecodeRows> {
    Ok(match variant(DECODE_ROWS_VAR, &["auto", "each", "prompt"]).map_err(candle_core::Error::msg)? {
        "each" => DecodeRows::Each,
        "prompt" => DecodeRows::Prompt,
        _ => DecodeRows::Auto,
    })
}

/// The rows a block of the kernel with a lane per key takes, beside its
/// `heads` query heads: the most of 4 or 2 such that every run of that
/// many rows, from the first, continues one shared row (`shared_rows`, each
/// row's), and the block's partial sums fit ([`sums_fit`]); else 1.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn rows_per_block(shared_rows: &[u32], heads: usize, head_size: usize) -> usize {
    let one_prompt = |r: usize| shared_rows.chunks(r).all(|run| run.len() == r && run.iter().all(|&x| x == run[0]));
    [4, 2].into_iter().find(|&r| sums_fit(r * heads, head_size) && one_prompt(r)).unwrap_or(1)
}

/// Picks whether a decoding step on a GPU splits each (row, head)'s keys
/// over several blocks: `auto` (the default: where a block per (row, head)
/// would leave the GPU idle and the cache is long enough, as with a few
/// rows served over a long context) or `off`, to compare them.
pub const DECODE_SPLIT_VAR: &str = "RLOO_DECODE_SPLIT";

/// Whether keys may be split; an unknown choice is an error.
pub fn decode_split_keys() -> Result<bool> {
    Ok(variant(DECODE_SPLIT_VAR, &["auto", "off"]).map_err(candle_core::Error::msg)? == "auto")
}

/// The fewest slots a split takes: one pass of a block's 8 warps of 32.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const MIN_SPLIT_SLOTS: usize = 256;

/// How a step's `slots` (the most a row can have) are split for `blocks`
/// blocks of (row, heads) on a GPU that runs `at_once` of them at a time:
/// (slots per split, splits), or (0, 1) unsplit. Splits are added until the
/// blocks fill the GPU once, each of at least [`MIN_SPLIT_SLOTS`]; the
/// split depends on the shapes and the kernel alone, so a step gives the
/// same bits every time it runs.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn key_splits(blocks: usize, slots: usize, at_once: usize) -> (usize, usize) {
    let wanted = at_once.div_ceil(blocks.max(1));
    let splits = wanted.min(slots / MIN_SPLIT_SLOTS);
    if splits <= 1 {
        return (0, 1);
    }
    let chunk = slots.div_ceil(splits).next_multiple_of(32);
    (chunk, slots.div_ceil(chunk))
}

/// Picks how a decoding step on a GPU rotates its new queries and keys and
/// writes keys and values to the cache: `fused` (the default: one launch,
/// [`rotary_append_cuda`]) or `composed` (the heads transposed, the rotary
/// kernel, the cache's own writes), to compare the two.
pub const DECODE_APPEND_VAR: &str = "RLOO_DECODE_APPEND";

/// Whether the fused append is chosen; an unknown choice is an error.
pub fn decode_append_fused() -> Result<bool> {
    Ok(variant(DECODE_APPEND_VAR, &["fused", "composed"]).map_err(candle_core::Error::msg)? == "fused")
}

/// A decoding step's rotary and cache append on a GPU, in one launch: q, k
/// and v (B, 1, heads, D) as the projections give them (views of the fused
/// one are read in place), `rotary` the step's (B, 1, 1, R) tables. Writes
/// k rotated, and v, into `layer`'s cache and returns q rotated (B, H, 1,
/// D) with that layer's cache; `None` where the kernel does not run (not
/// on a GPU, another dtype, more than one token, or features not adjacent),
/// and the caller composes the step.
pub fn rotary_append_cuda<'c>(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    rotary: Option<&(Tensor, Tensor)>,
    cache: &'c mut KvCache,
    layer: usize,
) -> Result<Option<(Tensor, LayerKv<'c>)>> {
    let adjacent = |t: &Tensor| t.rank() == 4 && t.dim(1).ok() == Some(1) && t.stride().last() == Some(&1);
    if !(adjacent(q) && adjacent(k) && adjacent(v) && super::on_cuda(&[q, k, v])) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    return cuda::rotary_append(q, k, v, rotary, cache, layer).map(Some);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (rotary, cache, layer);
        Ok(None)
    }
}

/// The head sizes the CUDA kernel with a warp per key takes: 32 lanes of 1,
/// 2, 4 or 8 features.
const CUDA_HEAD_SIZES: [usize; 4] = [32, 64, 128, 256];

/// Which CUDA kernel a decoding step attends with, what its blocks take,
/// and whether it may split the keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeKernel {
    /// A lane per key (else a warp per key).
    pub lanes: bool,
    /// A block of the lanes takes the query heads of a key/value head.
    pub grouped_heads: bool,
    /// How many rows a block of the lanes takes.
    pub rows: DecodeRows,
    /// Keys may be split across blocks ([`key_splits`]).
    pub split_keys: bool,
    /// The lanes read value rows packed into loads, where they can ([`packs`]).
    pub packed_values: bool,
}

impl DecodeKernel {
    /// The kernel `lanes` names, its blocks as `RLOO_DECODE_HEADS`,
    /// `RLOO_DECODE_ROWS` and `RLOO_DECODE_SPLIT` cut them and its values
    /// read as `RLOO_DECODE_VALUES` says (read once per pass, not at every
    /// layer).
    pub fn from_env(lanes: bool) -> Result<Self> {
        Ok(Self {
            lanes,
            grouped_heads: decode_heads_grouped()?,
            rows: decode_rows()?,
            split_keys: decode_split_keys()?,
            packed_values: decode_values_packed()?,
        })
    }
}

/// [`decode_attention`] on a GPU, with the key mask (B, S) on the device,
/// by `kernel`; `None` where the CUDA kernel does not run (another device
/// or dtype, another head size, or with a lane per key a cache not laid
/// out in whole 16-byte loads), and the caller composes the attention.
pub fn decode_attention_cuda(
    q: &Tensor,
    kv: &LayerKv,
    key_mask: &Tensor,
    scale: f64,
    kernel: DecodeKernel,
) -> Result<Option<Tensor>> {
    let [_, _, t, d] = *q.dims() else { candle_core::bail!("decode-attention: q must be 4-d") };
    // A cache the lanes cannot read in whole loads goes to a warp per key.
    let kernel = DecodeKernel { lanes: kernel.lanes && d <= 256 && in_whole_loads(kv), ..kernel };
    let takes = kernel.lanes || CUDA_HEAD_SIZES.contains(&d);
    if t != 1 || !takes || !super::on_cuda(&[q, &kv.keys, &kv.values]) {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    return cuda::run(q, kv, key_mask, scale, kernel).map(Some);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (key_mask, scale);
        Ok(None)
    }
}

/// Whether the cache's key and value rows all start on 16 bytes and are
/// whole 16-byte loads long, as the kernel with a lane per key reads them.
fn in_whole_loads(kv: &LayerKv) -> bool {
    let mut views = vec![&kv.keys, &kv.values];
    if let Some(s) = &kv.shared {
        views.extend([s.keys, s.values]);
    }
    views.into_iter().all(|t| {
        let size = t.dtype().size_in_bytes();
        let on_16 = |elements: usize| (elements * size).is_multiple_of(16);
        let l = t.layout();
        match l.stride().split_last() {
            // Rows of contiguous elements: their length and every stride between them.
            Some((1, between)) => {
                on_16(l.start_offset()) && on_16(*l.dims().last().unwrap_or(&0)) && between.iter().all(|&s| on_16(s))
            }
            _ => false,
        }
    })
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::op::BackpropOp;
    use candle_core::{CudaStorage, DType, Layout, Result, Storage, Tensor};

    use super::super::cuda::{self as launch, DecodeDims};
    use crate::model::cache::{KvCache, LayerKv};

    /// The (row, head) strides of a (rows, heads, slots, D) view whose
    /// slots are packed rows of D features.
    fn strides(l: &Layout, d: usize) -> Result<(i64, i64)> {
        match l.stride() {
            [row, head, slot, 1] if *slot == d => Ok((*row as i64, *head as i64)),
            other => candle_core::bail!("decode-attention: a cache view with strides {other:?} (head size {d})"),
        }
    }

    fn on_gpu<'a>(storage: &'a Storage, layout: &'a Layout) -> Result<(&'a CudaStorage, &'a Layout)> {
        match storage {
            Storage::Cuda(s) => Ok((s, layout)),
            _ => candle_core::bail!("decode-attention: an input is not on the GPU"),
        }
    }

    /// [`super::rotary_append_cuda`] once it has checked the inputs.
    pub fn rotary_append<'c>(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rotary: Option<&(Tensor, Tensor)>,
        cache: &'c mut KvCache,
        layer: usize,
    ) -> Result<(Tensor, LayerKv<'c>)> {
        let (b, _, h, d) = q.dims4()?;
        let h_kv = k.dim(2)?;
        if k.dims4()? != (b, 1, h_kv, d) || v.dims4()? != (b, 1, h_kv, d) {
            candle_core::bail!("rotary-append: q {:?}, k {:?}, v {:?}", q.dims(), k.dims(), v.dims());
        }
        let table = |t: &Tensor| -> Result<Tensor> { t.to_dtype(DType::F32)?.contiguous() };
        let tables = match rotary {
            Some((cos, sin)) => Some((table(cos)?, table(sin)?)),
            None => None,
        };
        let r = match &tables {
            Some((cos, _)) => cos.dim(candle_core::D::Minus1)?,
            None => 0,
        };
        if tables.as_ref().is_some_and(|(cos, _)| cos.elem_count() != b * r) || r > d {
            candle_core::bail!("rotary-append: tables of {r} features for {b} rows of {d}");
        }
        let (k_buf, v_buf, slot) = cache.make_room(layer, (b, h_kv, 1, d), q.dtype(), q.device())?;
        let strides = |t: &Tensor| (t.stride()[0] as i64, t.stride()[2] as i64);
        let ((q_row, q_head), (k_row, k_head), (v_row, v_head)) = (strides(q), strides(k), strides(v));
        let dims = launch::AppendDims {
            q_row,
            q_head,
            k_row,
            k_head,
            v_row,
            v_head,
            h: h as i32,
            h_kv: h_kv as i32,
            d: d as i32,
            r: r as i32,
            capacity: k_buf.dim(2)? as i32,
            slot: slot as i32,
        };
        let (q_g, k_g, v_g) = (q.storage_and_layout(), k.storage_and_layout(), v.storage_and_layout());
        let table_g = tables.as_ref().map(|(cos, sin)| (cos.storage_and_layout(), sin.storage_and_layout()));
        let tables = match &table_g {
            Some((cos, sin)) => Some((on_gpu(&cos.0, cos.1)?, on_gpu(&sin.0, sin.1)?)),
            None => None,
        };
        let slot_g = cache.slot_at().map(Tensor::storage_and_layout);
        let slot_at = match &slot_g {
            Some((s, l)) => Some(on_gpu(s, l)?),
            None => None,
        };
        let out = launch::rotary_append(
            (on_gpu(&q_g.0, q_g.1)?, on_gpu(&k_g.0, k_g.1)?, on_gpu(&v_g.0, v_g.1)?),
            tables,
            (&k_buf, &v_buf),
            slot_at,
            b,
            dims,
        )?;
        let q = Tensor::from_storage(Storage::Cuda(out), (b, h, 1, d), BackpropOp::none(), false);
        Ok((q, cache.layer(layer, slot + 1)?))
    }

    /// [`super::decode_attention_cuda`] once it has checked the inputs;
    /// with `kernel.split_keys` the keys split where [`super::key_splits`]
    /// says.
    pub fn run(q: &Tensor, kv: &LayerKv, key_mask: &Tensor, scale: f64, kernel: super::DecodeKernel) -> Result<Tensor> {
        let q = q.contiguous()?;
        let mask = key_mask.to_dtype(DType::F32)?.contiguous()?;
        let (b, h, _, d) = q.dims4()?;
        let (_, h_kv, s_own, _) = kv.keys.dims4()?;
        let (own_row, own_head) = strides(kv.keys.layout(), d)?;
        if strides(kv.values.layout(), d)? != (own_row, own_head) {
            candle_core::bail!("decode-attention: keys and values are laid out differently");
        }
        let (shared_row, shared_head, p) = match &kv.shared {
            Some(s) => {
                let (row, head) = strides(s.keys.layout(), d)?;
                if strides(s.values.layout(), d)? != (row, head) {
                    candle_core::bail!("decode-attention: shared keys and values are laid out differently");
                }
                (row, head, s.keys.dim(2)?)
            }
            None => (0, 0, 0),
        };
        // A cache with fixed slots gives a mask over all of them: each row's first p + s_own apply.
        let (mask_rows, mask_row) = mask.dims2()?;
        if mask_rows != b || mask_row < p + s_own {
            candle_core::bail!("decode-attention: key mask {:?} for {b} rows of {} slots", mask.dims(), p + s_own);
        }
        // With fixed slots a replayed step may read up to every one of them.
        let slots = match kv.slot_at {
            Some(_) => mask_row,
            None => p + s_own,
        };
        let heads_per_block = match (kernel.lanes, kernel.grouped_heads) {
            (true, true) => super::heads_per_block(h / h_kv, d),
            _ => 1,
        };
        let rows_per_block = match (kernel.lanes && kernel.rows.by_prompt(d), &kv.shared) {
            (true, Some(shared)) => super::rows_per_block(shared.rows, heads_per_block, d),
            _ => 1,
        };
        let packed = kernel.packed_values && super::packs(d, q.dtype().size_in_bytes());
        let lanes = kernel.lanes.then_some(launch::LanesBlock {
            heads: heads_per_block as u32,
            rows: rows_per_block as u32,
            packed,
        });
        // Fewer slots than two splits take: no split, and no occupancy query in the step.
        let (chunk, splits) = match kernel.split_keys && slots >= 2 * super::MIN_SPLIT_SLOTS {
            true => {
                let at_once = launch::decode_blocks_at_once(q.device().as_cuda_device()?, q.dtype(), d, lanes)?;
                super::key_splits(b * h / (heads_per_block * rows_per_block), slots, at_once)
            }
            false => (0, 1),
        };
        let dims = DecodeDims {
            h: h as i32,
            h_kv: h_kv as i32,
            d: d as i32,
            p: p as i32,
            s_own: s_own as i32,
            mask_row: mask_row as i64,
            own_row,
            own_head,
            shared_row,
            shared_head,
            scale: scale as f32,
            chunk: chunk as i32,
        };
        let (q_g, k_g, v_g, m_g) = (
            q.storage_and_layout(),
            kv.keys.storage_and_layout(),
            kv.values.storage_and_layout(),
            mask.storage_and_layout(),
        );
        let shared_g = kv
            .shared
            .as_ref()
            .map(|s| (s.keys.storage_and_layout(), s.values.storage_and_layout(), s.device_rows.storage_and_layout()));
        let shared = match &shared_g {
            Some((k, v, rows)) => Some((on_gpu(&k.0, k.1)?, on_gpu(&v.0, v.1)?, on_gpu(&rows.0, rows.1)?)),
            None => None,
        };
        let slot_g = kv.slot_at.map(Tensor::storage_and_layout);
        let slot_at = match &slot_g {
            Some((s, l)) => Some(on_gpu(s, l)?),
            None => None,
        };
        let out = launch::decode_attention(
            on_gpu(&q_g.0, q_g.1)?,
            (on_gpu(&k_g.0, k_g.1)?, on_gpu(&v_g.0, v_g.1)?),
            shared,
            on_gpu(&m_g.0, m_g.1)?,
            slot_at,
            (dims, splits as u32),
            lanes,
        )?;
        Ok(Tensor::from_storage(Storage::Cuda(out), (b, h, 1, d), BackpropOp::none(), false))
    }
}

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
    // A cache with fixed slots gives a mask over all of them: each row's first s apply.
    let mask_row = key_mask.len() / b.max(1);
    if mask_row < s || key_mask.len() != b * mask_row {
        candle_core::bail!("decode-attention: a key mask of {} entries for {b} rows of {s} slots", key_mask.len());
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
                mask: &key_mask[bi * mask_row..bi * mask_row + s],
            };
            #[cfg(target_arch = "x86_64")]
            if simd::available() {
                // Safety: the CPU has AVX2 and FMA.
                match d {
                    32 => return unsafe { simd::attend::<4>(&head, scale, scores, out) },
                    64 => return unsafe { simd::attend::<8>(&head, scale, scores, out) },
                    128 => return unsafe { simd::attend::<16>(&head, scale, scores, out) },
                    _ => {}
                }
            }
            with_avx2(
                #[inline(always)]
                || head.attend(d, scale, scores, out),
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
        let inv_total = 1.0 / exp_in_place(scores, top);
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

/// Replaces each score by e^(score - top) (0 for masked keys, at -inf) and
/// returns their sum, over eight partial sums so that the loop vectorises.
#[inline(always)]
fn exp_in_place(scores: &mut [f32], top: f32) -> f32 {
    let mut totals = [0f32; 8];
    for block in scores.chunks_mut(8) {
        for (score, total) in block.iter_mut().zip(&mut totals) {
            *score = exp(*score - top);
            *total += *score;
        }
    }
    totals.iter().sum()
}

/// The head sizes of real models (32, 64, 128) in AVX2 and FMA registers.
/// Plain Rust leaves each key's dot product as a chain of unfused
/// multiplies and adds with a horizontal sum; here eight keys' products
/// are summed across lanes together, and the output stays in registers.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::super::math::max;
    use super::{exp_in_place, Head};

    pub fn available() -> bool {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }

    /// [`Head::attend`] for head size 8 N.
    ///
    /// Safety: the CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn attend<const N: usize>(head: &Head, scale: f32, scores: &mut [f32], out: &mut [f32]) {
        let d = 8 * N;
        let q: [__m256; N] = std::array::from_fn(|n| _mm256_mul_ps(load(&head.q[8 * n..]), _mm256_set1_ps(scale)));
        let dot = |k: &[f32]| -> __m256 {
            let mut acc = _mm256_mul_ps(q[0], load(k));
            for n in 1..N {
                acc = _mm256_fmadd_ps(q[n], load(&k[8 * n..]), acc);
            }
            acc
        };
        // Scores of every key, masked ones included (they are overwritten).
        let mut j = 0;
        for seg in &head.segments {
            let key = |i: usize| &seg.k[i * seg.k_stride..i * seg.k_stride + d];
            let mut i = 0;
            while i + 8 <= seg.len {
                let sums: [__m256; 8] = std::array::from_fn(|r| dot(key(i + r)));
                scores[j..j + 8].copy_from_slice(&sum_lanes(sums));
                (i, j) = (i + 8, j + 8);
            }
            for i in i..seg.len {
                let lanes: [f32; 8] = std::mem::transmute(dot(key(i)));
                scores[j] = lanes.iter().sum();
                j += 1;
            }
        }
        let scores = &mut scores[..j];
        for (score, &m) in scores.iter_mut().zip(head.mask) {
            *score = if m == 0.0 { f32::NEG_INFINITY } else { *score };
        }
        let top = max(scores);
        if top == f32::NEG_INFINITY {
            return; // no real key (cannot happen for a real token): output 0
        }
        let total = exp_in_place(scores, top);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut weights = scores.iter();
        for seg in &head.segments {
            for (i, &p) in (0..seg.len).zip(&mut weights) {
                if p != 0.0 {
                    let (v, p) = (&seg.v[i * seg.v_stride..i * seg.v_stride + d], _mm256_set1_ps(p));
                    for n in 0..N {
                        acc[n] = _mm256_fmadd_ps(p, load(&v[8 * n..]), acc[n]);
                    }
                }
            }
        }
        let inv_total = _mm256_set1_ps(1.0 / total);
        for n in 0..N {
            _mm256_storeu_ps(out[8 * n..8 * n + 8].as_mut_ptr(), _mm256_mul_ps(acc[n], inv_total));
        }
    }

    /// The first eight lanes of `x`.
    #[inline(always)]
    unsafe fn load(x: &[f32]) -> __m256 {
        _mm256_loadu_ps(x[..8].as_ptr())
    }

    /// Lane r of the result is the sum of the lanes of `v[r]`.
    #[inline(always)]
    unsafe fn sum_lanes(v: [__m256; 8]) -> [f32; 8] {
        // Pairwise sums within 128-bit halves, then the two halves added.
        let a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
        let b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
        let low = _mm256_permute2f128_ps(a, b, 0x20);
        let high = _mm256_permute2f128_ps(a, b, 0x31);
        std::mem::transmute(_mm256_add_ps(low, high))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cache::SharedKv;
    use crate::model::kernels::test_randn;
    use crate::model::ops;
    use candle_core::{DType, Device};

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
    fn a_block_takes_the_query_heads_of_a_key_value_head_that_fit() {
        // Pythia: no grouped heads. Qwen3-8B: 4 of 128 features. Llama-3-70B: 8 of 128, 4 fit.
        assert_eq!((heads_per_block(1, 64), heads_per_block(4, 128), heads_per_block(8, 128)), (1, 4, 4));
        // Qwen2.5-7B's 7 query heads a key/value head share no power of two; 6 do.
        assert_eq!((heads_per_block(7, 128), heads_per_block(6, 128)), (1, 2));
        // The widest heads fit two; the narrowest eight.
        assert_eq!((heads_per_block(8, 256), heads_per_block(16, 8)), (2, 8));
    }

    #[test]
    fn a_block_takes_the_rows_of_a_prompt_that_fit() {
        // 64 prompts x 4 at head size 64 (Pythia-410m), and at 256 (Pythia-1B): 4 rows, then 2.
        let by_four: Vec<u32> = (0..256).map(|r| r / 4).collect();
        assert_eq!((rows_per_block(&by_four, 1, 64), rows_per_block(&by_four, 1, 256)), (4, 2));
        // k = 8 takes 4; grouped heads leave room for fewer rows, or none.
        let by_eight: Vec<u32> = (0..64).map(|r| r / 8).collect();
        assert_eq!((rows_per_block(&by_eight, 2, 64), rows_per_block(&by_eight, 4, 128)), (4, 1));
        // Runs that do not start at a multiple, or a last run cut short, take 2 or 1.
        assert_eq!(rows_per_block(&[0, 0, 1, 1, 1, 1, 2, 2], 1, 64), 2);
        assert_eq!(rows_per_block(&[0, 0, 0, 0, 1, 1], 1, 64), 2);
        assert_eq!(rows_per_block(&[0, 1, 1, 0, 1, 0], 1, 64), 1);
        assert_eq!(rows_per_block(&[0, 0, 0], 1, 64), 1);
    }

    #[test]
    fn value_rows_pack_where_their_pieces_divide_a_warp() {
        // bf16 rows of 8 to 256 features: 1 to 32 pieces of 16 bytes; f32 up to 128.
        assert!([8, 16, 64, 128, 256].iter().all(|&d| packs(d, 2)));
        assert!(packs(128, 4) && !packs(256, 4));
        // 40 and 96 features of bf16 make 5 and 12 pieces; 4 make half of one.
        assert!(!packs(40, 2) && !packs(96, 2) && !packs(4, 2));
    }

    #[test]
    fn keys_are_split_only_where_the_blocks_do_not_fill_the_gpu() {
        // An H100's 132 multiprocessors, 5 blocks of a key per lane each (51 registers a thread).
        let at_once = 132 * 5;
        // The benchmark's batch: 256 rows x 16 heads fill them.
        assert_eq!(key_splits(256 * 16, 320, at_once), (0, 1));
        // One row of 16 heads over 4,096 slots: 16 splits of 256.
        assert_eq!(key_splits(16, 4096, at_once), (256, 16));
        // 8 rows of 32 heads over 3,000 slots: 3 splits (660 / 256 blocks), whole warps of slots.
        assert_eq!(key_splits(8 * 32, 3000, at_once), (1024, 3));
        // Too few slots for two splits of 256.
        assert_eq!(key_splits(16, 511, at_once), (0, 1));
        // The splits cover every slot, none empty.
        for (blocks, slots) in [(1, 600), (3, 1000), (16, 2049), (64, 100_000)] {
            let (chunk, splits) = key_splits(blocks, slots, at_once);
            assert!(chunk * splits >= slots && chunk * (splits - 1) < slots, "{blocks} {slots}: {chunk} x {splits}");
            assert!(chunk >= MIN_SPLIT_SLOTS && chunk % 32 == 0);
        }
    }

    #[test]
    fn matches_the_composed_attention_on_strided_caches_with_gqa() {
        let (b, h, h_kv, s, cap, d) = (2, 4, 2, 5, 8, 3);
        let q = test_randn(&[b, h, 1, d], 0.0, 1.0);
        // Caches with spare capacity, read through narrow views.
        let k_buf = test_randn(&[b, h_kv, cap, d], 0.0, 1.0);
        let v_buf = test_randn(&[b, h_kv, cap, d], 0.0, 1.0);
        let (keys, values) = (k_buf.narrow(2, 0, s).unwrap(), v_buf.narrow(2, 0, s).unwrap());
        let kv = LayerKv { keys, values, shared: None, slot_at: None };
        let mask = vec![0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0];
        let got = decode_attention(&q, &kv, &mask, 0.5).unwrap();
        let diff = max_diff(&got, &composed(&q, &kv, &mask, 0.5));
        assert!(diff < 1e-5, "{diff}");
    }

    #[test]
    fn rows_read_their_shared_slots_then_their_own() {
        let dev = Device::Cpu;
        // Parts of more and fewer than eight keys, head size 32 (the AVX2 path where there is one).
        let (b, h, h_kv, p, s_own, cap, d) = (3, 4, 2, 11, 9, 12, 32);
        let q = test_randn(&[b, h, 1, d], 0.0, 1.0);
        // Two shared rows, the first left-padded; rows 0 and 2 continue shared row 1.
        let shared_k = test_randn(&[2, h_kv, p, d], 0.0, 1.0);
        let shared_v = test_randn(&[2, h_kv, p, d], 0.0, 1.0);
        let rows = [1u32, 0, 1];
        let device_rows = Tensor::new(&rows, &dev).unwrap();
        let k_buf = test_randn(&[b, h_kv, cap, d], 0.0, 1.0);
        let v_buf = test_randn(&[b, h_kv, cap, d], 0.0, 1.0);
        let kv = LayerKv {
            keys: k_buf.narrow(2, 0, s_own).unwrap(),
            values: v_buf.narrow(2, 0, s_own).unwrap(),
            shared: Some(SharedKv { keys: &shared_k, values: &shared_v, rows: &rows, device_rows: &device_rows }),
            slot_at: None,
        };
        // Row 1's prompt is left-padded by three; row 2's newest slot is padding.
        let s = p + s_own;
        let mask: Vec<f32> = (0..b * s)
            .map(|i| if (i / s == 1 && i % s < 3) || (i / s == 2 && i % s == s - 1) { 0.0 } else { 1.0 })
            .collect();
        let got = decode_attention(&q, &kv, &mask, 0.3).unwrap();
        let diff = max_diff(&got, &composed(&q, &kv, &mask, 0.3));
        assert!(diff < 1e-5, "{diff}");
        // A mask over a fixed cache's every slot (spare ones 1) reads the same.
        let wide: Vec<f32> = mask.chunks(s).flat_map(|row| row.iter().copied().chain([1.0; 3])).collect();
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(decode_attention(&q, &kv, &wide, 0.3).unwrap()), flat(got));
    }

    #[test]
    fn the_lane_kernel_takes_caches_of_whole_16_byte_rows() {
        let dev = Device::Cpu;
        let cache = |d: usize, dtype: DType| Tensor::zeros((2, 2, 6, d), dtype, &dev).unwrap();
        let own = |keys: Tensor, values: Tensor| LayerKv { keys, values, shared: None, slot_at: None };
        let (bf16, f32) = (cache(8, DType::BF16), cache(4, DType::F32));
        // A cache's filled slots, and the slots past a trimmed front.
        assert!(in_whole_loads(&own(bf16.narrow(2, 0, 3).unwrap(), bf16.narrow(2, 0, 3).unwrap())));
        assert!(in_whole_loads(&own(f32.narrow(2, 2, 3).unwrap(), f32.narrow(2, 2, 3).unwrap())));
        // Rows of 12 bytes, a view starting 8 bytes in, rows cut from a wider one.
        let f32_3 = cache(3, DType::F32);
        assert!(!in_whole_loads(&own(f32_3.clone(), f32_3)));
        let flat = Tensor::zeros(2 + 2 * 2 * 6 * 4, DType::F32, &dev).unwrap();
        let shifted = flat.narrow(0, 2, 2 * 2 * 6 * 4).unwrap().reshape((2, 2, 6, 4)).unwrap();
        assert!(!in_whole_loads(&own(shifted, f32.clone())));
        let cut = cache(16, DType::BF16).narrow(3, 4, 8).unwrap();
        assert!(!in_whole_loads(&own(cut, bf16.clone())));
        // A shared part counts too.
        let shared = Tensor::zeros((1, 2, 5, 3), DType::F32, &dev).unwrap();
        let rows = [0u32; 2];
        let device_rows = Tensor::new(&rows, &dev).unwrap();
        let kv = LayerKv {
            keys: f32.clone(),
            values: f32.clone(),
            shared: Some(SharedKv { keys: &shared, values: &shared, rows: &rows, device_rows: &device_rows }),
            slot_at: None,
        };
        assert!(!in_whole_loads(&kv));
    }
}
