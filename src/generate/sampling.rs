//! Choosing the next token from one row of logits: greedy, or sampling at a
//! temperature with top-k, top-p (nucleus) and min-p truncation, applied in
//! transformers' order (temperature, top-k, top-p, min-p).

use crate::model::kernels::math::{exp, max, with_avx2};
use crate::rng::Rng;

#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    /// The most likely token (ties: the lowest id, as `argmax` does).
    Greedy,
    Random {
        /// Logits are divided by this before the softmax (> 0).
        temperature: f32,
        /// Keep the k most likely tokens (0: all).
        top_k: usize,
        /// Keep the smallest set whose probability reaches top_p (1: all).
        top_p: f32,
        /// Drop tokens less likely than min_p times the most likely (0: none).
        min_p: f32,
    },
}

impl Sampling {
    pub fn greedy() -> Self {
        Self::Greedy
    }

    /// Plain sampling from the temperature-scaled distribution.
    pub fn temperature(temperature: f32) -> Self {
        Self::Random { temperature, top_k: 0, top_p: 1.0, min_p: 0.0 }
    }

    pub fn with_top_k(self, k: usize) -> Self {
        match self {
            Self::Random { temperature, top_p, min_p, .. } => Self::Random { temperature, top_k: k, top_p, min_p },
            greedy => greedy,
        }
    }

    pub fn with_top_p(self, p: f32) -> Self {
        match self {
            Self::Random { temperature, top_k, min_p, .. } => Self::Random { temperature, top_k, top_p: p, min_p },
            greedy => greedy,
        }
    }

    pub fn with_min_p(self, p: f32) -> Self {
        match self {
            Self::Random { temperature, top_k, top_p, .. } => Self::Random { temperature, top_k, top_p, min_p: p },
            greedy => greedy,
        }
    }

    /// The temperature log-probs are taken at (1 for greedy).
    pub fn logprob_temperature(&self) -> f32 {
        match self {
            Self::Greedy => 1.0,
            Self::Random { temperature, .. } => *temperature,
        }
    }

    /// Checks the ranges; the message names the offending option.
    pub fn validate(&self) -> Result<(), String> {
        if let Self::Random { temperature, top_p, min_p, .. } = self {
            if !(temperature.is_finite() && *temperature > 0.0) {
                return Err(format!("temperature must be > 0 for sampling, got {temperature}"));
            }
            if !(*top_p > 0.0 && *top_p <= 1.0) {
                return Err(format!("top_p must be in (0, 1], got {top_p}"));
            }
            if !(0.0..1.0).contains(min_p) {
                return Err(format!("min_p must be in [0, 1), got {min_p}"));
            }
        }
        Ok(())
    }

    /// [`pick`](Self::pick) after a repetition penalty over `seen` (1: none).
    /// The log-prob and entropy are then those of the penalised distribution.
    pub fn pick_penalized(
        &self,
        logits: &[f32],
        seen: impl IntoIterator<Item = u32>,
        penalty: f32,
        rng: &mut Rng,
        scratch: &mut Scratch,
    ) -> Pick {
        let mut buf = std::mem::take(&mut scratch.penalized);
        let pick = self.pick(with_penalty(logits, seen, penalty, &mut buf), rng, scratch);
        scratch.penalized = buf;
        pick
    }

    /// Picks a token from `logits`. Its log-probability and the entropy are
    /// those of the temperature-scaled distribution before truncation (the
    /// distribution the policy-gradient math refers to). `scratch` is reused
    /// across calls to avoid allocating per token.
    pub fn pick(&self, logits: &[f32], rng: &mut Rng, scratch: &mut Scratch) -> Pick {
        let inv_t = 1.0 / self.logprob_temperature();
        let (top, s0, s1) = with_avx2(
            #[inline(always)]
            || {
                let top = max(logits);
                let (s0, s1) = weights(logits, top, inv_t, &mut scratch.weights);
                (top, s0, s1)
            },
        );
        let token = match *self {
            Self::Greedy => argmax(logits),
            Self::Random { top_k, top_p, min_p, .. } if top_k == 0 && top_p >= 1.0 && min_p <= 0.0 => {
                draw_dense(&scratch.weights, s0, rng)
            }
            Self::Random { top_k, top_p, min_p, .. } => {
                let cands = &mut scratch.candidates;
                cands.clear();
                cands.extend(scratch.weights.iter().copied().zip(0..));
                truncate(cands, top_k, top_p, min_p);
                let total: f64 = cands.iter().map(|&(p, _)| p as f64).sum();
                let last = cands.last().map_or(0, |&(_, id)| id);
                draw(cands.iter().copied(), total, rng, last)
            }
        };
        let log_norm = s0.ln();
        Pick {
            token,
            logprob: (logits[token as usize] - top) * inv_t - log_norm as f32,
            entropy: (log_norm - s1 / s0) as f32,
        }
    }
}

