//! Dataset rows from JSON Lines (one object per line) or a JSON document
//! holding an array of objects (or `{"data": [...]}`), and a JSONL writer
//! for outputs (samples, metrics) that keeps every finished row if the run
//! is interrupted.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, Cursor, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

use super::rows::{read_all, Row, RowIter};
use crate::data::prompt::describe_json;
use crate::error::{Error, Result, RowPlace};

/// The rows of a JSON or JSON Lines stream.
///
/// Where `array_allowed` (a `.json` file), content starting with `[` is
/// read as an array of objects and `{"data": [...]}` as that array, as the
/// Hugging Face `datasets` json loader reads them; anything else is JSON
/// Lines, streamed line by line with blank lines skipped. A line or element
/// that is not a JSON object is an error naming the file and the line (or
/// row).
pub fn json_rows(file: Arc<Path>, mut reader: Box<dyn BufRead + Send>, array_allowed: bool) -> Result<RowIter> {
    let (head, first) = first_byte(&mut reader).map_err(|e| Error::io(&file, e))?;
    let reader: Box<dyn BufRead + Send> = Box::new(Cursor::new(head).chain(reader));
    if array_allowed && matches!(first, Some(b'[') | Some(b'{')) {
        let text = read_all(&file, reader)?;
        if let Some(items) = document_rows(&file, &text, first == Some(b'['))? {
            return Ok(Box::new(items.into_iter()));
        }
        return Ok(Box::new(lines(file, Box::new(Cursor::new(text.into_bytes())))));
    }
    Ok(Box::new(lines(file, reader)))
}

/// The bytes up to and including the first one that is not whitespace or a
/// UTF-8 byte order mark, and that byte.
fn first_byte(reader: &mut dyn BufRead) -> std::io::Result<(Vec<u8>, Option<u8>)> {
    let mut head = Vec::new();
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok((head, None));
        }
        let skip = |b: u8| b.is_ascii_whitespace() || matches!(b, 0xEF | 0xBB | 0xBF);
        match buf.iter().position(|&b| !skip(b)) {
            Some(i) => {
                let first = buf[i];
                head.extend_from_slice(&buf[..=i]);
                reader.consume(i + 1);
                return Ok((head, Some(first)));
            }
            None => {
                let n = buf.len();
                head.extend_from_slice(buf);
                reader.consume(n);
            }
        }
    }
}

/// A whole-document array (or `{"data": [...]}`) as rows; `None` when the
/// text is not one such document (JSON Lines in a `.json` file).
fn document_rows(file: &Arc<Path>, text: &str, is_array: bool) -> Result<Option<Vec<Result<Row>>>> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let items = match serde_json::from_str::<Value>(text) {
        Ok(Value::Array(items)) => items,
        Ok(Value::Object(mut map)) if map.len() == 1 && map.get("data").is_some_and(Value::is_array) => {
            match map.remove("data") {
                Some(Value::Array(items)) => items,
                _ => unreachable!("checked above"),
            }
        }
        Ok(_) => return Ok(None),
        Err(e) if is_array => return Err(Error::bad_file(file, format!("invalid JSON: {e}"))),
        Err(_) => return Ok(None),
    };
    Ok(Some(
        items
            .into_iter()
            .enumerate()
            .map(|(i, item)| {
                let at = RowPlace::Record { row: i + 1, group: None };
                match item {
                    Value::Object(fields) => Ok(Row::new(file.clone(), at, fields)),
                    other => Err(Error::BadRow {
                        path: file.to_path_buf(),
                        at,
                        msg: format!("expected a JSON object, got {}", describe_json(&other)),
                    }),
                }
            })
            .collect(),
    ))
}

/// JSON Lines rows, read as the consumer asks for them.
fn lines(file: Arc<Path>, reader: Box<dyn BufRead + Send>) -> impl Iterator<Item = Result<Row>> + Send {
    reader.lines().enumerate().filter_map(move |(i, line)| {
        let line_no = i + 1;
        let line = match line {
            Ok(line) => line,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                return Some(Err(Error::bad_row(&file, line_no, "not valid UTF-8")))
            }
            Err(e) => return Some(Err(Error::io(&file, e))),
        };
        let text = if line_no == 1 { line.strip_prefix('\u{feff}').unwrap_or(&line) } else { &line };
        let text = text.trim();
        if text.is_empty() {
            return None;
        }
        Some(match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(fields)) => Ok(Row::new(file.clone(), RowPlace::Line(line_no), fields)),
            Ok(other) => {
                Err(Error::bad_row(&file, line_no, format!("expected a JSON object, got {}", describe_json(&other))))
            }
            Err(e) => Err(Error::bad_row(&file, line_no, format!("invalid JSON: {e}"))),
        })
    })
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
    use crate::data::rows::read_rows;
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
        assert_eq!(rows[0].at, RowPlace::Line(1));
        assert_eq!(rows[0].fields["a"], json!(1));
        assert_eq!(rows[1].at, RowPlace::Line(4));
        assert_eq!(rows[1].fields["b"], json!("x"));
    }

    #[test]
    fn a_line_that_is_not_an_object_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "d.jsonl", "{\"a\": 1}\n[1, 2]\n");
        let err = read_rows(&path).unwrap_err();
        assert!(matches!(err, Error::BadRow { at: RowPlace::Line(2), .. }));
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
        assert_eq!(rows[1].at, RowPlace::Record { row: 2, group: None });
        assert_eq!(rows[1].fields["a"], json!(2));
    }

    #[test]
    fn json_array_element_that_is_not_an_object_says_row() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "d.json", "[{\"a\": 1}, \"oops\"]");
        let err = read_rows(&path).unwrap_err().to_string();
        assert_eq!(err, format!("{}: row 2: expected a JSON object, got a string (\"oops\")", path.display()));
    }

    #[test]
    fn a_data_object_holds_the_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "d.json", "{\"data\": [{\"a\": 1}, {\"a\": 2}]}");
        assert_eq!(read_rows(&path).unwrap()[1].fields["a"], json!(2));
        // One object with other keys is a one-row JSON Lines file.
        let path = write(dir.path(), "e.json", "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}]}");
        assert_eq!(read_rows(&path).unwrap().len(), 1);
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
