//! Reward-model training on preference pairs with the Bradley-Terry loss
//! `-log sigmoid(r(x, y_chosen) - r(x, y_rejected))`, the score read at the
//! last token by a sequence-classification head (a new one, initialised,
//! when starting from a causal LM). Accuracy and margin are measured on a
//! held-out split; the result is a `*ForSequenceClassification` directory.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::Value;

use super::supervised::{train_supervised, Objective, SupervisedConfig, Trainer};
use crate::data::{DatasetSpec, Row};
use crate::data::{Prompt, Tokenizer};
use crate::error::Result;
use crate::model::hub::resolve_model;
use crate::model::layer_graphs::LayerGraphs;
use crate::model::ops::log_softmax_last;
use crate::model::{HeadKind, Inputs, Model, Network, PadSide, Placement};
use crate::report::Metrics;
use crate::reward::model::encode_pair;
use crate::rng::streams;

/// `rloo reward train`'s side of the shared options.
#[derive(Debug, Clone, Copy)]
pub struct RewardTraining;

impl Trainer for RewardTraining {
    const CONFIG_FILE: &'static str = "reward_config.toml";
    const DATA_STREAM: u64 = streams::REWARD_DATA;

    fn defaults(shared: RewardTrainConfig) -> RewardTrainConfig {
        RewardTrainConfig {
            output_dir: "runs/reward_model".into(),
            eval_fraction: 0.1,
            learning_rate: 1e-5,
            logging_steps: 1,
            ..shared
        }
    }

    fn check(cfg: &RewardTrainConfig) -> Result<()> {
        if cfg.all_tokens {
            return Err(crate::error::Error::Invalid("all_tokens applies to rloo sft only".into()));
        }
        Ok(())
    }
}

pub type RewardTrainConfig = SupervisedConfig<RewardTraining>;

/// The reward model's objective: the Bradley-Terry loss averaged over each
/// optimizer step's pairs, with the share ranked right; held-out loss,
/// accuracy and margin after each epoch.
struct BradleyTerry<'a> {
    eval: Vec<Pair>,
    batch: usize,
    device: &'a Device,
    last_eval: Option<PairStats>,
}

impl Objective for BradleyTerry<'_> {
    type Example = Pair;

    fn tokens(p: &Pair) -> [&[u32]; 2] {
        [&p.chosen, &p.rejected]
    }

    fn micro_loss(&mut self, net: &Network, micro: &[&Pair], step: &[&Pair]) -> Result<(Tensor, usize)> {
        let (c, r) = pair_scores(net, micro, self.device)?;
        let d = (c - r)?;
        let correct = d.to_vec1::<f32>()?.iter().filter(|&&x| x > 0.0).count();
        Ok(((bradley_terry_sum(&d)? / step.len() as f64)?, correct))
    }

    fn step_metrics(&self, m: &mut Metrics, step_len: usize, correct: usize, _: f64) {
        m.set("train/accuracy", correct as f64 / step_len as f64);
    }

    fn evaluate(&mut self, net: &Network) -> Result<Option<Metrics>> {
        if self.eval.is_empty() {
            return Ok(None);
        }
        let s = evaluate(net, &self.eval, self.batch, self.device)?;
        self.last_eval = Some(s);
        Ok(Some(Metrics::from_iter([("eval/loss", s.loss), ("eval/accuracy", s.accuracy), ("eval/margin", s.margin)])))
    }
}

/// One preference pair as token ids.
#[derive(Debug, Clone)]
pub struct Pair {
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
}

/// Accuracy (chosen scored higher) and mean margin on held-out pairs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairStats {
    pub loss: f64,
    pub accuracy: f64,
    pub margin: f64,
}

pub struct RewardTrainSummary {
    pub steps: usize,
    pub eval: Option<PairStats>,
    pub output_dir: PathBuf,
    /// Every step done and the model saved (not stopped by `stop_after`).
    pub finished: bool,
    /// Whether this process wrote the run (the only one, or rank 0).
    pub main: bool,
}

