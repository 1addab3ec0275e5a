//! A stand-in HTTP service for the tests of the sources that call one: it
//! answers each request as a test says, including the ways real services
//! fail (an error status, a slow answer, a closed connection, a body that
//! is not JSON).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

/// What the stub does with one request.
pub enum Reply {
    /// A status and a body sent as JSON.
    Json(u16, String),
    /// The same, after a pause.
    Slow(Duration, u16, String),
    /// A status, headers and a body of bytes.
    Bytes(u16, Vec<(String, String)>, Vec<u8>),
    /// Close the connection without answering.
    Close,
}

/// A request as the stub saw it.
pub struct Seen {
    /// Requests before this one.
    pub n: usize,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Value,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// A running stub; it lives as long as the test process.
pub struct Stub {
    pub url: String,
    pub requests: Arc<AtomicUsize>,
}

impl Stub {
    pub fn start(answer: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Stub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&requests);
        let answer = Arc::new(answer);
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let (answer, count) = (Arc::clone(&answer), Arc::clone(&count));
                std::thread::spawn(move || serve_connection(stream, &*answer, &count));
            }
        });
        Stub { url, requests }
    }

    pub fn count(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

fn serve_connection(stream: TcpStream, answer: &dyn Fn(&Seen) -> Reply, count: &AtomicUsize) {
    stream.set_nodelay(true).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut stream = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            reader.read_line(&mut h).unwrap();
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.push((k.trim().to_string(), v.trim().to_string()));
            }
        }
        let len: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .map_or(0, |(_, v)| v.parse().unwrap());
        let mut body = vec![0; len];
        reader.read_exact(&mut body).unwrap();
        let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let n = count.fetch_add(1, Ordering::SeqCst);
        let json = || vec![("Content-Type".to_string(), "application/json".to_string())];
        let (status, headers, body) = match answer(&Seen { n, path, headers, body }) {
            Reply::Json(s, t) => (s, json(), t.into_bytes()),
            Reply::Slow(d, s, t) => {
                std::thread::sleep(d);
                (s, json(), t.into_bytes())
            }
            Reply::Bytes(s, h, b) => (s, h, b),
            Reply::Close => return,
        };
        let mut head = format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\n", body.len());
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        if stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(&body)).is_err() {
            return;
        }
    }
}
