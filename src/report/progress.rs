//! The training progress bar: episodes (completions) done out of the total,
//! elapsed time, ETA, and the numbers one watches while RLOO runs.
//!
//! It draws on stderr and hides itself when stderr is not a terminal
//! (indicatif's default), so logs of batch jobs stay free of redraws.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

const TEMPLATE: &str = "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} episodes (eta {eta}) {msg}";

pub struct TrainProgress {
    bar: ProgressBar,
}

impl TrainProgress {
    pub fn new(total_episodes: u64) -> TrainProgress {
        Self::with_target(total_episodes, ProgressDrawTarget::stderr())
    }

    fn with_target(total_episodes: u64, target: ProgressDrawTarget) -> TrainProgress {
        let bar = ProgressBar::with_draw_target(Some(total_episodes), target);
        bar.set_style(ProgressStyle::with_template(TEMPLATE).expect("the template is valid"));
        TrainProgress { bar }
    }

    /// Sets the episodes done so far and the latest throughput (episodes
    /// per second), mean score and KL.
    pub fn update(&self, episodes: u64, eps: f64, reward: f64, kl: f64) {
        self.bar.set_position(episodes);
        self.bar.set_message(message(eps, reward, kl));
    }

    /// Whether nothing is drawn (stderr is not a terminal); the trainer then
    /// logs plain lines instead.
    pub fn is_hidden(&self) -> bool {
        self.bar.is_hidden()
    }

    /// Runs `f` (printing a sample table, say) with the bar cleared, so the
    /// two do not overwrite each other.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }

    /// Leaves the bar drawn in its final state.
    pub fn finish(&self) {
        self.bar.finish();
    }
}

fn message(eps: f64, reward: f64, kl: f64) -> String {
    format!("eps {eps:.1} reward {reward:.3} kl {kl:.4}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_sets_position_and_message() {
        let p = TrainProgress::with_target(64, ProgressDrawTarget::hidden());
        p.update(16, 12.345, 0.5, 0.01234);
        assert_eq!(p.bar.position(), 16);
        assert_eq!(p.bar.length(), Some(64));
        assert_eq!(p.bar.message(), "eps 12.3 reward 0.500 kl 0.0123");
        assert!(p.is_hidden());
    }
}
