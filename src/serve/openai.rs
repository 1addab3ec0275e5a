//! OpenAI's chat and text completion endpoints over the engine: request
//! bodies read into generation requests (with the error a client of the
//! OpenAI API expects for each bad field), and answers built in OpenAI's
//! shapes, whole or streamed as `chat.completion.chunk` /
//! `text_completion` events ending with `[DONE]`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::engine::{Event, GenRequest, TokenLogprob};
use super::Generator;
use crate::data::prompt::describe_json;
use crate::data::{Message, Prompt};
use crate::generate::{FinishReason, Sampling, StopCriteria};
use crate::service::server::{ClientWatch, HttpError, NoMessage, Reply};
use crate::service::Cancel;

/// The most alternatives a token's log-probs may list.
const MAX_TOP_LOGPROBS: usize = 20;

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Endpoint {
    Chat,
    Text,
}

impl Endpoint {
    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Text, _) => "text_completion",
        }
    }

    fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Text => "cmpl",
        }
    }
}

/// A request read and checked, before it reaches the engine.
struct Parsed {
    /// One prompt for chat; one or several for text completions.
    prompts: Vec<Vec<u32>>,
    n: usize,
    max_tokens: usize,
    sampling: Sampling,
    repetition_penalty: f32,
    stop_ids: Vec<u32>,
    stop_strings: Vec<String>,
    seed: u64,
    logprobs: Option<usize>,
    stream: bool,
    include_usage: bool,
}

/// Answers a `/v1/chat/completions` or `/v1/completions` body; the
/// request's completions are cancelled if `client` leaves before the
/// answer is sent.
pub fn complete(
    model: &Generator,
    name: &str,
    endpoint: Endpoint,
    body: &Value,
    client: &ClientWatch,
) -> Result<Reply, HttpError> {
    let parsed = parse(model, endpoint, body)?;
    let (events, heard) = mpsc::channel();
    let cancel = Cancel::default();
    let n = parsed.n;
    for (p, prompt) in parsed.prompts.iter().enumerate() {
        let request = GenRequest {
            prompt: prompt.clone(),
            n,
            first_choice: p * n,
            max_tokens: parsed.max_tokens,
            sampling: parsed.sampling.clone(),
            repetition_penalty: parsed.repetition_penalty,
            stop_ids: parsed.stop_ids.clone(),
            stop_strings: parsed.stop_strings.clone(),
            seed: parsed.seed.wrapping_add(p as u64),
            logprobs: parsed.logprobs,
            events: events.clone(),
            cancel: cancel.clone(),
        };
        if let Err(e) = model.engine.submit(request) {
            cancel.cancel();
            return Err(HttpError::new(503, e));
        }
    }
    drop(events);
    let answer = Answer::new(endpoint, name, &parsed);
    let client = client.clone();
    if parsed.stream {
        Ok(Reply::Events(Box::new(Stream { answer, heard, client, cancel, opened: false, tail: None })))
    } else {
        collect(answer, &heard, &client, &cancel).map(Reply::Json)
    }
}

