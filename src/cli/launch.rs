//! `rloo launch`: one process per device, with the variables torchrun
//! sets, so that `rloo launch --nproc_per_node 8 -- train ...` and
//! `torchrun --nproc_per_node 8 --no-python rloo train ...` start the same
//! job. It forwards Ctrl-C and SIGTERM to every rank, and when one rank
//! fails it stops the others.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

use rloo::dist::{SECRET_VAR, TIMEOUT_VAR};

/// Run an rloo command data-parallel: one process per device on this
/// machine (and the same on each of `--nnodes` machines), joined at
/// `--master_addr:--master_port`.
///
/// Batch sizes named `per_device_*` are per process, as under accelerate;
/// the job's batch is the world size times theirs. Each process reads
/// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` and
/// `RLOO_JOB_SECRET` (a random one is made for a one-machine job; give
/// every machine the same one otherwise).
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Processes on this machine, one per GPU.
    #[arg(long, default_value_t = 1)]
    nproc_per_node: usize,
    /// Machines in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This machine's place among them; rank 0 runs on node 0.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Where rank 0 listens, as the other machines reach node 0.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Its port (torchrun's default).
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Seconds the others wait for a rank that stopped answering before they stop.
    #[arg(long)]
    timeout: Option<f64>,
    /// After `--`: the rloo command every process runs (`train ...`).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Signals the launcher received, to forward.
static SIGNALS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// How long the other ranks get to stop after one failed, before they are killed.
const GRACE: Duration = Duration::from_secs(30);

pub fn run(a: LaunchArgs) -> Result<()> {
    if a.nproc_per_node == 0 || a.nnodes == 0 || a.node_rank >= a.nnodes {
        bail!("--nproc_per_node and --nnodes must be at least 1, and --node_rank below --nnodes");
    }
    let trains = matches!(
        a.command.iter().map(String::as_str).collect::<Vec<_>>()[..],
        ["train", ..] | ["sft", ..] | ["reward", "train", ..]
    );
    if !trains {
        bail!("rloo launch runs the trainers data-parallel (train, sft, reward train); got `{}`", a.command.join(" "));
    }
    let secret = match std::env::var(SECRET_VAR) {
        Ok(s) if !s.is_empty() => s,
        _ if a.nnodes > 1 => bail!(
            "a job over several machines needs {SECRET_VAR} set to the same random value on each \
             (e.g. export {SECRET_VAR}=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'))"
        ),
        _ => random_secret()?,
    };
    let world = a.nnodes * a.nproc_per_node;
    let exe = std::env::current_exe().context("finding the rloo executable")?;
    // Each process gets its share of the cores unless told otherwise, as
    // torchrun sets OMP_NUM_THREADS.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| (cores / a.nproc_per_node).max(1).to_string());
    // Safety: the handler only increments an atomic.
    unsafe {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
    eprintln!(
        "launching {} process(es) here, ranks {}..{} of {world}, joining at {}:{}",
        a.nproc_per_node,
        a.node_rank * a.nproc_per_node,
        (a.node_rank + 1) * a.nproc_per_node - 1,
        a.master_addr,
        a.master_port
    );
    let mut ranks: Vec<(usize, Child)> = Vec::new();
    for local in 0..a.nproc_per_node {
        let rank = a.node_rank * a.nproc_per_node + local;
        let mut cmd = Command::new(&exe);
        cmd.args(&a.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", a.nproc_per_node.to_string())
            .env("GROUP_RANK", a.node_rank.to_string())
            .env("MASTER_ADDR", &a.master_addr)
            .env("MASTER_PORT", a.master_port.to_string())
            .env(SECRET_VAR, &secret)
            .env("RAYON_NUM_THREADS", &threads)
            // Signals reach the ranks once, from here, not also from the terminal.
            .process_group(0);
        if let Some(t) = a.timeout {
            cmd.env(TIMEOUT_VAR, t.to_string());
        }
        match cmd.spawn() {
            Ok(child) => ranks.push((rank, child)),
            Err(e) => {
                stop_all(&mut ranks, libc::SIGKILL);
                return Err(e).context(format!("starting rank {rank}"));
            }
        }
    }
    supervise(ranks)
}

/// Waits for the ranks; forwards signals; stops them all when one fails.
fn supervise(mut ranks: Vec<(usize, Child)>) -> Result<()> {
    let mut forwarded = 0;
    let mut failure: Option<(usize, String, i32)> = None;
    let mut killing_at: Option<Instant> = None;
    let mut running = ranks.len();
    while running > 0 {
        let signals = SIGNALS.load(Ordering::SeqCst);
        if signals > forwarded {
            forwarded = signals;
            // The first signal asks the ranks to save and stop; a second stops them at once.
            stop_all(&mut ranks, libc::SIGINT);
        }
        running = 0;
        for (rank, child) in ranks.iter_mut() {
            match child.try_wait() {
                Ok(Some(status)) if !status.success() && failure.is_none() => {
                    let code = status.code().unwrap_or(128 + status.signal().unwrap_or(0));
                    let how = match (status.code(), status.signal()) {
                        (Some(c), _) => format!("exited with status {c}"),
                        (None, Some(s)) => format!("was killed by signal {s}"),
                        _ => "ended".into(),
                    };
                    failure = Some((*rank, how, code));
                }
                Ok(Some(_)) => {}
                Ok(None) => running += 1,
                Err(_) => {}
            }
        }
        if let Some((rank, how, _)) = &failure {
            if running > 0 && killing_at.is_none() {
                // Ranks already asked to stop are saving their work: a second
                // signal would end them at once.
                if forwarded == 0 {
                    eprintln!("rank {rank} {how}; stopping the other ranks");
                    stop_all(&mut ranks, libc::SIGTERM);
                }
                killing_at = Some(Instant::now() + GRACE);
            }
        }
        if killing_at.is_some_and(|at| Instant::now() > at) {
            stop_all(&mut ranks, libc::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    match failure {
        None => Ok(()),
        Some((rank, how, code)) if forwarded > 0 => {
            eprintln!("stopped by a signal (rank {rank} {how})");
            std::process::exit(code)
        }
        Some((rank, how, code)) => {
            eprintln!("error: rank {rank} {how}; its log above says why");
            std::process::exit(code)
        }
    }
}

/// Sends `signal` to every rank still running.
fn stop_all(ranks: &mut [(usize, Child)], signal: libc::c_int) {
    for (_, child) in ranks.iter_mut() {
        if let Ok(None) = child.try_wait() {
            // Safety: kill(2) on a child's pid, which stays ours until it is reaped.
            unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        }
    }
}

/// 16 random bytes from the system, in hex.
fn random_secret() -> Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom for the job's secret")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
