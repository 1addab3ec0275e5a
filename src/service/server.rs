//! A JSON-over-HTTP server that holds under hostile clients: a thread per
//! connection up to `max_connections` (one more is answered 503 at once),
//! each request checked ([`Access`]: Host, Origin, token, JSON bodies) and
//! read within its limits ([`super::http`]) before a handler sees it, at
//! most `workers` requests in a handler at once and `max_queue` waiting
//! for one (503 beyond), and answers as JSON, an embedded page, or a
//! stream of server-sent events. Errors are answered as JSON (`{"error":
//! {"message", "type", "code"}}`, the OpenAI shape that clients of such
//! servers already parse).
//!
//! A handler's request carries a [`ClientWatch`], so that work for a
//! client that has left can be dropped. Once `stop()` is true the server
//! takes no new connection or request and returns when the requests in
//! flight have been answered; their handlers are asked to finish within
//! [`Limits::shutdown_grace`].

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub use super::access::Access;
use super::http::{self, Connection, Framing, Head, ReadError, ResponseHead};
pub use super::http::{ClientWatch, NoMessage};
use crate::error::{Error, Result};

/// How often a waiting thread looks at the stop flag.
const POLL: Duration = Duration::from_millis(100);

/// A request whose body has been read and parsed.
#[derive(Debug)]
pub struct JsonRequest {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    /// The parsed body; `Null` when there was none.
    pub body: Value,
    /// Whether the client is still there.
    pub client: ClientWatch,
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

    /// The server is stopping and takes no new work.
    pub fn stopping() -> HttpError {
        HttpError::new(503, "the server is stopping")
    }

    fn kind(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            408 => "timeout_error",
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

/// How much the server takes on, and how long it waits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_body_bytes: usize,
    /// Request line and headers together.
    pub max_header_bytes: usize,
    /// Requests in a handler at the same time (a streamed answer holds its
    /// place until it ends). `GET` requests are answered outside this count.
    pub workers: usize,
    /// Requests waiting for a handler; one more is answered 503 at once.
    pub max_queue: usize,
    /// Open connections, idle ones included; one more is answered 503.
    pub max_connections: usize,
    /// A request's head and body must arrive within this, and each write
    /// of an answer must be taken by the client within it.
    pub request_timeout: Duration,
    /// An idle connection is closed after this.
    pub keep_alive: Duration,
    /// Work in flight when the server is asked to stop gets this long to
    /// finish; what is left is then cancelled.
    pub shutdown_grace: Duration,
}

/// Where a server listens, who may use it, and its limits.
#[derive(Debug, Clone)]
pub struct Listen {
    pub host: String,
    /// 0: any free port (see [`JsonServer::addr`]).
    pub port: u16,
    pub access: Access,
    /// Listen beyond loopback without a token.
    pub insecure_no_api_key: bool,
    pub limits: Limits,
}

/// Stopping in two stages: no new work once `stop()` is true, and work in
/// flight cancelled once the grace period has passed since.
pub struct Shutdown<'a> {
    stop: &'a (dyn Fn() -> bool + Sync),
    grace: Duration,
    asked: std::sync::OnceLock<Instant>,
}

