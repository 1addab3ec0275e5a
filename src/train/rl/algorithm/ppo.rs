//! PPO, as TRL's PPOTrainer (docs/algorithm.md section 8): a critic (a
//! `*ForSequenceClassification` model with one label, its score head read
//! at every token), per-token rewards, GAE, whitened advantages, the
//! token-level clipped loss and a clipped value loss that trains the
//! critic. Checkpoints and the final output keep the critic in `critic/`.

use std::path::Path;

use candle_core::{Device, Tensor};

use super::{Algorithm, Batch, Entry, LiveRows, LossShape, Micro, PendingTally, Start, Tally, Targets, Trained};
use crate::algo::ppo::{gae, token_rewards, value_loss, whiten_tokens};
use crate::algo::{Aggregation, KlPlacement, RatioLevel};
use crate::error::{Error, Result};
use crate::model::hub::resolve_model;
use crate::model::layer_graphs::LayerGraphs;
use crate::model::readback::Readback;
use crate::model::scoring::{completion_values, completion_values_chunked, Sequences};
use crate::model::{HeadKind, Model, ModelConfig, Placement};
use crate::report::Metrics;
use crate::reward::RewardSpec;
use crate::train::config::{PpoSection, TrainConfig};

pub const ENTRY: Entry =
    Entry { name: "ppo", aliases: &["gae"], about: "PPO: a critic, GAE and a clipped value loss", check, start };

fn check(cfg: &TrainConfig) -> std::result::Result<(), String> {
    if cfg.rloo.k == 0 {
        return Err("rloo.k (--rloo_k) must be at least 1".into());
    }
    if cfg.rloo.kl_placement == KlPlacement::Loss {
        return Err("PPO puts the KL penalty into per-token rewards: rloo.kl_placement must be reward".into());
    }
    super::refuse_others_options(cfg, "ppo", &["the [ppo] options"])?;
    super::refuse_loss_options(cfg, "ppo", LOSS)
}

/// A token ratio averaged over the mini-batch's tokens, as TRL's PPOTrainer.
const LOSS: LossShape = LossShape { ratio: RatioLevel::Token, aggregation: Aggregation::TokenMean };

struct Ppo {
    critic: Critic,
    options: PpoSection,
    beta: f64,
    critic_learning_rate: f64,
}

fn start(s: &Start) -> Result<Box<dyn Algorithm>> {
    let critic = Critic::load(s.cfg, s.policy_dir, s.policy, s.device)?;
    let options = s.cfg.ppo.clone();
    let critic_learning_rate = options.critic_learning_rate.unwrap_or(s.cfg.train.learning_rate);
    Ok(Box::new(Ppo { critic, options, beta: s.cfg.rloo.kl_coef, critic_learning_rate }))
}

impl Algorithm for Ppo {
    fn loss(&self) -> LossShape {
        LOSS
    }

    fn rollout_values(&self, seqs: &Sequences, device: &Device, chunk: usize) -> Result<Option<Tensor>> {
        Ok(Some(completion_values_chunked(self.critic.model.frozen(), seqs, device, chunk)?))
    }

    fn targets(&self, batch: &Batch<'_>, metrics: &mut Metrics) -> Result<Targets> {
        let values = batch.values.expect("PPO's rollout values");
        let t = targets(&self.options, self.beta, batch.scores, batch.token_kl, values, batch.mask)?;
        metrics.set("objective/rlhf_reward", t.rlhf_reward);
        Ok(Targets { advantages: t.advantages, mask: t.mask, returns: Some(t.returns), values: Some(t.values) })
    }

