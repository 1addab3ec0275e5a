//! `rloo serve` over HTTP, against the built binary on the fixture models:
//! OpenAI's shapes whole and streamed, the same tokens as `rloo generate`,
//! concurrent requests batched without changing their answers, and every
//! kind of bad request turned away while the server keeps serving.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn serve(models: &[&str], extra: &[&str]) -> Server {
    serve_stepping(models, extra, "shrink")
}

/// The server with its decoding steps launched as `RLOO_DECODE_STEP` says.
fn serve_stepping(models: &[&str], extra: &[&str], stepping: &str) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rloo"));
    cmd.env("RLOO_DECODE_STEP", stepping).args(["serve", "--port", "0", "--device", "cpu"]);
    for m in models {
        cmd.args(["--model", m]);
    }
    Server::start(cmd.args(extra))
}

fn named(name: &str, fixture: &str) -> String {
    format!("{name}={}", model_dir(fixture).display())
}

/// A POST's status and JSON answer.
fn post(url: &str, path: &str, body: &Value) -> (u16, Value) {
    send(ureq::post(&format!("{url}{path}")).set("Content-Type", "application/json").send_string(&body.to_string()))
}

fn get(url: &str, path: &str) -> (u16, Value) {
    send(ureq::get(&format!("{url}{path}")).call())
}

