//! Rewards from outside the trainer, against real servers and processes on
//! this machine: the `http`, `command` and `judge` protocols, the ways they
//! fail, `rloo reward serve`, and training runs driven by them.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use candle_core::{DType, Device};
use common::stub::{Reply, Seen, Stub};
use common::*;
use rloo::data::Prompt;
use rloo::reward::{build, RewardSet, RewardSpec, Sample, Scores};
use serde_json::{json, Map, Value};

/// Completions of two prompts, two each.
struct Batch {
    prompts: Vec<Prompt>,
    completions: Vec<String>,
    rows: Vec<Map<String, Value>>,
}

impl Batch {
    fn new(completions: &[&str]) -> Batch {
        Batch {
            prompts: (0..completions.len().div_ceil(2)).map(|g| Prompt::Text(format!("Prompt {g}:"))).collect(),
            completions: completions.iter().map(|c| c.to_string()).collect(),
            rows: (0..completions.len()).map(|i| json!({"id": i}).as_object().unwrap().clone()).collect(),
        }
    }

    fn samples(&self) -> Vec<Sample<'_>> {
        (0..self.completions.len())
            .map(|i| Sample {
                prompt: &self.prompts[i / 2],
                completion: &self.completions[i],
                completion_ids: &[],
                ended_with_eos: true,
                row: &self.rows[i],
                group: i / 2,
            })
            .collect()
    }
}

fn set(spec: Value) -> RewardSet {
    let specs: Vec<RewardSpec> = serde_json::from_value(json!([spec])).unwrap();
    build(&specs, &Device::Cpu, DType::F32).unwrap()
}

fn score(set: &RewardSet, batch: &Batch) -> rloo::Result<Scores> {
    set.score(&batch.samples())
}

