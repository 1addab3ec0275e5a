//! Sampling by an exponential race over counter-based random streams: how a
//! GPU picks tokens without its logits leaving the device (`race_pick` in
//! the CUDA kernels), and the same rule on the CPU, which is its reference
//! and which the decoding loop runs there when asked (`RLOO_SAMPLER=race`).
//!
//! Entry j of a row's (penalised) logits scores u_j - ln E_j, where
//! u_j = (l_j - max) / T and E_j ~ Exp(1); the best-scoring kept entry is a
//! draw from softmax(u) over the kept entries (the Gumbel-max trick). E_j
//! comes from Philox4x32-10 keyed by the row's stream, at counter
//! (j / 4, t, 0, 0) with t the token's index in its completion: a token
//! depends on the seed, the prompt, the sample, t and the logits, never on
//! the batch, the order of work or the threads, and picking a maximum needs
//! no sum whose order could change it.
//!
//! Truncation keeps the entries at or above thresholds, in transformers'
//! order: top-k the k-th largest u; top-p (among top-k's) the largest u whose
//! entries and those above carry top_p of the mass; min-p e^u >= min_p. Ties
//! at a threshold are all kept. The log-prob and entropy are those of the
//! untruncated distribution at the temperature, as [`Sampling::pick`] gives.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::sampling::{Pick, Sampling};
use crate::error::{Error, Result};
use crate::rng::{philox, Rng};

/// Chooses the decoding loop's sampler (`host` or `race`).
pub const SAMPLER_VAR: &str = "RLOO_SAMPLER";

/// Above every noise term -ln E_j: E_j >= 2^-33, so -ln E_j <= 22.88. An
/// entry whose u is this far below the best score so far cannot win, and
/// its noise need not be drawn.
const MAX_GUMBEL: f32 = 23.0;

/// How the decoding loop picks tokens from a step's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampler {
    /// The logits are read on the host, each row drawing from its own
    /// generator ([`Sampling::pick`]): the CPU default.
    Host,
    /// The exponential race where the logits lie (this module): the GPU
    /// default. Only tokens, log-probs and entropies reach the host.
    Race,
}

impl Sampler {
    /// `RLOO_SAMPLER` if set, else the default for `device`.
    pub fn from_env(device: &candle_core::Device) -> Result<Self> {
        Self::parse(std::env::var(SAMPLER_VAR).ok().as_deref(), device)
    }

    fn parse(value: Option<&str>, device: &candle_core::Device) -> Result<Self> {
        match value {
            None | Some("") if device.is_cuda() => Ok(Self::Race),
            None | Some("") => Ok(Self::Host),
            Some("host") => Ok(Self::Host),
            Some("race") => Ok(Self::Race),
            Some(other) => Err(Error::Invalid(format!("{SAMPLER_VAR}={other}: expected host or race"))),
        }
    }
}

/// One row's draw: its settings and where its stream stands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RaceRow {
    /// The row's Philox key.
    pub key: [u32; 2],
    /// The token's index in its completion.
    pub step: u32,
    pub greedy: bool,
    /// 1 / temperature (1 for greedy).
    pub inv_t: f32,
    /// 0: all.
    pub top_k: u32,
    /// 1: all.
    pub top_p: f32,
    /// 0: none.
    pub min_p: f32,
    /// Repetition penalty over the entries marked seen (1: none).
    pub penalty: f32,
}

/// Words per row of [`RaceRow::to_words`], as the CUDA kernel reads them.
pub const ROW_WORDS: usize = 9;

impl RaceRow {
    /// The draw of token `step` of a row sampled with `sampling`, its key
    /// taken from the row's own stream (which the race leaves untouched).
    pub fn new(sampling: &Sampling, penalty: f32, stream: &Rng, step: usize) -> Self {
        let word = stream.clone().next_u64();
        let (greedy, top_k, top_p, min_p) = match *sampling {
            Sampling::Greedy => (true, 0, 1.0, 0.0),
            Sampling::Random { top_k, top_p, min_p, .. } => (false, top_k.min(u32::MAX as usize) as u32, top_p, min_p),
        };
        Self {
            key: [word as u32, (word >> 32) as u32],
            step: step as u32,
            greedy,
            inv_t: 1.0 / sampling.logprob_temperature(),
            top_k,
            top_p,
            min_p,
            penalty,
        }
    }

    pub fn to_words(&self) -> [u32; ROW_WORDS] {
        [
            self.key[0],
            self.key[1],
            self.step,
            self.greedy as u32,
            self.inv_t.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.penalty.to_bits(),
        ]
    }

