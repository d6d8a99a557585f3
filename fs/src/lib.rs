//! Files written whole, so that a reader (another process, or a run
//! resumed after a crash) sees the old file or the new one, never part of
//! either: the bytes go to a temporary beside the file, are synced, and
//! the temporary is renamed over the file (a rename within one folder is
//! atomic), then the folder is synced so the rename survives a power cut.
//!
//! Owns the temporary's name (`.NAME.tmp-PID`, which says whose it is, so
//! a later run can remove one whose writer died) and the write, sync and
//! rename. Not what is written, nor how a caller words its errors: each
//! crate maps [`WriteError`] into its own.
//!
//! ```
//! let dir = std::env::temp_dir().join(format!("hlo-fs-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! hlo_fs::write_atomic(&dir.join("a.json"), b"{}").unwrap();
//! assert_eq!(std::fs::read(dir.join("a.json")).unwrap(), b"{}");
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Why a file could not be written whole.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The path names no file (it ends in `..` or `/`).
    #[error("{} is not a file path", .0.display())]
    NotAFile(PathBuf),
    /// What the operating system said.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// The temporary `path` is written under until it is renamed into place:
/// `.NAME.tmp-PID` beside it (hidden, and named by process so concurrent
/// writers never share one). None where `path` names no file.
pub fn temporary_path(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?;
    Some(path.with_file_name(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// The process that wrote a temporary named `name` ([`temporary_path`]);
/// None for any other name.
pub fn temporary_writer(name: &str) -> Option<u32> {
    name.strip_prefix('.')?.rsplit_once(".tmp-")?.1.parse().ok()
}

/// Writes `bytes` to `path` whole: through its temporary, synced, renamed
/// over `path`, the folder synced. The temporary is removed when any step
/// fails, so a failed write leaves the old file and nothing beside it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    let tmp = temporary_path(path).ok_or_else(|| WriteError::NotAFile(path.to_path_buf()))?;
    let mut file = File::create(&tmp)?;
    if let Err(e) = file.write_all(bytes) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.into());
    }
    Ok(rename_into_place(file, &tmp, path)?)
}

/// Finishes a whole-file write made through `tmp` (`file`, its handle):
/// syncs it, renames it over `path` and syncs the folder. Removes `tmp`
/// when a step fails.
pub fn rename_into_place(file: File, tmp: &Path, path: &Path) -> std::io::Result<()> {
    let result = file
        .sync_all()
        .and_then(|()| std::fs::rename(tmp, path))
        .map(|()| sync_folder_of(path));
    if result.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    result
}

/// Syncs the folder holding `path`, so a rename into it is on disk.
/// Best effort: some file systems cannot sync a folder, and the file
/// itself is already synced.
fn sync_folder_of(path: &Path) {
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if let Ok(f) = File::open(folder) {
        let _ = f.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hlo-fs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn replaces_the_file_and_leaves_nothing_beside_it() {
        let dir = scratch("replace");
        let path = dir.join("a.txt");
        std::fs::write(&path, "old").unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_no_temporary() {
        let dir = scratch("fail");
        // Renaming a file over a folder fails after the bytes are written.
        std::fs::create_dir_all(dir.join("a.txt/inside")).unwrap();
        let e = write_atomic(&dir.join("a.txt"), b"x").unwrap_err();
        assert!(matches!(e, WriteError::Io(_)), "{e}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "only a.txt/");
        // A missing folder fails before anything is written.
        assert!(write_atomic(&dir.join("missing/b.txt"), b"x").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_path_without_a_file_name_is_refused() {
        let e = write_atomic(Path::new("/tmp/.."), b"x").unwrap_err();
        assert_eq!(e.to_string(), "/tmp/.. is not a file path");
    }

    #[test]
    fn a_temporary_names_its_writer() {
        let tmp = temporary_path(Path::new("/x/model.safetensors")).unwrap();
        let name = tmp.file_name().unwrap().to_str().unwrap();
        assert_eq!(
            name,
            format!(".model.safetensors.tmp-{}", std::process::id())
        );
        assert_eq!(temporary_writer(name), Some(std::process::id()));
        assert_eq!(temporary_writer("model.safetensors"), None);
        assert_eq!(temporary_writer(".a.tmp-x"), None);
    }
}
