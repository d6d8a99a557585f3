//! Several processes, one run: the rendezvous through process 0's
//! key-value service ([`ProcessGroup`]), whose client the [`Backend`]
//! then hands to the plugin's key-value callbacks.
//!
//! Who this process is ([`Launch`], from flags, SLURM or torchrun-style
//! variables) and the service itself belong to `hlo-rendezvous`
//! ([`crate::rendezvous`]); the launch types are re-exported here, since a
//! [`ProcessGroup`] is joined from a [`Launch`].
//!
//! [`Backend`]: crate::device::backend::Backend
//!
//! ```
//! use hlo_engine::device::processes::{Launch, LaunchFlags};
//! let flags = LaunchFlags {
//!     num_processes: Some(2),
//!     process_id: Some(1),
//!     coordinator: Some("10.0.0.1:7000".into()),
//!     ..LaunchFlags::default()
//! };
//! let launch = Launch::resolve(&flags, |_| None).unwrap().unwrap();
//! assert_eq!(launch.describe(), "process 1 of 2 (--num-processes), coordinator 10.0.0.1:7000");
//! ```

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;

use hlo_rendezvous::{KvClient, KvError, KvServer, ServerOptions};

use crate::error::{EngineError, Result};

pub use hlo_rendezvous::{Launch, LaunchError, LaunchFlags, LaunchSource, RunToken};

/// The live group: the key-value service's client (and, in process 0, the
/// service), alive for the whole run.
pub struct ProcessGroup {
    launch: Launch,
    kv: Arc<KvClient>,
    // Process 0 serves until every process has finished (`finish`).
    _server: Option<KvServer>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("launch", &self.launch)
            .finish()
    }
}

/// Where process 0 listens: the coordinator's own address and nothing
/// else (loopback for a loopback coordinator: tests, one node), so the
/// service is not offered on interfaces the other processes do not use.
fn bind_address(coordinator: &str) -> std::result::Result<SocketAddr, String> {
    let (host, port) = coordinator
        .rsplit_once(':')
        .ok_or_else(|| format!("{coordinator} is not HOST:PORT"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{coordinator} has no valid port"))?;
    if host == "localhost" {
        return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
    }
    let addrs: Vec<SocketAddr> = coordinator
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve the coordinator {coordinator}: {e}"))?
        .collect();
    // IPv4 first: what the other processes' clients connect to.
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("the coordinator {coordinator} resolves to no address"))
}

impl ProcessGroup {
    /// Meets the other processes: process 0 starts the service on the
    /// coordinator's port, every process connects and waits at a barrier
    /// until all have, within the launch's timeout. With a run token, every
    /// connection proves it first, so a process without it can neither take
    /// an id nor touch a key. Then a thread watches
    /// the others: a peer that dies ends this process with one line naming
    /// it (a blocked collective could not notice by itself).
    pub fn join(launch: &Launch) -> Result<Arc<ProcessGroup>> {
        let fail = |cause: KvError| EngineError::Rendezvous {
            launch: launch.describe(),
            cause,
        };
        let server = if launch.process_id == 0 {
            let bind = bind_address(&launch.coordinator).map_err(EngineError::Coordinator)?;
            let options = ServerOptions {
                run_token: launch.run_token.clone(),
                ..ServerOptions::default()
            };
            Some(KvServer::start_with(bind, launch.num_processes, options).map_err(fail)?)
        } else {
            None
        };
        let kv = KvClient::connect_with_token(
            &launch.coordinator,
            launch.process_id,
            launch.num_processes,
            launch.init_timeout,
            launch.run_token.clone(),
        )
        .map_err(fail)?;
        kv.barrier("join", launch.init_timeout).map_err(fail)?;
        let group = Arc::new(ProcessGroup {
            launch: launch.clone(),
            kv: Arc::new(kv),
            _server: server,
        });
        let watched = group.kv.clone();
        let who = launch.describe();
        std::thread::Builder::new()
            .name("hlo-train peers".into())
            .spawn(move || {
                if let Err(e) = watched.watch() {
                    // The run cannot go on without every process; say who
                    // left, once, and end this one too.
                    eprintln!("error: {who}: {e}");
                    std::process::exit(2);
                }
            })
            .map_err(|cause| EngineError::Thread {
                what: "the peer watcher",
                cause,
            })?;
        Ok(group)
    }

    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    pub fn process_id(&self) -> u32 {
        self.launch.process_id
    }

    pub fn num_processes(&self) -> u32 {
        self.launch.num_processes
    }

    /// Process 0 prints and writes for the run.
    pub fn is_main(&self) -> bool {
        self.launch.process_id == 0
    }

    /// The client the plugin's callbacks use.
    pub fn kv(&self) -> &Arc<KvClient> {
        &self.kv
    }

    /// Every process's `value` under `name`, in process order (each process
    /// calls this with its own).
    pub fn all_gather(&self, name: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let fail = |cause: KvError| EngineError::Rendezvous {
            launch: self.launch.describe(),
            cause,
        };
        self.kv
            .set(&format!("hlo-train/{name}/{}", self.process_id()), value)
            .map_err(fail)?;
        (0..self.num_processes())
            .map(|k| {
                self.kv
                    .get(&format!("hlo-train/{name}/{k}"), self.launch.init_timeout)
                    .map_err(fail)
            })
            .collect()
    }

    /// Says this process is done and waits for the others, so process 0
    /// serves until the last one is finished.
    pub fn finish(&self) -> Result<()> {
        self.kv
            .shutdown(self.launch.init_timeout)
            .map_err(|cause| EngineError::Rendezvous {
                launch: self.launch.describe(),
                cause,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_zero_binds_the_coordinators_address_only() {
        assert_eq!(
            bind_address("127.0.0.1:5000").unwrap(),
            "127.0.0.1:5000".parse().unwrap()
        );
        assert_eq!(
            bind_address("localhost:5000").unwrap(),
            "127.0.0.1:5000".parse().unwrap()
        );
        // Elsewhere: that address alone, never every interface.
        assert_eq!(
            bind_address("10.1.2.3:5000").unwrap(),
            "10.1.2.3:5000".parse().unwrap()
        );
        assert!(bind_address("10.1.2.3").is_err());
    }
}
