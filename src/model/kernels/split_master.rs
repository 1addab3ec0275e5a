//! An f32 master weight kept in 2 bytes and a bit beside its bf16 compute
//! copy (the default; `RLOO_MASTERS=f32` keeps it whole) instead of 4: the
//! copy is the master rounded to nearest even, so the master's top half is
//! the copy less the rounding's carry, and its low half is kept as it is.
//! The carry is a bit an element, 32 to a word: at a tie the low half
//! cannot tell it, since an even bf16 value is the rounding of 65,537 f32
//! values, one more than 16 bits can name. The master comes back to the
//! bit, so a run trains to the same bits either way; AdamW updates the
//! three in place (`cuda/adamw.cuh` on a GPU).

use candle_core::{DType, Result, Tensor, Var};
use half::bf16;
use rayon::prelude::*;

use super::math::with_avx2;

/// How a weight that trains in bf16 keeps its f32 master: `split` beside
/// its bf16 copy (the default) or whole, `f32`.
pub const MASTERS_VAR: &str = "RLOO_MASTERS";

/// Whether the masters of weights that train computing in `dtype` are
/// split (bf16 only); an unknown choice is an error.
pub fn masters_split(dtype: DType) -> Result<bool> {
    let chosen = crate::model::device::variant(MASTERS_VAR, &["split", "f32"]);
    Ok(dtype == DType::BF16 && chosen.map_err(candle_core::Error::msg)? == "split")
}

/// What a split master keeps beside its bf16 copy: variables, written in
/// place by a copy (candle's GPU kernels have no strided copy of i16).
#[derive(Clone)]
pub struct SplitMaster {
    /// The master's low 16 bits (i16 storage), in the weight's shape.
    pub low: Var,
    /// Whether the rounding went up, a bit an element, 32 to a u32 word.
    pub up: Var,
}

/// Bytes a split master of `n` elements keeps beside its bf16 copy.
pub fn split_master_bytes(n: u64) -> u64 {
    2 * n + 4 * n.div_ceil(32)
}

impl SplitMaster {
    /// `master` (f32) as its bf16 rounding and what the rounding dropped.
    pub fn split(master: &Tensor) -> Result<(Tensor, SplitMaster)> {
        let (hi, low, up) = split_bits(&master.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?);
        let (shape, dev) = (master.shape(), master.device());
        let words = up.len();
        let low = Var::from_tensor(&Tensor::from_vec(low, shape, dev)?)?;
        let split = SplitMaster { low, up: Var::from_tensor(&Tensor::from_vec(up, words, dev)?)? };
        Ok((Tensor::from_vec(hi, shape, dev)?, split))
    }

    /// The master of `hi`, in f32.
    pub fn join(&self, hi: &Tensor) -> Result<Tensor> {
        let low = self.low.flatten_all()?.to_vec1()?;
        let values = join_bits(&hi.flatten_all()?.to_vec1()?, &low, &self.up.to_vec1()?);
        Tensor::from_vec(values, hi.shape(), hi.device())
    }

    /// `master` written over `hi` and this split, in place (a recorded
    /// decoding step reads `hi` by its address).
    pub fn set(&self, hi: &Var, master: &Tensor) -> Result<()> {
        let (new_hi, new) = Self::split(&master.to_device(hi.device())?)?;
        hi.set(&new_hi)?;
        self.low.set(&new.low)?;
        self.up.set(&new.up)
    }
}

fn split_bits(master: &[f32]) -> (Vec<bf16>, Vec<i16>, Vec<u32>) {
    let n = master.len();
    let (mut hi, mut low, mut up) = (vec![bf16::ZERO; n], vec![0; n], vec![0; n.div_ceil(32)]);
    update_split(&mut hi, &mut low, &mut up, [master, master], |_, master, _| master);
    (hi, low, up)
}

fn join_bits(hi: &[bf16], low: &[i16], up: &[u32]) -> Vec<f32> {
    (0..hi.len()).into_par_iter().map(|i| join_one(hi[i], low[i], up[i / 32] >> (i % 32) & 1)).collect()
}

/// Elements per parallel task of [`update_split`]: whole words of carries.
const TASK: usize = 1 << 14;

/// Rewrites a split master in place: element `i`'s master becomes
/// `new(its master, a[i], b[i])`, in parallel over whole words of carries.
pub(super) fn update_split(
    hi: &mut [bf16],
    low: &mut [i16],
    up: &mut [u32],
    [a, b]: [&[f32]; 2],
    new: impl Fn(f32, f32, f32) -> f32 + Sync,
) {
    assert!(low.len() == hi.len() && a.len() == hi.len() && b.len() == hi.len() && up.len() == hi.len().div_ceil(32));
    let elements =
        hi.par_chunks_mut(TASK).zip(low.par_chunks_mut(TASK)).zip(a.par_chunks(TASK).zip(b.par_chunks(TASK)));
    elements.zip(up.par_chunks_mut(TASK / 32)).for_each(|(((hi, low), (a, b)), up)| {
        with_avx2(
            #[inline(always)]
            || {
                let words = hi.chunks_mut(32).zip(low.chunks_mut(32)).zip(a.chunks(32).zip(b.chunks(32)));
                for (((hi, low), (a, b)), carries) in words.zip(up.iter_mut()) {
                    *carries = update_word(hi, low, a, b, *carries, &new);
                }
            },
        )
    });
}

