//! What a run reports: per-step metrics (JSONL and TensorBoard), sampled
//! completions (JSONL and a console table), and the progress bar.

pub mod metrics;
pub mod plot;
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
