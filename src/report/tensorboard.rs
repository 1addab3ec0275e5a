//! TensorBoard event files, written without TensorFlow.
//!
//! An event file is a sequence of TFRecords (see `tfrecord.rs`), each holding
//! one `Event` protocol buffer (`tensorboard/compat/proto/event.proto`):
//! first a `file_version` event, then one event per logged step. The few
//! messages needed are encoded by hand below; field numbers are those of
//! `event.proto`, `summary.proto` and `tensor.proto`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::report::metrics::{Metrics, MetricsSink};
use crate::report::tfrecord;

/// Writes `<dir>/tensorboard/events.out.tfevents.<secs>.<host>.<pid>.<n>`,
/// the name TensorFlow's writers use (TensorBoard only reads files whose
/// name holds `tfevents`).
///
/// Each event is flushed as it is written, so a running TensorBoard shows
/// the run live and a crash loses nothing already logged.
pub struct TensorBoardWriter {
    path: PathBuf,
    file: File,
}

/// Makes file names unique within a process, as TensorFlow's `global_uid`.
static NEXT_UID: AtomicU32 = AtomicU32::new(0);

impl TensorBoardWriter {
    /// The subdirectory of the run directory that holds event files.
    pub const SUBDIR: &'static str = "tensorboard";

    /// Starts a new event file in `<dir>/tensorboard/`.
    pub fn create(dir: impl AsRef<Path>) -> Result<TensorBoardWriter> {
        let tb_dir = dir.as_ref().join(Self::SUBDIR);
        std::fs::create_dir_all(&tb_dir).map_err(|e| Error::io(&tb_dir, e))?;
        let (path, file) = create_new_event_file(&tb_dir)?;
        let mut writer = TensorBoardWriter { path, file };
        writer.write_event(&file_version_event(wall_time()))?;
        Ok(writer)
    }

    /// Starts a new event file for a run resumed at `next_step`.
    ///
    /// The old files stay; a `SessionLog START` event at `next_step` tells
    /// TensorBoard that events of steps `>= next_step` from before it are
    /// orphans of the crashed run, which it then hides (TensorFlow marks
    /// restarts the same way).
    ///
    /// Events of steps `>= next_step` in the existing files are dropped first
    /// (as `metrics.jsonl` rows are), so that readers other than TensorBoard
    /// see each step once too.
    pub fn resume(dir: impl AsRef<Path>, next_step: u64) -> Result<TensorBoardWriter> {
        drop_events_from_step(&dir.as_ref().join(Self::SUBDIR), next_step)?;
        let mut writer = Self::create(dir)?;
        writer.write_event(&session_start_event(wall_time(), next_step))?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Logs `metrics` at `step` as scalars; values are stored as `f32`, the
    /// width of TensorBoard's `simple_value`.
    pub fn add_scalars(&mut self, step: u64, metrics: &Metrics) -> Result<()> {
        self.write_event(&summary_event(wall_time(), step, &scalar_summary(metrics)))
    }

    /// Logs `markdown` at `step` under `tag` for TensorBoard's Text tab, which
    /// renders it as Markdown (tables included).
    pub fn add_text(&mut self, step: u64, tag: &str, markdown: &str) -> Result<()> {
        self.write_event(&summary_event(wall_time(), step, &text_summary(tag, markdown)))
    }

    fn write_event(&mut self, event: &Proto) -> Result<()> {
        // One write per record: an interruption cuts at most the last one,
        // which TensorBoard skips.
        self.file
            .write_all(&tfrecord::frame(&event.0))
            .and_then(|_| self.file.flush())
            .map_err(|e| Error::io(&self.path, e))
    }
}

impl MetricsSink for TensorBoardWriter {
    fn log(&mut self, step: u64, metrics: &Metrics) -> Result<()> {
        self.add_scalars(step, metrics)
    }

    fn flush(&mut self) -> Result<()> {
        self.file.flush().map_err(|e| Error::io(&self.path, e))
    }
}

/// Rewrites each event file in `tb_dir` (atomically) without the events
/// of steps `>= next_step` and without a record cut off by a crash.
fn drop_events_from_step(tb_dir: &Path, next_step: u64) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(tb_dir) else { return Ok(()) };
    for path in entries.filter_map(|e| e.ok()).map(|e| e.path()) {
        if !path.file_name().is_some_and(|n| n.to_string_lossy().contains("tfevents")) {
            continue;
        }
        let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        let (records, end) = tfrecord::intact_records(&bytes);
        let kept: Vec<&[u8]> =
            records.iter().copied().filter(|r| event_step(r).is_none_or(|s| s < next_step)).collect();
        if kept.len() == records.len() && end.is_ok() {
            continue;
        }
        let framed: Vec<u8> = kept.iter().flat_map(|r| tfrecord::frame(r)).collect();
        crate::io::write_atomic(&path, &framed)?;
    }
    Ok(())
}

