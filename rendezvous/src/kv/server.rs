//! Process 0's side: [`KvServer`], a listener thread and one thread per
//! connection over one shared state.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::io::{self, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::error::KvError;
use super::wire::{
    op, read_auth, read_request, status, u32s_to_bytes, u64s_to_bytes, write_greeting,
    write_response, ReadError, Request, MAGIC, MAX_STORED_BYTES, NO_TIMEOUT,
};
use crate::token::{self, RunToken, CLIENT_LABEL, PROOF_BYTES, SERVER_LABEL};

/// How often the server tells a waiting client that it is still there.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// A server write that makes no progress for this long means the client is gone.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a dropped server waits for the last `shutdown` answers to go out.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a new connection has to answer the greeting, so that a
/// stranger that connects and says nothing does not hold a thread for ever.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How a [`KvServer`] is set up beyond its address and process count.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The run token every connection must prove it holds before it may
    /// register a process or touch a key. `None`: any client that speaks
    /// the protocol is served (a trusted network).
    pub run_token: Option<RunToken>,
    /// The most bytes, keys and values together, held at once; a set
    /// beyond it is refused with [`KvError::Full`].
    pub max_stored_bytes: u64,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            run_token: None,
            max_stored_bytes: MAX_STORED_BYTES,
        }
    }
}

/// Process 0's service. Dropping it stops the listener thread and closes every
/// connection, so that clients still waiting see [`KvError::CoordinatorLost`].
pub struct KvServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    listener: Option<JoinHandle<()>>,
}

struct Shared {
    num_processes: u32,
    token: Option<RunToken>,
    max_stored_bytes: u64,
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
    /// Bytes of the keys and values in `values`.
    stored: u64,
    /// Waiting gets by key; a set hands its value to each of them once.
    waiters: HashMap<String, Vec<u64>>,
    /// Values handed to waiters that have not picked them up yet.
    delivered: HashMap<u64, Arc<Vec<u8>>>,
    next_waiter: u64,
    barriers: HashMap<String, Barrier>,
    members: Vec<Member>,
    /// The first process lost; it is the one every failure names.
    first_lost: Option<u32>,
    /// The first process that announced another process count, and that
    /// count: the run cannot start, and every wait fails naming both.
    mismatch: Option<(u32, u32)>,
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

