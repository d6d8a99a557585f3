//! Writing files so that a reader never sees half of one.

use std::io::Write;
use std::path::Path;

use crate::{safetensors_file, ModelError};

/// Writes `bytes` to `path` whole ([`hlo_fs::write_atomic`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    hlo_fs::write_atomic(path, bytes).map_err(|e| match e {
        hlo_fs::WriteError::NotAFile(p) => ModelError::NotAFile(p),
        hlo_fs::WriteError::Io(cause) => ModelError::io("write", path)(cause),
    })
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
    let types: Vec<(String, hlo_ir::TensorType)> = tensors
        .iter()
        .map(|(n, l)| (n.clone(), l.ty.clone()))
        .collect();
    write_hf_weights_with(dir, &types, max_bytes, |i| {
        Ok(std::borrow::Cow::Borrowed(&tensors[i].1.bytes))
    })
}

/// [`write_hf_weights`] for `tensors` (name, type) whose bytes come from
/// `bytes_of(i)` one tensor at a time, in order: the files are laid out
/// from the types alone, so a writer holds one tensor, never the model.
pub fn write_hf_weights_with<'a>(
    dir: &Path,
    tensors: &[(String, hlo_ir::TensorType)],
    max_bytes: u64,
    mut bytes_of: impl FnMut(usize) -> Result<std::borrow::Cow<'a, [u8]>, ModelError>,
) -> Result<Vec<String>, ModelError> {
    let size = |t: &hlo_ir::TensorType| t.size_in_bytes() as u64;
    let total: u64 = tensors.iter().map(|(_, t)| size(t)).sum();
    let index = dir.join(WEIGHTS_INDEX);
    // Tensors in order, a file closed when the next would overflow it.
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut filled = 0u64;
    for (i, (_, t)) in tensors.iter().enumerate() {
        let last = groups.last_mut().expect("a group");
        if !last.is_empty() && filled + size(t) > max_bytes {
            groups.push(Vec::new());
            filled = 0;
        }
        groups.last_mut().expect("a group").push(i);
        filled += size(t);
    }
    let n = groups.len();
    let file_name = |k: usize| match n {
        1 => "model.safetensors".to_string(),
        _ => format!("model-{:05}-of-{n:05}.safetensors", k + 1),
    };
    if n == 1 {
        remove_if_there(&index)?;
    }
    let mut map = serde_json::Map::new();
    let mut written = Vec::with_capacity(n);
    for (k, group) in groups.iter().enumerate() {
        let file = file_name(k);
        let types: Vec<_> = group.iter().map(|&i| tensors[i].clone()).collect();
        let mut writer = SafetensorsWriter::create(&dir.join(&file), &types)?;
        for &i in group {
            writer.write(&tensors[i].0, &bytes_of(i)?)?;
            map.insert(
                tensors[i].0.clone(),
                serde_json::Value::String(file.clone()),
            );
        }
        writer.finish()?;
        written.push(file);
    }
    if n > 1 {
        let json = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
        let text = serde_json::to_string_pretty(&json).expect("an index serialises");
        write_atomic(&index, text.as_bytes())?;
    }
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

/// The name safetensors gives `dtype`.
pub fn safetensors_dtype(dtype: hlo_ir::DType) -> Result<&'static str, ModelError> {
    use hlo_ir::DType;
    Ok(match dtype {
        DType::F32 => "F32",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::F64 => "F64",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::U8 => "U8",
        other => return Err(ModelError::UnwritableDType(other)),
    })
}

/// A safetensors file written one tensor at a time: the header (every
/// tensor's name, type and place) first, then each tensor's bytes in the
/// order given, so a writer holds one tensor, never the file. Written
/// under a temporary name, synced and renamed at [`SafetensorsWriter::finish`];
/// dropped unfinished, the temporary is removed.
pub struct SafetensorsWriter {
    path: std::path::PathBuf,
    tmp: std::path::PathBuf,
    file: Option<std::io::BufWriter<std::fs::File>>,
    /// Names and byte sizes, in write order.
    expected: Vec<(String, usize)>,
    next: usize,
    crc: crc32fast::Hasher,
}

