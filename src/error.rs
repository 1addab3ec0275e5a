//! The library's error type: every variant names the file, row, tensor or
//! option at fault, and what was expected.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    /// A file was read but its content is not what was expected.
    #[error("{}: {msg}", path.display())]
    BadFile { path: PathBuf, msg: String },
    /// One row of a dataset file is malformed.
    #[error("{}{at}: {msg}", path.display())]
    BadRow { path: PathBuf, at: RowPlace, msg: String },
    /// A model configuration that rloo cannot run.
    #[error("{}: {msg}", path.display())]
    BadConfig { path: PathBuf, msg: String },
    /// A weight that the architecture needs is absent or mis-shaped.
    #[error("{msg}")]
    Weights { msg: String },
    /// An option or argument is invalid.
    #[error("{0}")]
    Invalid(String),
    /// A run stopped on request (Ctrl-C, SIGTERM) after saving its work; the
    /// message says where and how to continue.
    #[error("{0}")]
    Interrupted(String),
    /// A reward source outside the trainer (a command, a service, a judge)
    /// failed beyond what a run tolerates; the message names it.
    #[error("{0}")]
    RewardService(String),
    /// A data-parallel job could not form, or one of its ranks failed; the
    /// message names the rank.
    #[error("{0}")]
    Dist(String),
    #[error(transparent)]
    Tensor(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Where a row sits in its file: a line of a text format (`path:3:`), or
/// a record of a table (`path: row 3 (row group 0):`). Rows and lines count
/// from 1, Parquet row groups from 0 as pyarrow numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowPlace {
    Line(usize),
    Record { row: usize, group: Option<usize> },
}

impl std::fmt::Display for RowPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RowPlace::Line(n) => write!(f, ":{n}"),
            RowPlace::Record { row, group: None } => write!(f, ": row {row}"),
            RowPlace::Record { row, group: Some(g) } => write!(f, ": row {row} (row group {g})"),
        }
    }
}

impl Error {
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io { path: path.as_ref().to_path_buf(), source }
    }
    pub fn bad_file(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::BadFile { path: path.as_ref().to_path_buf(), msg: msg.into() }
    }
    /// A malformed line of a text file (lines count from 1).
    pub fn bad_row(path: impl AsRef<Path>, line: usize, msg: impl Into<String>) -> Self {
        Error::BadRow { path: path.as_ref().to_path_buf(), at: RowPlace::Line(line), msg: msg.into() }
    }
    pub fn bad_config(path: impl AsRef<Path>, msg: impl Into<String>) -> Self {
        Error::BadConfig { path: path.as_ref().to_path_buf(), msg: msg.into() }
    }
}

/// Reads a whole file, naming it in the error.
pub fn read_to_string(path: impl AsRef<Path>) -> Result<String> {
    std::fs::read_to_string(path.as_ref()).map_err(|e| Error::io(path, e))
}

/// Parses a JSON file, naming it (and the serde position) in the error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: impl AsRef<Path>) -> Result<T> {
    let text = read_to_string(path.as_ref())?;
    serde_json::from_str(&text).map_err(|e| Error::bad_file(path, format!("invalid JSON: {e}")))
}
