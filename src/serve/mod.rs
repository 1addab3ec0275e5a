//! `rloo serve`: models behind an OpenAI-compatible HTTP API and a chat
//! page, in the binary.
//!
//! - `POST /v1/chat/completions` and `POST /v1/completions` ([`openai`]),
//!   whole or streamed as server-sent events, for every model with an LM head;
//! - `POST /score`, the protocol of `rloo reward serve`, for every reward
//!   model (`"model"` in the body picks one when there are several);
//! - `GET /v1/models`, `GET /health` (with what each engine holds), and
//!   `GET /`, a chat page that also puts two models side by side.
//!
//! Each text model has its own decoding thread ([`engine`]) that batches
//! the completions of every request in flight. The HTTP side is the one of
//! every service here ([`crate::service::server`]): bounded connections,
//! requests and queue, size limits and timeouts, Host and Origin checks,
//! an optional bearer token, and errors in OpenAI's shape.

pub mod engine;
pub mod openai;
mod text;

use std::path::Path;

use candle_core::{DType, Device};
use serde_json::{json, Value};

use crate::data::Tokenizer;
use crate::error::{Error, Result};
use crate::generate::{warm_up, Sampler, Stepping, StopCriteria};
use crate::model::{GenerationConfig, HeadKind, Model, ModelConfig, Placement};
use crate::reward::serve::{score_route, ScoreRoute};
use crate::reward::RewardModel;
use crate::service::server::{HttpError, JsonRequest, JsonServer, Listen, Reply, Shutdown};
use engine::Engine;
use openai::Endpoint;

/// The chat page, served at `/`.
const PAGE: &str = include_str!("page.html");

/// Completions without `max_tokens` get what the context leaves, or this
/// many tokens when the model states no context.
const DEFAULT_MAX_TOKENS: usize = 256;

/// OpenAI's default `max_tokens` for text completions.
const DEFAULT_TEXT_MAX_TOKENS: usize = 16;

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where to listen, who may call, and the HTTP limits (the token guards
    /// everything but `/` and `/health`).
    pub listen: Listen,
    /// Completions each model decodes together at most.
    pub max_batch_rows: usize,
    /// Completions (prompts x `n`) one request may ask for.
    pub max_request_rows: usize,
    /// Samples a reward model scores together.
    pub score_batch_size: usize,
    /// Samples one `/score` request may hold.
    pub max_score_samples: usize,
}

/// A model loaded for serving.
pub enum Loaded {
    Text { name: String, model: Model, tokenizer: Tokenizer, generation: GenerationConfig, eos_ids: Vec<u32> },
    Reward { name: String, model: RewardModel },
}

impl Loaded {
    /// Loads `dir` (a model or PEFT adapter directory) as a text model, or
    /// as a reward model when its head is a sequence-classification one.
    /// Text models compute in `dtype`.
    pub fn load(name: &str, dir: &Path, device: &Device, dtype: DType, score_batch_size: usize) -> Result<Loaded> {
        let context = |e: Error| Error::Invalid(format!("model `{name}` ({}): {e}", dir.display()));
        let is_reward = dir.join("config.json").is_file()
            && matches!(ModelConfig::from_dir(dir).map_err(context)?.head, HeadKind::SequenceClassification { .. });
        if is_reward {
            let model = RewardModel::from_dir(name, dir, device, score_batch_size).map_err(context)?;
            return Ok(Loaded::Reward { name: name.to_string(), model });
        }
        let model = Model::load_computing(dir, Placement::new(device, dtype)).map_err(context)?;
        if model.head() != HeadKind::CausalLm {
            return Err(context(Error::Invalid("a sequence-classification adapter cannot be served".into())));
        }
        let tokenizer = Tokenizer::from_dir(dir).map_err(context)?;
        tokenizer.check_model(model.config()).map_err(context)?;
        let generation = GenerationConfig::from_dir(dir).map_err(context)?.unwrap_or_default();
        let eos_ids = StopCriteria::model_eos_ids(dir, &tokenizer).map_err(context)?;
        Ok(Loaded::Text { name: name.to_string(), model, tokenizer, generation, eos_ids })
    }

    pub fn name(&self) -> &str {
        match self {
            Loaded::Text { name, .. } | Loaded::Reward { name, .. } => name,
        }
    }
}