fn parse(model: &Generator, endpoint: Endpoint, body: &Value) -> Result<Parsed, HttpError> {
    let body = body.as_object().ok_or_else(|| {
        HttpError::bad_request(format!("the body must be a JSON object, got {}", describe_json(body)))
    })?;
    let field = Fields(body);
    field.reject_unsupported()?;
    let prompts = match endpoint {
        Endpoint::Chat => vec![chat_prompt(model, field.get("messages"))?],
        Endpoint::Text => text_prompts(model, field.get("prompt"))?,
    };
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let max_tokens = match field.uint("max_completion_tokens")?.or(field.uint("max_tokens")?) {
        Some(0) => return Err(HttpError::bad_request("max_tokens must be at least 1")),
        Some(n) => n,
        None => model.default_max_tokens(endpoint, longest),
    };
    if let Some(context) = model.context {
        let what = if endpoint == Endpoint::Chat { "messages" } else { "prompt" };
        if longest >= context {
            return Err(HttpError::bad_request(format!(
                "This model's maximum context length is {context} tokens, but the {what} is {longest} tokens; \
                 shorten it"
            )));
        }
        if longest + max_tokens > context {
            return Err(HttpError::bad_request(format!(
                "This model's maximum context length is {context} tokens. However, you requested {} tokens \
                 ({longest} in the {what}, {max_tokens} in the completion); lower max_tokens to at most {}",
                longest + max_tokens,
                context - longest
            )));
        }
    }
    for ids in &prompts {
        model.model.check_tokens(ids).map_err(|e| HttpError::bad_request(e.to_string()))?;
    }
    let n = field.uint("n")?.unwrap_or(1);
    if n == 0 || n > model.engine.max_rows {
        return Err(HttpError::bad_request(format!("n must be between 1 and {}, got {n}", model.engine.max_rows)));
    }
    let rows = prompts.len().saturating_mul(n);
    if rows > model.max_request_rows {
        return Err(HttpError::bad_request(format!(
            "this request asks for {} prompts x n = {n}, {rows} completions; a request may ask for at most {} \
             (--max-request-rows): send fewer prompts per request",
            prompts.len(),
            model.max_request_rows
        )));
    }
    if let Some(best_of) = field.uint("best_of")? {
        if best_of != n {
            return Err(HttpError::bad_request("best_of other than n is not supported"));
        }
    }
    let logprobs = match endpoint {
        Endpoint::Chat => match field.get("logprobs") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(field.uint("top_logprobs")?.unwrap_or(0)),
            Some(other) => {
                return Err(HttpError::bad_request(format!("logprobs must be a boolean, got {}", describe_json(other))))
            }
        },
        Endpoint::Text => field.uint("logprobs")?,
    };
    if logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
        return Err(HttpError::bad_request(format!("at most {MAX_TOP_LOGPROBS} top log-probs per token")));
    }
    let mut stop_ids = if field.bool("ignore_eos")?.unwrap_or(false) { Vec::new() } else { model.eos_ids.to_vec() };
    stop_ids.extend(field.uint_list("stop_token_ids")?.into_iter().map(|id| id as u32));
    let include_usage = match field.get("stream_options") {
        Some(Value::Object(o)) => o.get("include_usage").and_then(Value::as_bool).unwrap_or(false),
        _ => false,
    };
    Ok(Parsed {
        prompts,
        n,
        max_tokens,
        sampling: sampling(model, &field)?,
        repetition_penalty: match field.float("repetition_penalty")?.or(model.generation.repetition_penalty) {
            Some(p) if !(p.is_finite() && p > 0.0) => {
                return Err(HttpError::bad_request(format!("repetition_penalty must be > 0, got {p}")))
            }
            p => p.unwrap_or(1.0) as f32,
        },
        stop_ids,
        stop_strings: field.stop()?,
        seed: match field.get("seed") {
            None => fresh_seed(),
            // Negative seeds (some clients send them) wrap around.
            Some(v) => v.as_u64().or(v.as_i64().map(|x| x as u64)).ok_or_else(|| {
                HttpError::bad_request(format!("`seed` must be an integer, got {}", describe_json(v)))
            })?,
        },
        logprobs,
        stream: field.bool("stream")?.unwrap_or(false),
        include_usage,
    })
}

/// Sampling from the request, each setting falling back to the model's
/// `generation_config.json`, then to OpenAI's defaults (temperature 1, no
/// truncation). Temperature 0 is greedy.
fn sampling(model: &Generator, field: &Fields) -> Result<Sampling, HttpError> {
    let gen = &model.generation;
    let sampled_by_default = gen.do_sample != Some(false);
    let default_temperature = if sampled_by_default { gen.temperature.unwrap_or(1.0) } else { 0.0 };
    let temperature = field.float("temperature")?.unwrap_or(default_temperature);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(HttpError::bad_request(format!("temperature must be in [0, 2], got {temperature}")));
    }
    if temperature == 0.0 {
        return Ok(Sampling::greedy());
    }
    // vLLM's -1 for "no top-k" is accepted too.
    let top_k = match field.get("top_k") {
        Some(Value::Number(k)) if k.as_i64() == Some(-1) => 0,
        _ => field.uint("top_k")?.or(gen.top_k.map(|k| k as usize)).unwrap_or(0),
    };
    let sampling = Sampling::temperature(temperature as f32)
        .with_top_k(top_k)
        .with_top_p(field.float("top_p")?.or(gen.top_p).unwrap_or(1.0) as f32)
        .with_min_p(field.float("min_p")?.or(gen.min_p).unwrap_or(0.0) as f32);
    sampling.validate().map_err(HttpError::bad_request)?;
    Ok(sampling)
}

