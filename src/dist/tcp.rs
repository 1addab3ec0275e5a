//! The CPU transport: every rank holds one TCP connection to rank 0, which
//! combines what the ranks send (sums in rank order, or concatenation) and
//! answers each. For the few processes of a CPU run, and the few bytes a
//! GPU run moves beside NCCL, a star is as fast as a ring and fails
//! cleanly: a rank that leaves closes its connection, and one that hangs
//! runs into the read timeout.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Communicator, Rendezvous, World};
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"RLOODIST";
/// How long a connecting process has to present itself.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    SumF32 = 1,
    SumF64 = 2,
    Gather = 3,
}

impl Op {
    fn name(byte: u8) -> &'static str {
        match byte {
            1 => "all_reduce (f32)",
            2 => "all_reduce (f64)",
            3 => "all_gather",
            _ => "an unknown collective",
        }
    }
}

pub struct Star {
    world: World,
    timeout: Duration,
    /// Rank 0: the link to rank r at r - 1; any other rank: its link to rank 0.
    links: Mutex<(u64, Vec<TcpStream>)>,
}

impl Star {
    pub fn join(rv: &Rendezvous) -> Result<Star> {
        let links = if rv.world.is_main() { accept_ranks(rv)? } else { vec![connect_to_main(rv)?] };
        for link in &links {
            link.set_nodelay(true).map_err(|e| io_error("setting up a connection", e))?;
            link.set_read_timeout(Some(rv.timeout)).map_err(|e| io_error("setting up a connection", e))?;
            link.set_write_timeout(Some(rv.timeout)).map_err(|e| io_error("setting up a connection", e))?;
        }
        tracing::info!("rank {} of {} joined the job at {}", rv.world.rank, rv.world.size, rv.master);
        Ok(Star { world: rv.world, timeout: rv.timeout, links: Mutex::new((0, links)) })
    }

    /// One collective: every rank's payload to rank 0, `combine`d there in
    /// rank order, the result back to every rank.
    fn exchange(&self, op: Op, mine: Vec<u8>, combine: &dyn Fn(Vec<Vec<u8>>) -> Vec<u8>) -> Result<Vec<u8>> {
        let mut guard = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let (seq, links) = &mut *guard;
        *seq += 1;
        let n = *seq;
        if self.world.is_main() {
            let mut all = Vec::with_capacity(self.world.size);
            all.push(mine);
            for (i, link) in links.iter_mut().enumerate() {
                all.push(self.receive(link, i + 1, op, n)?);
            }
            let result = combine(all);
            for (i, link) in links.iter_mut().enumerate() {
                send(link, op, n, &result).map_err(|e| self.lost(i + 1, e))?;
            }
            Ok(result)
        } else {
            let link = &mut links[0];
            send(link, op, n, &mine).map_err(|e| self.lost(0, e))?;
            self.receive(link, 0, op, n)
        }
    }

    fn receive(&self, link: &mut TcpStream, rank: usize, op: Op, n: u64) -> Result<Vec<u8>> {
        let mut head = [0u8; 17];
        link.read_exact(&mut head).map_err(|e| self.lost(rank, e))?;
        let seq = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(head[9..].try_into().expect("8 bytes"));
        if seq != n || head[8] != op as u8 {
            return Err(Error::Dist(format!(
                "rank {rank} called {} #{seq} where rank {} called {} #{n}: the ranks ran different steps",
                Op::name(head[8]),
                self.world.rank,
                Op::name(op as u8)
            )));
        }
        let mut payload = vec![0u8; len as usize];
        link.read_exact(&mut payload).map_err(|e| self.lost(rank, e))?;
        Ok(payload)
    }

    /// The error for a peer that cannot be reached.
    fn lost(&self, rank: usize, e: std::io::Error) -> Error {
        let why = match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                format!(
                    "sent nothing for {:.0} s (hung, or stopped); {}",
                    self.timeout.as_secs_f64(),
                    super::TIMEOUT_VAR
                ) + " sets how long ranks wait"
            }
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
                "left the job (its process ended; its own log says why)".to_string()
            }
            _ => format!("could not be reached: {e}"),
        };
        Error::Dist(format!("rank {rank} {why}"))
    }
}

fn send(link: &mut TcpStream, op: Op, seq: u64, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 17];
    head[..8].copy_from_slice(&seq.to_le_bytes());
    head[8] = op as u8;
    head[9..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    link.write_all(&head)?;
    link.write_all(payload)?;
    link.flush()
}

fn io_error(what: &str, e: std::io::Error) -> Error {
    Error::Dist(format!("{what}: {e}"))
}

