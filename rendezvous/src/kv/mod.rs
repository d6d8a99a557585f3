//! A small TCP key-value service with which the processes of one run meet.
//!
//! Process 0 runs a [`KvServer`]; every process (0 included) holds a
//! [`KvClient`]. The PJRT GPU plugins exchange their topology and NCCL ids
//! through it (their `kv_get`/`kv_put` callbacks, which `hlo-runtime`
//! implements over a [`KvClient`]), and the engine uses its
//! barriers, its [`KvClient::shutdown`] and [`KvClient::watch`] to start and
//! end a run together, and to stop at once when a peer dies.
//!
//! ```
//! use std::time::Duration;
//! use hlo_rendezvous::{KvClient, KvServer};
//!
//! let server = KvServer::start("127.0.0.1:0".parse().unwrap(), 1)?;
//! let addr = server.local_addr().to_string();
//! let client = KvClient::connect(&addr, 0, 1, Duration::from_secs(5))?;
//! client.set("nccl/id", b"\x01\x02")?;
//! assert_eq!(client.get("nccl/id", Duration::from_secs(1))?, b"\x01\x02");
//! client.barrier("start", Duration::from_secs(5))?;
//! client.shutdown(Duration::from_secs(5))?;
//! # Ok::<(), hlo_rendezvous::KvError>(())
//! ```
//!
//! Design, briefly: std threads and blocking sockets. Each client keeps one
//! *membership* connection open from `connect` until it is dropped; the server
//! learns from that connection closing (the OS closes it when a process dies)
//! that a process left without [`KvClient::shutdown`], and fails everyone's
//! waits with [`KvError::PeerLost`]. Requests go over a small pool of other
//! connections, one request in flight per connection, so blocking gets from
//! many threads do not queue behind each other. The server enforces each
//! request's timeout itself and sends a heartbeat byte every second while a
//! request waits, so the client can use a short read timeout and notice a
//! dead coordinator ([`KvError::CoordinatorLost`]) whatever the request's
//! timeout.
//!
//! A run token ([`crate::RunToken`], [`KvServer::start_with`],
//! [`KvClient::connect_with_token`]) guards every connection: nothing on one
//! is heard before the client has proved it holds the token, so a process
//! without it can neither take a process id nor touch a key. The server also
//! caps the bytes it holds ([`MAX_STORED_BYTES`] by default), and a process
//! started for another process count fails every process's waits at once
//! ([`KvError::CountMismatch`]).
//!
//! Wire format (big-endian). Every connection opens with a handshake:
//!
//! 1. server: `magic "HKV2", needs_token: u8, server_nonce: [u8; 32]`
//!    (a fresh nonce from `/dev/urandom`; zeros without a token);
//! 2. client: `magic "HKV2", has_token: u8, client_nonce: [u8; 32],
//!    proof: [u8; 32]`, the proof being HMAC-SHA256(token, "hlo-train
//!    rendezvous: client proof" ‖ server_nonce ‖ client_nonce) (zeros without
//!    a token). A client whose token presence differs from the greeting's
//!    stops there with [`KvError::TokenRequired`] or
//!    [`KvError::TokenUnexpected`];
//! 3. server: a response (below), `OK` with the server's proof
//!    HMAC-SHA256(token, "hlo-train rendezvous: server proof" ‖ server_nonce
//!    ‖ client_nonce) (empty without a token), which the client checks
//!    ([`KvError::ServerUnproven`]), or `AUTH_FAILED`, after which the server
//!    closes the connection ([`KvError::TokenMismatch`]). The server compares
//!    proofs in constant time, and gives a connection 10 s to answer.
//!
//! The token itself never crosses the wire; the labels keep one side's
//! proof from passing for the other's, and the nonces keep a recorded proof
//! from passing on another connection. Then requests follow: a request is
//! `op: u8, process: u32, timeout_ms: u64 (u64::MAX = none), key_len: u32,
//! key, value_len: u64, value`; a response is `status: u8` followed, unless
//! it is a heartbeat, by `payload_len: u64, payload`.
//!
//! The modules split along that design: `wire` (frames and their limits),
//! `server` and `client` (each side, over `wire`), `error`; the token's
//! proofs are `crate::token`'s.

mod client;
mod error;
mod server;
#[cfg(test)]
mod tests;
mod wire;

pub use client::KvClient;
pub use error::KvError;
pub use server::{KvServer, ServerOptions};
pub use wire::{MAX_STORED_BYTES, MAX_VALUE_BYTES};
