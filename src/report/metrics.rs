//! Per-step metrics and the sinks that record them.
//!
//! Names follow TRL (`objective/kl`, `loss/policy_avg`, `time/generation`)
//! so that dashboards and habits carry over; the list is in section 5 of
//! the RLOO spec.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::data::JsonlWriter;
use crate::error::Result;
use crate::report::resume::drop_rows_from_step;

/// One step's metrics: names to values, kept in insertion order so that a
/// JSONL line reads in the order the trainer computed them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    values: Vec<(String, f64)>,
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::default()
    }

    /// Sets `name` to `value`; a name set twice keeps its first position and
    /// its last value.
    pub fn set(&mut self, name: impl Into<String>, value: f64) {
        let name = name.into();
        match self.values.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.values.push((name, value)),
        }
    }

    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, f64)> {
        self.values.iter().map(|(n, v)| (n.as_str(), *v))
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

impl<S: Into<String>> FromIterator<(S, f64)> for Metrics {
    fn from_iter<I: IntoIterator<Item = (S, f64)>>(iter: I) -> Metrics {
        let mut metrics = Metrics::new();
        for (name, value) in iter {
            metrics.set(name, value);
        }
        metrics
    }
}

/// Somewhere a step's metrics go (a file, TensorBoard, the console).
pub trait MetricsSink {
    fn log(&mut self, step: u64, metrics: &Metrics) -> Result<()>;
    /// Pushes buffered output to the operating system.
    fn flush(&mut self) -> Result<()>;
}

/// Several sinks fed the same metrics, so the trainer logs once.
impl MetricsSink for Vec<Box<dyn MetricsSink>> {
    fn log(&mut self, step: u64, metrics: &Metrics) -> Result<()> {
        self.iter_mut().try_for_each(|sink| sink.log(step, metrics))
    }

    fn flush(&mut self) -> Result<()> {
        self.iter_mut().try_for_each(|sink| sink.flush())
    }
}

/// `<dir>/metrics.jsonl`: one object per step, `{"step": N, "objective/kl": ...}`.
///
/// Every line is flushed as it is written, so a crash loses nothing already
/// logged. Non-finite values become `null` (JSON has no NaN).
pub struct JsonlMetrics {
    writer: JsonlWriter,
}

impl JsonlMetrics {
    pub const FILE_NAME: &'static str = "metrics.jsonl";

    /// Starts a fresh `<dir>/metrics.jsonl`, truncating an old one.
    pub fn create(dir: impl AsRef<Path>) -> Result<JsonlMetrics> {
        let writer = JsonlWriter::create(Self::path_in(dir.as_ref()))?;
        Ok(JsonlMetrics { writer })
    }

    /// Continues `<dir>/metrics.jsonl` for a run resumed at `next_step`: the
    /// lines of steps `>= next_step` were logged after the checkpoint and
    /// will be logged again, so they are dropped first.
    pub fn resume(dir: impl AsRef<Path>, next_step: u64) -> Result<JsonlMetrics> {
        let path = Self::path_in(dir.as_ref());
        drop_rows_from_step(&path, next_step)?;
        let writer = JsonlWriter::append(&path)?;
        Ok(JsonlMetrics { writer })
    }

    pub fn path(&self) -> &Path {
        self.writer.path()
    }

    fn path_in(dir: &Path) -> PathBuf {
        dir.join(Self::FILE_NAME)
    }
}

impl MetricsSink for JsonlMetrics {
    fn log(&mut self, step: u64, metrics: &Metrics) -> Result<()> {
        let mut row = Map::new();
        row.insert("step".to_string(), Value::from(step));
        for (name, value) in metrics.iter() {
            // `Value::from` maps NaN and infinities to null.
            row.insert(name.to_string(), Value::from(value));
        }
        self.writer.write_row(&row)
    }

    fn flush(&mut self) -> Result<()> {
        // Each row is flushed by `write_row` already.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(kl: f64) -> Metrics {
        [("objective/kl", kl), ("loss/policy_avg", -0.5)].into_iter().collect()
    }

    #[test]
    fn set_keeps_first_position_and_last_value() {
        let mut m = Metrics::new();
        m.set("b", 1.0);
        m.set("a", 2.0);
        m.set("b", 3.0);
        assert_eq!(m.iter().collect::<Vec<_>>(), [("b", 3.0), ("a", 2.0)]);
        assert_eq!(m.get("a"), Some(2.0));
        assert_eq!(m.get("c"), None);
    }

    #[test]
    fn jsonl_lines_hold_step_then_metrics_in_order_with_null_for_non_finite() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = JsonlMetrics::create(dir.path()).unwrap();
        sink.log(1, &metrics(0.25)).unwrap();
        sink.log(2, &metrics(f64::NAN)).unwrap();
        let mut inf = Metrics::new();
        inf.set("grad_norm", f64::INFINITY);
        sink.log(3, &inf).unwrap();
        let text = std::fs::read_to_string(sink.path()).unwrap();
        assert_eq!(
            text,
            "{\"step\":1,\"objective/kl\":0.25,\"loss/policy_avg\":-0.5}\n\
             {\"step\":2,\"objective/kl\":null,\"loss/policy_avg\":-0.5}\n\
             {\"step\":3,\"grad_norm\":null}\n"
        );
    }

    #[test]
    fn resume_drops_steps_that_will_be_logged_again() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = JsonlMetrics::create(dir.path()).unwrap();
        for step in 1..=5 {
            sink.log(step, &metrics(step as f64)).unwrap();
        }
        drop(sink);
        let mut sink = JsonlMetrics::resume(dir.path(), 4).unwrap();
        sink.log(4, &metrics(40.0)).unwrap();
        let rows = crate::data::read_rows(sink.path()).unwrap();
        let steps: Vec<_> = rows.iter().map(|r| r.fields["step"].clone()).collect();
        assert_eq!(steps, [1, 2, 3, 4]);
        assert_eq!(rows[3].fields["objective/kl"], 40.0);
    }

    #[test]
    fn resume_without_a_file_starts_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = JsonlMetrics::resume(dir.path().join("run"), 7).unwrap();
        sink.log(7, &metrics(1.0)).unwrap();
        assert_eq!(crate::data::read_rows(sink.path()).unwrap().len(), 1);
    }

    #[test]
    fn a_vec_of_sinks_logs_to_each() {
        let dir = tempfile::tempdir().unwrap();
        let a = JsonlMetrics::create(dir.path().join("a")).unwrap();
        let b = JsonlMetrics::create(dir.path().join("b")).unwrap();
        let mut sinks: Vec<Box<dyn MetricsSink>> = vec![Box::new(a), Box::new(b)];
        sinks.log(1, &metrics(0.0)).unwrap();
        sinks.flush().unwrap();
        for name in ["a", "b"] {
            let path = dir.path().join(name).join("metrics.jsonl");
            assert_eq!(crate::data::read_rows(path).unwrap().len(), 1);
        }
    }
}
