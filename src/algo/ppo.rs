//! PPO's numbers, as TRL's PPOTrainer and "The N+ Implementation Details of
//! RLHF with PPO" compute them: per-token rewards, generalised advantage
//! estimation, whitening over a batch's tokens, and the clipped value loss.
//!
//! Per-token values are ragged: one `Vec` per completion, as long as it.

use candle_core::{Result, Tensor};

use crate::model::readback::{HostValues, Readback, Slot};

/// `r_t = -beta * kl_t` on every token, with the score added at the last
/// token. A completion with no tokens has no rewards (its score is lost,
/// as there is no action to credit).
pub fn token_rewards(scores: &[f32], kl: &[Vec<f32>], beta: f32) -> Vec<Vec<f32>> {
    scores
        .iter()
        .zip(kl)
        .map(|(&score, kl)| {
            let mut r: Vec<f32> = kl.iter().map(|&k| -beta * k).collect();
            if let Some(last) = r.last_mut() {
                *last += score;
            }
            r
        })
        .collect()
}

/// Generalised advantage estimation, per completion, back to front:
/// `delta_t = r_t + gamma * V_{t+1} - V_t` (`V` past the last token is 0),
/// `A_t = delta_t + gamma * lam * A_{t+1}`; returns are `A_t + V_t`.
/// Gives (advantages, returns).
pub fn gae(rewards: &[Vec<f32>], values: &[Vec<f32>], gamma: f32, lam: f32) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut advantages = Vec::with_capacity(rewards.len());
    let mut returns = Vec::with_capacity(rewards.len());
    for (r, v) in rewards.iter().zip(values) {
        assert_eq!(r.len(), v.len(), "one value per reward");
        let mut adv = vec![0f32; r.len()];
        let mut last = 0f32;
        for t in (0..r.len()).rev() {
            let next = v.get(t + 1).copied().unwrap_or(0.0);
            let delta = r[t] + gamma * next - v[t];
            last = delta + gamma * lam * last;
            adv[t] = last;
        }
        returns.push(adv.iter().zip(v).map(|(a, v)| a + v).collect());
        advantages.push(adv);
    }
    (advantages, returns)
}

/// Whitens every token of `rows` together: `(x - mean) / sqrt(var + 1e-8)`
/// with the unbiased variance (TRL's `masked_whiten`). With `shift_mean =
/// false` the mean is added back (TRL's reward whitening).
pub fn whiten_tokens(rows: &mut [Vec<f32>], shift_mean: bool) {
    let xs: Vec<f64> = rows.iter().flatten().map(|&x| x as f64).collect();
    let Some((mean, std)) = crate::stats::mean_std(&xs, crate::stats::Deviation::Sample) else { return };
    let scale = 1.0 / (std * std + 1e-8).sqrt();
    let back = if shift_mean { 0.0 } else { mean };
    for x in rows.iter_mut().flatten() {
        *x = ((*x as f64 - mean) * scale + back) as f32;
    }
}

/// Ragged rows padded with zeros into an (N, width) tensor.
pub fn padded(rows: &[Vec<f32>], width: usize, device: &candle_core::Device) -> Result<Tensor> {
    let data: Vec<f32> =
        rows.iter().flat_map(|r| r.iter().copied().chain(std::iter::repeat(0.0)).take(width)).collect();
    Tensor::from_vec(data, (rows.len(), width), device)
}

/// The value loss of one (micro-)batch and its diagnostics.
pub struct ValueLoss {
    /// Scalar, differentiable in the predicted values.
    pub loss: Tensor,
    /// What the diagnostics are summed from, still on the loss's device.
    pub diagnostics: ValueDiagnostics,
}

/// Detached per-token values of a value loss, (N, T).
pub struct ValueDiagnostics {
    mask: Tensor,
    unclipped: Tensor,
    clipped: Tensor,
    per_token: Tensor,
    vpred: Tensor,
}

/// [`ValueDiagnostics`] queued on a [`Readback`].
pub struct QueuedValueStats([Slot; 5]);

impl ValueDiagnostics {
    pub fn queue(&self, readback: &mut Readback) -> Result<QueuedValueStats> {
        let mut push = |t: &Tensor| readback.push(t);
        Ok(QueuedValueStats([
            push(&self.mask)?,
            push(&self.unclipped)?,
            push(&self.clipped)?,
            push(&self.per_token)?,
            push(&self.vpred)?,
        ]))
    }