/// The `step` (field 2) of an encoded `Event`; `None` when it has none
/// (the file-version event) or does not parse.
fn event_step(mut event: &[u8]) -> Option<u64> {
    fn varint(bytes: &mut &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = bytes.split_first()?;
            *bytes = rest;
            v |= ((b & 0x7f) as u64) << shift;
            if b < 0x80 {
                return Some(v);
            }
        }
        None
    }
    while !event.is_empty() {
        let key = varint(&mut event)?;
        let skip = match key & 7 {
            0 => {
                let v = varint(&mut event)?;
                if key >> 3 == 2 {
                    return Some(v);
                }
                0
            }
            1 => 8,
            2 => varint(&mut event)? as usize,
            5 => 4,
            _ => return None,
        };
        event = event.get(skip..)?;
    }
    None
}

const DT_STRING: u64 = 7;
const DATA_CLASS_TENSOR: u64 = 2;
const SESSION_LOG_START: u64 = 1;

fn file_version_event(wall_time: f64) -> Proto {
    let mut event = Proto::default();
    event.double(1, wall_time);
    event.string(3, "brain.Event:2");
    event
}

fn summary_event(wall_time: f64, step: u64, summary: &Proto) -> Proto {
    let mut event = Proto::default();
    event.double(1, wall_time);
    event.varint_field(2, step);
    event.message(5, summary);
    event
}

/// `Summary` with one `simple_value` per metric.
fn scalar_summary(metrics: &Metrics) -> Proto {
    let mut summary = Proto::default();
    for (tag, value) in metrics.iter() {
        let mut v = Proto::default();
        v.string(1, tag);
        v.float(2, value as f32);
        summary.message(1, &v);
    }
    summary
}

/// `Summary` with one string tensor tagged for the text plugin
/// (`tensorboard/plugins/text/metadata.py`), its data class stated so that
/// TensorBoard's data server need not infer it.
fn text_summary(tag: &str, markdown: &str) -> Proto {
    // A scalar string tensor: dtype, an empty (rank 0) shape, the value.
    let mut tensor = Proto::default();
    tensor.varint_field(1, DT_STRING);
    tensor.message(2, &Proto::default());
    tensor.bytes(8, markdown.as_bytes());
    let mut plugin = Proto::default();
    plugin.string(1, "text");
    let mut metadata = Proto::default();
    metadata.message(1, &plugin);
    metadata.varint_field(4, DATA_CLASS_TENSOR);
    // Fields in number order, as protobuf's own encoders write them.
    let mut value = Proto::default();
    value.string(1, tag);
    value.message(8, &tensor);
    value.message(9, &metadata);
    let mut summary = Proto::default();
    summary.message(1, &value);
    summary
}

fn session_start_event(wall_time: f64, step: u64) -> Proto {
    let mut log = Proto::default();
    log.varint_field(1, SESSION_LOG_START);
    let mut event = Proto::default();
    event.double(1, wall_time);
    event.varint_field(2, step);
    event.message(7, &log);
    event
}

/// A protocol buffer message being encoded (wire format: each field is a
/// varint key `field << 3 | wire_type`, then its value).
#[derive(Default)]
struct Proto(Vec<u8>);

impl Proto {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn key(&mut self, field: u32, wire_type: u8) {
        self.varint(((field as u64) << 3) | wire_type as u64);
    }

    /// int64, uint64 and enum fields (wire type 0).
    fn varint_field(&mut self, field: u32, v: u64) {
        self.key(field, 0);
        self.varint(v);
    }

    fn double(&mut self, field: u32, v: f64) {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    fn float(&mut self, field: u32, v: f32) {
        self.key(field, 5);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// bytes, string and embedded-message fields (wire type 2).
    fn bytes(&mut self, field: u32, bytes: &[u8]) {
        self.key(field, 2);
        self.varint(bytes.len() as u64);
        self.0.extend_from_slice(bytes);
    }

    fn string(&mut self, field: u32, s: &str) {
        self.bytes(field, s.as_bytes());
    }

    fn message(&mut self, field: u32, m: &Proto) {
        self.bytes(field, &m.0);
    }
}

fn wall_time() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Creates a file with a name no other writer has used, even one started in
/// the same second by this process.
fn create_new_event_file(dir: &Path) -> Result<(PathBuf, File)> {
    let secs = wall_time() as u64;
    let host = hostname();
    let pid = std::process::id();
    loop {
        let uid = NEXT_UID.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("events.out.tfevents.{secs:010}.{host}.{pid}.{uid}"));
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io(&path, e)),
        }
    }
}

/// The machine's name for the file name (read without a libc call), reduced
/// to characters that are safe in a file name.
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let name: String =
        raw.trim().chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')).collect();
    if name.is_empty() {
        "localhost".to_string()
    } else {
        name
    }
}

#[cfg(test)]
mod tests;
