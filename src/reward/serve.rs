//! `rloo reward serve`: a reward model behind the `http` reward protocol,
//! so that it can live on another machine (OpenRLHF's `serve_rm`).
//!
//! `POST /score` takes `{"prompts": [...], "completions": [...], "rows":
//! [...]}` (`rows` optional) and answers `{"scores": [...]}`; `GET /health`
//! answers `{"status": "ok", "model": ...}`. Requests that arrive together
//! are scored together, up to `batch_size` samples, by the prefix-sharing
//! scorer of [`RewardModel`]. Malformed requests get a 4xx JSON error naming
//! the field at fault. A sample the model cannot read (longer than its
//! context, or empty) gets `null`, as it gets no score inside `rloo train`,
//! and `"unscored": [{"index", "reason"}]` says why.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Mutex;

use serde_json::{json, Map, Value};

use super::{RewardModel, RewardSource, Sample};
use crate::data::prompt::describe_json;
use crate::data::Prompt;
use crate::error::{Error, Result};
use crate::service::server::{ClientWatch, HttpError, JsonRequest, JsonServer, Listen, NoMessage, Reply, Shutdown};
use crate::service::Cancel;

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where to listen, who may call, and the HTTP limits (the token
    /// guards `/score`).
    pub listen: Listen,
    /// Samples scored together at most.
    pub batch_size: usize,
    /// Samples one request may hold.
    pub max_request_samples: usize,
}

/// One request's samples, read and checked.
struct ScoreRequest {
    prompts: Vec<Prompt>,
    completions: Vec<String>,
    rows: Vec<Map<String, Value>>,
    /// `{"index", "reason"}` of each sample the model cannot read.
    unscored: Vec<Value>,
}

/// A request waiting for the scoring thread, and where its scores go.
struct Job {
    request: ScoreRequest,
    reply: Sender<Result<Vec<Option<f32>>>>,
    /// Set when the client has left: the job is dropped unscored.
    cancel: Cancel,
}

impl Job {
    fn len(&self) -> usize {
        self.request.completions.len()
    }
}

/// Serves until `stop()` says so; `on_listen` hears the bound address.
pub fn serve(
    model: &RewardModel,
    opts: &ServeOptions,
    stop: impl Fn() -> bool + Sync,
    on_listen: impl FnOnce(std::net::SocketAddr),
) -> Result<()> {
    if opts.batch_size == 0 || opts.max_request_samples == 0 {
        return Err(Error::Invalid("--batch-size and --max-request-samples must be at least 1".into()));
    }
    let server = JsonServer::bind(&opts.listen)?;
    on_listen(server.addr());
    let (route, scorer) = score_route(model, opts.batch_size, opts.max_request_samples);
    let model_name = model.dir().display().to_string();
    let shutdown = Shutdown::new(&stop, opts.listen.limits.shutdown_grace);
    std::thread::scope(|s| {
        let shutdown = &shutdown;
        let scorer = s.spawn(move || scorer.run(shutdown));
        let served =
            server.serve(&stop, |request: &JsonRequest| match (request.method.as_str(), request.path.as_str()) {
                ("GET", "/health") => Ok(Reply::Json(json!({"status": "ok", "model": model_name}))),
                ("POST", "/score") => route.answer(&request.body, &request.client).map(Reply::Json),
                (_, "/health" | "/score") => {
                    Err(HttpError::new(405, format!("{} {} is not allowed", request.method, request.path)))
                }
                (_, path) => Err(HttpError::new(404, format!("no route {path}; use POST /score or GET /health"))),
            });
        let scored = scorer.join().expect("the scoring thread panicked");
        served.and(scored)
    })
}

/// A reward model's `POST /score` route, for any server: requests from
/// the server's workers are queued for one [`ScoreLoop`].
pub struct ScoreRoute<'m> {
    model: &'m RewardModel,
    jobs: Mutex<Sender<Job>>,
    max_request_samples: usize,
}

/// The thread that scores what a [`ScoreRoute`] queues.
pub struct ScoreLoop<'m> {
    model: &'m RewardModel,
    queue: Receiver<Job>,
    batch_size: usize,
}

/// A route and the scoring loop behind it; run the loop on its own thread.
pub fn score_route(
    model: &RewardModel,
    batch_size: usize,
    max_request_samples: usize,
) -> (ScoreRoute<'_>, ScoreLoop<'_>) {
    let (jobs, queue) = mpsc::channel::<Job>();
    (ScoreRoute { model, jobs: Mutex::new(jobs), max_request_samples }, ScoreLoop { model, queue, batch_size })
}

impl ScoreRoute<'_> {
    /// Reads a `/score` body, waits for its scores and answers `{"scores":
    /// [...]}`; the job is dropped if `client` leaves first.
    pub fn answer(&self, body: &Value, client: &ClientWatch) -> std::result::Result<Value, HttpError> {
        let mut request = read_request(self.model, body, self.max_request_samples)?;
        let unscored = std::mem::take(&mut request.unscored);
        let (reply, answer) = mpsc::channel();
        let cancel = Cancel::default();
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Job { request, reply, cancel: cancel.clone() })
            .map_err(|_| HttpError::stopping())?;
        match client.recv(&answer, &cancel) {
            Ok(Ok(scores)) if unscored.is_empty() => Ok(json!({ "scores": scores })),
            Ok(Ok(scores)) => Ok(json!({ "scores": scores, "unscored": unscored })),
            Ok(Err(e)) => Err(HttpError::new(500, format!("scoring failed: {e}"))),
            Err(NoMessage::Closed) => Err(HttpError::stopping()),
            Err(NoMessage::ClientGone) => Err(HttpError::new(400, "the client left")),
        }
    }
}