    /// The sums, read now.
    pub fn read(&self) -> Result<ValueStats> {
        let mut readback = Readback::default();
        let queued = self.queue(&mut readback)?;
        Ok(queued.stats(&readback.read()?))
    }
}

impl QueuedValueStats {
    /// The sums over unmasked tokens, in token order.
    pub fn stats(&self, host: &HostValues) -> ValueStats {
        let [m, un, cl, term, v] = self.0.map(|s| host.get(s));
        let mut stats = ValueStats::default();
        for i in (0..m.len()).filter(|&i| m[i] > 0.0) {
            stats.tokens += 1.0;
            stats.clipped += f64::from(cl[i] > un[i]);
            stats.loss_sum += term[i] as f64;
            stats.vpred_sum += v[i] as f64;
            stats.error_sum += un[i] as f64;
        }
        stats
    }
}

/// Sums over unmasked tokens, added up across micro-batches.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ValueStats {
    pub tokens: f64,
    /// Tokens where the clipped prediction gave the larger error.
    pub clipped: f64,
    /// Sum of `0.5 * max(err^2, err_clipped^2)`.
    pub loss_sum: f64,
    pub vpred_sum: f64,
    /// Sum of `(vpred - return)^2`.
    pub error_sum: f64,
}

impl ValueStats {
    pub fn add(&mut self, other: &ValueStats) {
        self.tokens += other.tokens;
        self.clipped += other.clipped;
        self.loss_sum += other.loss_sum;
        self.vpred_sum += other.vpred_sum;
        self.error_sum += other.error_sum;
    }
    pub fn clipfrac(&self) -> f64 {
        self.clipped / self.tokens.max(1.0)
    }
    pub fn loss_mean(&self) -> f64 {
        self.loss_sum / self.tokens.max(1.0)
    }
    pub fn vpred_mean(&self) -> f64 {
        self.vpred_sum / self.tokens.max(1.0)
    }
    pub fn error_mean(&self) -> f64 {
        self.error_sum / self.tokens.max(1.0)
    }
}

