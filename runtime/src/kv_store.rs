//! A small TCP key-value service with which the processes of one run meet.
//!
//! Process 0 runs a [`KvServer`]; every process (0 included) holds a
//! [`KvClient`]. The PJRT GPU plugins exchange their topology and NCCL ids
//! through it (their `kv_get`/`kv_put` callbacks), and the engine uses its
//! barriers, its [`KvClient::shutdown`] and [`KvClient::watch`] to start and
//! end a run together, and to stop at once when a peer dies.
//!
//! ```
//! use std::time::Duration;
//! use hlo_runtime::{KvClient, KvServer};
//!
//! let server = KvServer::start("127.0.0.1:0".parse().unwrap(), 1)?;
//! let addr = server.local_addr().to_string();
//! let client = KvClient::connect(&addr, 0, 1, Duration::from_secs(5))?;
//! client.set("nccl/id", b"\x01\x02")?;
//! assert_eq!(client.get("nccl/id", Duration::from_secs(1))?, b"\x01\x02");
//! client.barrier("start", Duration::from_secs(5))?;
//! client.shutdown(Duration::from_secs(5))?;
//! # Ok::<(), hlo_runtime::KvError>(())
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
//! Wire format (big-endian): a request is `op: u8, process: u32,
//! timeout_ms: u64 (u64::MAX = none), key_len: u32, key, value_len: u64,
//! value`; a response is `status: u8` followed, unless it is a heartbeat, by
//! `payload_len: u64, payload`.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::io::{self, BufReader, Read, Write};
use std::net::ToSocketAddrs;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// The largest value `set` accepts.
pub const MAX_VALUE_BYTES: u64 = 1 << 30;
/// The longest key (in UTF-8 bytes).
const MAX_KEY_BYTES: u32 = 1 << 20;
/// How often the server tells a waiting client that it is still there.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// A client that hears nothing for this long (no heartbeat either) takes the
/// coordinator for dead.
const CLIENT_IO_TIMEOUT: Duration = Duration::from_secs(10);
/// A server write that makes no progress for this long means the client is gone.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Time to open a pool connection once the run is up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between connection attempts while the coordinator is not up yet.
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// Idle pool connections kept per client; more are closed after use.
const MAX_IDLE: usize = 8;
/// How long a dropped server waits for the last `shutdown` answers to go out.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// Sent with `hello`, so that something else listening on the port is not
/// taken for a coordinator (and a future format change is caught).
const MAGIC: [u8; 4] = *b"HKV1";
/// No timeout, on the wire.
const NO_TIMEOUT: u64 = u64::MAX;

mod op {
    pub const HELLO: u8 = 1;
    pub const SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const TRY_GET: u8 = 4;
    pub const BARRIER: u8 = 5;
    pub const SHUTDOWN: u8 = 6;
    pub const WATCH: u8 = 7;
}

mod status {
    pub const OK: u8 = 0;
    pub const NOT_FOUND: u8 = 1;
    pub const TIMEOUT: u8 = 2;
    pub const BARRIER_TIMEOUT: u8 = 3;
    pub const PEER_LOST: u8 = 4;
    pub const REFUSED: u8 = 5;
    pub const PROTOCOL: u8 = 6;
    pub const HEARTBEAT: u8 = 7;
}

/// What can go wrong while processes meet. Each message is one line naming
/// the process, key or address concerned.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("coordination service: {0}")]
    Io(#[from] io::Error),

    #[error(
        "process {process} of {num_processes} could not reach the coordinator {addr} within {} ({cause})",
        secs(.waited)
    )]
    Unreachable {
        process: u32,
        num_processes: u32,
        addr: String,
        waited: Duration,
        /// The last connection error, e.g. "Connection refused (os error 111)".
        cause: String,
    },

    #[error("the coordinator refused this process: {reason}")]
    Refused { reason: String },

    #[error("timed out after {} waiting for key `{key}`", secs(.waited))]
    Timeout { key: String, waited: Duration },

    #[error(
        "{} of {num_processes} never reached `{name}` within {}",
        processes(.missing),
        secs(.waited)
    )]
    BarrierTimeout {
        name: String,
        /// The ids that did not arrive, ascending.
        missing: Vec<u32>,
        num_processes: u32,
        waited: Duration,
    },

    #[error("process {process} left the run without finishing")]
    PeerLost { process: u32 },

    #[error("lost the connection to the coordinator {addr}")]
    CoordinatorLost { addr: String },

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

/// A timeout as sent on the wire: whole milliseconds, rounded up so that a
/// wait never ends before the caller's timeout.
fn wire_ms(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(NO_TIMEOUT).min(NO_TIMEOUT - 1)
}

// ---------------------------------------------------------------------------
// Frames
// ---------------------------------------------------------------------------

struct Request {
    op: u8,
    process: u32,
    timeout_ms: u64,
    key: String,
    value: Vec<u8>,
}

