//! The clipped policy-gradient loss (docs/algorithm.md section 4) and its
//! diagnostics.

use candle_core::{DType, Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::model::readback::{HostValues, Readback, Slot};

/// Whether the importance ratio is taken per sequence or per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RatioLevel {
    /// `rho_i = exp(LP_i - LP_old_i)` with `LP = sum_t m_t lp_t`: the whole completion is one action.
    #[default]
    Sequence,
    /// `rho_{i,t} = exp(lp_t - lp_old_t)`, the advantage broadcast to every unmasked token.
    Token,
}

/// How per-sequence or per-token losses are averaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregation {
    /// Mean over tokens within a sequence (token ratio), then over sequences.
    #[default]
    SequenceMean,
    /// Mean over every unmasked token of the mini-batch (token ratio only).
    TokenMean,
    /// Every unmasked token's term summed, over a constant: the
    /// mini-batch's completions x `response_length`, so that neither a
    /// completion's length nor the batch's token count weighs its tokens
    /// (Dr. GRPO; TRL's `loss_type = "dr_grpo"`; token ratio only).
    TokenSumNorm,
}

impl Aggregation {
    /// Whether every unmasked token weighs the same (the terms are summed
    /// over tokens, not averaged within each sequence first).
    fn per_token(self) -> bool {
        matches!(self, Aggregation::TokenMean | Aggregation::TokenSumNorm)
    }
}

/// The ratio is clipped to `[1 - low, 1 + high]`; `high > low` lets
/// unlikely tokens that earn a positive advantage grow further before the
/// clip stops them (DAPO's clip-higher, TRL's `epsilon_high`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipRange {
    pub low: f64,
    pub high: f64,
}

impl ClipRange {
    pub fn symmetric(eps: f64) -> ClipRange {
        ClipRange { low: eps, high: eps }
    }
}

/// The loss of one (micro-)batch and the diagnostics TRL logs.
pub struct PolicyLoss {
    /// Scalar, differentiable in the current log-probs.
    pub loss: Tensor,
    /// What the diagnostics are summed from, still on the loss's device.
    pub diagnostics: LossDiagnostics,
}

/// Detached per-term values of a policy loss, (N,) or flattened (N, T):
/// read to the host when the caller chooses, and summed there in f64.
pub struct LossDiagnostics {
    /// 1 on live terms, 0 elsewhere.
    live: Tensor,
    rho: Tensor,
    unclipped: Tensor,
    clipped: Tensor,
    per_term: Tensor,
    /// (N,): 1 on sequences with an unmasked token.
    has_tokens: Tensor,
    /// (N,): `LP - LP_old` per sequence.
    log_ratio_seq: Tensor,
}

/// [`LossDiagnostics`] queued on a [`Readback`].
pub struct QueuedLossStats([Slot; 7]);

impl LossDiagnostics {
    pub fn queue(&self, readback: &mut Readback) -> Result<QueuedLossStats> {
        let mut push = |t: &Tensor| readback.push(t);
        Ok(QueuedLossStats([
            push(&self.live)?,
            push(&self.rho)?,
            push(&self.unclipped)?,
            push(&self.clipped)?,
            push(&self.per_term)?,
            push(&self.has_tokens)?,
            push(&self.log_ratio_seq)?,
        ]))
    }

    /// The sums, read now.
    pub fn read(&self) -> Result<LossStats> {
        let mut readback = Readback::default();
        let queued = self.queue(&mut readback)?;
        Ok(queued.stats(&readback.read()?))
    }
}

impl QueuedLossStats {
    /// The sums over live terms, in term order.
    pub fn stats(&self, host: &HostValues) -> LossStats {
        let [live, rho, un, cl, term, has, log_ratio] = self.0.map(|s| host.get(s));
        let mut stats = LossStats::default();
        for i in (0..live.len()).filter(|&i| live[i] > 0.0) {
            stats.terms += 1.0;
            stats.clipped += f64::from(cl[i] > un[i]);
            stats.ratio_sum += rho[i] as f64;
            stats.ratio_sq_sum += (rho[i] as f64).powi(2);
            stats.loss_sum += term[i] as f64;
        }
        for (h, d) in has.iter().zip(log_ratio) {
            if *h > 0.0 {
                stats.sequences += 1.0;
                stats.approxkl_sum += 0.5 * (*d as f64).powi(2);
            }
        }
        stats
    }
}

