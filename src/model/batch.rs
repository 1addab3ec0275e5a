//! What a forward pass reads: token ids, the padding mask, per-row position
//! ids, and the attention bias they imply.

use candle_core::{DType, Device, Result, Tensor};

use super::cache::KvCache;

/// Which side of a row the padding goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PadSide {
    Left,
    Right,
}

/// One batch of token rows. Positions follow the mask, so a left-padded row
/// starts at position 0 on its first real token (as transformers' `generate`
/// does), and padding never shifts a row's positions.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// (B, T) u32
    pub ids: Tensor,
    /// (B, T) f32: 1 on real tokens, 0 on padding.
    pub mask: Tensor,
    /// (B, T) u32
    pub positions: Tensor,
    /// For rows packed by [`Inputs::shared_prefix`], which part of its row
    /// each token is, (B, T) on the host: 0 for the prompt, c + 1 for
    /// continuation c. A token sees the prompt and the earlier tokens of its
    /// own part only.
    pub segments: Option<Vec<u32>>,
    /// Each row's real tokens as one run `[start, end)`, where every row's
    /// are one (None: unknown, or a row's padding lies between them).
    pub real_runs: Option<Vec<(u32, u32)>>,
}

impl Inputs {
    /// Pads `rows` to one length with `pad_id`; positions are derived from the mask.
    pub fn from_rows(rows: &[Vec<u32>], pad_id: u32, side: PadSide, device: &Device) -> Result<Self> {
        let t = rows.iter().map(Vec::len).max().unwrap_or(0);
        let b = rows.len();
        let mut ids = Vec::with_capacity(b * t);
        let mut mask = Vec::with_capacity(b * t);
        let mut real_runs = Vec::with_capacity(b);
        for row in rows {
            let pad = t - row.len();
            real_runs.push(match side {
                PadSide::Left => (pad as u32, t as u32),
                PadSide::Right => (0, row.len() as u32),
            });
            let (real, fill) = (row.iter().copied(), std::iter::repeat_n(pad_id, pad));
            let (m_real, m_fill) = (std::iter::repeat_n(1f32, row.len()), std::iter::repeat_n(0f32, pad));
            match side {
                PadSide::Left => {
                    ids.extend(fill.chain(real));
                    mask.extend(m_fill.chain(m_real));
                }
                PadSide::Right => {
                    ids.extend(real.chain(fill));
                    mask.extend(m_real.chain(m_fill));
                }
            }
        }
        let positions = positions_from_mask(&mask, b, t);
        Ok(Self {
            ids: Tensor::from_vec(ids, (b, t), device)?,
            mask: Tensor::from_vec(mask, (b, t), device)?,
            positions: Tensor::from_vec(positions, (b, t), device)?,
            segments: None,
            real_runs: Some(real_runs),
        })
    }

    /// One row per prompt: the prompt once, then each of its continuations,
    /// right-padded to one length. Each continuation is positioned as if it
    /// followed the prompt directly and attends to the prompt and to itself
    /// only, so the prompt's tokens are computed once for all of them.
    pub fn shared_prefix(groups: &[SharedPrefix], pad_id: u32, device: &Device) -> Result<Self> {
        let t = groups.iter().map(SharedPrefix::len).max().unwrap_or(0);
        let b = groups.len();
        let (mut ids, mut mask) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        let (mut positions, mut segments) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for g in groups {
            let p = g.prompt.len() as u32;
            ids.extend_from_slice(g.prompt);
            positions.extend(0..p);
            segments.extend(std::iter::repeat_n(0, g.prompt.len()));
            for (c, cont) in g.continuations.iter().enumerate() {
                ids.extend_from_slice(cont);
                positions.extend(p..p + cont.len() as u32);
                segments.extend(std::iter::repeat_n(c as u32 + 1, cont.len()));
            }
            let pad = t - g.len();
            mask.extend(std::iter::repeat_n(1f32, g.len()).chain(std::iter::repeat_n(0f32, pad)));
            ids.extend(std::iter::repeat_n(pad_id, pad));
            positions.extend(std::iter::repeat_n(0, pad));
            segments.extend(std::iter::repeat_n(u32::MAX, pad));
        }
        Ok(Self {
            ids: Tensor::from_vec(ids, (b, t), device)?,
            mask: Tensor::from_vec(mask, (b, t), device)?,
            positions: Tensor::from_vec(positions, (b, t), device)?,
            segments: Some(segments),
            real_runs: None,
        })
    }