    fn from_words(w: &[u32]) -> Self {
        Self {
            key: [w[0], w[1]],
            step: w[2],
            greedy: w[3] != 0,
            inv_t: f32::from_bits(w[4]),
            top_k: w[5],
            top_p: f32::from_bits(w[6]),
            min_p: f32::from_bits(w[7]),
            penalty: f32::from_bits(w[8]),
        }
    }
}

/// An Exp(1) draw from a random word: -ln(1 - v), v in (0, 1] at the
/// word's f32 resolution (so never 0, never infinite for v < 1).
fn exponential(word: u32) -> f32 {
    let v = (word as f32 + 0.5) * (1.0 / 4_294_967_296.0);
    -(-v).ln_1p()
}

/// f32 bits in an order that follows the values' (for non-NaN values).
fn ordered(u: f32) -> u32 {
    let b = u.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Whether entry `j` is marked in a row's seen bits.
fn is_seen(bits: &[u32], j: usize) -> bool {
    bits.get(j / 32).is_some_and(|w| (w >> (j % 32)) & 1 == 1)
}

/// transformers' repetition penalty on one logit.
fn penalized(l: f32, penalty: f32) -> f32 {
    if l < 0.0 {
        l * penalty
    } else {
        l / penalty
    }
}

/// Whether (s, j) beats (best, at): higher score, ties to the lower id.
fn beats(s: f32, j: usize, best: f32, at: usize) -> bool {
    s > best || (s == best && j < at)
}

/// The pick of one row from its logits and, when the penalty applies,
/// its seen bits (one bit per entry, 32 to a word).
pub fn pick_row(logits: &[f32], seen: Option<&[u32]>, row: &RaceRow) -> Pick {
    let seen = seen.filter(|_| row.penalty != 1.0);
    let l = |j: usize| match seen {
        Some(bits) if is_seen(bits, j) => penalized(logits[j], row.penalty),
        _ => logits[j],
    };
    let (mut top, mut m) = (0, f32::NEG_INFINITY);
    for j in 0..logits.len() {
        if beats(l(j), j, m, top) {
            (top, m) = (j, l(j));
        }
    }
    let u: Vec<f32> = (0..logits.len()).map(|j| (l(j) - m) * row.inv_t).collect();
    let (mut s0, mut s1) = (0f64, 0f64);
    for &x in &u {
        let e = x.exp();
        if e > 0.0 {
            s0 += e as f64;
            s1 += (x * e) as f64;
        }
    }
    let token = if row.greedy { top } else { race(&u, row, top) };
    let log_s0 = s0.ln();
    Pick { token: token as u32, logprob: (u[token] as f64 - log_s0) as f32, entropy: (log_s0 - s1 / s0) as f32 }
}

/// The kept entry of `u` with the best score; `top` (u = 0, always kept)
/// when nothing else is.
fn race(u: &[f32], row: &RaceRow, top: usize) -> usize {
    let floor = threshold(u, row);
    let (mut best, mut at) = (f32::NEG_INFINITY, usize::MAX);
    for block in 0..u.len().div_ceil(4) {
        let mut words = None;
        for (i, j) in (4 * block..(4 * block + 4).min(u.len())).enumerate() {
            let x = u[j];
            let kept = ordered(x) >= floor && (row.min_p <= 0.0 || x.exp() >= row.min_p);
            if !kept || x + MAX_GUMBEL < best {
                continue;
            }
            let words = words.get_or_insert_with(|| philox([block as u32, row.step, 0, 0], row.key));
            let s = x - exponential(words[i]).ln();
            if beats(s, j, best, at) {
                (best, at) = (s, j);
            }
        }
    }
    if at == usize::MAX {
        top
    } else {
        at
    }
}

/// The lowest [`ordered`] value top-k and top-p keep (0: all).
fn threshold(u: &[f32], row: &RaceRow) -> u32 {
    let k = row.top_k as usize;
    let truncated_k = k > 0 && k < u.len();
    if !truncated_k && row.top_p >= 1.0 {
        return 0;
    }
    let mut desc: Vec<f32> = u.to_vec();
    desc.sort_unstable_by(|a, b| b.total_cmp(a));
    let kth = if truncated_k { ordered(desc[k - 1]) } else { 0 };
    if row.top_p >= 1.0 {
        return kth;
    }
    let kept = &desc[..desc.iter().take_while(|&&x| ordered(x) >= kth).count()];
    let total: f64 = kept.iter().map(|x| x.exp() as f64).sum();
    let mut mass = 0f64;
    for &x in kept {
        mass += x.exp() as f64;
        if mass >= row.top_p as f64 * total {
            return ordered(x).max(kth);
        }
    }
    kth
}

/// Every row's pick from (R, V) logits, where they lie: on a GPU only R x 3
/// words come back, and bf16 logits are read as they are (the picks of
/// their f32 cast); the CPU's rule reads f32. `seen` (R, ceil(V / 32)) u32
/// marks the entries a row's penalty applies to.
pub fn pick(logits: &Tensor, rows: &[RaceRow], seen: Option<&Tensor>) -> Result<Vec<Pick>> {
    let device = logits.device();
    let logits = match device.is_cpu() {
        true => logits.to_dtype(DType::F32)?,
        false => logits.clone(),
    };
    // Without seen bits no penalty applies, and one word stands in for them.
    let penalized = seen.is_some();
    let none;
    let seen = match seen {
        Some(s) => s,
        None => {
            none = Tensor::zeros((1, 1), DType::U32, device)?;
            &none
        }
    };
    let words: Vec<u32> = rows
        .iter()
        .flat_map(|r| RaceRow { penalty: if penalized { r.penalty } else { 1.0 }, ..*r }.to_words())
        .collect();
    let params = Tensor::from_vec(words, (rows.len(), ROW_WORDS), device)?;
    let out = logits.contiguous()?.apply_op3_no_bwd(&params, seen, &RacePick)?.to_vec2::<u32>()?;
    Ok(out.iter().map(|w| Pick { token: w[0], logprob: f32::from_bits(w[1]), entropy: f32::from_bits(w[2]) }).collect())
}

/// The seen bits of rows whose entries `seen` yields, for a vocabulary of `vocab`.
pub fn seen_bits<'a>(rows: impl Iterator<Item = impl Iterator<Item = &'a u32>>, vocab: usize) -> (Vec<u32>, usize) {
    let width = vocab.div_ceil(32);
    let mut bits = Vec::new();
    for row in rows {
        let start = bits.len();
        bits.resize(start + width, 0);
        for &id in row.filter(|&&id| (id as usize) < vocab) {
            bits[start + id as usize / 32] |= 1 << (id % 32);
        }
    }
    (bits, width)
}