/// Clipped value loss `0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`
/// summed over unmasked tokens and divided by `denominator` (the
/// mini-batch's unmasked tokens, so micro-batches add up to its mean).
/// All inputs (N, T); only `vpred` carries gradients.
pub fn value_loss(
    vpred: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    cliprange_value: f64,
    denominator: f64,
) -> Result<ValueLoss> {
    let clipped_pred = vpred.broadcast_maximum(&(old_values - cliprange_value)?)?;
    let clipped_pred = clipped_pred.broadcast_minimum(&(old_values + cliprange_value)?)?;
    let unclipped = (vpred - returns)?.sqr()?;
    let clipped = (clipped_pred - returns)?.sqr()?;
    let per_token = (unclipped.maximum(&clipped)? * 0.5)?;
    let loss = ((&per_token * mask)?.sum_all()? / denominator.max(1.0))?;

    let diagnostics = ValueDiagnostics {
        mask: mask.detach(),
        unclipped: unclipped.detach(),
        clipped: clipped.detach(),
        per_token: per_token.detach(),
        vpred: vpred.detach(),
    };
    Ok(ValueLoss { loss, diagnostics })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn close(a: &[Vec<f32>], b: &[Vec<f32>]) {
        for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
            assert!((x - y).abs() < 1e-5, "{a:?} != {b:?}");
        }
        assert_eq!(a.iter().map(Vec::len).collect::<Vec<_>>(), b.iter().map(Vec::len).collect::<Vec<_>>());
    }

    /// Two completions of 3 and 2 tokens, beta = 0.1, gamma = 0.9, lam = 0.5.
    #[test]
    fn gae_on_a_hand_computed_batch() {
        let kl = vec![vec![1.0, 0.0, 2.0], vec![-1.0, 1.0]];
        let rewards = token_rewards(&[1.0, -1.0], &kl, 0.1);
        // r = -0.1 kl, plus the score on the last token.
        close(&rewards, &[vec![-0.1, 0.0, 0.8], vec![0.1, -1.1]]);
        let values = vec![vec![0.5, 0.4, 0.3], vec![0.2, -0.5]];
        let (adv, ret) = gae(&rewards, &values, 0.9, 0.5);
        // Sequence 1, back to front (V past the end is 0):
        //   t=2: delta = 0.8 - 0.3 = 0.5;                 A = 0.5
        //   t=1: delta = 0.0 + 0.9*0.3 - 0.4 = -0.13;     A = -0.13 + 0.45*0.5 = 0.095
        //   t=0: delta = -0.1 + 0.9*0.4 - 0.5 = -0.24;    A = -0.24 + 0.45*0.095 = -0.19725
        // Sequence 2:
        //   t=1: delta = -1.1 - (-0.5) = -0.6;            A = -0.6
        //   t=0: delta = 0.1 + 0.9*(-0.5) - 0.2 = -0.55;  A = -0.55 + 0.45*(-0.6) = -0.82
        close(&adv, &[vec![-0.19725, 0.095, 0.5], vec![-0.82, -0.6]]);
        close(&ret, &[vec![0.30275, 0.495, 0.8], vec![-0.62, -1.1]]);
        // gamma = lam = 1 with zero values: the return is the sum of rewards to go.
        let zeros = vec![vec![0.0; 3], vec![0.0; 2]];
        let (adv, _) = gae(&rewards, &zeros, 1.0, 1.0);
        close(&adv, &[vec![0.7, 0.8, 0.8], vec![-1.0, -1.1]]);
    }

    #[test]
    fn whitening_uses_every_token_and_the_unbiased_variance() {
        let mut rows = vec![vec![1.0, 2.0, 3.0], vec![4.0]];
        whiten_tokens(&mut rows, true);
        // mean 2.5, unbiased variance 5/3.
        let s = (5.0f32 / 3.0).sqrt();
        close(&rows, &[vec![-1.5 / s, -0.5 / s, 0.5 / s], vec![1.5 / s]]);
        let mut rows = vec![vec![1.0, 3.0]];
        whiten_tokens(&mut rows, false);
        // mean 2, variance 2: (x - 2) / sqrt(2) + 2.
        close(&rows, &[vec![2.0 - 1.0 / 2f32.sqrt(), 2.0 + 1.0 / 2f32.sqrt()]]);
    }

    #[test]
    fn value_loss_takes_the_larger_of_the_clipped_and_unclipped_errors() {
        let dev = Device::Cpu;
        let t = |v: &[f32]| Tensor::from_vec(v.to_vec(), (1, v.len()), &dev).unwrap();
        // Token 0: V = 1.0, V_old = 0.0, R = 2.0, c = 0.2: clipped V = 0.2.
        //   unclipped (1 - 2)^2 = 1, clipped (0.2 - 2)^2 = 3.24 -> 0.5 * 3.24 = 1.62, clipped.
        // Token 1: V = 0.1, V_old = 0.0, R = -1.0: inside the range, both 1.21 -> 0.605.
        // Token 2: V = -3.0, V_old = 0.0, R = 0.0: clipped -0.2 gives 0.04 < 9 -> 4.5.
        // Token 3: masked.
        let vpred = candle_core::Var::from_tensor(&t(&[1.0, 0.1, -3.0, 7.0])).unwrap();
        let out = value_loss(
            vpred.as_tensor(),
            &t(&[0.0; 4]),
            &t(&[2.0, -1.0, 0.0, 0.0]),
            &t(&[1.0, 1.0, 1.0, 0.0]),
            0.2,
            3.0,
        )
        .unwrap();
        let loss = out.loss.to_scalar::<f32>().unwrap();
        assert!((loss - (1.62 + 0.605 + 4.5) / 3.0).abs() < 1e-5, "{loss}");
        let stats = out.diagnostics.read().unwrap();
        assert_eq!(stats.tokens, 3.0);
        assert_eq!(stats.clipped, 1.0);
        assert!((stats.error_mean() - (1.0 + 1.21 + 9.0) / 3.0).abs() < 1e-5);
        assert!((stats.vpred_mean() - (1.0 + 0.1 - 3.0) / 3.0).abs() < 1e-6);
        // The gradient flows through the unclipped error only where it is the larger one:
        // token 0 is clipped (no gradient), token 1: (V - R) / 3, token 2: (V - R) / 3.
        let grads = out.loss.backward().unwrap();
        let g: Vec<f32> = grads.get(&vpred).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let want = [0.0, 1.1 / 3.0, -3.0 / 3.0, 0.0];
        for (a, b) in g.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{g:?}");
        }
    }
}
