//! Where a batch's decoding steps spend their time on a GPU, when
//! `RLOO_DECODE_TIMING=on`: CUDA events around each step's picks and its
//! forward pass give their time on the GPU, and the time from one step's
//! picks to its forward pass starting is the host's turn (the picks read
//! back, the clients' verdicts, the next step's upload), during which the
//! GPU waits. Logged once the batch ends, as medians over its steps, with
//! what the medians leave out: the prefill, the first two steps (on a GPU
//! launched op by op, then recorded) and the steps' total.

use std::time::Instant;

use candle_core::Device;

use crate::error::{Error, Result};

/// `on` times a GPU's decoding steps; `off`, the default, does not.
pub const DECODE_TIMING_VAR: &str = "RLOO_DECODE_TIMING";

/// The points of a step that [`StepClock::mark`] records, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    PicksStart,
    PicksEnd,
    ForwardStart,
    ForwardEnd,
}

/// The events of a batch's steps, read when it ends.
pub struct StepClock {
    #[cfg(feature = "cuda")]
    stream: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    #[cfg(feature = "cuda")]
    events: Vec<(Mark, candle_core::cuda_backend::cudarc::driver::CudaEvent)>,
    /// The host's clock at each step's picks.
    started: Vec<Instant>,
    /// The prefill's time to its end on the device, and when it ended.
    prefill: Option<(f64, Instant)>,
    rows: usize,
}

/// Whether decoding steps are timed; an unknown choice is an error.
pub fn decode_timing() -> Result<bool> {
    Ok(crate::model::device::variant(DECODE_TIMING_VAR, &["off", "on"]).map_err(Error::Invalid)? == "on")
}

impl StepClock {
    /// A clock for a batch of `rows` on `device`, if asked for and a GPU.
    pub fn new(device: &Device, rows: usize) -> Result<Option<Self>> {
        let on = decode_timing()?;
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) if on => {
                let stream = dev.cuda_stream();
                Ok(Some(Self { stream, events: Vec::new(), started: Vec::new(), prefill: None, rows }))
            }
            _ => {
                let _ = (on, rows);
                Ok(None)
            }
        }
    }

    /// Notes that the batch's prefill, begun at `started`, has been
    /// queued: waits for the device to finish it (timing only), so that
    /// the prefill's time is its own and not the first step's.
    pub fn prefilled(&mut self, started: Instant) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            use candle_core::cuda_backend::WrapErr;
            self.stream.synchronize().w()?;
        }
        let now = Instant::now();
        self.prefill = Some(((now - started).as_secs_f64() * 1e3, now));
        Ok(())
    }

    /// Records `mark` where the device's queued work stands.
    pub fn mark(&mut self, mark: Mark) -> Result<()> {
        if mark == Mark::PicksStart {
            self.started.push(Instant::now());
        }
        #[cfg(feature = "cuda")]
        {
            use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
            use candle_core::cuda_backend::WrapErr;
            let event = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
            self.events.push((mark, event));
        }
        Ok(())
    }

    /// Logs the medians of the batch's steps: the picks and the forward
    /// pass on the GPU, the host's turn between them, and each step on the
    /// host's clock.
    pub fn report(&self) -> Result<()> {
        let (picks, turns, forwards) = self.stages()?;
        let walls: Vec<f64> = self.started.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3).collect();
        let ms = |x: Option<&f64>| x.map_or("-".to_string(), |x| format!("{x:.1}"));
        let (prefill, to_first) = match (self.prefill, self.started.first()) {
            (Some((spent, ended)), Some(first)) => (Some(spent), Some((*first - ended).as_secs_f64() * 1e3)),
            (prefill, _) => (prefill.map(|p| p.0), None),
        };
        tracing::info!(
            "decoding steps at {} rows, medians of {}: the picks {:.3} ms and the forward pass {:.3} ms on the GPU, \
             {:.3} ms from the picks to the forward pass (the host's turn); {:.3} ms a step on the host's clock; \
             the prefill {} ms, then {} ms to the first step; the first two steps {} and {} ms (launched, recorded); \
             {:.1} ms from the first step to the last",
            self.rows,
            self.started.len(),
            median(picks),
            median(forwards),
            median(turns),
            median(walls.clone()),
            ms(prefill.as_ref()),
            ms(to_first.as_ref()),
            ms(walls.first()),
            ms(walls.get(1)),
            walls.iter().sum::<f64>(),
        );
        Ok(())
    }

    /// Each step's picks, turn and forward pass in ms, read from its events.
    #[cfg(feature = "cuda")]
    fn stages(&self) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
        use candle_core::cuda_backend::WrapErr;
        let (mut picks, mut turns, mut forwards) = (Vec::new(), Vec::new(), Vec::new());
        for pair in self.events.windows(2) {
            let ((from, start), (_, end)) = (&pair[0], &pair[1]);
            let ms = start.elapsed_ms(end).w()? as f64;
            match from {
                Mark::PicksStart => picks.push(ms),
                Mark::PicksEnd => turns.push(ms),
                Mark::ForwardStart => forwards.push(ms),
                Mark::ForwardEnd => {}
            }
        }
        Ok((picks, turns, forwards))
    }

    #[cfg(not(feature = "cuda"))]
    fn stages(&self) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
        Ok(Default::default())
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}