/// The race as a candle op: (R, V) logits (f32, or on a GPU bf16 too),
/// (R, ROW_WORDS) u32 rows and (R, W) u32 seen bits (read only for rows with
/// a penalty) give (R, 3) u32 [token, log-prob bits, entropy bits].
struct RacePick;

impl CustomOp3 for RacePick {
    fn name(&self) -> &'static str {
        "race-pick"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        l_l: &Layout,
        params: &CpuStorage,
        p_l: &Layout,
        seen: &CpuStorage,
        s_l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(z), CpuStorage::U32(p), CpuStorage::U32(s)) = (logits, params, seen) else {
            candle_core::bail!("race-pick: expected f32 logits and u32 rows and seen bits")
        };
        let (Some((z0, z1)), Some((p0, p1)), Some((s0, s1))) =
            (l_l.contiguous_offsets(), p_l.contiguous_offsets(), s_l.contiguous_offsets())
        else {
            candle_core::bail!("race-pick: inputs must be contiguous")
        };
        let (rows, vocab) = l_l.shape().dims2()?;
        let width = s_l.shape().dims2()?.1;
        let (z, p, s) = (&z[z0..z1], &p[p0..p1], &s[s0..s1]);
        let out: Vec<u32> = (0..rows)
            .into_par_iter()
            .flat_map_iter(|r| {
                let seen = s.get(r * width..(r + 1) * width);
                let pick = pick_row(&z[r * vocab..(r + 1) * vocab], seen, &RaceRow::from_words(&p[r * ROW_WORDS..]));
                [pick.token, pick.logprob.to_bits(), pick.entropy.to_bits()]
            })
            .collect();
        Ok((CpuStorage::U32(out), Shape::from((rows, 3))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        l_l: &Layout,
        params: &candle_core::CudaStorage,
        p_l: &Layout,
        seen: &candle_core::CudaStorage,
        s_l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let rows = l_l.shape().dims2()?.0;
        let out = crate::model::kernels::cuda::race_pick((logits, l_l), (params, p_l), (seen, s_l))?;
        Ok((out, Shape::from((rows, 3))))
    }
}

#[cfg(test)]
mod tests {
    use super::super::sampling::Scratch;
    use super::*;

    fn row(sampling: &Sampling, seed: u64) -> RaceRow {
        RaceRow::new(sampling, 1.0, &Rng::new(seed), 0)
    }

