//! Prepared token shards: a dataset tokenized once ([`prepare`], what
//! `hlo-train data prepare` runs) into a folder that a run memory-maps
//! ([`TokenShards`]) instead of reading and tokenizing its data again, so
//! a run's memory does not grow with the data and its first step does not
//! wait for the tokenizer.
//!
//! The format, version 1, is plain enough to read without us (numpy's
//! `memmap` reads each file):
//!
//! - `manifest.json`: `format` (`"hlo-train tokens"`), `version` (1), the
//!   tokenizer's fingerprint, how the rows were read (`source`: the data's
//!   path and fingerprint, the chat template's fingerprint, whether inputs
//!   are learned, the EOS appended to text), the totals (`samples`,
//!   `tokens`, `learned`, the largest id `max_id`), `complete` (false while a prepare is under way
//!   or was interrupted) and the shards in order, each with the source
//!   rows it holds, its counts and the FNV-1a checksum of each file.
//! - `shard-NNNNN.ids`: the token ids of the shard's samples one after
//!   another, little-endian `u32`.
//! - `shard-NNNNN.mask`: one byte a token, 1 where the token is learned
//!   (predicted and counted in the loss), else 0.
//! - `shard-NNNNN.offsets`: little-endian `u64`, one more than the
//!   shard's samples: sample `i` is `ids[offsets[i]..offsets[i + 1]]`.
//!
//! A sample is one source row (a JSONL line or a Parquet row) exactly as
//! `train --data` reads it: whole, never cut (a run cuts to its `--seq`).

pub mod mixture;
pub mod order;
mod prepare;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};

use crate::reader::Example;
use crate::DataError;

pub use prepare::{prepare, PrepareOptions};

/// The manifest's `format`.
pub const FORMAT: &str = "hlo-train tokens";
/// The manifest's `version`.
pub(crate) const VERSION: u32 = 1;
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";

/// How the rows of a prepared set were read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    /// The data file or folder, as given.
    pub path: String,
    /// Its fingerprint (its files' names and contents).
    pub fingerprint: String,
    /// The chat template's fingerprint (None: no template).
    pub chat_template: Option<String>,
    /// Every token of a conversation learned, not only the replies.
    pub train_on_inputs: bool,
    /// The id appended to text rows.
    pub eos: Option<u32>,
}

/// FNV-1a checksums of a shard's files, hex.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checksums {
    pub ids: String,
    pub mask: String,
    pub offsets: String,
}

/// One shard: source rows `first_row..first_row + samples`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub name: String,
    pub first_row: u64,
    pub samples: u64,
    pub tokens: u64,
    pub learned: u64,
    /// Every token of every sample but its first is learned (plain text):
    /// what a row learns is then known from the samples' lengths alone,
    /// without reading the mask (false in sets prepared before this was
    /// recorded).
    #[serde(default)]
    pub learned_everywhere: bool,
    pub max_id: u32,
    pub fnv1a: Checksums,
}

/// A prepared set's `manifest.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// The tokenizer's fingerprint ([`crate::Tokenizer::fingerprint`]).
    pub tokenizer: String,
    pub source: Source,
    /// Source rows a shard holds (the last may hold fewer).
    pub rows_per_shard: u64,
    pub samples: u64,
    pub tokens: u64,
    /// Learned tokens (the first token of a sample is never predicted,
    /// and is not counted).
    pub learned: u64,
    /// The largest token id (a model's vocabulary must hold it).
    pub max_id: u32,
    /// Every source row is in the shards.
    pub complete: bool,
    pub shards: Vec<Shard>,
}

