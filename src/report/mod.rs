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

/// New metrics files in `dir`: `metrics.jsonl` and TensorBoard events.
pub fn metric_sinks(dir: &std::path::Path) -> crate::error::Result<Vec<Box<dyn MetricsSink>>> {
    Ok(vec![Box::new(JsonlMetrics::create(dir)?), Box::new(TensorBoardWriter::create(dir)?)])
}
