//! `type = "command"`: a long-running process that scores batches over
//! JSON lines. rloo writes one request line per batch,
//! `{"samples": [{"prompt", "completion", "row"}, ...]}`, and reads one
//! answer line, `{"scores": [number or null, ...]}`. The process's stderr
//! goes to the log under the source's name. A line on stdout that no
//! request asked for (a debug print, a second answer) would put every later
//! answer against the wrong batch, so it stops the run, naming the line.
//!
//! The process is started when the source is built (so that a wrong command
//! fails before training), restarted once if it dies (the batch it died on is
//! sent again), and killed when a batch takes longer than `timeout_s` (that
//! batch fails; the next one starts a fresh process).

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::config::{one, RewardTable};
use super::remote::{
    check_failure_rate, default_max_failure_rate, read_scores, sample_json, seconds, CallStats, FailureBudget, Tally,
};
use super::{RewardSource, Sample};
use crate::error::{Error, Result};

fn default_command_timeout() -> f64 {
    300.0
}

/// `type = "command"`: a long-running process scoring over JSON lines
/// (see `reward::command`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandSpec {
    /// Metric name; default `command`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// The program and its arguments, e.g. `["python3", "score.py"]`.
    pub command: Vec<String>,
    /// Working directory of the process; default: the current one.
    pub cwd: Option<PathBuf>,
    /// Variables added to the process's environment (it inherits rloo's;
    /// keep secrets there rather than here, since this table is saved with
    /// the run).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Samples per request line; default: all the samples of a step.
    pub batch_size: Option<usize>,
    /// Seconds to wait for an answer line before the process is stopped and
    /// the batch fails.
    #[serde(default = "default_command_timeout")]
    pub timeout_s: f64,
    /// The share of a step's samples that may fail before the run stops.
    #[serde(default = "default_max_failure_rate")]
    pub max_failure_rate: f64,
}

impl RewardTable for CommandSpec {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn weight(&self) -> f32 {
        self.weight
    }

    fn build(&self, name: String, _device: &Device, _dtype: DType) -> Result<Box<dyn RewardSource>> {
        if self.batch_size == Some(0) {
            return Err(Error::Invalid("batch_size must be at least 1".into()));
        }
        check_failure_rate(self.max_failure_rate)?;
        let launch = Launch {
            argv: self.command.clone(),
            cwd: self.cwd.clone(),
            env: self.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        };
        let timeout = seconds("timeout_s", self.timeout_s)?;
        Ok(Box::new(CommandSource::start(name, launch, self.batch_size, timeout, self.max_failure_rate)?))
    }
}

/// Lines of the process's stderr kept for error messages.
const STDERR_TAIL: usize = 5;

/// How long after an answer a second line counts as written with it (a
/// second print, a debug line before the answer flushed together).
const SETTLE: Duration = Duration::from_millis(10);

/// How the process is started.
#[derive(Debug, Clone)]
pub struct Launch {
    pub argv: Vec<String>,
    pub cwd: Option<PathBuf>,
    pub env: Vec<(String, String)>,
}

impl Launch {
    /// The command line for messages, cut when long.
    fn describe(&self) -> String {
        crate::service::client::quote(&self.argv.join(" "))
    }
}

pub struct CommandSource {
    name: String,
    launch: Launch,
    batch_size: Option<usize>,
    timeout: Duration,
    budget: FailureBudget,
    state: Mutex<State>,
}

struct State {
    process: Option<Process>,
    restarts_left: u32,
}

/// A running scorer. Its stdin is written and its stdout read on threads of
/// their own, so that a process that stops reading cannot block the
/// trainer past the timeout; the answer channel closes with stdout.
struct Process {
    child: Child,
    requests: Sender<String>,
    lines: Receiver<std::io::Result<String>>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

/// Why a batch got no answer.
enum NoAnswer {
    /// The process exited or closed its pipes; the text says how.
    Died(String),
    TimedOut,
    /// A line came that no request asked for: the answers are out of step.
    Stray(String),
}

impl CommandSource {
    /// Starts the process; `batch_size` samples per request (`None`: all the
    /// samples of a call in one request).
    pub fn start(
        name: impl Into<String>,
        launch: Launch,
        batch_size: Option<usize>,
        timeout: Duration,
        max_failure_rate: f64,
    ) -> Result<CommandSource> {
        let name = name.into();
        let process = Process::start(&name, &launch)?;
        Ok(CommandSource {
            budget: FailureBudget::new(&name, &format!("command `{}`", launch.describe()), max_failure_rate),
            name,
            launch,
            batch_size,
            timeout,
            state: Mutex::new(State { process: Some(process), restarts_left: 1 }),
        })
    }