fn chat_prompt(model: &Generator, messages: Option<&Value>) -> Result<Vec<u32>, HttpError> {
    let Some(Value::Array(items)) = messages else {
        return Err(HttpError::bad_request("`messages` must be a non-empty list of {role, content} objects"));
    };
    if items.is_empty() {
        return Err(HttpError::bad_request("`messages` is empty"));
    }
    let messages = items
        .iter()
        .enumerate()
        .map(|(i, m)| message(m).map_err(|e| HttpError::bad_request(format!("messages[{i}]: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    model
        .tokenizer
        .encode_prompt(&Prompt::Messages(messages))
        .map_err(|e| HttpError::bad_request(format!("{e}; send text to /v1/completions instead")))
}

/// A chat message: `content` as a string, or a list of text parts.
fn message(value: &Value) -> Result<Message, String> {
    let role = value.get("role").and_then(Value::as_str).ok_or("missing the string `role`")?;
    let content = match value.get("content") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => String::new(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(text)) => Ok(text),
                _ => Err(format!("only text content parts are supported, got {}", describe_json(p))),
            })
            .collect::<Result<Vec<_>, _>>()?
            .concat(),
        Some(other) => {
            return Err(format!("`content` must be a string or a list of parts, got {}", describe_json(other)))
        }
    };
    Ok(Message::new(role, content))
}

/// A string, a list of strings, a list of token ids, or a list of lists.
fn text_prompts(model: &Generator, prompt: Option<&Value>) -> Result<Vec<Vec<u32>>, HttpError> {
    let bad = |what: String| HttpError::bad_request(format!("`prompt` {what}"));
    let encode = |text: &str| -> Result<Vec<u32>, HttpError> {
        let ids = model.tokenizer.encode_prompt(&Prompt::Text(text.to_string())).map_err(|e| bad(e.to_string()))?;
        if ids.is_empty() {
            return Err(bad("has no tokens".into()));
        }
        Ok(ids)
    };
    let ids = |items: &[Value]| -> Result<Vec<u32>, HttpError> {
        let ids: Option<Vec<u32>> = items.iter().map(|v| v.as_u64().map(|i| i as u32)).collect();
        ids.filter(|ids| !ids.is_empty()).ok_or_else(|| bad("must hold token ids (non-negative integers)".into()))
    };
    match prompt {
        Some(Value::String(s)) => Ok(vec![encode(s)?]),
        Some(Value::Array(items)) if items.is_empty() => Err(bad("is empty".into())),
        Some(Value::Array(items)) => match &items[0] {
            Value::Number(_) => Ok(vec![ids(items)?]),
            Value::String(_) => items
                .iter()
                .map(|v| v.as_str().ok_or_else(|| bad("mixes strings and other values".into())).and_then(encode))
                .collect(),
            Value::Array(_) => items
                .iter()
                .map(|v| v.as_array().ok_or_else(|| bad("mixes lists and other values".into())).and_then(|l| ids(l)))
                .collect(),
            other => Err(bad(format!("must be text or token ids, got a list of {}", describe_json(other)))),
        },
        Some(other) => Err(bad(format!("must be a string or a list, got {}", describe_json(other)))),
        None => Err(bad("is missing".into())),
    }
}

/// Typed reads of a body's fields, with OpenAI-style messages.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn uint(&self, name: &str) -> Result<Option<usize>, HttpError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                HttpError::bad_request(format!("`{name}` must be a non-negative integer, got {}", describe_json(v)))
            }),
        }
    }

    fn float(&self, name: &str) -> Result<Option<f64>, HttpError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| HttpError::bad_request(format!("`{name}` must be a number, got {}", describe_json(v)))),
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, HttpError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| {
                HttpError::bad_request(format!("`{name}` must be true or false, got {}", describe_json(v)))
            }),
        }
    }

    fn uint_list(&self, name: &str) -> Result<Vec<u64>, HttpError> {
        match self.get(name) {
            None => Some(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(|v| v.as_u64()).collect::<Option<Vec<_>>>(),
            Some(_) => None,
        }
        .ok_or_else(|| HttpError::bad_request(format!("`{name}` must be a list of non-negative integers")))
    }

    /// `stop`: a string or a list of strings.
    fn stop(&self) -> Result<Vec<String>, HttpError> {
        let strings = match self.get("stop") {
            None => return Ok(Vec::new()),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| HttpError::bad_request("`stop` must be a string or a list of strings"))?,
            Some(other) => {
                return Err(HttpError::bad_request(format!(
                    "`stop` must be a string or a list of strings, got {}",
                    describe_json(other)
                )))
            }
        };
        StopCriteria::check_strings(&strings).map_err(|e| HttpError::bad_request(format!("`stop`: {e}")))?;
        Ok(strings)
    }

    /// Options that would change the answer and that this server does not
    /// implement are refused rather than silently ignored; their neutral
    /// values (what clients send by default) are fine.
    fn reject_unsupported(&self) -> Result<(), HttpError> {
        let unsupported = |what: &str| Err(HttpError::bad_request(format!("`{what}` is not supported by this server")));
        for penalty in ["presence_penalty", "frequency_penalty"] {
            if self.float(penalty)?.is_some_and(|p| p != 0.0) {
                return unsupported(penalty);
            }
        }
        if self.bool("echo")? == Some(true) {
            return unsupported("echo");
        }
        for name in ["suffix", "tools", "functions"] {
            if self.get(name).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
                return unsupported(name);
            }
        }
        if self.get("logit_bias").is_some_and(|v| v.as_object().is_none_or(|o| !o.is_empty())) {
            return unsupported("logit_bias");
        }
        match self.get("response_format").and_then(|f| f.get("type")).and_then(Value::as_str) {
            None | Some("text") => Ok(()),
            Some(other) => unsupported(&format!("response_format {other}")),
        }
    }
}

