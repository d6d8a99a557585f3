//! Tokenizing a dataset into shards: rows read in order (JSONL lines,
//! Parquet rows), a shard's worth at a time tokenized on every core, each
//! shard written whole and then named in the manifest, so an interrupted
//! preparation resumes after its last written shard.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{checksum, write_whole, Checksums, Manifest, Shard, Source, FORMAT, VERSION};
use crate::reader::{visit_rows, Example, Reader};
use crate::DataError;

/// Where and how to prepare.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// The folder the shards and manifest go to.
    pub out: PathBuf,
    pub source: Source,
    /// The tokenizer's fingerprint.
    pub tokenizer: String,
    /// Source rows a shard holds.
    pub rows_per_shard: u64,
    /// Threads tokenizing (each takes a slice of a shard's rows).
    pub threads: usize,
}

/// A source row waiting to be tokenized: its value, its file and its
/// place there (counted from 1, blank lines not counted).
type Pending = (Value, usize, usize);

/// What reading the rows has made so far.
struct Progress<'a> {
    manifest: Manifest,
    pending: Vec<Pending>,
    opts: &'a PrepareOptions,
    files: &'a [PathBuf],
    report: &'a mut dyn FnMut(&Manifest),
}

/// Tokenizes the rows of `files` (in order) with `reader` into shards in
/// `opts.out`, reporting the manifest after each shard: a folder holding
/// the same preparation, complete, is left as it is; one interrupted is
/// resumed after its last shard; one holding another preparation is
/// refused.
///
/// The caller holds `opts.out`'s lock ([`crate::lock::FolderLock`]): two
/// preparations into one folder would each write the other's shards.
pub fn prepare(
    files: &[PathBuf],
    reader: &Reader,
    opts: &PrepareOptions,
    report: &mut dyn FnMut(&Manifest),
) -> Result<Manifest, DataError> {
    std::fs::create_dir_all(&opts.out).map_err(|cause| DataError::Read {
        path: opts.out.clone(),
        cause,
    })?;
    let manifest = start(opts)?;
    if manifest.complete {
        return Ok(manifest);
    }
    let mut skip = manifest.samples;
    let mut p = Progress {
        manifest,
        pending: Vec::new(),
        opts,
        files,
        report,
    };
    for (f, file) in files.iter().enumerate() {
        let mut failed = None;
        let mut row = 0;
        visit_rows(file, &mut |value| {
            row += 1;
            if skip > 0 {
                skip -= 1;
                return Ok(true);
            }
            p.pending.push((value.clone(), f, row));
            if p.pending.len() as u64 >= opts.rows_per_shard {
                if let Err(e) = p.flush(reader) {
                    failed = Some(e);
                    return Ok(false);
                }
            }
            Ok(true)
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
    }
    p.flush(reader)?;
    if p.manifest.samples == 0 {
        return Err(DataError::Empty {
            path: PathBuf::from(&opts.source.path),
        });
    }
    p.manifest.complete = true;
    p.manifest.write(&opts.out)?;
    Ok(p.manifest)
}

/// The manifest to continue: the folder's own when it holds this
/// preparation (its shards checked to exist whole), else a new one.
fn start(opts: &PrepareOptions) -> Result<Manifest, DataError> {
    let fresh = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        tokenizer: opts.tokenizer.clone(),
        source: opts.source.clone(),
        rows_per_shard: opts.rows_per_shard,
        samples: 0,
        tokens: 0,
        learned: 0,
        max_id: 0,
        complete: false,
        shards: Vec::new(),
    };
    let Some(mut m) = Manifest::read(&opts.out)? else {
        return Ok(fresh);
    };
    let same = (&m.tokenizer, &m.source, m.rows_per_shard)
        == (&fresh.tokenizer, &fresh.source, fresh.rows_per_shard);
    if !same {
        return Err(DataError::Rows {
            path: opts.out.clone(),
            message: format!(
                "holds tokens of {} prepared otherwise (another source, tokenizer, chat template or shard size); give another --out",
                m.source.path
            ),
        });
    }
    // A shard whose files are not all there whole is made again, and
    // every one after it.
    let whole = |s: &Shard| {
        [
            ("ids", 4 * s.tokens),
            ("mask", s.tokens),
            ("offsets", 8 * (s.samples + 1)),
        ]
        .iter()
        .all(|(ext, len)| {
            std::fs::metadata(opts.out.join(format!("{}.{ext}", s.name)))
                .is_ok_and(|md| md.len() == *len)
        })
    };
    if let Some(k) = m.shards.iter().position(|s| !whole(s)) {
        m.shards.truncate(k);
        m.complete = false;
    }
    m.samples = m.shards.iter().map(|s| s.samples).sum();
    m.tokens = m.shards.iter().map(|s| s.tokens).sum();
    m.learned = m.shards.iter().map(|s| s.learned).sum();
    m.max_id = m.shards.iter().map(|s| s.max_id).max().unwrap_or(0);
    Ok(m)
}

impl Progress<'_> {
    /// Tokenizes the pending rows on every thread, writes them as the
    /// next shard and the manifest naming it.
    fn flush(&mut self, reader: &Reader) -> Result<(), DataError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let rows = std::mem::take(&mut self.pending);
        let examples = tokenize(&rows, reader, self.opts.threads, self.files)?;
        let first_row = self.manifest.samples;
        let name = format!("shard-{:05}", self.manifest.shards.len());
        let shard = write_shard(&self.opts.out, &name, first_row, &examples)?;
        self.manifest.samples += shard.samples;
        self.manifest.tokens += shard.tokens;
        self.manifest.learned += shard.learned;
        self.manifest.max_id = self.manifest.max_id.max(shard.max_id);
        self.manifest.shards.push(shard);
        self.manifest.write(&self.opts.out)?;
        (self.report)(&self.manifest);
        Ok(())
    }
}

