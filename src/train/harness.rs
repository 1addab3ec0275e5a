//! What every trainer does around its steps: one writer on the output
//! directory, metrics sinks and the sample log (new, or continued where a
//! resumed run left off), the progress bar, named phase timings, the
//! logging and checkpoint cadence, and the errors a run stops with.

use std::path::Path;
use std::time::Instant;

use super::optim::StepGuard;
use super::run_dir::{Reuse, RunDir};
use super::stop;
use crate::error::{Error, Result};
use crate::report::{metric_sinks, Metrics, MetricsSink, SampleTable, SampleWriter, TrainProgress};

/// How a run reports.
pub struct HarnessOptions {
    /// Log every N steps (and the last).
    pub logging_steps: usize,
    /// Episodes (completions) the progress bar counts to; none: no bar.
    pub progress_total: Option<u64>,
    /// Keep `samples.jsonl`.
    pub samples: bool,
    /// Write TensorBoard event files beside `metrics.jsonl`.
    pub tensorboard: bool,
}

/// An open run: its directory, sinks, sample log and progress bar; on the
/// ranks of a data-parallel job other than the main one, none of them.
pub struct Harness {
    /// None on a rank that writes nothing.
    run_dir: Option<RunDir>,
    sinks: Vec<Box<dyn MetricsSink>>,
    samples: Option<SampleWriter>,
    progress: Option<TrainProgress>,
    logging_steps: usize,
    /// The first step this invocation runs (1-based).
    first_step: usize,
    timing: RunTiming,
}

impl Harness {
    /// Locks `output_dir` (see [`RunDir`]) and installs the Ctrl-C handler:
    /// the first thing a run does, before it reads a checkpoint there.
    pub fn lock(output_dir: &Path, reuse: Reuse) -> Result<RunDir> {
        let run_dir = RunDir::open(output_dir, reuse)?;
        stop::install();
        Ok(run_dir)
    }

    /// A rank of a data-parallel job that is not the main one: it writes
    /// and prints nothing, and stops on the same signals.
    pub fn silent(done: usize) -> Self {
        stop::install();
        Self {
            run_dir: None,
            sinks: Vec::new(),
            samples: None,
            progress: None,
            logging_steps: 1,
            first_step: done + 1,
            timing: RunTiming::default(),
        }
    }

    /// Opens the logs of the locked directory: new ones, or a resumed run's
    /// with the rows of steps after `done` dropped (they run again).
    pub fn open(run_dir: RunDir, done: usize, opts: HarnessOptions) -> Result<Self> {
        let output_dir = run_dir.path();
        let first_step = done + 1;
        let sinks = metric_sinks(output_dir, opts.tensorboard, (done > 0).then_some(first_step as u64))?;
        let samples = match (opts.samples, done) {
            (false, _) => None,
            (true, 0) => Some(SampleWriter::create(output_dir)?),
            (true, done) => Some(SampleWriter::resume(output_dir, done as u64 + 1)?),
        };
        Ok(Self {
            run_dir: Some(run_dir),
            sinks,
            samples,
            progress: opts.progress_total.map(TrainProgress::new),
            logging_steps: opts.logging_steps.max(1),
            first_step,
            timing: RunTiming::default(),
        })
    }

    /// Writes `metrics` of `step` (1-based) when logging is due, or when `force`d.
    pub fn log(&mut self, step: usize, metrics: &Metrics, force: bool) -> Result<()> {
        if force || step.is_multiple_of(self.logging_steps) {
            self.sinks.log(step as u64, metrics)?;
            self.sinks.flush()?;
        }
        Ok(())
    }

    /// Appends a step's samples to `samples.jsonl`, and prints the first
    /// `show_rows` of them as a table (none: 0).
    pub fn samples(&mut self, step: usize, table: &SampleTable, show_rows: usize) -> Result<()> {
        if let Some(writer) = &mut self.samples {
            writer.write_all(step as u64, table.samples())?;
        }
        if show_rows > 0 {
            self.print_table(&format!("step {step}"), table, show_rows);
        }
        Ok(())
    }

    /// Prints the first `rows` of `table` under `heading`.
    pub fn print_table(&self, heading: &str, table: &SampleTable, rows: usize) {
        if self.run_dir.is_none() {
            return;
        }
        let print = || eprintln!("{heading}\n{}", table.render(crate::report::table::terminal_width(), rows, 8));
        match &self.progress {
            Some(bar) => bar.suspend(print),
            None => print(),
        }
    }

    /// Moves the progress bar to `episodes`, showing the step's throughput,
    /// mean score and KL.
    pub fn progress(&self, episodes: usize, metrics: &Metrics) {
        if let Some(bar) = &self.progress {
            bar.update(
                episodes as u64,
                metrics.get("eps").unwrap_or(0.0),
                metrics.get("objective/scores").unwrap_or(f64::NAN),
                metrics.get("objective/kl").unwrap_or(f64::NAN),
            );
        }
    }

