//! HTTP/1.1 on a blocking socket, every read and write bounded: a request
//! head of at most `max_header_bytes`, parsed by `httparse` (the parser
//! under hyper); a body whose declared length is checked before a byte of
//! it is kept, then read as it arrives (`Content-Length` or chunked); a
//! deadline on each request and on each write; keep-alive and
//! `Expect: 100-continue`. What a request means is the server's business
//! ([`super::server`]).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::server::HttpError;
use super::Cancel;

/// How often a blocked read looks at the stop flag.
const POLL: Duration = Duration::from_millis(100);

/// Headers a request may have.
const MAX_HEADERS: usize = 96;

/// Bytes read from the socket at a time.
const READ_CHUNK: usize = 16 * 1024;

/// Longest chunk-size line of a chunked body.
const MAX_CHUNK_LINE: usize = 1024;

/// A request line and headers.
#[derive(Debug)]
pub struct Head {
    pub method: String,
    /// The request target as sent: the path and the query string.
    pub target: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    /// Names in lower case, values as sent (bytes that are not UTF-8 replaced).
    pub headers: Vec<(String, String)>,
}

impl Head {
    /// The first value of header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.trim())
    }

    /// The target without its query string.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }

    /// Whether the client keeps the connection open after the answer.
    pub fn keep_alive(&self) -> bool {
        let connection = self.header("connection").map(str::to_ascii_lowercase);
        let says = |token: &str| connection.as_deref().is_some_and(|c| c.split(',').any(|t| t.trim() == token));
        if self.minor_version == 0 {
            says("keep-alive")
        } else {
            !says("close")
        }
    }

    pub fn expects_continue(&self) -> bool {
        self.header("expect").is_some_and(|e| e.eq_ignore_ascii_case("100-continue"))
    }

    /// How the body is delimited; a declared length over `limit` is
    /// refused here, before any of the body is read.
    pub fn framing(&self, limit: usize) -> Result<Framing, HttpError> {
        let encodings: Vec<&str> =
            self.headers.iter().filter(|(n, _)| n == "transfer-encoding").map(|(_, v)| v.trim()).collect();
        let lengths: Vec<&str> =
            self.headers.iter().filter(|(n, _)| n == "content-length").map(|(_, v)| v.trim()).collect();
        if !encodings.is_empty() {
            if !lengths.is_empty() {
                return Err(HttpError::bad_request(
                    "a request may not carry both Content-Length and Transfer-Encoding",
                ));
            }
            return match encodings.as_slice() {
                [te] if te.eq_ignore_ascii_case("chunked") => Ok(Framing::Chunked),
                _ => Err(HttpError::new(
                    501,
                    format!(
                        "Transfer-Encoding `{}` is not supported; send chunked or a Content-Length",
                        encodings.join(", ")
                    ),
                )),
            };
        }
        let Some(first) = lengths.first() else { return Ok(Framing::Length(0)) };
        if lengths.iter().any(|l| l != first) || first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
            return Err(HttpError::bad_request(format!(
                "Content-Length `{}` is not one length in bytes",
                lengths.join(", ")
            )));
        }
        match first.parse::<u64>() {
            Ok(n) if n <= limit as u64 => Ok(Framing::Length(n as usize)),
            _ => Err(too_large(limit)),
        }
    }
}

fn too_large(limit: usize) -> HttpError {
    HttpError::new(413, format!("the body is larger than the limit of {limit} bytes"))
}

/// How a request's body ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Framing {
    Length(usize),
    Chunked,
}

/// Why no request could be read.
#[derive(Debug)]
pub enum ReadError {
    /// The request is bad, too large or too slow: answer this, then close.
    Answer(HttpError),
    /// Nothing to answer: the client left, or the server is stopping.
    Closed,
}

impl From<HttpError> for ReadError {
    fn from(e: HttpError) -> ReadError {
        ReadError::Answer(e)
    }
}

