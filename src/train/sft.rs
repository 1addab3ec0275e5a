//! Supervised fine-tuning: cross-entropy on completion tokens (prompt tokens
//! masked, or every token with `all_tokens`), AdamW with a schedule and
//! gradient accumulation, an evaluation loss on a held-out split, and a
//! Hugging Face directory at the end.
//!
//! Rows are `{"prompt", "completion"}` (each a string or chat messages),
//! `{"messages": [...]}` (the last assistant message is the completion), or
//! `{"text"}` (language modelling on all tokens).

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Device, Tensor};
use serde_json::Value;

use super::supervised::{train_supervised, Objective, SupervisedConfig, Trainer};
use crate::data::{DatasetSpec, Row};
use crate::data::{Message, Prompt, Tokenizer};
use crate::error::{Error, Result};
use crate::model::hub::resolve_model;
use crate::model::layer_graphs::LayerGraphs;
use crate::model::scoring::{completion_logprobs, Sequences};
use crate::model::{HeadKind, Model, Network, Placement};
use crate::report::Metrics;
use crate::rng::streams;

/// `rloo sft`'s side of the shared options.
#[derive(Debug, Clone, Copy)]
pub struct Sft;

impl Trainer for Sft {
    const CONFIG_FILE: &'static str = "sft_config.toml";
    const DATA_STREAM: u64 = streams::SFT_DATA;

    fn defaults(shared: SftConfig) -> SftConfig {
        SftConfig { output_dir: "runs/sft".into(), ..shared }
    }

    fn check(_: &SftConfig) -> Result<()> {
        Ok(())
    }
}

pub type SftConfig = SupervisedConfig<Sft>;

/// One tokenized training example.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
}

pub struct SftSummary {
    pub steps: usize,
    pub train_loss: f64,
    pub eval_loss: Option<f64>,
    pub output_dir: PathBuf,
    /// Every step done and the model saved (not stopped by `stop_after`).
    pub finished: bool,
    /// Whether this process wrote the run (the only one, or rank 0).
    pub main: bool,
}

/// Tokenizes one row (see the module doc for the formats).
pub fn example_from_row(row: &Row, tok: &Tokenizer, all_tokens: bool) -> std::result::Result<Example, String> {
    let f = &row.fields;
    let eos: Vec<u32> = tok.eos_token_id().into_iter().collect();
    let (prompt, completion) = if let Some(messages) = f.get("messages") {
        let Prompt::Messages(mut messages) =
            Prompt::from_value(messages).map_err(|e| format!("column `messages`: {e}"))?
        else {
            return Err("column `messages` must be a list of chat messages".into());
        };
        let last =
            messages.pop().filter(|m| m.role == "assistant").ok_or("the last message must be the assistant's")?;
        chat_pair(tok, &messages, &last)?
    } else if let Some(text) = f.get("text") {
        let text = text.as_str().ok_or("column `text` must be a string")?;
        let ids = tok.encode_prompt(&Prompt::Text(text.to_string())).map_err(|e| e.to_string())?;
        let (first, rest) = ids.split_first().ok_or("column `text` is empty")?;
        (vec![*first], [rest, &eos].concat())
    } else {
        let prompt = f.get("prompt").ok_or("expected `prompt` and `completion`, `messages`, or `text` columns")?;
        let prompt = Prompt::from_value(prompt).map_err(|e| format!("column `prompt`: {e}"))?;
        match (prompt, f.get("completion")) {
            (Prompt::Messages(messages), Some(Value::Array(c))) => {
                let Some(Prompt::Messages(reply)) = Prompt::from_value(&Value::Array(c.clone())).ok() else {
                    return Err("column `completion` must be messages when `prompt` is".into());
                };
                let last = reply.last().ok_or("column `completion` is empty")?;
                chat_pair(tok, &messages, last)?
            }
            (Prompt::Messages(messages), Some(Value::String(c))) => {
                chat_pair(tok, &messages, &Message::new("assistant", c))?
            }
            (prompt, Some(Value::String(c))) => {
                let p = tok.encode_prompt(&prompt).map_err(|e| e.to_string())?;
                (p, [tok.encode(c).map_err(|e| e.to_string())?, eos].concat())
            }
            (_, Some(other)) => return Err(format!("column `completion` must be a string or messages, got {other}")),
            (_, None) => return Err("missing column `completion`".into()),
        }
    };
    if prompt.is_empty() || completion.is_empty() {
        return Err("the prompt or the completion has no tokens".into());
    }
    Ok(if all_tokens {
        let all = [prompt, completion].concat();
        Example { prompt: all[..1].to_vec(), completion: all[1..].to_vec() }
    } else {
        Example { prompt, completion }
    })
}

