//! Talking to other processes over HTTP: the client that reward sources use
//! to reach scoring services and LLM judges ([`client`]), the server under
//! `rloo serve` and `rloo reward serve` ([`server`], on the HTTP/1.1 of
//! [`http`] and the request checks of [`access`]), and a bounded pool that
//! keeps a fixed number of requests in flight ([`in_parallel`]).
//!
//! One stack for every service: `ureq` (blocking, rustls) for requests, our
//! own bounded HTTP/1.1 over `httparse` for serving. Servers bind to
//! loopback unless told otherwise.

pub mod access;
pub mod client;
pub mod http;
pub mod server;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub use client::{CallError, Client, Retry};

/// Set when the client some work is for has gone: whoever does the work
/// drops what is left of it.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Runs `f` on every job with at most `workers` jobs at a time, each on its
/// own thread, and returns the results in job order. A slow job holds only
/// its own thread: the others keep taking jobs.
pub fn in_parallel<T: Sync, R: Send>(jobs: &[T], workers: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let workers = workers.clamp(1, jobs.len().max(1));
    if workers == 1 {
        return jobs.iter().map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..jobs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let r = f(job);
                results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
            });
        }
    });
    results.into_inner().unwrap_or_else(|e| e.into_inner()).into_iter().map(|r| r.expect("every job ran")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn results_come_back_in_job_order() {
        let jobs: Vec<u64> = (0..20).collect();
        let out = in_parallel(&jobs, 4, |&j| {
            std::thread::sleep(Duration::from_millis(20 - j));
            j * 10
        });
        assert_eq!(out, (0..20).map(|j| j * 10).collect::<Vec<_>>());
    }

    #[test]
    fn workers_bound_the_jobs_in_flight_and_overlap_waits() {
        let in_flight = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        let jobs = [(); 8];
        let started = Instant::now();
        in_parallel(&jobs, 4, |_| {
            let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(50));
            in_flight.fetch_sub(1, Ordering::SeqCst);
        });
        assert_eq!(most.load(Ordering::SeqCst), 4);
        // Two rounds of 50 ms, not eight.
        assert!(started.elapsed() < Duration::from_millis(300), "{:?}", started.elapsed());
    }

    #[test]
    fn no_jobs_is_no_results() {
        assert!(in_parallel(&[] as &[u8], 8, |_| 0).is_empty());
    }
}
