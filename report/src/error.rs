//! Errors of reading a run's metrics and writing its report files.

use std::path::PathBuf;

/// What went wrong, in one line a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file or folder could not be read, written or created.
    #[error("cannot {action} {}: {cause}", path.display())]
    Io {
        /// What was being done: `read`, `write`, `create`.
        action: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// What the operating system said. Not a `source`: the message
        /// already carries it, and a chain would print it twice.
        cause: std::io::Error,
    },
    /// A line of a metrics file that is not a JSON object.
    #[error("{}: line {line}: not a JSON object: {detail}", path.display())]
    MalformedLine {
        /// The metrics file.
        path: PathBuf,
        /// Counted from 1.
        line: usize,
        /// The parser's message, or the start of a line that is JSON but
        /// not an object.
        detail: String,
    },
    /// A metrics file without a single loss value to plot.
    #[error("{} holds no loss values (no line with a numeric \"step\" and \"loss\" or \"eval_loss\"); nothing to plot", path.display())]
    NoLossValues {
        /// The metrics file.
        path: PathBuf,
    },
    /// An output path that names no file (it ends in `..` or `/`).
    #[error("{} is not a file path", path.display())]
    NotAFile {
        /// The path as given.
        path: PathBuf,
    },
}

impl ReportError {
    /// The `map_err` of an I/O call: `action` on `path` failed.
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> ReportError {
        let path = path.into();
        move |cause| ReportError::Io {
            action,
            path,
            cause,
        }
    }
}

/// `hlo-report`'s result, failing with a [`ReportError`].
pub type Result<T, E = ReportError> = std::result::Result<T, E>;