fn lengths(body: &Value) -> Vec<usize> {
    body["completions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().chars().count()).collect()
}

/// A scoring service that answers with each completion's length.
fn length_reply(seen: &Seen) -> String {
    json!({ "scores": lengths(&seen.body) }).to_string()
}

fn http(url: &str, extra: Value) -> Value {
    let mut spec = json!({"type": "http", "url": format!("{url}/score"), "batch_size": 2, "backoff_s": 0.01});
    spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    spec
}

fn metric(scores: &Scores, key: &str) -> Option<f32> {
    scores.metrics().into_iter().find(|(k, _)| k == key).map(|(_, v)| v)
}

#[test]
fn http_round_trip_sends_the_batch_and_the_token() {
    std::env::set_var("RLOO_TEST_SCORER_TOKEN", "s3cret");
    let stub = Stub::start(|seen| {
        assert_eq!(seen.path, "/score");
        assert_eq!(seen.header("authorization"), Some("Bearer s3cret"));
        assert_eq!(seen.header("x-team"), Some("rl"));
        assert_eq!(seen.body["prompts"].as_array().unwrap().len(), seen.body["rows"].as_array().unwrap().len());
        // OpenRLHF's key, on every other request.
        let key = if seen.n % 2 == 0 { "scores" } else { "rewards" };
        Reply::Json(200, json!({ key: lengths(&seen.body) }).to_string())
    });
    let set = set(http(&stub.url, json!({"api_key_env": "RLOO_TEST_SCORER_TOKEN", "headers": {"X-Team": "rl"}})));
    let batch = Batch::new(&["a", "abc", "ab", "abcd", ""]);
    let scores = score(&set, &batch).unwrap();
    assert_eq!(scores.total, [Some(1.0), Some(3.0), Some(2.0), Some(4.0), Some(0.0)]);
    assert_eq!(stub.count(), 3, "batches of 2");
    assert_eq!(metric(&scores, "rewards/http/failures"), Some(0.0));
    assert!(
        metric(&scores, "rewards/http/latency_s/p95").unwrap()
            >= metric(&scores, "rewards/http/latency_s/p50").unwrap()
    );
    // The token is read from the environment and never saved.
    let saved = toml::to_string(
        &serde_json::from_value::<RewardSpec>(http(&stub.url, json!({"api_key_env": "RLOO_TEST_SCORER_TOKEN"})))
            .unwrap(),
    )
    .unwrap();
    assert!(!saved.contains("s3cret") && saved.contains("RLOO_TEST_SCORER_TOKEN"), "{saved}");
}

#[test]
fn http_errors_are_retried_with_backoff_until_they_pass() {
    // 500 then 429 then an answer, for every batch.
    let stub = Stub::start(|seen| match seen.n % 3 {
        0 => Reply::Json(500, "{\"error\": \"overloaded\"}".into()),
        1 => Reply::Json(429, "{}".into()),
        _ => Reply::Json(200, length_reply(seen)),
    });
    let set = set(http(&stub.url, json!({"retries": 2, "max_concurrency": 1})));
    let scores = score(&set, &Batch::new(&["xx", "y", "zzz", ""])).unwrap();
    assert_eq!(scores.total, [Some(2.0), Some(1.0), Some(3.0), Some(0.0)]);
    assert_eq!(stub.count(), 6);
    assert_eq!(metric(&scores, "rewards/http/failures"), Some(0.0));
}

#[test]
fn http_failures_leave_samples_unscored_below_the_rate_and_stop_the_run_above() {
    // The second batch of every call fails in its own way; the others answer.
    type Fault = fn(&Seen) -> Reply;
    let faults: [(&str, Fault, &str); 5] = [
        ("slow", |_| Reply::Slow(Duration::from_millis(1500), 200, "{\"scores\": [1, 1]}".into()), "timed out"),
        ("closed", |_| Reply::Close, ""),
        ("malformed", |_| Reply::Json(200, "{\"scores\": [1, ".into()), "the answer is not JSON"),
        ("wrong count", |_| Reply::Json(200, "{\"scores\": [1]}".into()), "expected 2 scores, got 1"),
        (
            "bad request",
            |_| Reply::Json(400, "{\"error\": \"no such model\"}".into()),
            "HTTP 400: {\"error\": \"no such model\"}",
        ),
    ];
    for (what, fault, message) in faults {
        let stub = Stub::start(move |seen| {
            if seen.body["completions"][0] == "fail" {
                fault(seen)
            } else {
                Reply::Json(200, length_reply(seen))
            }
        });
        let batch = Batch::new(&["ab", "c", "fail", "x", "abcd", "abc"]);
        // One batch of three is a third of the samples: within a rate of 0.5.
        let tolerant = set(http(&stub.url, json!({"timeout_s": 0.5, "retries": 1, "max_failure_rate": 0.5})));
        let scores = score(&tolerant, &batch).unwrap();
        assert_eq!(scores.total, [Some(2.0), Some(1.0), None, None, Some(4.0), Some(3.0)], "{what}");
        assert_eq!(metric(&scores, "rewards/http/failures"), Some(2.0), "{what}");
        let strict = set(http(&stub.url, json!({"timeout_s": 0.5, "retries": 0, "max_failure_rate": 0.2})));
        let err = score(&strict, &batch).unwrap_err();
        assert!(matches!(err, rloo::Error::RewardService(_)), "{what}: {err}");
        let err = err.to_string();
        assert!(
            err.starts_with(&format!("reward `http` ({}/score): 2 of 6 samples failed in one step", stub.url)),
            "{what}: {err}"
        );
        assert!(err.contains(message), "{what}: {err}");
    }
}

#[test]
fn a_refused_connection_names_the_url() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let set = set(http(&url, json!({"retries": 1})));
    let err = score(&set, &Batch::new(&["a", "b"])).unwrap_err().to_string();
    assert!(err.starts_with(&format!("reward `http` ({url}/score): 2 of 2 samples failed")), "{err}");
    assert!(err.contains("(after 2 attempts)"), "{err}");
}

