//! What the key-value service can fail with.

use std::io;
use std::time::Duration;

/// What can go wrong while processes meet. Each message is one line naming
/// the process, key or address concerned.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// A socket or thread operation failed outside any one request.
    #[error("coordination service: {0}")]
    Io(#[from] io::Error),

    /// The coordinator did not answer within the connect timeout.
    #[error(
        "process {process} of {num_processes} could not reach the coordinator {addr} within {} ({cause})",
        secs(.waited)
    )]
    Unreachable {
        /// The id this process asked for.
        process: u32,
        /// The process count this process was started for.
        num_processes: u32,
        /// The coordinator's `HOST:PORT`.
        addr: String,
        /// How long it tried.
        waited: Duration,
        /// The last connection error, e.g. "Connection refused (os error 111)".
        cause: String,
    },

    /// The coordinator would not register this process (id out of range
    /// or taken, or another process count).
    #[error("the coordinator refused this process: {reason}")]
    Refused {
        /// Why, as the coordinator put it.
        reason: String,
    },

    /// A get whose key was not set in time.
    #[error("timed out after {} waiting for key `{key}`", secs(.waited))]
    Timeout {
        /// The key waited for.
        key: String,
        /// The get's timeout.
        waited: Duration,
    },

    /// A barrier (or shutdown) that not every process reached in time.
    #[error(
        "{} of {num_processes} never reached `{name}` within {}",
        processes(.missing),
        secs(.waited)
    )]
    BarrierTimeout {
        /// The barrier's name (`shutdown` for a shutdown).
        name: String,
        /// The ids that did not arrive, ascending.
        missing: Vec<u32>,
        /// How many processes the run has.
        num_processes: u32,
        /// The barrier's timeout.
        waited: Duration,
    },

    /// A process closed its connection without shutting down (it died or
    /// was killed); every wait fails with it from then on.
    #[error("process {process} left the run without finishing")]
    PeerLost {
        /// The first process that left.
        process: u32,
    },

    /// The coordinator went away (process 0 died or stopped serving).
    #[error("lost the connection to the coordinator {addr}")]
    CoordinatorLost {
        /// The coordinator's `HOST:PORT`.
        addr: String,
    },

    /// A frame that does not follow the wire format, or a key or value over
    /// its limit.
    #[error("malformed coordination message: {0}")]
    Protocol(String),
}

/// "300 ms", "5 s", "2.5 s".
fn secs(d: &Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms} ms")
    } else if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// "process 3", "processes 1, 3".
fn processes(ids: &[u32]) -> String {
    let list = ids
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() == 1 {
        format!("process {list}")
    } else {
        format!("processes {list}")
    }
}
