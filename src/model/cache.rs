//! The key/value cache of incremental decoding.

use candle_core::{DType, Device, Result, Tensor};

/// Keys and values of every layer for the tokens seen so far, and which
/// cache slots are real tokens. Each row keeps its own positions (given in
/// each step's inputs), so rows of different prompt lengths decode together.
/// Buffers are allocated with spare capacity and written in place, so a
/// decoding step copies only its new keys and values.
///
/// Rows may start with slots they share ([`KvCache::share`]): the k
/// completions of a prompt read its keys and values from one copy.
///
/// Its slots may be fixed ([`KvCache::fix_slots`]): the buffers then have
/// their final size, the key mask covers every slot, and a decoding step
/// launches the same kernels on the same buffers every time, reading the
/// slot it writes from the device, so that it can be recorded once as a
/// CUDA graph and replayed. A row that leaves such a cache leaves its
/// place behind, and a row prefilled apart may take it ([`KvCache::place`]):
/// a server's batch then changes its rows without changing its buffers.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// Per layer: each row's own key and value buffers (B, Hkv, capacity, D),
    /// whose first `len() - shared_len()` slots hold data.
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// (B, S) f32 mask over all filled slots, the shared ones first.
    key_mask: Option<Tensor>,
    shared: Option<Shared>,
    /// Slots per row the own buffers get when next allocated, if more than
    /// they need.
    planned: usize,
    fixed: Option<Fixed>,
}

/// What a cache with fixed slots keeps beside its buffers.
#[derive(Debug, Clone)]
struct Fixed {
    /// Own slots filled so far, of the buffers' `capacity`.
    filled: usize,
    capacity: usize,
    /// (1,) u32: the own slot the next step writes, which its owner sets
    /// to `filled` before each step.
    slot: Tensor,
}

/// Slots several rows start with, stored once.
#[derive(Debug, Clone)]
struct Shared {
    /// Per layer: keys and values (U, Hkv, P, D).
    layers: Vec<(Tensor, Tensor)>,
    /// For each row, the shared row it continues.
    rows: Vec<u32>,
    /// The same on the cache's device, for index selects and kernels.
    device_rows: Tensor,
    /// P.
    len: usize,
}

/// One layer's cache after an append.
pub struct LayerKv<'a> {
    /// Each row's own slots: (B, Hkv, S_own, D) views.
    pub keys: Tensor,
    pub values: Tensor,
    /// The shared slots in front of them, if any.
    pub shared: Option<SharedKv<'a>>,
    /// With fixed slots, the (1,) u32 slot this step writes: the GPU
    /// kernels read the own slots' count there (it plus one), not from the
    /// views, so that a replayed step reads past its recording's length.
    pub slot_at: Option<&'a Tensor>,
}

/// Shared slots: row b reads keys and values of row `rows[b]`.
pub struct SharedKv<'a> {
    /// (U, Hkv, P, D)
    pub keys: &'a Tensor,
    pub values: &'a Tensor,
    pub rows: &'a [u32],
    /// `rows` (B,) u32 on the keys' device.
    pub device_rows: &'a Tensor,
}