    /// Adds a step's phase times to the run's timing and to `metrics` as
    /// `time/<phase>`. The first step of an invocation pays warm-up costs,
    /// so it is kept apart.
    pub fn record_phases(&mut self, step: usize, completions: usize, phases: &Phases, metrics: &mut Metrics) {
        for (name, secs) in phases.iter() {
            metrics.set(format!("time/{name}"), secs);
        }
        let sums = if step == self.first_step { &mut self.timing.first } else { &mut self.timing.rest };
        sums.add(completions, phases);
    }

    /// Closes the progress bar; the timing of this invocation's steps.
    pub fn finish(&self) -> StepTiming {
        if let Some(bar) = &self.progress {
            bar.finish();
        }
        match self.timing.rest.steps {
            0 => self.timing.first.clone(),
            _ => StepTiming { after_first: true, ..self.timing.rest.clone() },
        }
    }
}

/// Why a run stops before its last step, once the step's work is saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopping {
    /// A signal asked to stop.
    Interrupted,
    /// Too many optimizer steps in a row were skipped.
    Diverged,
}

impl Stopping {
    /// Whether the run must stop now; `signalled`: whether a signal asked
    /// this process (or, in a data-parallel job, any of its ranks) to stop.
    pub fn now(guard: &StepGuard, signalled: bool) -> Option<Stopping> {
        if guard.exhausted() {
            Some(Stopping::Diverged)
        } else if signalled {
            Some(Stopping::Interrupted)
        } else {
            None
        }
    }

    /// The error to stop with after `step`, its work saved in `saved` ("the
    /// last good weights in <dir>"); `resume` says how to continue.
    pub fn error(self, guard: &StepGuard, step: usize, saved: &Path, resume: &str) -> Error {
        match self {
            Stopping::Diverged => Error::Invalid(format!(
                "{}; stopped at step {step} with the last good weights in {} (lower the learning rate, or check \
                 the rewards for huge or non-finite values)",
                guard.describe(),
                saved.display()
            )),
            Stopping::Interrupted => Error::Interrupted(format!(
                "stopped by a signal after step {step}; the work so far is in {}; {resume}",
                saved.display()
            )),
        }
    }
}

/// Named wall times of one step's phases, in the order they ran.
#[derive(Debug, Clone)]
pub struct Phases {
    started: Instant,
    times: Vec<(&'static str, f64)>,
}

impl Phases {
    pub fn start() -> Self {
        Phases { started: Instant::now(), times: Vec::new() }
    }

    /// Runs `f`, recording its time as `name`.
    pub fn time<R>(&mut self, name: &'static str, f: impl FnOnce() -> R) -> R {
        let t = Instant::now();
        let out = f();
        self.record(name, t.elapsed().as_secs_f64());
        out
    }

    /// Records a time measured elsewhere (on another thread, say).
    pub fn record(&mut self, name: &'static str, secs: f64) {
        self.times.push((name, secs));
    }

    /// Seconds since the step started.
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The phases, then `step`: the whole step so far.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, f64)> + '_ {
        self.times.iter().copied().chain(std::iter::once(("step", self.elapsed())))
    }
}

/// Seconds per phase summed over steps, and completions per second.
#[derive(Debug, Clone, Default)]
pub struct StepTiming {
    pub steps: usize,
    pub completions: usize,
    /// Per phase (and `step`, the whole step), in the order they ran.
    pub phases: Vec<(&'static str, f64)>,
    /// The sums leave out the invocation's first step.
    pub after_first: bool,
}

impl StepTiming {
    fn add(&mut self, completions: usize, phases: &Phases) {
        self.steps += 1;
        self.completions += completions;
        for (name, secs) in phases.iter() {
            match self.phases.iter_mut().find(|(n, _)| *n == name) {
                Some((_, sum)) => *sum += secs,
                None => self.phases.push((name, secs)),
            }
        }
    }

    /// Summed seconds of `phase`.
    pub fn get(&self, phase: &str) -> f64 {
        self.phases.iter().find(|(n, _)| *n == phase).map_or(0.0, |(_, s)| *s)
    }

    /// "per step: generation 0.130 s, ..., step 0.412 s; 77.7 completions/s".
    pub fn describe(&self) -> String {
        let n = self.steps.max(1) as f64;
        let phases: Vec<String> =
            self.phases.iter().map(|(name, secs)| format!("{} {:.3} s", name.replace('_', " "), secs / n)).collect();
        format!(
            "per step: {}; {:.1} completions/s",
            phases.join(", "),
            self.completions as f64 / self.get("step").max(1e-9)
        )
    }
}

#[derive(Debug, Clone, Default)]
struct RunTiming {
    first: StepTiming,
    rest: StepTiming,
}