/// A sampled token with its log-prob and the entropy of the distribution
/// it was drawn from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    pub token: u32,
    pub logprob: f32,
    pub entropy: f32,
}

/// Buffers [`Sampling::pick`] reuses from token to token.
#[derive(Debug, Default)]
pub struct Scratch {
    weights: Vec<f32>,
    candidates: Vec<(f32, u32)>,
    penalized: Vec<f32>,
}

/// `logits` under a repetition penalty over `seen`: themselves when the
/// penalty is 1, else their penalised copy in `buf`.
pub fn with_penalty<'a>(
    logits: &'a [f32],
    seen: impl IntoIterator<Item = u32>,
    penalty: f32,
    buf: &'a mut Vec<f32>,
) -> &'a [f32] {
    if penalty == 1.0 {
        return logits;
    }
    penalize_repeats(logits, seen, penalty, buf);
    buf
}

/// transformers' `RepetitionPenaltyLogitsProcessor`: the logit of every
/// token in `seen` (the prompt and the completion so far) is divided by
/// `penalty` when positive and multiplied by it when negative, once however
/// often the token appeared. `out` gets the penalised copy of `logits`.
fn penalize_repeats(logits: &[f32], seen: impl IntoIterator<Item = u32>, penalty: f32, out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(logits);
    for id in seen {
        if let Some(&l) = logits.get(id as usize) {
            out[id as usize] = if l < 0.0 { l * penalty } else { l / penalty };
        }
    }
}

/// Fills `out` with the unnormalised probabilities `e^u`, u = (l - max) / T,
/// and returns S0 = sum e^u and S1 = sum u e^u: log Z = ln S0 and the
/// entropy is ln S0 - S1 / S0. Eight partial sums, so the loop vectorises.
#[inline(always)]
fn weights(logits: &[f32], max: f32, inv_t: f32, out: &mut Vec<f32>) -> (f64, f64) {
    out.clear();
    out.resize(logits.len(), 0.0);
    let (mut s0, mut s1) = ([0f32; 8], [0f32; 8]);
    let mut step = |o: &mut [f32], l: &[f32]| {
        for j in 0..l.len() {
            let u = (l[j] - max) * inv_t;
            let e = exp(u);
            o[j] = e;
            s0[j] += e;
            s1[j] += u * e;
        }
    };
    let whole = logits.len() / 8 * 8;
    for (o, l) in out[..whole].chunks_exact_mut(8).zip(logits[..whole].chunks_exact(8)) {
        step(o, l);
    }
    step(&mut out[whole..], &logits[whole..]);
    (s0.iter().map(|&x| x as f64).sum(), s1.iter().map(|&x| x as f64).sum())
}

/// Draws from `weights` (ids are positions) with the given total: skips
/// whole blocks of 8 by their sums, then walks the block it lands in.
fn draw_dense(weights: &[f32], total: f64, rng: &mut Rng) -> u32 {
    let mut u = rng.uniform() * total;
    let mut start = 0;
    for block in weights.chunks(8) {
        let sum: f32 = block.iter().sum();
        if u < sum as f64 {
            break;
        }
        u -= sum as f64;
        start += block.len();
    }
    let rest = weights[start.min(weights.len())..].iter().copied().zip(start as u32..);
    draw_from(rest, u, weights.len() as u32 - 1)
}

/// Draws from `(weight, id)` pairs with the given total; `fallback` when
/// rounding leaves the draw past the end.
fn draw(weights: impl Iterator<Item = (f32, u32)>, total: f64, rng: &mut Rng, fallback: u32) -> u32 {
    draw_from(weights, rng.uniform() * total, fallback)
}

