//! `hlo-rendezvous` owns how the processes of one run find each other, with
//! std and, for the run token's proofs, RustCrypto's `hmac` and `sha2`:
//!
//! - [`launch`]: who this process is — its index, the process count and
//!   process 0's address — from `--num-processes/--process-id/--coordinator`,
//!   else torchrun-style variables (`WORLD_SIZE`, `RANK`, `MASTER_ADDR`, ...),
//!   else SLURM's (`SLURM_NTASKS`, `SLURM_PROCID`, the node list).
//! - [`kv`]: the small TCP key-value service process 0 serves
//!   ([`KvServer`]) and every process holds a [`KvClient`] of: set, blocking
//!   get, try-get, barriers, a shutdown that waits for all, and a watch
//!   that fails at once when a peer dies.
//! - [`token`]: the run token ([`RunToken`]) every connection proves it
//!   holds, by challenge and response, before it is served.
//!
//! It knows no PJRT, device or plugin: `hlo-runtime` hands a [`KvClient`]
//! to a plugin through PJRT's key-value callbacks, and `hlo-engine` joins
//! the processes of a run (its `processes::ProcessGroup`) and decides what
//! they exchange.

#![warn(missing_docs)]

pub mod kv;
pub mod launch;
pub mod token;

pub use kv::{KvClient, KvError, KvServer, ServerOptions, MAX_STORED_BYTES, MAX_VALUE_BYTES};
pub use launch::{
    first_slurm_host, slurm_tasks_on_node, Launch, LaunchError, LaunchFlags, LaunchSource,
    DEFAULT_INIT_TIMEOUT, SLURM_PORT_BASE,
};
pub use token::{EmptyToken, RunToken, RUN_TOKEN_ENV};