impl<'a> Shutdown<'a> {
    pub fn new(stop: &'a (dyn Fn() -> bool + Sync), grace: Duration) -> Shutdown<'a> {
        Shutdown { stop, grace, asked: std::sync::OnceLock::new() }
    }

    /// Whether new work is refused.
    pub fn stopping(&self) -> bool {
        if self.asked.get().is_some() {
            return true;
        }
        if (self.stop)() {
            self.asked.get_or_init(Instant::now);
            return true;
        }
        false
    }

    /// Whether work in flight must end now.
    pub fn past_grace(&self) -> bool {
        self.stopping() && self.asked.get().is_some_and(|at| at.elapsed() >= self.grace)
    }
}

/// A bound socket and the rules every request must meet.
pub struct JsonServer {
    listener: TcpListener,
    rules: Rules,
}

/// What every connection is held to.
struct Rules {
    access: Access,
    limits: Limits,
}

impl JsonServer {
    /// Listens on `listen.host:port`, after [`Access::check_bind`].
    pub fn bind(listen: &Listen) -> Result<JsonServer> {
        let Listen { host, port, access, insecure_no_api_key, limits } = listen;
        if limits.workers == 0 || limits.max_connections == 0 {
            return Err(Error::Invalid("a server needs at least one worker and one connection".into()));
        }
        access.check_bind(host, *port, *insecure_no_api_key)?;
        let listener = TcpListener::bind((host.trim_start_matches('[').trim_end_matches(']'), *port))
            .map_err(|e| Error::Invalid(format!("cannot listen on {host}:{port}: {e}")))?;
        if let Some(warning) = access.exposure(host, *port) {
            tracing::warn!("{warning}");
        }
        Ok(JsonServer { listener, rules: Rules { access: access.clone(), limits: *limits } })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener")
    }

    /// Answers requests until `stop()` says so, each with `handle`; then
    /// closes the socket, so that new connections are refused, and waits
    /// for the answers in flight.
    pub fn serve(
        self,
        stop: impl Fn() -> bool + Sync,
        handle: impl Fn(&JsonRequest) -> std::result::Result<Reply, HttpError> + Sync,
    ) -> Result<()> {
        let JsonServer { listener, rules } = self;
        let rules = &rules;
        let slots = Slots::new(rules.limits.workers, rules.limits.max_queue);
        let open = AtomicUsize::new(0);
        let stop: &(dyn Fn() -> bool + Sync) = &stop;
        let handle: &(dyn Fn(&JsonRequest) -> std::result::Result<Reply, HttpError> + Sync) = &handle;
        std::thread::scope(|s| {
            while !stop() {
                if !readable(&listener, POLL) {
                    continue;
                }
                let stream = match listener.accept() {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors, say: wait rather than spin.
                        tracing::warn!("accepting a connection: {e}");
                        std::thread::sleep(POLL);
                        continue;
                    }
                };
                if open.fetch_add(1, Ordering::SeqCst) >= rules.limits.max_connections {
                    open.fetch_sub(1, Ordering::SeqCst);
                    rules.turn_away(stream);
                    continue;
                }
                let (slots, open) = (&slots, &open);
                let spawned = std::thread::Builder::new().name("http".into()).spawn_scoped(s, move || {
                    rules.connection(stream, slots, stop, handle);
                    open.fetch_sub(1, Ordering::SeqCst);
                });
                if let Err(e) = spawned {
                    open.fetch_sub(1, Ordering::SeqCst);
                    tracing::warn!("no thread for a connection: {e}");
                }
            }
            drop(listener);
        });
        Ok(())
    }
}

impl Rules {
    /// A connection beyond `max_connections`: 503, closed.
    fn turn_away(&self, stream: TcpStream) {
        let busy = HttpError::new(
            503,
            format!("the server has {} connections open, its limit; try again shortly", self.limits.max_connections),
        );
        if let Ok(mut conn) = Connection::new(stream, Duration::from_millis(200)) {
            let head =
                ResponseHead { status: 503, headers: vec![("Content-Type", "application/json")], keep_alive: false };
            let _ = head.send(&mut conn, busy.body().to_string().as_bytes());
        }
    }

    /// Requests on one connection, one after another, until it closes.
    fn connection(
        &self,
        stream: TcpStream,
        slots: &Slots,
        stop: &(dyn Fn() -> bool + Sync),
        handle: &(dyn Fn(&JsonRequest) -> std::result::Result<Reply, HttpError> + Sync),
    ) {
        let Ok(mut conn) = Connection::new(stream, self.limits.request_timeout) else { return };
        // A new connection must send its first request as promptly as any
        // request's parts arrive; later ones may wait keep_alive.
        let mut idle = self.limits.request_timeout;
        loop {
            let (head, started) =
                match conn.read_head(self.limits.max_header_bytes, idle, self.limits.request_timeout, stop) {
                    Ok(Some(head)) => head,
                    Ok(None) | Err(ReadError::Closed) => return,
                    Err(ReadError::Answer(e)) => return refuse(conn, &e, None),
                };
            idle = self.limits.keep_alive;
            match self.exchange(&mut conn, &head, started, slots, stop, handle) {
                Ok(true) => {}
                Ok(false) => return,
                Err((e, cors)) => return refuse(conn, &e, cors.as_deref()),
            }
        }
    }

