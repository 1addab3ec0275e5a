//! Rows of CSV and TSV files: the first record names the columns, and every
//! cell is a string (as typed as the file is; the filter language and the
//! recipes compare numeric strings as numbers).

use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::rows::{Row, RowIter};
use crate::error::{Error, Result, RowPlace};

/// The rows of a delimited text stream with a header row.
pub fn csv_rows(file: Arc<Path>, reader: Box<dyn BufRead + Send>, delimiter: u8) -> Result<RowIter> {
    let mut csv = csv::ReaderBuilder::new().delimiter(delimiter).has_headers(true).from_reader(reader);
    let header: Vec<String> = csv
        .headers()
        .map_err(|e| Error::bad_file(&file, format!("cannot read the header row: {e}")))?
        .iter()
        .map(|h| h.trim_start_matches('\u{feff}').to_string())
        .collect();
    if header.iter().all(String::is_empty) {
        return Err(Error::bad_file(&file, "no header row naming the columns"));
    }
    if let Some(dup) = header.iter().enumerate().find(|(i, h)| header[..*i].contains(h)).map(|(_, h)| h) {
        return Err(Error::bad_file(&file, format!("the header names column `{dup}` twice")));
    }
    let rows = csv.into_records().map(move |record| {
        let record = record.map_err(|e| {
            let line = e.position().map_or(0, |p| p.line() as usize);
            let msg = match e.kind() {
                csv::ErrorKind::UnequalLengths { expected_len, len, .. } => {
                    format!("{len} fields where the header has {expected_len} ({})", header.join(", "))
                }
                _ => e.to_string(),
            };
            Error::bad_row(&file, line, msg)
        })?;
        let line = record.position().map_or(0, |p| p.line() as usize);
        let fields: Map<String, Value> =
            header.iter().zip(record.iter()).map(|(h, cell)| (h.clone(), Value::String(cell.to_string()))).collect();
        Ok(Row::new(file.clone(), RowPlace::Line(line), fields))
    });
    Ok(Box::new(rows))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::rows::read_rows;
    use serde_json::json;

    #[test]
    fn cells_are_strings_keyed_by_the_header_and_quoted_newlines_survive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.csv");
        std::fs::write(&path, "prompt,label\n\"Say \"\"hi\"\",\nthen stop\",1\nplain,0\n").unwrap();
        let rows = read_rows(&path).unwrap();
        assert_eq!(rows[0].fields["prompt"], json!("Say \"hi\",\nthen stop"));
        assert_eq!(rows[1].fields["label"], json!("0"));
        assert_eq!(rows[1].at, RowPlace::Line(4), "the line where the record starts");
    }

    #[test]
    fn ragged_rows_name_the_line_and_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.tsv");
        std::fs::write(&path, "a\tb\n1\t2\n3\n").unwrap();
        let err = read_rows(&path).unwrap_err().to_string();
        assert_eq!(err, format!("{}:3: 1 fields where the header has 2 (a, b)", path.display()));
    }
}
