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

    /// Process 0 requires a run token and this process has none.
    #[error("the rendezvous at {addr} requires a run token (HLO_TRAIN_RUN_TOKEN) and this process has none")]
    TokenRequired {
        /// The coordinator's `HOST:PORT`.
        addr: String,
    },

    /// This process has a run token and process 0 was started without one.
    #[error("this process has a run token but the rendezvous at {addr} takes none (process 0 was started without HLO_TRAIN_RUN_TOKEN)")]
    TokenUnexpected {
        /// The coordinator's `HOST:PORT`.
        addr: String,
    },

    /// Process 0 refused this process's proof of the run token.
    #[error(
        "this process's run token differs from process 0's (the rendezvous at {addr} refused it)"
    )]
    TokenMismatch {
        /// The coordinator's `HOST:PORT`.
        addr: String,
    },

    /// What answered at the coordinator's address could not prove that it
    /// holds the run token.
    #[error("the rendezvous at {addr} could not prove it holds this run's token (is another run serving there?)")]
    ServerUnproven {
        /// The coordinator's `HOST:PORT`.
        addr: String,
    },

    /// A process was started for another process count than process 0's;
    /// every process of the run is told, at once.
    #[error("process {process} was started for {theirs} processes but process 0 runs {ours}; start every process with the same count")]
    CountMismatch {
        /// The process that announced the other count.
        process: u32,
        /// The count it was started for.
        theirs: u32,
        /// Process 0's count.
        ours: u32,
    },

    /// A set that would take the service over the bytes it may hold.
    #[error(
        "cannot store key `{key}` ({}): the rendezvous already holds {} of at most {}",
        size(*.bytes),
        size(*.stored),
        size(*.limit)
    )]
    Full {
        /// The key refused.
        key: String,
        /// Its key and value bytes.
        bytes: u64,
        /// What the service holds now.
        stored: u64,
        /// The most it holds.
        limit: u64,
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

/// "512 B", "3.0 KiB", "256.0 MiB".
fn size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut x = bytes as f64 / 1024.0;
    let mut unit = 0;
    while x >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    format!("{x:.1} {}", UNITS[unit])
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
