//! Writing a whole file so that no reader ever sees part of it.

use std::io::Write;
use std::path::Path;

use crate::error::{ReportError, Result};

/// Writes `bytes` to a temporary file beside `path` and renames it over
/// `path` (a rename within one folder is atomic); the temporary file is
/// removed when anything fails.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().ok_or_else(|| ReportError::NotAFile {
        path: path.to_path_buf(),
    })?;
    // Hidden and named by process, so concurrent writers do not collide.
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(ReportError::io("write", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_nothing_beside_it() {
        let dir = crate::temp_dir("atomic");
        let path = dir.join("a.txt");
        std::fs::write(&path, "old").unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        // A folder that is missing fails with the path, and no file stays.
        let err = write_atomic(&dir.join("missing/b.txt"), b"x").unwrap_err();
        assert!(
            matches!(&err, ReportError::Io { action: "write", path, .. } if path.ends_with("missing/b.txt")),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_path_without_a_file_name_is_refused() {
        let err = write_atomic(Path::new("/tmp/.."), b"x").unwrap_err();
        assert_eq!(err.to_string(), "/tmp/.. is not a file path");
    }
}