/// A seed for requests that bring none.
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(32)
}

/// One choice's text and tokens so far.
#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<TokenLogprob>,
    finish_reason: Option<FinishReason>,
    tokens: usize,
}

/// The answer being assembled from the engine's events.
struct Answer {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    include_usage: bool,
    prompt_tokens: usize,
    choices: Vec<Choice>,
}

impl Answer {
    fn new(endpoint: Endpoint, model: &str, parsed: &Parsed) -> Answer {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let serial = NEXT.fetch_add(1, Ordering::Relaxed);
        Answer {
            endpoint,
            id: format!("{}-{:x}{:06x}", endpoint.id_prefix(), fresh_seed() & 0xffff_ffff, serial),
            created,
            model: model.to_string(),
            logprobs: parsed.logprobs.is_some(),
            include_usage: parsed.include_usage,
            prompt_tokens: parsed.prompts.iter().map(Vec::len).sum(),
            choices: (0..parsed.prompts.len() * parsed.n).map(|_| Choice::default()).collect(),
        }
    }

    fn finished(&self) -> bool {
        self.choices.iter().all(|c| c.finish_reason.is_some())
    }

    fn usage(&self) -> Value {
        let completion: usize = self.choices.iter().map(|c| c.tokens).sum();
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        })
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.endpoint.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// A choice in a whole answer or a chunk: `text` and `logprobs` are
    /// the whole completion's or the chunk's.
    fn choice(
        &self,
        index: usize,
        text: &str,
        logprobs: &[TokenLogprob],
        finish: Option<FinishReason>,
        chunk: bool,
    ) -> Value {
        let logprobs = self.logprobs.then(|| match self.endpoint {
            Endpoint::Chat => json!({ "content": logprobs.iter().map(chat_logprob).collect::<Vec<_>>() }),
            Endpoint::Text => text_logprobs(logprobs),
        });
        let mut choice = json!({ "index": index, "logprobs": logprobs, "finish_reason": finish });
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => choice["message"] = json!({ "role": "assistant", "content": text }),
            (Endpoint::Chat, true) if finish.is_some() && text.is_empty() => choice["delta"] = json!({}),
            (Endpoint::Chat, true) => choice["delta"] = json!({ "content": text }),
            (Endpoint::Text, _) => choice["text"] = json!(text),
        }
        choice
    }

    /// The whole answer, once every choice has finished.
    fn whole(&self) -> Value {
        let choices = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| self.choice(i, &c.text, &c.logprobs, c.finish_reason, false))
            .collect();
        let mut answer = self.envelope(false, choices);
        answer["usage"] = self.usage();
        answer
    }
}

fn chat_logprob(t: &TokenLogprob) -> Value {
    let entry = |token: &str, logprob: f32| json!({ "token": token, "logprob": logprob, "bytes": token.as_bytes() });
    let mut v = entry(&t.token, t.logprob);
    v["top_logprobs"] = t.top.iter().map(|(tok, lp)| entry(tok, *lp)).collect::<Vec<_>>().into();
    v
}