/// A conversation's prompt (template with the generation prompt) and the
/// assistant reply's tokens: the full rendering minus the prompt rendering.
fn chat_pair(
    tok: &Tokenizer,
    messages: &[Message],
    reply: &Message,
) -> std::result::Result<(Vec<u32>, Vec<u32>), String> {
    let prompt = tok.encode_prompt(&Prompt::Messages(messages.to_vec())).map_err(|e| e.to_string())?;
    let template = tok.chat_template().ok_or("chat rows need a model with a chat template")?;
    let mut all = messages.to_vec();
    all.push(reply.clone());
    let text = template.render(&all, false).map_err(|e| e.to_string())?;
    let mut full = tok.encode(&text).map_err(|e| e.to_string())?;
    if prompt.first() != full.first() && prompt.first() == tok.bos_token_id().as_ref() {
        full.insert(0, prompt[0]);
    }
    if !full.starts_with(&prompt) {
        return Err("the chat template renders the conversation with a different prefix than the prompt".into());
    }
    Ok((prompt.clone(), full[prompt.len()..].to_vec()))
}

/// SFT's objective: the mean next-token loss over the completion tokens of
/// each optimizer step; the held-out loss after each epoch.
struct NextTokenLoss<'a> {
    eval: Vec<Example>,
    batch: usize,
    device: &'a Device,
    eval_loss: Option<f64>,
}

impl Objective for NextTokenLoss<'_> {
    type Example = Example;

    fn tokens(e: &Example) -> [&[u32]; 2] {
        [&e.prompt, &e.completion]
    }

    fn micro_loss(&mut self, net: &Network, micro: &[&Example], step: &[&Example]) -> Result<(Tensor, usize)> {
        let tokens: f64 = step.iter().map(|e| e.completion.len() as f64).sum();
        let lp = completion_logprobs(net, &sequences(micro), 1.0, self.device)?;
        // Token mean over the whole optimizer step, however it is split.
        Ok(((lp.logprobs.sum_all()?.neg()? / tokens)?, 0))
    }

    fn step_metrics(&self, m: &mut Metrics, _: usize, _: usize, epoch_progress: f64) {
        m.set("train/epoch", epoch_progress);
    }

    fn evaluate(&mut self, net: &Network) -> Result<Option<Metrics>> {
        if self.eval.is_empty() {
            return Ok(None);
        }
        let refs: Vec<&Example> = self.eval.iter().collect();
        let loss = mean_loss(net, &refs, self.batch, self.device)?;
        self.eval_loss = Some(loss);
        Ok(Some(Metrics::from_iter([("eval/loss", loss)])))
    }
}

/// `context`: the model's positions, which no prompt + completion may exceed.
fn load_examples(data: &DatasetSpec, tok: &Tokenizer, cfg: &SftConfig, context: Option<usize>) -> Result<Vec<Example>> {
    let mut out = Vec::new();
    for row in data.read_all()? {
        let mut ex = example_from_row(&row, tok, cfg.all_tokens).map_err(|e| row.error(e))?;
        let room = cfg.max_length.saturating_sub(ex.prompt.len());
        if room == 0 {
            return Err(row.error(format!("the prompt alone exceeds max_length = {}", cfg.max_length)));
        }
        ex.completion.truncate(room);
        let length = ex.prompt.len() + ex.completion.len();
        if let Some(positions) = context.filter(|&p| length > p) {
            return Err(row.error(format!(
                "{length} tokens (after max_length = {}) exceed the model's context of {positions} positions; \
                 lower max_length",
                cfg.max_length
            )));
        }
        out.push(ex);
    }
    Ok(out)
}

