//! `rloo study`: a grid of trainer configurations (arms) over the same
//! data, seeds and episode budget, and one report comparing them.
//!
//! A study file is a `rloo train` configuration (the base: inline sections,
//! and/or `base = "train.toml"`) plus `seeds = [...]`, `output_dir` and
//! `[[arm]]` tables, each a `name` and the keys it overrides:
//!
//! ```toml
//! base = "train.toml"
//! seeds = [1, 2]
//! output_dir = "runs/study"
//!
//! [[arm]]
//! name = "rloo k=4"
//! rloo = { k = 4 }
//!
//! [[arm]]
//! name = "ppo"
//! train = { algo = "ppo" }
//! rloo = { k = 1 }
//! ```
//!
//! Each (arm, seed) trains in its own process (`<output_dir>/<arm>/seed-<s>/`),
//! so that its peak memory is its own; a finished one is kept, an
//! interrupted one resumes from its last checkpoint. With an `[eval]`
//! table (see [`eval`]), each finished run is then measured on held-out
//! prompts.

pub mod eval;
mod report;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use self::eval::{Measure, StudyEval};
use crate::error::{read_json, Error, Result};
use crate::io::write_atomic;
use crate::train::TrainConfig;

pub use report::{summarise, write_report, ArmSummary, StudyReport};

/// A parsed study: its arms' configurations, one per seed.
#[derive(Debug, Clone)]
pub struct Study {
    pub output_dir: PathBuf,
    pub seeds: Vec<u64>,
    pub arms: Vec<Arm>,
    /// Measures on held-out prompts, taken after each run.
    pub eval: Option<StudyEval>,
}

#[derive(Debug, Clone)]
pub struct Arm {
    pub name: String,
    /// The arm's configuration before the seed and output directory.
    pub config: toml::Table,
}

/// What one finished (arm, seed) run measured, saved as `study_run.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    pub arm: String,
    pub seed: u64,
    pub wall_seconds: f64,
    /// The training process's peak resident memory.
    pub peak_rss_mb: f64,
    /// The `[eval]` measures of the trained policy (`None`: nothing scored).
    #[serde(default)]
    pub eval: BTreeMap<String, Option<f64>>,
}

const RUN_RECORD: &str = "study_run.json";

impl Study {
    /// Reads a study file; every arm's configuration is checked before any runs.
    pub fn load(path: &Path) -> Result<Study> {
        let text = crate::error::read_to_string(path)?;
        let mut table: toml::Table =
            text.parse().map_err(|e: toml::de::Error| Error::bad_config(path, e.to_string()))?;
        let bad = |msg: String| Error::bad_config(path, msg);
        let seeds: Vec<u64> = match table.remove("seeds") {
            Some(v) => v.try_into().map_err(|e| bad(format!("seeds: {e}")))?,
            None => vec![42],
        };
        if seeds.is_empty() {
            return Err(bad("seeds is empty".into()));
        }
        let output_dir = match table.remove("output_dir") {
            Some(toml::Value::String(s)) => PathBuf::from(s),
            Some(other) => return Err(bad(format!("output_dir must be a string, got {other}"))),
            None => PathBuf::from("runs/study"),
        };
        let eval: Option<StudyEval> = match table.remove("eval") {
            Some(v) => Some(v.try_into().map_err(|e| bad(format!("[eval]: {e}")))?),
            None => None,
        };
        let arms = match table.remove("arm") {
            Some(toml::Value::Array(arms)) => arms,
            _ => return Err(bad("no [[arm]] tables: a study compares at least one arm".into())),
        };
        let mut base = match table.remove("base") {
            Some(toml::Value::String(file)) => {
                let file = path.parent().unwrap_or(Path::new(".")).join(file);
                let text = crate::error::read_to_string(&file)?;
                text.parse::<toml::Table>().map_err(|e| Error::bad_config(&file, e.to_string()))?
            }
            Some(other) => return Err(bad(format!("base must be a train configuration file, got {other}"))),
            None => toml::Table::new(),
        };
        merge(&mut base, table);
        let mut out: Vec<Arm> = Vec::new();
        let mut first_measures = None;
        for (i, arm) in arms.into_iter().enumerate() {
            let toml::Value::Table(mut arm) = arm else {
                return Err(bad(format!("arm {}: expected a table", i + 1)));
            };
            let name = match arm.remove("name") {
                Some(toml::Value::String(name)) if !name.trim().is_empty() => name,
                _ => return Err(bad(format!("arm {}: needs a name", i + 1))),
            };
            if out.iter().any(|a: &Arm| slug(&a.name) == slug(&name)) {
                return Err(bad(format!("two arms are named {name:?}")));
            }
            let mut config = base.clone();
            merge(&mut config, arm);
            let arm = Arm { name, config };
            let source = path.join(format!("arm {:?}", arm.name));
            let cfg = TrainConfig::from_table(arm.run_table(seeds[0], Path::new("check")), &source)?;
            cfg.validate().map_err(|e| bad(format!("arm {:?}: {e}", arm.name)))?;
            if let Some(eval) = &eval {
                eval.validate(&cfg).map_err(|e| bad(format!("[eval] for arm {:?}: {e}", arm.name)))?;
                let measures = eval.measures(&cfg);
                match &first_measures {
                    None => first_measures = Some(measures),
                    Some(first) if *first != measures => {
                        return Err(bad(format!(
                            "arms {:?} and {:?} have different rewards, so [eval] would measure them differently: \
                             give [[eval.reward]] tables",
                            out[0].name, arm.name
                        )))
                    }
                    Some(_) => {}
                }
            }
            out.push(arm);
        }
        Ok(Study { output_dir, seeds, arms: out, eval })
    }