    /// One batch's scores, restarting a dead process once.
    fn score_batch(
        &self,
        state: &mut State,
        samples: &[Sample],
    ) -> Result<std::result::Result<Vec<Option<f32>>, String>> {
        let request = json!({"samples": samples.iter().map(sample_json).collect::<Vec<Value>>()}).to_string();
        loop {
            let process = match &mut state.process {
                Some(p) => p,
                None => state.process.insert(Process::start(&self.name, &self.launch)?),
            };
            match process.ask(&request, self.timeout) {
                Ok(line) => {
                    let scores = serde_json::from_str::<Value>(&line)
                        .map_err(|e| {
                            format!("the answer line is not JSON ({e}): {}", crate::service::client::quote(&line))
                        })
                        .and_then(|v| read_scores(&v, samples.len()));
                    if scores.is_err() {
                        // Its real answer may still come: the next batch
                        // starts a fresh process rather than read it.
                        state.process = None;
                    }
                    return Ok(scores);
                }
                Err(NoAnswer::Stray(line)) => {
                    state.process = None;
                    return Err(Error::RewardService(format!(
                        "reward `{}`: command `{}` wrote a line no request asked for, which would put its answers \
                         against the wrong samples (each request line gets exactly one answer line; write \
                         anything else to stderr): {}",
                        self.name,
                        self.launch.describe(),
                        crate::service::client::quote(&line)
                    )));
                }
                Err(NoAnswer::TimedOut) => {
                    state.process = None;
                    return Ok(Err(format!(
                        "no answer within {:.1} s; the process was stopped",
                        self.timeout.as_secs_f64()
                    )));
                }
                Err(NoAnswer::Died(how)) => {
                    state.process = None;
                    if state.restarts_left == 0 {
                        return Err(Error::RewardService(format!(
                            "reward `{}`: command `{}` {how}, and it was already restarted once",
                            self.name,
                            self.launch.describe()
                        )));
                    }
                    state.restarts_left -= 1;
                    tracing::warn!(
                        "reward `{}`: the command {how}; restarting it and sending the batch again",
                        self.name
                    );
                }
            }
        }
    }
}

impl RewardSource for CommandSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, samples: &[Sample]) -> Result<Vec<Option<f32>>> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut tally = Tally::new(samples.len());
        for batch in samples.chunks(self.batch_size.unwrap_or(samples.len()).max(1)) {
            let started = Instant::now();
            let answer = self.score_batch(&mut state, batch)?;
            tally.add(answer, batch.len(), started.elapsed().as_secs_f64());
        }
        drop(state);
        tally.settle(&self.budget)
    }

    fn call_stats(&self) -> Option<CallStats> {
        self.budget.take()
    }
}

impl Process {
    fn start(name: &str, launch: &Launch) -> Result<Process> {
        let (program, args) = launch
            .argv
            .split_first()
            .ok_or_else(|| Error::Invalid("command must name a program, e.g. [\"python3\", \"score.py\"]".into()))?;
        let mut command = Command::new(program);
        command
            .args(args)
            .envs(launch.env.iter().cloned())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(dir) = &launch.cwd {
            command.current_dir(dir);
        }
        let mut child = command
            .spawn()
            .map_err(|e| Error::Invalid(format!("cannot start command `{}`: {e}", launch.describe())))?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let (requests, to_write) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in to_write {
                let sent =
                    stdin.write_all(line.as_bytes()).and_then(|_| stdin.write_all(b"\n")).and_then(|_| stdin.flush());
                if sent.is_err() {
                    break;
                }
            }
        });
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let tail = Arc::clone(&stderr_tail);
        let name = name.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(std::io::Result::ok) {
                tracing::info!("[{name}] {line}");
                let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                if tail.len() == STDERR_TAIL {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        });
        Ok(Process { child, requests, lines, stderr_tail })
    }

    /// Sends one request line and waits for one answer line; a line
    /// already waiting before the request, or following the answer within
    /// [`SETTLE`], is one no request asked for.
    fn ask(&mut self, request: &str, timeout: Duration) -> std::result::Result<String, NoAnswer> {
        if let Ok(Ok(line)) = self.lines.try_recv() {
            return Err(NoAnswer::Stray(line));
        }
        if self.requests.send(request.to_string()).is_err() {
            return Err(NoAnswer::Died(self.exit_description()));
        }
        let answer = match self.lines.recv_timeout(timeout) {
            Ok(Ok(line)) => line,
            Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => return Err(NoAnswer::Died(self.exit_description())),
            Err(RecvTimeoutError::Timeout) => return Err(NoAnswer::TimedOut),
        };
        match self.lines.recv_timeout(SETTLE) {
            Ok(Ok(line)) => Err(NoAnswer::Stray(line)),
            _ => Ok(answer),
        }
    }

    /// `exited with status 3 (stderr: ...)`, waiting a moment for the exit.
    fn exit_description(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(2);
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                _ => break None,
            }
        };
        let how = match status {
            Some(s) => format!("exited ({s})"),
            None => "closed its output".to_string(),
        };
        // The stderr thread may still be reading the last lines.
        std::thread::sleep(Duration::from_millis(50));
        let tail = self.stderr_tail.lock().unwrap_or_else(|e| e.into_inner());
        match tail.back() {
            Some(last) => format!("{how}; its last stderr line: {last}"),
            None => how,
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
