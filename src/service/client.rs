//! JSON over HTTP to a service: one POST, retried with exponential backoff
//! and jitter when the failure is likely to pass (no connection, a timeout,
//! 429 Too Many Requests, a 5xx answer), failed at once otherwise.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// The longest wait between two attempts, whatever the backoff or a
/// `Retry-After` header asks for.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Bodies quoted in errors are cut to this many characters.
const QUOTED_BODY_CHARS: usize = 300;

/// How often and how patiently to retry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retry {
    /// Attempts after the first.
    pub retries: u32,
    /// The wait before the first retry; doubled for each next one, with
    /// jitter (a wait `d` becomes a uniform draw from `[d/2, d]`).
    pub backoff: Duration,
}

/// Why a request failed after its retries: the last failure, with the
/// status and a piece of the body when the server answered.
#[derive(Debug, Clone, PartialEq)]
pub struct CallError {
    pub message: String,
    /// Requests sent, retries included.
    pub attempts: u32,
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.attempts > 1 {
            write!(f, "{} (after {} attempts)", self.message, self.attempts)
        } else {
            f.write_str(&self.message)
        }
    }
}

/// A client for one kind of request; cheap to share between threads.
pub struct Client {
    agent: ureq::Agent,
    /// Sent with every request; the bearer token, when there is one, is the
    /// `Authorization` entry (never printed).
    headers: Vec<(String, String)>,
    retry: Retry,
}

/// One attempt's outcome: an answer, or an error and whether to try again
/// (with the server's `Retry-After`, when it gave one).
enum Attempt {
    Done(Value),
    Retry(String, Option<Duration>),
    Fail(String),
}

impl Client {
    /// `timeout` bounds each attempt from connecting to the last byte of the
    /// answer; `bearer` is sent as `Authorization: Bearer <token>`.
    pub fn new(timeout: Duration, headers: &[(String, String)], bearer: Option<&str>, retry: Retry) -> Client {
        let agent = ureq::AgentBuilder::new().timeout(timeout).build();
        let mut headers = headers.to_vec();
        if let Some(token) = bearer {
            headers.push(("Authorization".into(), format!("Bearer {token}")));
        }
        Client { agent, headers, retry }
    }

    /// POSTs `body` as JSON to `url` and returns the JSON answer.
    pub fn post_json(&self, url: &str, body: &Value) -> Result<Value, CallError> {
        let body = body.to_string();
        let mut attempts = 0;
        loop {
            attempts += 1;
            let (message, retry_after) = match self.attempt(url, &body) {
                Attempt::Done(v) => return Ok(v),
                Attempt::Fail(message) => return Err(CallError { message, attempts }),
                Attempt::Retry(message, retry_after) => (message, retry_after),
            };
            if attempts > self.retry.retries {
                return Err(CallError { message, attempts });
            }
            let wait = backoff(self.retry.backoff, attempts - 1).max(retry_after.unwrap_or_default());
            tracing::debug!("{url}: {message}; retrying in {:.2} s", wait.as_secs_f64());
            std::thread::sleep(wait.min(MAX_BACKOFF));
        }
    }

    fn attempt(&self, url: &str, body: &str) -> Attempt {
        let mut request = self.agent.post(url).set("Content-Type", "application/json");
        for (k, v) in &self.headers {
            request = request.set(k, v);
        }
        match request.send_string(body) {
            Ok(response) => match response.into_string() {
                Ok(text) => match serde_json::from_str(&text) {
                    Ok(v) => Attempt::Done(v),
                    Err(e) => Attempt::Fail(format!("the answer is not JSON ({e}): {}", quote(&text))),
                },
                Err(e) => Attempt::Retry(format!("reading the answer: {e}"), None),
            },
            Err(ureq::Error::Status(code, response)) => {
                let retry_after = response
                    .header("Retry-After")
                    .and_then(|s| s.trim().parse::<f64>().ok())
                    .filter(|s| s.is_finite() && *s >= 0.0)
                    .map(Duration::from_secs_f64);
                let text = response.into_string().unwrap_or_default();
                let message = format!("HTTP {code}: {}", quote(&text));
                if code == 429 || code >= 500 {
                    Attempt::Retry(message, retry_after)
                } else {
                    Attempt::Fail(message)
                }
            }
            Err(ureq::Error::Transport(t)) => Attempt::Retry(t.to_string(), None),
        }
    }
}

/// `first * 2^retry`, capped, then jittered into `[d/2, d]` so that many
/// clients that failed together do not retry together.
fn backoff(first: Duration, retry: u32) -> Duration {
    let d = first.saturating_mul(1u32 << retry.min(16)).min(MAX_BACKOFF);
    d.mul_f64(0.5 + 0.5 * jitter())
}

/// A number in `[0, 1)` that differs between calls and threads; it only
/// spreads retries out, so it need not be reproducible.
fn jitter() -> f64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos() as u64);
    let thread = std::thread::current().id();
    let mut h = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(&(nanos, thread), &mut h);
    (std::hash::Hasher::finish(&h) >> 11) as f64 / (1u64 << 53) as f64
}

/// A body for an error message: trimmed, cut, `(empty)` when empty.
pub fn quote(text: &str) -> String {
    let text = text.trim();
    if text.is_empty() {
        return "(empty)".into();
    }
    match text.char_indices().nth(QUOTED_BODY_CHARS) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_within_its_jitter_and_is_capped() {
        let first = Duration::from_millis(100);
        for retry in 0..4 {
            let d = backoff(first, retry).as_secs_f64();
            let full = 0.1 * (1 << retry) as f64;
            assert!(d >= full / 2.0 - 1e-9 && d <= full + 1e-9, "retry {retry}: {d}");
        }
        assert!(backoff(Duration::from_secs(10), 10) <= MAX_BACKOFF);
    }

    #[test]
    fn quoted_bodies_are_cut() {
        assert_eq!(quote("  "), "(empty)");
        assert_eq!(quote(" {\"a\": 1}\n"), "{\"a\": 1}");
        let long = "é".repeat(QUOTED_BODY_CHARS + 5);
        assert_eq!(quote(&long), format!("{}...", "é".repeat(QUOTED_BODY_CHARS)));
    }
}
