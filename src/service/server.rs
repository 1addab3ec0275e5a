//! A small JSON-over-HTTP server: one thread accepting requests into a
//! bounded queue (503 when it is full), a pool of workers answering them
//! (JSON, an embedded page, or a stream of server-sent events), an optional
//! bearer token, a body size limit, and errors answered as JSON
//! (`{"error": {"message", "type", "code"}}`, the OpenAI shape that clients
//! of such servers already parse).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{json, Value};

use crate::error::{Error, Result};

/// How often a waiting thread looks at the stop flag.
const POLL: Duration = Duration::from_millis(200);

/// A request whose body has been read and parsed.
#[derive(Debug)]
pub struct JsonRequest {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The parsed body; `Null` when there was none.
    pub body: Value,
}

/// An answer other than 200, with the message the client sees.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpError {
    pub status: u16,
    pub message: String,
}

impl HttpError {
    pub fn new(status: u16, message: impl Into<String>) -> HttpError {
        HttpError { status, message: message.into() }
    }

    pub fn bad_request(message: impl Into<String>) -> HttpError {
        HttpError::new(400, message)
    }

    fn kind(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            404 => "not_found_error",
            413 => "request_too_large",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The OpenAI-shaped error body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "code": self.status}})
    }
}

/// What a handler answers with status 200.
pub enum Reply {
    Json(Value),
    /// A page embedded in the binary.
    Static {
        content_type: &'static str,
        body: &'static str,
    },
    /// Server-sent events: each item is one event's `data`, sent as soon
    /// as the iterator yields it; the stream ends with the iterator. When
    /// the client goes away the iterator is dropped, which is how whatever
    /// feeds it learns to stop.
    Events(Box<dyn Iterator<Item = String> + Send>),
}

/// How much the server takes on at once.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_body_bytes: usize,
    /// Requests handled at the same time, each on its own thread (a
    /// streamed answer holds its thread until it ends).
    pub workers: usize,
    /// Requests waiting for a worker; one more is answered 503 at once.
    pub max_queue: usize,
}

/// A bound socket and the rules every request must meet.
pub struct JsonServer {
    server: tiny_http::Server,
    /// Requests other than `GET /health` and `GET /` must carry `Authorization: Bearer <token>`.
    token: Option<String>,
    limits: Limits,
}

impl JsonServer {
    /// Listens on `host:port` (port 0: any free port; see [`addr`](Self::addr)).
    pub fn bind(host: &str, port: u16, token: Option<String>, limits: Limits) -> Result<JsonServer> {
        if limits.workers == 0 {
            return Err(Error::Invalid("a server needs at least one worker".into()));
        }
        let server = tiny_http::Server::http((host, port))
            .map_err(|e| Error::Invalid(format!("cannot listen on {host}:{port}: {e}")))?;
        Ok(JsonServer { server, token, limits })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.server_addr().to_ip().expect("an IP listener")
    }

    /// Answers requests until `stop()` says so: the calling thread accepts
    /// them into a bounded queue that the workers take from; each answer
    /// (status 200) or error comes from `handle`.
    pub fn serve(
        &self,
        stop: impl Fn() -> bool + Sync,
        handle: impl Fn(&JsonRequest) -> std::result::Result<Reply, HttpError> + Sync,
    ) -> Result<()> {
        // Counted from acceptance to the end of the answer, so that the
        // bound does not depend on whether a worker is between two requests.
        let capacity = self.limits.workers + self.limits.max_queue;
        let in_flight = AtomicUsize::new(0);
        let (queue, taken) = mpsc::sync_channel::<tiny_http::Request>(capacity);
        let taken = Mutex::new(taken);
        std::thread::scope(|s| {
            for _ in 0..self.limits.workers {
                s.spawn(|| loop {
                    let next = taken.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok(request) = next else { break };
                    self.answer(request, &handle);
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                });
            }
            // Once this returns the queue's sender is gone: the workers
            // finish what they hold and end.
            self.accept(&stop, queue, &in_flight, capacity)
        })
    }

