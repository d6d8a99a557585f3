//! Every process's side: [`KvClient`], one membership connection and a
//! pool of request connections.

use std::fmt;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::error::KvError;
use super::wire::{
    check_sizes, one_u32, op, read_greeting, read_response, status, two_u64, u32s_from_bytes,
    wire_ms, write_auth, write_request, ReadError, MAGIC, NO_TIMEOUT,
};
use crate::token::{self, RunToken, CLIENT_LABEL, PROOF_BYTES, SERVER_LABEL};

/// A client that hears nothing for this long (no heartbeat either) takes the
/// coordinator for dead.
const CLIENT_IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Time to open a pool connection once the run is up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between connection attempts while the coordinator is not up yet.
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// Idle pool connections kept per client; more are closed after use.
const MAX_IDLE: usize = 8;

/// One process's handle on the service. It is `Send + Sync`: many threads
/// (PJRT's among them) may call it at once; each call in flight uses a
/// connection of its own.
///
/// Dropping it without [`KvClient::shutdown`] tells the others that this
/// process left the run ([`KvError::PeerLost`]).
pub struct KvClient {
    coordinator: String,
    addr: SocketAddr,
    process_id: u32,
    num_processes: u32,
    /// Held open only so that the server sees it close when we go.
    membership: TcpStream,
    /// Proved on every connection this client opens.
    token: Option<RunToken>,
    idle: Mutex<Vec<TcpStream>>,
    /// Our shutdown succeeded: the coordinator going away is then expected.
    finished: AtomicBool,
}

impl fmt::Debug for KvClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvClient")
            .field("coordinator", &self.coordinator)
            .field("process_id", &self.process_id)
            .field("num_processes", &self.num_processes)
            .finish_non_exhaustive()
    }
}

/// How a handshake failed: a connection that may be tried again, or an
/// answer that will not change.
enum Handshake {
    Io(io::Error),
    Fatal(KvError),
}

impl From<io::Error> for Handshake {
    fn from(e: io::Error) -> Self {
        Handshake::Io(e)
    }
}

/// A new connection's opening: reads the server's greeting, proves this
/// process's run token for its nonce (or says it has none), and checks the
/// server's proof in turn. The token itself is never sent.
fn handshake(
    s: &mut TcpStream,
    token: Option<&RunToken>,
    coordinator: &str,
) -> Result<(), Handshake> {
    let addr = coordinator.to_owned();
    let (needs_token, server_nonce) = match read_greeting(s) {
        Ok(greeting) => greeting,
        Err(ReadError::Protocol(msg)) => {
            return Err(Handshake::Fatal(KvError::Protocol(format!(
                "{coordinator}: {msg}"
            ))))
        }
        Err(ReadError::Eof) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
        Err(ReadError::Io(e)) => return Err(e.into()),
    };
    let proof = match (token, needs_token) {
        (None, false) => None,
        (None, true) => return Err(Handshake::Fatal(KvError::TokenRequired { addr })),
        (Some(_), false) => return Err(Handshake::Fatal(KvError::TokenUnexpected { addr })),
        (Some(t), true) => {
            let nonce = token::nonce().map_err(|e| Handshake::Fatal(e.into()))?;
            Some((nonce, t.proof(CLIENT_LABEL, &server_nonce, &nonce)))
        }
    };
    write_auth(s, proof.as_ref())?;
    let (st, payload) = match read_response(s) {
        Ok(answer) => answer,
        Err(ReadError::Protocol(msg)) => return Err(Handshake::Fatal(KvError::Protocol(msg))),
        Err(ReadError::Eof) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
        Err(ReadError::Io(e)) => return Err(e.into()),
    };
    match st {
        status::OK => {}
        status::AUTH_FAILED => return Err(Handshake::Fatal(KvError::TokenMismatch { addr })),
        status::PROTOCOL => {
            return Err(Handshake::Fatal(KvError::Protocol(
                String::from_utf8_lossy(&payload).into_owned(),
            )))
        }
        other => {
            return Err(Handshake::Fatal(KvError::Protocol(format!(
                "greeting answered with {other}"
            ))))
        }
    }
    // Mutual: a server that cannot prove the token is not this run's.
    if let (Some(t), Some((nonce, _))) = (token, proof) {
        let proved = <&[u8; PROOF_BYTES]>::try_from(payload.as_slice())
            .is_ok_and(|p| t.verify(SERVER_LABEL, &server_nonce, &nonce, p));
        if !proved {
            return Err(Handshake::Fatal(KvError::ServerUnproven { addr }));
        }
    }
    Ok(())
}

