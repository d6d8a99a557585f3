//! Errors of the runtime layer.

use std::path::PathBuf;

/// A status code from the plugin (`PJRT_Error_Code`, after absl's codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
    Other(u32),
}

impl ErrorCode {
    pub(crate) fn from_raw(code: u32) -> Self {
        use ErrorCode::*;
        match code {
            1 => Cancelled,
            2 => Unknown,
            3 => InvalidArgument,
            4 => DeadlineExceeded,
            5 => NotFound,
            6 => AlreadyExists,
            7 => PermissionDenied,
            8 => ResourceExhausted,
            9 => FailedPrecondition,
            10 => Aborted,
            11 => OutOfRange,
            12 => Unimplemented,
            13 => Internal,
            14 => Unavailable,
            15 => DataLoss,
            16 => Unauthenticated,
            n => Other(n),
        }
    }
}

/// Everything that can go wrong between us and a PJRT plugin.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("PJRT plugin not found at {}", path.display())]
    PluginNotFound { path: PathBuf },

    #[error("{0}")]
    PluginDiscovery(String),

    #[error("cannot load {} as a PJRT plugin: {reason}", path.display())]
    NotAPlugin { path: PathBuf, reason: String },

    #[error(
        "PJRT plugin {} has API version {major}.{minor}; hlo-train needs {need_major}.{need_minor} or newer",
        path.display()
    )]
    PluginTooOld {
        path: PathBuf,
        major: i32,
        minor: i32,
        need_major: i32,
        need_minor: i32,
    },

    #[error(
        "PJRT plugin does not provide {function} (its API table is too short or the slot is empty)"
    )]
    MissingFunction { function: String },

    /// An error returned by the plugin, its message carried verbatim.
    #[error("{function} failed ({code:?}): {message}")]
    Pjrt {
        function: String,
        code: ErrorCode,
        message: String,
    },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A layout that does not fit the mesh or the array.
    #[error(transparent)]
    Sharding(#[from] hlo_partitioner::ShardingError),

    /// Rendezvous with the other processes of the run failed.
    #[error(transparent)]
    Kv(#[from] hlo_rendezvous::KvError),

    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