/// The legacy completions shape: parallel lists, alternatives as maps.
fn text_logprobs(tokens: &[TokenLogprob]) -> Value {
    let mut offset = 0;
    let offsets: Vec<usize> = tokens
        .iter()
        .map(|t| {
            let at = offset;
            offset += t.token.len();
            at
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens
            .iter()
            .map(|t| t.top.iter().map(|(tok, lp)| (tok.clone(), json!(lp))).collect::<Map<_, _>>())
            .collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// Waits for every choice and answers with the whole completion.
fn collect(
    mut answer: Answer,
    heard: &Receiver<Event>,
    client: &ClientWatch,
    cancel: &Cancel,
) -> Result<Value, HttpError> {
    while !answer.finished() {
        match client.recv(heard, cancel) {
            Ok(Event::Token { choice, text, logprob }) => {
                let c = &mut answer.choices[choice];
                c.text.push_str(&text);
                c.logprobs.extend(logprob);
            }
            Ok(Event::Done { choice, finish_reason, tokens }) => {
                answer.choices[choice].finish_reason = Some(finish_reason);
                answer.choices[choice].tokens = tokens;
            }
            Ok(Event::Failed(e)) => return Err(HttpError::new(500, format!("generation failed: {e}"))),
            Ok(Event::Stopped) | Err(NoMessage::Closed) => return Err(HttpError::stopping()),
            Err(NoMessage::ClientGone) => return Err(HttpError::new(400, "the client left")),
        }
    }
    Ok(answer.whole())
}

/// The streamed answer: one chunk per event that carries something, then
/// the usage chunk when asked for, then `[DONE]`.
struct Stream {
    answer: Answer,
    heard: Receiver<Event>,
    client: ClientWatch,
    /// Set when the stream is dropped before its end: the client left.
    cancel: Cancel,
    opened: bool,
    /// What is left to send once the completions have ended, last first.
    tail: Option<Vec<String>>,
}

impl Iterator for Stream {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        if let Some(tail) = &mut self.tail {
            return tail.pop();
        }
        let a = &mut self.answer;
        if !self.opened {
            self.opened = true;
            // Chat streams open each choice with the assistant's role.
            if a.endpoint == Endpoint::Chat {
                let open = |i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
                return Some(a.envelope(true, (0..a.choices.len()).map(open).collect()).to_string());
            }
        }
        while !a.finished() {
            let event = match self.client.recv(&self.heard, &self.cancel) {
                Ok(event) => event,
                Err(NoMessage::Closed) => Event::Stopped,
                Err(NoMessage::ClientGone) => return None,
            };
            match event {
                Event::Token { choice, text, logprob } => {
                    a.choices[choice].tokens += 1;
                    if text.is_empty() && logprob.is_none() {
                        continue;
                    }
                    let logprobs: Vec<TokenLogprob> = logprob.into_iter().collect();
                    let chunk = a.choice(choice, &text, &logprobs, None, true);
                    return Some(a.envelope(true, vec![chunk]).to_string());
                }
                Event::Done { choice, finish_reason, tokens } => {
                    a.choices[choice].finish_reason = Some(finish_reason);
                    a.choices[choice].tokens = tokens;
                    let chunk = a.choice(choice, "", &[], Some(finish_reason), true);
                    return Some(a.envelope(true, vec![chunk]).to_string());
                }
                Event::Failed(e) => {
                    self.tail = Some(vec!["[DONE]".to_string()]);
                    return Some(HttpError::new(500, format!("generation failed: {e}")).body().to_string());
                }
                Event::Stopped => {
                    self.tail = Some(vec!["[DONE]".to_string()]);
                    return Some(HttpError::stopping().body().to_string());
                }
            }
        }
        let mut tail = vec!["[DONE]".to_string()];
        if a.include_usage {
            let mut usage = a.envelope(true, Vec::new());
            usage["usage"] = a.usage();
            tail.push(usage.to_string());
        }
        let next = tail.pop();
        self.tail = Some(tail);
        next
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // Dropped unfinished when the client left (or the answer failed):
        // the completions still decoding stop.
        if !self.answer.finished() {
            self.cancel.cancel();
        }
    }
}
