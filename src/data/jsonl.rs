//! Dataset rows from JSON Lines files (one object per line) or JSON files
//! holding an array of objects, and a JSONL writer for outputs (samples,
//! metrics) that keeps every finished row if the run is interrupted.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::data::prompt::describe_json;
use crate::error::{Error, Result};

/// One dataset row: its fields, and where it came from for error messages.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// 1-based line number in a JSONL file; 1-based index in a JSON array.
    pub line: usize,
    pub fields: Map<String, Value>,
}

/// Reads every row of `path`.
///
/// A `.json` file whose content starts with `[` is read as an array of
/// objects; anything else as JSON Lines, where blank lines are skipped (a
/// `.json` file may hold JSON Lines too, as the Hugging Face `datasets` json
/// loader accepts). A line or element that is not a JSON object is an error
/// naming the file and the line (or row).
pub fn read_rows(path: impl AsRef<Path>) -> Result<Vec<Row>> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut reader = BufReader::new(file);
    let is_json = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"));
    if is_json && starts_with_bracket(&mut reader).map_err(|e| Error::io(path, e))? {
        read_array(path, reader)
    } else {
        read_lines(path, reader)
    }
}

/// Whether the first non-whitespace byte (after a UTF-8 BOM) is `[`; leaves
/// the reader at the start.
fn starts_with_bracket(reader: &mut BufReader<File>) -> std::io::Result<bool> {
    let mut head = Vec::new();
    reader.by_ref().take(4096).read_to_end(&mut head)?;
    reader.seek(SeekFrom::Start(0))?;
    let head = head.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&head);
    Ok(head.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'['))
}

fn read_array(path: &Path, mut reader: BufReader<File>) -> Result<Vec<Row>> {
    let mut text = String::new();
    reader.read_to_string(&mut text).map_err(|e| Error::io(path, e))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let items: Vec<Value> =
        serde_json::from_str(text).map_err(|e| Error::bad_file(path, format!("invalid JSON: {e}")))?;
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::Object(fields) => Ok(Row { line: i + 1, fields }),
            other => Err(Error::bad_row(
                path,
                i + 1,
                format!("row {}: expected a JSON object, got {}", i + 1, describe_json(&other)),
            )),
        })
        .collect()
}

fn read_lines(path: &Path, reader: BufReader<File>) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => Error::bad_row(path, line_no, "not valid UTF-8".to_string()),
            _ => Error::io(path, e),
        })?;
        let text = if line_no == 1 { line.strip_prefix('\u{feff}').unwrap_or(&line) } else { &line };
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(fields)) => rows.push(Row { line: line_no, fields }),
            Ok(other) => {
                return Err(Error::bad_row(
                    path,
                    line_no,
                    format!("expected a JSON object, got {}", describe_json(&other)),
                ))
            }
            Err(e) => return Err(Error::bad_row(path, line_no, format!("invalid JSON: {e}"))),
        }
    }
    Ok(rows)
}

/// Writes one JSON object per line and flushes after each, so that a run
/// killed half-way leaves every row it finished (no fsync: a power cut may
/// still lose the tail).
pub struct JsonlWriter {
    path: PathBuf,
    file: File,
    /// Where [`commit`](Self::commit) moves `path` to, for a writer made by
    /// [`replacing`](Self::replacing).
    target: Option<PathBuf>,
}

impl JsonlWriter {
    /// Creates `path` (and its parent directories), truncating an old file.
    pub fn create(path: impl AsRef<Path>) -> Result<JsonlWriter> {
        let path = path.as_ref();
        make_parent(path)?;
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        Ok(JsonlWriter { path: path.to_path_buf(), file, target: None })
    }

    /// Writes to a temporary file beside `path` that [`commit`](Self::commit)
    /// renames to `path`: a file already there stays whole until the new
    /// one is complete, and a run that fails half-way leaves it untouched.
    pub fn replacing(path: impl AsRef<Path>) -> Result<JsonlWriter> {
        let target = path.as_ref().to_path_buf();
        let mut writer = Self::create(crate::io::temp_sibling(&target))?;
        writer.target = Some(target);
        Ok(writer)
    }

    /// Moves the rows of a [`replacing`](Self::replacing) writer into place.
    pub fn commit(mut self) -> Result<()> {
        let Some(target) = self.target.take() else { return Ok(()) };
        self.file.sync_all().map_err(|e| Error::io(&self.path, e))?;
        std::fs::rename(&self.path, &target).map_err(|e| Error::io(&target, e))
    }