impl Manifest {
    /// The manifest in `dir`, if it holds one of this format.
    pub fn read(dir: &Path) -> Result<Option<Manifest>, DataError> {
        let path = dir.join(MANIFEST);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|cause| DataError::Read {
            path: path.clone(),
            cause,
        })?;
        let m: Manifest = serde_json::from_str(&text).map_err(|cause| DataError::Json {
            path: path.clone(),
            cause,
        })?;
        if m.format != FORMAT || m.version != VERSION {
            return Err(DataError::Rows {
                path,
                message: format!(
                    "is {} version {}, not {FORMAT} version {VERSION}",
                    m.format, m.version
                ),
            });
        }
        Ok(Some(m))
    }

    /// Writes it to `dir` whole (a temporary file renamed over the last).
    pub fn write(&self, dir: &Path) -> Result<(), DataError> {
        let text = serde_json::to_string_pretty(self).expect("a manifest serialises");
        write_whole(&dir.join(MANIFEST), text.as_bytes())
    }

    /// The totals agree with the shards, each of which holds samples: a
    /// manifest edited or cut short is refused before any shard is read.
    fn check_totals(&self) -> Result<(), String> {
        if self.shards.is_empty() {
            return Err(format!("{MANIFEST} names no shards: {DAMAGED}"));
        }
        if let Some(s) = self.shards.iter().find(|s| s.samples == 0) {
            return Err(format!(
                "{MANIFEST}: shard {} holds no samples: {DAMAGED}",
                s.name
            ));
        }
        let sum = |f: fn(&Shard) -> u64| {
            self.shards
                .iter()
                .try_fold(0u64, |a, s| a.checked_add(f(s)))
        };
        let largest = self.shards.iter().map(|s| s.max_id).max();
        for (what, total, shards) in [
            ("samples", Some(self.samples), sum(|s| s.samples)),
            ("tokens", Some(self.tokens), sum(|s| s.tokens)),
            ("learned", Some(self.learned), sum(|s| s.learned)),
            (
                "max_id",
                Some(u64::from(self.max_id)),
                largest.map(u64::from),
            ),
        ] {
            if total != shards {
                return Err(format!(
                    "{MANIFEST} gives {what} {}, its shards {}: {DAMAGED}",
                    total.unwrap_or(0),
                    shards.map_or("more than 2^64".into(), |n| n.to_string())
                ));
            }
        }
        Ok(())
    }
}

/// Whether `path` is a folder of prepared token shards.
pub fn is_token_dir(path: &Path) -> bool {
    path.join(MANIFEST).is_file()
}

/// `bytes` written to `path` whole ([`hlo_fs::write_atomic`]), so a
/// reader sees the old file or the new one.
pub(crate) fn write_whole(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    hlo_fs::write_atomic(path, bytes).map_err(|cause| DataError::Write {
        path: path.to_path_buf(),
        cause,
    })
}

/// One shard's files, memory-mapped.
struct Mapped {
    ids: memmap2::Mmap,
    mask: memmap2::Mmap,
    offsets: memmap2::Mmap,
}

impl Mapped {
    /// Shard `s`'s files in `dir`, each of the size the manifest gives.
    fn open(dir: &Path, s: &Shard) -> Result<Mapped, DataError> {
        let map = |ext: &str, len: Option<u64>| -> Result<memmap2::Mmap, DataError> {
            let path = dir.join(format!("{}.{ext}", s.name));
            let file = std::fs::File::open(&path).map_err(|cause| DataError::Read {
                path: path.clone(),
                cause,
            })?;
            // Safety: the files are read only, and a prepared set is
            // not written once complete.
            let m = unsafe { memmap2::Mmap::map(&file) }.map_err(|cause| DataError::Read {
                path: path.clone(),
                cause,
            })?;
            if Some(m.len() as u64) != len {
                return Err(DataError::Rows {
                    path: path.clone(),
                    message: format!(
                        "holds {} bytes, the manifest says {}: {DAMAGED}",
                        m.len(),
                        len.map_or("more than 2^64".into(), |n| n.to_string())
                    ),
                });
            }
            Ok(m)
        };
        Ok(Mapped {
            ids: map("ids", s.tokens.checked_mul(4))?,
            mask: map("mask", Some(s.tokens))?,
            offsets: map(
                "offsets",
                s.samples.checked_add(1).and_then(|n| n.checked_mul(8)),
            )?,
        })
    }