    /// `vf_coef` times the clipped value loss, whose gradients reach the critic.
    fn extra_loss(&self, micro: &Micro<'_>, readback: &mut Readback) -> Result<Option<(Tensor, PendingTally)>> {
        let vpred = completion_values(self.critic.model.network(), micro.part, micro.device)?;
        let (Some(values), Some(returns)) = (&micro.targets.values, &micro.targets.returns) else {
            unreachable!("PPO's targets hold values and returns")
        };
        let (values, returns) = ((micro.rows)(values)?, (micro.rows)(returns)?);
        let o = &self.options;
        let v = value_loss(&vpred, &values, &returns, micro.mask, o.cliprange_value, micro.denominator)?;
        let queued = v.diagnostics.queue(readback)?;
        let tally: PendingTally = Box::new(move |host| {
            let stats = queued.stats(host);
            let mut tally = Tally::default();
            for (name, x) in [
                ("tokens", stats.tokens),
                ("clipped", stats.clipped),
                ("loss", stats.loss_sum),
                ("vpred", stats.vpred_sum),
                ("error", stats.error_sum),
            ] {
                tally.add(name, x);
            }
            tally
        });
        Ok(Some(((v.loss * o.vf_coef)?, tally)))
    }

    fn trained(&self) -> Vec<Trained<'_>> {
        vec![Trained { subdir: CRITIC_DIR, model: &self.critic.model, learning_rate: self.critic_learning_rate }]
    }

    fn trained_mut(&mut self) -> Vec<&mut Model> {
        vec![&mut self.critic.model]
    }

    fn record(&self, tally: &Tally, m: &mut Metrics) {
        let per_token = |name: &str| tally.get(name) / tally.get("tokens").max(1.0);
        m.set("loss/value_avg", per_token("loss"));
        m.set("val/clipfrac_avg", per_token("clipped"));
        m.set("val/vpred", per_token("vpred"));
        m.set("val/error", per_token("error"));
    }
}

/// Where a checkpoint and the output directory keep the critic.
const CRITIC_DIR: &str = "critic";

struct Critic {
    model: Model,
}

/// A rollout's PPO targets, all (N, Tc) like the policy's log-probs.
struct GaeTargets {
    /// Whitened GAE advantages; 0 on padding and on unscorable rows.
    advantages: Tensor,
    returns: Tensor,
    /// The critic's values at rollout time.
    values: Tensor,
    /// The completion mask without the unscorable rows, which teach nothing.
    mask: Tensor,
    /// Mean over completions of the summed per-token rewards.
    rlhf_reward: f64,
}

impl Critic {
    /// The critic `ppo.value_model` names, with a one-label head (a new one,
    /// seeded, on a causal LM).
    fn load(cfg: &TrainConfig, policy_dir: &Path, policy: &ModelConfig, device: &Device) -> Result<Critic> {
        let dir = match value_model_source(cfg)? {
            Source::Policy => policy_dir.to_path_buf(),
            Source::Dir(name) => resolve_model(&name)?,
        };
        let model = Model::load_with_head(
            &dir,
            Placement::new(device, cfg.train.dtype.dtype()),
            HeadKind::SequenceClassification { num_labels: 1 },
            cfg.train.seed,
        )?
        .with_dtype(cfg.train.dtype.dtype(), true)?
        .with_layer_graphs(LayerGraphs::for_training(cfg.train.gradient_checkpointing));
        if model.config().vocab_size() != policy.vocab_size() || !same_vocabulary(&dir, policy_dir) {
            return Err(Error::Invalid(format!(
                "the critic {} reads the policy's tokens, but its vocabulary differs from the policy's {}; \
                 set ppo.value_model = \"policy\" (--value_model_path policy) or a model with the policy's tokenizer",
                dir.display(),
                policy_dir.display()
            )));
        }
        tracing::info!("PPO critic from {}", dir.display());
        Ok(Critic { model })
    }
}

