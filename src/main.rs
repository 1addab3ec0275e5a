//! The `rloo` binary: a thin command line over the library.

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    keep_freed_memory();
    elementwise_on_calling_thread();
    on_the_worker_threads(cli::main)
}

/// Runs `f` on a worker of the thread pool (RAYON_NUM_THREADS threads,
/// else one per core) rather than beside it. Kernels called from a worker
/// share out their work in that pool, and when one thread works alone
/// between parallel regions the idle workers spin on their own cores:
/// called from outside, the calling thread would be one thread too many
/// and compete with them for the cores.
fn on_the_worker_threads(f: impl FnOnce() -> ExitCode + Send) -> ExitCode {
    // Backward passes recurse through the graph; give workers a main thread's stack.
    match rayon::ThreadPoolBuilder::new().stack_size(64 << 20).build() {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

/// Decoding and training allocate many short-lived multi-megabyte tensors.
/// glibc serves each from a fresh mmap and hands it back on free, so every
/// step faults the pages in again (a third of decoding time). Keeping
/// freed memory in the heap lets the next step reuse it.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // Safety: mallopt only tunes the allocator; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// candle runs large elementwise ops on a thread pool of its own, beside
/// rayon's, which runs the matmuls and the fused kernels. Its workers spin
/// between ops and take cores from rayon's threads: on 2 cores a training
/// step is 10% slower. Those ops stay on the calling thread unless
/// CANDLE_NUM_THREADS asks for more.
fn elementwise_on_calling_thread() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}