/// A text model and the engine decoding for it.
pub struct Generator<'m> {
    pub model: &'m Model,
    pub tokenizer: &'m Tokenizer,
    pub generation: &'m GenerationConfig,
    pub eos_ids: &'m [u32],
    /// Prompt + completion tokens the model allows, when its config says.
    pub context: Option<usize>,
    /// Completions (prompts x `n`) one request may ask for.
    pub max_request_rows: usize,
    pub engine: Engine,
}

impl Generator<'_> {
    fn default_max_tokens(&self, endpoint: Endpoint, prompt_len: usize) -> usize {
        let room = self.context.map_or(DEFAULT_MAX_TOKENS, |c| c.saturating_sub(prompt_len).max(1));
        match endpoint {
            Endpoint::Chat => room,
            Endpoint::Text => room.min(DEFAULT_TEXT_MAX_TOKENS),
        }
    }
}

/// What a route can reach by name.
enum Served<'m> {
    Text(Generator<'m>),
    Reward(ScoreRoute<'m>),
}

/// Serves `models` until `stop()` says so; `on_listen` hears the address.
pub fn serve(
    models: &[Loaded],
    opts: &ServeOptions,
    stop: impl Fn() -> bool + Sync,
    on_listen: impl FnOnce(std::net::SocketAddr),
) -> Result<()> {
    if models.is_empty() {
        return Err(Error::Invalid("no model to serve".into()));
    }
    for (i, m) in models.iter().enumerate() {
        if models[..i].iter().any(|o| o.name() == m.name()) {
            return Err(Error::Invalid(format!("two models are named `{}`: give them NAME=DIR names", m.name())));
        }
    }
    if opts.max_batch_rows == 0 || opts.score_batch_size == 0 || opts.max_score_samples == 0 {
        return Err(Error::Invalid("batch sizes and sample limits must be at least 1".into()));
    }
    if opts.max_request_rows == 0 {
        return Err(Error::Invalid("--max-request-rows must be at least 1".into()));
    }
    let server = JsonServer::bind(&opts.listen)?;
    let shutdown = Shutdown::new(&stop, opts.listen.limits.shutdown_grace);
    std::thread::scope(|s| {
        let shutdown = &shutdown;
        let mut served = Vec::with_capacity(models.len());
        let mut loops = Vec::new();
        for m in models {
            match m {
                Loaded::Text { name, model, tokenizer, generation, eos_ids } => {
                    let device = model.device();
                    let (sampler, stepping) = (Sampler::from_env(&device)?, Stepping::from_env(&device)?);
                    // Warm before the server says it listens: its first request
                    // waits on none of a GPU's one-time costs.
                    if device.is_cuda() {
                        warm_up(model.frozen(), &device, sampler, stepping)?;
                    }
                    let (engine, decoding) =
                        engine::engine(model.frozen(), tokenizer, &device, opts.max_batch_rows, (sampler, stepping));
                    loops.push(s.spawn(move || decoding.run(shutdown)));
                    let context = model.config().context_length();
                    let max_request_rows = opts.max_request_rows;
                    let generator =
                        Generator { model, tokenizer, generation, eos_ids, context, max_request_rows, engine };
                    served.push((name.as_str(), Served::Text(generator)));
                }
                Loaded::Reward { name, model } => {
                    let (route, scoring) = score_route(model, opts.score_batch_size, opts.max_score_samples);
                    loops.push(s.spawn(move || scoring.run(shutdown)));
                    served.push((name.as_str(), Served::Reward(route)));
                }
            }
        }
        on_listen(server.addr());
        let routes = Routes { served };
        let result = server.serve(&stop, |request| routes.answer(request));
        // The engines stop with the flag, or once their handles are gone.
        drop(routes);
        loops.into_iter().map(|l| l.join().expect("a model thread panicked")).fold(result, Result::and)
    })
}

struct Routes<'m> {
    served: Vec<(&'m str, Served<'m>)>,
}