impl SafetensorsWriter {
    /// Starts `path` for `tensors` (name, type), written in this order.
    pub fn create(
        path: &Path,
        tensors: &[(String, hlo_ir::TensorType)],
    ) -> Result<SafetensorsWriter, ModelError> {
        let mut header = serde_json::Map::new();
        let mut at = 0usize;
        let mut expected = Vec::with_capacity(tensors.len());
        for (name, ty) in tensors {
            let size = ty.size_in_bytes();
            header.insert(
                name.clone(),
                serde_json::json!({
                    "dtype": safetensors_dtype(ty.dtype)?,
                    "shape": ty.dims,
                    "data_offsets": [at, at + size],
                }),
            );
            expected.push((name.clone(), size));
            at += size;
        }
        let mut text = serde_json::Value::Object(header).to_string().into_bytes();
        // Padded with spaces to 8 bytes, so the data that follows is aligned.
        text.resize(text.len().div_ceil(8) * 8, b' ');
        let tmp =
            hlo_fs::temporary_path(path).ok_or_else(|| ModelError::NotAFile(path.to_path_buf()))?;
        let file = std::fs::File::create(&tmp).map_err(ModelError::io("create", &tmp))?;
        let mut writer = SafetensorsWriter {
            path: path.to_path_buf(),
            tmp,
            file: Some(std::io::BufWriter::with_capacity(1 << 22, file)),
            expected,
            next: 0,
            crc: crc32fast::Hasher::new(),
        };
        writer.put(&(text.len() as u64).to_le_bytes())?;
        writer.put(&text)?;
        Ok(writer)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), ModelError> {
        self.crc.update(bytes);
        let file = self.file.as_mut().expect("open until finished");
        file.write_all(bytes)
            .map_err(ModelError::io("write", &self.tmp))
    }

    /// Writes the next tensor's bytes; `name` must be the next named at
    /// creation, with its size.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<(), ModelError> {
        let misplaced = |message: String| ModelError::Checkpoint {
            file: self.path.display().to_string(),
            message,
        };
        let Some((want, size)) = self.expected.get(self.next) else {
            return Err(misplaced(format!("`{name}` is one tensor too many")));
        };
        if want != name || *size != bytes.len() {
            return Err(misplaced(format!(
                "`{name}` ({} bytes) written where `{want}` ({size} bytes) comes",
                bytes.len()
            )));
        }
        self.next += 1;
        self.put(bytes)
    }

    /// Syncs and renames the file into place once every tensor is
    /// written; returns the CRC-32 of its bytes.
    pub fn finish(mut self) -> Result<u32, ModelError> {
        if self.next != self.expected.len() {
            return Err(ModelError::Checkpoint {
                file: self.path.display().to_string(),
                message: format!("`{}` was never written", self.expected[self.next].0),
            });
        }
        let file = self.file.take().expect("open until finished");
        let done = file
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| hlo_fs::rename_into_place(f, &self.tmp, &self.path));
        done.map_err(ModelError::io("write", &self.path))?;
        Ok(self.crc.clone().finalize())
    }
}

impl Drop for SafetensorsWriter {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A safetensors file mapped into memory, its tensors found by name
/// (a checkpoint's shards are read block by block from such maps).
pub struct MappedSafetensors {
    map: memmap2::Mmap,
    tensors: std::collections::HashMap<String, safetensors_file::StoredTensor>,
}

impl MappedSafetensors {
    pub fn open(path: &Path) -> Result<MappedSafetensors, ModelError> {
        let map = safetensors_file::mmap(path)?;
        let tensors = safetensors_file::index_file(path, &map)?
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        Ok(MappedSafetensors { map, tensors })
    }

    /// The tensor `name`: its type and bytes.
    pub fn get(&self, name: &str) -> Option<(hlo_ir::TensorType, &[u8])> {
        self.tensors.get(name).map(|t| {
            (
                hlo_ir::TensorType::new(t.dtype, t.shape.clone()),
                &self.map[t.start..t.end],
            )
        })
    }
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

    /// A file written tensor by tensor reads back as written (by our
    /// reader and the safetensors crate), and a tensor out of order or of
    /// another size is refused, leaving no file.
    #[test]
    fn a_streamed_file_reads_back_and_refuses_a_misplaced_tensor() {
        use hlo_ir::{DType, Literal, TensorType};
        let dir = std::env::temp_dir().join(format!("hlo-models-stream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = Literal::from_f64s(
            TensorType::new(DType::F32, [2, 3]),
            &[1., 2., 3., 4., 5., 6.],
        );
        let b = Literal::from_f64s(TensorType::new(DType::BF16, [3]), &[0.5, -1., 2.]);
        let types = vec![
            ("a".to_string(), a.ty.clone()),
            ("b".to_string(), b.ty.clone()),
        ];
        let path = dir.join("s.safetensors");
        let mut w = SafetensorsWriter::create(&path, &types).unwrap();
        w.write("a", &a.bytes).unwrap();
        w.write("b", &b.bytes).unwrap();
        let crc = w.finish().unwrap();
        assert_eq!(crc, crc32fast::hash(&std::fs::read(&path).unwrap()));
        let back = read_safetensors(&path).unwrap();
        assert_eq!(
            back,
            vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())]
        );
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("b").unwrap().data(), &b.bytes[..]);
        // Out of order, and unfinished: refused, no file left.
        let other = dir.join("t.safetensors");
        let mut w = SafetensorsWriter::create(&other, &types).unwrap();
        let err = w.write("b", &b.bytes).unwrap_err().to_string();
        assert!(err.contains("written where `a`"), "{err}");
        assert!(w.finish().is_err());
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("s.safetensors")]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