    /// How often each entry wins over `n` draws (one key per draw).
    fn counts(sampling: &Sampling, logits: &[f32], n: u64) -> Vec<usize> {
        let mut counts = vec![0; logits.len()];
        for i in 0..n {
            counts[pick_row(logits, None, &row(sampling, i)).token as usize] += 1;
        }
        counts
    }

    #[test]
    fn exponential_draws_are_finite_positive_with_mean_one() {
        assert!(exponential(0) > 0.0 && -exponential(0).ln() < MAX_GUMBEL);
        let n = 200_000u32;
        let mean: f64 = (0..n).map(|i| exponential(philox([i, 0, 0, 0], [1, 2])[0]) as f64).sum::<f64>() / n as f64;
        assert!((mean - 1.0).abs() < 0.01, "{mean}");
    }

    #[test]
    fn ordered_bits_follow_the_values() {
        let xs = [f32::NEG_INFINITY, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, f32::INFINITY];
        for w in xs.windows(2) {
            assert!(ordered(w[0]) <= ordered(w[1]), "{w:?}");
        }
    }

    #[test]
    fn the_race_draws_from_the_tempered_distribution() {
        let logits = [0.0f32, (3f32).ln()];
        let c = counts(&Sampling::temperature(1.0), &logits, 20_000);
        assert!((c[1] as f64 / 20_000.0 - 0.75).abs() < 0.015, "{c:?}");
        let c = counts(&Sampling::temperature(2.0), &logits, 20_000);
        let want = 3f64.sqrt() / (1.0 + 3f64.sqrt());
        assert!((c[1] as f64 / 20_000.0 - want).abs() < 0.015, "{c:?}");
        // Over a wide vocabulary too (the noise of entry j is word j % 4 of block j / 4).
        let logits: Vec<f32> = (0..64).map(|j| ((j * 7919) % 13) as f32 * 0.3).collect();
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let c = counts(&Sampling::temperature(1.0), &logits, 40_000);
        for (j, &n) in c.iter().enumerate() {
            let p = (logits[j] as f64).exp() / z;
            assert!((n as f64 / 40_000.0 - p).abs() < 4.0 * (p / 40_000.0).sqrt() + 1e-3, "entry {j}: {n} for p {p}");
        }
    }

    #[test]
    fn picks_carry_the_host_samplers_logprob_and_entropy_and_greedy_its_token() {
        let logits = [0.3f32, 2.0, -1.0, 2.0, 0.5];
        let mut scratch = Scratch::default();
        for sampling in [Sampling::greedy(), Sampling::temperature(0.7)] {
            let host = sampling.pick(&logits, &mut Rng::new(1), &mut scratch);
            let race = pick_row(&logits, None, &row(&sampling, 1));
            assert!((host.entropy - race.entropy).abs() < 1e-6, "{sampling:?}");
            let inv_t = 1.0 / sampling.logprob_temperature();
            let z: f64 = logits.iter().map(|&l| ((l * inv_t) as f64).exp()).sum();
            let want = ((logits[race.token as usize] * inv_t) as f64).exp() / z;
            assert!((race.logprob as f64 - want.ln()).abs() < 1e-5, "{sampling:?}");
            if sampling == Sampling::Greedy {
                // The first of the tied maxima.
                assert_eq!((race.token, race), (1, host));
            }
        }
    }

    #[test]
    fn truncations_keep_what_the_host_sampler_keeps() {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let s = Sampling::temperature(1.0);
        assert_eq!(counts(&s.clone().with_top_k(2), &logits, 2000)[2..], [0, 0]);
        // top_p 0.79: 0.5 + 0.3 reaches it (0.8 sits on rounding's edge); 0.81 needs the third.
        assert_eq!(counts(&s.clone().with_top_p(0.79), &logits, 2000)[2..], [0, 0]);
        let c = counts(&s.clone().with_top_p(0.81), &logits, 4000);
        assert!(c[2] > 0 && c[3] == 0, "{c:?}");
        // top-p among top-k's: 0.5 and 0.3 renormalise to 0.625 and 0.375,
        // so 0.6 keeps one and 0.7 both.
        assert_eq!(counts(&s.clone().with_top_k(2).with_top_p(0.6), &logits, 500)[0], 500);
        let c = counts(&s.clone().with_top_k(2).with_top_p(0.7), &logits, 2000);
        assert!(c[1] > 0 && c[2..] == [0, 0], "{c:?}");
        // min_p 0.2: keep p >= 0.1.
        let c = counts(&s.clone().with_min_p(0.2), &logits, 4000);
        assert!(c[2] > 0 && c[3] == 0, "{c:?}");
        // A tiny top_p keeps only the most likely.
        assert_eq!(counts(&s.with_top_p(1e-6), &logits, 100)[0], 100);
    }