impl Routes<'_> {
    fn answer(&self, request: &JsonRequest) -> std::result::Result<Reply, HttpError> {
        let body = &request.body;
        match (request.method.as_str(), request.path.as_str()) {
            ("GET", "/") => Ok(Reply::Static { content_type: "text/html; charset=utf-8", body: PAGE }),
            ("GET", "/health") => Ok(Reply::Json(self.health())),
            ("GET", "/v1/models") => Ok(Reply::Json(self.models())),
            ("POST", "/v1/chat/completions") => {
                let (name, g) = self.text_model(body)?;
                openai::complete(g, name, Endpoint::Chat, body, &request.client)
            }
            ("POST", "/v1/completions") => {
                let (name, g) = self.text_model(body)?;
                openai::complete(g, name, Endpoint::Text, body, &request.client)
            }
            ("POST", "/score") => self.reward_model(body)?.answer(body, &request.client).map(Reply::Json),
            (method, path @ ("/" | "/health" | "/v1/models" | "/v1/chat/completions" | "/v1/completions" | "/score")) => {
                Err(HttpError::new(405, format!("{method} {path} is not allowed")))
            }
            (_, path) => Err(HttpError::new(
                404,
                format!("no route {path}; this server answers /v1/chat/completions, /v1/completions, /v1/models, /score, /health and /"),
            )),
        }
    }

    fn health(&self) -> Value {
        let models: serde_json::Map<String, Value> = self
            .served
            .iter()
            .map(|(name, s)| {
                let state = match s {
                    Served::Text(g) => g.engine.stats.json(),
                    Served::Reward(_) => json!({}),
                };
                (name.to_string(), state)
            })
            .collect();
        json!({ "status": "ok", "models": models })
    }

    /// OpenAI's model list, with what the page needs to know of each.
    fn models(&self) -> Value {
        let data: Vec<Value> = self
            .served
            .iter()
            .map(|(name, s)| {
                let mut entry = json!({ "id": name, "object": "model", "created": 0, "owned_by": "rloo" });
                match s {
                    Served::Text(g) => {
                        entry["kind"] = json!("text");
                        entry["chat_template"] = json!(g.tokenizer.chat_template().is_some());
                        entry["max_model_len"] = json!(g.context);
                    }
                    Served::Reward(_) => entry["kind"] = json!("reward"),
                }
                entry
            })
            .collect();
        json!({ "object": "list", "data": data })
    }

    /// The model a body's `"model"` names, or the only one of its kind.
    fn find<'a, T>(
        &'a self,
        body: &Value,
        kind: &str,
        pick: impl Fn(&'a Served) -> Option<&'a T>,
    ) -> std::result::Result<(&'a str, &'a T), HttpError> {
        let of_kind: Vec<(&str, &T)> = self.served.iter().filter_map(|(n, s)| pick(s).map(|t| (*n, t))).collect();
        let names = || self.served.iter().map(|(n, _)| format!("`{n}`")).collect::<Vec<_>>().join(", ");
        match body.get("model") {
            Some(Value::String(wanted)) => of_kind.into_iter().find(|(n, _)| n == wanted).ok_or_else(|| {
                let other_kind = self.served.iter().any(|(n, _)| n == wanted);
                if other_kind {
                    HttpError::bad_request(format!("`{wanted}` is not a {kind} model"))
                } else {
                    HttpError::new(404, format!("the model `{wanted}` does not exist; this server has {}", names()))
                }
            }),
            None | Some(Value::Null) if of_kind.len() == 1 => Ok(of_kind[0]),
            None | Some(Value::Null) => {
                Err(HttpError::bad_request(format!("name a {kind} model in `model`; this server has {}", names())))
            }
            Some(other) => Err(HttpError::bad_request(format!(
                "`model` must be a string, got {}",
                crate::data::prompt::describe_json(other)
            ))),
        }
    }

    fn text_model(&self, body: &Value) -> std::result::Result<(&str, &Generator<'_>), HttpError> {
        self.find(body, "text", |s| match s {
            Served::Text(g) => Some(g),
            Served::Reward(_) => None,
        })
    }

    fn reward_model(&self, body: &Value) -> std::result::Result<&ScoreRoute<'_>, HttpError> {
        self.find(body, "reward", |s| match s {
            Served::Reward(r) => Some(r),
            Served::Text(_) => None,
        })
        .map(|(_, r)| r)
    }
}

/// A `--model` argument: `NAME=DIR`, or a directory (or cached hub id)
/// served under the name given.
pub fn model_arg(arg: &str) -> (String, String) {
    match arg.split_once('=') {
        Some((name, dir)) if !name.is_empty() && !name.contains('/') => (name.to_string(), dir.to_string()),
        _ => (arg.to_string(), arg.to_string()),
    }
}
