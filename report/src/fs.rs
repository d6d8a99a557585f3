//! Writing a whole file so that no reader ever sees part of it.

use std::path::Path;

use crate::error::{ReportError, Result};

/// Writes `bytes` to `path` whole ([`hlo_fs::write_atomic`]).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    hlo_fs::write_atomic(path, bytes).map_err(|e| match e {
        hlo_fs::WriteError::NotAFile(p) => ReportError::NotAFile { path: p },
        hlo_fs::WriteError::Io(cause) => ReportError::io("write", path)(cause),
    })
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
