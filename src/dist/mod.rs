//! Data parallelism over several processes, one per device: the world this
//! process belongs to (read from the launcher's environment: `rloo launch`,
//! torchrun or Slurm), the rendezvous of its ranks, and the one
//! communicator the trainers see. A world of one copies nothing.
//!
//! Every collective is called by every rank in the same order; a rank that
//! dies, hangs past the timeout or calls another collective stops the
//! others with an error naming it.

#[cfg(feature = "cuda")]
mod nccl;
mod tcp;

use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// This process's place in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct World {
    pub rank: usize,
    pub size: usize,
    /// The rank among this machine's processes (which GPU it drives).
    pub local_rank: usize,
    /// Whether this process met others at a rendezvous, so that every
    /// collective runs: a job of several, or a job of one that names its
    /// transport (`RLOO_DIST_BACKEND`) to exercise it on one device.
    pub joined: bool,
}

impl World {
    pub const SOLO: World = World { rank: 0, size: 1, local_rank: 0, joined: false };

    /// The rank that writes the run's files.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }
}

/// The collectives the trainers use. Sums run in rank order, so a run is
/// bit-identical run to run at a given world size.
pub trait Communicator: Send + Sync {
    fn world(&self) -> World;
    /// Element-wise sum over the ranks, left in `data` on every rank.
    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()>;
    /// The same for statistics kept in f64.
    fn all_reduce_sum_f64(&self, data: &mut [f64]) -> Result<()>;
    /// Every rank's bytes, in rank order, on every rank.
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// The element-wise sum of a tensor over the ranks (the gradients, in
    /// one buffer). The TCP star moves it through host memory; NCCL sums it
    /// where it lies.
    fn all_reduce_tensor(&self, t: &Tensor) -> Result<Tensor> {
        let mut values = host_f32(t)?;
        self.all_reduce_sum(&mut values)?;
        Ok(Tensor::from_vec(values, t.shape(), t.device())?.to_dtype(t.dtype())?)
    }
    /// Whether any rank says `yes` (a stop asked on one rank stops them all).
    fn any(&self, yes: bool) -> Result<bool> {
        let mut flag = [if yes { 1.0 } else { 0.0 }];
        self.all_reduce_sum_f64(&mut flag)?;
        Ok(flag[0] > 0.0)
    }
}

/// The communicator of a world of one.
pub struct Solo;

impl Communicator for Solo {
    fn world(&self) -> World {
        World::SOLO
    }

    fn all_reduce_sum(&self, _: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<()> {
        Ok(())
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![mine.to_vec()])
    }
}

/// Where the ranks meet and how they prove they belong to the job.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    pub world: World,
    /// Rank 0 listens here (`MASTER_ADDR:MASTER_PORT`).
    pub master: String,
    /// The job's secret: a connection that does not present it is refused.
    pub secret: String,
    /// How long a rank waits for the others (joining, or in a collective).
    pub timeout: Duration,
}

/// The environment variable holding the job's secret.
pub const SECRET_VAR: &str = "RLOO_JOB_SECRET";
/// Seconds a rank waits on the others before it gives up on them.
pub const TIMEOUT_VAR: &str = "RLOO_DIST_TIMEOUT";
const DEFAULT_TIMEOUT_S: f64 = 1800.0;

impl Rendezvous {
    /// The job this process was launched into, from torchrun's variables
    /// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`)
    /// or Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`); none
    /// when neither is set or the world is one process.
    pub fn from_env() -> Result<Option<Rendezvous>> {
        Self::from_vars(&|name| std::env::var(name).ok())
    }

    fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Rendezvous>> {
        let Some(world) = place(var)? else { return Ok(None) };
        let number = |name: &str| -> Result<Option<usize>> { parse(name, var(name)) };
        let rank = world.rank;
        let addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = number("MASTER_PORT")?.unwrap_or(29500);
        let secret = match (var(SECRET_VAR), var("TORCHELASTIC_RUN_ID"), var("SLURM_JOB_ID")) {
            (Some(s), _, _) if !s.is_empty() => s,
            (_, Some(id), _) | (_, None, Some(id)) if !id.is_empty() && id != "none" => {
                if rank == 0 {
                    tracing::warn!(
                        "{SECRET_VAR} is not set: the ranks prove they belong to the job with its id {id}, which \
                         others can guess; set {SECRET_VAR} to a random value shared by the ranks"
                    );
                }
                id
            }
            _ => {
                return Err(Error::Invalid(format!(
                    "{SECRET_VAR} is not set: give the ranks of the job a shared random secret (rloo launch sets one)"
                )))
            }
        };
        let timeout = match var(TIMEOUT_VAR) {
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .ok_or_else(|| Error::Invalid(format!("{TIMEOUT_VAR}={v} is not a number of seconds > 0")))?,
            None => DEFAULT_TIMEOUT_S,
        };
        let master = if addr.contains(':') && !addr.starts_with('[') { format!("[{addr}]") } else { addr };
        Ok(Some(Rendezvous {
            world,
            master: format!("{master}:{port}"),
            secret,
            timeout: Duration::from_secs_f64(timeout),
        }))
    }

    /// Meets the other ranks and gives the communicator over TCP (the CPU
    /// transport; on GPUs it also carries NCCL's unique id).
    pub fn join(&self) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(tcp::Star::join(self)?))
    }
}

/// This process's place in a job of several, from the launcher's
/// variables (torchrun's, else Slurm's); none in a world of one, unless
/// it names its transport.
fn place(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<World>> {
    let number = |name: &str| parse(name, var(name));
    let (rank, size, local_rank) = match (number("RANK")?, number("WORLD_SIZE")?) {
        (Some(rank), Some(size)) => (rank, size, number("LOCAL_RANK")?.unwrap_or(rank)),
        (None, None) => match (number("SLURM_PROCID")?, number("SLURM_NTASKS")?) {
            (Some(rank), Some(size)) => (rank, size, number("SLURM_LOCALID")?.unwrap_or(rank)),
            _ => return Ok(None),
        },
        _ => return Err(Error::Invalid("RANK and WORLD_SIZE must be set together".into())),
    };
    if size == 0 || rank >= size {
        return Err(Error::Invalid(format!("RANK={rank} is not a rank of WORLD_SIZE={size}")));
    }
    let named = backend(var)?.is_some();
    Ok((size > 1 || named).then_some(World { rank, size, local_rank, joined: true }))
}

/// The variable that picks the transport of a job's tensors.
pub const BACKEND_VAR: &str = "RLOO_DIST_BACKEND";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The TCP star alone, through host memory.
    Tcp,
    /// NCCL for tensors on GPUs (the default there), the star for the rest.
    Nccl,
}

/// The transport `RLOO_DIST_BACKEND` names, if any.
fn backend(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Backend>> {
    match var(BACKEND_VAR).as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some("tcp") => Ok(Some(Backend::Tcp)),
        Some("nccl") => Ok(Some(Backend::Nccl)),
        Some(other) => Err(Error::Invalid(format!("{BACKEND_VAR}={other}: expected tcp or nccl"))),
    }
}

fn parse(name: &str, value: Option<String>) -> Result<Option<usize>> {
    value
        .map(|v| v.trim().parse::<usize>().map_err(|_| Error::Invalid(format!("{name}={v} is not a number"))))
        .transpose()
}

/// (rank, world size) of this process in a job of several, from the
/// launcher's variables, without checking the rest of them.
pub fn rank_from_env() -> Option<(usize, usize)> {
    let world = place(&|name| std::env::var(name).ok()).ok()??;
    Some((world.rank, world.size))
}

/// The communicator of this process: its job's, or a world of one.
pub fn init() -> Result<Arc<dyn Communicator>> {
    match Rendezvous::from_env()? {
        Some(rendezvous) => rendezvous.join(),
        None => Ok(Arc::new(Solo)),
    }
}