/// One client's connection: the socket and the bytes received from it
/// that no request has consumed yet.
pub struct Connection {
    stream: TcpStream,
    received: Vec<u8>,
}

impl Connection {
    /// Each write must be taken by the client within `write_timeout`.
    pub fn new(stream: TcpStream, write_timeout: Duration) -> std::io::Result<Connection> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(write_timeout))?;
        Ok(Connection { stream, received: Vec::new() })
    }

    /// A handle that tells whether the client has gone.
    pub fn watch(&self) -> ClientWatch {
        ClientWatch(self.stream.try_clone().ok().map(Arc::new))
    }

    /// The next request's head. `Ok(None)`: no byte of a request came
    /// within `idle`, the client closed the connection, or `stop()` was
    /// true before one did. Once its first byte is in, the head must be
    /// complete by `deadline_after` from then; the instant it started is
    /// returned with it.
    pub fn read_head(
        &mut self,
        max_bytes: usize,
        idle: Duration,
        deadline_after: Duration,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<(Head, Instant)>, ReadError> {
        if self.received.is_empty() {
            match self.fill(Instant::now() + idle, stop) {
                Ok(()) => {}
                Err(Fill::Timeout | Fill::Closed) => return Ok(None),
            }
        }
        let started = Instant::now();
        let deadline = started + deadline_after;
        loop {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut request = httparse::Request::new(&mut headers);
            match request.parse(&self.received) {
                Ok(httparse::Status::Complete(len)) if len <= max_bytes => {
                    let head = Head {
                        method: request.method.unwrap_or_default().to_string(),
                        target: request.path.unwrap_or_default().to_string(),
                        minor_version: request.version.unwrap_or(1),
                        headers: request
                            .headers
                            .iter()
                            .map(|h| (h.name.to_ascii_lowercase(), String::from_utf8_lossy(h.value).into_owned()))
                            .collect(),
                    };
                    self.received.drain(..len);
                    return Ok(Some((head, started)));
                }
                Ok(httparse::Status::Partial) if self.received.len() <= max_bytes => {}
                Ok(_) => return Err(header_too_large(max_bytes).into()),
                Err(httparse::Error::TooManyHeaders) => {
                    return Err(HttpError::new(431, format!("more than {MAX_HEADERS} headers")).into())
                }
                Err(e) => return Err(HttpError::bad_request(format!("malformed request head: {e}")).into()),
            }
            self.fill(deadline, stop).map_err(|f| f.during("the request head", deadline_after))?;
        }
    }

    /// The body `framing` announces, of at most `limit` bytes, complete by `deadline`.
    pub fn read_body(
        &mut self,
        framing: Framing,
        limit: usize,
        deadline: Instant,
        timeout: Duration,
        stop: &dyn Fn() -> bool,
    ) -> Result<Vec<u8>, ReadError> {
        let slow = |f: Fill| f.during("the request body", timeout);
        match framing {
            Framing::Length(n) => {
                while self.received.len() < n {
                    self.fill(deadline, stop).map_err(slow)?;
                }
                let rest = self.received.split_off(n);
                Ok(std::mem::replace(&mut self.received, rest))
            }
            Framing::Chunked => {
                let mut body = Vec::new();
                loop {
                    let line = self.line(MAX_CHUNK_LINE, deadline, stop, &slow)?;
                    let size = line.split(';').next().unwrap_or("").trim();
                    let size = usize::from_str_radix(size, 16).map_err(|_| {
                        HttpError::bad_request(format!(
                            "malformed chunk size `{}`",
                            crate::service::client::quote(&line)
                        ))
                    })?;
                    if size == 0 {
                        break;
                    }
                    if body.len().saturating_add(size) > limit {
                        return Err(too_large(limit).into());
                    }
                    while self.received.len() < size + 2 {
                        self.fill(deadline, stop).map_err(slow)?;
                    }
                    if &self.received[size..size + 2] != b"\r\n" {
                        return Err(HttpError::bad_request("a chunk does not end with CRLF").into());
                    }
                    body.extend_from_slice(&self.received[..size]);
                    self.received.drain(..size + 2);
                }
                // Trailer fields are read and dropped, up to an empty line.
                let mut trailers = 0;
                loop {
                    let line = self.line(MAX_CHUNK_LINE, deadline, stop, &slow)?;
                    trailers += line.len();
                    if line.is_empty() {
                        return Ok(body);
                    }
                    if trailers > MAX_CHUNK_LINE * 8 {
                        return Err(HttpError::new(431, "the chunked body's trailers are too large").into());
                    }
                }
            }
        }
    }

    /// One CRLF-terminated line of at most `max` bytes, without the CRLF.
    fn line(
        &mut self,
        max: usize,
        deadline: Instant,
        stop: &dyn Fn() -> bool,
        slow: &dyn Fn(Fill) -> ReadError,
    ) -> Result<String, ReadError> {
        loop {
            if let Some(end) = self.received.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.received[..end]).into_owned();
                self.received.drain(..end + 2);
                return Ok(line);
            }
            if self.received.len() > max {
                return Err(HttpError::bad_request("a line of the chunked body is too long").into());
            }
            self.fill(deadline, stop).map_err(slow)?;
        }
    }

    /// Reads what the socket has, waiting until `deadline` at most.
    fn fill(&mut self, deadline: Instant, stop: &dyn Fn() -> bool) -> Result<(), Fill> {
        let mut chunk = [0u8; READ_CHUNK];
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(Fill::Timeout);
            }
            if stop() {
                return Err(Fill::Closed);
            }
            self.stream.set_read_timeout(Some((deadline - now).min(POLL))).map_err(|_| Fill::Closed)?;
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(Fill::Closed),
                Ok(n) => {
                    self.received.extend_from_slice(&chunk[..n]);
                    return Ok(());
                }
                Err(e) if is_wait(&e) => continue,
                Err(_) => return Err(Fill::Closed),
            }
        }
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)?;
        self.stream.flush()
    }

    /// Closes after an answer the client may still be sending a body to:
    /// the rest of what it sends is read and dropped for a moment, so
    /// that the answer arrives rather than a reset (a close with unread
    /// bytes resets the connection).
    pub fn close_lingering(mut self) {
        let _ = self.stream.shutdown(Shutdown::Write);
        let until = Instant::now() + Duration::from_secs(1);
        let mut sink = [0u8; READ_CHUNK];
        let mut drained = 0usize;
        while Instant::now() < until && drained < (4 << 20) {
            let _ = self.stream.set_read_timeout(Some(POLL));
            match self.stream.read(&mut sink) {
                Ok(0) => break,
                Ok(n) => drained += n,
                Err(e) if is_wait(&e) => {}
                Err(_) => break,
            }
        }
    }
}