enum ReadError {
    /// The peer closed the connection between frames.
    Eof,
    Io(io::Error),
    Protocol(String),
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

fn write_request(
    w: &mut impl Write,
    op: u8,
    process: u32,
    timeout_ms: u64,
    key: &str,
    value: &[u8],
) -> io::Result<()> {
    let mut head = Vec::with_capacity(25 + key.len() + value.len().min(1 << 16));
    head.push(op);
    head.extend_from_slice(&process.to_be_bytes());
    head.extend_from_slice(&timeout_ms.to_be_bytes());
    // Lengths were checked by the caller (`check_sizes`).
    head.extend_from_slice(&(key.len() as u32).to_be_bytes());
    head.extend_from_slice(key.as_bytes());
    head.extend_from_slice(&(value.len() as u64).to_be_bytes());
    write_with_payload(w, head, value)
}

/// Writes `head` then `payload`: a small payload in the same write, a large
/// one not copied.
fn write_with_payload(w: &mut impl Write, mut head: Vec<u8>, payload: &[u8]) -> io::Result<()> {
    if payload.len() <= 1 << 16 {
        head.extend_from_slice(payload);
        w.write_all(&head)
    } else {
        w.write_all(&head)?;
        w.write_all(payload)
    }
}

/// Reads one byte; `None` on a clean end of stream.
fn read_first_byte(r: &mut impl Read) -> io::Result<Option<u8>> {
    let mut b = [0u8; 1];
    loop {
        match r.read(&mut b) {
            Ok(0) => return Ok(None),
            Ok(_) => return Ok(Some(b[0])),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// Reads exactly `len` bytes, growing the buffer as they come, so that a
/// bogus length does not allocate a gigabyte up front.
fn read_bytes(r: &mut impl Read, len: u64) -> io::Result<Vec<u8>> {
    let mut buf = Vec::with_capacity(len.min(1 << 20) as usize);
    r.take(len).read_to_end(&mut buf)?;
    if buf.len() as u64 != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed inside a frame",
        ));
    }
    Ok(buf)
}

fn read_request(r: &mut impl Read) -> Result<Request, ReadError> {
    let Some(op) = read_first_byte(r)? else {
        return Err(ReadError::Eof);
    };
    if !(op::HELLO..=op::WATCH).contains(&op) {
        return Err(ReadError::Protocol(format!("unknown request {op}")));
    }
    let process = read_u32(r)?;
    let timeout_ms = read_u64(r)?;
    let key_len = read_u32(r)?;
    if key_len > MAX_KEY_BYTES {
        return Err(ReadError::Protocol(format!(
            "key of {key_len} bytes (the limit is {MAX_KEY_BYTES})"
        )));
    }
    let key = String::from_utf8(read_bytes(r, u64::from(key_len))?)
        .map_err(|_| ReadError::Protocol("key is not UTF-8".into()))?;
    let value_len = read_u64(r)?;
    if value_len > MAX_VALUE_BYTES {
        return Err(ReadError::Protocol(format!(
            "value of {value_len} bytes for key `{key}` (the limit is 1 GiB)"
        )));
    }
    let value = read_bytes(r, value_len)?;
    Ok(Request {
        op,
        process,
        timeout_ms,
        key,
        value,
    })
}

fn write_response(w: &mut impl Write, status: u8, payload: &[u8]) -> io::Result<()> {
    let mut head = Vec::with_capacity(9 + payload.len().min(1 << 16));
    head.push(status);
    head.extend_from_slice(&(payload.len() as u64).to_be_bytes());
    write_with_payload(w, head, payload)
}

/// Reads a response, skipping heartbeats.
fn read_response(r: &mut impl Read) -> Result<(u8, Vec<u8>), ReadError> {
    loop {
        let Some(status) = read_first_byte(r)? else {
            return Err(ReadError::Eof);
        };
        match status {
            status::HEARTBEAT => continue,
            status::OK..=status::PROTOCOL => {}
            other => return Err(ReadError::Protocol(format!("unknown response {other}"))),
        }
        let len = read_u64(r)?;
        if len > MAX_VALUE_BYTES {
            return Err(ReadError::Protocol(format!("response of {len} bytes")));
        }
        return Ok((status, read_bytes(r, len)?));
    }
}

fn u32s_to_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|id| id.to_be_bytes()).collect()
}

