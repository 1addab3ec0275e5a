//! Rows of columnar files: Parquet (read one batch of a row group at a
//! time, so memory stays bounded however large the file) and Arrow IPC
//! (file or stream form, as the `datasets` library saves). Each Arrow
//! column becomes JSON: strings, numbers, booleans and nulls as they are,
//! lists as arrays, structs and maps as objects, dictionaries by value,
//! dates and times as ISO text, binary as text when it is UTF-8 (else null).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::Path;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::*;
use arrow_array::{Array, RecordBatch};
use arrow_schema::{ArrowError, DataType, SchemaRef, TimeUnit};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::{Map, Number, Value};

use super::rows::{Row, RowIter};
use crate::error::{Error, Result, RowPlace};

/// Rows decoded per batch: enough to amortise decoding, few enough that a
/// batch of long texts stays small.
const BATCH_ROWS: usize = 256;

/// The rows of a Parquet file, one batch at a time.
pub fn parquet_rows(file: Arc<Path>) -> Result<RowIter> {
    let builder = parquet_builder(&file)?;
    let group_ends: Vec<usize> = builder
        .metadata()
        .row_groups()
        .iter()
        .scan(0, |end, g| {
            *end += g.num_rows() as usize;
            Some(*end)
        })
        .collect();
    let reader = builder.with_batch_size(BATCH_ROWS).build().map_err(|e| Error::bad_file(&file, e.to_string()))?;
    Ok(Box::new(BatchRows::new(file, Box::new(reader), Some(group_ends))))
}

/// The schema of a Parquet file, from its footer alone.
pub fn parquet_schema(path: &Path) -> Result<SchemaRef> {
    Ok(parquet_builder(path)?.schema().clone())
}

fn parquet_builder(path: &Path) -> Result<ParquetRecordBatchReaderBuilder<File>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| Error::bad_file(path, format!("not a readable Parquet file: {e}")))
}

/// The rows of an Arrow IPC file (`ARROW1` magic) or stream.
pub fn ipc_rows(file: Arc<Path>) -> Result<RowIter> {
    let (_, batches) = ipc_batches(&file)?;
    Ok(Box::new(BatchRows::new(file, batches, None)))
}

/// The schema of an Arrow IPC file or stream.
pub fn ipc_schema(path: &Path) -> Result<SchemaRef> {
    Ok(ipc_batches(path)?.0)
}

type Batches = Box<dyn Iterator<Item = std::result::Result<RecordBatch, ArrowError>> + Send>;

fn ipc_batches(path: &Path) -> Result<(SchemaRef, Batches)> {
    let bad = |e: ArrowError| Error::bad_file(path, format!("not a readable Arrow IPC file: {e}"));
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut magic = [0u8; 6];
    let is_file_form = file.read_exact(&mut magic).is_ok() && &magic == b"ARROW1";
    file.rewind().map_err(|e| Error::io(path, e))?;
    if is_file_form {
        let reader = arrow_ipc::reader::FileReader::try_new(file, None).map_err(bad)?;
        Ok((reader.schema(), Box::new(reader)))
    } else {
        let reader = arrow_ipc::reader::StreamReader::try_new(BufReader::new(file), None).map_err(bad)?;
        Ok((reader.schema(), Box::new(reader)))
    }
}

/// Turns record batches into rows, numbering them and (for Parquet) naming
/// the row group each one came from.
struct BatchRows {
    file: Arc<Path>,
    batches: Batches,
    pending: VecDeque<Row>,
    /// Rows handed out so far.
    next_row: usize,
    /// The row count at the end of each row group, for error places.
    group_ends: Option<Vec<usize>>,
    failed: bool,
}

impl BatchRows {
    fn new(file: Arc<Path>, batches: Batches, group_ends: Option<Vec<usize>>) -> Self {
        BatchRows { file, batches, pending: VecDeque::new(), next_row: 0, group_ends, failed: false }
    }

    /// The place of the 0-based row `index`.
    fn place(&self, index: usize) -> RowPlace {
        let group = self.group_ends.as_ref().map(|ends| ends.partition_point(|&end| end <= index));
        RowPlace::Record { row: index + 1, group }
    }

