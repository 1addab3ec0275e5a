//! A small seeded generator (xoshiro256++ seeded through SplitMix64), kept in
//! the crate so that a seed gives the same samples on every build and
//! platform, whatever version of an RNG crate is around.

#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut state = seed;
        Self { s: [(); 4].map(|_| splitmix64(&mut state)) }
    }

    /// An independent stream for one item (e.g. one completion), so that its
    /// samples do not depend on which other items share its batch.
    pub fn stream(seed: u64, ids: &[u64]) -> Self {
        let mut state = seed;
        let mut mixed = splitmix64(&mut state);
        for &id in ids {
            state ^= id.wrapping_mul(0xD6E8_FEB8_6659_FD93);
            mixed ^= splitmix64(&mut state);
        }
        Self::new(mixed)
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniformly random order of `0..n` (Fisher-Yates).
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, (self.next_u64() % (i as u64 + 1)) as usize);
        }
        order
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform(); // (0, 1]
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * self.uniform()).cos()
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A host tensor of normal samples: inputs for checks and tests that
    /// come out the same on every run, where candle's `randn` is unseeded.
    pub fn normal_tensor(&mut self, shape: &[usize], mean: f32, std: f32) -> candle_core::Tensor {
        let values: Vec<f32> = (0..shape.iter().product()).map(|_| mean + std * self.normal() as f32).collect();
        candle_core::Tensor::from_vec(values, shape, &candle_core::Device::Cpu)
            .expect("as many values as the shape holds")
    }
}

/// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
/// 1, 2, 3", 2011): four random words from a counter and a key.
pub fn philox(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(0x9E37_79B9), k[1].wrapping_add(0xBB67_AE85)];
        }
        let p0 = 0xD251_1F53u64 * c[0] as u64;
        let p1 = 0xCD9E_8D57u64 * c[2] as u64;
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// The random streams drawn from a run's seed (the first word of
/// [`Rng::stream`]'s path), one name each, so that no two uses share a
/// stream by accident.
pub mod streams {
    /// RLOO: the sampler's seed of each rollout step (with the step).
    pub const ROLLOUT_SAMPLING: u64 = 0x6e6e;
    /// RLOO: the mini-batch order (with the step and the epoch).
    pub const MINIBATCH_ORDER: u64 = 0x0b5e;
    /// The prompts' order in each epoch (with the epoch).
    pub const PROMPT_ORDER: u64 = 0x5eed_da7a;
    /// SFT: the held-out rows, and each epoch's order (with the epoch + 1).
    pub const SFT_DATA: u64 = 0x5f7;
    /// Reward-model training: the held-out pairs and each epoch's order.
    pub const REWARD_DATA: u64 = 0x7e;
    /// A new sequence-classification head.
    pub const SCORE_HEAD_INIT: u64 = 0x5c0e;
    /// Randomly initialised weights (the built-in task's policy).
    pub const WEIGHT_INIT: u64 = 0x1a17;
    /// New LoRA `A` matrices, and the adapters' dropout masks.
    pub const LORA_INIT: u64 = 0x10ba;
    pub const LORA_DROPOUT: u64 = 0x10bd;
    /// The built-in task's rows, and its held-out titles.
    pub const TASK_DATA: u64 = 0x1bdb;
    pub const TASK_EVAL: u64 = 0xe7a1;
    /// `rloo data prepare`: each split's shuffle (with a hash of its name),
    /// and the validation hold-out.
    pub const PREPARE_SHUFFLE: u64 = 0x5b0f;
    pub const PREPARE_VALIDATION: u64 = 0x7a1d;
    /// Evaluation during training: the sampler's seed of the held-out answers.
    pub const EVAL_SAMPLING: u64 = 0xe7a5;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_gives_random123s_known_answers() {
        assert_eq!(philox([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        assert_eq!(
            philox([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::stream(7, &[1, 2]);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::stream(7, &[1, 2]);
                move |_| r.next_u64()
            })
            .collect();
        let c = Rng::stream(7, &[2, 1]).next_u64();
        assert_eq!(a, b);
        assert_ne!(a[0], c);
        let mut r = Rng::new(1);
        let mean = (0..10_000).map(|_| r.uniform()).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }
}
