//! A run's state as the blocks each process holds: every process writes
//! one safetensors file of the distinct blocks its devices hold (a block
//! held on several devices, or by several processes, is written once, by
//! the lowest mesh position holding it), and process 0 writes
//! `manifest.json`, which names each tensor's global shape, dtype and
//! sharding and where each of its blocks lies. Blocks go device → host →
//! file one at a time, so a save holds one block beyond what the process
//! already holds. A restore reads, for each block the new mesh puts on
//! this process's devices, the parts of the saved blocks it overlaps,
//! from memory-mapped files: any mesh, any process count.
//!
//! The format, for readers without hlo-train: `manifest.json` is
//! `{"format": "hlo-train sharded state", "version": 1, "mesh": [[axis,
//! size], ...], "files": {file: {"process": p, "crc32": hex}}, "tensors":
//! {name: {"role", "dtype", "shape", "spec", "blocks": [{"file", "key",
//! "offset", "shape", "crc32"}]}}}`; block `key` in `file` holds the
//! region of `shape` starting at `offset` (a whole tensor's key is its
//! name, a part's `name[a:b,c:d]`). The blocks of a tensor tile it
//! exactly. A restore checks each block's CRC-32 when it first reads it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use hlo_ir::{DType, Literal, TensorType};
use hlo_models::io::{safetensors_dtype, MappedSafetensors, SafetensorsWriter};
use hlo_runtime::{blocks_to_write, copy_overlap, DeviceArray, HostArray};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// The manifest's name in a state folder.
pub const MANIFEST: &str = "manifest.json";
const FORMAT: &str = "hlo-train sharded state";

/// What `manifest.json` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// The mesh the state was saved from (axis, size): for information; a
    /// restore lays it out over its own.
    pub mesh: Vec<(String, i64)>,
    pub files: BTreeMap<String, FileEntry>,
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// One process's file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub process: u32,
    /// CRC-32 of the file's bytes, hex.
    pub crc32: String,
}

/// One tensor of the state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// `parameter`, `optimizer` or `step`.
    pub role: String,
    /// As safetensors names it (`F32`, `BF16`, ...).
    pub dtype: String,
    pub shape: Vec<i64>,
    /// Its layout when saved, in JAX's spelling (`P('fsdp', None)`).
    pub spec: String,
    pub blocks: Vec<BlockEntry>,
}

/// Where one block of a tensor lies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockEntry {
    pub file: String,
    pub key: String,
    pub offset: Vec<i64>,
    pub shape: Vec<i64>,
    /// CRC-32 of the block's bytes, hex: checked when a restore first
    /// reads the block.
    pub crc32: String,
}

/// The CRC-32 of a block's bytes as the manifest writes it.
pub fn block_crc(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}

/// One array of the state to save: its name, role and device array.
pub struct StateArray<'a> {
    pub name: String,
    pub role: &'static str,
    pub array: &'a DeviceArray,
}

/// What one process wrote: its file, checksum and blocks (tensor name,
/// block), or why it could not.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProcessShards {
    pub process: u32,
    pub file: String,
    pub crc32: String,
    pub blocks: Vec<(String, BlockEntry)>,
}

/// The file process `p` of `n` writes.
pub(crate) fn shard_file(p: u32, n: u32) -> String {
    format!("shard-{p:05}-of-{n:05}.safetensors")
}

/// The key of the block at `offset` of `shape` in a tensor of `dims`.
fn block_key(name: &str, offset: &[i64], shape: &[i64], dims: &[i64]) -> String {
    if shape == dims {
        return name.to_string();
    }
    let ranges: Vec<String> = offset
        .iter()
        .zip(shape)
        .map(|(a, n)| format!("{a}:{}", a + n))
        .collect();
    format!("{name}[{}]", ranges.join(","))
}

/// Writes process `process` of `processes`'s blocks of `arrays` into
/// `dir`: those at the mesh positions it holds for which `holds` is true
/// (every position it holds, in a real run; tests pass a subset to act
/// as one of several processes). Refuses, leaving no file, at the first
/// block that is not finite.
pub fn write_process_shards(
    dir: &Path,
    arrays: &[StateArray],
    process: u32,
    processes: u32,
    holds: impl Fn(usize) -> bool,
    what: &str,
) -> Result<ProcessShards> {
    let file = shard_file(process, processes);
    let mut plan = Vec::new();
    for a in arrays {
        let held: Vec<usize> = a
            .array
            .positions()
            .iter()
            .copied()
            .filter(|&d| holds(d))
            .collect();
        let dims = &a.array.ty().dims;
        let block = a.array.block_dims();
        for (d, offset) in blocks_to_write(a.array.sharding(), dims, &held) {
            let key = block_key(&a.name, &offset, &block, dims);
            plan.push((a, d, offset, key));
        }
    }
    let types: Vec<(String, TensorType)> = plan
        .iter()
        .map(|(a, _, _, key)| {
            let ty = TensorType::new(a.array.ty().dtype, a.array.block_dims());
            (key.clone(), ty)
        })
        .collect();
    let mut writer = SafetensorsWriter::create(&dir.join(&file), &types)?;
    let mut blocks = Vec::with_capacity(plan.len());
    for (a, d, offset, key) in plan {
        let host = Literal::from(a.array.block_to_host(d)?);
        super::finite::check_finite_one(&a.name, &host, what)?;
        writer.write(&key, &host.bytes)?;
        blocks.push((
            a.name.clone(),
            BlockEntry {
                file: file.clone(),
                key,
                offset,
                shape: host.ty.dims.clone(),
                crc32: block_crc(&host.bytes),
            },
        ));
    }
    let crc = writer.finish()?;
    Ok(ProcessShards {
        process,
        file,
        crc32: format!("{crc:08x}"),
        blocks,
    })
}

