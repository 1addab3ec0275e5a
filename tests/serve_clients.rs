//! Real clients against the built `rloo serve`: the chat page in headless
//! Chromium driven over WebDriver (chromedriver), and the `openai` Python
//! package through `scripts/serve/openai_check.py`. Each is skipped with a
//! message where its tools are missing, except under CI, which installs
//! them (`.ci/run`) and must run them.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// Why a client test cannot run here: a message outside CI, a failure in it.
fn missing(what: &str) {
    if std::env::var_os("CI").is_some() {
        panic!("{what}: CI must run this test (.ci/run installs it)");
    }
    eprintln!("skipped: {what}");
}

/// The first of `names` found on PATH.
fn on_path(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).flat_map(|dir| names.iter().map(move |n| dir.join(n))).find(|p| p.is_file())
}

fn serve(models: &[(&str, &str)]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rloo"));
    cmd.args(["serve", "--port", "0", "--device", "cpu"]);
    for (name, fixture) in models {
        cmd.args(["--model", &format!("{name}={}", model_dir(fixture).display())]);
    }
    Server::start(&mut cmd)
}

fn post(url: &str, path: &str, body: &Value) -> Value {
    let r = ureq::post(&format!("{url}{path}")).set("Content-Type", "application/json").send_string(&body.to_string());
    serde_json::from_str(&r.unwrap().into_string().unwrap()).unwrap()
}