/// The communicator for a job whose processes compute on `device`: on
/// GPUs (built with CUDA), NCCL for the tensors unless
/// `RLOO_DIST_BACKEND=tcp` asks for the TCP star alone; else `comm`.
pub fn on_device(comm: Arc<dyn Communicator>, device: &Device) -> Result<Arc<dyn Communicator>> {
    let tcp_only = backend(&|name| std::env::var(name).ok())? == Some(Backend::Tcp);
    if !comm.world().joined || !device.is_cuda() || tcp_only {
        return Ok(comm);
    }
    #[cfg(feature = "cuda")]
    return Ok(Arc::new(nccl::Nccl::join(comm, device)?));
    #[cfg(not(feature = "cuda"))]
    Ok(comm)
}

/// The device `name` (`--device`) means for a process of `world`: with
/// several processes on a machine, `cuda` is the GPU of the local rank.
pub fn device_for(name: &str, world: World) -> Result<Device> {
    match name {
        "cuda" | "gpu" if world.size > 1 => crate::model::parse_device(&format!("cuda:{}", world.local_rank)),
        name => crate::model::parse_device(name),
    }
}

/// A tensor's values as f32 in host memory, in order.
pub fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

/// Fixed-size values to and from the bytes the collectives move.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn bytes_f32(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// Checks that every rank holds the same thing (its digest in `mine`):
/// weights, data and options that differ would train different models in
/// lockstep. The error names the first rank that differs from rank 0.
pub fn check_same(comm: &dyn Communicator, what: &str, mine: &str) -> Result<()> {
    let all = comm.all_gather(mine.as_bytes())?;
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        if theirs != &all[0] {
            return Err(Error::Dist(format!(
                "rank {rank} started with other {what} than rank 0 ({} vs {}): every rank must run the same job",
                String::from_utf8_lossy(theirs),
                String::from_utf8_lossy(&all[0])
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Result<Option<Rendezvous>> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Rendezvous::from_vars(&move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn the_world_comes_from_torchruns_or_slurms_variables() {
        assert!(vars(&[]).unwrap().is_none());
        assert!(vars(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap().is_none());
        // A job of one that names its transport runs every collective.
        let one = vars(&[("RANK", "0"), ("WORLD_SIZE", "1"), (BACKEND_VAR, "tcp"), (SECRET_VAR, "s")]);
        assert_eq!(one.unwrap().unwrap().world, World { rank: 0, size: 1, local_rank: 0, joined: true });
        let err = vars(&[("RANK", "0"), ("WORLD_SIZE", "1"), (BACKEND_VAR, "gloo")]).unwrap_err().to_string();
        assert!(err.contains("RLOO_DIST_BACKEND=gloo: expected tcp or nccl"), "{err}");
        let r = vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.2"),
            ("MASTER_PORT", "1234"),
            (SECRET_VAR, "s3"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(r.world, World { rank: 3, size: 8, local_rank: 1, joined: true });
        assert_eq!((r.master.as_str(), r.secret.as_str()), ("10.0.0.2:1234", "s3"));
        let r = vars(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "1"), ("SLURM_JOB_ID", "77")])
            .unwrap()
            .unwrap();
        assert_eq!((r.world.rank, r.world.size, r.master.as_str(), r.secret.as_str()), (1, 2, "127.0.0.1:29500", "77"));
    }

    #[test]
    fn a_world_without_a_secret_or_with_a_bad_rank_is_refused() {
        let err = vars(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err().to_string();
        assert!(err.contains(SECRET_VAR), "{err}");
        let err = vars(&[("RANK", "2"), ("WORLD_SIZE", "2"), (SECRET_VAR, "x")]).unwrap_err().to_string();
        assert!(err.contains("RANK=2 is not a rank of WORLD_SIZE=2"), "{err}");
        let err = vars(&[("RANK", "0")]).unwrap_err().to_string();
        assert!(err.contains("together"), "{err}");
        let err = vars(&[("RANK", "0"), ("WORLD_SIZE", "2"), (SECRET_VAR, "x"), (TIMEOUT_VAR, "-1")])
            .unwrap_err()
            .to_string();
        assert!(err.contains(TIMEOUT_VAR), "{err}");
    }
}