/// [`update_split`] over the elements of one word of carries (32, or
/// fewer at the end), which it returns rewritten.
#[inline(always)]
fn update_word(
    hi: &mut [bf16],
    low: &mut [i16],
    a: &[f32],
    b: &[f32],
    carries: u32,
    new: &impl Fn(f32, f32, f32) -> f32,
) -> u32 {
    let mut bits = 0;
    // A whole word as arrays, so that the loop runs without bounds checks
    // across the vector lanes; a short one element by element.
    let whole = (<&mut [bf16; 32]>::try_from(&mut *hi), <&mut [i16; 32]>::try_from(&mut *low));
    if let ((Ok(hi), Ok(low)), Ok(a), Ok(b)) = (whole, <&[f32; 32]>::try_from(a), <&[f32; 32]>::try_from(b)) {
        for i in 0..32 {
            bits |= update_one(&mut hi[i], &mut low[i], carries >> i & 1, a[i], b[i], new) << i;
        }
        return bits;
    }
    for i in 0..hi.len() {
        bits |= update_one(&mut hi[i], &mut low[i], carries >> i & 1, a[i], b[i], new) << i;
    }
    bits
}

/// One element of [`update_word`]: its new carry bit.
#[inline(always)]
fn update_one(hi: &mut bf16, low: &mut i16, carry: u32, a: f32, b: f32, new: &impl Fn(f32, f32, f32) -> f32) -> u32 {
    let (h, l, rounded_up) = split_one(new(join_one(*hi, *low, carry), a, b));
    (*hi, *low) = (h, l);
    rounded_up as u32
}

/// A master from its bf16 copy, its low half and its carry bit.
#[inline(always)]
fn join_one(hi: bf16, low: i16, carry: u32) -> f32 {
    f32::from_bits((hi.to_bits() as u32).wrapping_sub(carry) << 16 | low as u16 as u32)
}

/// A master's bf16 rounding, its low half, and whether the rounding went up.
#[inline(always)]
fn split_one(master: f32) -> (bf16, i16, bool) {
    let bits = master.to_bits();
    // To nearest even on the bits, as `bf16::from_f32` rounds every value
    // but a NaN (never a master), without its branches.
    let rounded = (bits.wrapping_add(0x7fff + (bits >> 16 & 1)) >> 16) as u16;
    let hi = if master.is_nan() { bf16::from_f32(master).to_bits() } else { rounded };
    (bf16::from_bits(hi), bits as u16 as i16, hi != (bits >> 16) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn bits16(t: &Tensor) -> Vec<u16> {
        t.flatten_all().unwrap().to_vec1::<bf16>().unwrap().iter().map(|h| h.to_bits()).collect()
    }

    fn bits32(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// Values that round both ways to bf16, ties included (down to an even
    /// value and up to one), values that round up into the next binade or
    /// to infinity, subnormals, signed zeros and infinities, then random bits.
    fn awkward() -> Vec<f32> {
        let mut bits: Vec<u32> = vec![
            0x3f80_0000,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x3f80_7fff,
            0x3fff_ffff,
            0x3fff_8000,
            0x7f7f_ffff,
            0x7f7f_8000,
            0x0000_0001,
            0x0000_8000,
            0x0001_8000,
            0x007f_ffff,
            0x0000_0000,
            0x7f80_0000,
        ];
        bits.extend(bits.clone().iter().map(|b| b | 0x8000_0000));
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..4_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let b = state as u32;
            // Not NaN: a master never is.
            if b & 0x7f80_0000 != 0x7f80_0000 || b & 0x007f_ffff == 0 {
                bits.push(b);
            }
        }
        bits.into_iter().map(f32::from_bits).collect()
    }

    #[test]
    fn a_split_master_comes_back_to_the_bit_beside_candles_rounding() {
        let values = awkward();
        let master = Tensor::from_vec(values.clone(), values.len(), &Device::Cpu).unwrap();
        let (hi, split) = SplitMaster::split(&master).unwrap();
        assert_eq!(bits16(&hi), bits16(&master.to_dtype(DType::BF16).unwrap()));
        assert_eq!(bits32(&split.join(&hi).unwrap()), bits32(&master));
        // Both ties of one even value: one rounded down to it, one up.
        let ties = [f32::from_bits(0x3f80_8000), f32::from_bits(0x3f7f_8000)];
        let (hi, split) = SplitMaster::split(&Tensor::new(&ties, &Device::Cpu).unwrap()).unwrap();
        assert_eq!(bits16(&hi), [0x3f80; 2]);
        assert_eq!(split.join(&hi).unwrap().to_vec1::<f32>().unwrap(), ties);
    }

    #[test]
    fn a_split_master_is_written_in_place() {
        let dev = Device::Cpu;
        let a = Tensor::new(&[[1.5f32, -2.25e-3], [7.0, 3.0e5]], &dev).unwrap();
        let b = (&a * 1.000_123).unwrap();
        let (hi, split) = SplitMaster::split(&a).unwrap();
        let hi = Var::from_tensor(&hi).unwrap();
        // Handles on the storages as they were: they must see b's parts.
        let (hi_then, then) = (hi.as_tensor().clone(), split.clone());
        split.set(&hi, &b).unwrap();
        let (b_hi, b_split) = SplitMaster::split(&b).unwrap();
        assert_eq!(bits16(&hi_then), bits16(&b_hi));
        assert_eq!(then.low.to_vec2::<i16>().unwrap(), b_split.low.to_vec2::<i16>().unwrap());
        assert_eq!(then.up.to_vec1::<u32>().unwrap(), b_split.up.to_vec1::<u32>().unwrap());
        assert_eq!(bits32(&then.join(&hi_then).unwrap()), bits32(&b));
    }
}