    /// Offset `j` (in tokens).
    fn offset(&self, j: usize) -> u64 {
        let b: [u8; 8] = self.offsets[8 * j..8 * j + 8]
            .try_into()
            .expect("8 bytes, sizes checked at open");
        u64::from_le_bytes(b)
    }

    /// The offsets run from 0 to the shard's tokens, never decreasing.
    fn check_offsets(&self, s: &Shard) -> Result<(), String> {
        let n = s.samples as usize;
        if self.offset(0) != 0 || self.offset(n) != s.tokens {
            return Err(format!(
                "its offsets run from {} to {}, not from 0 to its {} tokens",
                self.offset(0),
                self.offset(n),
                s.tokens
            ));
        }
        match (0..n).find(|&j| self.offset(j + 1) < self.offset(j)) {
            Some(j) => Err(format!("sample {j}'s offsets decrease")),
            None => Ok(()),
        }
    }

    /// The whole shard against its manifest entry: the checksums, the
    /// largest id, the mask (bytes 0 or 1, its learned count, every token
    /// but a sample's first learned where the shard says so).
    fn check_whole(&self, s: &Shard, dir: &Path) -> Result<(), (PathBuf, String)> {
        let file = |ext: &str| dir.join(format!("{}.{ext}", s.name));
        let (ids_sum, largest) = self.read_ids();
        for (ext, got, want) in [
            ("ids", ids_sum, &s.fnv1a.ids),
            ("mask", checksum(&self.mask), &s.fnv1a.mask),
            ("offsets", checksum(&self.offsets), &s.fnv1a.offsets),
        ] {
            if &got != want {
                return Err((file(ext), "does not match its checksum".into()));
            }
        }
        if largest != s.max_id {
            return Err((
                file("ids"),
                format!(
                    "holds token id {largest}, the manifest says at most {}",
                    s.max_id
                ),
            ));
        }
        if self.mask.iter().any(|&b| b > 1) {
            return Err((file("mask"), "holds bytes other than 0 and 1".into()));
        }
        let mut learned = 0u64;
        for j in 0..s.samples as usize {
            let (from, to) = (self.offset(j) as usize, self.offset(j + 1) as usize);
            let after_first = &self.mask[(from + 1).min(to)..to];
            let n = after_first.iter().filter(|&&b| b == 1).count();
            if s.learned_everywhere && n != after_first.len() {
                return Err((
                    file("mask"),
                    format!("sample {j} has unlearned tokens in a shard marked learned everywhere"),
                ));
            }
            learned += n as u64;
        }
        if learned != s.learned {
            return Err((
                file("mask"),
                format!(
                    "marks {learned} tokens learned, the manifest says {}",
                    s.learned
                ),
            ));
        }
        self.release_pages();
        Ok(())
    }

    /// The ids' checksum and largest id, read a chunk at a time, each
    /// chunk's pages released once read.
    fn read_ids(&self) -> (String, u32) {
        let mut sum = hlo_ir::rng::Fnv1a::new();
        let mut largest = 0u32;
        for (k, chunk) in self.ids.chunks(CHECK_CHUNK).enumerate() {
            sum.update(chunk);
            let most = chunk
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .max();
            largest = largest.max(most.unwrap_or(0));
            release(&self.ids, k * CHECK_CHUNK, chunk.len());
        }
        (format!("{:016x}", sum.finish()), largest)
    }

    /// Drops the mask's pages a whole read mapped into the process (the
    /// ids' go as they are read).
    fn release_pages(&self) {
        release(&self.mask, 0, self.mask.len());
    }
}

/// Bytes of a shard's ids a whole check reads before releasing them (a
/// multiple of the page size and of 4).
const CHECK_CHUNK: usize = 64 << 20;

/// Drops `len` bytes at `at` of `map` from the process (they stay in the
/// system's page cache), so checking a set does not count its size in
/// the process's resident memory.
fn release(map: &memmap2::Mmap, at: usize, len: usize) {
    // Safety: the mapping is read only; its pages are read again from
    // the file when next touched.
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at, len) };
}

