//! Files read a chunk at a time (a state, a plugin or a data file may be
//! larger than memory allows twice): their fingerprint, or any hash a
//! caller feeds.

use std::path::Path;

use hlo_ir::rng::Fnv1a;

use crate::error::{EngineError, Result};

/// The FNV-1a fingerprint of the bytes of `path`, hex (read in chunks:
/// a state or data file may be larger than memory allows twice).
pub(crate) fn file_fingerprint(path: &Path) -> Result<String> {
    let mut hash = Fnv1a::new();
    for_each_chunk(path, |chunk| hash.update(chunk))?;
    Ok(format!("{:016x}", hash.finish()))
}

/// Reads `path` a MiB at a time, handing each chunk to `f`.
pub(crate) fn for_each_chunk(path: &Path, mut f: impl FnMut(&[u8])) -> Result<()> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(EngineError::io("read", path))?;
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut chunk)
            .map_err(EngineError::io("read", path))?;
        if n == 0 {
            return Ok(());
        }
        f(&chunk[..n]);
    }
}