    /// Opens `path` for appending (creating it if needed), as a resumed run
    /// does. A last line cut off by a crash is ended with a newline first, so
    /// that new rows do not merge into it.
    pub fn append(path: impl AsRef<Path>) -> Result<JsonlWriter> {
        let path = path.as_ref();
        make_parent(path)?;
        let mut file =
            OpenOptions::new().create(true).read(true).append(true).open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if len > 0 {
            let mut last = [0u8; 1];
            file.seek(SeekFrom::Start(len - 1))
                .and_then(|_| file.read_exact(&mut last))
                .map_err(|e| Error::io(path, e))?;
            if last[0] != b'\n' {
                file.write_all(b"\n").map_err(|e| Error::io(path, e))?;
            }
        }
        Ok(JsonlWriter { path: path.to_path_buf(), file, target: None })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `row`, which must serialise to a JSON object, as one line.
    pub fn write_row<T: Serialize + ?Sized>(&mut self, row: &T) -> Result<()> {
        let value =
            serde_json::to_value(row).map_err(|e| Error::bad_file(&self.path, format!("cannot serialise row: {e}")))?;
        if !value.is_object() {
            return Err(Error::bad_file(
                &self.path,
                format!("a JSONL row must be a JSON object, got {}", describe_json(&value)),
            ));
        }
        let mut line = serde_json::to_string(&value).expect("a JSON value serialises");
        line.push('\n');
        // One write call per row: an interruption loses at most this row.
        self.file.write_all(line.as_bytes()).and_then(|_| self.file.flush()).map_err(|e| Error::io(&self.path, e))
    }
}

impl Drop for JsonlWriter {
    /// An uncommitted replacement is discarded.
    fn drop(&mut self) {
        if self.target.is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn make_parent(path: &Path) -> Result<()> {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn jsonl_rows_keep_their_line_numbers_and_skip_blank_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "d.jsonl", "\u{feff}{\"a\": 1}\n\n  \r\n{\"a\": 2, \"b\": \"x\"}\r\n");
        let rows = read_rows(&path).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].line, 1);
        assert_eq!(rows[0].fields["a"], json!(1));
        assert_eq!(rows[1].line, 4);
        assert_eq!(rows[1].fields["b"], json!("x"));
    }

    #[test]
    fn a_line_that_is_not_an_object_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "d.jsonl", "{\"a\": 1}\n[1, 2]\n");
        let err = read_rows(&path).unwrap_err();
        assert!(matches!(err, Error::BadRow { line: 2, .. }));
        assert_eq!(err.to_string(), format!("{}:2: expected a JSON object, got a list of 2 items", path.display()));
    }

    #[test]
    fn invalid_json_line_reports_the_parser_message() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "d.jsonl", "{\"a\": 1}\n\n{\"a\": }\n");
        let err = read_rows(&path).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}:3: invalid JSON: ", path.display())), "{err}");
    }

    #[test]
    fn json_array_rows_are_numbered_from_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "d.json", " [{\"a\": 1}, {\"a\": 2}]");
        let rows = read_rows(&path).unwrap();
        assert_eq!(rows.iter().map(|r| r.line).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(rows[1].fields["a"], json!(2));
    }

    #[test]
    fn json_array_element_that_is_not_an_object_says_row() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "d.json", "[{\"a\": 1}, \"oops\"]");
        let err = read_rows(&path).unwrap_err().to_string();
        assert_eq!(err, format!("{}:2: row 2: expected a JSON object, got a string (\"oops\")", path.display()));
    }

    #[test]
    fn json_file_holding_json_lines_is_read_as_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "d.json", "{\"a\": 1}\n{\"a\": 2}\n");
        assert_eq!(read_rows(&path).unwrap().len(), 2);
    }

    #[test]
    fn missing_file_names_the_path() {
        let err = read_rows("/nonexistent/d.jsonl").unwrap_err().to_string();
        assert!(err.starts_with("/nonexistent/d.jsonl: "), "{err}");
    }

    #[test]
    fn writer_round_trips_rows_and_append_continues() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out/samples.jsonl");
        let mut w = JsonlWriter::create(&path).unwrap();
        w.write_row(&json!({"step": 1, "text": "a\nb"})).unwrap();
        // Visible before the writer is dropped: each row is flushed.
        assert_eq!(read_rows(&path).unwrap().len(), 1);
        drop(w);
        let mut w = JsonlWriter::append(&path).unwrap();
        w.write_row(&json!({"step": 2})).unwrap();
        let rows = read_rows(&path).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].fields["text"], json!("a\nb"));
        assert_eq!(rows[1].fields["step"], json!(2));

        let mut w = JsonlWriter::create(&path).unwrap();
        w.write_row(&json!({"step": 9})).unwrap();
        assert_eq!(read_rows(&path).unwrap().len(), 1, "create truncates");
    }

    #[test]
    fn a_replacing_writer_leaves_the_old_file_until_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "out.jsonl", "{\"old\": 1}\n");
        let mut w = JsonlWriter::replacing(&path).unwrap();
        w.write_row(&json!({"new": 1})).unwrap();
        drop(w);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"old\": 1}\n", "dropped without commit");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary left");
        let mut w = JsonlWriter::replacing(&path).unwrap();
        w.write_row(&json!({"new": 2})).unwrap();
        w.commit().unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"new\":2}\n");
    }

    #[test]
    fn append_after_a_cut_off_line_starts_a_new_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "m.jsonl", "{\"step\": 1}\n{\"step\": 2, \"lo");
        let mut w = JsonlWriter::append(&path).unwrap();
        w.write_row(&json!({"step": 3})).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with("\"lo\n{\"step\":3}\n"), "{text:?}");
    }

    #[test]
    fn writer_rejects_rows_that_are_not_objects() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = JsonlWriter::create(dir.path().join("x.jsonl")).unwrap();
        let err = w.write_row(&[1, 2]).unwrap_err().to_string();
        assert!(err.ends_with("a JSONL row must be a JSON object, got a list of 2 items"), "{err}");
    }
}