/// `{"prompt", "chosen", "rejected"}` with a text or chat prompt and text
/// answers, or chosen/rejected as whole conversations (the last assistant
/// message is the answer).
pub fn pair_from_row(row: &Row, tok: &Tokenizer, max_length: usize) -> std::result::Result<Pair, String> {
    let side = |key: &str| -> std::result::Result<Vec<u32>, String> {
        let value = row.fields.get(key).ok_or(format!("missing column `{key}`"))?;
        let (prompt, answer) = match (row.fields.get("prompt"), value) {
            (Some(p), Value::String(answer)) => {
                (Prompt::from_value(p).map_err(|e| format!("column `prompt`: {e}"))?, answer.clone())
            }
            (prompt, Value::Array(_)) => {
                let Ok(Prompt::Messages(mut conversation)) = Prompt::from_value(value) else {
                    return Err(format!("column `{key}` must be a string or chat messages"));
                };
                let answer = conversation
                    .pop()
                    .filter(|m| m.role == "assistant")
                    .ok_or(format!("column `{key}`: the last message must be the assistant's"))?;
                if let Some(p) = prompt {
                    let Ok(Prompt::Messages(mut head)) = Prompt::from_value(p) else {
                        return Err("column `prompt` must be messages when the answers are".into());
                    };
                    head.extend(conversation);
                    conversation = head;
                }
                (Prompt::Messages(conversation), answer.content)
            }
            (None, _) => return Err("missing column `prompt`".into()),
            (_, other) => return Err(format!("column `{key}` must be a string or chat messages, got {other}")),
        };
        let mut ids = encode_pair(tok, &prompt, &answer).map_err(|e| e.to_string())?;
        ids.truncate(max_length);
        if ids.is_empty() {
            return Err(format!("column `{key}` gives no tokens"));
        }
        Ok(ids)
    };
    Ok(Pair { chosen: side("chosen")?, rejected: side("rejected")? })
}

/// `context`: the model's positions, which no sequence may exceed.
fn load_pairs(data: &DatasetSpec, tok: &Tokenizer, max_length: usize, context: Option<usize>) -> Result<Vec<Pair>> {
    data.read_all()?
        .iter()
        .map(|row| {
            let pair = pair_from_row(row, tok, max_length).map_err(|e| row.error(e))?;
            let longest = pair.chosen.len().max(pair.rejected.len());
            match context.filter(|&p| longest > p) {
                Some(positions) => Err(row.error(format!(
                    "{longest} tokens (after max_length = {max_length}) exceed the model's context of \
                     {positions} positions; lower max_length"
                ))),
                None => Ok(pair),
            }
        })
        .collect()
}

/// Scores of the chosen and rejected sides: two (N,) tensors.
fn pair_scores(net: &Network, pairs: &[&Pair], device: &Device) -> Result<(Tensor, Tensor)> {
    let rows: Vec<Vec<u32>> =
        pairs.iter().map(|p| p.chosen.clone()).chain(pairs.iter().map(|p| p.rejected.clone())).collect();
    let scores = net.scores(&Inputs::from_rows(&rows, 0, PadSide::Right, device)?)?.squeeze(1)?;
    let n = pairs.len();
    Ok((scores.narrow(0, 0, n)?, scores.narrow(0, n, n)?))
}

/// `sum -log sigmoid(d)` over margins `d` (N,), as `-log_softmax([d, 0])[0]`:
/// finite for any |d| and smooth at 0, unlike relu/abs forms whose kinks
/// give the wrong subgradient there.
pub fn bradley_terry_sum(margin: &Tensor) -> Result<Tensor> {
    let pair = Tensor::stack(&[margin, &margin.zeros_like()?], 1)?; // (N, 2)
    Ok(log_softmax_last(&pair)?.narrow(1, 0, 1)?.sum_all()?.neg()?)
}

