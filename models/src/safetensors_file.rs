//! One safetensors file on its own: mapped into memory, its header read
//! and every tensor's offsets checked. Below both `checkpoint` (HF model
//! folders) and `io` (single files), which read files through it.

use std::path::Path;

use hlo_ir::{DType, Literal, TensorType};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

use crate::ModelError;

/// A read-only mapping of `path`, for reading safetensors without copying
/// the whole file.
pub(crate) fn mmap(path: &Path) -> Result<memmap2::Mmap, ModelError> {
    let file = std::fs::File::open(path).map_err(ModelError::io("open", path))?;
    // SAFETY: the file is opened read-only; a concurrent writer would be a
    // user error that at worst yields wrong values, which validation and
    // tests catch, not memory unsafety in safe code that copies bytes out.
    unsafe { memmap2::Mmap::map(&file) }.map_err(ModelError::io("map", path))
}

/// Where one tensor lies in a safetensors file.
pub struct StoredTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<i64>,
    /// Byte range inside the file.
    pub start: usize,
    pub end: usize,
}

impl StoredTensor {
    /// The tensor's bytes in `file`, as a literal.
    pub fn literal(&self, file: &[u8]) -> Literal {
        Literal {
            ty: TensorType::new(self.dtype, self.shape.clone()),
            bytes: file[self.start..self.end].to_vec(),
        }
    }
}

/// The dtype a safetensors dtype holds, None for those hlo-train does not
/// read.
fn st_dtype(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F32 => DType::F32,
        StDtype::BF16 => DType::BF16,
        StDtype::F16 => DType::F16,
        StDtype::F64 => DType::F64,
        StDtype::I32 => DType::I32,
        StDtype::I64 => DType::I64,
        // bitsandbytes' packed 4-bit weights and 8-bit scales.
        StDtype::U8 => DType::U8,
        _ => return None,
    })
}

/// Reads the header of a safetensors file's bytes and validates every
/// offset (`path` only names the file in errors).
pub fn index_file(path: &Path, map: &[u8]) -> Result<Vec<StoredTensor>, ModelError> {
    let bad = |message: String| ModelError::Checkpoint {
        file: path.display().to_string(),
        message,
    };
    // deserialize checks the header length, the JSON, and that the offsets
    // tile the data exactly and lie inside the file.
    SafeTensors::deserialize(map).map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let (header, meta) =
        SafeTensors::read_metadata(map).map_err(|e| bad(format!("bad header: {e}")))?;
    let base = 8 + header;
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let dtype = st_dtype(info.dtype).ok_or_else(|| {
            bad(format!(
                "tensor `{name}` has unsupported dtype {:?}",
                info.dtype
            ))
        })?;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        let (s, e) = info.data_offsets;
        out.push(StoredTensor {
            name,
            dtype,
            shape,
            start: base + s,
            end: base + e,
        });
    }
    Ok(out)
}
