//! Sampled completions, kept in `<dir>/samples.jsonl` so that what the
//! policy wrote at each step can be read back after the run.

use std::path::Path;

use serde_json::{Map, Value};

use crate::data::JsonlWriter;
use crate::error::{Error, Result};
use crate::report::resume::drop_rows_from_step;

/// One prompt's completion and its scores.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub prompt: String,
    pub completion: String,
    /// The score the trainer optimises (all reward sources combined).
    pub score: f64,
    /// Further named scores, such as each reward source's own.
    pub extra_scores: Vec<(String, f64)>,
}

/// Appends rows `{"step", "prompt", "completion", "score", <extra>...}`,
/// each flushed as it is written. Non-finite scores are written as `null`.
pub struct SampleWriter {
    writer: JsonlWriter,
}

/// Row keys that an extra score may not take.
const FIXED_KEYS: [&str; 4] = ["step", "prompt", "completion", "score"];

impl SampleWriter {
    pub const FILE_NAME: &'static str = "samples.jsonl";

    /// Starts a fresh `<dir>/samples.jsonl`, truncating an old one.
    pub fn create(dir: impl AsRef<Path>) -> Result<SampleWriter> {
        let writer = JsonlWriter::create(dir.as_ref().join(Self::FILE_NAME))?;
        Ok(SampleWriter { writer })
    }

    /// Continues `<dir>/samples.jsonl` for a run resumed at `next_step`,
    /// dropping the rows of steps `>= next_step` first (they will be
    /// sampled again).
    pub fn resume(dir: impl AsRef<Path>, next_step: u64) -> Result<SampleWriter> {
        let path = dir.as_ref().join(Self::FILE_NAME);
        drop_rows_from_step(&path, next_step)?;
        let writer = JsonlWriter::append(&path)?;
        Ok(SampleWriter { writer })
    }

    pub fn path(&self) -> &Path {
        self.writer.path()
    }

    /// Writes one row. An extra score named like a fixed key (`step`,
    /// `prompt`, `completion`, `score`) is an error, as it would hide it.
    pub fn write(&mut self, step: u64, sample: &Sample) -> Result<()> {
        let mut row = Map::new();
        row.insert("step".into(), Value::from(step));
        row.insert("prompt".into(), Value::from(sample.prompt.as_str()));
        row.insert("completion".into(), Value::from(sample.completion.as_str()));
        row.insert("score".into(), Value::from(sample.score));
        for (name, value) in &sample.extra_scores {
            if FIXED_KEYS.contains(&name.as_str()) {
                return Err(Error::Invalid(format!(
                    "{}: extra score `{name}` clashes with a column of every row ({})",
                    self.path().display(),
                    FIXED_KEYS.join(", ")
                )));
            }
            row.insert(name.clone(), Value::from(*value));
        }
        self.writer.write_row(&row)
    }

    /// Writes one row per sample, all at `step`.
    pub fn write_all(&mut self, step: u64, samples: &[Sample]) -> Result<()> {
        samples.iter().try_for_each(|s| self.write(step, s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::read_rows;
    use serde_json::json;

    fn sample(completion: &str, score: f64) -> Sample {
        Sample {
            prompt: "Say hi".into(),
            completion: completion.into(),
            score,
            extra_scores: vec![("rewards/length".into(), 0.5)],
        }
    }

    #[test]
    fn rows_hold_step_prompt_completion_score_and_extra_scores() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SampleWriter::create(dir.path()).unwrap();
        w.write_all(3, &[sample("hi", 1.0), sample("hey", f64::NAN)]).unwrap();
        let text = std::fs::read_to_string(w.path()).unwrap();
        assert_eq!(
            text,
            "{\"step\":3,\"prompt\":\"Say hi\",\"completion\":\"hi\",\"score\":1.0,\"rewards/length\":0.5}\n\
             {\"step\":3,\"prompt\":\"Say hi\",\"completion\":\"hey\",\"score\":null,\"rewards/length\":0.5}\n"
        );
    }

    #[test]
    fn resume_drops_rows_of_steps_to_be_redone() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SampleWriter::create(dir.path()).unwrap();
        for step in 1..=3 {
            w.write_all(step, &[sample("a", 0.0), sample("b", 0.0)]).unwrap();
        }
        let mut w = SampleWriter::resume(dir.path(), 2).unwrap();
        w.write(2, &sample("c", 0.0)).unwrap();
        let rows = read_rows(w.path()).unwrap();
        let got: Vec<_> = rows.iter().map(|r| (r.fields["step"].clone(), r.fields["completion"].clone())).collect();
        assert_eq!(got, [(json!(1), json!("a")), (json!(1), json!("b")), (json!(2), json!("c"))]);
    }

    #[test]
    fn an_extra_score_named_like_a_fixed_column_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = SampleWriter::create(dir.path()).unwrap();
        let mut s = sample("a", 0.0);
        s.extra_scores.push(("score".into(), 1.0));
        let err = w.write(1, &s).unwrap_err().to_string();
        assert!(
            err.ends_with(
                "samples.jsonl: extra score `score` clashes with a column of every row \
                 (step, prompt, completion, score)"
            ),
            "{err}"
        );
    }
}
