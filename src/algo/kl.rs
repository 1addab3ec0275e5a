//! KL to the reference model (docs/algorithm.md section 2).

use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};

/// Per-token estimators of KL(policy || reference) from the log-ratio
/// `d = lp - lp_ref` of sampled tokens (Schulman, "Approximating KL
/// divergence").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `k1 = d`: unbiased, can be negative per token.
    #[default]
    K1,
    /// `k2 = d^2 / 2`.
    K2,
    /// `k3 = exp(-d) - 1 + d`: unbiased and non-negative.
    K3,
}

/// Where the KL penalty acts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlPlacement {
    /// Subtracted from the score: `R_i = s_i - beta * sum_t m_t kl_t` (TRL, the RLOO paper).
    #[default]
    Reward,
    /// Added to the loss on the current policy: `+ beta * mean_t kl_t` (GRPO-style).
    Loss,
}

/// Per-token KL estimate, elementwise over any shape; differentiable in `lp`.
pub fn kl_per_token(lp: &Tensor, lp_ref: &Tensor, estimator: KlEstimator) -> Result<Tensor> {
    let d = (lp - lp_ref)?;
    match estimator {
        KlEstimator::K1 => Ok(d),
        KlEstimator::K2 => d.sqr()? * 0.5,
        KlEstimator::K3 => (d.neg()?.exp()? - 1.0)? + d,
    }
}

/// Sequence KL `KL_i = sum_t m_t kl_t`: (N, T) tokens and mask -> (N,).
pub fn sequence_kl(kl: &Tensor, mask: &Tensor) -> Result<Tensor> {
    (kl * mask)?.sum(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn estimators_match_hand_computed_values() {
        let dev = Device::Cpu;
        let lp = Tensor::new(&[[-1.0f32, -2.0, -0.5]], &dev).unwrap();
        let lp_ref = Tensor::new(&[[-1.5f32, -1.0, -0.5]], &dev).unwrap();
        // d = [0.5, -1.0, 0.0]
        let get = |e| kl_per_token(&lp, &lp_ref, e).unwrap().to_vec2::<f32>().unwrap()[0].clone();
        assert_eq!(get(KlEstimator::K1), vec![0.5, -1.0, 0.0]);
        assert_eq!(get(KlEstimator::K2), vec![0.125, 0.5, 0.0]);
        let k3 = get(KlEstimator::K3);
        let want = [(-0.5f32).exp() - 1.0 + 0.5, 1f32.exp() - 1.0 - 1.0, 0.0];
        for (a, b) in k3.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{k3:?}");
        }
        let mask = Tensor::new(&[[1.0f32, 1.0, 0.0]], &dev).unwrap();
        let seq = sequence_kl(&kl_per_token(&lp, &lp_ref, KlEstimator::K1).unwrap(), &mask).unwrap();
        assert_eq!(seq.to_vec1::<f32>().unwrap(), vec![-0.5]);
    }
}