impl Manifest {
    /// The manifest of `arrays` written by `written` (every process's).
    pub fn new(arrays: &[StateArray], written: &[ProcessShards]) -> Result<Manifest> {
        let mesh = arrays
            .first()
            .map(|a| {
                let m = &a.array.sharding().mesh;
                m.axes().iter().map(|(n, s)| (n.clone(), *s)).collect()
            })
            .unwrap_or_default();
        let mut tensors = BTreeMap::new();
        for a in arrays {
            let ty = a.array.ty();
            tensors.insert(
                a.name.clone(),
                TensorEntry {
                    role: a.role.to_string(),
                    dtype: safetensors_dtype(ty.dtype)?.to_string(),
                    shape: ty.dims.clone(),
                    spec: a.array.sharding().spec.to_string(),
                    blocks: Vec::new(),
                },
            );
        }
        let mut files = BTreeMap::new();
        for w in written {
            files.insert(
                w.file.clone(),
                FileEntry {
                    process: w.process,
                    crc32: w.crc32.clone(),
                },
            );
            for (name, block) in &w.blocks {
                if let Some(t) = tensors.get_mut(name) {
                    t.blocks.push(block.clone());
                }
            }
        }
        Ok(Manifest {
            format: FORMAT.to_string(),
            version: 1,
            mesh,
            files,
            tensors,
        })
    }
}

/// Whether `blocks` tile a tensor of `shape` exactly: each inside it,
/// no two sharing an element, together as many elements as it has (so
/// covering it).
fn tiles(shape: &[i64], blocks: &[BlockEntry]) -> std::result::Result<(), String> {
    for (k, b) in blocks.iter().enumerate() {
        let inside = b.offset.len() == shape.len()
            && b.shape.len() == shape.len()
            && (0..shape.len()).all(|d| {
                b.offset[d] >= 0 && b.shape[d] >= 0 && b.offset[d] <= shape[d] - b.shape[d]
            });
        if !inside {
            return Err(format!(
                "block `{}` at {:?} of {:?} lies outside its shape {shape:?}",
                b.key, b.offset, b.shape
            ));
        }
        if let Some(o) = blocks[..k]
            .iter()
            .find(|o| meets(&o.offset, &o.shape, &b.offset, &b.shape))
        {
            return Err(format!(
                "blocks `{}` and `{}` overlap (at {:?} and {:?})",
                o.key, b.key, o.offset, b.offset
            ));
        }
    }
    Ok(())
}

/// Whether the block at `a` of `a_dims` and the region at `b` of
/// `b_dims` share an element.
fn meets(a: &[i64], a_dims: &[i64], b: &[i64], b_dims: &[i64]) -> bool {
    (0..a.len()).all(|k| a[k].max(b[k]) < (a[k] + a_dims[k]).min(b[k] + b_dims[k]))
}

/// The dtype safetensors calls `name`.
fn dtype_named(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "BF16" => DType::BF16,
        "F16" => DType::F16,
        "F64" => DType::F64,
        "I32" => DType::I32,
        "I64" => DType::I64,
        "U8" => DType::U8,
        _ => return None,
    })
}

/// A sharded state opened for reading: its manifest and its files,
/// memory-mapped. Each block is checked against its checksum when first
/// read (one pass over what a restore reads, not a pass over the files
/// first).
pub struct ShardedState {
    dir: PathBuf,
    manifest: Manifest,
    files: HashMap<String, MappedSafetensors>,
    /// Blocks (file, key) whose checksum has been checked.
    verified: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
}