impl ScoreLoop<'_> {
    /// Scores until the server stops (the batch in hand is finished; the
    /// jobs still queued are answered 503) or the route is gone.
    pub fn run(self, shutdown: &Shutdown) -> Result<()> {
        score_jobs(self.model, self.queue, self.batch_size, shutdown)
    }
}

/// The scoring thread: takes the first waiting job, adds whatever else is
/// queued up to `batch_size` samples, scores them in one call and answers
/// each job with its share.
fn score_jobs(model: &RewardModel, queue: Receiver<Job>, batch_size: usize, shutdown: &Shutdown) -> Result<()> {
    while !shutdown.stopping() {
        let first = match queue.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(job) => job,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut batch = vec![first];
        let mut n = batch[0].len();
        while n < batch_size {
            match queue.try_recv() {
                Ok(job) => {
                    n += job.len();
                    batch.push(job);
                }
                Err(_) => break,
            }
        }
        batch.retain(|job| !job.cancel.is_cancelled());
        // Samples with the same prompt share a group, and so their prefix.
        let mut groups: HashMap<String, usize> = HashMap::new();
        let mut samples = Vec::with_capacity(n);
        for Job { request: r, .. } in &batch {
            for ((prompt, completion), row) in r.prompts.iter().zip(&r.completions).zip(&r.rows) {
                let next = groups.len();
                let group = *groups.entry(format!("{prompt:?}")).or_insert(next);
                samples.push(Sample { prompt, completion, completion_ids: &[], ended_with_eos: true, row, group });
            }
        }
        let scores = model.score(&samples);
        let mut at = 0;
        for job in &batch {
            let share =
                scores.as_ref().map(|s| s[at..at + job.len()].to_vec()).map_err(|e| Error::Invalid(e.to_string()));
            at += job.len();
            let _ = job.reply.send(share);
        }
    }
    Ok(())
}

/// Reads and checks a `/score` body.
fn read_request(model: &RewardModel, body: &Value, max_samples: usize) -> std::result::Result<ScoreRequest, HttpError> {
    let field = |name: &str| -> std::result::Result<Option<&Vec<Value>>, HttpError> {
        match body.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(other) => {
                Err(HttpError::bad_request(format!("`{name}` must be a list, got {}", describe_json(other))))
            }
        }
    };
    if !body.is_object() {
        return Err(HttpError::bad_request(format!(
            "the body must be an object {{\"prompts\", \"completions\", \"rows\"}}, got {}",
            describe_json(body)
        )));
    }
    let prompts = field("prompts")?.ok_or_else(|| HttpError::bad_request("missing `prompts`"))?;
    let completions = field("completions")?.ok_or_else(|| HttpError::bad_request("missing `completions`"))?;
    let n = prompts.len();
    if completions.len() != n {
        return Err(HttpError::bad_request(format!("{n} prompts but {} completions", completions.len())));
    }
    if n > max_samples {
        return Err(HttpError::new(413, format!("{n} samples in one request; the limit is {max_samples}")));
    }
    let rows = match field("rows")? {
        Some(rows) if rows.len() != n => {
            return Err(HttpError::bad_request(format!("{n} prompts but {} rows", rows.len())))
        }
        Some(rows) => rows
            .iter()
            .enumerate()
            .map(|(i, r)| match r {
                Value::Object(m) => Ok(m.clone()),
                other => {
                    Err(HttpError::bad_request(format!("rows[{i}] must be an object, got {}", describe_json(other))))
                }
            })
            .collect::<std::result::Result<Vec<_>, _>>()?,
        None => vec![Map::new(); n],
    };
    let prompts = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Prompt::from_value(p).map_err(|e| HttpError::bad_request(format!("prompts[{i}]: {e}"))))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let completions = completions
        .iter()
        .enumerate()
        .map(|(i, c)| match c {
            Value::String(s) => Ok(s.clone()),
            other => {
                Err(HttpError::bad_request(format!("completions[{i}] must be a string, got {}", describe_json(other))))
            }
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    // Encoding errors (a chat prompt for a model without a chat template)
    // are the client's, and are found here rather than in a shared batch.
    let mut unscored = Vec::new();
    for (i, (prompt, completion)) in prompts.iter().zip(&completions).enumerate() {
        let ids = super::model::encode_pair(model.tokenizer(), prompt, completion)
            .map_err(|e| HttpError::bad_request(format!("sample {i}: {e}")))?;
        let unreadable = match model.check_fits(&ids) {
            Err(e) => Some(e.to_string()),
            Ok(()) if ids.is_empty() => Some("prompt and completion are both empty".to_string()),
            Ok(()) => None,
        };
        if let Some(reason) = unreadable {
            unscored.push(json!({"index": i, "reason": reason}));
        }
    }
    Ok(ScoreRequest { prompts, completions, rows, unscored })
}