#[test]
fn bad_http_and_judge_tables_are_explained() {
    let err = |spec: Value| {
        let specs: Vec<RewardSpec> = serde_json::from_value(json!([spec])).unwrap();
        build(&specs, &Device::Cpu, DType::F32).err().unwrap().to_string()
    };
    assert_eq!(
        err(json!({"type": "http", "url": "localhost:8000/score"})),
        "reward #1 (http `http`): url `localhost:8000/score` must start with http:// or https://"
    );
    assert_eq!(
        err(json!({"type": "http", "url": "http://h/score", "api_key_env": "RLOO_TEST_UNSET_VARIABLE"})),
        "reward #1 (http `http`): api_key_env: the environment variable `RLOO_TEST_UNSET_VARIABLE` is not set"
    );
    assert_eq!(
        err(json!({"type": "http", "url": "http://h/score", "max_failure_rate": 2})),
        "reward #1 (http `http`): max_failure_rate must be in [0, 1], got 2"
    );
    assert_eq!(
        err(json!({"type": "judge", "url": "http://h/v1", "model": "m", "timeout_s": 0})),
        "reward #1 (judge `judge`): timeout_s must be a number of seconds > 0, got 0"
    );
    assert_eq!(
        err(json!({"type": "command", "command": ["/no/such/scorer"]})),
        "reward #1 (command `command`): cannot start command `/no/such/scorer`: No such file or directory (os error 2)"
    );
}

/// A scorer process in POSIX sh and awk (always installed): each request
/// line is answered with the character length of each completion (escaped
/// quotes and backslashes removed first, so that they cannot end a string
/// early). One awk per line, since mawk would wait for a full input buffer.
const AWK_LENGTHS: &str = r#"{
  line = $0; gsub(/\\\\/, "", line); gsub(/\\"/, "", line); out = ""; n = 0
  while (match(line, /"completion":"[^"]*"/)) {
    s = substr(line, RSTART + 14, RLENGTH - 15); out = out (n ? "," : "") length(s); n++
    line = substr(line, RSTART + RLENGTH)
  }
  print "{\"scores\":[" out "]}"; fflush()
}"#;

fn command(script: &str, extra: Value) -> Value {
    let mut spec = json!({"type": "command", "name": "scorer", "command": ["sh", "-c", script]});
    spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    spec
}

/// Answers the request line in `$line`.
fn answer_line() -> String {
    format!("printf '%s\\n' \"$line\" | awk '{AWK_LENGTHS}'")
}

fn scorer_loop() -> String {
    format!("while IFS= read -r line; do {}; done", answer_line())
}

#[test]
fn a_command_scores_over_json_lines() {
    let set = set(command(&scorer_loop(), json!({"batch_size": 3})));
    let batch = Batch::new(&["ab", "say \"hi\"", "back\\slash", "", "four"]);
    let scores = score(&set, &batch).unwrap();
    // Quotes and backslashes arrive escaped and are dropped by the scorer.
    assert_eq!(scores.total, [Some(2.0), Some(6.0), Some(9.0), Some(0.0), Some(4.0)]);
    assert_eq!(metric(&scores, "rewards/scorer/failures"), Some(0.0));
    // The process lives on between calls.
    assert_eq!(score(&set, &Batch::new(&["abc"])).unwrap().total, [Some(3.0)]);
}

#[test]
fn a_command_that_dies_is_restarted_once() {
    let tmp = tempfile::tempdir().unwrap();
    let marker = tmp.path().join("crashed");
    // The first process dies on its second request, leaving a marker; the
    // restarted one sees the marker and keeps going.
    let script = format!(
        "if [ -e {m} ]; then {all}; else IFS= read -r line; {one}; touch {m}; echo 'scorer: out of memory' >&2; exit 3; fi",
        m = marker.display(),
        all = scorer_loop(),
        one = answer_line()
    );
    let set = set(command(&script, json!({})));
    assert_eq!(score(&set, &Batch::new(&["a"])).unwrap().total, [Some(1.0)]);
    assert_eq!(score(&set, &Batch::new(&["ab"])).unwrap().total, [Some(2.0)]);
    assert_eq!(score(&set, &Batch::new(&["abc"])).unwrap().total, [Some(3.0)]);

    // One that always dies is not restarted a second time.
    let set = self::set(command("head -n 1 >/dev/null; echo 'scorer: bad input' >&2; exit 3", json!({})));
    let err = score(&set, &Batch::new(&["a"])).unwrap_err();
    assert!(matches!(err, rloo::Error::RewardService(_)), "{err}");
    assert_eq!(
        err.to_string(),
        "reward `scorer`: command `sh -c head -n 1 >/dev/null; echo 'scorer: bad input' >&2; exit 3` exited \
         (exit status: 3); its last stderr line: scorer: bad input, and it was already restarted once"
    );
}