    /// The CUDA kernel finds its thresholds one bit at a time from the top
    /// (`race_search`): the largest tau >= floor whose upper count or mass
    /// reaches the target.
    fn bit_search(u: &[f32], floor: u32, target: f64, mass: bool) -> u32 {
        let upper = |tau: u32| -> f64 {
            u.iter().filter(|&&x| ordered(x) >= tau).map(|&x| if mass { x.exp() as f64 } else { 1.0 }).sum()
        };
        let mut tau = 0u32;
        for bit in (0..32).rev() {
            if upper((tau | 1 << bit).max(floor)) >= target {
                tau |= 1 << bit;
            }
        }
        tau.max(floor)
    }

    #[test]
    fn the_kernels_bit_search_finds_the_thresholds_of_the_sort() {
        let mut rng = Rng::new(4);
        for _ in 0..40 {
            let mut u: Vec<f32> = (0..300).map(|_| (rng.normal() * 3.0) as f32).collect();
            u[7] = u[5]; // a tie
            let m = u.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            u.iter_mut().for_each(|x| *x -= m);
            for (top_k, top_p) in [(10, 1.0), (0, 0.9), (25, 0.7), (300, 0.5), (1, 0.3), (0, 1.0)] {
                let r = RaceRow { top_k, top_p, ..row(&Sampling::temperature(1.0), 0) };
                let mut floor = 0;
                if top_k > 0 && (top_k as usize) < u.len() {
                    floor = bit_search(&u, 0, top_k as f64, false);
                }
                if top_p < 1.0 {
                    let total: f64 = u.iter().filter(|&&x| ordered(x) >= floor).map(|&x| x.exp() as f64).sum();
                    floor = bit_search(&u, floor, top_p as f64 * total, true);
                }
                assert_eq!(floor, threshold(&u, &r), "top_k {top_k}, top_p {top_p}");
            }
        }
    }

    #[test]
    fn the_penalty_applies_to_seen_entries_once() {
        let logits = [2.0f32, -1.0, 0.5, 3.0];
        let (bits, _) = seen_bits([[3u32, 3].iter()].into_iter(), 4);
        let mut r = row(&Sampling::greedy(), 0);
        r.penalty = 2.0;
        // 3.0 / 2 = 1.5 falls below 2.0.
        assert_eq!(pick_row(&logits, Some(&bits), &r).token, 0);
        let host = Sampling::greedy().pick_penalized(&logits, [3], 2.0, &mut Rng::new(0), &mut Scratch::default());
        assert_eq!(pick_row(&logits, Some(&bits), &r), host);
        r.penalty = 1.0;
        assert_eq!(pick_row(&logits, Some(&bits), &r).token, 3);
    }

    #[test]
    fn a_draw_depends_on_its_key_and_step_only() {
        let logits: Vec<f32> = (0..1000).map(|j| ((j * 31) % 17) as f32 * 0.1).collect();
        let s = Sampling::temperature(1.0).with_top_k(50);
        let rows: Vec<RaceRow> =
            (0..40).map(|i| RaceRow::new(&s, 1.0, &Rng::stream(5, &[i / 4, i % 4]), i as usize % 7)).collect();
        let batch = Tensor::from_vec(logits.repeat(rows.len()), (rows.len(), 1000), &candle_core::Device::Cpu).unwrap();
        let together = pick(&batch, &rows, None).unwrap();
        let alone: Vec<Pick> = rows.iter().map(|r| pick_row(&logits, None, r)).collect();
        assert_eq!(together, alone);
        let reversed: Vec<RaceRow> = rows.iter().rev().copied().collect();
        let mut back = pick(&batch, &reversed, None).unwrap();
        back.reverse();
        assert_eq!(back, alone);
        // Different keys or steps draw differently.
        let tokens: std::collections::BTreeSet<u32> = together.iter().map(|p| p.token).collect();
        assert!(tokens.len() > 10, "{tokens:?}");
    }

    #[test]
    fn the_sampler_is_named_or_defaults_by_device() {
        let cpu = candle_core::Device::Cpu;
        assert_eq!(Sampler::parse(None, &cpu).unwrap(), Sampler::Host);
        assert_eq!(Sampler::parse(Some("race"), &cpu).unwrap(), Sampler::Race);
        assert_eq!(Sampler::parse(Some("host"), &cpu).unwrap(), Sampler::Host);
        assert!(Sampler::parse(Some("gpu"), &cpu).unwrap_err().to_string().contains(SAMPLER_VAR));
    }
}