pub fn evaluate(net: &Network, pairs: &[Pair], batch: usize, device: &Device) -> Result<PairStats> {
    let (mut loss, mut correct, mut margin) = (0f64, 0usize, 0f64);
    let refs: Vec<&Pair> = pairs.iter().collect();
    for chunk in refs.chunks(batch.max(1)) {
        let (c, r) = pair_scores(net, chunk, device)?;
        let d = (c - r)?;
        loss += bradley_terry_sum(&d)?.to_scalar::<f32>()? as f64;
        let d: Vec<f32> = d.to_vec1()?;
        correct += d.iter().filter(|&&x| x > 0.0).count();
        margin += d.iter().map(|&x| x as f64).sum::<f64>();
    }
    let n = pairs.len().max(1) as f64;
    Ok(PairStats { loss: loss / n, accuracy: correct as f64 / n, margin: margin / n })
}

pub fn train_reward_model(cfg: &RewardTrainConfig) -> Result<RewardTrainSummary> {
    cfg.validate()?;
    let mut job = cfg.start_job()?;
    let device = job.device(&cfg.device)?;
    let dir = resolve_model(&cfg.model)?;
    let head = HeadKind::SequenceClassification { num_labels: 1 };
    // The score head trains in full beside the adapters (PEFT's modules_to_save).
    let load = |dir: &Path| {
        Model::load_trainable(
            dir,
            Placement::new(&device, cfg.dtype.dtype()),
            head,
            (&cfg.peft, &["score"]),
            cfg.seed,
            true,
        )
    };
    let mut model = load(&dir)?
        .with_dtype(cfg.dtype.dtype(), true)?
        .with_layer_graphs(LayerGraphs::for_training(cfg.gradient_checkpointing));
    let tok = Tokenizer::from_dir(&dir)?;
    tok.check_model(model.config())?;
    let context = model.config().context_length();
    // transformers needs the pad id to find the last token of padded batches.
    if model.config().raw.get("pad_token_id").is_none_or(Value::is_null) {
        if let Some(pad) = tok.pad_token_id().or(tok.eos_token_id()) {
            model.set_config_key("pad_token_id", pad.into());
        }
    }
    let train = load_pairs(&cfg.dataset, &tok, cfg.max_length, context)?;
    let eval = cfg.eval_dataset.as_ref().map(|data| load_pairs(data, &tok, cfg.max_length, context)).transpose()?;
    let (train, eval) = cfg.split_eval(train, eval);
    let mini = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * job.comm.world().size;
    let total = train.len().div_ceil(mini) * cfg.num_train_epochs;
    tracing::info!("reward model: {} train / {} eval pairs, {} steps of {mini} pairs", train.len(), eval.len(), total);

    let mut objective = BradleyTerry { eval, batch: cfg.per_device_train_batch_size, device: &device, last_eval: None };
    let done = train_supervised(cfg, job, model, load, &train, &mut objective)?;
    let output_dir = PathBuf::from(&cfg.output_dir);
    let (steps, finished, main) = (done.steps, done.finished, done.main);
    Ok(RewardTrainSummary { steps, eval: objective.last_eval, output_dir, finished, main })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn bradley_terry_loss_and_gradient_match_the_formula() {
        let d = Var::new(&[0.0f32, 2.0, -30.0], &Device::Cpu).unwrap();
        let loss = bradley_terry_sum(d.as_tensor()).unwrap();
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let want = -(sig(0.0).ln() + sig(2.0).ln()) + 30.0;
        assert!((loss.to_scalar::<f32>().unwrap() as f64 - want).abs() < 1e-4);
        // d/dd -log sigmoid(d) = sigmoid(d) - 1
        let g: Vec<f32> = loss.backward().unwrap().get(&d).unwrap().to_vec1().unwrap();
        for (x, gx) in [0.0, 2.0, -30.0].iter().zip(g) {
            assert!((gx as f64 - (sig(*x) - 1.0)).abs() < 1e-6, "{gx}");
        }
    }
}