fn u32s_from_bytes(b: &[u8]) -> Result<Vec<u32>, KvError> {
    if !b.len().is_multiple_of(4) {
        return Err(KvError::Protocol(format!(
            "a list of process ids of {} bytes",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn one_u32(b: &[u8]) -> Result<u32, KvError> {
    match u32s_from_bytes(b)?.as_slice() {
        [id] => Ok(*id),
        _ => Err(KvError::Protocol("expected one process id".into())),
    }
}

fn check_sizes(key: &str, value: &[u8]) -> Result<(), KvError> {
    if key.len() > MAX_KEY_BYTES as usize {
        return Err(KvError::Protocol(format!(
            "key of {} bytes is longer than the limit of {MAX_KEY_BYTES}",
            key.len()
        )));
    }
    if value.len() as u64 > MAX_VALUE_BYTES {
        return Err(KvError::Protocol(format!(
            "value of {} bytes for key `{key}` is larger than the limit of 1 GiB",
            value.len()
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

/// Process 0's service. Dropping it stops the listener thread and closes every
/// connection, so that clients still waiting see [`KvError::CoordinatorLost`].
pub struct KvServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    listener: Option<JoinHandle<()>>,
}

struct Shared {
    num_processes: u32,
    state: Mutex<State>,
    changed: Condvar,
    /// Every open connection, so that drop can close them (their threads are
    /// blocked in reads we cannot otherwise interrupt).
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    stopping: AtomicBool,
}

#[derive(Clone, Copy, Default)]
struct Member {
    /// Its membership connection is open.
    live: bool,
    /// It called shutdown: its connection closing later is no loss.
    done: bool,
    /// Its membership connection closed before it was done.
    lost: bool,
    /// Its shutdown answer has been written (drop waits for these).
    acked: bool,
}

#[derive(Default)]
struct Barrier {
    /// Bumped each time the barrier completes; waiters wait for a change.
    generation: u64,
    arrived: BTreeSet<u32>,
}

#[derive(Default)]
struct State {
    values: HashMap<String, Arc<Vec<u8>>>,
    /// Waiting gets by key; a set hands its value to each of them once.
    waiters: HashMap<String, Vec<u64>>,
    /// Values handed to waiters that have not picked them up yet.
    delivered: HashMap<u64, Arc<Vec<u8>>>,
    next_waiter: u64,
    barriers: HashMap<String, Barrier>,
    members: Vec<Member>,
    /// The first process lost; it is the one every failure names.
    first_lost: Option<u32>,
    stopping: bool,
}

impl State {
    fn all_done(&self) -> bool {
        self.members.iter().all(|m| m.done)
    }

    fn not_done(&self) -> Vec<u32> {
        (0u32..)
            .zip(&self.members)
            .filter(|(_, m)| !m.done)
            .map(|(id, _)| id)
            .collect()
    }

    fn remove_waiter(&mut self, key: &str, id: u64) {
        if let Some(ids) = self.waiters.get_mut(key) {
            ids.retain(|w| *w != id);
            if ids.is_empty() {
                self.waiters.remove(key);
            }
        }
        self.delivered.remove(&id);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>, d: Duration) -> MutexGuard<'a, State> {
        self.changed
            .wait_timeout(guard, d)
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }

    fn conns(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.conns.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl KvServer {
    /// Binds `bind` (port 0 = any free port; see [`KvServer::local_addr`]) for
    /// a run of `num_processes` processes, and serves it on threads of its own.
    pub fn start(bind: SocketAddr, num_processes: u32) -> Result<KvServer, KvError> {
        if num_processes == 0 {
            return Err(KvError::Refused {
                reason: "a run needs at least one process".into(),
            });
        }
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            num_processes,
            state: Mutex::new(State {
                members: vec![Member::default(); num_processes as usize],
                ..State::default()
            }),
            changed: Condvar::new(),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
        });
        let for_thread = Arc::clone(&shared);
        let handle = thread::Builder::new()
            .name("kv-listener".into())
            .spawn(move || accept_loop(&for_thread, &listener))?;
        Ok(KvServer {
            addr,
            shared,
            listener: Some(handle),
        })
    }

    /// The address it listens on (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many gets are waiting for a key right now (tests use it to know
    /// that their waiters are in place before setting keys).
    #[cfg(test)]
    fn waiting_gets(&self) -> usize {
        self.shared.lock().waiters.values().map(Vec::len).sum()
    }
}

impl Drop for KvServer {
    fn drop(&mut self) {
        // After a normal end, let the last shutdown answers reach the peers
        // before their connections are closed under them.
        {
            let deadline = Instant::now() + DRAIN_TIMEOUT;
            let mut state = self.shared.lock();
            while state.all_done()
                && !state.members.iter().all(|m| m.acked)
                && Instant::now() < deadline
            {
                let left = deadline.saturating_duration_since(Instant::now());
                state = self.shared.wait(state, left.min(Duration::from_millis(50)));
            }
            state.stopping = true;
        }
        self.shared.changed.notify_all();
        {
            // Under the lock, so the listener cannot register a connection
            // after we have closed the others.
            let mut conns = self.shared.conns();
            self.shared.stopping.store(true, Ordering::SeqCst);
            for (_, stream) in conns.drain() {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        // Wake the listener out of accept() with a connection of our own.
        let wake = match self.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), self.addr.port())
            }
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), self.addr.port())
            }
            _ => self.addr,
        };
        let woke = TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok();
        if let Some(handle) = self.listener.take() {
            // If we could not wake it, leave it: it exits at its next accept.
            if woke {
                let _ = handle.join();
            }
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else {
            // E.g. out of file descriptors: back off rather than spin.
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        {
            let mut conns = shared.conns();
            if shared.stopping.load(Ordering::SeqCst) {
                return;
            }
            match stream.try_clone() {
                Ok(clone) => {
                    conns.insert(id, clone);
                }
                Err(_) => continue,
            }
        }
        let for_thread = Arc::clone(shared);
        let spawned = thread::Builder::new()
            .name("kv-conn".into())
            .spawn(move || {
                serve_connection(&for_thread, stream);
                for_thread.conns().remove(&id);
            });
        if spawned.is_err() {
            if let Some(stream) = shared.conns().remove(&id) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
    }
}

fn serve_connection(shared: &Shared, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT));
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut out = stream;
    loop {
        let req = match read_request(&mut reader) {
            Ok(req) => req,
            Err(ReadError::Protocol(msg)) => {
                // Tell the sender why, then drop this connection only.
                let _ = write_response(&mut out, status::PROTOCOL, msg.as_bytes());
                let _ = out.shutdown(Shutdown::Both);
                return;
            }
            Err(ReadError::Eof | ReadError::Io(_)) => return,
        };
        if req.op == op::HELLO {
            hello(shared, &req, reader, out);
            return;
        }
        let answered = match req.op {
            op::SET => {
                set(shared, req.key, req.value);
                write_response(&mut out, status::OK, &[])
            }
            op::TRY_GET => {
                let value = shared.lock().values.get(&req.key).cloned();
                match value {
                    Some(v) => write_response(&mut out, status::OK, &v),
                    None => write_response(&mut out, status::NOT_FOUND, &[]),
                }
            }
            op::GET => get(shared, &mut out, &req),
            op::BARRIER => barrier(shared, &mut out, &req),
            op::SHUTDOWN => shutdown(shared, &mut out, &req),
            op::WATCH => watch(shared, &mut out),
            _ => Err(io::Error::other("unknown request")),
        };
        if answered.is_err() {
            let _ = out.shutdown(Shutdown::Both);
            return;
        }
    }
}

/// Registers a process, then holds its membership connection until it closes.
fn hello(shared: &Shared, req: &Request, mut reader: BufReader<TcpStream>, mut out: TcpStream) {
    let n = shared.num_processes;
    let p = req.process;
    if req.value.len() != 8 || req.value[..4] != MAGIC {
        let _ = write_response(&mut out, status::PROTOCOL, b"not a hlo-train kv client");
        return;
    }
    let their_n = u32::from_be_bytes([req.value[4], req.value[5], req.value[6], req.value[7]]);
    let refusal = {
        let mut state = shared.lock();
        if their_n != n {
            Some(format!(
                "it runs {n} processes, but process {p} was started for {their_n}"
            ))
        } else if p >= n {
            Some(format!(
                "process id {p} is out of range for a run of {n} processes"
            ))
        } else {
            let m = &mut state.members[p as usize];
            if m.live {
                Some(format!("process id {p} is already taken by a live process"))
            } else if m.lost {
                Some(format!("process {p} already left this run"))
            } else if m.done {
                Some(format!("process {p} already finished this run"))
            } else {
                m.live = true;
                None
            }
        }
    };
    if let Some(reason) = refusal {
        let _ = write_response(&mut out, status::REFUSED, reason.as_bytes());
        return;
    }
    if write_response(&mut out, status::OK, &[]).is_ok() {
        // Nothing more is sent on this connection; we only wait for its end.
        let mut sink = [0u8; 64];
        loop {
            match reader.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
    }
    {
        let mut state = shared.lock();
        let state = &mut *state;
        let m = &mut state.members[p as usize];
        m.live = false;
        if !m.done && !state.stopping {
            m.lost = true;
            state.first_lost.get_or_insert(p);
        }
    }
    shared.changed.notify_all();
}

fn set(shared: &Shared, key: String, value: Vec<u8>) {
    let value = Arc::new(value);
    {
        let mut state = shared.lock();
        // Hand the value to the gets waiting now, once each, so a later set
        // of the same key neither wakes them again nor changes what they see.
        if let Some(ids) = state.waiters.remove(&key) {
            for id in ids {
                state.delivered.insert(id, Arc::clone(&value));
            }
        }
        state.values.insert(key, value);
    }
    shared.changed.notify_all();
}

/// Waits, under the state lock, until `step` has an answer. `step` gets the
/// state and whether the deadline has passed (then it must answer). Every
/// [`HEARTBEAT`] the lock is released to write a heartbeat byte. `None`: the
/// server is stopping or the client is gone; `cleanup` then undoes what the
/// wait registered.
fn wait_for<T>(
    shared: &Shared,
    out: &mut TcpStream,
    timeout_ms: u64,
    mut step: impl FnMut(&mut State, bool) -> Option<T>,
    mut cleanup: impl FnMut(&mut State),
) -> Option<T> {
    let start = Instant::now();
    let deadline = if timeout_ms == NO_TIMEOUT {
        None
    } else {
        start.checked_add(Duration::from_millis(timeout_ms))
    };
    let mut next_beat = start + HEARTBEAT;
    let mut state = shared.lock();
    loop {
        if state.stopping {
            cleanup(&mut state);
            return None;
        }
        let now = Instant::now();
        let expired = deadline.is_some_and(|d| now >= d);
        if let Some(answer) = step(&mut state, expired) {
            return Some(answer);
        }
        if now >= next_beat {
            drop(state);
            let alive = out.write_all(&[status::HEARTBEAT]).is_ok();
            state = shared.lock();
            if !alive {
                cleanup(&mut state);
                return None;
            }
            next_beat = Instant::now() + HEARTBEAT;
            continue;
        }
        let until = deadline.map_or(next_beat, |d| d.min(next_beat));
        state = shared.wait(state, until.saturating_duration_since(now));
    }
}

fn not_answered() -> io::Error {
    io::Error::other("stopping or client gone")
}

fn get(shared: &Shared, out: &mut TcpStream, req: &Request) -> io::Result<()> {
    let waiter = {
        let mut state = shared.lock();
        if let Some(p) = state.first_lost {
            drop(state);
            return write_response(out, status::PEER_LOST, &p.to_be_bytes());
        }
        if let Some(v) = state.values.get(&req.key).cloned() {
            drop(state);
            return write_response(out, status::OK, &v);
        }
        let id = state.next_waiter;
        state.next_waiter += 1;
        state.waiters.entry(req.key.clone()).or_default().push(id);
        id
    };
    let key = req.key.as_str();
    let answer = wait_for(
        shared,
        out,
        req.timeout_ms,
        |state, expired| {
            if let Some(v) = state.delivered.remove(&waiter) {
                return Some(Ok(v));
            }
            if let Some(p) = state.first_lost {
                state.remove_waiter(key, waiter);
                return Some(Err((status::PEER_LOST, p.to_be_bytes().to_vec())));
            }
            if expired {
                state.remove_waiter(key, waiter);
                return Some(Err((status::TIMEOUT, Vec::new())));
            }
            None
        },
        |state| state.remove_waiter(key, waiter),
    );
    match answer {
        Some(Ok(v)) => write_response(out, status::OK, &v),
        Some(Err((st, payload))) => write_response(out, st, &payload),
        None => Err(not_answered()),
    }
}

fn barrier(shared: &Shared, out: &mut TcpStream, req: &Request) -> io::Result<()> {
    let n = shared.num_processes;
    if req.process >= n {
        let msg = format!("barrier from process {} in a run of {n}", req.process);
        return write_response(out, status::PROTOCOL, msg.as_bytes());
    }
    let generation = {
        let mut state = shared.lock();
        if let Some(p) = state.first_lost {
            drop(state);
            return write_response(out, status::PEER_LOST, &p.to_be_bytes());
        }
        let b = state.barriers.entry(req.key.clone()).or_default();
        let generation = b.generation;
        b.arrived.insert(req.process);
        if b.arrived.len() == n as usize {
            b.generation += 1;
            b.arrived.clear();
            drop(state);
            shared.changed.notify_all();
            return write_response(out, status::OK, &[]);
        }
        generation
    };
    let key = req.key.as_str();
    // A process that times out stays counted as arrived: `missing` names those
    // that never came, whoever gave up first.
    let answer = wait_for(
        shared,
        out,
        req.timeout_ms,
        |state, expired| {
            let b = state.barriers.entry(key.to_owned()).or_default();
            if b.generation != generation {
                return Some((status::OK, Vec::new()));
            }
            let missing: Vec<u32> = (0..n).filter(|id| !b.arrived.contains(id)).collect();
            if let Some(p) = state.first_lost {
                return Some((status::PEER_LOST, p.to_be_bytes().to_vec()));
            }
            expired.then(|| (status::BARRIER_TIMEOUT, u32s_to_bytes(&missing)))
        },
        |_| {},
    );
    match answer {
        Some((st, payload)) => write_response(out, st, &payload),
        None => Err(not_answered()),
    }
}

fn shutdown(shared: &Shared, out: &mut TcpStream, req: &Request) -> io::Result<()> {
    let p = req.process;
    if p >= shared.num_processes {
        let msg = format!(
            "shutdown from process {p} in a run of {}",
            shared.num_processes
        );
        return write_response(out, status::PROTOCOL, msg.as_bytes());
    }
    {
        let mut state = shared.lock();
        if let Some(lost) = state.first_lost {
            drop(state);
            return write_response(out, status::PEER_LOST, &lost.to_be_bytes());
        }
        state.members[p as usize].done = true;
    }
    shared.changed.notify_all();
    let answer = wait_for(
        shared,
        out,
        req.timeout_ms,
        |state, expired| {
            if state.all_done() {
                return Some((status::OK, Vec::new()));
            }
            if let Some(lost) = state.first_lost {
                return Some((status::PEER_LOST, lost.to_be_bytes().to_vec()));
            }
            expired.then(|| (status::BARRIER_TIMEOUT, u32s_to_bytes(&state.not_done())))
        },
        |_| {},
    );
    let Some((st, payload)) = answer else {
        return Err(not_answered());
    };
    write_response(out, st, &payload)?;
    if st == status::OK {
        shared.lock().members[p as usize].acked = true;
        shared.changed.notify_all();
    }
    Ok(())
}

fn watch(shared: &Shared, out: &mut TcpStream) -> io::Result<()> {
    let answer = wait_for(
        shared,
        out,
        NO_TIMEOUT,
        |state, _| {
            if let Some(p) = state.first_lost {
                return Some((status::PEER_LOST, p.to_be_bytes().to_vec()));
            }
            state.all_done().then(|| (status::OK, Vec::new()))
        },
        |_| {},
    );
    match answer {
        Some((st, payload)) => write_response(out, st, &payload),
        None => Err(not_answered()),
    }
}

// ---------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------

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

impl fmt::Debug for KvServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvServer")
            .field("addr", &self.addr)
            .field("num_processes", &self.shared.num_processes)
            .finish_non_exhaustive()
    }
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

impl KvClient {
    /// Connects to `coordinator` (`"HOST:PORT"`) as process `process_id` of
    /// `num_processes` and registers that id. Connections that are refused or
    /// fail are retried every ~100 ms until `timeout`, since process 0 may
    /// start after the others.
    ///
    /// Errors: [`KvError::Unreachable`] if the coordinator did not answer in
    /// time; [`KvError::Refused`] if the id is out of range, already taken by a
    /// live process, or the coordinator runs another number of processes.
    pub fn connect(
        coordinator: &str,
        process_id: u32,
        num_processes: u32,
        timeout: Duration,
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
            let left = timeout.saturating_sub(start.elapsed());
            let attempt = connect_once(
                coordinator,
                left.clamp(Duration::from_millis(10), Duration::from_secs(1)),
            )
            .and_then(|mut s| {
                let _ = s.set_nodelay(true);
                // The server answers a hello at once, but give a slow
                // start-up a moment beyond the caller's deadline.
                let wait = timeout
                    .saturating_sub(start.elapsed())
                    .max(Duration::from_secs(1));
                s.set_read_timeout(Some(wait))?;
                s.set_write_timeout(Some(wait))?;
                let mut hello = MAGIC.to_vec();
                hello.extend_from_slice(&num_processes.to_be_bytes());
                write_request(&mut s, op::HELLO, process_id, NO_TIMEOUT, "", &hello)?;
                Ok(s)
            });
            match attempt {
                Ok(s) => break s,
                Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                    // A malformed address does not get better with retries.
                    return Err(unreachable(e.to_string()));
                }
                Err(e) => {
                    let left = timeout.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        return Err(unreachable(e.to_string()));
                    }
                    thread::sleep(left.min(RETRY_EVERY));
                }
            }
        };
        let (st, payload) = match read_response(&mut stream) {
            Ok(answer) => answer,
            Err(ReadError::Protocol(msg)) => return Err(KvError::Protocol(msg)),
            Err(ReadError::Eof) => return Err(unreachable("connection closed".into())),
            Err(ReadError::Io(e)) => return Err(unreachable(e.to_string())),
        };
        match st {
            status::OK => {}
            status::REFUSED => {
                return Err(KvError::Refused {
                    reason: String::from_utf8_lossy(&payload).into_owned(),
                })
            }
            status::PROTOCOL => {
                return Err(KvError::Protocol(
                    String::from_utf8_lossy(&payload).into_owned(),
                ))
            }
            other => return Err(KvError::Protocol(format!("hello answered with {other}"))),
        }
        // Nobody reads the membership connection: no timeouts on it.
        stream.set_read_timeout(None)?;
        let addr = stream.peer_addr()?;
        Ok(KvClient {
            coordinator: coordinator.to_owned(),
            addr,
            process_id,
            num_processes,
            membership: stream,
            idle: Mutex::new(Vec::new()),
            finished: AtomicBool::new(false),
        })
    }

    pub fn process_id(&self) -> u32 {
        self.process_id
    }

    pub fn num_processes(&self) -> u32 {
        self.num_processes
    }

    /// Sets `key` to `value` (any bytes, empty allowed, up to 1 GiB). A
    /// repeated key overwrites: the last set wins, and gets already woken by
    /// an earlier set keep the value they got.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), KvError> {
        check_sizes(key, value)?;
        let (st, payload) = self.request(op::SET, NO_TIMEOUT, key, value)?;
        self.expect_ok(st, payload).map(drop)
    }

    /// Blocks until `key` is set and returns its value, or fails with
    /// [`KvError::Timeout`] after `timeout`. Fails at once with
    /// [`KvError::PeerLost`] once a peer has left the run without shutting
    /// down.
    ///
    /// ```no_run
    /// # fn f(kv: &hlo_runtime::KvClient) -> Result<(), hlo_runtime::KvError> {
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
        let conn =
            TcpStream::connect_timeout(&self.addr, CONNECT_TIMEOUT).map_err(|_| self.lost())?;
        conn.set_nodelay(true)?;
        // The server sends heartbeats while a request waits, so silence this
        // long means it is gone, whatever the request's own timeout.
        conn.set_read_timeout(Some(CLIENT_IO_TIMEOUT))?;
        conn.set_write_timeout(Some(CLIENT_IO_TIMEOUT))?;
        Ok(conn)
    }
}