    /// One request and its answer. `Ok(keep the connection)`; `Err`: the
    /// request was refused before its body was read, so the connection
    /// cannot carry another.
    fn exchange(
        &self,
        conn: &mut Connection,
        head: &Head,
        started: Instant,
        slots: &Slots,
        stop: &(dyn Fn() -> bool + Sync),
        handle: &(dyn Fn(&JsonRequest) -> std::result::Result<Reply, HttpError> + Sync),
    ) -> std::result::Result<bool, (HttpError, Option<String>)> {
        let path = head.path().to_string();
        let public = head.method == "GET" && (path == "/" || path == "/health");
        let passed = self.access.check(head, public).map_err(|e| (e, None))?;
        let cors = passed.cors_origin;
        let limits = &self.limits;
        let framing = head.framing(limits.max_body_bytes).map_err(|e| (e, cors.clone()))?;
        if head.expects_continue() && framing != Framing::Length(0) && http::send_continue(conn).is_err() {
            return Ok(false);
        }
        let deadline = started + limits.request_timeout;
        let bytes = match conn.read_body(framing, limits.max_body_bytes, deadline, limits.request_timeout, stop) {
            Ok(bytes) => bytes,
            Err(ReadError::Closed) => return Ok(false),
            Err(ReadError::Answer(e)) => return Err((e, cors)),
        };
        let keep_alive = head.keep_alive() && !stop();
        let answer = Answer { conn, cors: cors.as_deref(), keep_alive };
        if passed.preflight {
            return Ok(answer.preflight() && keep_alive);
        }
        if stop() {
            answer.error(&HttpError::stopping());
            return Ok(false);
        }
        let slot = match head.method.as_str() {
            "GET" => None,
            _ => match slots.acquire(stop, &answer.conn.watch()) {
                Ok(slot) => Some(slot),
                Err(e) => return Ok(answer.error(&e) && keep_alive),
            },
        };
        let reply = parse_body(&bytes).and_then(|body| {
            let request = JsonRequest { method: head.method.clone(), path, body, client: answer.conn.watch() };
            handle(&request)
        });
        if let Err(e) = &reply {
            tracing::debug!("{} {}: {} {}", head.method, head.target, e.status, e.message);
        }
        let sent = answer.send(reply);
        drop(slot);
        Ok(sent && keep_alive)
    }
}

/// Answers an error to a request whose body was not read, and closes.
fn refuse(mut conn: Connection, e: &HttpError, cors: Option<&str>) {
    tracing::debug!("refused: {} {}", e.status, e.message);
    Answer { conn: &mut conn, cors, keep_alive: false }.error(e);
    conn.close_lingering();
}

fn parse_body(bytes: &[u8]) -> std::result::Result<Value, HttpError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(bytes).map_err(|e| HttpError::bad_request(format!("the body is not JSON: {e}")))
}

/// Writes one answer on a connection; each method says whether it was sent.
struct Answer<'c> {
    conn: &'c mut Connection,
    /// An allowed foreign origin to name in CORS headers.
    cors: Option<&'c str>,
    keep_alive: bool,
}

