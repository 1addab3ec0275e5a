//! Dataset rows from every file format users bring, read lazily: JSON Lines
//! and JSON (plain, gzip or zstd), CSV and TSV, Parquet and Arrow IPC. The
//! format comes from the file name; a row is a JSON object whatever the
//! format, so that everything after reading is format-blind.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value};

use crate::error::{Error, Result, RowPlace};

/// One dataset row: its fields, and where it came from for error messages.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub file: Arc<Path>,
    pub at: RowPlace,
    pub fields: Map<String, Value>,
}

impl Row {
    pub fn new(file: Arc<Path>, at: RowPlace, fields: Map<String, Value>) -> Row {
        Row { file, at, fields }
    }

    /// An error about this row, naming its file and place.
    pub fn error(&self, msg: impl Into<String>) -> Error {
        Error::BadRow { path: self.file.to_path_buf(), at: self.at, msg: msg.into() }
    }

    /// `file:3` or `file: row 3`, for messages that are not errors.
    pub fn location(&self) -> String {
        format!("{}{}", self.file.display(), self.at)
    }

    /// The value of `column`; when the row lacks it, a message naming it and
    /// the columns the row has.
    pub fn column(&self, column: &str) -> std::result::Result<&Value, String> {
        self.fields.get(column).ok_or_else(|| format!("no column `{column}` (columns: {})", self.column_names()))
    }

    /// The row's column names, comma-separated.
    pub fn column_names(&self) -> String {
        self.fields.keys().map(String::as_str).collect::<Vec<_>>().join(", ")
    }
}

/// A lazy stream of rows; reading stops where the consumer stops.
pub type RowIter = Box<dyn Iterator<Item = Result<Row>> + Send>;

/// How a file's rows are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// JSON Lines, or a JSON array (or `{"data": [...]}`) in a `.json` file.
    Json {
        array_allowed: bool,
    },
    /// Delimited text with a header row.
    Csv {
        delimiter: u8,
    },
    Parquet,
    /// Arrow IPC, file or stream form (the `datasets` library writes streams).
    Arrow,
}

/// A byte-level compression around a text format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// The suffixes [`format_of`] knows, for messages and directory scans.
pub const DATA_SUFFIXES: &str = ".jsonl, .ndjson, .json, .csv, .tsv (each optionally .gz or .zst), .parquet, .arrow";

/// The format of a file from its name, `None` when the name is not a
/// dataset file's.
pub fn format_of(name: &str) -> Option<(Format, Compression)> {
    let lower = name.to_ascii_lowercase();
    let (rest, compression) = if let Some(rest) = lower.strip_suffix(".gz") {
        (rest, Compression::Gzip)
    } else if let Some(rest) = lower.strip_suffix(".zst").or_else(|| lower.strip_suffix(".zstd")) {
        (rest, Compression::Zstd)
    } else {
        (lower.as_str(), Compression::None)
    };
    let ext = rest.rsplit_once('.')?.1;
    let format = match ext {
        "jsonl" | "ndjson" => Format::Json { array_allowed: false },
        "json" => Format::Json { array_allowed: true },
        "csv" => Format::Csv { delimiter: b',' },
        "tsv" => Format::Csv { delimiter: b'\t' },
        "parquet" | "pq" if compression == Compression::None => Format::Parquet,
        "arrow" | "ipc" | "feather" if compression == Compression::None => Format::Arrow,
        _ => return None,
    };
    Some((format, compression))
}

/// The rows of one file, read lazily.
pub fn open_file(path: &Path) -> Result<RowIter> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let Some((format, compression)) = format_of(&name) else {
        return Err(Error::bad_file(path, format!("not a dataset file by its name: expected {DATA_SUFFIXES}")));
    };
    let file: Arc<Path> = Arc::from(path);
    match format {
        Format::Json { array_allowed } => super::jsonl::json_rows(file, text_reader(path, compression)?, array_allowed),
        Format::Csv { delimiter } => super::csv::csv_rows(file, text_reader(path, compression)?, delimiter),
        Format::Parquet => super::table::parquet_rows(file),
        Format::Arrow => super::table::ipc_rows(file),
    }
}

/// Every row of one file.
pub fn read_rows(path: impl AsRef<Path>) -> Result<Vec<Row>> {
    open_file(path.as_ref())?.collect()
}

/// A buffered reader of a text file's bytes, decompressed.
fn text_reader(path: &Path, compression: Compression) -> Result<Box<dyn BufRead + Send>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    Ok(match compression {
        Compression::None => Box::new(BufReader::with_capacity(1 << 16, file)),
        // Multi-member: `cat a.gz b.gz` and pigz output are one stream.
        Compression::Gzip => Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(BufReader::new(file)))),
        Compression::Zstd => {
            let decoder = zstd::stream::read::Decoder::new(file).map_err(|e| Error::io(path, e))?;
            Box::new(BufReader::new(decoder))
        }
    })
}

/// Reads all of `reader` to a string, naming `path` in errors (a corrupt
/// compressed stream surfaces here).
pub(crate) fn read_all(path: &Path, mut reader: impl Read) -> Result<String> {
    let mut text = String::new();
    reader.read_to_string(&mut text).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => Error::bad_file(path, format!("not valid UTF-8 text: {e}")),
        _ => Error::io(path, e),
    })?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_come_from_the_name() {
        let j = Some((Format::Json { array_allowed: false }, Compression::None));
        assert_eq!(format_of("a.jsonl"), j);
        assert_eq!(format_of("A.JSONL"), j);
        assert_eq!(format_of("t.json.gz"), Some((Format::Json { array_allowed: true }, Compression::Gzip)));
        assert_eq!(format_of("t.jsonl.zst"), Some((Format::Json { array_allowed: false }, Compression::Zstd)));
        assert_eq!(format_of("t.tsv"), Some((Format::Csv { delimiter: b'\t' }, Compression::None)));
        assert_eq!(format_of("train-00000-of-00002.parquet"), Some((Format::Parquet, Compression::None)));
        assert_eq!(format_of("data-00000-of-00001.arrow"), Some((Format::Arrow, Compression::None)));
        for not_data in ["README.md", "x.parquet.gz", "noext", "a.txt"] {
            assert_eq!(format_of(not_data), None, "{not_data}");
        }
    }

    #[test]
    fn an_unknown_suffix_is_an_error_listing_the_known_ones() {
        let err = open_file(Path::new("/x/prompts.txt")).err().unwrap().to_string();
        assert!(err.starts_with("/x/prompts.txt: not a dataset file by its name: expected .jsonl"), "{err}");
    }
}