/// Advantages and returns of a rollout: per-token rewards `-beta kl_t`
/// plus the shaped score at the last token, GAE over the critic's
/// `values`, advantages whitened over the batch's tokens.
fn targets(
    ppo: &PpoSection,
    beta: f64,
    scores: &[Option<f32>],
    kl: Option<&Tensor>,
    values: &Tensor,
    mask: &Tensor,
) -> Result<GaeTargets> {
    let rows = LiveRows::new(scores, mask)?;
    let kl = match kl {
        Some(kl) => rows.take(kl)?,
        None => rows.filled(|_| 0.0),
    };
    let live_scores: Vec<f32> = rows.live().iter().map(|&i| scores[i].expect("live rows are scored")).collect();
    let mut rewards = token_rewards(&live_scores, &kl, beta as f32);
    let rlhf_reward =
        crate::stats::mean(&rewards.iter().map(|r| r.iter().map(|&x| x as f64).sum()).collect::<Vec<f64>>())
            .unwrap_or(f64::NAN);
    if ppo.whiten_rewards {
        whiten_tokens(&mut rewards, false);
    }
    let (mut advantages, returns) = gae(&rewards, &rows.take(values)?, ppo.gamma as f32, ppo.lam as f32);
    whiten_tokens(&mut advantages, true);
    Ok(GaeTargets {
        advantages: rows.padded(advantages)?,
        returns: rows.padded(returns)?,
        values: values.clone(),
        mask: rows.mask()?,
        rlhf_reward,
    })
}

enum Source {
    Policy,
    Dir(String),
}

/// `ppo.value_model`, with its default: the one reward model, else the policy.
fn value_model_source(cfg: &TrainConfig) -> Result<Source> {
    let models: Vec<&str> = cfg
        .reward
        .iter()
        .filter_map(|r| match r {
            RewardSpec::Model(m) => Some(m.path.as_str()),
            _ => None,
        })
        .collect();
    match cfg.ppo.value_model.as_deref() {
        Some("policy") => Ok(Source::Policy),
        Some("reward") => match models.as_slice() {
            [one] => Ok(Source::Dir(one.to_string())),
            _ => Err(Error::Invalid(format!(
                "ppo.value_model = \"reward\" needs exactly one [[reward]] of type \"model\", there are {}",
                models.len()
            ))),
        },
        Some(dir) => Ok(Source::Dir(dir.to_string())),
        None => Ok(match models.as_slice() {
            [one] => Source::Dir(one.to_string()),
            _ => Source::Policy,
        }),
    }
}

/// Whether two model directories tokenize alike: the same `model.vocab` in
/// their `tokenizer.json` (or no file to compare).
fn same_vocabulary(a: &Path, b: &Path) -> bool {
    let vocab = |dir: &Path| -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(dir.join("tokenizer.json")).ok()?;
        serde_json::from_str::<serde_json::Value>(&text).ok()?.get("model")?.get("vocab").cloned()
    };
    match (vocab(a), vocab(b)) {
        (Some(x), Some(y)) => x == y,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two rows, the second unscorable: it gets no advantage and leaves the
    /// mask; the first follows the worked GAE of `algo::ppo`.
    #[test]
    fn targets_of_a_rollout_leave_out_unscorable_rows() {
        let dev = Device::Cpu;
        let mask = Tensor::new(&[[1f32, 1.0, 1.0], [1.0, 1.0, 0.0]], &dev).unwrap();
        let kl = Tensor::new(&[[1f32, 0.0, 2.0], [-1.0, 1.0, 0.0]], &dev).unwrap();
        let values = Tensor::new(&[[0.5f32, 0.4, 0.3], [0.2, -0.5, 0.0]], &dev).unwrap();
        let ppo = PpoSection { gamma: 0.9, lam: 0.5, ..PpoSection::default() };
        let t = targets(&ppo, 0.1, &[Some(1.0), None], Some(&kl), &values, &mask).unwrap();
        assert_eq!(t.mask.to_vec2::<f32>().unwrap(), [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]);
        let ret = t.returns.to_vec2::<f32>().unwrap();
        for (a, b) in ret[0].iter().zip([0.30275, 0.495, 0.8]) {
            assert!((a - b).abs() < 1e-5, "{ret:?}");
        }
        assert_eq!(ret[1], [0.0, 0.0, 0.0]);
        // Whitened over the one live row's three tokens.
        let adv = t.advantages.to_vec2::<f32>().unwrap();
        assert!(adv[0].iter().sum::<f32>().abs() < 1e-5 && adv[1] == [0.0, 0.0, 0.0], "{adv:?}");
        assert!((t.rlhf_reward - 0.7).abs() < 1e-6);
    }
}
