//! TensorBoard event files: what `tf.summary` writes, so `tensorboard
//! --logdir` shows a run's scalars without TensorFlow or a protobuf crate.
//!
//! An event file is a TFRecord stream: each record is a little-endian u64
//! length, the masked CRC32C of those 8 bytes, the data, and the masked
//! CRC32C of the data. Each record's data is an `Event` protocol buffer;
//! the first one only names the format (`brain.Event:2`), the others carry
//! a `Summary` of scalar values. The few fields used are encoded by hand.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{ReportError, Result};

/// Writes one run's scalars to a new event file in a folder.
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` and in it a new file
    /// `events.out.tfevents.{unix_seconds}.{hostname}.{pid}.hlo-train`,
    /// starting with the record that names the format.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        std::fs::create_dir_all(dir).map_err(ReportError::io("create", dir))?;
        let seconds = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let stem = format!(
            "events.out.tfevents.{seconds}.{}.{}.hlo-train",
            hostname(),
            std::process::id()
        );
        // Two writers of one process in one second would share the name;
        // a numbered suffix keeps the first file whole (TensorBoard reads
        // every file whose name holds "tfevents", in name order).
        let mut n = 0u32;
        let (file, path) = loop {
            let name = if n == 0 {
                stem.clone()
            } else {
                format!("{stem}.{n}")
            };
            let path = dir.join(name);
            match File::options().write(true).create_new(true).open(&path) {
                Ok(f) => break (f, path),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(ReportError::io("create", &path)(e)),
            }
        };
        let mut writer = EventWriter {
            out: BufWriter::new(file),
            path,
        };
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        // The header reaches the disk at once so TensorBoard lists the run
        // from its start.
        writer.flush()?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes several scalars of one step in one event.
    pub fn add_scalars(&mut self, step: i64, values: &[(&str, f64)]) -> Result<()> {
        let event = scalar_event(wall_time(), step, values);
        self.record(&event)
    }

    /// Hands what is buffered to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .map_err(ReportError::io("write", &self.path))
    }

    /// Appends one TFRecord holding `data`.
    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut framed = Vec::with_capacity(data.len() + 16);
        framed.extend_from_slice(&len);
        framed.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        framed.extend_from_slice(data);
        framed.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        self.out
            .write_all(&framed)
            .map_err(ReportError::io("write", &self.path))
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        // Nothing can report an error from here; an explicit `flush` can.
        let _ = self.out.flush();
    }
}

/// Seconds since the Unix epoch, as `Event.wall_time` holds them.
fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The machine's name for the file name, with anything but letters,
/// digits, `-` and `_` replaced so it stays one path component (dots too:
/// TensorBoard's own names put the host between dots).
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "localhost".to_string());
    raw.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// `Event { wall_time, step, summary: Summary { value: [Value { tag,
/// simple_value }] } }`.
fn scalar_event(wall_time: f64, step: i64, values: &[(&str, f64)]) -> Vec<u8> {
    let mut summary = Vec::new();
    for (tag, value) in values {
        let mut v = Vec::new();
        put_bytes(&mut v, 1, tag.as_bytes());
        // `simple_value` is a proto `float`.
        put_float(&mut v, 2, *value as f32);
        put_bytes(&mut summary, 1, &v);
    }
    let mut event = Vec::new();
    put_double(&mut event, 1, wall_time);
    put_varint_field(&mut event, 2, step as u64);
    put_bytes(&mut event, 5, &summary);
    event
}

// Protocol buffer wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u32) {
    put_varint(out, u64::from(field << 3 | wire));
}

/// An `int64` (a negative one is its two's complement: ten bytes).
fn put_varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    put_key(out, field, VARINT);
    put_varint(out, v);
}

fn put_double(out: &mut Vec<u8>, field: u32, v: f64) {
    put_key(out, field, FIXED64);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_float(out: &mut Vec<u8>, field: u32, v: f32) {
    put_key(out, field, FIXED32);
    out.extend_from_slice(&v.to_le_bytes());
}

/// A string, bytes or embedded message.
fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), one table entry
/// per byte value, built at compile time.
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// The CRC-32C of `data`.
pub(crate) fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = CRC32C_TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC: a CRC of data that itself holds CRCs is weak,
/// so the stored value is rotated and offset.
pub(crate) fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vectors() {
        // The check value of CRC-32C, and RFC 3720's (iSCSI) B.4 vectors.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        assert_eq!(crc32c(b""), 0);
        // Rotating 0xE3069283 right by 15 gives 0x2507C60D; plus the
        // offset 0xA282EAD8.
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn scalar_event_bytes_follow_the_wire_format() {
        let got = scalar_event(2.0, 3, &[("a", 1.5)]);
        let mut want = vec![0x09]; // field 1, fixed64
        want.extend_from_slice(&2.0f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0x03]); // field 2, varint 3
                                               // field 5, 10 bytes: Summary.value (field 1), 8 bytes: tag "a"
                                               // (field 1, 1 byte), simple_value 1.5f32 = 0x3FC00000 (field 2).
        want.extend_from_slice(&[0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15, 0, 0, 0xc0, 0x3f]);
        assert_eq!(got, want);
        // A negative int64 is ten varint bytes.
        let neg = scalar_event(0.0, -1, &[]);
        assert_eq!(
            &neg[9..],
            &[0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0x2a, 0x00]
        );
    }

    /// A protobuf field as the test decoder reads it.
    #[derive(Debug, Clone, PartialEq)]
    enum Field {
        Varint(u64),
        Fixed64([u8; 8]),
        Len(Vec<u8>),
        Fixed32([u8; 4]),
    }

    /// Decodes a message into (field number, value) pairs, written from
    /// the protobuf encoding spec independently of the encoder above.
    fn decode(mut b: &[u8]) -> Vec<(u64, Field)> {
        fn varint(b: &mut &[u8]) -> u64 {
            let mut v = 0u64;
            let mut shift = 0;
            loop {
                let byte = b[0];
                *b = &b[1..];
                v |= u64::from(byte & 0x7f) << shift;
                if byte < 0x80 {
                    return v;
                }
                shift += 7;
            }
        }
        let mut fields = Vec::new();
        while !b.is_empty() {
            let key = varint(&mut b);
            let field = match key & 7 {
                0 => Field::Varint(varint(&mut b)),
                1 => {
                    let f = Field::Fixed64(b[..8].try_into().unwrap());
                    b = &b[8..];
                    f
                }
                2 => {
                    let n = varint(&mut b) as usize;
                    let f = Field::Len(b[..n].to_vec());
                    b = &b[n..];
                    f
                }
                5 => {
                    let f = Field::Fixed32(b[..4].try_into().unwrap());
                    b = &b[4..];
                    f
                }
                w => panic!("wire type {w}"),
            };
            fields.push((key >> 3, field));
        }
        fields
    }

    /// Splits a TFRecord stream into its records, checking both CRCs with
    /// the mask written out as the format defines it.
    fn records(mut b: &[u8]) -> Vec<Vec<u8>> {
        let mask = |c: u32| c.rotate_right(15).wrapping_add(0xa282_ead8);
        let mut out = Vec::new();
        while !b.is_empty() {
            let len = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(b[8..12].try_into().unwrap());
            assert_eq!(len_crc, mask(crc32c(&b[..8])), "length crc");
            let data = &b[12..12 + len];
            let data_crc = u32::from_le_bytes(b[12 + len..16 + len].try_into().unwrap());
            assert_eq!(data_crc, mask(crc32c(data)), "data crc");
            out.push(data.to_vec());
            b = &b[16 + len..];
        }
        out
    }

    fn len_field(fields: &[(u64, Field)], n: u64) -> Vec<Vec<u8>> {
        fields
            .iter()
            .filter_map(|(k, f)| match f {
                Field::Len(b) if *k == n => Some(b.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn written_file_reads_back() {
        let dir = crate::temp_dir("tb");
        let before = wall_time();
        let path = {
            let mut w = EventWriter::create(&dir.join("tb")).unwrap();
            w.add_scalars(1, &[("train/loss", 2.5)]).unwrap();
            w.add_scalars(2, &[("train/loss", 0.1)]).unwrap();
            w.add_scalars(2, &[("eval/loss", 3.25), ("eval/nan", f64::NAN)])
                .unwrap();
            w.path().to_path_buf()
            // Dropped unflushed: the drop writes the rest.
        };
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        assert!(name.ends_with(&format!(".{}.hlo-train", std::process::id())));
        assert_eq!(name.split('.').count(), 7, "{name}");

        let bytes = std::fs::read(&path).unwrap();
        let recs = records(&bytes);
        assert_eq!(recs.len(), 4);
        let header = decode(&recs[0]);
        assert_eq!(header.len(), 2);
        assert_eq!(header[1], (3, Field::Len(b"brain.Event:2".to_vec())));

        let mut got = Vec::new();
        for r in &recs[1..] {
            let fields = decode(r);
            let Field::Fixed64(t) = fields[0].1 else {
                panic!("{fields:?}")
            };
            let t = f64::from_le_bytes(t);
            assert!(t >= before.floor() && t < before + 60.0, "{t}");
            let step = match fields.iter().find(|(k, _)| *k == 2) {
                Some((_, Field::Varint(s))) => *s as i64,
                _ => panic!("no step: {fields:?}"),
            };
            for summary in len_field(&fields, 5) {
                for value in len_field(&decode(&summary), 1) {
                    let v = decode(&value);
                    let tag = String::from_utf8(len_field(&v, 1).remove(0)).unwrap();
                    let Some((_, Field::Fixed32(x))) = v.iter().find(|(k, _)| *k == 2) else {
                        panic!("{v:?}")
                    };
                    got.push((tag, step, f32::from_le_bytes(*x)));
                }
            }
        }
        assert_eq!(got.len(), 4);
        assert_eq!(got[0], ("train/loss".into(), 1, 2.5));
        assert_eq!(got[1], ("train/loss".into(), 2, 0.1f32));
        assert_eq!(got[2], ("eval/loss".into(), 2, 3.25));
        assert_eq!(got[3].0, "eval/nan");
        assert!(got[3].2.is_nan());

        // A second writer in the same second gets a file of its own.
        let second = EventWriter::create(&dir.join("tb")).unwrap();
        assert_ne!(second.path(), path);
        drop(second);
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hostname_is_one_path_component() {
        let h = hostname();
        assert!(!h.is_empty());
        assert!(!h.contains('/') && !h.contains('.'), "{h}");
    }
}
