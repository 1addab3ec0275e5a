//! Event files are checked two ways: byte for byte against records that the
//! Python `tensorboard` package wrote for the same events, and by decoding
//! what the writer put on disk.

use super::*;
use crate::report::tfrecord::unframe;

/// Records written by `tensorboard.summary.writer.record_writer.RecordWriter`
/// (tensorboard 2.21) for: `Event(wall_time=1.5, file_version="brain.Event:2")`;
/// `Event(wall_time=2, step=300, summary=[objective/kl=0.25, lr=3e-6])`;
/// a text summary `"| a |"` at step 3 with the text plugin's metadata and
/// `data_class=DATA_CLASS_TENSOR`; `SessionLog(status=START)` at step 4.
const PYTHON_RECORDS: &str = "1800000000000000a37f4b2209000000000000f83f1a0d627261696e2e4576\
656e743a322a28646c2e00000000000000c5cb57fa09000000000000004010ac022a200a130a0c6f626a656374\
6976652f6b6c150000803e0a090a026c72159c5349368874c3c831000000000000009d8383e909000000000000\
004010032a240a220a0773616d706c6573420b0807120042057c2061207c4a0a0a060a04746578742002\
3fef3eac0f000000000000006d532b0909000000000000004010043a0208017601b5eb";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn records_match_those_of_the_python_writer_byte_for_byte() {
    let metrics: Metrics = [("objective/kl", 0.25), ("lr", 3e-6)].into_iter().collect();
    let mut ours = tfrecord::frame(&file_version_event(1.5).0);
    ours.extend(tfrecord::frame(&summary_event(2.0, 300, &scalar_summary(&metrics)).0));
    ours.extend(tfrecord::frame(&summary_event(2.0, 3, &text_summary("samples", "| a |")).0));
    ours.extend(tfrecord::frame(&session_start_event(2.0, 4).0));
    assert_eq!(ours, hex(PYTHON_RECORDS));
}

/// A decoded protocol buffer field value.
#[derive(Debug, Clone, PartialEq)]
enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Bytes(&'a [u8]),
    Fixed32([u8; 4]),
}

impl<'a> Field<'a> {
    fn bytes(&self) -> &'a [u8] {
        match self {
            Field::Bytes(b) => b,
            other => panic!("expected a length-delimited field, got {other:?}"),
        }
    }
    fn str(&self) -> &'a str {
        std::str::from_utf8(self.bytes()).unwrap()
    }
}

fn read_varint(bytes: &mut &[u8]) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (b, rest) = bytes.split_first().expect("varint cut off");
        *bytes = rest;
        v |= ((b & 0x7F) as u64) << shift;
        if b & 0x80 == 0 {
            return v;
        }
    }
    panic!("varint longer than 10 bytes")
}

fn decode(mut bytes: &[u8]) -> Vec<(u64, Field<'_>)> {
    let mut fields = Vec::new();
    while !bytes.is_empty() {
        let key = read_varint(&mut bytes);
        let value = match key & 7 {
            0 => Field::Varint(read_varint(&mut bytes)),
            1 => {
                let (v, rest) = bytes.split_at(8);
                bytes = rest;
                Field::Fixed64(v.try_into().unwrap())
            }
            2 => {
                let len = read_varint(&mut bytes) as usize;
                let (v, rest) = bytes.split_at(len);
                bytes = rest;
                Field::Bytes(v)
            }
            5 => {
                let (v, rest) = bytes.split_at(4);
                bytes = rest;
                Field::Fixed32(v.try_into().unwrap())
            }
            t => panic!("unexpected wire type {t}"),
        };
        fields.push((key >> 3, value));
    }
    fields
}

fn field<'a>(fields: &[(u64, Field<'a>)], number: u64) -> Field<'a> {
    let found: Vec<_> = fields.iter().filter(|(n, _)| *n == number).collect();
    assert_eq!(found.len(), 1, "field {number} in {fields:?}");
    found[0].1.clone()
}

fn wall_time_of(fields: &[(u64, Field)]) -> f64 {
    match field(fields, 1) {
        Field::Fixed64(b) => f64::from_le_bytes(b),
        other => panic!("wall_time: {other:?}"),
    }
}