impl Mapped {}

/// A prepared set, memory-mapped: samples by index, read from the pages
/// the system keeps (the process holds none of them itself).
///
/// What is cheap is checked when the set is opened: the manifest's totals
/// against its shards, each file's size, each shard's offsets (monotone,
/// from 0 to its tokens). What needs a whole shard read (its checksums,
/// every id within the manifest's largest, the mask's learned count) is
/// checked the first time a run touches the shard, before any of its
/// samples is returned ([`TokenShards::sample`]).
pub struct TokenShards {
    pub manifest: Manifest,
    pub dir: PathBuf,
    shards: Vec<Mapped>,
    /// The first sample of each shard, and the total after the last.
    starts: Vec<u64>,
    /// Each shard's whole check, made once (the error's message).
    checked: Vec<OnceLock<Result<(), (PathBuf, String)>>>,
}

/// The words every refusal of a damaged set ends with.
const DAMAGED: &str = "the set is damaged; prepare it again";

impl TokenShards {
    /// Opens a complete prepared set: the manifest's totals, each file's
    /// size and each shard's offsets checked (the rest of each shard the
    /// first time it is read; all of it by [`TokenShards::verify`]).
    pub fn open(dir: &Path) -> Result<TokenShards, DataError> {
        let bad = |message: String| DataError::Rows {
            path: dir.to_path_buf(),
            message,
        };
        let manifest = Manifest::read(dir)?.ok_or_else(|| {
            bad(format!(
                "holds no {MANIFEST}: prepare it with `hlo-train data prepare`"
            ))
        })?;
        if !manifest.complete {
            return Err(bad(
                "its preparation did not finish: run the same `hlo-train data prepare` again to complete it".into(),
            ));
        }
        manifest.check_totals().map_err(bad)?;
        let mut shards = Vec::with_capacity(manifest.shards.len());
        let mut starts = vec![0u64];
        for s in &manifest.shards {
            let mapped = Mapped::open(dir, s)?;
            mapped.check_offsets(s).map_err(|m| DataError::Rows {
                path: dir.join(format!("{}.offsets", s.name)),
                message: format!("{m}: {DAMAGED}"),
            })?;
            shards.push(mapped);
            starts.push(starts[starts.len() - 1] + s.samples);
        }
        Ok(TokenShards {
            checked: manifest.shards.iter().map(|_| OnceLock::new()).collect(),
            manifest,
            dir: dir.to_path_buf(),
            shards,
            starts,
        })
    }

    /// Checks every shard whole (reads the whole set).
    pub fn verify(&self) -> Result<(), DataError> {
        (0..self.shards.len()).try_for_each(|k| self.touch(k))
    }

