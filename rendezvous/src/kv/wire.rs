//! The wire format shared by server and client: frames, their limits, and
//! the codes of requests and answers.

use std::io::{self, Read, Write};
use std::time::Duration;

use super::error::KvError;

/// The largest value `set` accepts.
pub const MAX_VALUE_BYTES: u64 = 1 << 30;
/// The longest key (in UTF-8 bytes).
const MAX_KEY_BYTES: u32 = 1 << 20;
/// Sent with `hello`, so that something else listening on the port is not
/// taken for a coordinator (and a future format change is caught).
pub(super) const MAGIC: [u8; 4] = *b"HKV1";
/// No timeout, on the wire.
pub(super) const NO_TIMEOUT: u64 = u64::MAX;

/// Request codes.
pub(super) mod op {
    pub const HELLO: u8 = 1;
    pub const SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const TRY_GET: u8 = 4;
    pub const BARRIER: u8 = 5;
    pub const SHUTDOWN: u8 = 6;
    pub const WATCH: u8 = 7;
}

/// Answer codes; a heartbeat carries no payload.
pub(super) mod status {
    pub const OK: u8 = 0;
    pub const NOT_FOUND: u8 = 1;
    pub const TIMEOUT: u8 = 2;
    pub const BARRIER_TIMEOUT: u8 = 3;
    pub const PEER_LOST: u8 = 4;
    pub const REFUSED: u8 = 5;
    pub const PROTOCOL: u8 = 6;
    pub const HEARTBEAT: u8 = 7;
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