/// Sums (not means), so that micro-batches can be added up and divided once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LossStats {
    /// Number of ratio terms (sequences, or unmasked tokens).
    pub terms: f64,
    /// Terms where the clipped surrogate was the one taken.
    pub clipped: f64,
    pub ratio_sum: f64,
    pub ratio_sq_sum: f64,
    /// Sequences with at least one unmasked token.
    pub sequences: f64,
    /// Sum over sequences of `0.5 * (LP - LP_old)^2`.
    pub approxkl_sum: f64,
    /// Sum of the per-sequence (or per-token) losses.
    pub loss_sum: f64,
}

impl LossStats {
    pub fn add(&mut self, other: &LossStats) {
        self.terms += other.terms;
        self.clipped += other.clipped;
        self.ratio_sum += other.ratio_sum;
        self.ratio_sq_sum += other.ratio_sq_sum;
        self.sequences += other.sequences;
        self.approxkl_sum += other.approxkl_sum;
        self.loss_sum += other.loss_sum;
    }

    pub fn clipfrac(&self) -> f64 {
        self.clipped / self.terms.max(1.0)
    }
    pub fn ratio_mean(&self) -> f64 {
        self.ratio_sum / self.terms.max(1.0)
    }
    /// Population variance of the ratio.
    pub fn ratio_var(&self) -> f64 {
        (self.ratio_sq_sum / self.terms.max(1.0) - self.ratio_mean().powi(2)).max(0.0)
    }
    pub fn approxkl(&self) -> f64 {
        self.approxkl_sum / self.sequences.max(1.0)
    }
    pub fn loss_mean(&self) -> f64 {
        self.loss_sum / self.terms.max(1.0)
    }
}

/// Clipped surrogate `L = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`.
///
/// `lp`: (N, T) current log-probs (differentiable); `lp_old`: (N, T) of the
/// sampling policy; `mask`: (N, T) in {0, 1}; `adv`: (N,), or (N, T) per
/// token with the token ratio (PPO's GAE advantages). A sequence with
/// no unmasked token contributes nothing. `denominator` is the number of
/// terms the loss is averaged over: pass the mini-batch's count (sequences
/// or unmasked tokens) so that micro-batches accumulate to the mini-batch mean.
#[allow(clippy::too_many_arguments)]
pub fn policy_loss(
    lp: &Tensor,
    lp_old: &Tensor,
    mask: &Tensor,
    adv: &Tensor,
    clip: ClipRange,
    ratio: RatioLevel,
    aggregation: Aggregation,
    denominator: f64,
) -> Result<PolicyLoss> {
    if adv.rank() == 2 && ratio == RatioLevel::Sequence {
        candle_core::bail!("per-token advantages need the token ratio");
    }
    let lengths = mask.sum(1)?; // (N,)
    let has_tokens = lengths.gt(0.0)?.to_dtype(DType::F32)?;
    let seq_lp = (lp * mask)?.sum(1)?;
    let seq_lp_old = (lp_old * mask)?.sum(1)?;
    let log_ratio_seq = (&seq_lp - &seq_lp_old)?;

    // Per-term log-ratio, advantage and weight (1 on live terms, 0 elsewhere).
    let (log_ratio, adv_b, weight) = match ratio {
        RatioLevel::Sequence => (log_ratio_seq.clone(), adv.clone(), has_tokens.clone()),
        RatioLevel::Token => {
            let w = match aggregation {
                // Each token weighs 1/len, so a sequence's tokens sum to 1.
                Aggregation::SequenceMean => mask.broadcast_div(&lengths.maximum(1.0)?.unsqueeze(1)?)?,
                Aggregation::TokenMean | Aggregation::TokenSumNorm => mask.clone(),
            };
            let adv_t = match adv.rank() {
                2 => adv.clone(),
                _ => adv.unsqueeze(1)?.broadcast_as(lp.shape())?.contiguous()?,
            };
            ((lp - lp_old)?, adv_t, w)
        }
    };
    let rho = log_ratio.exp()?;
    let unclipped = (rho.neg()? * &adv_b)?;
    let clipped = (rho.clamp(1.0 - clip.low, 1.0 + clip.high)?.neg()? * &adv_b)?;
    let per_term = unclipped.maximum(&clipped)?; // -min(a, b) = max(-a, -b)
    let loss = ((&per_term * &weight)?.sum_all()? / denominator.max(1.0))?;

    let live = match ratio {
        RatioLevel::Sequence => has_tokens.clone(),
        RatioLevel::Token => mask.clone(),
    };
    // Detached, so that holding them does not hold the forward pass's graph.
    let diagnostics = LossDiagnostics {
        live: live.detach(),
        rho: rho.detach(),
        unclipped: unclipped.detach(),
        clipped: clipped.detach(),
        per_term: per_term.detach(),
        has_tokens: has_tokens.detach(),
        log_ratio_seq: log_ratio_seq.detach(),
    };
    Ok(PolicyLoss { loss, diagnostics })
}