#[test]
fn a_command_that_hangs_or_babbles_fails_its_batch() {
    let set = set(command("sleep 30", json!({"timeout_s": 0.3, "max_failure_rate": 1.0})));
    let scores = score(&set, &Batch::new(&["a", "b"])).unwrap();
    assert_eq!(scores.total, [None, None]);
    assert_eq!(metric(&scores, "rewards/scorer/failures"), Some(2.0));
    let set = self::set(command("while read l; do echo 'ready!'; done", json!({"max_failure_rate": 0.5})));
    let err = score(&set, &Batch::new(&["a"])).unwrap_err().to_string();
    assert!(err.contains("1 of 1 samples failed") && err.contains("the answer line is not JSON"), "{err}");
}

/// A scorer that writes a line no request asked for (a second answer, a
/// debug print) stops the run, naming the line, rather than putting every
/// later answer against the wrong batch.
#[test]
fn a_command_that_writes_an_extra_line_stops_naming_it() {
    let answer_and =
        |extra: &str| format!("while IFS= read -r line; do out=$({}); printf '{extra}' \"$out\"; done", answer_line());
    let twice = answer_and("%s\\n{\"scores\": [99]}\\n");
    let set = set(command(&twice, json!({"batch_size": 1})));
    let err = score(&set, &Batch::new(&["a", "bb", "ccc", "dddd"])).unwrap_err().to_string();
    assert!(err.contains("reward `scorer`: command `sh -c"), "{err}");
    assert!(
        err.ends_with(
            "wrote a line no request asked for, which would put its answers against the wrong samples \
         (each request line gets exactly one answer line; write anything else to stderr): {\"scores\": [99]}"
        ),
        "{err}"
    );
    let chatty = answer_and("scoring a batch\\n%s\\n");
    let set = self::set(command(&chatty, json!({"batch_size": 1})));
    let err = score(&set, &Batch::new(&["a", "bb"])).unwrap_err().to_string();
    assert!(
        err.ends_with(
            "(each request line gets exactly one answer line; write anything else to stderr): {\"scores\":[1]}"
        ),
        "{err}"
    );
}

/// A chat-completions stub whose "judge" counts the letter `e`: in
/// `A:<completion>` for pointwise requests and in `1:<a>|2:<b>` for pairwise
/// ones; completions containing `<unsure>` get an answer without a score.
fn judge_stub() -> Stub {
    Stub::start(|seen| {
        assert_eq!(seen.path, "/v1/chat/completions");
        assert_eq!(seen.body["model"], "rule-judge");
        let user = seen.body["messages"].as_array().unwrap().last().unwrap()["content"].as_str().unwrap().to_string();
        let es = |s: &str| s.matches('e').count();
        let answer = if user.contains("<unsure>") {
            "I cannot decide.".to_string()
        } else if let Some(rest) = user.strip_prefix("1:") {
            let (a, b) = rest.split_once("|2:").unwrap();
            format!("Reasoning... \\boxed{{{}, {}}}", es(a), es(b))
        } else {
            format!("\\boxed{{{}}}", es(user.strip_prefix("A:").unwrap()))
        };
        Reply::Json(200, json!({"choices": [{"message": {"role": "assistant", "content": answer}}]}).to_string())
    })
}

