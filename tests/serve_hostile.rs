//! `rloo serve` and `rloo reward serve` under hostile and careless clients,
//! over raw sockets against the built binary: each case is answered as it
//! should be, within its limit and without the memory it asks for, and the
//! server goes on serving everyone else.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn serve(extra: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rloo"));
    cmd.args(["serve", "--port", "0", "--device", "cpu"])
        .args(["--model", &format!("neox={}", model_dir("gpt_neox-causal").display())])
        .args(["--model", &format!("rm={}", model_dir("gpt_neox-seqcls").display())]);
    Server::start(cmd.args(extra))
}

fn reward_serve(extra: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rloo"));
    cmd.args(["reward", "serve", "--port", "0", "--device", "cpu"])
        .args(["--model", model_dir("gpt_neox-seqcls").to_str().unwrap()]);
    Server::start(cmd.args(extra))
}

/// Sends `bytes` on a new connection (ignoring a send the server cut
/// short) and reads the answer until the server closes or 10 s pass.
fn exchange(addr: &str, bytes: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for piece in bytes.chunks(64 << 10) {
        if stream.write_all(piece).is_err() {
            break;
        }
    }
    read_answer(&mut stream)
}

fn read_answer(stream: &mut TcpStream) -> String {
    let mut answer = Vec::new();
    let mut buf = [0u8; 8192];
    while let Ok(n) = stream.read(&mut buf) {
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// The status of the (last) answer in `text`.
fn status(text: &str) -> Option<u16> {
    text.rsplit("HTTP/1.1 ").next().filter(|_| text.contains("HTTP/1.1 "))?.get(..3)?.parse().ok()
}

fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Vec<u8> {
    let mut text = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    for (k, v) in headers {
        text.push_str(&format!("{k}: {v}\r\n"));
    }
    text.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    text.into_bytes()
}

fn post(url: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = ureq::post(&format!("{url}{path}")).set("Content-Type", "application/json").send_string(&body.to_string());
    let (code, text) = match r {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
        Err(e) => panic!("{e}"),
    };
    (code, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

fn health(url: &str) -> Value {
    serde_json::from_str(&ureq::get(&format!("{url}/health")).call().unwrap().into_string().unwrap()).unwrap()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Waits until `done(health)` or panics after `limit`.
fn wait_for(url: &str, limit: Duration, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let h = health(url);
        if done(&h) {
            return h;
        }
        assert!(started.elapsed() < limit, "{what}: {h}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const JSON: (&str, &str) = ("Content-Type", "application/json");

/// A body declared at 100 GB is refused before any of it is stored, by
/// both servers, with or without a token; so are heads past the limit,
/// while the memory of the server stays where it was.
#[test]
fn huge_declared_bodies_and_heads_are_refused_before_they_are_stored() {
    std::env::set_var("RLOO_TEST_HOSTILE_KEY", "k");
    let servers = [(serve(&[]), None), (reward_serve(&["--api-key-env", "RLOO_TEST_HOSTILE_KEY"]), Some("Bearer k"))];
    for (server, token) in servers {
        let addr = server.addr();
        let before = rss_kib(server.child.id());
        let huge = |auth: Option<&str>| {
            let auth = auth.map(|a| format!("Authorization: {a}\r\n")).unwrap_or_default();
            let head = format!("Host: {addr}\r\nContent-Type: application/json\r\n{auth}Content-Length: 99999999999");
            exchange(addr, format!("POST /score HTTP/1.1\r\n{head}\r\n\r\n{{}}").as_bytes())
        };
        let answer = huge(token);
        assert_eq!(status(&answer), Some(413), "{answer}");
        assert!(answer.contains("the body is larger than the limit"), "{answer}");
        if token.is_some() {
            // Without the token it is turned away before its length is read.
            assert_eq!(status(&huge(None)), Some(401));
        }
        // 8 MiB of one header line: answered 431 once the limit is passed.
        let mut big = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nX-Big: ").into_bytes();
        big.resize(big.len() + (8 << 20), b'a');
        let answer = exchange(addr, &big);
        assert_eq!(status(&answer), Some(431), "{answer}");
        let too_many: String = (0..200).map(|i| format!("X-{i}: v\r\n")).collect();
        let answer = exchange(addr, format!("GET /health HTTP/1.1\r\nHost: {addr}\r\n{too_many}\r\n").as_bytes());
        assert_eq!(status(&answer), Some(431), "{answer}");
        let after = rss_kib(server.child.id());
        assert!(after < before + 16 * 1024, "RSS grew from {before} KiB to {after} KiB");
        assert_eq!(health(&server.url)["status"], "ok");
    }
}

/// A connection that sends nothing, half a head or half a body is
/// answered 408 (or closed, when nothing came) once the request timeout
/// passes, and an idle kept-alive connection is closed.
#[test]
fn idle_and_half_sent_requests_time_out() {
    let server = serve(&["--request-timeout-s", "1", "--keep-alive-s", "1"]);
    let addr = server.addr();
    let timed = |bytes: &[u8]| {
        let started = Instant::now();
        let answer = exchange(addr, bytes);
        (answer, started.elapsed())
    };
    let (answer, took) = timed(b"");
    assert_eq!(answer, "");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "{took:?}");
    let (answer, took) = timed(format!("POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Ty").as_bytes());
    assert_eq!(status(&answer), Some(408), "{answer}");
    assert!(answer.contains("the request head did not arrive within 1 s"), "{answer}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    let head = format!("POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n");
    let (answer, _) = timed(format!("{head}Content-Length: 100\r\n\r\n{{\"prompt\"").as_bytes());
    assert_eq!(status(&answer), Some(408), "{answer}");
    assert!(answer.contains("the request body did not arrive within 1 s"), "{answer}");
    let (answer, _) = timed(format!("{head}Transfer-Encoding: chunked\r\n\r\n5\r\n{{\"pro").as_bytes());
    assert_eq!(status(&answer), Some(408), "{answer}");

    // A trickle of one byte every 300 ms does not extend the deadline.
    let mut slow = TcpStream::connect(addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let started = Instant::now();
    let mut answer = String::new();
    for byte in format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nX-Slow: {}", "a".repeat(100)).bytes() {
        if slow.write_all(&[byte]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(300));
        let mut buf = [0u8; 512];
        if let Ok(n @ 1..) = slow.read(&mut buf) {
            answer = String::from_utf8_lossy(&buf[..n]).into_owned();
            break;
        }
    }
    assert_eq!(status(&answer), Some(408), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());

    // Kept alive after an answer, then closed when idle.
    let mut kept = TcpStream::connect(addr).unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(kept, "GET /health HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let started = Instant::now();
    let answer = read_answer(&mut kept);
    assert_eq!(status(&answer), Some(200), "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(900), "closed at once: {:?}", started.elapsed());
    assert_eq!(health(&server.url)["status"], "ok");
}

/// A request for 20,000 prompts x 64 is refused with the limit named; a
/// client that leaves a large request it is waiting for frees the engine
/// within moments, its completions cancelled.
#[test]
fn requests_are_capped_and_work_for_a_client_that_left_is_cancelled() {
    let server = serve(&["--max-batch-rows", "4"]);
    let prompts = vec!["x"; 20_000];
    let (code, e) = post(&server.url, "/v1/completions", &json!({"prompt": prompts, "n": 4, "max_tokens": 4}));
    assert_eq!(code, 400, "{e}");
    assert_eq!(
        e["error"]["message"],
        "this request asks for 20000 prompts x n = 4, 80000 completions; a request may ask for at most 256 \
         (--max-request-rows): send fewer prompts per request"
    );

    let body = json!({"prompt": vec!["Hello there"; 64], "n": 4, "max_tokens": 100, "ignore_eos": true}).to_string();
    let mut client = TcpStream::connect(server.addr()).unwrap();
    client.write_all(&request("POST", "/v1/completions", &[("Host", server.addr()), JSON], &body)).unwrap();
    wait_for(&server.url, Duration::from_secs(30), "the request never started", |h| {
        h["models"]["neox"]["running"].as_u64() > Some(0)
    });
    drop(client);
    let h = wait_for(&server.url, Duration::from_secs(5), "the engine kept decoding for a client that left", |h| {
        h["models"]["neox"]["running"] == 0 && h["models"]["neox"]["waiting"] == 0
    });
    let neox = &h["models"]["neox"];
    println!("after the client left: {neox}");
    assert!(neox["cancelled"].as_u64().unwrap() > 200, "{neox}");
    assert!(neox["completed"].as_u64().unwrap() < 56, "{neox}");
    assert_eq!(post(&server.url, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 2})).0, 200);
}

/// Requests a web page could send are refused: a body that is not
/// `application/json`, a foreign `Origin`, a `Host` that is not a
/// loopback name or an address (DNS rebinding). An origin allowed by flag
/// gets CORS headers naming it, and never `*`.
#[test]
fn browsers_cannot_drive_the_server_from_other_sites() {
    let server = serve(&["--allowed-origins", "http://localhost:3000", "--allowed-hosts", "models.lan"]);
    let addr = server.addr();
    let body = json!({"model": "neox", "prompt": "hi", "max_tokens": 2}).to_string();
    type Headers<'a> = &'a [(&'a str, &'a str)];
    let cases: [(Headers, u16, &str); 7] = [
        (&[("Host", addr), ("Content-Type", "text/plain")], 415, "send the body as JSON"),
        (&[("Host", addr)], 415, "send the body as JSON"),
        (&[("Host", addr), JSON, ("Origin", "https://evil.example")], 403, "requests from web pages of"),
        (&[("Host", addr), JSON, ("Origin", "null")], 403, "requests from web pages of null"),
        (&[("Host", "evil.example:8000"), JSON], 403, "Host `evil.example:8000` is not one this server answers to"),
        (&[("Host", "models.lan:8000"), JSON], 200, ""),
        (&[("Host", addr), JSON, ("Origin", &format!("http://{addr}"))], 200, ""),
    ];
    for (headers, code, message) in cases {
        let answer = exchange(addr, &request("POST", "/v1/completions", headers, &body));
        assert_eq!(status(&answer), Some(code), "{headers:?}: {answer}");
        assert!(answer.contains(message), "{headers:?}: {answer}");
        assert!(!answer.contains("Access-Control-Allow-Origin"), "{answer}");
    }
    let allowed = [("Host", addr), JSON, ("Origin", "http://localhost:3000")];
    let answer = exchange(addr, &request("POST", "/v1/completions", &allowed, &body));
    assert_eq!(status(&answer), Some(200), "{answer}");
    assert!(answer.contains("Access-Control-Allow-Origin: http://localhost:3000\r\n"), "{answer}");
    let preflight = [
        ("Host", addr),
        ("Origin", "http://localhost:3000"),
        ("Access-Control-Request-Method", "POST"),
        ("Access-Control-Request-Headers", "content-type, authorization"),
    ];
    let answer = exchange(addr, &request("OPTIONS", "/v1/completions", &preflight, ""));
    assert_eq!(status(&answer), Some(204), "{answer}");
    assert!(answer.contains("Access-Control-Allow-Methods: GET, POST, OPTIONS"), "{answer}");
    let foreign = [("Host", addr), ("Origin", "https://evil.example"), ("Access-Control-Request-Method", "POST")];
    assert_eq!(status(&exchange(addr, &request("OPTIONS", "/v1/completions", &foreign, ""))), Some(403));
    // The page itself loads, and its own requests pass.
    let page = exchange(addr, &request("GET", "/", &[("Host", addr)], ""));
    assert_eq!(status(&page), Some(200));
    assert!(page.contains("X-Frame-Options: DENY"), "the page cannot be framed by another site");
}

/// Beyond loopback without a token is refused before the models load,
/// unless `--insecure-no-api-key` says so; a warning says where it
/// listens either way.
#[test]
fn listening_beyond_loopback_needs_a_token_or_a_flag() {
    let neox = model_dir("gpt_neox-causal");
    let base = ["serve", "--port", "0", "--device", "cpu", "--host", "0.0.0.0", "--model", neox.to_str().unwrap()];
    let refused = rloo(&base);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("refusing to listen on 0.0.0.0:0 without a token"), "{stderr}");
    assert!(stderr.contains("--insecure-no-api-key"), "{stderr}");
    let seqcls = model_dir("gpt_neox-seqcls");
    let refused = rloo(&["reward", "serve", "--port", "0", "--host", "0.0.0.0", "--model", seqcls.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("refusing to listen on 0.0.0.0:0"));

    let open = Server::start(Command::new(env!("CARGO_BIN_EXE_rloo")).args(base).arg("--insecure-no-api-key"));
    assert!(open.log.lock().unwrap().contains("WITHOUT a token"), "{}", open.log.lock().unwrap());
    let guarded = Server::start(
        Command::new(env!("CARGO_BIN_EXE_rloo"))
            .args(base)
            .args(["--api-key-env", "RLOO_TEST_BIND_KEY"])
            .env("RLOO_TEST_BIND_KEY", "k"),
    );
    assert!(guarded.log.lock().unwrap().contains("reachable from other machines; requests need the token"));
}

/// `/score` gives no score to a sample longer than a rotary reward
/// model's context (GPT-NeoX: `max_position_embeddings` 128), and says why.
#[test]
fn scores_are_not_given_past_the_reward_models_context() {
    for server in [serve(&[]), reward_serve(&[])] {
        let long = " word".repeat(300);
        let body = json!({"model": "rm", "prompts": ["a", "a"], "completions": [" good", long]});
        let (code, answer) = post(&server.url, "/score", &body);
        assert_eq!(code, 200, "{answer}");
        assert!(answer["scores"][0].is_number(), "{answer}");
        assert!(answer["scores"][1].is_null(), "{answer}");
        assert_eq!(answer["unscored"][0]["index"], 1);
        let reason = answer["unscored"][0]["reason"].as_str().unwrap();
        assert!(reason.contains("longer than the model's context of 128 positions"), "{reason}");
    }
}

/// 200 well-behaved clients at once, while others trickle heads, declare
/// huge bodies, send huge heads and walk away from large requests: every
/// well-behaved request is answered, the server still answers after, its
/// engines are idle and its memory is back near where it was.
#[test]
fn two_hundred_clients_are_served_beside_hostile_ones() {
    let server = serve(&["--request-timeout-s", "3", "--max-concurrent", "256"]);
    let (url, addr) = (server.url.as_str(), server.addr());
    let polite = |i: usize| -> bool {
        match i % 4 {
            0 => {
                let body = json!({"model": "neox", "prompt": format!("client {i}"), "max_tokens": 6, "stream": true});
                let r = ureq::post(&format!("{url}/v1/completions"))
                    .set("Content-Type", "application/json")
                    .send_string(&body.to_string());
                r.is_ok_and(|r| r.into_string().is_ok_and(|t| t.trim_end().ends_with("data: [DONE]")))
            }
            3 => {
                let body = json!({"model": "rm", "prompts": [format!("client {i}")], "completions": [" fine"]});
                let (code, answer) = post(url, "/score", &body);
                code == 200 && answer["scores"][0].is_number()
            }
            _ => {
                let body = json!({"model": "neox", "prompt": format!("client {i}"), "max_tokens": 6, "seed": i});
                let (code, answer) = post(url, "/v1/completions", &body);
                code == 200 && answer["choices"][0]["finish_reason"].is_string()
            }
        }
    };
    let hostile = |i: usize| match i % 4 {
        0 => {
            // Slowloris: a byte of head every 100 ms.
            let mut s = TcpStream::connect(addr).unwrap();
            for byte in format!("POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nX: {}", "a".repeat(100)).bytes() {
                if s.write_all(&[byte]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        1 => {
            exchange(addr, b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999999999\r\n\r\n{}");
        }
        2 => {
            let mut big = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nX-Big: ").into_bytes();
            big.resize(big.len() + (4 << 20), b'a');
            exchange(addr, &big);
        }
        _ => {
            let body = json!({"model": "neox", "prompt": vec!["Leaving"; 64], "n": 4, "max_tokens": 100,
                              "ignore_eos": true})
            .to_string();
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&request("POST", "/v1/completions", &[("Host", addr), JSON], &body)).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let warm: usize = (0..16).filter(|&i| polite(i)).count();
    assert_eq!(warm, 16);
    let before = rss_kib(server.child.id());
    let barrier = std::sync::Barrier::new(200 + 24);
    let answered: usize = std::thread::scope(|s| {
        for i in 0..24 {
            let barrier = &barrier;
            s.spawn(move || {
                barrier.wait();
                hostile(i);
            });
        }
        let clients: Vec<_> = (0..200)
            .map(|i| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    polite(i)
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).filter(|&ok| ok).count()
    });
    assert_eq!(answered, 200, "well-behaved requests failed");
    let h = wait_for(url, Duration::from_secs(10), "the engine did not go idle", |h| {
        h["models"]["neox"]["running"] == 0 && h["models"]["neox"]["waiting"] == 0
    });
    println!("after the load: {h}");
    assert!(polite(1) && polite(3));
    let after = rss_kib(server.child.id());
    println!("server RSS {before} KiB before the load, {after} KiB after");
    assert!(after < before + 64 * 1024, "RSS grew from {before} KiB to {after} KiB");
}

/// SIGTERM: the server takes no new connection, a stream in flight ends
/// normally within the grace period, and work still waiting is answered
/// 503 at once; with a short grace period, rows still decoding are
/// stopped with an error event and the process exits promptly.
#[test]
fn sigterm_finishes_or_cancels_work_in_flight_within_the_grace_period() {
    let stream_request = |addr: &str, body: Value| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(&request("POST", "/v1/completions", &[("Host", addr), JSON], &body.to_string())).unwrap();
        s
    };
    let terminate = |server: &Server| unsafe { libc::kill(server.child.id() as libc::pid_t, libc::SIGTERM) };

    let mut server = serve(&["--shutdown-grace-s", "10", "--max-batch-rows", "64"]);
    let addr = server.addr().to_string();
    let body = json!({"model": "neox", "prompt": "Go", "n": 64, "max_tokens": 120, "ignore_eos": true, "stream": true});
    let mut running = stream_request(&addr, body);
    let mut first = [0u8; 64];
    running.read_exact(&mut first).unwrap();
    let waiting_body = json!({"model": "neox", "prompt": vec!["Wait"; 64], "n": 4, "max_tokens": 100});
    let mut waiting = stream_request(&addr, waiting_body);
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    terminate(&server);
    let waited = read_answer(&mut waiting);
    assert_eq!(status(&waited), Some(503), "{waited}");
    assert!(waited.contains("the server is stopping"));
    let streamed = read_answer(&mut running);
    assert!(streamed.contains("data: [DONE]"), "{streamed}");
    assert_eq!(streamed.matches("\"finish_reason\":\"length\"").count(), 64, "every row finished");
    assert!(server.child.wait().unwrap().success());
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    assert!(TcpStream::connect(&addr).is_err(), "the port still takes connections");

    let mut server = serve(&["--shutdown-grace-s", "0.05", "--max-batch-rows", "256"]);
    let addr = server.addr().to_string();
    let body = json!({"model": "neox", "prompt": vec!["Go"; 64], "n": 4, "max_tokens": 120, "ignore_eos": true,
                      "stream": true});
    let mut running = stream_request(&addr, body);
    running.read_exact(&mut first).unwrap();
    let started = Instant::now();
    terminate(&server);
    let streamed = read_answer(&mut running);
    assert!(streamed.contains("the server is stopping"), "{}", &streamed[streamed.len().saturating_sub(500)..]);
    assert!(streamed.contains("data: [DONE]"));
    assert!(server.child.wait().unwrap().success());
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}
