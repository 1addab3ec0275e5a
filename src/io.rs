//! Writing outputs so that a crash never leaves a half-written file behind:
//! everything goes to a temporary sibling first and is renamed into place.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Writes `bytes` to `path` atomically (temp file in the same directory, fsync, rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| fs::File::create(tmp)?.write_all(bytes))
}

/// Has `write` create the file at the path it is given, then syncs it and
/// renames it to `path`: for writers that stream a large file instead of
/// holding all of it in memory.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> std::io::Result<()>) -> Result<()> {
    let tmp = temp_sibling(path);
    let result = write(&tmp).and_then(|()| fs::File::open(&tmp)?.sync_all());
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Builds a directory under a temporary name and renames it into place when
/// `fill` succeeds; an existing directory at `dir` is replaced only then.
pub fn write_dir_atomic(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = temp_sibling(dir);
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    if let Err(e) = fill(&tmp) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if dir.exists() {
        // Keep the old copy until the new one is in place.
        let old = dir.with_file_name(format!(".{}.old", file_name(dir)));
        let _ = fs::remove_dir_all(&old);
        fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
        fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".to_string())
}

/// `.NAME.tmp<pid>` beside `path`.
pub(crate) fn temp_sibling(path: &Path) -> PathBuf {
    let name = format!(".{}.tmp{}", file_name(path), std::process::id());
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_dir_replaces_only_on_success() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        write_dir_atomic(&dir, |d| write_atomic(&d.join("a"), b"1")).unwrap();
        let failed = write_dir_atomic(&dir, |d| {
            write_atomic(&d.join("a"), b"2")?;
            Err(Error::Invalid("boom".into()))
        });
        assert!(failed.is_err());
        assert_eq!(fs::read(dir.join("a")).unwrap(), b"1");
        assert_eq!(fs::read_dir(root.path()).unwrap().count(), 1, "no temp left behind");
    }
}