/// Each row parsed and tokenized, `threads` slices of them at once; the
/// first bad row (in order) is the error, naming its file and row.
fn tokenize(
    rows: &[Pending],
    reader: &Reader,
    threads: usize,
    files: &[PathBuf],
) -> Result<Vec<Example>, DataError> {
    let per = rows.len().div_ceil(threads.max(1)).max(1);
    let parsed: Vec<Vec<Result<Example, String>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = rows
            .chunks(per)
            .map(|chunk| {
                scope.spawn(move || chunk.iter().map(|(v, _, _)| reader.parse_row(v)).collect())
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec![Err("tokenizing panicked".into())])
            })
            .collect()
    });
    parsed
        .into_iter()
        .flatten()
        .zip(rows)
        .map(|(r, (_, f, row))| {
            r.map_err(|message| DataError::Row {
                path: files[*f].clone(),
                row: *row,
                message,
            })
        })
        .collect()
}

/// Writes `examples` as shard `name` (each file whole) and its entry.
fn write_shard(
    out: &Path,
    name: &str,
    first_row: u64,
    examples: &[Example],
) -> Result<Shard, DataError> {
    let tokens: usize = examples.iter().map(|e| e.ids.len()).sum();
    let mut ids = Vec::with_capacity(4 * tokens);
    let mut mask = Vec::with_capacity(tokens);
    let mut offsets = Vec::with_capacity(8 * (examples.len() + 1));
    let mut learned = 0u64;
    let mut everywhere = true;
    offsets.extend_from_slice(&0u64.to_le_bytes());
    for e in examples {
        for &id in &e.ids {
            ids.extend_from_slice(&id.to_le_bytes());
        }
        mask.extend(e.target.iter().map(|&t| u8::from(t)));
        learned += e.learned_within(e.target.len()) as u64;
        everywhere &= e.target.iter().skip(1).all(|&t| t);
        offsets.extend_from_slice(&((ids.len() / 4) as u64).to_le_bytes());
    }
    for (ext, bytes) in [("ids", &ids), ("mask", &mask), ("offsets", &offsets)] {
        write_whole(&out.join(format!("{name}.{ext}")), bytes)?;
    }
    Ok(Shard {
        name: name.to_string(),
        first_row,
        samples: examples.len() as u64,
        tokens: tokens as u64,
        learned,
        learned_everywhere: everywhere,
        max_id: examples
            .iter()
            .flat_map(|e| e.ids.iter().copied())
            .max()
            .unwrap_or(0),
        fnv1a: Checksums {
            ids: checksum(&ids),
            mask: checksum(&mask),
            offsets: checksum(&offsets),
        },
    })
}