    /// A batch from id and mask tensors (any integer or float dtype for the mask).
    pub fn new(ids: &Tensor, mask: &Tensor) -> Result<Self> {
        let (b, t) = ids.dims2()?;
        let mask = mask.to_dtype(DType::F32)?;
        let host: Vec<f32> = mask.flatten_all()?.to_vec1()?;
        let positions = Tensor::from_vec(positions_from_mask(&host, b, t), (b, t), ids.device())?;
        let real_runs = host.chunks(t.max(1)).map(one_run).collect();
        Ok(Self { ids: ids.to_dtype(DType::U32)?, mask, positions, segments: None, real_runs })
    }

    /// One new token per row at the given positions (a decoding step).
    pub fn step(tokens: &[u32], positions: &[u32], device: &Device) -> Result<Self> {
        let b = tokens.len();
        Ok(Self {
            ids: Tensor::from_slice(tokens, (b, 1), device)?,
            mask: Tensor::ones((b, 1), DType::F32, device)?,
            positions: Tensor::from_slice(positions, (b, 1), device)?,
            segments: None,
            real_runs: None,
        })
    }

    pub fn batch_size(&self) -> usize {
        self.ids.dims()[0]
    }

    pub fn seq_len(&self) -> usize {
        self.ids.dims()[1]
    }

    /// Index of each row's last real token, for sequence-classification heads.
    pub fn last_token_index(&self) -> Result<Vec<usize>> {
        let mask: Vec<Vec<f32>> = self.mask.to_vec2()?;
        Ok(mask.iter().map(|row| row.iter().rposition(|&m| m > 0.0).unwrap_or(0)).collect())
    }
}

/// A prompt and the continuations that share it, for [`Inputs::shared_prefix`].
#[derive(Debug, Clone)]
pub struct SharedPrefix<'a> {
    pub prompt: &'a [u32],
    pub continuations: Vec<&'a [u32]>,
}

impl SharedPrefix<'_> {
    /// Tokens in the packed row.
    pub fn len(&self) -> usize {
        self.prompt.len() + self.continuations.iter().map(|c| c.len()).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where continuation `c` starts in the packed row.
    pub fn start(&self, c: usize) -> usize {
        self.prompt.len() + self.continuations[..c].iter().map(|c| c.len()).sum::<usize>()
    }
}

/// A row's real tokens (mask above 0) as one run `[start, end)`, if they are one.
fn one_run(mask: &[f32]) -> Option<(u32, u32)> {
    let start = mask.iter().position(|&m| m > 0.0).unwrap_or(0);
    let end = mask.iter().rposition(|&m| m > 0.0).map_or(start, |e| e + 1);
    mask[start..end].iter().all(|&m| m > 0.0).then_some((start as u32, end as u32))
}

/// `max(cumsum(mask) - 1, 0)` per row.
fn positions_from_mask(mask: &[f32], b: usize, t: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(b * t);
    for row in 0..b {
        let mut seen = 0u32;
        for &m in &mask[row * t..(row + 1) * t] {
            if m > 0.0 {
                seen += 1;
            }
            out.push(seen.saturating_sub(1));
        }
    }
    out
}

/// A large negative number for disallowed attention pairs. Finite, so that a
/// query with no allowed key (a padding position) gives a finite, ignored
/// result instead of NaN.
const MASKED: f64 = -1e30;

/// The key mask (B, S) of a pass over `inputs` after the cache's past
/// slots: the cache's own mask, then the inputs'. The cache keeps it after
/// the forward pass.
pub fn key_mask(inputs: &Inputs, cache: Option<&KvCache>) -> Result<Tensor> {
    if inputs.segments.is_some() && cache.is_some() {
        candle_core::bail!("shared-prefix rows are for whole-sequence passes, not a key/value cache");
    }
    Ok(match cache.and_then(KvCache::key_mask) {
        // Fixed slots: the mask already covers the new ones.
        Some(past) if cache.is_some_and(|c| c.fixed_slot().is_some()) => past.clone(),
        Some(past) => Tensor::cat(&[past, &inputs.mask], 1)?,
        None => inputs.mask.clone(),
    })
}

/// The additive attention bias (B, 1, T, S) of `inputs` under `key_mask`
/// (from [`key_mask`]): a query may see real keys up to its own slot, and
/// a shared-prefix row's query only its prompt and its own part.
pub fn attention_bias(inputs: &Inputs, key_mask: &Tensor) -> Result<Tensor> {
    let (b, t) = inputs.ids.dims2()?;
    match &inputs.segments {
        Some(segments) => shared_prefix_bias(segments, b, t, inputs.ids.device()),
        None => causal_bias(key_mask, t),
    }
}