    fn decode(&mut self, batch: &RecordBatch) -> Result<()> {
        let columns = batch
            .schema()
            .fields()
            .iter()
            .zip(batch.columns())
            .map(|(field, column)| {
                column_json(column.as_ref()).map(|values| (field.name().clone(), values)).map_err(|why| {
                    let at = self.place(self.next_row + self.pending.len());
                    Error::BadRow {
                        path: self.file.to_path_buf(),
                        at,
                        msg: format!("column `{}`: {why}", field.name()),
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut columns: Vec<(String, std::vec::IntoIter<Value>)> =
            columns.into_iter().map(|(name, values)| (name, values.into_iter())).collect();
        for _ in 0..batch.num_rows() {
            let fields: Map<String, Value> =
                columns.iter_mut().map(|(name, values)| (name.clone(), values.next().unwrap_or(Value::Null))).collect();
            let at = self.place(self.next_row + self.pending.len());
            self.pending.push_back(Row::new(self.file.clone(), at, fields));
        }
        Ok(())
    }
}

impl Iterator for BatchRows {
    type Item = Result<Row>;

    fn next(&mut self) -> Option<Result<Row>> {
        while self.pending.is_empty() {
            if self.failed {
                return None;
            }
            let batch = match self.batches.next()? {
                Ok(batch) => batch,
                Err(e) => {
                    self.failed = true;
                    let at = self.place(self.next_row);
                    return Some(Err(Error::BadRow {
                        path: self.file.to_path_buf(),
                        at,
                        msg: format!("cannot decode: {e}"),
                    }));
                }
            };
            if let Err(e) = self.decode(&batch) {
                self.failed = true;
                return Some(Err(e));
            }
        }
        self.next_row += 1;
        self.pending.pop_front().map(Ok)
    }
}

fn float(x: f64) -> Value {
    Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// Every value of `array` as JSON, nulls included.
pub fn column_json(array: &dyn Array) -> std::result::Result<Vec<Value>, String> {
    let n = array.len();
    macro_rules! each {
        ($typed:expr, |$v:ident| $json:expr) => {{
            let typed = $typed;
            (0..n)
                .map(|i| {
                    let $v = typed.value(i);
                    $json
                })
                .collect()
        }};
    }
    let bytes_json = |b: &[u8]| std::str::from_utf8(b).map_or(Value::Null, |s| Value::String(s.to_string()));
    let sliced = |inner: Vec<Value>, offsets: &mut dyn Iterator<Item = (usize, usize)>| -> Vec<Value> {
        offsets.map(|(a, b)| Value::Array(inner[a..b].to_vec())).collect()
    };
    let values: Vec<Value> = match array.data_type() {
        DataType::Null => vec![Value::Null; n],
        DataType::Boolean => each!(array.as_boolean(), |v| Value::Bool(v)),
        DataType::Int8 => each!(array.as_primitive::<Int8Type>(), |v| v.into()),
        DataType::Int16 => each!(array.as_primitive::<Int16Type>(), |v| v.into()),
        DataType::Int32 => each!(array.as_primitive::<Int32Type>(), |v| v.into()),
        DataType::Int64 => each!(array.as_primitive::<Int64Type>(), |v| v.into()),
        DataType::UInt8 => each!(array.as_primitive::<UInt8Type>(), |v| v.into()),
        DataType::UInt16 => each!(array.as_primitive::<UInt16Type>(), |v| v.into()),
        DataType::UInt32 => each!(array.as_primitive::<UInt32Type>(), |v| v.into()),
        DataType::UInt64 => each!(array.as_primitive::<UInt64Type>(), |v| v.into()),
        DataType::Float16 => each!(array.as_primitive::<Float16Type>(), |v| float(v.to_f64())),
        DataType::Float32 => each!(array.as_primitive::<Float32Type>(), |v| float(v as f64)),
        DataType::Float64 => each!(array.as_primitive::<Float64Type>(), |v| float(v)),
        DataType::Utf8 => each!(array.as_string::<i32>(), |v| v.into()),
        DataType::LargeUtf8 => each!(array.as_string::<i64>(), |v| v.into()),
        DataType::Utf8View => each!(array.as_string_view(), |v| v.into()),
        DataType::Binary => each!(array.as_binary::<i32>(), |v| bytes_json(v)),
        DataType::LargeBinary => each!(array.as_binary::<i64>(), |v| bytes_json(v)),
        DataType::BinaryView => each!(array.as_binary_view(), |v| bytes_json(v)),
        DataType::FixedSizeBinary(_) => each!(array.as_fixed_size_binary(), |v| bytes_json(v)),
        DataType::Decimal128(..) => {
            let typed = array.as_primitive::<Decimal128Type>();
            (0..n).map(|i| Value::String(typed.value_as_string(i))).collect()
        }
        DataType::Date32 => {
            let typed = array.as_primitive::<Date32Type>();
            (0..n).map(|i| typed.value_as_date(i).map_or(Value::Null, |d| Value::String(d.to_string()))).collect()
        }
        DataType::Date64 => {
            let typed = array.as_primitive::<Date64Type>();
            (0..n).map(|i| typed.value_as_date(i).map_or(Value::Null, |d| Value::String(d.to_string()))).collect()
        }
        DataType::Timestamp(unit, _) => {
            let datetimes: Vec<Option<String>> = match unit {
                TimeUnit::Second => timestamps(array.as_primitive::<TimestampSecondType>()),
                TimeUnit::Millisecond => timestamps(array.as_primitive::<TimestampMillisecondType>()),
                TimeUnit::Microsecond => timestamps(array.as_primitive::<TimestampMicrosecondType>()),
                TimeUnit::Nanosecond => timestamps(array.as_primitive::<TimestampNanosecondType>()),
            };
            datetimes.into_iter().map(|d| d.map_or(Value::Null, Value::String)).collect()
        }
        DataType::List(_) => {
            let list = array.as_list::<i32>();
            let inner = column_json(list.values().as_ref())?;
            sliced(inner, &mut list.value_offsets().windows(2).map(|w| (w[0] as usize, w[1] as usize)))
        }
        DataType::LargeList(_) => {
            let list = array.as_list::<i64>();
            let inner = column_json(list.values().as_ref())?;
            sliced(inner, &mut list.value_offsets().windows(2).map(|w| (w[0] as usize, w[1] as usize)))
        }
        DataType::FixedSizeList(_, size) => {
            let list = array.as_fixed_size_list();
            let inner = column_json(list.values().as_ref())?;
            let size = *size as usize;
            sliced(inner, &mut (0..n).map(|i| (list.value_offset_at(i), list.value_offset_at(i) + size)))
        }
        DataType::Struct(fields) => {
            let parts = array.as_struct();
            let columns: Vec<Vec<Value>> =
                parts.columns().iter().map(|c| column_json(c.as_ref())).collect::<std::result::Result<_, _>>()?;
            (0..n)
                .map(|i| {
                    Value::Object(fields.iter().zip(&columns).map(|(f, c)| (f.name().clone(), c[i].clone())).collect())
                })
                .collect()
        }
        DataType::Map(..) => {
            let map = array.as_map();
            let keys = column_json(map.keys().as_ref())?;
            let values = column_json(map.values().as_ref())?;
            map.value_offsets()
                .windows(2)
                .map(|w| {
                    let (a, b) = (w[0] as usize, w[1] as usize);
                    let key = |k: &Value| match k {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    Value::Object((a..b).map(|j| (key(&keys[j]), values[j].clone())).collect())
                })
                .collect()
        }
        DataType::Dictionary(..) => {
            let dictionary = array.as_any_dictionary();
            let values = column_json(dictionary.values().as_ref())?;
            dictionary.normalized_keys().into_iter().map(|k| values.get(k).cloned().unwrap_or(Value::Null)).collect()
        }
        other => return Err(format!("Arrow type {other} is not supported")),
    };
    Ok(values.into_iter().enumerate().map(|(i, v)| if array.is_null(i) { Value::Null } else { v }).collect())
}

fn timestamps<T: ArrowTimestampType>(array: &arrow_array::PrimitiveArray<T>) -> Vec<Option<String>> {
    (0..array.len()).map(|i| array.value_as_datetime(i).map(|d| d.to_string())).collect()
}