impl ShardedState {
    /// Reads `dir/manifest.json` and maps every file it names.
    pub fn open(dir: &Path) -> Result<ShardedState> {
        let path = dir.join(MANIFEST);
        let bad = |message: String| EngineError::ShardedState {
            path: path.clone(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(EngineError::io("read", &path))?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| bad(format!("not a sharded state's manifest: {e}")))?;
        if manifest.format != FORMAT || manifest.version != 1 {
            return Err(bad(format!(
                "format `{}` version {} is not `{FORMAT}` version 1",
                manifest.format, manifest.version
            )));
        }
        let mut files = HashMap::new();
        for name in manifest.files.keys() {
            files.insert(name.clone(), MappedSafetensors::open(&dir.join(name))?);
        }
        let state = ShardedState {
            dir: dir.to_path_buf(),
            manifest,
            files,
            verified: Default::default(),
        };
        state.check_blocks()?;
        Ok(state)
    }

    /// Every block names a file of the manifest and a key of that file
    /// with the block's type, and a tensor's blocks tile it exactly.
    fn check_blocks(&self) -> Result<()> {
        for (name, t) in &self.manifest.tensors {
            let dtype = self.dtype(name, t)?;
            tiles(&t.shape, &t.blocks).map_err(|m| self.bad(format!("`{name}`: {m}")))?;
            let mut elements = 0i64;
            for b in &t.blocks {
                let want = TensorType::new(dtype, b.shape.clone());
                match self.files.get(&b.file).and_then(|f| f.get(&b.key)) {
                    Some((ty, _)) if ty == want => {}
                    _ => {
                        return Err(self.bad(format!(
                            "`{name}`: {} has no {want} block `{}`",
                            b.file, b.key
                        )))
                    }
                }
                elements += b.shape.iter().product::<i64>();
            }
            if elements != t.shape.iter().product::<i64>() {
                return Err(self.bad(format!(
                    "`{name}`: its blocks hold {elements} values, its shape {:?} has {}",
                    t.shape,
                    t.shape.iter().product::<i64>()
                )));
            }
        }
        Ok(())
    }

    fn bad(&self, message: String) -> EngineError {
        EngineError::ShardedState {
            path: self.dir.join(MANIFEST),
            message,
        }
    }

    fn dtype(&self, name: &str, t: &TensorEntry) -> Result<DType> {
        dtype_named(&t.dtype).ok_or_else(|| {
            self.bad(format!(
                "`{name}` has dtype `{}`, which hlo-train does not read",
                t.dtype
            ))
        })
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The type of tensor `name`, if the state holds it.
    pub(crate) fn tensor_type(&self, name: &str) -> Result<Option<TensorType>> {
        match self.manifest.tensors.get(name) {
            Some(t) => Ok(Some(TensorType::new(self.dtype(name, t)?, t.shape.clone()))),
            None => Ok(None),
        }
    }

    /// The region of tensor `name` of `dims` starting at `at`, assembled
    /// from the saved blocks it overlaps; refused when not finite.
    pub(crate) fn read_region(&self, name: &str, at: &[i64], dims: &[i64]) -> Result<HostArray> {
        let t = self
            .manifest
            .tensors
            .get(name)
            .ok_or_else(|| self.bad(format!("the state has no `{name}`")))?;
        let dtype = self.dtype(name, t)?;
        let elem = dtype.size_in_bytes();
        let n: i64 = dims.iter().product();
        let mut out = vec![0u8; n as usize * elem];
        let mut copied = 0u64;
        for b in &t.blocks {
            if !meets(&b.offset, &b.shape, at, dims) {
                continue;
            }
            let bytes = self.block_bytes(b)?;
            copied += copy_overlap(bytes, &b.offset, &b.shape, &mut out, at, dims, elem);
        }
        if copied != n as u64 {
            return Err(self.bad(format!(
                "`{name}`: its blocks cover {copied} of the {n} values at {at:?}"
            )));
        }
        let lit = Literal {
            ty: TensorType::new(dtype, dims.to_vec()),
            bytes: out,
        };
        match lit.non_finite_count() {
            0 => {}
            bad => {
                return Err(EngineError::NonFiniteSaved {
                    what: format!("the state saved in {}", self.dir.display()),
                    tensor: name.to_string(),
                    bad,
                    total: lit.ty.element_count(),
                })
            }
        }
        Ok(HostArray::from(lit))
    }

    /// The bytes of block `b`, checked against its checksum the first
    /// time.
    fn block_bytes(&self, b: &BlockEntry) -> Result<&[u8]> {
        let (_, bytes) = self
            .files
            .get(&b.file)
            .and_then(|f| f.get(&b.key))
            .expect("checked on opening");
        let id = (b.file.clone(), b.key.clone());
        let mut verified = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        if !verified.contains(&id) {
            let got = block_crc(bytes);
            if got != b.crc32 {
                return Err(EngineError::ShardedState {
                    path: self.dir.join(&b.file),
                    message: format!(
                        "block `{}` does not match its checksum (crc32 {got}, saved {}): the file was changed or damaged",
                        b.key, b.crc32
                    ),
                });
            }
            verified.insert(id);
        }
        Ok(bytes)
    }

    /// Tensor `name` whole.
    pub fn read(&self, name: &str) -> Result<HostArray> {
        let ty = self
            .tensor_type(name)?
            .ok_or_else(|| self.bad(format!("the state has no `{name}`")))?;
        self.read_region(name, &vec![0; ty.dims.len()], &ty.dims)
    }
}
