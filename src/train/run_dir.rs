//! The output directory of a training run: one writer at a time, and never
//! a new run mixed into an older run's files.
//!
//! A run holds an exclusive `flock` on `<dir>/.rloo.lock` from start to
//! exit (the kernel drops it when the process dies, even by `kill -9`), and
//! writes its pid there so that a second run can name the holder. A new run
//! refuses a directory that holds another run's outputs unless it is told
//! to overwrite them or to resume from them. Temporaries left by a killed
//! run (`.checkpoint-N.tmp<pid>`, `.metrics.jsonl.tmp<pid>`, ...) are
//! removed once the lock is held, when no live writer can own them.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

const LOCK_FILE: &str = ".rloo.lock";

/// What a run may do with a directory that already holds outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// Only an empty (or new) directory.
    Fresh,
    /// Delete the previous run's checkpoints and logs first
    /// (`--overwrite_output_dir`).
    Overwrite,
    /// Continue the run whose outputs are there (`--resume_from_checkpoint`).
    Resume,
}

/// Outputs of a previous run that `Reuse::Overwrite` deletes: everything a
/// new run would append to or mix with. Model files are replaced whole at
/// the end of the new run.
const PREVIOUS_RUN: &[&str] = &["metrics.jsonl", "samples.jsonl", "tensorboard"];

/// An output directory locked for this process until dropped.
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    _lock: File,
}

impl RunDir {
    /// Creates `path` if needed, locks it, cleans a killed run's
    /// temporaries and applies `reuse`.
    pub fn open(path: &Path, reuse: Reuse) -> Result<Self> {
        fs::create_dir_all(path).map_err(|e| Error::io(path, e))?;
        let lock = lock(path)?;
        remove_stale_temporaries(path)?;
        let previous = previous_outputs(path)?;
        match reuse {
            Reuse::Resume => {}
            Reuse::Fresh if previous.is_empty() => {}
            Reuse::Fresh => {
                let shown: Vec<String> = previous.iter().take(4).map(|p| file_name(p)).collect();
                let more = if previous.len() > 4 { format!(" and {} more", previous.len() - 4) } else { String::new() };
                return Err(Error::Invalid(format!(
                    "output directory {} already holds a run ({}{more}); pass --overwrite_output_dir to replace it, \
                     --resume_from_checkpoint latest to continue it, or choose another --output_dir",
                    path.display(),
                    shown.join(", ")
                )));
            }
            Reuse::Overwrite => {
                for p in previous {
                    let name = file_name(&p);
                    if name.starts_with("checkpoint-") || PREVIOUS_RUN.contains(&name.as_str()) {
                        remove(&p)?;
                    }
                }
            }
        }
        Ok(Self { path: path.to_path_buf(), _lock: lock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Takes the lock without waiting; a held lock is an error naming its pid.
fn lock(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io(&path, e))?;
    // Safety: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(Error::io(&path, err));
        }
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = match holder.trim() {
            "" => "another process".to_string(),
            pid => format!("pid {pid}"),
        };
        return Err(Error::Invalid(format!(
            "output directory {} is in use by another run ({holder}); wait for it to end or choose another --output_dir",
            dir.display()
        )));
    }
    let write_pid = |file: &mut File| -> std::io::Result<()> {
        file.set_len(0)?;
        file.rewind()?;
        writeln!(file, "{}", std::process::id())
    };
    write_pid(&mut file).map_err(|e| Error::io(&path, e))?;
    Ok(file)
}

/// `.NAME.tmp<pid>` and `.NAME.old` entries: what `io::write_atomic` and
/// `io::write_dir_atomic` leave behind when killed.
fn is_stale_temporary(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('.') else { return false };
    if rest.ends_with(".old") {
        return true;
    }
    rest.rsplit_once(".tmp").is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
}

fn remove_stale_temporaries(dir: &Path) -> Result<()> {
    for entry in entries(dir)? {
        if is_stale_temporary(&file_name(&entry)) {
            tracing::info!("removing {}, left by an interrupted run", entry.display());
            remove(&entry)?;
        }
    }
    Ok(())
}

/// Everything in `dir` but the lock file.
fn previous_outputs(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found: Vec<PathBuf> = entries(dir)?.into_iter().filter(|p| file_name(p) != LOCK_FILE).collect();
    found.sort();
    Ok(found)
}

fn entries(dir: &Path) -> Result<Vec<PathBuf>> {
    let read = fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    Ok(read.filter_map(|e| e.ok()).map(|e| e.path()).collect())
}

fn remove(path: &Path) -> Result<()> {
    let result = if path.is_dir() { fs::remove_dir_all(path) } else { fs::remove_file(path) };
    result.map_err(|e| Error::io(path, e))
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_opener_is_refused_with_the_holders_pid() {
        let root = tempfile::tempdir().unwrap();
        let first = RunDir::open(root.path(), Reuse::Fresh).unwrap();
        let err = RunDir::open(root.path(), Reuse::Resume).unwrap_err().to_string();
        assert!(err.contains(&format!("in use by another run (pid {})", std::process::id())), "{err}");
        drop(first);
        RunDir::open(root.path(), Reuse::Resume).unwrap();
    }

    #[test]
    fn a_directory_with_outputs_needs_overwrite_or_resume() {
        let root = tempfile::tempdir().unwrap();
        fs::create_dir(root.path().join("checkpoint-7")).unwrap();
        fs::write(root.path().join("metrics.jsonl"), "{}\n").unwrap();
        fs::write(root.path().join("notes.txt"), "mine").unwrap();
        let err = RunDir::open(root.path(), Reuse::Fresh).unwrap_err().to_string();
        assert!(err.contains("already holds a run (checkpoint-7, metrics.jsonl, notes.txt)"), "{err}");
        assert!(err.contains("--overwrite_output_dir") && err.contains("--resume_from_checkpoint"), "{err}");
        drop(RunDir::open(root.path(), Reuse::Resume).unwrap());
        assert!(root.path().join("checkpoint-7").exists(), "resume keeps the checkpoints");
        drop(RunDir::open(root.path(), Reuse::Overwrite).unwrap());
        assert!(!root.path().join("checkpoint-7").exists() && !root.path().join("metrics.jsonl").exists());
        assert!(root.path().join("notes.txt").exists(), "overwrite deletes only a run's own outputs");
    }

    #[test]
    fn temporaries_of_a_killed_run_are_removed() {
        let root = tempfile::tempdir().unwrap();
        let tmp_ckpt = root.path().join(".checkpoint-4.tmp1234");
        fs::create_dir(&tmp_ckpt).unwrap();
        fs::write(tmp_ckpt.join("model.safetensors"), "half").unwrap();
        fs::write(root.path().join(".metrics.jsonl.tmp99"), "x").unwrap();
        fs::create_dir(root.path().join(".checkpoint-2.old")).unwrap();
        fs::write(root.path().join(".done"), "").unwrap();
        drop(RunDir::open(root.path(), Reuse::Resume).unwrap());
        let left: Vec<String> = entries(root.path()).unwrap().iter().map(|p| file_name(p)).collect();
        let mut left = left;
        left.sort();
        assert_eq!(left, [".done", LOCK_FILE]);
    }
}