/// One attempt: resolve (DNS may not be ready yet either) and connect.
fn connect_once(coordinator: &str, within: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address");
    for addr in coordinator.to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, within) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// One attempt at the membership connection: connects within what is left
/// of `timeout` since `start`, proves the token, and sends the hello that
/// registers `process_id`. Its answer is read by [`read_hello_answer`].
fn say_hello(
    coordinator: &str,
    process_id: u32,
    num_processes: u32,
    timeout: Duration,
    start: Instant,
    token: Option<&RunToken>,
) -> Result<TcpStream, Handshake> {
    let left = timeout.saturating_sub(start.elapsed());
    let mut s = connect_once(
        coordinator,
        left.clamp(Duration::from_millis(10), Duration::from_secs(1)),
    )?;
    let _ = s.set_nodelay(true);
    // The server answers a hello at once, but give a slow
    // start-up a moment beyond the caller's deadline.
    let wait = timeout
        .saturating_sub(start.elapsed())
        .max(Duration::from_secs(1));
    s.set_read_timeout(Some(wait))?;
    s.set_write_timeout(Some(wait))?;
    handshake(&mut s, token, coordinator)?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&num_processes.to_be_bytes());
    write_request(&mut s, op::HELLO, process_id, NO_TIMEOUT, "", &hello)?;
    Ok(s)
}

/// The coordinator's answer to our hello: whether it took this process's
/// id. A connection lost here is the coordinator being `unreachable`; a
/// refusal or another process count is its final word.
fn read_hello_answer(
    stream: &mut TcpStream,
    unreachable: impl Fn(String) -> KvError,
) -> Result<(), KvError> {
    let (st, payload) = match read_response(stream) {
        Ok(answer) => answer,
        Err(ReadError::Protocol(msg)) => return Err(KvError::Protocol(msg)),
        Err(ReadError::Eof) => return Err(unreachable("connection closed".into())),
        Err(ReadError::Io(e)) => return Err(unreachable(e.to_string())),
    };
    match st {
        status::OK => Ok(()),
        status::REFUSED => Err(KvError::Refused {
            reason: String::from_utf8_lossy(&payload).into_owned(),
        }),
        status::COUNT_MISMATCH => Err(count_mismatch(&payload)?),
        status::PROTOCOL => Err(KvError::Protocol(
            String::from_utf8_lossy(&payload).into_owned(),
        )),
        other => Err(KvError::Protocol(format!("hello answered with {other}"))),
    }
}

impl KvClient {
    /// Connects to `coordinator` (`"HOST:PORT"`) as process `process_id` of
    /// `num_processes` and registers that id. Connections that are refused or
    /// fail are retried every ~100 ms until `timeout`, since process 0 may
    /// start after the others.
    ///
    /// Errors: [`KvError::Unreachable`] if the coordinator did not answer in
    /// time; [`KvError::Refused`] if the id is out of range or already taken
    /// by a live process; [`KvError::CountMismatch`] if the coordinator runs
    /// another number of processes; [`KvError::TokenRequired`] if it requires
    /// a run token (see [`KvClient::connect_with_token`]).
    pub fn connect(
        coordinator: &str,
        process_id: u32,
        num_processes: u32,
        timeout: Duration,
    ) -> Result<KvClient, KvError> {
        Self::connect_with_token(coordinator, process_id, num_processes, timeout, None)
    }