#[test]
fn event_file_holds_version_then_one_scalar_event_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = TensorBoardWriter::create(dir.path()).unwrap();
    let mut m = Metrics::new();
    m.set("objective/kl", 0.125);
    m.set("loss/policy_avg", -1.5);
    w.log(1, &m).unwrap();
    m.set("objective/kl", f64::NAN);
    w.log(200, &m).unwrap();
    w.flush().unwrap();

    let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
    assert_eq!(w.path().parent().unwrap(), dir.path().join("tensorboard"));
    let parts: Vec<&str> = name.split('.').collect();
    assert_eq!(parts[..3], ["events", "out", "tfevents"]);
    assert_eq!(parts[3].len(), 10, "ten-digit unix time in {name}");
    assert_eq!(parts[parts.len() - 2], std::process::id().to_string());

    let bytes = std::fs::read(w.path()).unwrap();
    let records = unframe(&bytes).unwrap();
    assert_eq!(records.len(), 3);

    let first = decode(records[0]);
    assert!(wall_time_of(&first) > 1.5e9);
    assert_eq!(field(&first, 3).str(), "brain.Event:2");

    let mut seen = Vec::new();
    for record in &records[1..] {
        let event = decode(record);
        assert!(wall_time_of(&event) >= wall_time_of(&first));
        let Field::Varint(step) = field(&event, 2) else { panic!("step") };
        for (n, value) in decode(field(&event, 5).bytes()) {
            assert_eq!(n, 1, "Summary.value");
            let value = decode(value.bytes());
            let Field::Fixed32(v) = field(&value, 2) else { panic!("simple_value") };
            seen.push((step, field(&value, 1).str(), f32::from_le_bytes(v)));
        }
    }
    assert_eq!(seen.len(), 4);
    assert_eq!(seen[0], (1, "objective/kl", 0.125));
    assert_eq!(seen[1], (1, "loss/policy_avg", -1.5));
    assert_eq!(seen[2].0, 200);
    assert!(seen[2].2.is_nan(), "NaN is kept: TensorBoard shows it");
    assert_eq!(seen[3], (200, "loss/policy_avg", -1.5));
}

#[test]
fn text_event_carries_the_text_plugin_and_a_scalar_string_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = TensorBoardWriter::create(dir.path()).unwrap();
    w.add_text(7, "samples", "| prompt |\n|---|\n| héllo |").unwrap();
    let bytes = std::fs::read(w.path()).unwrap();
    let records = unframe(&bytes).unwrap();
    let event = decode(records[1]);
    assert_eq!(field(&event, 2), Field::Varint(7));
    let summary = decode(field(&event, 5).bytes());
    let value = decode(field(&summary, 1).bytes());
    assert_eq!(field(&value, 1).str(), "samples");
    let metadata = decode(field(&value, 9).bytes());
    let plugin = decode(field(&metadata, 1).bytes());
    assert_eq!(field(&plugin, 1).str(), "text");
    assert_eq!(field(&metadata, 4), Field::Varint(DATA_CLASS_TENSOR));
    let tensor = decode(field(&value, 8).bytes());
    assert_eq!(field(&tensor, 1), Field::Varint(DT_STRING));
    assert_eq!(field(&tensor, 2), Field::Bytes(&[]), "rank-0 shape");
    assert_eq!(field(&tensor, 8).str(), "| prompt |\n|---|\n| héllo |");
}

#[test]
fn resume_starts_a_new_file_with_a_session_start_at_the_resume_step() {
    let dir = tempfile::tempdir().unwrap();
    let first = TensorBoardWriter::create(dir.path()).unwrap();
    let resumed = TensorBoardWriter::resume(dir.path(), 42).unwrap();
    assert_ne!(first.path(), resumed.path(), "same second, same process");
    let bytes = std::fs::read(resumed.path()).unwrap();
    let records = unframe(&bytes).unwrap();
    assert_eq!(records.len(), 2);
    let event = decode(records[1]);
    assert_eq!(field(&event, 2), Field::Varint(42));
    let log = decode(field(&event, 7).bytes());
    assert_eq!(field(&log, 1), Field::Varint(SESSION_LOG_START));
}

#[test]
fn resume_drops_events_of_the_steps_to_be_redone_and_a_cut_off_record() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = TensorBoardWriter::create(dir.path()).unwrap();
    for step in 1..=5 {
        let mut m = Metrics::new();
        m.set("objective/kl", step as f64);
        first.add_scalars(step, &m).unwrap();
    }
    let old = first.path().to_path_buf();
    drop(first);
    // A crash cut the last record short.
    let mut bytes = std::fs::read(&old).unwrap();
    bytes.extend_from_slice(&tfrecord::frame(b"cut")[..10]);
    std::fs::write(&old, bytes).unwrap();

    let _resumed = TensorBoardWriter::resume(dir.path(), 4).unwrap();
    let bytes = std::fs::read(&old).unwrap();
    let records = unframe(&bytes).unwrap();
    let steps: Vec<Field> = records[1..].iter().map(|r| field(&decode(r), 2)).collect();
    assert_eq!(steps, [Field::Varint(1), Field::Varint(2), Field::Varint(3)]);
    assert_eq!(field(&decode(records[0]), 3).str(), "brain.Event:2", "the version event stays first");
}

#[test]
fn hostname_is_safe_in_a_file_name() {
    let host = hostname();
    assert!(!host.is_empty());
    assert!(host.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)));
}