fn send(r: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
    let (code, text) = match r {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
        Err(e) => panic!("{e}"),
    };
    (code, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

/// The `data:` payloads of a streamed answer, `[DONE]` included.
fn stream(url: &str, path: &str, body: &Value) -> Vec<String> {
    let r = ureq::post(&format!("{url}{path}"))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
        .unwrap();
    assert_eq!(r.header("Content-Type"), Some("text/event-stream"));
    BufReader::new(r.into_reader())
        .lines()
        .map(Result::unwrap)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

fn message(answer: &Value) -> &str {
    answer["choices"][0]["message"]["content"].as_str().unwrap()
}

/// Greedy text completions are the tokens `rloo generate` gives, whole and
/// streamed, with OpenAI's fields (also where the random-weight models write
/// bytes that are not whole characters).
#[test]
fn text_completions_match_rloo_generate_whole_and_streamed() {
    let server = serve(&[&named("neox", "gpt_neox-causal"), &named("qwen", "qwen3-causal")], &[]);
    let tmp = tempfile::tempdir().unwrap();
    let prompts = ["The quick brown fox", "Once", "A long time ago, in a galaxy"];
    let file = tmp.path().join("prompts.jsonl");
    std::fs::write(&file, prompts.iter().map(|p| format!("{}\n", json!({"prompt": p}))).collect::<String>()).unwrap();
    for (name, fixture) in [("neox", "gpt_neox-causal"), ("qwen", "qwen3-causal")] {
        let out = tmp.path().join(format!("{name}.jsonl"));
        let dir = model_dir(fixture);
        ok(rloo(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompts",
            file.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--temperature",
            "0",
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--device",
            "cpu",
        ]));
        let generated: Vec<Value> =
            std::fs::read_to_string(&out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        for row in &generated {
            let prompt = prompts[row["prompt_index"].as_u64().unwrap() as usize];
            let body = json!({"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true});
            let (code, answer) = post(&server.url, "/v1/completions", &body);
            assert_eq!(code, 200, "{answer}");
            assert_eq!(answer["object"], "text_completion");
            assert_eq!(answer["model"], name);
            assert!(answer["id"].as_str().unwrap().starts_with("cmpl-"));
            let choice = &answer["choices"][0];
            assert_eq!(choice["text"], row["completion"], "{name}: {prompt}");
            assert_eq!(choice["finish_reason"], "length");
            assert_eq!(answer["usage"]["completion_tokens"], 12);
            let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
            assert_eq!(answer["usage"]["total_tokens"], prompt_tokens + 12);

            let mut streamed = body.clone();
            streamed["stream"] = json!(true);
            streamed["stream_options"] = json!({"include_usage": true});
            let events = stream(&server.url, "/v1/completions", &streamed);
            assert_eq!(events.last().unwrap(), "[DONE]");
            let chunks: Vec<Value> =
                events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
            let choices = || chunks.iter().flat_map(|c| c["choices"].as_array().unwrap());
            let text: String = choices().filter_map(|c| c["text"].as_str()).collect();
            assert_eq!(text, choice["text"].as_str().unwrap());
            assert!(chunks.len() > 3, "one chunk per token, not one in all: {chunks:?}");
            assert_eq!(choices().filter(|c| !c["finish_reason"].is_null()).count(), 1);
            assert_eq!(chunks.last().unwrap()["usage"], answer["usage"]);
        }
    }
}

/// Chat completions render the messages with the model's chat template;
/// the stream opens with the assistant's role and adds up to the whole
/// answer; log-probs come with their alternatives; `n` samples are
/// reproducible with a seed.
#[test]
fn chat_completions_stream_sample_and_report_logprobs() {
    let server = serve(&[&named("qwen", "qwen3-causal")], &[]);
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]);
    let body = json!({"model": "qwen", "messages": messages, "max_tokens": 10, "temperature": 0,
                      "logprobs": true, "top_logprobs": 3});
    let (code, answer) = post(&server.url, "/v1/chat/completions", &body);
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    let content = answer["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, answer["usage"]["completion_tokens"].as_u64().unwrap());
    for token in content {
        let top = token["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], token["token"]);
        assert!((top[0]["logprob"].as_f64().unwrap() - token["logprob"].as_f64().unwrap()).abs() < 1e-5);
        assert!(top[0]["logprob"].as_f64().unwrap() >= top[1]["logprob"].as_f64().unwrap());
    }

    // Under a repetition penalty the alternatives come from the same
    // penalised distribution as the chosen token.
    let mut penalized = body.clone();
    penalized["repetition_penalty"] = json!(1.5);
    let (_, answer_p) = post(&server.url, "/v1/chat/completions", &penalized);
    for token in answer_p["choices"][0]["logprobs"]["content"].as_array().unwrap() {
        let top = &token["top_logprobs"][0];
        assert_eq!(top["token"], token["token"]);
        assert!((top["logprob"].as_f64().unwrap() - token["logprob"].as_f64().unwrap()).abs() < 1e-5, "{token}");
    }

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["logprobs"] = json!(false);
    let events = stream(&server.url, "/v1/chat/completions", &streamed);
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, message(&answer));

    let sampled =
        json!({"model": "qwen", "messages": messages, "max_tokens": 8, "temperature": 1.0, "n": 4, "seed": 7});
    let (_, a) = post(&server.url, "/v1/chat/completions", &sampled);
    let (_, b) = post(&server.url, "/v1/chat/completions", &sampled);
    let texts = |v: &Value| -> Vec<String> {
        v["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(
        a["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert_eq!(texts(&a), texts(&b), "the same seed gives the same samples");
    let mut distinct = texts(&a);
    distinct.dedup();
    assert!(distinct.len() > 1, "four samples at temperature 1 should differ: {distinct:?}");
}

/// A stop string ends the text before it, and the answer says `stop`.
#[test]
fn stop_strings_cut_the_text() {
    let server = serve(&[&named("neox", "gpt_neox-causal")], &[]);
    let body = json!({"prompt": "Once upon", "max_tokens": 30, "temperature": 0, "ignore_eos": true});
    let (_, free) = post(&server.url, "/v1/completions", &body);
    let text = free["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop string taken from the middle of the free-running text.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut stopped = body.clone();
    stopped["stop"] = json!([stop]);
    let (_, cut) = post(&server.url, "/v1/completions", &stopped);
    let expected = &text[..text.find(&stop).unwrap()];
    assert_eq!(cut["choices"][0]["text"], expected, "stop {stop:?} in {text:?}");
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
}

/// Many clients at once get the answers each would get alone, all of them,
/// from a batch that shrinks as rows leave and from one whose rows take the
/// places of rows that left (fixed stepping, as a GPU records its steps).
#[test]
fn concurrent_requests_are_batched_without_changing_answers() {
    let prompts: Vec<String> = (0..24).map(|i| format!("Request {i} says{}", " more".repeat(i % 5))).collect();
    let body = |p: &str| json!({"prompt": p, "max_tokens": 6 + p.len() % 7, "temperature": 0, "ignore_eos": true});
    let mut answers = Vec::new();
    for stepping in ["shrink", "fixed"] {
        let server = serve_stepping(&[&named("neox", "gpt_neox-causal")], &["--max-batch-rows", "16"], stepping);
        let alone: Vec<Value> = prompts.iter().map(|p| post(&server.url, "/v1/completions", &body(p)).1).collect();
        let together: Vec<Value> = std::thread::scope(|s| {
            let handles: Vec<_> =
                prompts.iter().map(|p| s.spawn(|| post(&server.url, "/v1/completions", &body(p)).1)).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for ((p, a), t) in prompts.iter().zip(&alone).zip(&together) {
            assert_eq!(a["choices"][0]["text"], t["choices"][0]["text"], "{stepping}: {p}");
        }
        let (_, health) = get(&server.url, "/health");
        assert_eq!(health["models"]["neox"]["running"], 0);
        assert_eq!(health["models"]["neox"]["completed"], 48);
        answers.push(together.iter().map(|t| t["choices"][0]["text"].clone()).collect::<Vec<_>>());
    }
    assert_eq!(answers[0], answers[1], "the same answers from either batch");
}

/// Each bad request gets a 4xx in OpenAI's error shape, and the server
/// goes on serving.
#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let server = serve(&[&named("neox", "gpt_neox-causal"), &named("rm", "gpt_neox-seqcls")], &["--max-body-mib", "1"]);
    let url = &server.url;
    let raw = |body: &str| {
        send(ureq::post(&format!("{url}/v1/completions")).set("Content-Type", "application/json").send_string(body))
    };
    let (code, e) = raw("{\"prompt\": ");
    assert_eq!(code, 400);
    assert!(e["error"]["message"].as_str().unwrap().starts_with("the body is not JSON"), "{e}");
    assert_eq!(e["error"]["type"], "invalid_request_error");

    let cases = [
        (
            json!({"model": "gpt-4", "prompt": "x"}),
            404,
            "the model `gpt-4` does not exist; this server has `neox`, `rm`",
        ),
        (json!({"model": "rm", "prompt": "x"}), 400, "`rm` is not a text model"),
        (
            json!({"prompt": "x", "max_tokens": 500}),
            400,
            "This model's maximum context length is 128 tokens. However, you requested",
        ),
        (
            json!({"prompt": "word ".repeat(200)}),
            400,
            "This model's maximum context length is 128 tokens, but the prompt is",
        ),
        (json!({"prompt": "x", "temperature": 3}), 400, "temperature must be in [0, 2], got 3"),
        (json!({"prompt": "x", "n": 0}), 400, "n must be between 1 and 64, got 0"),
        (json!({"prompt": "x", "presence_penalty": 0.5}), 400, "`presence_penalty` is not supported by this server"),
        (json!({"prompt": 5}), 400, "`prompt` must be a string or a list, got a number (5)"),
        (json!({"prompt": [1, 2, 99999]}), 400, "99999"),
        (json!({"prompt": "x", "max_tokens": "many"}), 400, "`max_tokens` must be a non-negative integer"),
        (json!({"prompt": "x", "stop": ["\n", ""]}), 400, "`stop`: a stop string is empty"),
    ];
    for (body, code, message) in cases {
        let (got, e) = post(url, "/v1/completions", &body);
        let text = e["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(got, code, "{body}: {e}");
        assert!(text.contains(message), "{body}: {text}");
    }
    let (code, e) =
        post(url, "/v1/chat/completions", &json!({"model": "neox", "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(code, 400);
    assert!(e["error"]["message"].as_str().unwrap().contains("no chat template"), "{e}");
    let (code, _) = get(url, "/v1/nothing");
    assert_eq!(code, 404);
    let (code, _) = get(url, "/v1/completions");
    assert_eq!(code, 405);
    let big = json!({"prompt": "x".repeat(2 << 20)});
    let (code, e) = post(url, "/v1/completions", &big);
    assert_eq!(code, 413, "{e}");

    // Still serving, and the reward model scores on the same server.
    let (code, _) = post(url, "/v1/completions", &json!({"prompt": "hello", "max_tokens": 3}));
    assert_eq!(code, 200);
    let (code, scores) = post(url, "/score", &json!({"prompts": ["a", "a"], "completions": [" good", " bad"]}));
    assert_eq!(code, 200, "{scores}");
    assert_eq!(scores["scores"].as_array().unwrap().len(), 2);
    let (_, models) = get(url, "/v1/models");
    let kinds: Vec<(&str, &str)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["kind"].as_str().unwrap()))
        .collect();
    assert_eq!(kinds, [("neox", "text"), ("rm", "reward")]);
}

/// With a token, the API needs it; the page and the health check do not.
#[test]
fn a_bearer_token_guards_the_api() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rloo"));
    cmd.args(["serve", "--port", "0", "--device", "cpu", "--model", &named("neox", "gpt_neox-causal")])
        .args(["--api-key-env", "RLOO_TEST_KEY"])
        .env("RLOO_TEST_KEY", "sesame");
    let server = Server::start(&mut cmd);
    let url = &server.url;
    let (code, e) = post(url, "/v1/completions", &json!({"prompt": "x", "max_tokens": 2}));
    assert_eq!((code, e["error"]["type"].as_str()), (401, Some("authentication_error")));
    let r = ureq::post(&format!("{url}/v1/completions"))
        .set("Authorization", "Bearer sesame")
        .set("Content-Type", "application/json")
        .send_string(&json!({"prompt": "x", "max_tokens": 2}).to_string());
    assert_eq!(send(r).0, 200);
    assert_eq!(get(url, "/health").0, 200);
    let page = ureq::get(&format!("{url}/")).call().unwrap();
    assert_eq!(page.header("Content-Type"), Some("text/html; charset=utf-8"));
    let html = page.into_string().unwrap();
    assert!(html.contains("Side by side") && html.contains("/v1/chat/completions"), "the chat page");
}

/// A client that leaves in the middle of a stream frees its rows; a full
/// queue answers 503 at once.
#[test]
fn abandoned_streams_are_cleaned_up_and_a_full_queue_answers_503() {
    let server = serve(&[&named("neox", "gpt_neox-causal")], &["--max-concurrent", "1", "--max-queue", "0"]);
    let url = server.url.clone();
    let addr = url.trim_start_matches("http://").to_string();
    let body = json!({"prompt": "Keep going", "max_tokens": 120, "temperature": 0, "ignore_eos": true, "stream": true})
        .to_string();
    let mut client = TcpStream::connect(&addr).unwrap();
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    let n = client.read(&mut first).unwrap();
    let head = String::from_utf8_lossy(&first[..n]);
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");

    // The one worker is busy with the stream: the next request is turned away.
    let (code, e) = post(&url, "/v1/completions", &json!({"prompt": "x", "max_tokens": 2}));
    assert_eq!(code, 503, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("the server is busy"));

    drop(client);
    let started = Instant::now();
    loop {
        let (code, health) = get(&url, "/health");
        if code == 200 && health["models"]["neox"]["cancelled"] == 1 {
            assert_eq!(health["models"]["neox"]["running"], 0);
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the abandoned stream was not cleaned up: {health}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The worker is free again once it has seen the connection closed.
    let started = Instant::now();
    while post(&url, "/v1/completions", &json!({"prompt": "x", "max_tokens": 2})).0 != 200 {
        assert!(started.elapsed() < Duration::from_secs(30), "the worker was not freed");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A few hundred requests from 32 clients: none lost, and the server's
/// memory does not grow with the requests it has answered.
#[test]
fn a_load_test_loses_no_request_and_leaks_no_memory() {
    let server = serve(&[&named("neox", "gpt_neox-causal")], &[]);
    let round = |requests: usize| -> usize {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..32)
                .map(|c| {
                    let url = &server.url;
                    s.spawn(move || {
                        (c..requests)
                            .step_by(32)
                            .filter(|i| {
                                let stream = i % 3 == 0;
                                let body = json!({"prompt": format!("client {c} asks {i}"), "max_tokens": 4 + i % 9,
                                                  "temperature": 0.8, "seed": i, "stream": stream});
                                if stream {
                                    stream_ok(url, &body)
                                } else {
                                    post(url, "/v1/completions", &body).0 == 200
                                }
                            })
                            .count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        })
    };
    assert_eq!(round(96), 96);
    let before = rss_kib(server.child.id());
    assert_eq!(round(320), 320);
    let after = rss_kib(server.child.id());
    println!("server RSS {before} KiB after warm-up, {after} KiB after 320 more requests");
    assert!(after < before + 16 * 1024, "RSS grew from {before} KiB to {after} KiB");
}

fn stream_ok(url: &str, body: &Value) -> bool {
    let events = stream(url, "/v1/completions", body);
    events.last().map(String::as_str) == Some("[DONE]")
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Greedy tokens and logits of `prompt` decoded alone, `steps` tokens.
fn decode_alone(net: &rloo::model::Network, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    use rloo::model::{Inputs, PadSide};
    let dev = candle_core::Device::Cpu;
    let mut cache = net.new_cache();
    let inputs = Inputs::from_rows(&[prompt.to_vec()], 0, PadSide::Left, &dev).unwrap();
    let mut logits = net.logits(&inputs, Some(&mut cache)).unwrap().get(0).unwrap();
    let mut out = Vec::new();
    for pos in (prompt.len() as u32..).take(steps) {
        let last: Vec<f32> = logits.get(logits.dim(0).unwrap() - 1).unwrap().to_vec1().unwrap();
        let next = argmax(&last);
        out.push(last);
        let step = Inputs::step(&[next], &[pos], &dev).unwrap();
        logits = net.logits(&step, Some(&mut cache)).unwrap().get(0).unwrap();
    }
    out
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
}

/// Rows prefilled apart and joined into one cache (left-padded to a common
/// length, then trimmed once the older row leaves) decode exactly as each
/// does alone: what the server's batching relies on.
#[test]
fn joined_rows_decode_as_they_do_alone() {
    use rloo::model::{Inputs, Model, PadSide};
    let dev = candle_core::Device::Cpu;
    for name in ["llama-causal", "gpt2-causal", "gpt_neox-causal"] {
        let model = Model::load(&model_dir(name), &dev).unwrap();
        let net = model.frozen();
        let (a, b): (Vec<u32>, Vec<u32>) = ((3..9).collect(), (20..23).collect());
        let (alone_a, alone_b) = (decode_alone(net, &a, 8), decode_alone(net, &b, 8));

        // A decodes 3 tokens, then B joins; A leaves after 6, B goes on.
        let mut cache = net.new_cache();
        let inputs = Inputs::from_rows(std::slice::from_ref(&a), 0, PadSide::Left, &dev).unwrap();
        let h = net.logits(&inputs, Some(&mut cache)).unwrap();
        let mut rows: Vec<(usize, Vec<u32>, Vec<Vec<f32>>)> = vec![(0, a.clone(), Vec::new())];
        let mut logits: Vec<Vec<f32>> = vec![h.get(0).unwrap().get(a.len() - 1).unwrap().to_vec1().unwrap()];
        let mut worst = 0f32;
        for step in 0..11 {
            if step == 3 {
                let mut joining = net.new_cache();
                let inputs = Inputs::from_rows(std::slice::from_ref(&b), 0, PadSide::Left, &dev).unwrap();
                let h = net.logits(&inputs, Some(&mut joining)).unwrap();
                cache.join(joining, 16).unwrap();
                rows.push((1, b.clone(), Vec::new()));
                logits.push(h.get(0).unwrap().get(b.len() - 1).unwrap().to_vec1().unwrap());
            }
            for (row, l) in rows.iter_mut().zip(&logits) {
                row.2.push(l.clone());
                row.1.push(argmax(l));
            }
            if step == 5 {
                let (done, _, seen) = rows.remove(0);
                assert_eq!(done, 0);
                for (x, y) in seen.iter().zip(&alone_a) {
                    worst = worst.max(x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max));
                }
                cache.select_rows(&[1]).unwrap();
                assert!(cache.trim_front(1).unwrap() > 0, "A's slots in front of B are dropped");
            }
            let tokens: Vec<u32> = rows.iter().map(|r| *r.1.last().unwrap()).collect();
            let positions: Vec<u32> = rows.iter().map(|r| r.1.len() as u32 - 1).collect();
            let step_in = Inputs::step(&tokens, &positions, &dev).unwrap();
            let out = net.logits(&step_in, Some(&mut cache)).unwrap().squeeze(1).unwrap();
            logits = (0..rows.len()).map(|i| out.get(i).unwrap().to_vec1().unwrap()).collect();
        }
        for (x, y) in rows[0].2.iter().zip(&alone_b) {
            worst = worst.max(x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max));
        }
        println!("{name}: joined rows' logits within {worst:.2e} of decoding alone");
        assert!(worst < 1e-4, "{name}: {worst}");
    }
}