fn judge(url: &str, extra: Value) -> Value {
    let mut spec = json!({"type": "judge", "url": format!("{url}/v1"), "model": "rule-judge", "backoff_s": 0.01});
    spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    spec
}

#[test]
fn a_pointwise_judge_reads_the_score_and_counts_unreadable_answers() {
    let stub = judge_stub();
    let set = set(judge(&stub.url, json!({"template": "A:{completion}", "max_failure_rate": 0.5})));
    let scores = score(&set, &Batch::new(&["eee", "e<unsure>", "", "see"])).unwrap();
    assert_eq!(scores.total, [Some(3.0), None, Some(0.0), Some(2.0)]);
    assert_eq!(metric(&scores, "rewards/judge/failures"), Some(1.0));
}

#[test]
fn a_pairwise_judge_averages_each_samples_scores_over_its_comparisons() {
    let stub = judge_stub();
    let set = set(judge(&stub.url, json!({"mode": "pairwise", "template": "1:{completion_1}|2:{completion_2}"})));
    // Groups of two: each pair is asked in both orders.
    let scores = score(&set, &Batch::new(&["ee", "e", "", "eeee"])).unwrap();
    assert_eq!(scores.total, [Some(2.0), Some(1.0), Some(0.0), Some(4.0)]);
    assert_eq!(stub.count(), 4);
    // All pairs of a group of four: 12 comparisons, one unreadable answer
    // (the pairs with "<unsure>") leaves that sample's other comparisons in charge.
    let stub = judge_stub();
    let set = self::set(judge(
        &stub.url,
        json!({"mode": "pairwise", "pairs": "all", "template": "1:{completion_1}|2:{completion_2}", "max_failure_rate": 0.6}),
    ));
    let mut batch = Batch::new(&["ee", "<unsure>", "", "eee"]);
    batch.prompts = vec![Prompt::Text("One prompt".into()); 2];
    let samples: Vec<Sample> = batch.samples().into_iter().map(|s| Sample { group: 0, ..s }).collect();
    let scores = set.score(&samples).unwrap();
    assert_eq!(scores.total, [Some(2.0), None, Some(0.0), Some(3.0)]);
    assert_eq!(stub.count(), 12);
    assert_eq!(metric(&scores, "rewards/judge/failures"), Some(6.0));
}

fn write_prompts(dir: &Path) -> String {
    let path = dir.join("prompts.jsonl");
    let prompts = ["The movie was", "Tomorrow the weather will be", "I think the film", "We cooked"];
    let rows: Vec<String> = prompts.iter().map(|p| json!({ "prompt": p }).to_string()).collect();
    std::fs::write(&path, rows.join("\n") + "\n").unwrap();
    path.to_str().unwrap().to_string()
}

fn train_args<'a>(prompts: &'a str, out: &'a str, reward: &'a str, episodes: &'a str) -> Vec<&'a str> {
    let policy = Box::leak(model_dir("gpt_neox-causal").to_str().unwrap().to_string().into_boxed_str());
    vec![
        "train",
        "--model_name_or_path",
        policy,
        "--dataset_name",
        prompts,
        "--output_dir",
        out,
        "--set",
        reward,
        "--total_episodes",
        episodes,
        "--per_device_train_batch_size",
        "16",
        "--rloo_k",
        "4",
        "--response_length",
        "16",
        "--num_ppo_epochs",
        "1",
        "--learning_rate",
        "2e-3",
        "--kl_coef",
        "0.1",
        "--num_sample_generations",
        "0",
        "--device",
        "cpu",
    ]
}

fn metrics(dir: &Path) -> Vec<Map<String, Value>> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap().as_object().unwrap().clone())
        .collect()
}