    fn accept(
        &self,
        stop: &impl Fn() -> bool,
        queue: SyncSender<tiny_http::Request>,
        in_flight: &AtomicUsize,
        capacity: usize,
    ) -> Result<()> {
        while !stop() {
            let request =
                self.server.recv_timeout(POLL).map_err(|e| Error::Invalid(format!("accepting a request: {e}")))?;
            let Some(request) = request else { continue };
            if in_flight.fetch_add(1, Ordering::SeqCst) < capacity {
                if queue.send(request).is_err() {
                    break;
                }
                continue;
            }
            in_flight.fetch_sub(1, Ordering::SeqCst);
            let busy = HttpError::new(
                503,
                format!(
                    "the server is busy: {} requests in progress and {} waiting; try again shortly",
                    self.limits.workers, self.limits.max_queue
                ),
            );
            respond_json(request, busy.status, &busy.body());
        }
        Ok(())
    }

    fn answer(
        &self,
        mut request: tiny_http::Request,
        handle: &impl Fn(&JsonRequest) -> std::result::Result<Reply, HttpError>,
    ) {
        match self.read(&mut request).and_then(|r| handle(&r)) {
            Ok(Reply::Json(v)) => respond_json(request, 200, &v),
            Ok(Reply::Static { content_type, body }) => {
                let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes())
                    .expect("a valid header");
                if let Err(e) = request.respond(tiny_http::Response::from_string(body).with_header(header)) {
                    tracing::debug!("answering a request: {e}");
                }
            }
            Ok(Reply::Events(events)) => {
                if let Err(e) = stream_events(request.into_writer(), events) {
                    tracing::debug!("a client left an event stream: {e}");
                }
            }
            Err(e) => {
                tracing::debug!("{} {}: {} {}", request.method(), request.url(), e.status, e.message);
                respond_json(request, e.status, &e.body());
            }
        }
    }

    fn read(&self, request: &mut tiny_http::Request) -> std::result::Result<JsonRequest, HttpError> {
        let method = request.method().as_str().to_string();
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let public = method == "GET" && (path == "/health" || path == "/");
        if let (Some(token), false) = (&self.token, public) {
            let given = request
                .headers()
                .iter()
                .find(|h| h.field.equiv("Authorization"))
                .map(|h| h.value.as_str().trim().to_string());
            if given.as_deref().and_then(|v| v.strip_prefix("Bearer ")) != Some(token.as_str()) {
                let what = if given.is_some() { "a wrong bearer token" } else { "no Authorization header" };
                return Err(HttpError::new(401, format!("{what}: send `Authorization: Bearer <token>`")));
            }
        }
        let too_large = || {
            HttpError::new(413, format!("the body is larger than the limit of {} bytes", self.limits.max_body_bytes))
        };
        if request.body_length().is_some_and(|n| n > self.limits.max_body_bytes) {
            return Err(too_large());
        }
        let mut bytes = Vec::new();
        request
            .as_reader()
            .take(self.limits.max_body_bytes as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| HttpError::bad_request(format!("reading the body: {e}")))?;
        if bytes.len() > self.limits.max_body_bytes {
            return Err(too_large());
        }
        let body = if bytes.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).map_err(|e| HttpError::bad_request(format!("the body is not JSON: {e}")))?
        };
        Ok(JsonRequest { method, path, body })
    }
}

fn respond_json(request: tiny_http::Request, status: u16, body: &Value) {
    let content_type =
        tiny_http::Header::from_bytes(&b"Content-Type"[..], &b"application/json"[..]).expect("a valid header");
    let response =
        tiny_http::Response::from_string(body.to_string()).with_status_code(status).with_header(content_type);
    if let Err(e) = request.respond(response) {
        tracing::debug!("answering a request: {e}");
    }
}

/// Writes the answer by hand, each event as its own HTTP chunk flushed at
/// once (tiny_http's chunked writer would hold 8 KiB back).
fn stream_events(
    mut out: Box<dyn Write + Send>,
    events: Box<dyn Iterator<Item = String> + Send>,
) -> std::io::Result<()> {
    out.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
          Transfer-Encoding: chunked\r\n\r\n",
    )?;
    out.flush()?;
    for data in events {
        let event = format!("data: {data}\n\n");
        write!(out, "{:x}\r\n{event}\r\n", event.len())?;
        out.flush()?;
    }
    out.write_all(b"0\r\n\r\n")?;
    out.flush()
}