/// A per-token penalty (such as KL in the loss) averaged the way the policy
/// loss is: within each sequence then over `denominator` sequences, or
/// summed over tokens and divided by `denominator` (`token_mean`,
/// `token_sum_norm`). `values`, `mask`: (N, T).
pub fn masked_mean_loss(
    values: &Tensor,
    mask: &Tensor,
    ratio: RatioLevel,
    aggregation: Aggregation,
    denominator: f64,
) -> Result<Tensor> {
    let masked = (values * mask)?;
    let total = match ratio {
        RatioLevel::Token if aggregation.per_token() => masked.sum_all()?,
        _ => masked.sum(1)?.div(&mask.sum(1)?.maximum(1.0)?)?.sum_all()?,
    };
    total / denominator.max(1.0)
}

/// What a mini-batch's loss is divided by: its live sequences, its
/// unmasked tokens for `token_mean`, or its completions x
/// `response_length` for `token_sum_norm` (0 when no token is live, which
/// skips the step). `lengths`: each completion's unmasked tokens.
pub fn loss_denominator(lengths: &[f32], ratio: RatioLevel, aggregation: Aggregation, response_length: usize) -> f64 {
    let live = lengths.iter().filter(|&&l| l > 0.0).count() as f64;
    match (ratio, aggregation) {
        (RatioLevel::Token, Aggregation::TokenMean) => lengths.iter().map(|&l| l as f64).sum(),
        (RatioLevel::Token, Aggregation::TokenSumNorm) if live > 0.0 => (lengths.len() * response_length) as f64,
        _ => live,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn lengths(mask: &Tensor) -> Vec<f32> {
        mask.sum(1).unwrap().to_vec1().unwrap()
    }

    /// Two prompts x two completions of up to 3 tokens; the last completion
    /// is fully masked.
    fn toy() -> (Var, Tensor, Tensor, Tensor) {
        let dev = Device::Cpu;
        let lp = Var::new(&[[-1.0f32, -2.0, -0.5], [-0.2, -0.3, -9.0], [-1.0, -1.0, -1.0], [-3.0, -3.0, -3.0]], &dev)
            .unwrap();
        let lp_old =
            Tensor::new(&[[-1.1f32, -2.0, -0.5], [-0.2, -0.1, -9.0], [-1.0, -1.0, -1.0], [-3.0, -3.0, -3.0]], &dev)
                .unwrap();
        let mask = Tensor::new(&[[1.0f32, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], &dev).unwrap();
        let adv = Tensor::new(&[2.0f32, -1.0, 0.5, 3.0], &dev).unwrap();
        (lp, lp_old, mask, adv)
    }

    #[test]
    fn sequence_ratio_loss_and_gradient_match_hand_computation() {
        let (lp, lp_old, mask, adv) = toy();
        let denom = loss_denominator(&lengths(&mask), RatioLevel::Sequence, Aggregation::SequenceMean, 3);
        assert_eq!(denom, 3.0, "the fully masked completion is not a term");
        let out = policy_loss(
            lp.as_tensor(),
            &lp_old,
            &mask,
            &adv,
            ClipRange::symmetric(0.2),
            RatioLevel::Sequence,
            Aggregation::SequenceMean,
            denom,
        )
        .unwrap();
        // Sequence log-ratios: 0.1, -0.2, 0.
        let r0 = 0.1f64.exp(); // 1.105, inside [0.8, 1.2]
        let r1 = (-0.2f64).exp(); // 0.819, also inside
        let want = (-(r0 * 2.0) + r1 * 1.0 + -0.5) / 3.0;
        let got = out.loss.to_scalar::<f32>().unwrap() as f64;
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        // d loss / d lp_{i,t} = -A_i * rho_i * m_t / 3 (unclipped terms).
        let grads = out.loss.backward().unwrap();
        let g = grads.get(&lp).unwrap().to_vec2::<f32>().unwrap();
        let expect = [[-2.0 * r0 / 3.0; 3], [r1 / 3.0, r1 / 3.0, 0.0], [-0.5 / 3.0, 0.0, 0.0], [0.0; 3]];
        for (row, want_row) in g.iter().zip(expect) {
            for (a, b) in row.iter().zip(want_row) {
                assert!((*a as f64 - b).abs() < 1e-6, "{g:?}");
            }
        }
        let stats = out.diagnostics.read().unwrap();
        assert_eq!(stats.terms, 3.0);
        assert_eq!(stats.clipped, 0.0);
        let approxkl = 0.5 * (0.01 + 0.04) / 3.0;
        assert!((stats.approxkl() - approxkl).abs() < 1e-6);
    }

    #[test]
    fn clipping_takes_the_pessimistic_term_and_stops_its_gradient() {
        let dev = Device::Cpu;
        let lp = Var::new(&[[0.0f32]], &dev).unwrap();
        let lp_old = Tensor::new(&[[-0.5f32]], &dev).unwrap(); // rho = e^0.5 = 1.65 > 1.2
        let mask = Tensor::new(&[[1.0f32]], &dev).unwrap();
        let adv = Tensor::new(&[1.0f32], &dev).unwrap();
        let out = policy_loss(
            lp.as_tensor(),
            &lp_old,
            &mask,
            &adv,
            ClipRange::symmetric(0.2),
            RatioLevel::Sequence,
            Aggregation::SequenceMean,
            1.0,
        )
        .unwrap();
        assert!((out.loss.to_scalar::<f32>().unwrap() + 1.2).abs() < 1e-6);
        let stats = out.diagnostics.read().unwrap();
        assert_eq!(stats.clipped, 1.0);
        let g = out.loss.backward().unwrap().get(&lp).unwrap().to_vec2::<f32>().unwrap()[0][0];
        assert_eq!(g, 0.0, "a clipped term has no gradient");
    }

    /// With eps_high = 0.28 > eps_low = 0.2 (DAPO's values), a ratio of
    /// 1.25 with a positive advantage is inside the range and keeps its
    /// gradient; with a negative advantage the lower bound 0.8 still clips
    /// a ratio of 0.75.
    #[test]
    fn asymmetric_clipping_lets_the_ratio_rise_further_than_it_falls() {
        let dev = Device::Cpu;
        let clip = ClipRange { low: 0.2, high: 0.28 };
        let lp = Var::new(&[[1.25f32.ln()], [0.75f32.ln()]], &dev).unwrap();
        let lp_old = Tensor::zeros((2, 1), DType::F32, &dev).unwrap();
        let mask = Tensor::ones((2, 1), DType::F32, &dev).unwrap();
        let adv = Tensor::new(&[1.0f32, -1.0], &dev).unwrap();
        let out = policy_loss(
            lp.as_tensor(),
            &lp_old,
            &mask,
            &adv,
            clip,
            RatioLevel::Sequence,
            Aggregation::SequenceMean,
            2.0,
        )
        .unwrap();
        // Terms: -min(1.25, 1.25) = -1.25; -min(-0.75, -0.8) = 0.8.
        assert!((out.loss.to_scalar::<f32>().unwrap() - (-1.25 + 0.8) / 2.0).abs() < 1e-6);
        let stats = out.diagnostics.read().unwrap();
        assert_eq!(stats.clipped, 1.0);
        let g = out.loss.backward().unwrap().get(&lp).unwrap().to_vec2::<f32>().unwrap();
        // d/d lp of -rho * A / 2 = -1.25 / 2 for the first; the clipped second has none.
        assert!((g[0][0] + 0.625).abs() < 1e-6 && g[1][0] == 0.0, "{g:?}");
        // Symmetric 0.2 clips the first too.
        let sym = policy_loss(
            lp.as_tensor(),
            &lp_old,
            &mask,
            &adv,
            ClipRange::symmetric(0.2),
            RatioLevel::Sequence,
            Aggregation::SequenceMean,
            2.0,
        )
        .unwrap();
        assert!((sym.loss.to_scalar::<f32>().unwrap() - (-1.2 + 0.8) / 2.0).abs() < 1e-6);
    }

    #[test]
    fn token_ratio_aggregations() {
        let (lp, lp_old, mask, adv) = toy();
        let loss = |aggregation, denominator| {
            let out = policy_loss(
                lp.as_tensor(),
                &lp_old,
                &mask,
                &adv,
                ClipRange::symmetric(0.2),
                RatioLevel::Token,
                aggregation,
                denominator,
            )
            .unwrap();
            out.loss.to_scalar::<f32>().unwrap() as f64
        };
        let r = |d: f64| d.exp();
        let tm = loss_denominator(&lengths(&mask), RatioLevel::Token, Aggregation::TokenMean, 3);
        assert_eq!(tm, 6.0);
        let want = (-2.0 * (r(0.1) + 1.0 + 1.0) + (1.0 + r(-0.2)) - 0.5) / 6.0;
        assert!((loss(Aggregation::TokenMean, tm) - want).abs() < 1e-6);
        let want = (-2.0 * (r(0.1) + 2.0) / 3.0 + (1.0 + r(-0.2)) / 2.0 - 0.5) / 3.0;
        assert!((loss(Aggregation::SequenceMean, 3.0) - want).abs() < 1e-6);
        // Dr. GRPO: the same token terms summed, over 4 completions x a
        // response_length of 5, whatever their lengths.
        let ts = loss_denominator(&lengths(&mask), RatioLevel::Token, Aggregation::TokenSumNorm, 5);
        assert_eq!(ts, 20.0);
        let want = (-2.0 * (r(0.1) + 1.0 + 1.0) + (1.0 + r(-0.2)) - 0.5) / 20.0;
        assert!((loss(Aggregation::TokenSumNorm, ts) - want).abs() < 1e-6);
        let none = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(loss_denominator(&lengths(&none), RatioLevel::Token, Aggregation::TokenSumNorm, 5), 0.0);
    }

    #[test]
    fn fully_masked_batches_give_zero_loss_and_zero_gradient() {
        let (lp, lp_old, _, adv) = toy();
        let mask = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
        let out = policy_loss(
            lp.as_tensor(),
            &lp_old,
            &mask,
            &adv,
            ClipRange::symmetric(0.2),
            RatioLevel::Sequence,
            Aggregation::SequenceMean,
            0.0,
        )
        .unwrap();
        assert_eq!(out.loss.to_scalar::<f32>().unwrap(), 0.0);
        let g = out
            .loss
            .backward()
            .unwrap()
            .get(&lp)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(g, 0.0);
        let stats = out.diagnostics.read().unwrap();
        assert_eq!(stats.terms, 0.0);
    }
}
