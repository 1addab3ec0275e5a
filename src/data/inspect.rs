//! `rloo data inspect`: what a dataset holds before training on it: its
//! files and splits, the columns and their types, the row count, the first
//! rows, and (with a tokenizer) how long its prompts are in tokens.

use std::io::Write;

use arrow_schema::DataType;
use serde_json::Value;

use super::prompt::Prompt;
use super::rows::{format_of, Format};
use super::source::{splits, DatasetSpec};
use super::table::{ipc_schema, parquet_schema};
use super::Tokenizer;
use crate::error::{Error, Result};

pub struct InspectOptions {
    pub dataset: DatasetSpec,
    /// Rows printed.
    pub rows: usize,
    /// Counts tokens of `column` (a model directory or hub id).
    pub tokenizer: Option<String>,
    /// The column measured [default: `prompt`].
    pub column: String,
}

/// Writes the report to `out`.
pub fn inspect(opts: &InspectOptions, out: &mut dyn Write) -> Result<()> {
    let spec = &opts.dataset;
    let files = spec.files()?;
    let io = |e: std::io::Error| Error::Invalid(format!("cannot write the report: {e}"));
    writeln!(out, "dataset: {}", spec.label()).map_err(io)?;
    writeln!(out, "splits: {}", splits(spec)?.join(", ")).map_err(io)?;
    writeln!(out, "files:").map_err(io)?;
    for f in &files {
        let size = std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
        writeln!(out, "  {} ({})", f.display(), human_bytes(size)).map_err(io)?;
    }

    let tokenizer =
        opts.tokenizer.as_deref().map(|m| Tokenizer::from_dir(&crate::model::hub::resolve_model(m)?)).transpose()?;
    let mut rows = spec.rows()?;
    let mut first = Vec::new();
    let mut lengths = Vec::new();
    let mut count = 0usize;
    for row in rows.by_ref() {
        let row = row?;
        count += 1;
        if let Some(tok) = &tokenizer {
            let value = row.column(&opts.column).map_err(|e| row.error(e))?;
            let prompt = Prompt::from_value(value).map_err(|e| row.error(format!("column `{}`: {e}", opts.column)))?;
            lengths.push(tok.encode_prompt(&prompt).map_err(|e| row.error(e.to_string()))?.len());
        }
        if first.len() < opts.rows.max(100) {
            first.push(row);
        }
    }

    writeln!(out, "columns:").map_err(io)?;
    for (name, kind) in schema(&files[0], &first)? {
        writeln!(out, "  {name}: {kind}").map_err(io)?;
    }
    match &spec.filter {
        Some(filter) => writeln!(out, "rows: {count} of {} pass --dataset_filter {filter:?}", rows.seen),
        None => writeln!(out, "rows: {count}"),
    }
    .map_err(io)?;
    for row in first.iter().take(opts.rows) {
        writeln!(out, "\n{}:", row.location()).map_err(io)?;
        let clipped: serde_json::Map<String, Value> = row.fields.iter().map(|(k, v)| (k.clone(), clip(v))).collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&clipped).expect("JSON")).map_err(io)?;
    }
    if !lengths.is_empty() {
        writeln!(out, "\ntokens of `{}`:", opts.column).map_err(io)?;
        histogram(&mut lengths, out).map_err(io)?;
    }
    Ok(())
}

/// Column names and types: the file's Arrow schema for columnar files,
/// else what the first rows hold.
fn schema(first_file: &std::path::Path, rows: &[super::Row]) -> Result<Vec<(String, String)>> {
    let name = first_file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let arrow = match format_of(&name).map(|(f, _)| f) {
        Some(Format::Parquet) => Some(parquet_schema(first_file)?),
        Some(Format::Arrow) => Some(ipc_schema(first_file)?),
        _ => None,
    };
    if let Some(schema) = arrow {
        return Ok(schema.fields().iter().map(|f| (f.name().clone(), arrow_type(f.data_type()))).collect());
    }
    let mut columns: Vec<(String, Vec<String>)> = Vec::new();
    for row in rows {
        for (name, value) in &row.fields {
            let kind = json_type(value);
            match columns.iter_mut().find(|(n, _)| n == name) {
                Some((_, kinds)) if !kinds.contains(&kind) => kinds.push(kind),
                Some(_) => {}
                None => columns.push((name.clone(), vec![kind])),
            }
        }
    }
    Ok(columns.into_iter().map(|(n, kinds)| (n, kinds.join(" | "))).collect())
}

fn arrow_type(t: &DataType) -> String {
    match t {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => "string".into(),
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => {
            format!("list<{}>", arrow_type(f.data_type()))
        }
        DataType::Struct(fields) => format!(
            "struct<{}>",
            fields
                .iter()
                .map(|f| format!("{}: {}", f.name(), arrow_type(f.data_type())))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        DataType::Dictionary(_, values) => format!("dictionary<{}>", arrow_type(values)),
        other => other.to_string().to_lowercase(),
    }
}

fn json_type(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(_) => "bool".into(),
        Value::Number(n) if n.is_f64() => "float".into(),
        Value::Number(_) => "int".into(),
        Value::String(_) => "string".into(),
        Value::Array(items) => format!("list<{}>", items.first().map_or("?".into(), json_type)),
        Value::Object(map) => format!(
            "struct<{}>",
            map.iter().map(|(k, v)| format!("{k}: {}", json_type(v))).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// Long strings cut to 200 characters, for printing.
fn clip(v: &Value) -> Value {
    match v {
        Value::String(s) if s.chars().count() > 200 => {
            Value::String(format!("{}... ({} characters)", s.chars().take(200).collect::<String>(), s.chars().count()))
        }
        Value::Array(items) => Value::Array(items.iter().map(clip).collect()),
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), clip(v))).collect()),
        other => other.clone(),
    }
}

fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.1} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// Percentiles and ten equal-width bins drawn as bars.
fn histogram(lengths: &mut [usize], out: &mut dyn Write) -> std::io::Result<()> {
    lengths.sort_unstable();
    let at = |q: f64| lengths[((lengths.len() - 1) as f64 * q).round() as usize];
    writeln!(out, "  min {}  median {}  p95 {}  max {}", lengths[0], at(0.5), at(0.95), at(1.0))?;
    let (lo, hi) = (lengths[0], lengths[lengths.len() - 1]);
    let width = (hi - lo).div_ceil(10).max(1);
    let mut bins = [0usize; 10];
    for &n in lengths.iter() {
        bins[((n - lo) / width).min(9)] += 1;
    }
    let most = bins.iter().copied().max().unwrap_or(1).max(1);
    for (i, &count) in bins.iter().enumerate() {
        let start = lo + i * width;
        if start > hi {
            break;
        }
        let bar = "#".repeat((count * 40).div_ceil(most));
        writeln!(out, "  {:>6}-{:<6} {:>7}  {bar}", start, start + width - 1, count)?;
    }
    Ok(())
}