/// The bias of `t` queries that follow `S - t` past slots, over the (B, S)
/// key mask.
pub fn causal_bias(key_mask: &Tensor, t: usize) -> Result<Tensor> {
    let (b, s) = key_mask.dims2()?;
    let past = s - t;
    // causal (T, S): query i sits at slot past + i.
    let causal: Vec<f32> =
        (0..t).flat_map(|i| (0..s).map(move |j| if j <= past + i { 0.0 } else { MASKED as f32 })).collect();
    let causal = Tensor::from_vec(causal, (1, 1, t, s), key_mask.device())?;
    // (B, S) -> (B, 1, 1, S): 0 for real keys, MASKED for padding.
    let keys = ((key_mask.clone() - 1.0)? * (-MASKED))?.reshape((b, 1, 1, s))?;
    causal.broadcast_add(&keys)
}

/// The (B, 1, T, T) bias of shared-prefix rows: query i sees key j <= i
/// when j is in the prompt or in i's own part (padding is its own part,
/// which no real token shares).
pub(crate) fn shared_prefix_bias(segments: &[u32], b: usize, t: usize, dev: &Device) -> Result<Tensor> {
    let mut bias = Vec::with_capacity(b * t * t);
    for row in segments.chunks(t) {
        for (i, &si) in row.iter().enumerate() {
            bias.extend(row.iter().enumerate().map(
                |(j, &sj)| {
                    if j <= i && (sj == 0 || sj == si) {
                        0.0
                    } else {
                        MASKED as f32
                    }
                },
            ));
        }
    }
    Tensor::from_vec(bias, (b, 1, t, t), dev)
}

/// Keys in a block of [`AttentionSpans::key_blocks`]: the rows of a block
/// of the flash attention's d k, d v kernel.
pub const SPAN_KEY_BLOCK: usize = 64;

/// The keys each query of a whole-sequence pass sees, where they are at
/// most two runs, as the flash attention kernels read them in place of the
/// (B, 1, T, T) bias: a prompt and the query's own part, or one causal run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionSpans {
    /// Per (row, query): the runs `[a0, a1)` and `[b0, b1)`, `[0, 0)` empty.
    pub spans: Vec<[u32; 4]>,
    /// Per (row, block of [`SPAN_KEY_BLOCK`] keys): the queries `[first,
    /// end)` between which lie all that see one of them (`[0, 0)`: none).
    pub key_blocks: Vec<[u32; 2]>,
}