    /// Starts checking every shard whole, in order, on a thread of its
    /// own (while a run compiles, say), so a run's first batches seldom
    /// wait for it. A sample is still never read before its shard's
    /// check has passed: a read of a shard being checked waits for it.
    /// One thread a core, each taking the next shard not yet checked.
    pub fn check_ahead(self: &Arc<Self>) {
        let n = self.shards.len();
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for _ in 0..cores.min(n) {
            let (shards, next) = (Arc::clone(self), Arc::clone(&next));
            std::thread::spawn(move || loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if k >= n {
                    break;
                }
                let _ = shards.touch(k);
            });
        }
    }

    /// Shard `k` checked whole, the first time only: its checksums, its
    /// ids within its recorded largest, its mask's bytes and learned
    /// count.
    fn touch(&self, k: usize) -> Result<(), DataError> {
        let (s, m) = (&self.manifest.shards[k], &self.shards[k]);
        self.checked[k]
            .get_or_init(|| m.check_whole(s, &self.dir))
            .clone()
            .map_err(|(path, message)| DataError::Rows {
                path,
                message: format!("{message}: {DAMAGED}"),
            })
    }

    /// Samples in the set.
    pub fn len(&self) -> usize {
        self.manifest.samples as usize
    }

    pub fn is_empty(&self) -> bool {
        self.manifest.samples == 0
    }

    /// The shard of sample `i` and its place there.
    fn locate(&self, i: usize) -> (usize, usize) {
        let i = i as u64;
        let shard = self.starts.partition_point(|&s| s <= i) - 1;
        (shard, (i - self.starts[shard]) as usize)
    }

    /// Where sample `i`'s tokens are in its shard.
    fn span(&self, i: usize) -> (usize, std::ops::Range<usize>) {
        let (shard, k) = self.locate(i);
        let m = &self.shards[shard];
        (shard, m.offset(k) as usize..m.offset(k + 1) as usize)
    }

    /// The length of sample `i`, in tokens (reads its offsets only).
    pub(crate) fn sample_len(&self, i: usize) -> usize {
        self.span(i).1.len()
    }

    /// How many of sample `i`'s first `len` tokens after its first are
    /// learned: the predictions a row holding those `len` tokens counts
    /// (reads the mask only: what a process counts of rows it does not
    /// fill).
    pub(crate) fn learned_within(&self, i: usize, len: usize) -> Result<usize, DataError> {
        let (shard, span) = self.span(i);
        self.touch(shard)?;
        let end = span.end.min(span.start.saturating_add(len));
        let from = (span.start + 1).min(end);
        Ok(self.shards[shard].mask[from..end]
            .iter()
            .filter(|&&b| b != 0)
            .count())
    }

    /// Sample `i`, its first `limit` tokens at most (its shard checked
    /// whole first, the first time it is read).
    pub fn sample(&self, i: usize, limit: usize) -> Result<Example, DataError> {
        let (shard, span) = self.span(i);
        self.touch(shard)?;
        let end = span.end.min(span.start.saturating_add(limit));
        let m = &self.shards[shard];
        let ids = m.ids[4 * span.start..4 * end]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let target = m.mask[span.start..end].iter().map(|&b| b != 0).collect();
        Ok(Example { ids, target })
    }

    /// What the set holds for rows of `seq` tokens, as
    /// [`crate::reader::stats`] counts examples: its samples and tokens,
    /// the learned tokens within a row and the samples cut. Reads every
    /// sample's offsets, and the first `seq` mask bytes of each in shards
    /// not learned everywhere (never the ids); `no_signal` is left 0, since a loader over shards takes every
    /// sample in order (one with nothing to learn within a row adds no
    /// loss).
    pub fn stats(&self, seq: usize) -> crate::DataStats {
        let mut s = crate::DataStats {
            samples: self.len(),
            tokens: self.manifest.tokens as usize,
            ..crate::DataStats::default()
        };
        for i in 0..self.len() {
            let (shard, span) = self.span(i);
            let kept = span.len().min(seq);
            s.learned += if self.manifest.shards[shard].learned_everywhere {
                kept.saturating_sub(1)
            } else {
                let mask = &self.shards[shard].mask[span.start..span.start + kept];
                mask.iter().skip(1).filter(|&&b| b != 0).count()
            };
            s.cut += usize::from(span.len() > seq);
        }
        s
    }

    /// The share of a row of `seq` slots a sample fills unpacked, each
    /// cut to the row (reads every sample's offsets).
    pub fn unpacked_fill(&self, seq: usize) -> f64 {
        let seq = seq.max(1);
        let kept: usize = (0..self.len()).map(|i| self.sample_len(i).min(seq)).sum();
        kept as f64 / (self.len().max(1) * seq) as f64
    }

    /// The set's identity: its manifest's tokenizer, source and shard
    /// checksums.
    pub fn fingerprint(&self) -> String {
        let text = serde_json::to_string(&(&self.manifest.tokenizer, &self.manifest.shards))
            .expect("serialises");
        format!("tokens:{:016x}", hlo_ir::rng::fnv1a(text.as_bytes()))
    }
}

/// The FNV-1a checksum of `bytes`, hex.
pub(crate) fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", hlo_ir::rng::fnv1a(bytes))
}

#[cfg(test)]
mod tests;