fn is_wait(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted)
}

fn header_too_large(max_bytes: usize) -> HttpError {
    HttpError::new(431, format!("the request head is larger than the limit of {max_bytes} bytes"))
}

/// Why [`Connection::fill`] got nothing.
enum Fill {
    Timeout,
    Closed,
}

impl Fill {
    fn during(self, what: &str, timeout: Duration) -> ReadError {
        match self {
            Fill::Timeout => ReadError::Answer(HttpError::new(
                408,
                format!("{what} did not arrive within {} s", timeout.as_secs_f64()),
            )),
            Fill::Closed => ReadError::Closed,
        }
    }
}

/// Tells whether a client has closed its connection, without reading
/// from it: work for a client that left can be dropped.
#[derive(Clone, Debug, Default)]
pub struct ClientWatch(Option<Arc<TcpStream>>);

impl ClientWatch {
    /// A watch that never sees the client go (work not tied to a socket).
    pub fn none() -> ClientWatch {
        ClientWatch(None)
    }

    /// True once the client has closed or reset the connection. Bytes it
    /// sent ahead (a pipelined request) do not count as gone.
    pub fn gone(&self) -> bool {
        let Some(stream) = &self.0 else { return false };
        let mut byte = 0u8;
        // Safety: a one-byte peek into a live local; the descriptor is
        // owned by `stream`, which outlives the call.
        let n = unsafe {
            libc::recv(stream.as_raw_fd(), (&mut byte as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
        };
        match n {
            0 => true,
            n if n > 0 => false,
            _ => !matches!(
                std::io::Error::last_os_error().kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ),
        }
    }
}

/// Why [`ClientWatch::recv`] got no message.
#[derive(Debug, PartialEq)]
pub enum NoMessage {
    /// Every sender is gone.
    Closed,
    /// The client left; the work was cancelled.
    ClientGone,
}

/// How often a handler waiting for its work looks whether the client is there.
const WATCH_EVERY: Duration = Duration::from_millis(50);

impl ClientWatch {
    /// The next message of `rx`; when the client leaves first, `cancel` is
    /// set so that the work behind `rx` stops.
    pub fn recv<T>(&self, rx: &Receiver<T>, cancel: &Cancel) -> Result<T, NoMessage> {
        loop {
            // Looked at before each message too: messages may keep coming
            // for a client that has gone.
            if self.gone() {
                cancel.cancel();
                return Err(NoMessage::ClientGone);
            }
            match rx.recv_timeout(WATCH_EVERY) {
                Ok(message) => return Ok(message),
                Err(RecvTimeoutError::Disconnected) => return Err(NoMessage::Closed),
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }
}

/// The reason phrase of the statuses this server answers with.
fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// A status line and headers; `Content-Length` or chunked framing and
/// `Connection` are added by the writers below.
pub struct ResponseHead<'a> {
    pub status: u16,
    pub headers: Vec<(&'static str, &'a str)>,
    pub keep_alive: bool,
}

impl ResponseHead<'_> {
    fn write(&self, out: &mut String, framing: &str) {
        use std::fmt::Write as _;
        let _ = write!(out, "HTTP/1.1 {} {}\r\n", self.status, reason(self.status));
        for (name, value) in &self.headers {
            let _ = write!(out, "{name}: {value}\r\n");
        }
        // Answers are never to be sniffed as another type or framed by another page.
        out.push_str("X-Content-Type-Options: nosniff\r\nX-Frame-Options: DENY\r\n");
        out.push_str(if self.keep_alive { "Connection: keep-alive\r\n" } else { "Connection: close\r\n" });
        out.push_str(framing);
        out.push_str("\r\n");
    }

    /// The whole answer, with its length.
    pub fn send(&self, conn: &mut Connection, body: &[u8]) -> std::io::Result<()> {
        let mut head = String::new();
        self.write(&mut head, &format!("Content-Length: {}\r\n", body.len()));
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(body);
        conn.write_all(&bytes)
    }

    /// Starts a chunked answer; each [`send_chunk`] is flushed at once.
    pub fn start_chunked(&self, conn: &mut Connection) -> std::io::Result<()> {
        let mut head = String::new();
        self.write(&mut head, "Transfer-Encoding: chunked\r\n");
        conn.write_all(head.as_bytes())
    }
}

pub fn send_chunk(conn: &mut Connection, data: &[u8]) -> std::io::Result<()> {
    let mut bytes = format!("{:x}\r\n", data.len()).into_bytes();
    bytes.extend_from_slice(data);
    bytes.extend_from_slice(b"\r\n");
    conn.write_all(&bytes)
}

pub fn end_chunks(conn: &mut Connection) -> std::io::Result<()> {
    conn.write_all(b"0\r\n\r\n")
}

/// The interim answer a client that sent `Expect: 100-continue` waits for.
pub fn send_continue(conn: &mut Connection) -> std::io::Result<()> {
    conn.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connection whose client has sent `bytes` (and then closes its side
    /// when `close` says so).
    fn connection(bytes: &[u8], close: bool) -> (Connection, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client.write_all(bytes).unwrap();
        if close {
            client.shutdown(Shutdown::Write).unwrap();
        }
        let (server, _) = listener.accept().unwrap();
        (Connection::new(server, Duration::from_secs(1)).unwrap(), client)
    }

    const SECOND: Duration = Duration::from_secs(1);

    fn head_and_body(conn: &mut Connection) -> Result<(Head, Vec<u8>), ReadError> {
        let (head, started) = conn.read_head(4096, SECOND, SECOND, &|| false)?.expect("a request");
        let framing = head.framing(1000)?;
        let body = conn.read_body(framing, 1000, started + SECOND, SECOND, &|| false)?;
        Ok((head, body))
    }

    fn status(result: Result<(Head, Vec<u8>), ReadError>) -> u16 {
        match result {
            Err(ReadError::Answer(e)) => e.status,
            other => panic!("expected an answer, got {:?}", other.map(|(h, b)| (h, String::from_utf8(b)))),
        }
    }

    #[test]
    fn pipelined_requests_with_length_and_chunked_bodies_read_in_turn() {
        let bytes = b"POST /a?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello\
                      POST /b HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n\
                      3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n\
                      GET /c HTTP/1.0\r\n\r\n";
        let (mut conn, _client) = connection(bytes, true);
        let (head, body) = head_and_body(&mut conn).unwrap();
        assert_eq!((head.method.as_str(), head.path(), &body[..]), ("POST", "/a", &b"hello"[..]));
        assert!(head.keep_alive());
        let (head, body) = head_and_body(&mut conn).unwrap();
        assert_eq!((head.path(), &body[..]), ("/b", &b"abcde"[..]));
        let (head, body) = head_and_body(&mut conn).unwrap();
        assert_eq!((head.path(), body.len()), ("/c", 0));
        assert!(!head.keep_alive(), "HTTP/1.0 closes unless asked");
        assert!(conn.read_head(4096, SECOND, SECOND, &|| false).unwrap().is_none(), "the client closed");
    }

    #[test]
    fn ambiguous_or_oversized_framing_is_refused_before_the_body() {
        let cases: [(&[u8], u16); 7] = [
            (b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", 413),
            (b"POST / HTTP/1.1\r\nContent-Length: 1001\r\n\r\n", 413),
            (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
            (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
            (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
            (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n", 413),
        ];
        for (bytes, code) in cases {
            let (mut conn, _client) = connection(bytes, false);
            assert_eq!(status(head_and_body(&mut conn)), code, "{}", String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn malformed_and_oversized_heads_are_answered() {
        let (mut conn, _client) = connection(b"\x16\x03\x01\x02\x00 TLS hello\r\n\r\n", false);
        assert_eq!(status(head_and_body(&mut conn)), 400);
        let mut big = b"GET / HTTP/1.1\r\nX: ".to_vec();
        big.resize(5000, b'a');
        let (mut conn, _client) = connection(&big, false);
        assert_eq!(status(head_and_body(&mut conn)), 431);
        let (mut conn, _client) = connection(b"GET / HTTP/1.1\r\nHost: h\r\n", false);
        let started = Instant::now();
        assert_eq!(status(head_and_body(&mut conn)), 408);
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn a_closed_client_is_seen_gone_but_one_that_sent_ahead_is_not() {
        let (conn, client) = connection(b"", false);
        let watch = conn.watch();
        assert!(!watch.gone());
        drop(client);
        std::thread::sleep(Duration::from_millis(50));
        assert!(watch.gone());
        let (conn, _client) = connection(b"GET / HTTP/1.1\r\n\r\n", false);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!conn.watch().gone());
        assert!(!ClientWatch::none().gone());
    }
}