/// A pairwise judge that prefers completions with more `e`s drives a short
/// run: its reward rises as a rule's would.
#[test]
fn a_pairwise_judge_reward_rises_within_a_short_run() {
    let stub = judge_stub();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let prompts = write_prompts(tmp.path());
    let reward = format!(
        "reward=[{{type=\"judge\", url=\"{}/v1\", model=\"rule-judge\", mode=\"pairwise\", \
         template=\"1:{{completion_1}}|2:{{completion_2}}\", max_failure_rate=0.5}}]",
        stub.url
    );
    let args = train_args(&prompts, out.to_str().unwrap(), &reward, "640");
    let run = rloo(&args);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let rows = metrics(&out);
    assert_eq!(rows.len(), 40);
    let mean = |rows: &[Map<String, Value>]| {
        rows.iter().map(|r| r["rewards/judge/mean"].as_f64().unwrap()).sum::<f64>() / rows.len() as f64
    };
    let (first, last) = (mean(&rows[..5]), mean(&rows[35..]));
    for r in rows.iter().step_by(5) {
        println!(
            "step {:>2} judge reward {:.2} kl {:.3} failures {} latency p50 {:.4} s",
            r["step"],
            r["rewards/judge/mean"],
            r["objective/kl"],
            r["rewards/judge/failures"],
            r["rewards/judge/latency_s/p50"]
        );
    }
    println!("judge reward {first:.2} -> {last:.2}");
    assert!(last > first + 1.0, "the judge reward did not rise: {first} -> {last}");
    // 16 samples in groups of 4, round robin: 16 comparisons per step.
    assert_eq!(stub.count(), 40 * 16);
}

/// A service that starts failing mid-run stops it with an error naming it,
/// after the weights of the last finished step are saved; the run resumes
/// from there once the service is back.
#[test]
fn a_failing_service_stops_the_run_with_a_checkpoint() {
    let healthy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let up = std::sync::Arc::clone(&healthy);
    let stub = Stub::start(move |seen| {
        // Fails from its fourth request (the second step) until told otherwise.
        if seen.n >= 3 && !up.load(std::sync::atomic::Ordering::SeqCst) {
            Reply::Json(503, "{\"error\": \"the GPU fell off the bus\"}".into())
        } else {
            Reply::Json(200, json!({ "scores": lengths(&seen.body) }).to_string())
        }
    });
    healthy.store(false, std::sync::atomic::Ordering::SeqCst);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let prompts = write_prompts(tmp.path());
    let reward =
        format!("reward=[{{type=\"http\", url=\"{}/score\", batch_size=8, retries=1, backoff_s=0.01}}]", stub.url);
    let args = train_args(&prompts, out.to_str().unwrap(), &reward, "64");
    let run = rloo(&args);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    println!("{stderr}");
    assert!(
        stderr.contains(&format!("reward `http` ({}/score): 8 of 16 samples failed in one step", stub.url)),
        "{stderr}"
    );
    assert!(stderr.contains("HTTP 503: {\"error\": \"the GPU fell off the bus\"} (after 2 attempts)"), "{stderr}");
    assert!(stderr.contains("the run stopped after step 1 with its weights in"), "{stderr}");
    assert!(out.join("checkpoint-1/trainer_state.json").is_file());
    assert_eq!(metrics(&out).len(), 1);

    healthy.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut resume = args.clone();
    resume.extend(["--resume_from_checkpoint", "latest"]);
    let run = rloo(&resume);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert_eq!(metrics(&out).len(), 4);
}