    /// [`KvClient::connect`], proving `token` on every connection (and
    /// checking that the coordinator holds it too). Further errors:
    /// [`KvError::TokenMismatch`], [`KvError::TokenUnexpected`] (the
    /// coordinator takes no token), [`KvError::ServerUnproven`].
    pub fn connect_with_token(
        coordinator: &str,
        process_id: u32,
        num_processes: u32,
        timeout: Duration,
        token: Option<RunToken>,
    ) -> Result<KvClient, KvError> {
        if process_id >= num_processes {
            return Err(KvError::Refused {
                reason: format!(
                    "process id {process_id} is out of range for a run of {num_processes} processes"
                ),
            });
        }
        let start = Instant::now();
        let unreachable = |cause: String| KvError::Unreachable {
            process: process_id,
            num_processes,
            addr: coordinator.to_owned(),
            waited: timeout,
            cause,
        };
        let mut stream = loop {
            let attempt = say_hello(
                coordinator,
                process_id,
                num_processes,
                timeout,
                start,
                token.as_ref(),
            );
            match attempt {
                Ok(s) => break s,
                Err(Handshake::Fatal(e)) => return Err(e),
                Err(Handshake::Io(e)) if e.kind() == io::ErrorKind::InvalidInput => {
                    // A malformed address does not get better with retries.
                    return Err(unreachable(e.to_string()));
                }
                Err(Handshake::Io(e)) => {
                    let left = timeout.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        return Err(unreachable(e.to_string()));
                    }
                    thread::sleep(left.min(RETRY_EVERY));
                }
            }
        };
        read_hello_answer(&mut stream, unreachable)?;
        // Nobody reads the membership connection: no timeouts on it.
        stream.set_read_timeout(None)?;
        let addr = stream.peer_addr()?;
        Ok(KvClient {
            coordinator: coordinator.to_owned(),
            addr,
            process_id,
            num_processes,
            membership: stream,
            token,
            idle: Mutex::new(Vec::new()),
            finished: AtomicBool::new(false),
        })
    }

    /// This process's id in the run.
    pub fn process_id(&self) -> u32 {
        self.process_id
    }

    /// How many processes the run has.
    pub fn num_processes(&self) -> u32 {
        self.num_processes
    }

    /// Sets `key` to `value` (any bytes, empty allowed, up to 1 GiB). A
    /// repeated key overwrites: the last set wins, and gets already woken by
    /// an earlier set keep the value they got.
    ///
    /// Fails with [`KvError::Full`] when the service would then hold more
    /// than its byte cap ([`crate::kv::MAX_STORED_BYTES`] by default).
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), KvError> {
        check_sizes(key, value)?;
        let (st, payload) = self.request(op::SET, NO_TIMEOUT, key, value)?;
        if st == status::FULL {
            let (stored, limit) = two_u64(&payload)?;
            return Err(KvError::Full {
                key: key.to_owned(),
                bytes: (key.len() + value.len()) as u64,
                stored,
                limit,
            });
        }
        self.expect_ok(st, payload).map(drop)
    }

    /// Blocks until `key` is set and returns its value, or fails with
    /// [`KvError::Timeout`] after `timeout`. Fails at once with
    /// [`KvError::PeerLost`] once a peer has left the run without shutting
    /// down.
    ///
    /// ```no_run
    /// # fn f(kv: &hlo_rendezvous::KvClient) -> Result<(), hlo_rendezvous::KvError> {
    /// let id = kv.get("nccl/unique_id/0", std::time::Duration::from_secs(60))?;
    /// # Ok(()) }
    /// ```
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, KvError> {
        check_sizes(key, &[])?;
        let (st, payload) = self.request(op::GET, wire_ms(timeout), key, &[])?;
        match st {
            status::TIMEOUT => Err(KvError::Timeout {
                key: key.to_owned(),
                waited: timeout,
            }),
            _ => self.expect_ok(st, payload),
        }
    }

    /// The value of `key` if it is set now, else `None`; never blocks.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, KvError> {
        check_sizes(key, &[])?;
        let (st, payload) = self.request(op::TRY_GET, NO_TIMEOUT, key, &[])?;
        match st {
            status::NOT_FOUND => Ok(None),
            _ => self.expect_ok(st, payload).map(Some),
        }
    }

    /// Waits until all processes have reached barrier `name`. A name may be
    /// used again only once the barrier has completed; prefer distinct names.
    /// On timeout, [`KvError::BarrierTimeout`] names the ids that never came.
    pub fn barrier(&self, name: &str, timeout: Duration) -> Result<(), KvError> {
        check_sizes(name, &[])?;
        let (st, payload) = self.request(op::BARRIER, wire_ms(timeout), name, &[])?;
        self.barrier_answer(name, timeout, st, payload)
    }

    /// Says this process is done and waits until every process has said so,
    /// so that process 0 keeps serving until the last peer is finished. On
    /// timeout, [`KvError::BarrierTimeout`] names the ids not done.
    pub fn shutdown(&self, timeout: Duration) -> Result<(), KvError> {
        let (st, payload) = self.request(op::SHUTDOWN, wire_ms(timeout), "", &[])?;
        self.barrier_answer("shutdown", timeout, st, payload)?;
        self.finished.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Blocks until a peer leaves the run without shutting down and returns
    /// [`KvError::PeerLost`] naming it, or [`KvError::CoordinatorLost`] if the
    /// service itself went away; `Ok(())` once the run has shut down normally.
    /// Meant for a thread of its own.
    pub fn watch(&self) -> Result<(), KvError> {
        match self.request(op::WATCH, NO_TIMEOUT, "", &[]) {
            Ok((st, payload)) => self.expect_ok(st, payload).map(drop),
            // The coordinator goes away as soon as everyone is done.
            Err(KvError::CoordinatorLost { .. }) if self.finished.load(Ordering::SeqCst) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn barrier_answer(
        &self,
        name: &str,
        timeout: Duration,
        st: u8,
        payload: Vec<u8>,
    ) -> Result<(), KvError> {
        match st {
            status::BARRIER_TIMEOUT => Err(KvError::BarrierTimeout {
                name: name.to_owned(),
                missing: u32s_from_bytes(&payload)?,
                num_processes: self.num_processes,
                waited: timeout,
            }),
            _ => self.expect_ok(st, payload).map(drop),
        }
    }

    /// The payload of an OK answer; the error for the answers every request
    /// may get.
    fn expect_ok(&self, st: u8, payload: Vec<u8>) -> Result<Vec<u8>, KvError> {
        match st {
            status::OK => Ok(payload),
            status::PEER_LOST => Err(KvError::PeerLost {
                process: one_u32(&payload)?,
            }),
            status::COUNT_MISMATCH => Err(count_mismatch(&payload)?),
            status::PROTOCOL => Err(KvError::Protocol(
                String::from_utf8_lossy(&payload).into_owned(),
            )),
            other => Err(KvError::Protocol(format!("unexpected answer {other}"))),
        }
    }

    fn lost(&self) -> KvError {
        KvError::CoordinatorLost {
            addr: self.coordinator.clone(),
        }
    }

    /// Sends one request on a connection of its own and reads the answer.
    fn request(
        &self,
        op: u8,
        timeout_ms: u64,
        key: &str,
        value: &[u8],
    ) -> Result<(u8, Vec<u8>), KvError> {
        let mut conn = self.checkout()?;
        write_request(&mut conn, op, self.process_id, timeout_ms, key, value)
            .map_err(|_| self.lost())?;
        let answer = match read_response(&mut conn) {
            Ok(answer) => answer,
            Err(ReadError::Protocol(msg)) => return Err(KvError::Protocol(msg)),
            Err(ReadError::Eof | ReadError::Io(_)) => return Err(self.lost()),
        };
        // A protocol complaint from the server means it closed this one.
        if answer.0 != status::PROTOCOL {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            if idle.len() < MAX_IDLE {
                idle.push(conn);
            }
        }
        Ok(answer)
    }

    fn checkout(&self) -> Result<TcpStream, KvError> {
        let pooled = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        if let Some(conn) = pooled {
            return Ok(conn);
        }
        let mut conn =
            TcpStream::connect_timeout(&self.addr, CONNECT_TIMEOUT).map_err(|_| self.lost())?;
        conn.set_nodelay(true)?;
        // The server sends heartbeats while a request waits, so silence this
        // long means it is gone, whatever the request's own timeout.
        conn.set_read_timeout(Some(CLIENT_IO_TIMEOUT))?;
        conn.set_write_timeout(Some(CLIENT_IO_TIMEOUT))?;
        match handshake(&mut conn, self.token.as_ref(), &self.coordinator) {
            Ok(()) => Ok(conn),
            Err(Handshake::Io(_)) => Err(self.lost()),
            Err(Handshake::Fatal(e)) => Err(e),
        }
    }
}

/// The error of a `COUNT_MISMATCH` answer: the process, its count, ours.
fn count_mismatch(payload: &[u8]) -> Result<KvError, KvError> {
    match u32s_from_bytes(payload)?.as_slice() {
        &[process, theirs, ours] => Ok(KvError::CountMismatch {
            process,
            theirs,
            ours,
        }),
        _ => Err(KvError::Protocol(
            "a count mismatch without its counts".into(),
        )),
    }
}

impl Drop for KvClient {
    fn drop(&mut self) {
        // Closing the membership connection is how the server learns we left.
        let _ = self.membership.shutdown(Shutdown::Both);
    }
}
