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