/// `rloo reward serve` answers the `http` source with the scores the reward
/// model gives in process, and turns bad requests away with a reason.
#[test]
fn a_served_reward_model_scores_as_it_does_in_process() {
    let model = model_dir("gpt_neox-seqcls");
    let server = Server::start(
        Command::new(env!("CARGO_BIN_EXE_rloo"))
            .args(["reward", "serve", "--model", model.to_str().unwrap(), "--port", "0", "--device", "cpu"])
            .args(["--batch-size", "4", "--max-request-samples", "8", "--api-key-env", "RLOO_TEST_SERVE_TOKEN"])
            .env("RLOO_TEST_SERVE_TOKEN", "tok"),
    );
    let url = server.url.clone();

    std::env::set_var("RLOO_TEST_CLIENT_TOKEN", "tok");
    let served = set(
        json!({"type": "http", "url": format!("{url}/score"), "batch_size": 3, "api_key_env": "RLOO_TEST_CLIENT_TOKEN"}),
    );
    let local = set(json!({"type": "model", "path": model, "name": "http"}));
    let batch = Batch::new(&[" good.", " bad, really", " fine", "", " the end"]);
    let (a, b) = (score(&served, &batch).unwrap(), score(&local, &batch).unwrap());
    for (x, y) in a.total.iter().zip(&b.total) {
        assert!((x.unwrap() - y.unwrap()).abs() < 1e-5, "served {:?}, in process {:?}", a.total, b.total);
    }

    let agent = ureq::AgentBuilder::new().build();
    let post = |body: &str, token: &str| -> (u16, Value) {
        let r = agent
            .post(&format!("{url}/score"))
            .set("Authorization", &format!("Bearer {token}"))
            .set("Content-Type", "application/json")
            .send_string(body);
        let (code, text) = match r {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
            Err(e) => panic!("{e}"),
        };
        (code, serde_json::from_str(&text).unwrap())
    };
    let health: Value =
        serde_json::from_str(&agent.get(&format!("{url}/health")).call().unwrap().into_string().unwrap()).unwrap();
    assert_eq!(health["status"], "ok");
    for (body, token, code, message) in [
        (
            "{\"prompts\": [\"a\"], \"completions\": [\"b\"]}",
            "wrong",
            401,
            "a wrong bearer token: send `Authorization: Bearer <token>`",
        ),
        ("{\"prompts\": [\"a\"]}", "tok", 400, "missing `completions`"),
        ("{\"prompts\": [\"a\", \"b\"], \"completions\": [\"c\"]}", "tok", 400, "2 prompts but 1 completions"),
        (
            "{\"prompts\": [3], \"completions\": [\"c\"]}",
            "tok",
            400,
            "prompts[0]: expected a string or a list of {role, content} messages, got a number (3)",
        ),
        (
            "[1, 2]",
            "tok",
            400,
            "the body must be an object {\"prompts\", \"completions\", \"rows\"}, got a list of 2 items",
        ),
        (
            &format!("{{\"prompts\": {p}, \"completions\": {p}}}", p = json!(vec!["x"; 9])),
            "tok",
            413,
            "9 samples in one request; the limit is 8",
        ),
    ] {
        let (got, answer) = post(body, token);
        assert_eq!((got, answer["error"]["message"].as_str().unwrap()), (code, message), "{body}");
    }
}