/// Rank 0: listens at the master address until every other rank has
/// presented the job's secret; strangers are refused and logged.
fn accept_ranks(rv: &Rendezvous) -> Result<Vec<TcpStream>> {
    let listener = TcpListener::bind(&rv.master).map_err(|e| match e.kind() {
        ErrorKind::AddrInUse => Error::Dist(format!(
            "{} is in use by another process: give the job another MASTER_PORT (rloo launch --master_port)",
            rv.master
        )),
        _ => io_error(&format!("listening at {}", rv.master), e),
    })?;
    listener.set_nonblocking(true).map_err(|e| io_error("listening", e))?;
    let deadline = Instant::now() + rv.timeout;
    let mut links: Vec<Option<TcpStream>> = (1..rv.world.size).map(|_| None).collect();
    while links.iter().any(Option::is_none) {
        let (mut stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<String> = links
                        .iter()
                        .enumerate()
                        .filter(|(_, l)| l.is_none())
                        .map(|(i, _)| (i + 1).to_string())
                        .collect();
                    return Err(Error::Dist(format!(
                        "rank(s) {} did not join at {} within {:.0} s",
                        missing.join(", "),
                        rv.master,
                        rv.timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(io_error("accepting a rank", e)),
        };
        stream.set_nonblocking(false).map_err(|e| io_error("accepting a rank", e))?;
        stream.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(|e| io_error("accepting a rank", e))?;
        let (rank, size) = match read_hello(&mut stream, &rv.secret) {
            Ok(hello) => hello,
            Err(why) => {
                tracing::warn!("refused a connection from {peer}: {why}");
                continue;
            }
        };
        if size != rv.world.size {
            return Err(Error::Dist(format!(
                "rank {rank} was started with WORLD_SIZE={size}, rank 0 with {}",
                rv.world.size
            )));
        }
        match links.get_mut(rank.wrapping_sub(1)) {
            Some(slot @ None) => {
                stream.write_all(MAGIC).map_err(|e| io_error("welcoming a rank", e))?;
                *slot = Some(stream);
            }
            Some(Some(_)) => return Err(Error::Dist(format!("two processes joined as rank {rank}"))),
            None => return Err(Error::Dist(format!("a process joined as rank {rank} of {size}"))),
        }
    }
    Ok(links.into_iter().flatten().collect())
}

/// What a connecting rank says first: the magic, the secret, its rank and the world's size.
fn read_hello(stream: &mut TcpStream, secret: &str) -> std::result::Result<(usize, usize), String> {
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).map_err(|e| format!("no greeting ({e})"))?;
    if &head[..8] != MAGIC {
        return Err("it does not speak rloo's rendezvous".into());
    }
    let len = u32::from_le_bytes(head[8..].try_into().expect("4 bytes")) as usize;
    if len > 4096 {
        return Err("an oversized secret".into());
    }
    let mut theirs = vec![0u8; len + 16];
    stream.read_exact(&mut theirs).map_err(|e| format!("a cut greeting ({e})"))?;
    // Compared in full whatever the first difference, so timing tells nothing.
    let same =
        len == secret.len() && theirs[..len].iter().zip(secret.as_bytes()).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0;
    if !same {
        return Err("it did not present the job's secret".into());
    }
    let number = |at: usize| u64::from_le_bytes(theirs[len + at..len + at + 8].try_into().expect("8 bytes")) as usize;
    Ok((number(0), number(8)))
}

/// Any other rank: connects to rank 0 (retrying while it starts) and presents itself.
fn connect_to_main(rv: &Rendezvous) -> Result<TcpStream> {
    let deadline = Instant::now() + rv.timeout;
    let addrs: Vec<SocketAddr> =
        rv.master.to_socket_addrs().map_err(|e| Error::Dist(format!("MASTER_ADDR {}: {e}", rv.master)))?.collect();
    let mut stream = loop {
        match addrs.iter().find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(5)).ok()) {
            Some(stream) => break stream,
            None if Instant::now() > deadline => {
                return Err(Error::Dist(format!(
                    "rank 0 did not listen at {} within {:.0} s",
                    rv.master,
                    rv.timeout.as_secs_f64()
                )))
            }
            None => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let mut hello = MAGIC.to_vec();
    hello.extend((rv.secret.len() as u32).to_le_bytes());
    hello.extend(rv.secret.as_bytes());
    hello.extend((rv.world.rank as u64).to_le_bytes());
    hello.extend((rv.world.size as u64).to_le_bytes());
    stream.write_all(&hello).map_err(|e| io_error(&format!("greeting rank 0 at {}", rv.master), e))?;
    stream.set_read_timeout(Some(rv.timeout)).map_err(|e| io_error("joining", e))?;
    let mut welcome = [0u8; 8];
    if stream.read_exact(&mut welcome).is_err() || &welcome != MAGIC {
        return Err(Error::Dist(format!(
            "rank 0 at {} did not let rank {} join: another job's rank 0, or another {}",
            rv.master,
            rv.world.rank,
            super::SECRET_VAR
        )));
    }
    Ok(stream)
}

impl Communicator for Star {
    fn world(&self) -> World {
        self.world
    }

    fn all_reduce_sum(&self, data: &mut [f32]) -> Result<()> {
        let sum = self.exchange(Op::SumF32, super::f32_bytes(data), &|all| {
            let mut total = super::bytes_f32(&all[0]);
            for part in &all[1..] {
                for (t, v) in total.iter_mut().zip(super::bytes_f32(part)) {
                    *t += v;
                }
            }
            super::f32_bytes(&total)
        })?;
        check_len(data.len() * 4, sum.len())?;
        data.copy_from_slice(&super::bytes_f32(&sum));
        Ok(())
    }

    fn all_reduce_sum_f64(&self, data: &mut [f64]) -> Result<()> {
        let to_bytes = |v: &[f64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let from_bytes = |b: &[u8]| {
            b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect::<Vec<_>>()
        };
        let sum = self.exchange(Op::SumF64, to_bytes(data), &|all| {
            let mut total = from_bytes(&all[0]);
            for part in &all[1..] {
                for (t, v) in total.iter_mut().zip(from_bytes(part)) {
                    *t += v;
                }
            }
            to_bytes(&total)
        })?;
        check_len(data.len() * 8, sum.len())?;
        data.copy_from_slice(&from_bytes(&sum));
        Ok(())
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let joined = self.exchange(Op::Gather, mine.to_vec(), &|all| {
            let mut out = Vec::new();
            for part in all {
                out.extend((part.len() as u64).to_le_bytes());
                out.extend(part);
            }
            out
        })?;
        let mut parts = Vec::with_capacity(self.world.size);
        let mut rest = &joined[..];
        while rest.len() >= 8 {
            let len = u64::from_le_bytes(rest[..8].try_into().expect("8 bytes")) as usize;
            let end = (8 + len).min(rest.len());
            parts.push(rest[8..end].to_vec());
            rest = &rest[end..];
        }
        if parts.len() != self.world.size {
            return Err(Error::Dist(format!(
                "all_gather returned {} parts for {} ranks",
                parts.len(),
                self.world.size
            )));
        }
        Ok(parts)
    }
}

/// A sum whose length differs from the caller's means the ranks passed different sizes.
fn check_len(want: usize, got: usize) -> Result<()> {
    if want == got {
        Ok(())
    } else {
        Err(Error::Dist(format!(
            "the ranks reduced buffers of different sizes ({} and {} bytes): they hold different models",
            want, got
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendezvous(rank: usize, size: usize, port: u16, secret: &str) -> Rendezvous {
        Rendezvous {
            world: World { rank, size, local_rank: rank, joined: true },
            master: format!("127.0.0.1:{port}"),
            secret: secret.into(),
            timeout: Duration::from_secs(5),
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[test]
    fn three_ranks_sum_in_rank_order_and_gather_in_rank_order() {
        let port = free_port();
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    s.spawn(move || {
                        let star = Star::join(&rendezvous(rank, 3, port, "job")).unwrap();
                        let mut v = [rank as f32, 1.0];
                        star.all_reduce_sum(&mut v).unwrap();
                        let mut w = [0.5f64 * rank as f64];
                        star.all_reduce_sum_f64(&mut w).unwrap();
                        let gathered = star.all_gather(&vec![rank as u8; rank]).unwrap();
                        let any = star.any(rank == 2).unwrap();
                        (v, w, gathered, any)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (v, w, gathered, any) in results {
            assert_eq!(v, [3.0, 3.0]);
            assert_eq!(w, [1.5]);
            assert_eq!(gathered, vec![vec![], vec![1], vec![2, 2]]);
            assert!(any);
        }
    }

    #[test]
    fn a_stranger_is_refused_and_a_leaving_rank_is_named() {
        let port = free_port();
        std::thread::scope(|s| {
            let main = s.spawn(move || {
                let star = Star::join(&rendezvous(0, 2, port, "job")).unwrap();
                let mut v = [1.0f32];
                star.all_reduce_sum(&mut v).unwrap();
                star.all_reduce_sum(&mut v).unwrap_err().to_string()
            });
            // A process with the wrong secret gets no welcome.
            let err = match Star::join(&rendezvous(1, 2, port, "guess")) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("a stranger joined"),
            };
            assert!(err.contains("did not let rank 1 join"), "{err}");
            let star = Star::join(&rendezvous(1, 2, port, "job")).unwrap();
            let mut v = [2.0f32];
            star.all_reduce_sum(&mut v).unwrap();
            assert_eq!(v, [3.0]);
            drop(star);
            let err = main.join().unwrap();
            assert!(err.contains("rank 1 left the job"), "{err}");
        });
    }

    #[test]
    fn a_port_in_use_is_named() {
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let err = match Star::join(&rendezvous(0, 2, port, "job")) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("bound a port in use"),
        };
        assert!(err.contains(&format!("127.0.0.1:{port} is in use")), "{err}");
    }

    #[test]
    fn a_hung_rank_is_named_after_the_timeout() {
        let port = free_port();
        std::thread::scope(|s| {
            let main = s.spawn(move || {
                let mut rv = rendezvous(0, 2, port, "job");
                rv.timeout = Duration::from_millis(300);
                let star = Star::join(&rv).unwrap();
                star.all_reduce_sum(&mut [1.0]).unwrap_err().to_string()
            });
            let _idle = Star::join(&rendezvous(1, 2, port, "job")).unwrap();
            let err = main.join().unwrap();
            assert!(err.contains("rank 1 sent nothing for 0 s"), "{err}");
        });
    }
}
