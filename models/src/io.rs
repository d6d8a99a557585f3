//! Writing files so that a reader never sees half of one.

use std::io::Write;
use std::path::Path;

use crate::{safetensors_file, ModelError};

/// Writes `bytes` to `path` through a temporary file in the same folder,
/// synced and then renamed over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let name = path
        .file_name()
        .ok_or_else(|| ModelError::NotAFile(path.to_path_buf()))?;
    let tmp = path.with_file_name(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(ModelError::io("write", path))
}

/// Every tensor of a safetensors file (validated, copied out), in file order.
pub fn read_safetensors(path: &Path) -> Result<Vec<(String, hlo_ir::Literal)>, ModelError> {
    let map = safetensors_file::mmap(path)?;
    let mut entries = safetensors_file::index_file(path, &map)?;
    entries.sort_by_key(|e| e.start);
    Ok(entries
        .into_iter()
        .map(|t| (t.name.clone(), t.literal(&map)))
        .collect())
}

/// Writes `tensors` as a safetensors file, atomically.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, hlo_ir::Literal)],
) -> Result<(), ModelError> {
    use safetensors::tensor::{Dtype, TensorView};
    let dtype = |d: hlo_ir::DType| match d {
        hlo_ir::DType::F32 => Ok(Dtype::F32),
        hlo_ir::DType::BF16 => Ok(Dtype::BF16),
        hlo_ir::DType::F16 => Ok(Dtype::F16),
        hlo_ir::DType::F64 => Ok(Dtype::F64),
        hlo_ir::DType::I32 => Ok(Dtype::I32),
        hlo_ir::DType::I64 => Ok(Dtype::I64),
        hlo_ir::DType::U8 => Ok(Dtype::U8),
        other => Err(ModelError::UnwritableDType(other)),
    };
    let views = tensors
        .iter()
        .map(|(name, l)| {
            let shape: Vec<usize> = l.ty.dims.iter().map(|&d| d as usize).collect();
            let view = TensorView::new(dtype(l.ty.dtype)?, shape, &l.bytes).map_err(|e| {
                ModelError::Checkpoint {
                    file: path.display().to_string(),
                    message: format!("tensor `{name}`: {e}"),
                }
            })?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let bytes = safetensors::serialize(views, None).map_err(|e| ModelError::Checkpoint {
        file: path.display().to_string(),
        message: format!("cannot serialise: {e}"),
    })?;
    write_atomic(path, &bytes)
}

/// The most bytes of weights one file of an HF model folder holds, as
/// transformers' `save_pretrained(max_shard_size="5GB")` splits them.
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The index of a model folder whose weights are split over several files.
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// Writes a model's weights into folder `dir` as transformers does:
/// `model.safetensors` when they come to at most `max_bytes`, else
/// `model-0000K-of-0000N.safetensors` files of at most `max_bytes` each
/// (tensors in order, a file closed when the next would overflow it; a
/// tensor larger than `max_bytes` alone in its file) and
/// `model.safetensors.index.json` (`metadata.total_size` and each tensor's
/// file). Weight files of an earlier save that the new one does not name
/// are removed once it is written (a stale index first, so a reader never
/// takes the old index for the new files). Returns the files written.
pub fn write_hf_weights(
    dir: &Path,
    tensors: &[(String, hlo_ir::Literal)],
    max_bytes: u64,
) -> Result<Vec<String>, ModelError> {
    let size = |l: &hlo_ir::Literal| l.bytes.len() as u64;
    let total: u64 = tensors.iter().map(|(_, l)| size(l)).sum();
    let index = dir.join(WEIGHTS_INDEX);
    if total <= max_bytes {
        remove_if_there(&index)?;
        write_safetensors(&dir.join("model.safetensors"), tensors)?;
        let written = vec!["model.safetensors".to_string()];
        remove_stale_weights(dir, &written)?;
        return Ok(written);
    }
    let mut groups: Vec<Vec<(String, hlo_ir::Literal)>> = vec![Vec::new()];
    let mut filled = 0u64;
    for (name, l) in tensors {
        let last = groups.last_mut().expect("a group");
        if !last.is_empty() && filled + size(l) > max_bytes {
            groups.push(Vec::new());
            filled = 0;
        }
        groups
            .last_mut()
            .expect("a group")
            .push((name.clone(), l.clone()));
        filled += size(l);
    }
    let n = groups.len();
    let mut map = serde_json::Map::new();
    let mut written = Vec::with_capacity(n);
    for (k, group) in groups.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        write_safetensors(&dir.join(&file), group)?;
        for (name, _) in group {
            map.insert(name.clone(), serde_json::Value::String(file.clone()));
        }
        written.push(file);
    }
    let json = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
    let text = serde_json::to_string_pretty(&json).expect("an index serialises");
    write_atomic(&index, text.as_bytes())?;
    remove_stale_weights(dir, &written)?;
    Ok(written)
}

fn remove_if_there(path: &Path) -> Result<(), ModelError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(ModelError::io("remove", path)(e))
        }
        _ => Ok(()),
    }
}