/// `examples/helpsteer3/rloo.toml` as shipped (its judge template, score
/// pattern and chat prompts), with the bundled chat model as the policy and
/// a stand-in GenRM that rates longer responses higher: two steps run and
/// the judge sees the conversation and both responses in its format.
#[test]
fn the_helpsteer3_example_trains_against_a_genrm_style_judge() {
    let stub = Stub::start(|seen| {
        let user = seen.body["messages"][0]["content"].as_str().unwrap().to_string();
        let section =
            |from: &str, to: &str| user.split(from).nth(1).unwrap().split(to).next().unwrap().trim().chars().count();
        assert!(user.contains("[Conversation]\nUser: "), "{user}");
        let (a, b) = (section("[Response 1]", "[Response 2]"), section("[Response 2]", "Explain your reasoning"));
        let score = |n: usize| 1 + n.min(40) / 10;
        let answer = format!("Response 1 is ... \\boxed{{{}, {}}}", score(a), score(b));
        Reply::Json(200, json!({"choices": [{"message": {"role": "assistant", "content": answer}}]}).to_string())
    });
    let tmp = tempfile::tempdir().unwrap();
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/helpsteer3/rloo.toml")).unwrap();
    let mut config: toml::Table = toml::from_str(&text).unwrap();
    let set = |config: &mut toml::Table, path: &[&str], value: toml::Value| {
        let mut table = config;
        for key in &path[..path.len() - 1] {
            table = match table.get_mut(*key).unwrap() {
                toml::Value::Array(a) => a[0].as_table_mut().unwrap(),
                v => v.as_table_mut().unwrap(),
            };
        }
        table.insert(path[path.len() - 1].to_string(), value);
    };
    let s = |x: &str| toml::Value::String(x.to_string());
    set(&mut config, &["model", "policy"], s(model_dir("qwen2-causal").to_str().unwrap()));
    set(&mut config, &["model", "device"], s("cpu"));
    set(&mut config, &["train", "output_dir"], s(tmp.path().join("run").to_str().unwrap()));
    set(&mut config, &["train", "total_episodes"], toml::Value::Integer(32));
    set(&mut config, &["generation", "response_length"], toml::Value::Integer(8));
    set(&mut config, &["reward", "url"], s(&format!("{}/v1", stub.url)));
    let path = tmp.path().join("rloo.toml");
    std::fs::write(&path, toml::to_string(&config).unwrap()).unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_rloo"))
        .args(["train", path.to_str().unwrap()])
        .env("GENRM_API_KEY", "key")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let rows = metrics(&tmp.path().join("run"));
    assert_eq!(rows.len(), 2);
    for r in &rows {
        let mean = r["rewards/genrm/mean"].as_f64().unwrap();
        assert!((1.0..=5.0).contains(&mean) && r["rewards/genrm/failures"] == 0.0, "{r:?}");
    }
    // 16 samples a step in groups of 4, round robin.
    assert_eq!(stub.count(), 2 * 16);
    let saved = std::fs::read_to_string(tmp.path().join("run/rloo_config.toml")).unwrap();
    assert!(saved.contains("GENRM_API_KEY") && !saved.contains("\"key\""));
}

/// `rloo eval --judge` against a reference column: both orders of each
/// pair asked, unreadable answers and rows without a reference counted and
/// left out, the answers saved beside the report.
#[test]
fn judged_evaluation_against_a_reference_column() {
    let stub = judge_stub();
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("held_out.jsonl");
    let long = "e".repeat(40);
    let rows = [
        json!({"prompt": "The movie was", "summary": long}),
        json!({"prompt": "I think the film", "summary": long}),
        json!({"prompt": "We cooked", "summary": "<unsure>"}),
        json!({"prompt": "The music was"}),
    ];
    std::fs::write(&prompts, rows.iter().map(|r| format!("{r}\n")).collect::<String>()).unwrap();
    let judge = tmp.path().join("judge.toml");
    std::fs::write(
        &judge,
        format!(
            "[[reward]]\ntype = \"judge\"\nurl = \"{}/v1\"\nmodel = \"rule-judge\"\nmode = \"pairwise\"\n\
             template = \"1:{{completion_1}}|2:{{completion_2}}\"\n",
            stub.url
        ),
    )
    .unwrap();
    let report = tmp.path().join("eval.json");
    let out = rloo(&[
        "eval",
        "--prompts",
        prompts.to_str().unwrap(),
        "--model",
        model_dir("gpt_neox-causal").to_str().unwrap(),
        "--judge",
        judge.to_str().unwrap(),
        "--judge-reference-column",
        "summary",
        "--max-new-tokens",
        "8",
        "--output",
        report.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(stdout.contains("judged win rate of"), "{stdout}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let j = &report["judged"];
    assert_eq!((j["pairs"].as_u64(), j["missing_reference"].as_u64()), (Some(3), Some(1)), "{j}");
    let (read, unparsable) = (j["verdicts"].as_u64().unwrap(), j["unparsable"].as_u64().unwrap());
    assert!(unparsable >= 2 && read + unparsable + j["failed"].as_u64().unwrap() == 6, "{j}");
    assert!(j["win_rate"].as_f64().unwrap() < 0.2, "8 tokens cannot hold 40 e's: {j}");
    let answers = std::fs::read_to_string(tmp.path().join("eval.judge.jsonl")).unwrap();
    let orders: Vec<Value> =
        answers.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["order"].clone()).collect();
    assert_eq!(orders, ["a_first", "b_first"].repeat(3));
    assert_eq!(stub.count(), 6);
}
