//! The wire format shared by server and client: frames, their limits, and
//! the codes of requests and answers.

use std::io::{self, Read, Write};
use std::time::Duration;

use super::error::KvError;
use crate::token::PROOF_BYTES;

/// The largest value `set` accepts.
pub const MAX_VALUE_BYTES: u64 = 1 << 30;
/// The most the service holds at once, keys and values together, by
/// default: far above what a run exchanges (topologies, NCCL ids, small
/// all-gathers), and a bound on what a runaway or hostile peer can make
/// process 0 keep in memory.
pub const MAX_STORED_BYTES: u64 = 256 << 20;
/// The longest key (in UTF-8 bytes).
const MAX_KEY_BYTES: u32 = 1 << 20;
/// Opens the server's greeting and the client's answer to it, and is sent
/// with `hello`, so that something else listening on the port is not taken
/// for a coordinator (and a format change is caught).
pub(super) const MAGIC: [u8; 4] = *b"HKV2";
/// No timeout, on the wire.
pub(super) const NO_TIMEOUT: u64 = u64::MAX;

/// Request codes.
pub(super) mod op {
    pub const HELLO: u8 = 1;
    pub(crate) const SET: u8 = 2;
    pub const GET: u8 = 3;
    pub(crate) const TRY_GET: u8 = 4;
    pub(crate) const BARRIER: u8 = 5;
    pub(crate) const SHUTDOWN: u8 = 6;
    pub(crate) const WATCH: u8 = 7;
}

/// Answer codes; a heartbeat carries no payload.
pub(super) mod status {
    pub const OK: u8 = 0;
    pub const NOT_FOUND: u8 = 1;
    pub(crate) const TIMEOUT: u8 = 2;
    pub(crate) const BARRIER_TIMEOUT: u8 = 3;
    pub(crate) const PEER_LOST: u8 = 4;
    pub(crate) const REFUSED: u8 = 5;
    pub(crate) const PROTOCOL: u8 = 6;
    pub const HEARTBEAT: u8 = 7;
    /// Another process count than the coordinator's (payload: the
    /// process, its count, the coordinator's count).
    pub const COUNT_MISMATCH: u8 = 8;
    /// A set that would take the service over its byte cap (payload: the
    /// bytes held, the cap).
    pub(crate) const FULL: u8 = 9;
    /// The client's proof of the run token is wrong (or it has a token and
    /// the server none).
    pub const AUTH_FAILED: u8 = 10;
}

/// Whether `s` is an answer code other than a heartbeat.
fn is_answer(s: u8) -> bool {
    matches!(s, status::OK..=status::PROTOCOL | status::COUNT_MISMATCH..=status::AUTH_FAILED)
}

/// A timeout as sent on the wire: whole milliseconds, rounded up so that a
/// wait never ends before the caller's timeout.
pub(super) fn wire_ms(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(NO_TIMEOUT).min(NO_TIMEOUT - 1)
}

pub(super) struct Request {
    pub(super) op: u8,
    pub(super) process: u32,
    pub(super) timeout_ms: u64,
    pub(super) key: String,
    pub(super) value: Vec<u8>,
}

