//! One writer per folder: a lock file, `hlo-train.lock`, held for the
//! writer's life (an advisory lock the system drops when the process
//! ends, however it ends) and naming its holder (pid, host, what it is
//! doing), so a second writer is refused naming the first, and a lock
//! file left by a process that died is taken over, and said so.
//!
//! What takes it: `data prepare` (its `--out`) and a training run (its
//! run folder). Readers take no lock.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::DataError;

/// The lock file's name in the folder it guards.
pub const LOCK_FILE: &str = "hlo-train.lock";

/// A held lock on a folder; released (and its file removed) when
/// dropped.
#[derive(Debug)]
pub struct FolderLock {
    file: File,
    path: PathBuf,
    /// The holder whose lock file this one took over (a process that
    /// ended without releasing it), as its file named it.
    pub took_over: Option<String>,
}

/// Who holds a lock: `pid 123 on host h (data prepare)`.
fn holder_line(what: &str) -> String {
    format!(
        "pid {} on host {} ({what})",
        std::process::id(),
        host_name()
    )
}

/// This machine's name (`unknown` where it cannot be read).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

impl FolderLock {
    /// Makes `dir` (and its parents) where missing, and takes its lock.
    pub fn create(dir: &Path, what: &str) -> Result<FolderLock, DataError> {
        std::fs::create_dir_all(dir).map_err(|cause| DataError::Create {
            path: dir.to_path_buf(),
            cause,
        })?;
        Self::acquire(dir, what)
    }

    /// Takes `dir`'s lock for `what` (the folder must exist), or says who
    /// holds it.
    pub fn acquire(dir: &Path, what: &str) -> Result<FolderLock, DataError> {
        let path = dir.join(LOCK_FILE);
        let io = |cause| DataError::Read {
            path: path.clone(),
            cause,
        };
        // A holder may remove the file between our open and our lock:
        // then the lock we took is on a file no one else can see, so
        // open the new one and try again.
        for _ in 0..8 {
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io)?;
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    let mut held = String::new();
                    let _ = file.read_to_string(&mut held);
                    return Err(DataError::Locked {
                        path: dir.to_path_buf(),
                        holder: held.trim().to_string(),
                    });
                }
                Err(TryLockError::Error(cause)) => return Err(io(cause)),
            }
            let same = std::fs::metadata(&path).is_ok_and(|m| {
                file.metadata()
                    .is_ok_and(|f| (f.dev(), f.ino()) == (m.dev(), m.ino()))
            });
            if !same {
                continue;
            }
            let mut before = String::new();
            file.read_to_string(&mut before).map_err(io)?;
            file.set_len(0).map_err(io)?;
            file.rewind().map_err(io)?;
            writeln!(file, "{}", holder_line(what)).map_err(io)?;
            file.sync_all().map_err(io)?;
            let before = before.trim();
            return Ok(FolderLock {
                file,
                path,
                took_over: (!before.is_empty()).then(|| before.to_string()),
            });
        }
        Err(DataError::Locked {
            path: dir.to_path_buf(),
            holder: "another process, taking and releasing it as we tried".into(),
        })
    }

    /// The line to print when this lock took over a dead holder's file.
    pub fn took_over_line(&self) -> Option<String> {
        self.took_over.as_ref().map(|h| {
            format!(
                "took over {}: its holder, {h}, ended without releasing it",
                self.path.display()
            )
        })
    }
}

impl Drop for FolderLock {
    fn drop(&mut self) {
        // Removed while still held, so no one takes the old file.
        let _ = std::fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_and_a_dead_holders_lock_is_taken_over() {
        let dir = std::env::temp_dir().join(format!("hlo-data-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let first = FolderLock::acquire(&dir, "data prepare").unwrap();
        assert!(first.took_over.is_none());
        // (A second open file description of the same process is refused
        // as another process would be.)
        let e = FolderLock::acquire(&dir, "data prepare")
            .unwrap_err()
            .to_string();
        let me = format!("pid {} on host", std::process::id());
        assert!(e.contains("is held by") && e.contains(&me), "{e}");
        drop(first);
        assert!(!dir.join(LOCK_FILE).exists(), "released and removed");
        // A file left by a process that died, never locked: taken over.
        std::fs::write(dir.join(LOCK_FILE), "pid 4194304 on host gone (train)\n").unwrap();
        let second = FolderLock::acquire(&dir, "train").unwrap();
        let line = second.took_over_line().unwrap();
        assert!(line.contains("pid 4194304 on host gone (train)"), "{line}");
        let held = std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap();
        assert!(held.starts_with(&me) && held.contains("(train)"), "{held}");
    }
}
