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

/// The metrics files in `dir`: `metrics.jsonl`, and TensorBoard events
/// when asked for; new ones, or a resumed run's from step `resume_at` on.
pub fn metric_sinks(
    dir: &std::path::Path,
    tensorboard: bool,
    resume_at: Option<u64>,
) -> crate::error::Result<Vec<Box<dyn MetricsSink>>> {
    let jsonl = match resume_at {
        None => JsonlMetrics::create(dir)?,
        Some(step) => JsonlMetrics::resume(dir, step)?,
    };
    let mut sinks: Vec<Box<dyn MetricsSink>> = vec![Box::new(jsonl)];
    if tensorboard {
        sinks.push(Box::new(match resume_at {
            None => TensorBoardWriter::create(dir)?,
            Some(step) => TensorBoardWriter::resume(dir, step)?,
        }));
    }
    Ok(sinks)
}