/// Mean next-token loss over the completion tokens of `examples`.
pub fn mean_loss(net: &Network, examples: &[&Example], batch: usize, device: &Device) -> Result<f64> {
    let (mut total, mut tokens) = (0f64, 0f64);
    for chunk in examples.chunks(batch.max(1)) {
        let seqs = sequences(chunk);
        let lp = completion_logprobs(net, &seqs, 1.0, device)?;
        total -= lp.logprobs.sum_all()?.to_scalar::<f32>()? as f64;
        tokens += lp.mask.sum_all()?.to_scalar::<f32>()? as f64;
    }
    Ok(total / tokens.max(1.0))
}

fn sequences<'a>(examples: &[&'a Example]) -> Sequences<'a> {
    Sequences::new(
        examples.iter().map(|e| e.prompt.as_slice()).collect(),
        examples.iter().map(|e| e.completion.as_slice()).collect(),
    )
}

pub fn train_sft(cfg: &SftConfig) -> Result<SftSummary> {
    cfg.validate()?;
    let mut job = cfg.start_job()?;
    let device = job.device(&cfg.device)?;
    let dir = resolve_model(&cfg.model)?;
    let load = |dir: &Path| {
        Model::load_trainable(
            dir,
            Placement::new(&device, cfg.dtype.dtype()),
            HeadKind::CausalLm,
            (&cfg.peft, &[]),
            cfg.seed,
            true,
        )
    };
    let model = load(&dir)?
        .with_dtype(cfg.dtype.dtype(), true)?
        .with_layer_graphs(LayerGraphs::for_training(cfg.gradient_checkpointing));
    if model.head() != HeadKind::CausalLm {
        return Err(Error::bad_file(&dir, "SFT needs a causal LM"));
    }
    let tok = Tokenizer::from_dir(&dir)?;
    tok.check_model(model.config())?;
    let context = model.config().context_length();
    let train = load_examples(&cfg.dataset, &tok, cfg, context)?;
    let eval = cfg.eval_dataset.as_ref().map(|data| load_examples(data, &tok, cfg, context)).transpose()?;
    let (train, eval) = cfg.split_eval(train, eval);
    let world = job.comm.world().size;
    let mini = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world;
    tracing::info!(
        "SFT: {} train / {} eval examples; {} epochs x {} steps of {} ({} x {} accumulated{})",
        train.len(),
        eval.len(),
        cfg.num_train_epochs,
        train.len().div_ceil(mini),
        mini,
        cfg.per_device_train_batch_size,
        cfg.gradient_accumulation_steps,
        if world > 1 { format!(" x {world} processes") } else { String::new() }
    );
    let mut objective =
        NextTokenLoss { eval, batch: cfg.per_device_train_batch_size, device: &device, eval_loss: None };
    let started = Instant::now();
    let done = train_supervised(cfg, job, model, load, &train, &mut objective)?;
    let output_dir = PathBuf::from(&cfg.output_dir);
    tracing::info!(
        "SFT: {} steps in {:.1} s, last train loss {:.4}, eval loss {} -> {}",
        done.steps,
        started.elapsed().as_secs_f64(),
        done.last_loss,
        objective.eval_loss.map_or("n/a".into(), |l| format!("{l:.4}")),
        output_dir.display()
    );
    Ok(SftSummary {
        steps: done.steps,
        train_loss: done.last_loss,
        eval_loss: objective.eval_loss,
        output_dir,
        finished: done.finished,
        main: done.main,
    })
}
