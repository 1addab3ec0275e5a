//! A small JSON-over-HTTP server: a pool of threads taking requests from
//! one listening socket, an optional bearer token, a body size limit, and
//! errors answered as JSON (`{"error": {"message", "type", "code"}}`, the
//! OpenAI shape that clients of such servers already parse).

use std::io::Read;
use std::net::SocketAddr;
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

    fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "code": self.status}})
    }
}

/// A bound socket and the rules every request must meet.
pub struct JsonServer {
    server: tiny_http::Server,
    /// Requests other than `GET /health` must carry `Authorization: Bearer <token>`.
    token: Option<String>,
    max_body_bytes: usize,
}

impl JsonServer {
    /// Listens on `host:port` (port 0: any free port; see [`addr`](Self::addr)).
    pub fn bind(host: &str, port: u16, token: Option<String>, max_body_bytes: usize) -> Result<JsonServer> {
        let server = tiny_http::Server::http((host, port))
            .map_err(|e| Error::Invalid(format!("cannot listen on {host}:{port}: {e}")))?;
        Ok(JsonServer { server, token, max_body_bytes })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.server_addr().to_ip().expect("an IP listener")
    }

    /// Answers requests on `threads` threads until `stop()` says so; each
    /// request's JSON answer (status 200) or error comes from `handle`.
    pub fn serve(
        &self,
        threads: usize,
        stop: impl Fn() -> bool + Sync,
        handle: impl Fn(&JsonRequest) -> std::result::Result<Value, HttpError> + Sync,
    ) -> Result<()> {
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads.max(1))
                .map(|_| {
                    s.spawn(|| -> Result<()> {
                        while !stop() {
                            let request = self
                                .server
                                .recv_timeout(POLL)
                                .map_err(|e| Error::Invalid(format!("accepting a request: {e}")))?;
                            if let Some(request) = request {
                                self.answer(request, &handle);
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            workers.into_iter().try_for_each(|w| w.join().expect("a server thread panicked"))
        })
    }

    fn answer(
        &self,
        mut request: tiny_http::Request,
        handle: &impl Fn(&JsonRequest) -> std::result::Result<Value, HttpError>,
    ) {
        let (status, body) = match self.read(&mut request).and_then(|r| handle(&r)) {
            Ok(v) => (200, v),
            Err(e) => {
                tracing::debug!("{} {}: {} {}", request.method(), request.url(), e.status, e.message);
                (e.status, e.body())
            }
        };
        let content_type =
            tiny_http::Header::from_bytes(&b"Content-Type"[..], &b"application/json"[..]).expect("a valid header");
        let response =
            tiny_http::Response::from_string(body.to_string()).with_status_code(status).with_header(content_type);
        if let Err(e) = request.respond(response) {
            tracing::debug!("answering a request: {e}");
        }
    }

    fn read(&self, request: &mut tiny_http::Request) -> std::result::Result<JsonRequest, HttpError> {
        let method = request.method().as_str().to_string();
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let public = method == "GET" && path == "/health";
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
        let too_large =
            || HttpError::new(413, format!("the body is larger than the limit of {} bytes", self.max_body_bytes));
        if request.body_length().is_some_and(|n| n > self.max_body_bytes) {
            return Err(too_large());
        }
        let mut bytes = Vec::new();
        request
            .as_reader()
            .take(self.max_body_bytes as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| HttpError::bad_request(format!("reading the body: {e}")))?;
        if bytes.len() > self.max_body_bytes {
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