impl LayerKv<'_> {
    /// Every slot of every row, the shared ones first: keys and values
    /// (B, Hkv, S, D), copied out when slots are shared.
    pub fn whole(&self) -> Result<(Tensor, Tensor)> {
        let Some(shared) = &self.shared else {
            return Ok((self.keys.clone(), self.values.clone()));
        };
        let idx = shared.device_rows;
        let keys = Tensor::cat(&[&shared.keys.index_select(idx, 0)?, &self.keys], 2)?;
        let values = Tensor::cat(&[&shared.values.index_select(idx, 0)?, &self.values], 2)?;
        Ok((keys, values))
    }
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self { layers: vec![None; num_layers], key_mask: None, shared: None, planned: 0, fixed: None }
    }

    /// Number of filled slots (S), shared ones included.
    pub fn len(&self) -> usize {
        match &self.fixed {
            Some(fixed) => self.shared_len() + fixed.filled,
            None => self.key_mask.as_ref().map_or(0, |m| m.dims()[1]),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The (B, S) mask of filled slots: 1 for real tokens, 0 for padding.
    /// With fixed slots it covers every slot, S being the shared ones plus
    /// the capacity, and a slot not yet filled is 1.
    pub fn key_mask(&self) -> Option<&Tensor> {
        self.key_mask.as_ref()
    }

    /// Records the key mask after a forward pass has appended every layer
    /// (with fixed slots, counts the pass's `t` new slots instead).
    pub fn finish_pass(&mut self, key_mask: Tensor, t: usize) {
        match self.fixed {
            Some(_) => self.advance(t),
            None => self.key_mask = Some(key_mask),
        }
    }

    /// With fixed slots, counts `t` slots written by a step the host did
    /// not run (a replayed CUDA graph).
    pub fn advance(&mut self, t: usize) {
        if let Some(fixed) = &mut self.fixed {
            fixed.filled += t;
        }
    }

    /// The slot the next step writes, with fixed slots.
    pub fn fixed_slot(&self) -> Option<usize> {
        self.fixed.as_ref().map(|f| f.filled)
    }

    /// With fixed slots, the (1,) u32 tensor the GPU kernels read that
    /// slot from.
    pub fn slot_at(&self) -> Option<&Tensor> {
        self.fixed.as_ref().map(|f| &f.slot)
    }

    /// Fixes the slots: gives every layer's buffers the capacity
    /// [`reserve`](Self::reserve) planned, and the key mask a 1 for every
    /// slot after the filled ones. Steps then read the slot they write from
    /// `slot`, (1,) u32, which the caller sets before each step; called
    /// again (after [`select_rows`](Self::select_rows)) it only swaps
    /// `slot`.
    pub fn fix_slots(&mut self, slot: Tensor) -> Result<()> {
        if let Some(fixed) = &mut self.fixed {
            fixed.slot = slot;
            return Ok(());
        }
        let Some(mask) = self.key_mask.clone() else { candle_core::bail!("the cache is empty: no slots to fix") };
        let (b, filled) = (mask.dim(0)?, self.len() - self.shared_len());
        let capacity = self.planned.max(filled);
        for layer in 0..self.layers.len() {
            let (h, d, dtype, device) = match (&self.layers[layer], &self.shared) {
                (Some((k, _)), _) => (k.dim(1)?, k.dim(3)?, k.dtype(), k.device().clone()),
                (None, Some(shared)) => {
                    let k = &shared.layers[layer].0;
                    (k.dim(1)?, k.dim(3)?, k.dtype(), k.device().clone())
                }
                (None, None) => candle_core::bail!("layer {layer} has no cache yet"),
            };
            self.make_room(layer, (b, h, capacity - filled, d), dtype, &device)?;
        }
        let spare = Tensor::ones((b, capacity - filled), mask.dtype(), mask.device())?;
        self.key_mask = Some(Tensor::cat(&[&mask, &spare], 1)?);
        self.fixed = Some(Fixed { filled, capacity, slot });
        Ok(())
    }

    /// With fixed slots, how many more steps the buffers hold.
    pub fn slots_left(&self) -> Option<usize> {
        self.fixed.as_ref().map(|f| f.capacity - f.filled)
    }

    /// Undoes [`fix_slots`](Self::fix_slots): the key mask covers the
    /// filled slots again, so that rows can be selected, joined and
    /// trimmed. The buffers keep their capacity.
    pub fn unfix(&mut self) -> Result<()> {
        let Some(fixed) = self.fixed.take() else { return Ok(()) };
        if let Some(mask) = &self.key_mask {
            self.key_mask = Some(mask.narrow(1, 0, self.shared_len() + fixed.filled)?.contiguous()?);
        }
        self.planned = fixed.filled;
        Ok(())
    }

    /// Adds `n` rows with no real slot (every slot masked) after the
    /// others: places for rows to come.
    pub fn pad_rows(&mut self, n: usize) -> Result<()> {
        self.refuse_fixed("be padded")?;
        if self.shared.is_some() {
            candle_core::bail!("a cache with shared slots cannot be padded");
        }
        let Some(mask) = &self.key_mask else { return Ok(()) };
        if n == 0 {
            return Ok(());
        }
        self.key_mask = Some(mask.pad_with_zeros(0, 0, n)?);
        for (k, v) in self.layers.iter_mut().flatten() {
            (*k, *v) = (k.pad_with_zeros(0, 0, n)?, v.pad_with_zeros(0, 0, n)?);
        }
        Ok(())
    }

    /// With fixed slots, writes row `from` of `other` (a prefilled cache,
    /// slots neither fixed nor shared) into this cache's row `row`, whose
    /// previous row has left: its slots end where the next step writes,
    /// the slots before them masked, as [`join`](Self::join) pads a row on
    /// the left. The buffers stay where they are, so a recorded step
    /// still runs on them.
    pub fn place(&mut self, row: usize, other: &KvCache, from: usize) -> Result<()> {
        let Some(fixed) = &self.fixed else { candle_core::bail!("rows take places only in a cache with fixed slots") };
        if self.shared.is_some() || other.shared.is_some() || other.fixed.is_some() {
            candle_core::bail!("a row is placed from a cache of its own slots into one without shared slots");
        }
        let (Some(mask), Some(theirs)) = (&self.key_mask, &other.key_mask) else {
            candle_core::bail!("a row is placed from, and into, a cache with slots");
        };
        let len = theirs.dim(1)?;
        let Some(start) = fixed.filled.checked_sub(len) else {
            candle_core::bail!("a row of {len} slots placed before slot {}", fixed.filled);
        };
        let (width, device) = (mask.dim(1)?, mask.device());
        let parts = [
            Tensor::zeros((1, start), mask.dtype(), device)?,
            theirs.narrow(0, from, 1)?.to_dtype(mask.dtype())?,
            Tensor::ones((1, width - fixed.filled), mask.dtype(), device)?,
        ];
        // Empty parts left out, so that no copy of no elements is launched.
        let parts: Vec<&Tensor> = parts.iter().filter(|p| p.elem_count() > 0).collect();
        mask.narrow(0, row, 1)?.slice_set(&Tensor::cat(&parts, 1)?, 1, 0)?;
        for (mine, theirs) in self.layers.iter().zip(&other.layers) {
            let (Some((kb, vb)), Some((k, v))) = (mine, theirs) else {
                candle_core::bail!("a layer has no cached keys to place");
            };
            for (buffer, part) in [(kb, k), (vb, v)] {
                let part = part.narrow(0, from, 1)?.narrow(2, 0, len)?.contiguous()?;
                buffer.narrow(0, row, 1)?.slice_set(&part, 2, start)?;
            }
        }
        Ok(())
    }

    fn refuse_fixed(&self, what: &str) -> Result<()> {
        match self.fixed {
            Some(_) => candle_core::bail!("a cache with fixed slots cannot {what}"),
            None => Ok(()),
        }
    }

    fn shared_len(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.len)
    }

    /// Sizes the buffers for `additional` more slots per row when they are
    /// next allocated, so that decoding that many tokens never regrows
    /// (copies) them.
    pub fn reserve(&mut self, additional: usize) {
        if self.fixed.is_some() {
            return;
        }
        self.planned = self.len() - self.shared_len() + additional;
    }

    /// Turns the filled slots into slots shared by a new set of rows: new
    /// row i continues current row `rows[i]`, with no copy of its keys and
    /// values. Later appends go to each new row's own slots.
    pub fn share(&mut self, rows: &[u32]) -> Result<()> {
        if self.shared.is_some() {
            candle_core::bail!("the cache already has shared slots");
        }
        self.refuse_fixed("share slots")?;
        let Some(mask) = &self.key_mask else { candle_core::bail!("the cache is empty: nothing to share") };
        let len = mask.dim(1)?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &mut self.layers {
            let Some((k, v)) = layer.take() else { candle_core::bail!("a layer has no cached keys to share") };
            layers.push((k.narrow(2, 0, len)?.contiguous()?, v.narrow(2, 0, len)?.contiguous()?));
        }
        let device_rows = Tensor::from_slice(rows, rows.len(), mask.device())?;
        self.key_mask = Some(mask.index_select(&device_rows, 0)?);
        self.shared = Some(Shared { layers, rows: rows.to_vec(), device_rows, len });
        Ok(())
    }

    /// Keeps only the given rows (finished rows leave the batch).
    pub fn select_rows(&mut self, rows: &[u32]) -> Result<()> {
        let Some(mask) = &self.key_mask else { return Ok(()) };
        let idx = Tensor::from_slice(rows, rows.len(), mask.device())?;
        self.key_mask = Some(mask.index_select(&idx, 0)?);
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.index_select(&idx, 0)?;
            *v = v.index_select(&idx, 0)?;
        }
        if let Some(shared) = &mut self.shared {
            shared.rows = rows.iter().map(|&r| shared.rows[r as usize]).collect();
            shared.device_rows = shared.device_rows.index_select(&idx, 0)?;
        }
        Ok(())
    }

    /// Appends the rows of `other` after this cache's rows, so that rows
    /// prefilled apart decode in one batch from then on (a server's
    /// requests joining a running batch). The shorter side is padded on the
    /// left with masked slots: rows keep their own positions, so where a
    /// row's slots sit does not change what it computes. Buffers get room
    /// for `reserve` more slots per row. Neither cache may share slots.
    pub fn join(&mut self, other: KvCache, reserve: usize) -> Result<()> {
        if self.shared.is_some() || other.shared.is_some() {
            candle_core::bail!("caches with shared slots cannot be joined");
        }
        self.refuse_fixed("be joined")?;
        other.refuse_fixed("be joined")?;
        let Some(theirs) = other.key_mask.clone() else { return Ok(()) };
        let Some(ours) = self.key_mask.take() else {
            *self = other;
            return self.regrow(reserve);
        };
        let s = ours.dim(1)?.max(theirs.dim(1)?);
        let left_pad = |t: &Tensor, dim: usize| -> Result<Tensor> {
            let missing = s - t.dim(dim)?;
            if missing == 0 {
                return Ok(t.clone());
            }
            t.pad_with_zeros(dim, missing, 0)
        };
        self.key_mask = Some(Tensor::cat(&[&left_pad(&ours, 1)?, &left_pad(&theirs, 1)?], 0)?);
        let (a_len, b_len) = (ours.dim(1)?, theirs.dim(1)?);
        for (mine, theirs) in self.layers.iter_mut().zip(other.layers) {
            let (Some((ka, va)), Some((kb, vb))) = (mine.take(), theirs) else {
                candle_core::bail!("a layer has no cached keys to join");
            };
            let (ka, va) = (left_pad(&ka.narrow(2, 0, a_len)?, 2)?, left_pad(&va.narrow(2, 0, a_len)?, 2)?);
            let (kb, vb) = (left_pad(&kb.narrow(2, 0, b_len)?, 2)?, left_pad(&vb.narrow(2, 0, b_len)?, 2)?);
            *mine = Some((Tensor::cat(&[&ka, &kb], 0)?, Tensor::cat(&[&va, &vb], 0)?));
        }
        self.regrow(reserve)
    }

    /// Drops the leading slots that no row uses any more (their rows have
    /// left the batch), when they are at least `min_slots`; returns how many
    /// were dropped. Keeps a long-running batch from growing without bound.
    pub fn trim_front(&mut self, min_slots: usize) -> Result<usize> {
        let Some(mask) = &self.key_mask else { return Ok(0) };
        if self.shared.is_some() || self.fixed.is_some() {
            return Ok(0);
        }
        let s = mask.dim(1)?;
        let rows: Vec<Vec<f32>> = mask.to_vec2()?;
        let unused = (0..s).take_while(|&j| rows.iter().all(|r| r[j] == 0.0)).count();
        if unused < min_slots.max(1) {
            return Ok(0);
        }
        self.key_mask = Some(mask.narrow(1, unused, s - unused)?);
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.narrow(2, unused, s - unused)?;
            *v = v.narrow(2, unused, s - unused)?;
        }
        self.regrow(self.planned.saturating_sub(s))?;
        Ok(unused)
    }

    /// Copies each layer's filled slots into new contiguous buffers with
    /// room for `reserve` more slots.
    fn regrow(&mut self, reserve: usize) -> Result<()> {
        let len = self.len();
        self.planned = len + reserve;
        for (k, v) in self.layers.iter_mut().flatten() {
            let (b, h, _, d) = k.dims4()?;
            let kb = Tensor::zeros((b, h, len + reserve, d), k.dtype(), k.device())?;
            let vb = Tensor::zeros((b, h, len + reserve, d), v.dtype(), v.device())?;
            kb.slice_set(&k.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
            vb.slice_set(&v.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
            (*k, *v) = (kb, vb);
        }
        Ok(())
    }

    /// Writes one layer's new keys and values (B, Hkv, T, D) after each
    /// row's filled slots and returns that layer's cache.
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<LayerKv<'_>> {
        if super::device::recording(k.device()) {
            candle_core::bail!(
                "a recorded decoding step would write its keys to the slot it was recorded at: \
                 recording needs the one-launch append (RLOO_DECODE_APPEND=fused)"
            );
        }
        let t = k.dim(2)?;
        let (kb, vb, start) = self.make_room(layer, k.dims4()?, k.dtype(), k.device())?;
        kb.slice_set(&k.contiguous()?, 2, start)?;
        vb.slice_set(&v.contiguous()?, 2, start)?;
        self.layer(layer, start + t)
    }

    /// Room for T new slots after each row's filled ones in `layer`'s key
    /// and value buffers (B, Hkv, capacity, D), `new` being (B, Hkv, T, D):
    /// returns the buffers, grown if need be, and the first new slot, for a
    /// caller that writes them itself; [`KvCache::layer`] then reads them.
    pub fn make_room(
        &mut self,
        layer: usize,
        (b, h, t, d): (usize, usize, usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor, usize)> {
        let start = self.len() - self.shared_len();
        let need = start + t;
        let (kb, vb) = match self.layers[layer].take() {
            Some((kb, vb)) if kb.dim(2)? >= need => (kb, vb),
            Some(_) if self.fixed.is_some() => {
                candle_core::bail!("a cache with fixed slots is full: {need} slots asked of {}", self.planned)
            }
            old => {
                // Grow geometrically so that decoding N tokens copies O(N) slots in all.
                let capacity = if need <= self.planned { self.planned } else { (2 * need).max(64) };
                let kb = Tensor::zeros((b, h, capacity, d), dtype, device)?;
                let vb = Tensor::zeros((b, h, capacity, d), dtype, device)?;
                if let Some((ok, ov)) = old {
                    kb.slice_set(&ok.narrow(2, 0, start)?.contiguous()?, 2, 0)?;
                    vb.slice_set(&ov.narrow(2, 0, start)?.contiguous()?, 2, 0)?;
                }
                (kb, vb)
            }
        };
        self.layers[layer] = Some((kb.clone(), vb.clone()));
        Ok((kb, vb, start))
    }

    /// `layer`'s cache, its first `len` own slots filled.
    pub fn layer(&self, layer: usize, len: usize) -> Result<LayerKv<'_>> {
        let Some((kb, vb)) = &self.layers[layer] else { candle_core::bail!("layer {layer} has no cache yet") };
        let (keys, values) = (kb.narrow(2, 0, len)?, vb.narrow(2, 0, len)?);
        let shared = self.shared.as_ref().map(|s| {
            let (keys, values) = &s.layers[layer];
            SharedKv { keys, values, rows: &s.rows, device_rows: &s.device_rows }
        });
        Ok(LayerKv { keys, values, shared, slot_at: self.fixed.as_ref().map(|f| &f.slot) })
    }
}
