//! Trimming JSONL logs when a run resumes from a checkpoint.
//!
//! Rows written after the last checkpoint will be written again by the
//! resumed run; dropping them first keeps each step in the log once.

use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::io::write_atomic;

/// Rewrites the JSONL file at `path` (atomically) keeping only the lines
/// whose `step` is below `next_step`.
///
/// A line that does not parse as an object with an integer `step` is
/// dropped too: the usual one is the last line cut off by the crash that
/// the run is resuming from. A missing file is left missing.
pub fn drop_rows_from_step(path: &Path, next_step: u64) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(path, e)),
    };
    let mut kept = String::with_capacity(text.len());
    for line in text.lines() {
        if step_of(line).is_some_and(|step| step < next_step) {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    if kept == text {
        return Ok(());
    }
    write_atomic(path, kept.as_bytes())
}

fn step_of(line: &str) -> Option<u64> {
    match serde_json::from_str::<Value>(line).ok()? {
        Value::Object(fields) => fields.get("step")?.as_u64(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_earlier_steps_and_drops_later_and_cut_off_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        let text = "{\"step\":1,\"a\":1}\n{\"step\":1,\"a\":2}\n{\"step\":2}\n{\"step\":3}\n{\"step\":4,\"a";
        std::fs::write(&path, text).unwrap();
        drop_rows_from_step(&path, 3).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"step\":1,\"a\":1}\n{\"step\":1,\"a\":2}\n{\"step\":2}\n"
        );
    }

    #[test]
    fn a_missing_file_stays_missing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.jsonl");
        drop_rows_from_step(&path, 3).unwrap();
        assert!(!path.exists());
    }
}