/// The spans of a whole-sequence pass over `inputs` (no cache), which see
/// what [`attention_bias`] lets them: None where a row's real tokens are
/// not one run.
pub fn attention_spans(inputs: &Inputs) -> Option<AttentionSpans> {
    let (b, t) = (inputs.batch_size(), inputs.seq_len());
    let mut spans = Vec::with_capacity(b * t);
    match (&inputs.segments, &inputs.real_runs) {
        (Some(segments), _) => {
            for row in segments.chunks(t.max(1)) {
                // The prompt (part 0) comes first; each other part is one run after it.
                let prompt = row.iter().take_while(|&&s| s == 0).count() as u32;
                let mut start = 0;
                for (i, &s) in row.iter().enumerate() {
                    if i > 0 && s != row[i - 1] {
                        start = i as u32;
                    }
                    let end = i as u32 + 1;
                    spans.push(if s == 0 { [0, end, 0, 0] } else { [0, prompt, start, end] });
                }
            }
        }
        (None, Some(runs)) => {
            for &(first, end) in runs {
                // Causal over the real keys: [first, min(end, i + 1)).
                spans.extend((1..=t as u32).map(|i| match end.min(i) {
                    last if first < last => [first, last, 0, 0],
                    _ => [0; 4],
                }));
            }
        }
        (None, None) => return None,
    }
    let blocks = t.div_ceil(SPAN_KEY_BLOCK);
    let mut key_blocks = vec![[0u32; 2]; b * blocks];
    for (row, per_query) in spans.chunks(t.max(1)).enumerate() {
        let row_blocks = &mut key_blocks[row * blocks..(row + 1) * blocks];
        for (i, span) in per_query.iter().enumerate() {
            for (x, y) in [(span[0], span[1]), (span[2], span[3])].into_iter().filter(|(x, y)| x < y) {
                for block in &mut row_blocks[x as usize / SPAN_KEY_BLOCK..=(y as usize - 1) / SPAN_KEY_BLOCK] {
                    // Queries come in order: the first to see the block starts it.
                    if block[1] == 0 {
                        block[0] = i as u32;
                    }
                    block[1] = i as u32 + 1;
                }
            }
        }
    }
    Some(AttentionSpans { spans, key_blocks })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_follow_the_mask_on_both_sides() {
        let rows = vec![vec![5, 6, 7], vec![8]];
        let dev = Device::Cpu;
        let left = Inputs::from_rows(&rows, 0, PadSide::Left, &dev).unwrap();
        assert_eq!(left.positions.to_vec2::<u32>().unwrap(), vec![vec![0, 1, 2], vec![0, 0, 0]]);
        assert_eq!(left.ids.to_vec2::<u32>().unwrap(), vec![vec![5, 6, 7], vec![0, 0, 8]]);
        assert_eq!(left.last_token_index().unwrap(), vec![2, 2]);
        let right = Inputs::from_rows(&rows, 0, PadSide::Right, &dev).unwrap();
        assert_eq!(right.positions.to_vec2::<u32>().unwrap(), vec![vec![0, 1, 2], vec![0, 0, 0]]);
        assert_eq!(right.last_token_index().unwrap(), vec![2, 0]);
    }

    #[test]
    fn bias_is_causal_and_hides_padding() {
        let dev = Device::Cpu;
        let inputs = Inputs::from_rows(&[vec![1, 2], vec![3]], 0, PadSide::Left, &dev).unwrap();
        let bias = attention_bias(&inputs, &key_mask(&inputs, None).unwrap()).unwrap();
        // (B=2, 1, T=2, S=2) flattened: index (b * 2 + query) * 2 + key.
        let bias: Vec<f32> = bias.flatten_all().unwrap().to_vec1().unwrap();
        let ok = |b: usize, q: usize, k: usize| bias[(b * 2 + q) * 2 + k] == 0.0;
        assert!(ok(0, 0, 0) && !ok(0, 0, 1));
        assert!(ok(0, 1, 0) && ok(0, 1, 1));
        // Row 1 is left-padded: key 0 is padding for every query.
        assert!(!ok(1, 1, 0) && ok(1, 1, 1));
    }

    /// Every (row, query, key) the spans let through is one the bias does,
    /// and each key block's queries lie in its range, which is tight.
    fn assert_spans_see_what_the_bias_does(inputs: &Inputs) {
        let (b, t) = (inputs.batch_size(), inputs.seq_len());
        let spans = attention_spans(inputs).expect("spans");
        let bias: Vec<f32> = attention_bias(inputs, &inputs.mask).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let blocks = t.div_ceil(SPAN_KEY_BLOCK);
        for row in 0..b {
            let mut seen = vec![(usize::MAX, 0); blocks];
            for i in 0..t {
                let [a0, a1, b0, b1] = spans.spans[row * t + i].map(|x| x as usize);
                for j in 0..t {
                    let visible = (a0..a1).contains(&j) || (b0..b1).contains(&j);
                    assert_eq!(visible, bias[(row * t + i) * t + j] == 0.0, "row {row} query {i} key {j}");
                    if visible {
                        let block = &mut seen[j / SPAN_KEY_BLOCK];
                        *block = (block.0.min(i), i + 1);
                    }
                }
            }
            for (k, &(first, end)) in seen.iter().enumerate() {
                let want = if end == 0 { [0, 0] } else { [first as u32, end as u32] };
                assert_eq!(spans.key_blocks[row * blocks + k], want, "row {row} key block {k}");
            }
        }
    }

    #[test]
    fn spans_see_what_the_bias_does() {
        let dev = Device::Cpu;
        let ids: Vec<u32> = (1..=200).collect();
        // Prompts of 70 and 3, parts across key blocks, and padding at the end.
        let groups = [
            SharedPrefix { prompt: &ids[..70], continuations: vec![&ids[70..140], &ids[140..141], &ids[141..200]] },
            SharedPrefix { prompt: &ids[..3], continuations: vec![&ids[3..90], &ids[90..100]] },
        ];
        assert_spans_see_what_the_bias_does(&Inputs::shared_prefix(&groups, 0, &dev).unwrap());
        let rows = [ids[..150].to_vec(), ids[..1].to_vec(), ids[..66].to_vec()];
        for side in [PadSide::Left, PadSide::Right] {
            assert_spans_see_what_the_bias_does(&Inputs::from_rows(&rows, 0, side, &dev).unwrap());
        }
        // A mask given whole: one run per row has spans, a hole has none.
        let id = Tensor::zeros((2, 4), DType::U32, &dev).unwrap();
        let mask = |m: &[f32]| Tensor::from_slice(m, (2, 4), &dev).unwrap();
        assert_spans_see_what_the_bias_does(&Inputs::new(&id, &mask(&[0., 1., 1., 1., 1., 1., 0., 0.])).unwrap());
        assert_eq!(attention_spans(&Inputs::new(&id, &mask(&[1., 0., 1., 1., 1., 1., 1., 1.])).unwrap()), None);
    }
}
