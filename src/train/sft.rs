//! Supervised fine-tuning: cross-entropy on completion tokens (prompt tokens
//! masked, or every token with `all_tokens`), AdamW with a schedule and
//! gradient accumulation, an evaluation loss on a held-out split, and a
//! Hugging Face directory at the end.
//!
//! Rows are `{"prompt", "completion"}` (each a string or chat messages),
//! `{"messages": [...]}` (the last assistant message is the completion), or
//! `{"text"}` (language modelling on all tokens).

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::config::{to_toml, OptimizerOptions, Schedule};
use super::harness::{Harness, HarnessOptions};
use super::run_dir::Reuse;
use super::supervised::{require_model_and_data, train_supervised, validate_data, LoopOptions, Objective};
use crate::data::split_eval;
use crate::data::{DatasetSpec, Row};
use crate::data::{Message, Prompt, Tokenizer};
use crate::error::{Error, Result};
use crate::generate::rng::streams;
use crate::generate::Rng;
use crate::io::write_atomic;
use crate::model::hub::resolve_model;
use crate::model::layer_graphs::LayerGraphs;
use crate::model::lora::PeftOptions;
use crate::model::scoring::{completion_logprobs, Sequences};
use crate::model::{parse_device, HeadKind, Model, Network, Precision};
use crate::report::Metrics;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftConfig {
    pub model: String,
    pub dataset: DatasetSpec,
    /// Held-out rows; without them, `eval_fraction` of the rows are held out.
    pub eval_dataset: Option<DatasetSpec>,
    pub eval_fraction: f64,
    pub output_dir: String,
    pub device: String,
    /// f32, or bf16 mixed precision (f32 master weights and optimizer state).
    pub dtype: Precision,
    /// Keep only each layer's input in the forward pass and recompute the
    /// layer in the backward.
    pub gradient_checkpointing: bool,
    pub learning_rate: f64,
    pub per_device_train_batch_size: usize,
    pub gradient_accumulation_steps: usize,
    pub num_train_epochs: usize,
    pub lr_scheduler_type: Schedule,
    /// Warm-up optimizer steps; 0: `warmup_ratio` of all steps.
    pub warmup_steps: usize,
    pub warmup_ratio: f64,
    /// AdamW decoupled weight decay (not applied to biases and norm weights).
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    pub max_grad_norm: f64,
    /// Longest prompt + completion in tokens; longer rows are cut at the end.
    pub max_length: usize,
    /// Train on prompt tokens too.
    pub all_tokens: bool,
    pub seed: u64,
    pub logging_steps: usize,
    /// Replace the logs of a previous run in output_dir.
    pub overwrite_output_dir: bool,
    /// Stop after this many optimizer steps in a row with a non-finite loss or gradient.
    pub max_skipped_steps: usize,
    /// LoRA adapters instead of full training.
    pub peft: PeftOptions,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self {
            model: String::new(),
            dataset: DatasetSpec::default(),
            eval_dataset: None,
            eval_fraction: 0.0,
            output_dir: "runs/sft".into(),
            device: "auto".into(),
            dtype: Precision::F32,
            gradient_checkpointing: false,
            learning_rate: 2e-5,
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 1,
            num_train_epochs: 1,
            lr_scheduler_type: Schedule::Linear,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            max_length: 1024,
            all_tokens: false,
            seed: 42,
            logging_steps: 10,
            overwrite_output_dir: false,
            max_skipped_steps: 10,
            peft: PeftOptions::default(),
        }
    }
}

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

/// The resolved configuration, saved in the output directory.
pub const CONFIG_FILE: &str = "sft_config.toml";

impl SftConfig {
    /// The shared loop's options.
    fn loop_options(&self) -> LoopOptions {
        LoopOptions {
            per_device_train_batch_size: self.per_device_train_batch_size,
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            num_train_epochs: self.num_train_epochs,
            learning_rate: self.learning_rate,
            lr_scheduler_type: self.lr_scheduler_type,
            warmup_steps: self.warmup_steps,
            warmup_ratio: self.warmup_ratio,
            optimizer: OptimizerOptions {
                adam_beta1: self.adam_beta1,
                adam_beta2: self.adam_beta2,
                adam_epsilon: self.adam_epsilon,
                weight_decay: self.weight_decay,
                max_grad_norm: self.max_grad_norm,
            },
            max_skipped_steps: self.max_skipped_steps,
            seed: self.seed,
            order_stream: streams::SFT_DATA,
        }
    }

    /// Checks values that no type can express; messages name the option.
    pub fn validate(&self) -> Result<()> {
        require_model_and_data(&self.model, &self.dataset)?;
        self.loop_options().validate()?;
        validate_data(self.max_length, self.eval_fraction)
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
    let output_dir = PathBuf::from(&cfg.output_dir);
    let run_dir = Harness::lock(&output_dir, if cfg.overwrite_output_dir { Reuse::Overwrite } else { Reuse::Fresh })?;
    let device = parse_device(&cfg.device)?;
    let dir = resolve_model(&cfg.model)?;
    let model = Model::load_trainable(&dir, &device, HeadKind::CausalLm, (&cfg.peft, &[]), cfg.seed, true)?
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
    let (train, eval) = split_eval(train, eval, cfg.eval_fraction, &mut Rng::stream(cfg.seed, &[streams::SFT_DATA]));
    let options =
        HarnessOptions { logging_steps: cfg.logging_steps, progress_total: None, samples: false, tensorboard: true };
    let mut harness = Harness::open(run_dir, 0, options)?;
    write_atomic(&output_dir.join(CONFIG_FILE), to_toml(cfg).as_bytes())?;

    let mini = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps;
    let steps_per_epoch = train.len().div_ceil(mini);
    tracing::info!(
        "SFT: {} train / {} eval examples; {} epochs x {} steps of {} ({} x {} accumulated)",
        train.len(),
        eval.len(),
        cfg.num_train_epochs,
        steps_per_epoch,
        mini,
        cfg.per_device_train_batch_size,
        cfg.gradient_accumulation_steps
    );
    let mut objective =
        NextTokenLoss { eval, batch: cfg.per_device_train_batch_size, device: &device, eval_loss: None };
    let started = Instant::now();
    let done = train_supervised(&model, &train, &mut objective, &cfg.loop_options(), &mut harness)?;
    let (step, last_loss, eval_loss) = (done.steps, done.last_loss, objective.eval_loss);
    model.save_files(&output_dir)?;
    tracing::info!(
        "SFT: {step} steps in {:.1} s, last train loss {last_loss:.4}, eval loss {} -> {}",
        started.elapsed().as_secs_f64(),
        eval_loss.map_or("n/a".into(), |l| format!("{l:.4}")),
        output_dir.display()
    );
    Ok(SftSummary { steps: step, train_loss: last_loss, eval_loss, output_dir })
}