/// A headless Chromium session over the WebDriver protocol.
struct Browser {
    driver: Child,
    base: String,
    _profile: tempfile::TempDir,
}

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Browser {
    fn start(chromium: &PathBuf, chromedriver: &PathBuf) -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        while ureq::get(&format!("{url}/status")).call().is_err() {
            assert!(started.elapsed() < Duration::from_secs(30), "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let profile = tempfile::tempdir().unwrap();
        let args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--window-size=1400,900",
            &format!("--user-data-dir={}", profile.path().display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium, "args": args}}}});
        let session = call(ureq::post(&format!("{url}/session")), Some(caps));
        let id = session["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {session}"));
        Browser { base: format!("{url}/session/{id}"), driver, _profile: profile }
    }

    fn post(&self, path: &str, body: Value) -> Value {
        call(ureq::post(&format!("{}{path}", self.base)), Some(body))
    }

    fn open(&self, url: &str) {
        self.post("/url", json!({"url": url}));
    }

    /// Runs `script` (a function body) in the page and returns its value.
    fn run(&self, script: &str) -> Value {
        self.post("/execute/sync", json!({"script": script, "args": []}))
    }

    fn element(&self, css: &str) -> String {
        let found = self.post("/element", json!({"using": "css selector", "value": css}));
        found[ELEMENT].as_str().unwrap_or_else(|| panic!("no element {css}: {found}")).to_string()
    }

    fn click(&self, css: &str) {
        self.post(&format!("/element/{}/click", self.element(css)), json!({}));
    }

    fn type_into(&self, css: &str, text: &str) {
        self.post(&format!("/element/{}/value", self.element(css)), json!({"text": text}));
    }

    /// Waits until `script` returns something other than false or null.
    fn wait_for(&self, script: &str, what: &str) -> Value {
        let started = Instant::now();
        loop {
            let v = self.run(script);
            if !(v.is_null() || v == json!(false)) {
                return v;
            }
            if started.elapsed() > Duration::from_secs(60) {
                let page = self.run("return document.body.innerText");
                panic!("{what} did not happen; the page shows:\n{}", page.as_str().unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = ureq::delete(&self.base).call();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// A WebDriver call's `value`.
fn call(request: ureq::Request, body: Option<Value>) -> Value {
    let r = match body {
        Some(b) => request.set("Content-Type", "application/json").send_string(&b.to_string()),
        None => request.call(),
    };
    let text = match r {
        Ok(r) => r.into_string().unwrap(),
        Err(ureq::Error::Status(code, r)) => panic!("WebDriver {code}: {}", r.into_string().unwrap()),
        Err(e) => panic!("WebDriver: {e}"),
    };
    serde_json::from_str::<Value>(&text).unwrap()["value"].clone()
}

/// Records the page's requests to the API and each distinct text the last
/// answer showed while it streamed.
const WATCH: &str = r#"
window.seen = { requests: [], texts: [] };
const fetched = window.fetch;
window.fetch = async (path, init) => {
  const r = await fetched(path, init);
  window.seen.requests.push({ path, body: init && init.body ? JSON.parse(init.body) : null,
                              status: r.status, type: r.headers.get("Content-Type") });
  return r;
};
new MutationObserver(() => {
  const bodies = document.querySelectorAll(".msg.assistant > div:first-child");
  const text = bodies.length ? bodies[bodies.length - 1].textContent : "";
  const texts = window.seen.texts;
  if (text && texts[texts.length - 1] !== text) texts.push(text);
}).observe(document.body, { subtree: true, childList: true, characterData: true });
"#;

/// The page loads, chats with a streamed answer that is the API's, and
/// side by side shows two models' answers with the reward model's scores,
/// the better one marked.
#[test]
fn the_chat_page_streams_answers_and_compares_two_models_with_scores() {
    let (Some(chromium), Some(chromedriver)) =
        (on_path(&["chromium", "chromium-browser", "google-chrome"]), on_path(&["chromedriver"]))
    else {
        return missing(
            "the chat page test needs Chromium and chromedriver (apt-get install chromium chromium-driver)",
        );
    };
    let server = serve(&[
        ("chat", "qwen3-causal"),
        ("neox", "gpt_neox-causal"),
        ("opt", "opt-causal"),
        ("rm", "gpt_neox-seqcls"),
    ]);
    let browser = Browser::start(&chromium, &chromedriver);
    browser.open(&format!("{}/", server.url));
    browser.wait_for("return document.querySelectorAll('#model-a option').length === 3", "the model list");
    browser.run(WATCH);
    browser.run(
        "const set = (id, v) => { const e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event('change')); };
         set('model-a', 'chat'); set('temperature', '0'); set('max_tokens', '12');",
    );

    // Chat: the answer streams in and is the one the API gives.
    browser.type_into("#prompt", "Hello there");
    browser.click("#send");
    let meta = browser.wait_for(
        "const m = document.querySelector('#log-a .msg.assistant .meta'); return m && m.textContent.includes('tokens') && m.textContent",
        "the chat answer",
    );
    let shown = browser.run("return document.querySelector('#log-a .msg.assistant > div').textContent");
    let seen = browser.run("return window.seen");
    let request = &seen["requests"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(request["path"], "/v1/chat/completions", "{seen}");
    assert_eq!(request["body"]["stream"], true);
    assert_eq!((request["status"].as_u64(), request["type"].as_str()), (Some(200), Some("text/event-stream")));
    let api = post(
        &server.url,
        "/v1/chat/completions",
        &json!({"model": "chat", "messages": [{"role": "user", "content": "Hello there"}], "temperature": 0,
                "max_tokens": 12, "top_p": 1, "top_k": 0, "min_p": 0}),
    );
    assert_eq!(shown, api["choices"][0]["message"]["content"], "{meta}");
    let tokens = api["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(meta.as_str().unwrap().starts_with(&format!("{tokens} tokens")), "{meta}");
    println!("chat: {shown} ({meta}); texts shown while streaming: {}", seen["texts"]);

    // Side by side with scores.
    browser.click("#tab-compare");
    browser.run(
        "const set = (id, v) => { const e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event('change')); };
         set('model-a', 'neox'); set('model-b', 'opt');",
    );
    assert_eq!(browser.run("return document.getElementById('reward').value"), "rm");
    let prompt = "Review: Casablanca";
    browser.type_into("#prompt", prompt);
    browser.click("#send");
    browser.wait_for(
        "const m = [...document.querySelectorAll('.msg.assistant .meta')].map((e) => e.textContent);
         return m.length === 2 && m.every((t) => t.includes('score')) && m",
        "two scored answers",
    );
    let sides = browser.run(
        "return ['a', 'b'].map((s) => { const m = document.querySelector('#log-' + s + ' .msg.assistant');
           return { text: m.firstChild.textContent, meta: m.querySelector('.meta').textContent,
                    best: !!m.querySelector('.score.best') }; })",
    );
    let sides = sides.as_array().unwrap();
    let mut texts = Vec::new();
    for (side, model) in sides.iter().zip(["neox", "opt"]) {
        let body = json!({"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 12});
        let api = post(&server.url, "/v1/completions", &body);
        assert_eq!(side["text"], api["choices"][0]["text"], "{model}: {side}");
        texts.push(side["text"].as_str().unwrap().to_string());
    }
    let scores =
        post(&server.url, "/score", &json!({"model": "rm", "prompts": [prompt, prompt], "completions": texts}));
    let scores: Vec<f64> = scores["scores"].as_array().unwrap().iter().map(|s| s.as_f64().unwrap()).collect();
    for (side, score) in sides.iter().zip(&scores) {
        assert!(side["meta"].as_str().unwrap().contains(&format!("score {score:.3}")), "{side} vs {score}");
    }
    let better = if scores[0] >= scores[1] { 0 } else { 1 };
    assert_eq!(sides[better]["best"], true, "{sides:?}");
    println!("side by side: {sides:?}");
}

/// `scripts/serve/openai_check.py` runs the `openai` package through
/// every endpoint and option, unchanged, against the server.
#[test]
fn the_openai_python_client_works_unchanged() {
    let python = std::env::var("RLOO_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_openai = Command::new(&python).args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
    if !has_openai {
        return missing(&format!(
            "the openai client test needs Python with the openai package ({python}; \
             pip install -r scripts/serve/requirements.txt, or set RLOO_TEST_PYTHON)"
        ));
    }
    let server = serve(&[("chat", "qwen3-causal"), ("text", "gpt_neox-causal")]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/serve/openai_check.py");
    let out = Command::new(&python).arg(script).arg(format!("{}/v1", server.url)).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.ends_with("the openai client works unchanged\n"), "{stdout}");
}