/// The first id at which the running sum of weights passes `u`.
fn draw_from(weights: impl Iterator<Item = (f32, u32)>, mut u: f64, fallback: u32) -> u32 {
    for (p, id) in weights {
        u -= p as f64;
        if u < 0.0 {
            return id;
        }
    }
    fallback
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Keeps the candidates that survive top-k, then top-p, then min-p. The max
/// candidate always survives.
fn truncate(cands: &mut Vec<(f32, u32)>, top_k: usize, top_p: f32, min_p: f32) {
    let by_prob_desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if top_k > 0 && top_k < cands.len() {
        // Ties with the k-th value are kept, as transformers' `< kth` test does.
        cands.select_nth_unstable_by(top_k - 1, by_prob_desc);
        let kth = cands[top_k - 1].0;
        cands.retain(|&(p, _)| p >= kth);
    }
    if top_p < 1.0 {
        cands.sort_unstable_by(by_prob_desc);
        let total: f32 = cands.iter().map(|c| c.0).sum();
        let mut cum = 0.0;
        let mut keep = cands.len();
        for (i, c) in cands.iter().enumerate() {
            cum += c.0 / total;
            if cum >= top_p {
                keep = i + 1;
                break;
            }
        }
        cands.truncate(keep.max(1));
    }
    if min_p > 0.0 {
        let top = cands.iter().map(|c| c.0).fold(0.0, f32::max);
        cands.retain(|&(p, _)| p >= min_p * top);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draw(s: &Sampling, logits: &[f32], n: usize) -> Vec<usize> {
        let mut rng = Rng::new(3);
        let mut scratch = Scratch::default();
        let mut counts = vec![0; logits.len()];
        for _ in 0..n {
            counts[s.pick(logits, &mut rng, &mut scratch).token as usize] += 1;
        }
        counts
    }

    #[test]
    fn greedy_takes_the_argmax_with_its_logprob() {
        let logits = [0.0f32, 2.0, 1.0];
        let pick = Sampling::greedy().pick(&logits, &mut Rng::new(0), &mut Scratch::default());
        assert_eq!(pick.token, 1);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((pick.logprob - (2f32.exp() / z).ln()).abs() < 1e-6);
        let entropy: f32 = logits.iter().map(|l| -(l.exp() / z) * (l.exp() / z).ln()).sum();
        assert!((pick.entropy - entropy).abs() < 1e-6, "{} vs {entropy}", pick.entropy);
    }

    #[test]
    fn sampling_follows_the_tempered_distribution() {
        let logits = [0.0f32, (3f32).ln()];
        // temperature 1: p = (1/4, 3/4)
        let counts = draw(&Sampling::temperature(1.0), &logits, 20_000);
        assert!((counts[1] as f64 / 20_000.0 - 0.75).abs() < 0.015, "{counts:?}");
        // temperature 2 flattens: p ∝ (1, sqrt 3)
        let counts = draw(&Sampling::temperature(2.0), &logits, 20_000);
        let want = 3f64.sqrt() / (1.0 + 3f64.sqrt());
        assert!((counts[1] as f64 / 20_000.0 - want).abs() < 0.015, "{counts:?}");
        let pick = Sampling::temperature(2.0).pick(&logits, &mut Rng::new(0), &mut Scratch::default());
        assert!(pick.logprob < 0.0);
        // Entropy at T = 2 of p ∝ (1, sqrt 3).
        let p = [1.0 - want as f32, want as f32];
        let entropy: f32 = p.iter().map(|p| -p * p.ln()).sum();
        assert!((pick.entropy - entropy).abs() < 1e-6, "{} vs {entropy}", pick.entropy);
    }

    #[test]
    fn truncations_remove_the_unlikely_tail() {
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let s = Sampling::temperature(1.0);
        assert_eq!(draw(&s.clone().with_top_k(2), &logits, 2000)[2..], [0, 0]);
        // top_p 0.8: 0.5 + 0.3 reaches it.
        assert_eq!(draw(&s.clone().with_top_p(0.8), &logits, 2000)[2..], [0, 0]);
        // min_p 0.2: keep p >= 0.1.
        let c = draw(&s.clone().with_min_p(0.2), &logits, 4000);
        assert!(c[2] > 0 && c[3] == 0, "{c:?}");
        // A tiny top_p still keeps the most likely token.
        assert_eq!(draw(&s.with_top_p(1e-6), &logits, 100)[0], 100);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_once() {
        let logits = [2.0f32, -1.0, 0.5, 3.0];
        let mut out = Vec::new();
        // Token 1 seen twice is penalised once.
        penalize_repeats(&logits, [0, 1, 1], 2.0, &mut out);
        assert_eq!(out, [1.0, -2.0, 0.5, 3.0]);
        let greedy = Sampling::greedy();
        let (mut rng, mut scratch) = (Rng::new(0), Scratch::default());
        assert_eq!(greedy.pick_penalized(&logits, [], 2.0, &mut rng, &mut scratch).token, 3);
        // 3.0 / 2 = 1.5 falls below 2.0.
        assert_eq!(greedy.pick_penalized(&logits, [3], 2.0, &mut rng, &mut scratch).token, 0);
    }

    #[test]
    fn bad_ranges_are_named() {
        assert!(Sampling::temperature(0.0).validate().unwrap_err().contains("temperature"));
        assert!(Sampling::temperature(1.0).with_top_p(1.5).validate().unwrap_err().contains("top_p"));
        assert!(Sampling::temperature(1.0).with_min_p(1.0).validate().unwrap_err().contains("min_p"));
    }
}