/// Removes `dir`'s HF weight files (`model.safetensors`,
/// `model-*-of-*.safetensors`) that are not among `keep`.
fn remove_stale_weights(dir: &Path, keep: &[String]) -> Result<(), ModelError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let weights = name == "model.safetensors"
            || (name.starts_with("model-")
                && name.contains("-of-")
                && name.ends_with(".safetensors"));
        if weights && !keep.contains(&name) {
            remove_if_there(&entry.path())?;
        }
    }
    Ok(())
}

/// The files of an HF model folder besides its weights and config that a
/// copy of the model needs: tokenizer, chat template, generation settings.
pub const HF_SIDE_FILES: [&str; 6] = [
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
];

/// Copies each of [`HF_SIDE_FILES`] that `from` has into `to`
/// (atomically, one by one); returns the names copied.
pub fn copy_side_files(from: &Path, to: &Path) -> Result<Vec<&'static str>, ModelError> {
    let mut copied = Vec::new();
    for name in HF_SIDE_FILES {
        let src = from.join(name);
        if src.is_file() {
            let bytes = std::fs::read(&src).map_err(ModelError::io("read", &src))?;
            write_atomic(&to.join(name), &bytes)?;
            copied.push(name);
        }
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::decoder::{init_base, ModelConfig};
    use hlo_ir::DType;

    /// A model's weights split over files of a bound read back whole
    /// through the index, and a later save in one file leaving no stale
    /// file or index behind.
    #[test]
    fn weights_past_the_bound_split_into_indexed_files() {
        let dir = std::env::temp_dir().join(format!("hlo-models-shards-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = ModelConfig::preset("tiny").unwrap();
        std::fs::write(dir.join("config.json"), config.to_json()).unwrap();
        let weights = init_base(&config, DType::F32, 1);
        let total: usize = weights.iter().map(|(_, l)| l.bytes.len()).sum();
        let largest = weights.iter().map(|(_, l)| l.bytes.len()).max().unwrap();
        // A bound below the largest tensor: that one alone in its file.
        let bound = (largest / 2) as u64;
        let files = write_hf_weights(&dir, &weights, bound).unwrap();
        assert!(files.len() > 2, "{files:?}");
        assert_eq!(
            files[0],
            format!("model-00001-of-{:05}.safetensors", files.len())
        );
        for f in &files {
            let held = read_safetensors(&dir.join(f)).unwrap();
            let bytes: usize = held.iter().map(|(_, l)| l.bytes.len()).sum();
            assert!(
                bytes as u64 <= bound || held.len() == 1,
                "{f}: {bytes} bytes"
            );
        }
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(WEIGHTS_INDEX)).unwrap())
                .unwrap();
        assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total as u64));
        let read_back = |dir: &Path| {
            let c = Checkpoint::open(dir).unwrap();
            for (name, l) in &weights {
                assert_eq!(&c.read(name, DType::F32).unwrap(), l, "{name}");
            }
        };
        read_back(&dir);
        // Saved again within the bound: one file, the index and shards gone.
        assert_eq!(
            write_hf_weights(&dir, &weights, MAX_SHARD_BYTES).unwrap(),
            ["model.safetensors"]
        );
        let left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            !left
                .iter()
                .any(|f| f.starts_with("model-") || f == WEIGHTS_INDEX),
            "{left:?}"
        );
        read_back(&dir);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