impl<'c> Answer<'c> {
    fn head(&self, status: u16, content_type: &'static str) -> ResponseHead<'c> {
        let mut headers = vec![("Content-Type", content_type)];
        if let Some(origin) = self.cors {
            headers.extend([("Access-Control-Allow-Origin", origin), ("Vary", "Origin")]);
        }
        ResponseHead { status, headers, keep_alive: self.keep_alive }
    }

    fn send(self, reply: std::result::Result<Reply, HttpError>) -> bool {
        match reply {
            Ok(Reply::Json(v)) => self.json(200, &v),
            Ok(Reply::Static { content_type, body }) => {
                let head = self.head(200, content_type);
                head.send(self.conn, body.as_bytes()).is_ok()
            }
            Ok(Reply::Events(events)) => {
                let mut head = self.head(200, "text/event-stream");
                head.headers.push(("Cache-Control", "no-cache"));
                let sent = stream_events(self.conn, &head, events);
                if let Err(e) = &sent {
                    tracing::debug!("a client left an event stream: {e}");
                }
                sent.is_ok()
            }
            Err(e) => self.error(&e),
        }
    }

    fn json(self, status: u16, value: &Value) -> bool {
        let head = self.head(status, "application/json");
        head.send(self.conn, value.to_string().as_bytes()).is_ok()
    }

    fn error(self, e: &HttpError) -> bool {
        self.json(e.status, &e.body())
    }

    /// A CORS preflight of an allowed origin.
    fn preflight(self) -> bool {
        let mut head = self.head(204, "text/plain");
        head.headers.extend([
            ("Access-Control-Allow-Methods", "GET, POST, OPTIONS"),
            ("Access-Control-Allow-Headers", "authorization, content-type"),
            ("Access-Control-Max-Age", "600"),
        ]);
        head.send(self.conn, b"").is_ok()
    }
}

/// Each event is its own chunk, flushed at once.
fn stream_events(
    conn: &mut Connection,
    head: &ResponseHead,
    events: Box<dyn Iterator<Item = String> + Send>,
) -> std::io::Result<()> {
    head.start_chunked(conn)?;
    for data in events {
        http::send_chunk(conn, format!("data: {data}\n\n").as_bytes())?;
    }
    http::end_chunks(conn)
}

/// Places in a handler: `workers` at once, `max_queue` waiting.
struct Slots {
    workers: usize,
    max_queue: usize,
    /// (in a handler, waiting)
    count: Mutex<(usize, usize)>,
    freed: Condvar,
}

/// A place in a handler, given back when dropped.
struct Slot<'a>(&'a Slots);

impl Slots {
    fn new(workers: usize, max_queue: usize) -> Slots {
        Slots { workers, max_queue, count: Mutex::new((0, 0)), freed: Condvar::new() }
    }

    /// A place, at once or after waiting in the queue; 503 when the queue
    /// is full, the server stops or the client leaves while waiting.
    fn acquire(&self, stop: &dyn Fn() -> bool, client: &ClientWatch) -> std::result::Result<Slot<'_>, HttpError> {
        let mut count = self.count.lock().unwrap_or_else(|e| e.into_inner());
        if count.0 < self.workers {
            count.0 += 1;
            return Ok(Slot(self));
        }
        if count.1 >= self.max_queue {
            return Err(HttpError::new(
                503,
                format!(
                    "the server is busy: {} requests in progress and {} waiting; try again shortly",
                    self.workers, self.max_queue
                ),
            ));
        }
        count.1 += 1;
        loop {
            count = self.freed.wait_timeout(count, POLL).unwrap_or_else(|e| e.into_inner()).0;
            if count.0 < self.workers {
                count.1 -= 1;
                count.0 += 1;
                return Ok(Slot(self));
            }
            if stop() || client.gone() {
                count.1 -= 1;
                return Err(HttpError::stopping());
            }
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.count.lock().unwrap_or_else(|e| e.into_inner()).0 -= 1;
        self.0.freed.notify_one();
    }
}

/// Waits up to `timeout` for a connection to accept.
fn readable(listener: &TcpListener, timeout: Duration) -> bool {
    let mut poll = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // Safety: one pollfd that lives across the call.
    unsafe { libc::poll(&mut poll, 1, timeout.as_millis() as libc::c_int) > 0 }
}