    /// Where the run of `arm` with `seed` goes.
    pub fn run_dir(&self, arm: &Arm, seed: u64) -> PathBuf {
        self.output_dir.join(slug(&arm.name)).join(format!("seed-{seed}"))
    }

    /// Runs every (arm, seed) not finished yet with the `rloo` binary
    /// `exe`, arm by arm; gives the records of all.
    pub fn run(&self, exe: &Path) -> Result<Vec<RunRecord>> {
        std::fs::create_dir_all(&self.output_dir).map_err(|e| Error::io(&self.output_dir, e))?;
        let mut records = Vec::new();
        let total = self.arms.len() * self.seeds.len();
        for arm in &self.arms {
            for &seed in &self.seeds {
                let dir = self.run_dir(arm, seed);
                let record_path = dir.join(RUN_RECORD);
                let mut record = if record_path.is_file() {
                    tracing::info!("study: {} seed {seed} is done ({})", arm.name, dir.display());
                    read_json(&record_path)?
                } else {
                    tracing::info!(
                        "study: run {} of {total}: {} seed {seed} -> {}",
                        records.len() + 1,
                        arm.name,
                        dir.display()
                    );
                    let record = arm.train(exe, seed, &dir)?;
                    save_record(&record_path, &record)?;
                    record
                };
                if let Some(eval) = &self.eval {
                    let cfg = arm.config(seed, &dir)?;
                    if eval.measures(&cfg).iter().any(|m| !record.eval.contains_key(m.name())) {
                        tracing::info!("study: evaluating {} seed {seed} on {}", arm.name, eval.prompts);
                        record.eval = eval.evaluate(&cfg, &dir)?;
                        save_record(&record_path, &record)?;
                    }
                }
                records.push(record);
            }
        }
        Ok(records)
    }

    /// The `[eval]` measures (the same for every arm), or none.
    pub fn measures(&self) -> Result<Vec<Measure>> {
        match (&self.eval, self.arms.first()) {
            (Some(eval), Some(arm)) => {
                let seed = self.seeds[0];
                Ok(eval.measures(&arm.config(seed, &self.run_dir(arm, seed))?))
            }
            _ => Ok(vec![]),
        }
    }

    /// The records of the runs that finished.
    pub fn finished(&self) -> Result<Vec<RunRecord>> {
        let mut records = Vec::new();
        for arm in &self.arms {
            for &seed in &self.seeds {
                let path = self.run_dir(arm, seed).join(RUN_RECORD);
                if path.is_file() {
                    records.push(read_json(&path)?);
                }
            }
        }
        Ok(records)
    }
}

fn save_record(path: &Path, record: &RunRecord) -> Result<()> {
    let json = serde_json::to_vec_pretty(record).map_err(|e| Error::Invalid(e.to_string()))?;
    write_atomic(path, &json)
}