pub(super) enum ReadError {
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

pub(super) fn write_request(
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

pub(super) fn read_request(r: &mut impl Read) -> Result<Request, ReadError> {
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

pub(super) fn write_response(w: &mut impl Write, status: u8, payload: &[u8]) -> io::Result<()> {
    let mut head = Vec::with_capacity(9 + payload.len().min(1 << 16));
    head.push(status);
    head.extend_from_slice(&(payload.len() as u64).to_be_bytes());
    write_with_payload(w, head, payload)
}

/// Reads a response, skipping heartbeats.
pub(super) fn read_response(r: &mut impl Read) -> Result<(u8, Vec<u8>), ReadError> {
    loop {
        let Some(status) = read_first_byte(r)? else {
            return Err(ReadError::Eof);
        };
        match status {
            status::HEARTBEAT => continue,
            s if is_answer(s) => {}
            other => return Err(ReadError::Protocol(format!("unknown response {other}"))),
        }
        let len = read_u64(r)?;
        if len > MAX_VALUE_BYTES {
            return Err(ReadError::Protocol(format!("response of {len} bytes")));
        }
        return Ok((status, read_bytes(r, len)?));
    }
}

/// The server's first frame on every connection: `MAGIC`, whether a run
/// token is required (`u8`), a nonce (zeros without a token).
pub(super) const GREETING_BYTES: usize = 4 + 1 + PROOF_BYTES;
/// The client's answer: `MAGIC`, whether it proves a token (`u8`), its
/// nonce and its proof (zeros without a token).
pub(super) const AUTH_BYTES: usize = 4 + 1 + 2 * PROOF_BYTES;

/// A client's nonce and proof.
pub(super) type Proof = ([u8; PROOF_BYTES], [u8; PROOF_BYTES]);

pub(super) fn write_greeting(
    w: &mut impl Write,
    needs_token: bool,
    nonce: &[u8; PROOF_BYTES],
) -> io::Result<()> {
    let mut frame = Vec::with_capacity(GREETING_BYTES);
    frame.extend_from_slice(&MAGIC);
    frame.push(u8::from(needs_token));
    frame.extend_from_slice(nonce);
    w.write_all(&frame)
}

/// Whether the server needs a token, and its nonce.
pub(super) fn read_greeting(r: &mut impl Read) -> Result<(bool, [u8; PROOF_BYTES]), ReadError> {
    let mut frame = [0u8; GREETING_BYTES];
    r.read_exact(&mut frame)?;
    let needs_token = match (frame[..4] == MAGIC, frame[4]) {
        (true, 0) => false,
        (true, 1) => true,
        _ => return Err(ReadError::Protocol("not a hlo-train rendezvous".into())),
    };
    let mut nonce = [0u8; PROOF_BYTES];
    nonce.copy_from_slice(&frame[5..]);
    Ok((needs_token, nonce))
}

pub(super) fn write_auth(w: &mut impl Write, proof: Option<&Proof>) -> io::Result<()> {
    let mut frame = Vec::with_capacity(AUTH_BYTES);
    frame.extend_from_slice(&MAGIC);
    frame.push(u8::from(proof.is_some()));
    let zeros = [0u8; PROOF_BYTES];
    let (nonce, mac) = proof.map_or((&zeros, &zeros), |(n, m)| (n, m));
    frame.extend_from_slice(nonce);
    frame.extend_from_slice(mac);
    w.write_all(&frame)
}

/// The client's nonce and proof, if it sent one.
pub(super) fn read_auth(r: &mut impl Read) -> Result<Option<Proof>, ReadError> {
    let mut frame = [0u8; AUTH_BYTES];
    // The head first, so that a stranger's other bytes are refused at once
    // rather than waited for.
    r.read_exact(&mut frame[..5])?;
    let has_proof = match (frame[..4] == MAGIC, frame[4]) {
        (true, 0) => false,
        (true, 1) => true,
        _ => return Err(ReadError::Protocol("not a hlo-train kv client".into())),
    };
    r.read_exact(&mut frame[5..])?;
    if !has_proof {
        return Ok(None);
    }
    let mut nonce = [0u8; PROOF_BYTES];
    let mut mac = [0u8; PROOF_BYTES];
    nonce.copy_from_slice(&frame[5..5 + PROOF_BYTES]);
    mac.copy_from_slice(&frame[5 + PROOF_BYTES..]);
    Ok(Some((nonce, mac)))
}

/// `u64`s as sent in a payload.
pub(super) fn u64s_to_bytes(xs: &[u64]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_be_bytes()).collect()
}

/// The two `u64`s of a payload.
pub(super) fn two_u64(b: &[u8]) -> Result<(u64, u64), KvError> {
    match b.len() {
        16 => {
            let mut x = [0u8; 8];
            let mut y = [0u8; 8];
            x.copy_from_slice(&b[..8]);
            y.copy_from_slice(&b[8..]);
            Ok((u64::from_be_bytes(x), u64::from_be_bytes(y)))
        }
        n => Err(KvError::Protocol(format!(
            "expected two counts, got {n} bytes"
        ))),
    }
}

pub(super) fn u32s_to_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|id| id.to_be_bytes()).collect()
}

pub(super) fn u32s_from_bytes(b: &[u8]) -> Result<Vec<u32>, KvError> {
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

pub(super) fn one_u32(b: &[u8]) -> Result<u32, KvError> {
    match u32s_from_bytes(b)?.as_slice() {
        [id] => Ok(*id),
        _ => Err(KvError::Protocol("expected one process id".into())),
    }
}

pub(super) fn check_sizes(key: &str, value: &[u8]) -> Result<(), KvError> {
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