    /// The answer every wait gets once the run cannot go on (`n`: the
    /// run's process count), if it cannot.
    fn failure(&self, n: u32) -> Option<(u8, Vec<u8>)> {
        if let Some((p, theirs)) = self.mismatch {
            return Some((status::COUNT_MISMATCH, u32s_to_bytes(&[p, theirs, n])));
        }
        self.first_lost
            .map(|p| (status::PEER_LOST, p.to_be_bytes().to_vec()))
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
    /// a run of `num_processes` processes, and serves it on threads of its own,
    /// with no run token and the default byte cap.
    pub fn start(bind: SocketAddr, num_processes: u32) -> Result<KvServer, KvError> {
        Self::start_with(bind, num_processes, ServerOptions::default())
    }

    /// [`KvServer::start`] with `options`: a run token every connection must
    /// prove, and the byte cap.
    pub fn start_with(
        bind: SocketAddr,
        num_processes: u32,
        options: ServerOptions,
    ) -> Result<KvServer, KvError> {
        if num_processes == 0 {
            return Err(KvError::Refused {
                reason: "a run needs at least one process".into(),
            });
        }
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        if options.run_token.is_some() {
            // Fail here, not on each connection, if there is no randomness.
            token::nonce()?;
        }
        let shared = Arc::new(Shared {
            num_processes,
            token: options.run_token,
            max_stored_bytes: options.max_stored_bytes,
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
    pub(super) fn waiting_gets(&self) -> usize {
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
    if !admit(shared, &mut reader, &mut out) {
        let _ = out.shutdown(Shutdown::Both);
        return;
    }
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
            op::SET => match set(shared, req.key, req.value) {
                Ok(()) => write_response(&mut out, status::OK, &[]),
                Err(full) => write_response(&mut out, status::FULL, &u64s_to_bytes(&full)),
            },
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

/// Greets a new connection and checks its answer: with a run token, a
/// proof of it for this connection's nonce, answered with the server's own
/// proof; without, an answer that claims no token. False: it proved
/// nothing (or is gone), and must be closed before it is heard.
fn admit(shared: &Shared, reader: &mut BufReader<TcpStream>, out: &mut TcpStream) -> bool {
    let nonce = match &shared.token {
        Some(_) => match token::nonce() {
            Ok(n) => n,
            Err(_) => return false,
        },
        None => [0; PROOF_BYTES],
    };
    if write_greeting(out, shared.token.is_some(), &nonce).is_err()
        || reader
            .get_ref()
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .is_err()
    {
        return false;
    }
    let proof = match read_auth(reader) {
        Ok(proof) => proof,
        Err(ReadError::Protocol(msg)) => {
            let _ = write_response(out, status::PROTOCOL, msg.as_bytes());
            return false;
        }
        Err(ReadError::Eof | ReadError::Io(_)) => return false,
    };
    let answer = match (&shared.token, proof) {
        (None, None) => Some(Vec::new()),
        (Some(token), Some((client_nonce, mac)))
            if token.verify(CLIENT_LABEL, &nonce, &client_nonce, &mac) =>
        {
            Some(token.proof(SERVER_LABEL, &nonce, &client_nonce).to_vec())
        }
        // A wrong proof, none where one is needed, or one where none is.
        _ => None,
    };
    match answer {
        Some(server_proof) => {
            write_response(out, status::OK, &server_proof).is_ok()
                && reader.get_ref().set_read_timeout(None).is_ok()
        }
        None => {
            let _ = write_response(out, status::AUTH_FAILED, &[]);
            false
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
    if their_n != n {
        // The run cannot start: fail every process's waits at once, ours
        // included, rather than let them wait out their timeouts.
        shared.lock().mismatch.get_or_insert((p, their_n));
        shared.changed.notify_all();
        let _ = write_response(
            &mut out,
            status::COUNT_MISMATCH,
            &u32s_to_bytes(&[p, their_n, n]),
        );
        return;
    }
    let refusal = {
        let mut state = shared.lock();
        if p >= n {
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

/// Stores `value` under `key`; `Err([held, cap])` if that would take the
/// service over its byte cap.
fn set(shared: &Shared, key: String, value: Vec<u8>) -> Result<(), [u64; 2]> {
    let value = Arc::new(value);
    {
        let mut state = shared.lock();
        let old = state
            .values
            .get(&key)
            .map_or(0, |v| (key.len() + v.len()) as u64);
        let after = state.stored - old + (key.len() + value.len()) as u64;
        if after > shared.max_stored_bytes {
            return Err([state.stored, shared.max_stored_bytes]);
        }
        state.stored = after;
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
    Ok(())
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
    let n = shared.num_processes;
    let waiter = {
        let mut state = shared.lock();
        if let Some((st, payload)) = state.failure(n) {
            drop(state);
            return write_response(out, st, &payload);
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
            if let Some(failed) = state.failure(n) {
                state.remove_waiter(key, waiter);
                return Some(Err(failed));
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
        if let Some((st, payload)) = state.failure(n) {
            drop(state);
            return write_response(out, st, &payload);
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
            if let Some(failed) = state.failure(n) {
                return Some(failed);
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
    let n = shared.num_processes;
    {
        let mut state = shared.lock();
        if let Some((st, payload)) = state.failure(n) {
            drop(state);
            return write_response(out, st, &payload);
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
            if let Some(failed) = state.failure(n) {
                return Some(failed);
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
    let n = shared.num_processes;
    let answer = wait_for(
        shared,
        out,
        NO_TIMEOUT,
        |state, _| {
            if let Some(failed) = state.failure(n) {
                return Some(failed);
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

impl fmt::Debug for KvServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvServer")
            .field("addr", &self.addr)
            .field("num_processes", &self.shared.num_processes)
            .field("run_token", &self.shared.token.is_some())
            .finish_non_exhaustive()
    }
}