impl Arm {
    /// Trains with `seed` into `dir` in a child process.
    fn train(&self, exe: &Path, seed: u64, dir: &Path) -> Result<RunRecord> {
        let config_path = dir.with_extension("toml");
        let text = toml::to_string_pretty(&self.run_table(seed, dir)).map_err(|e| Error::Invalid(e.to_string()))?;
        if let Some(parent) = config_path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        write_atomic(&config_path, text.as_bytes())?;
        let started = Instant::now();
        let peak_rss_mb = run_measured(Command::new(exe).arg("train").arg(&config_path)).map_err(|e| {
            Error::Invalid(format!(
                "study arm {:?} seed {seed} ({}): {e}; run the study again to continue from its last checkpoint",
                self.name,
                dir.display()
            ))
        })?;
        Ok(RunRecord {
            arm: self.name.clone(),
            seed,
            wall_seconds: started.elapsed().as_secs_f64(),
            peak_rss_mb,
            eval: BTreeMap::new(),
        })
    }

    /// The arm's configuration for one run into `dir`.
    pub fn config(&self, seed: u64, dir: &Path) -> Result<TrainConfig> {
        TrainConfig::from_table(self.run_table(seed, dir), &dir.with_extension("toml"))
    }

    /// The arm's table for one run: its seed, output directory, and a resume
    /// of whatever an interrupted run left there.
    fn run_table(&self, seed: u64, dir: &Path) -> toml::Table {
        let mut table = self.config.clone();
        let mut train = toml::Table::new();
        train.insert("seed".into(), toml::Value::Integer(seed as i64));
        train.insert("output_dir".into(), toml::Value::String(dir.display().to_string()));
        train.insert("resume_from_checkpoint".into(), toml::Value::String("latest".into()));
        let mut run = toml::Table::new();
        run.insert("train".into(), toml::Value::Table(train));
        merge(&mut table, run);
        table
    }
}

/// Deep-merges `over` into `base`: tables merge key by key, anything else replaces.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// A directory name for an arm: letters, digits, `-`, `.` and `_`; others become `-`.
pub fn slug(name: &str) -> String {
    let s: String = name
        .trim()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_') { c } else { '-' })
        .collect();
    s.trim_matches('-').to_string()
}

/// Runs `command` to its end; gives its peak resident memory in MB, or an
/// error with its exit status.
fn run_measured(command: &mut Command) -> std::result::Result<f64, String> {
    let child = command.spawn().map_err(|e| format!("cannot start {command:?}: {e}"))?;
    let mut status: libc::c_int = 0;
    // Safety: a zeroed rusage is a valid value for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // Safety: waits for our own child, writing into the two locals.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    if pid < 0 {
        return Err(format!("cannot wait for the training process: {}", std::io::Error::last_os_error()));
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        let why = if libc::WIFEXITED(status) {
            format!("exit status {}", libc::WEXITSTATUS(status))
        } else {
            format!("signal {}", libc::WTERMSIG(status))
        };
        return Err(format!("training stopped ({why})"));
    }
    // ru_maxrss is in kilobytes on Linux.
    Ok(usage.ru_maxrss as f64 / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arms_override_the_base_key_by_key() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("study.toml");
        std::fs::write(
            &path,
            r#"
seeds = [1, 2]
output_dir = "out"
[model]
policy = "p"
[data]
path = "d.jsonl"
[rloo]
k = 2
kl_coef = 0.1
[[reward]]
type = "length"
[[arm]]
name = "rloo k=4"
rloo = { k = 4 }
[[arm]]
name = "ppo"
train = { algo = "ppo" }
rloo = { k = 1 }
"#,
        )
        .unwrap();
        let study = Study::load(&path).unwrap();
        assert_eq!(study.seeds, [1, 2]);
        let arm = &study.arms[0];
        let cfg = TrainConfig::from_table(arm.run_table(2, Path::new("x")), &path).unwrap();
        assert_eq!((cfg.rloo.k, cfg.rloo.kl_coef, cfg.train.seed), (4, 0.1, 2));
        assert_eq!(cfg.train.resume_from_checkpoint.as_deref(), Some("latest"));
        let ppo = TrainConfig::from_table(study.arms[1].run_table(1, Path::new("x")), &path).unwrap();
        assert_eq!((ppo.train.algo.as_str(), ppo.rloo.k), ("ppo", 1));
        assert_eq!(study.run_dir(arm, 2), Path::new("out/rloo-k-4/seed-2"));

        std::fs::write(&path, "[[arm]]\nname = \"a\"\nrloo = { k = 1 }\n[model]\npolicy = \"p\"\n").unwrap();
        let err = Study::load(&path).unwrap_err().to_string();
        assert!(err.contains("arm \"a\"") && err.contains("no prompts"), "{err}");
    }
}
