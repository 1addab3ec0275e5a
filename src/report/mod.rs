//! What a run reports: per-step metrics (JSONL and TensorBoard), sampled
//! completions (JSONL and a console table), and the progress bar.

pub mod chart;
pub mod metrics;
pub mod progress;
mod resume;
pub mod samples;
pub mod table;
pub mod tensorboard;
mod tfrecord;

pub use metrics::{JsonlMetrics, Metrics, MetricsSink};
pub use progress::TrainProgress;
pub use samples::{Sample, SampleWriter};
pub use table::{render_table, terminal_width, SampleTable};
pub use tensorboard::TensorBoardWriter;

/// New metrics files in `dir`: `metrics.jsonl`, and TensorBoard events
/// when asked for.
pub fn metric_sinks(dir: &std::path::Path, tensorboard: bool) -> crate::error::Result<Vec<Box<dyn MetricsSink>>> {
    let mut sinks: Vec<Box<dyn MetricsSink>> = vec![Box::new(JsonlMetrics::create(dir)?)];
    if tensorboard {
        sinks.push(Box::new(TensorBoardWriter::create(dir)?));
    }
    Ok(sinks)
}