impl Drop for KvClient {
    fn drop(&mut self) {
        // Closing the membership connection is how the server learns we left.
        let _ = self.membership.shutdown(Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    const SEC5: Duration = Duration::from_secs(5);

    fn server(n: u32) -> (KvServer, String) {
        let server = KvServer::start("127.0.0.1:0".parse().unwrap(), n).unwrap();
        let addr = server.local_addr().to_string();
        (server, addr)
    }

    fn clients(addr: &str, n: u32) -> Vec<Arc<KvClient>> {
        (0..n)
            .map(|p| Arc::new(KvClient::connect(addr, p, n, SEC5).unwrap()))
            .collect()
    }

    /// Waits (bounded) until the server has `n` gets waiting.
    fn until_waiting(server: &KvServer, n: usize) {
        let deadline = Instant::now() + SEC5;
        while server.waiting_gets() < n {
            assert!(Instant::now() < deadline, "waiters never arrived");
            thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn concurrent_blocking_gets() {
        let (server, addr) = server(4);
        let cs = clients(&addr, 4);
        let handles: Vec<_> = (0..16)
            .map(|t| {
                let c = Arc::clone(&cs[t % 3]);
                thread::spawn(move || {
                    let key = format!("k{}", t % 8);
                    (t, c.get(&key, SEC5))
                })
            })
            .collect();
        until_waiting(&server, 16);
        for k in 0..8 {
            cs[3]
                .set(&format!("k{k}"), format!("value {k}").as_bytes())
                .unwrap();
        }
        for h in handles {
            let (t, got) = h.join().unwrap();
            assert_eq!(got.unwrap(), format!("value {}", t % 8).as_bytes());
        }
        let start = Instant::now();
        assert_eq!(cs[1].get("k5", SEC5).unwrap(), b"value 5");
        assert!(start.elapsed() < Duration::from_millis(500));
    }

    #[test]
    fn get_times_out_and_try_get_does_not_block() {
        let (_server, addr) = server(1);
        let c = KvClient::connect(&addr, 0, 1, SEC5).unwrap();
        let start = Instant::now();
        let err = c.get("absent", Duration::from_millis(300)).unwrap_err();
        let took = start.elapsed();
        assert!(
            matches!(&err, KvError::Timeout { key, .. } if key == "absent"),
            "{err}"
        );
        assert!(took >= Duration::from_millis(300), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
        assert_eq!(
            err.to_string(),
            "timed out after 300 ms waiting for key `absent`"
        );
        assert_eq!(c.try_get("absent").unwrap(), None);
        c.set("present", b"x").unwrap();
        assert_eq!(c.try_get("present").unwrap(), Some(b"x".to_vec()));
    }

    #[test]
    fn repeated_key_last_set_wins_and_waiter_sees_first() {
        let (server, addr) = server(2);
        let cs = clients(&addr, 2);
        let waiter = {
            let c = Arc::clone(&cs[0]);
            thread::spawn(move || c.get("k", SEC5))
        };
        until_waiting(&server, 1);
        cs[1].set("k", b"a").unwrap();
        cs[1].set("k", b"b").unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), b"a");
        assert_eq!(cs[0].get("k", SEC5).unwrap(), b"b");
        assert_eq!(server.waiting_gets(), 0);
    }

    #[test]
    fn binary_values_and_odd_keys_round_trip() {
        let (_server, addr) = server(1);
        let c = KvClient::connect(&addr, 0, 1, SEC5).unwrap();
        let all: Vec<u8> = (0..=255).collect();
        let big: Vec<u8> = (0..4 << 20).map(|i: u32| (i * 7 + i / 251) as u8).collect();
        c.set("all/bytes", &all).unwrap();
        c.set("empty", &[]).unwrap();
        c.set("big", &big).unwrap();
        c.set("ключ/ü/🔑", b"unicode").unwrap();
        assert_eq!(c.get("all/bytes", SEC5).unwrap(), all);
        assert_eq!(c.get("empty", SEC5).unwrap(), Vec::<u8>::new());
        assert_eq!(c.try_get("empty").unwrap(), Some(Vec::new()));
        assert!(c.get("big", SEC5).unwrap() == big);
        assert_eq!(c.get("ключ/ü/🔑", SEC5).unwrap(), b"unicode");
    }

    #[test]
    fn barrier_passes_with_all_and_names_the_missing() {
        let (_server, addr) = server(4);
        let cs = clients(&addr, 4);
        let all: Vec<_> = cs
            .iter()
            .map(|c| {
                let c = Arc::clone(c);
                thread::spawn(move || c.barrier("start", SEC5))
            })
            .collect();
        for h in all {
            h.join().unwrap().unwrap();
        }
        // The name may be used again once the barrier completed.
        let three: Vec<_> = [0usize, 1, 3]
            .iter()
            .map(|&i| {
                let c = Arc::clone(&cs[i]);
                thread::spawn(move || c.barrier("start", Duration::from_millis(300)))
            })
            .collect();
        for h in three {
            match h.join().unwrap().unwrap_err() {
                KvError::BarrierTimeout { name, missing, .. } => {
                    assert_eq!(name, "start");
                    assert_eq!(missing, vec![2]);
                }
                other => panic!("{other}"),
            }
        }
        let err = KvError::BarrierTimeout {
            name: "start".into(),
            missing: vec![1, 3],
            num_processes: 4,
            waited: SEC5,
        };
        assert_eq!(
            err.to_string(),
            "processes 1, 3 of 4 never reached `start` within 5 s"
        );
    }

    #[test]
    fn shutdown_waits_for_every_process() {
        let (server, addr) = server(3);
        let cs = clients(&addr, 3);
        let (tx, rx) = mpsc::channel();
        let early: Vec<_> = [0usize, 1]
            .iter()
            .map(|&i| {
                let c = Arc::clone(&cs[i]);
                let tx = tx.clone();
                thread::spawn(move || {
                    c.shutdown(SEC5).unwrap();
                    tx.send((i, Instant::now())).unwrap();
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(300));
        assert!(
            rx.try_recv().is_err(),
            "shutdown returned before process 2 was done"
        );
        let last_called = Instant::now();
        cs[2].shutdown(SEC5).unwrap();
        for h in early {
            h.join().unwrap();
        }
        for _ in 0..2 {
            let (_, at) = rx.recv().unwrap();
            assert!(at >= last_called);
        }
        // A normal end: watch says so, and closing the clients loses no one.
        assert!(cs[0].watch().is_ok());
        drop(cs);
        drop(server);
    }

    #[test]
    fn dropped_client_is_a_lost_peer() {
        let (_server, addr) = server(3);
        let mut cs = clients(&addr, 3);
        let pending = {
            let c = Arc::clone(&cs[2]);
            thread::spawn(move || c.get("never", Duration::from_secs(8)))
        };
        let watcher = {
            let c = Arc::clone(&cs[0]);
            thread::spawn(move || c.watch())
        };
        thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        drop(cs.remove(1));
        let err = pending.join().unwrap().unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        assert!(matches!(err, KvError::PeerLost { process: 1 }), "{err}");
        assert_eq!(err.to_string(), "process 1 left the run without finishing");
        let err = watcher.join().unwrap().unwrap_err();
        assert!(matches!(err, KvError::PeerLost { process: 1 }), "{err}");
        // Later waits fail at once too.
        let err = cs[0].barrier("b", SEC5).unwrap_err();
        assert!(matches!(err, KvError::PeerLost { process: 1 }), "{err}");
        let err = cs[1].shutdown(SEC5).unwrap_err();
        assert!(matches!(err, KvError::PeerLost { process: 1 }), "{err}");
        // And the lost id cannot come back.
        let err = KvClient::connect(&addr, 1, 3, SEC5).unwrap_err();
        assert!(matches!(err, KvError::Refused { .. }), "{err}");
    }

    #[test]
    fn stopped_server_is_a_lost_coordinator() {
        let (server, addr) = server(2);
        let cs = clients(&addr, 2);
        let watcher = {
            let c = Arc::clone(&cs[1]);
            thread::spawn(move || c.watch())
        };
        let pending = {
            let c = Arc::clone(&cs[0]);
            thread::spawn(move || c.get("never", Duration::from_secs(8)))
        };
        thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        drop(server);
        let err = watcher.join().unwrap().unwrap_err();
        assert!(
            matches!(&err, KvError::CoordinatorLost { addr: a } if *a == addr),
            "{err}"
        );
        let err = pending.join().unwrap().unwrap_err();
        assert!(matches!(err, KvError::CoordinatorLost { .. }), "{err}");
        assert!(start.elapsed() < Duration::from_secs(2));
        assert!(matches!(
            cs[0].set("k", b"v"),
            Err(KvError::CoordinatorLost { .. })
        ));
    }

    #[test]
    fn connect_errors() {
        // A port where nothing listens.
        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let start = Instant::now();
        let err =
            KvClient::connect(&free.to_string(), 1, 2, Duration::from_millis(500)).unwrap_err();
        let took = start.elapsed();
        assert!(
            matches!(err, KvError::Unreachable { process: 1, .. }),
            "{err}"
        );
        assert!(
            took >= Duration::from_millis(500) && took < Duration::from_millis(1500),
            "{took:?}"
        );
        assert!(
            err.to_string().starts_with(&format!(
                "process 1 of 2 could not reach the coordinator {free} within 500 ms"
            )),
            "{err}"
        );

        let (_server, addr) = server(2);
        let _first = KvClient::connect(&addr, 1, 2, SEC5).unwrap();
        let err = KvClient::connect(&addr, 1, 2, SEC5).unwrap_err();
        assert!(matches!(err, KvError::Refused { .. }), "{err}");
        let err = KvClient::connect(&addr, 2, 2, SEC5).unwrap_err();
        assert!(matches!(err, KvError::Refused { .. }), "{err}");
        let err = KvClient::connect(&addr, 2, 3, SEC5).unwrap_err();
        assert!(
            matches!(&err, KvError::Refused { reason } if reason.contains("runs 2")),
            "{err}"
        );
        // A process started before the coordinator still gets in.
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let late = thread::spawn(move || {
            thread::sleep(Duration::from_millis(300));
            KvServer::start(port, 1).unwrap()
        });
        let c = KvClient::connect(&port.to_string(), 0, 1, SEC5).unwrap();
        c.set("up", b"1").unwrap();
        drop(c);
        drop(late.join().unwrap());
    }

    #[test]
    fn malformed_frame_closes_only_that_connection() {
        let (_server, addr) = server(1);
        let c = KvClient::connect(&addr, 0, 1, SEC5).unwrap();
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.set_read_timeout(Some(SEC5)).unwrap();
        raw.write_all(&[99, 0, 0, 0, 0]).unwrap();
        match read_response(&mut raw) {
            Ok((status::PROTOCOL, _)) => {}
            _ => panic!("expected a protocol complaint"),
        }
        let mut rest = Vec::new();
        assert_eq!(raw.read_to_end(&mut rest).map(|n| n == 0).ok(), Some(true));
        // A value length over the limit.
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.set_read_timeout(Some(SEC5)).unwrap();
        let mut frame = vec![op::SET, 0, 0, 0, 0];
        frame.extend_from_slice(&0u64.to_be_bytes());
        frame.extend_from_slice(&1u32.to_be_bytes());
        frame.push(b'k');
        frame.extend_from_slice(&u64::MAX.to_be_bytes());
        raw.write_all(&frame).unwrap();
        assert!(matches!(read_response(&mut raw), Ok((status::PROTOCOL, _))));
        c.set("still", b"fine").unwrap();
        assert_eq!(c.get("still", SEC5).unwrap(), b"fine");
    }

    #[test]
    fn client_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<KvClient>();
        check::<KvServer>();
    }
}
