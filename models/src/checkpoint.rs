//! HF safetensors checkpoints: one `model.safetensors`, or several listed by
//! `model.safetensors.index.json`. Files are memory-mapped; every tensor is
//! checked against the config (name, shape, dtype, offsets inside its file)
//! before anything is loaded, and tensors are read one at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use hlo_ir::{DType, Literal, TensorType};
use memmap2::Mmap;

use crate::decoder::ModelConfig;
use crate::mxfp4;
use crate::nf4::{self, Nf4Tensor};
use crate::safetensors_file::mmap;
pub use crate::safetensors_file::{index_file, StoredTensor};
use crate::ModelError;

/// What a packed weight's quant state says beyond what is checked.
struct Nf4State {
    /// Set when the absmax are quantized again.
    nested_offset: Option<f32>,
}

struct Entry {
    file: usize,
    tensor: StoredTensor,
}

/// An opened HF model folder.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    files: Vec<(PathBuf, Mmap)>,
    tensors: BTreeMap<String, Entry>,
    /// Parameters stored in parts: a mixture of experts' fused tensors
    /// from per-expert ones, and Mixtral's router under its stored name;
    /// the parts' values, in order, are the parameter's.
    joined: BTreeMap<String, Vec<String>>,
    /// gpt-oss expert tensors stored in MXFP4 (`<name>_blocks`,
    /// `<name>_scales`), dequantized when read.
    mxfp4: BTreeSet<String>,
}

/// Parameters as transformers 5's `save_pretrained` writes them: a sparse
/// layer's fused experts split per expert under the checkpoint names
/// (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`; Mixtral's
/// `block_sparse_moe.experts.{e}.w1/w3/w2.weight`, its router
/// `block_sparse_moe.gate.weight`); every other parameter as it is.
pub fn hf_layout(config: &ModelConfig, params: Vec<(String, Literal)>) -> Vec<(String, Literal)> {
    let mut out = Vec::with_capacity(params.len());
    for (name, lit) in params {
        let mut parts = hf_parts(config, &name, &lit.ty);
        if parts.len() == 1 && parts[0].2 == (0..lit.bytes.len()) {
            let (hf_name, ty, _) = parts.remove(0);
            out.push((
                hf_name,
                Literal {
                    ty,
                    bytes: lit.bytes,
                },
            ));
            continue;
        }
        for (hf_name, ty, range) in parts {
            let bytes = lit.bytes[range].to_vec();
            out.push((hf_name, Literal { ty, bytes }));
        }
    }
    out
}

/// How [`hf_layout`] writes parameter `name` of type `ty`: each tensor it
/// becomes (name, type, and the byte range of the parameter it holds).
/// Known from names and types alone, so a writer can lay out files before
/// reading any weight.
pub fn hf_parts(
    config: &ModelConfig,
    name: &str,
    ty: &TensorType,
) -> Vec<(String, TensorType, std::ops::Range<usize>)> {
    let whole = vec![(name.to_string(), ty.clone(), 0..ty.size_in_bytes())];
    // gpt-oss's are saved fused, as the model holds them.
    if config.moe.as_ref().is_some_and(|m| m.transposed()) {
        return whole;
    }
    let (module, [gate, up, down]) = per_expert_names(config);
    let Some((layer, what)) = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
        .filter(|(l, _)| l.parse::<i64>().is_ok_and(|l| config.is_sparse(l)))
    else {
        return whole;
    };
    let at = format!("model.layers.{layer}.{module}");
    let names: &[&str] = match what {
        "mlp.gate.weight" => {
            return vec![(
                format!("{at}.gate.weight"),
                whole[0].1.clone(),
                whole[0].2.clone(),
            )]
        }
        "mlp.experts.gate_up_proj" => &[gate, up],
        "mlp.experts.down_proj" => &[down],
        _ => return whole,
    };
    // [E, rows, cols]: each expert's rows, split evenly among `names`.
    let (e, rows, cols) = (ty.dims[0], ty.dims[1], ty.dims[2]);
    let part_rows = rows / names.len() as i64;
    let size = (part_rows * cols) as usize * ty.dtype.size_in_bytes();
    let mut out = Vec::with_capacity(e as usize * names.len());
    for x in 0..e {
        for (k, w) in names.iter().enumerate() {
            let start = (x as usize * names.len() + k) * size;
            out.push((
                format!("{at}.experts.{x}.{w}.weight"),
                TensorType::new(ty.dtype, [part_rows, cols]),
                start..start + size,
            ));
        }
    }
    out
}

/// How a family's checkpoints name a sparse layer's experts stored one by
/// one: the module under the layer (Mixtral's `block_sparse_moe`, else
/// `mlp`) and each expert's gate, up and down weights (Mixtral's `w1`,
/// `w3`, `w2`).
fn per_expert_names(config: &ModelConfig) -> (&'static str, [&'static str; 3]) {
    if config.family == crate::decoder::Family::Mixtral {
        ("block_sparse_moe", ["w1", "w3", "w2"])
    } else {
        ("mlp", ["gate_proj", "up_proj", "down_proj"])
    }
}

/// Where each sparse layer's fused expert tensors and router are stored
/// when not under their own names, as transformers 5 converts on load:
/// per expert (`mlp.experts.{e}.gate_proj.weight`, `up_proj`,
/// `down_proj`; Mixtral's `block_sparse_moe.experts.{e}.w1` (gate), `w3`
/// (up), `w2` (down) and `block_sparse_moe.gate`), the gate and up rows of
/// each expert one after the other.
fn expert_parts(
    config: &ModelConfig,
    stored: &BTreeMap<String, Entry>,
) -> BTreeMap<String, Vec<String>> {
    let mut joined = BTreeMap::new();
    let Some(moe) = config.moe.as_ref().filter(|m| !m.transposed()) else {
        return joined;
    };
    let (module, names) = per_expert_names(config);
    for l in (0..config.num_hidden_layers).filter(|l| config.is_sparse(*l)) {
        let canonical = format!("model.layers.{l}.mlp");
        let stored_at = if stored.contains_key(&format!("{canonical}.gate.weight")) {
            canonical.clone()
        } else {
            format!("model.layers.{l}.{module}")
        };
        let router = format!("{canonical}.gate.weight");
        if stored_at != canonical {
            joined.insert(router, vec![format!("{stored_at}.gate.weight")]);
        }
        let expert = |e: i64, w: &str| format!("{stored_at}.experts.{e}.{w}.weight");
        for (fused, parts) in [("gate_up_proj", &names[..2]), ("down_proj", &names[2..])] {
            let name = format!("{canonical}.experts.{fused}");
            if stored.contains_key(&name) {
                continue;
            }
            let at = format!("{stored_at}.experts.{fused}");
            let list = if stored.contains_key(&at) {
                vec![at]
            } else {
                (0..moe.num_experts)
                    .flat_map(|e| parts.iter().map(move |w| expert(e, w)))
                    .collect()
            };
            joined.insert(name, list);
        }
    }
    joined
}

impl Checkpoint {
    /// Opens `dir` (config.json + safetensors) and checks every tensor the
    /// config needs.
    pub fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::MissingFolder(dir.to_path_buf()));
        }
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let index = dir.join("model.safetensors.index.json");
        let names: Vec<String> = if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(ModelError::io("read", &index))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::Checkpoint {
                    file: index.display().to_string(),
                    message: format!("not JSON: {e}"),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Checkpoint {
                    file: index.display().to_string(),
                    message: "no weight_map".into(),
                })?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut files = Vec::new();
        let mut tensors = BTreeMap::new();
        for name in names {
            if name.contains('/') || name.contains("..") {
                return Err(ModelError::Checkpoint {
                    file: index.display().to_string(),
                    message: format!("bad file name `{name}`"),
                });
            }
            let path = dir.join(&name);
            if !path.is_file() {
                return Err(ModelError::MissingShard {
                    file: name,
                    dir: dir.to_path_buf(),
                });
            }
            let map = mmap(&path)?;
            for tensor in index_file(&path, &map)? {
                let file = files.len();
                tensors.insert(tensor.name.clone(), Entry { file, tensor });
            }
            files.push((path, map));
        }
        let joined = expert_parts(&config, &tensors);
        // gpt-oss's released experts: blocks and scales where the tensor
        // would be.
        let mxfp4 = config
            .parameter_shapes()
            .into_iter()
            .map(|(name, _)| name)
            .filter(|name| {
                config.moe.as_ref().is_some_and(|m| m.transposed())
                    && !tensors.contains_key(name)
                    && tensors.contains_key(&format!("{name}{}", mxfp4::BLOCKS_SUFFIX))
            })
            .collect();
        let mut ckpt = Checkpoint {
            dir: dir.to_path_buf(),
            config,
            files,
            tensors,
            joined,
            mxfp4,
        };
        ckpt.untie_a_distinct_head()?;
        ckpt.check()?;
        Ok(ckpt)
    }

    /// transformers does not tie the head to the embeddings when the
    /// weights hold an `lm_head.weight` that differs from them (it warns,
    /// and uses the file's head): neither do we.
    fn untie_a_distinct_head(&mut self) -> Result<(), ModelError> {
        if !self.config.tie_word_embeddings || !self.tensors.contains_key("lm_head.weight") {
            return Ok(());
        }
        let head = self.read("lm_head.weight", DType::F32)?;
        let embed = self.read("model.embed_tokens.weight", DType::F32)?;
        if head.ty.dims != embed.ty.dims || head.bytes != embed.bytes {
            self.config.tie_word_embeddings = false;
        }
        Ok(())
    }

    /// Every parameter the config needs is present with its shape, and no
    /// layer lies beyond the config's depth.
    fn check(&self) -> Result<(), ModelError> {
        let here = |e: &Entry| self.files[e.file].0.display().to_string();
        for (name, shape) in self.config.parameter_shapes() {
            if let Some(parts) = self.joined.get(&name) {
                self.check_parts(&name, parts, &shape)?;
                continue;
            }
            if self.mxfp4.contains(&name) {
                self.check_mxfp4(&name, &shape)?;
                continue;
            }
            let e = self
                .tensors
                .get(&name)
                .ok_or_else(|| ModelError::Checkpoint {
                    file: self.dir.display().to_string(),
                    message: format!("tensor `{name}` is missing (config.json needs it)"),
                })?;
            if self.is_prequantized(&name) {
                self.nf4_state(&name, &shape)?;
                continue;
            }
            if e.tensor.shape != shape {
                return Err(ModelError::Checkpoint {
                    file: here(e),
                    message: format!(
                        "tensor `{name}` has shape {:?}, config.json implies {shape:?}",
                        e.tensor.shape
                    ),
                });
            }
            if !e.tensor.dtype.is_float() {
                return Err(ModelError::Checkpoint {
                    file: here(e),
                    message: format!("tensor `{name}` is {}, not a float", e.tensor.dtype),
                });
            }
        }
        for name in self.tensors.keys() {
            if let Some(rest) = name.strip_prefix("model.layers.") {
                let layer: i64 = rest
                    .split('.')
                    .next()
                    .and_then(|l| l.parse().ok())
                    .unwrap_or(-1);
                if layer >= self.config.num_hidden_layers {
                    return Err(ModelError::Checkpoint {
                        file: self.dir.display().to_string(),
                        message: format!(
                            "the weights have layer {layer} (`{name}`) but config.json says num_hidden_layers = {}",
                            self.config.num_hidden_layers
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// An MXFP4 tensor's blocks and scales are there, bytes, and of the
    /// shapes that hold `shape` ([`mxfp4::stored_shapes`]).
    fn check_mxfp4(&self, name: &str, shape: &[i64]) -> Result<(), ModelError> {
        let (blocks, scales) =
            mxfp4::stored_shapes(shape).ok_or_else(|| ModelError::Checkpoint {
                file: self.dir.display().to_string(),
                message: format!(
                    "`{name}` is stored in MXFP4, but its {shape:?} input features are not whole blocks of {}",
                    mxfp4::BLOCK
                ),
            })?;
        for (suffix, want) in [
            (mxfp4::BLOCKS_SUFFIX, blocks),
            (mxfp4::SCALES_SUFFIX, scales),
        ] {
            let e = self.entry(&format!("{name}{suffix}"))?;
            if e.tensor.dtype != DType::U8 || e.tensor.shape != want {
                return Err(ModelError::Checkpoint {
                    file: self.files[e.file].0.display().to_string(),
                    message: format!(
                        "tensor `{name}{suffix}` is {} {:?}, MXFP4 of {shape:?} is U8 {want:?}",
                        e.tensor.dtype, e.tensor.shape
                    ),
                });
            }
        }
        // E8M0 scales: 255 is NaN (the OCP format), and a block of it
        // would turn the layer's every output NaN.
        let e = self.entry(&format!("{name}{}", mxfp4::SCALES_SUFFIX))?;
        let scales = &self.files[e.file].1[e.tensor.start..e.tensor.end];
        let nan = scales.iter().filter(|&&s| s == mxfp4::NAN_SCALE).count();
        if nan > 0 {
            return Err(ModelError::Checkpoint {
                file: self.files[e.file].0.display().to_string(),
                message: format!(
                    "tensor `{name}{}` has {nan} scales of {} (NaN in MXFP4) among its {}; the checkpoint is damaged",
                    mxfp4::SCALES_SUFFIX,
                    mxfp4::NAN_SCALE,
                    scales.len()
                ),
            });
        }
        Ok(())
    }

    /// The parts of a parameter stored in parts ([`expert_parts`]) are
    /// there, floats, and together of the parameter's shape.
    fn check_parts(&self, name: &str, parts: &[String], shape: &[i64]) -> Result<(), ModelError> {
        let total: i64 = shape.iter().product();
        let mut sum = 0;
        for part in parts {
            let e = self
                .tensors
                .get(part)
                .ok_or_else(|| ModelError::Checkpoint {
                    file: self.dir.display().to_string(),
                    message: format!(
                        "tensor `{part}` is missing (config.json needs `{name}`, stored fused or per expert)"
                    ),
                })?;
            if !e.tensor.dtype.is_float() {
                return Err(ModelError::Checkpoint {
                    file: self.files[e.file].0.display().to_string(),
                    message: format!("tensor `{part}` is {}, not a float", e.tensor.dtype),
                });
            }
            // Every part is whole rows of the parameter.
            if e.tensor.shape.len() < 2 || e.tensor.shape.last() != shape.last() {
                return Err(ModelError::Checkpoint {
                    file: self.files[e.file].0.display().to_string(),
                    message: format!(
                        "tensor `{part}` has shape {:?}, config.json implies a part of {shape:?} for `{name}`",
                        e.tensor.shape
                    ),
                });
            }
            sum += e.tensor.shape.iter().product::<i64>();
        }
        if sum != total {
            return Err(ModelError::Checkpoint {
                file: self.dir.display().to_string(),
                message: format!(
                    "the parts of `{name}` hold {sum} values, config.json implies {shape:?}"
                ),
            });
        }
        Ok(())
    }

    /// The stored dtype of a tensor (of a parameter stored in parts, its
    /// first part's).
    pub fn dtype(&self, name: &str) -> Option<DType> {
        // transformers dequantizes MXFP4 to bf16, which holds it exactly.
        if self.mxfp4.contains(name) {
            return Some(DType::BF16);
        }
        let stored = self.joined.get(name).and_then(|p| p.first());
        let name = stored.map_or(name, String::as_str);
        self.tensors.get(name).map(|e| e.tensor.dtype)
    }

    /// The safetensors files the weights are read from.
    pub fn weight_files(&self) -> Vec<PathBuf> {
        self.files.iter().map(|(p, _)| p.clone()).collect()
    }

    /// Whether weight `name` is stored in bitsandbytes' packed 4-bit form.
    pub fn is_prequantized(&self, name: &str) -> bool {
        self.config.quantization.is_some()
            && nf4::is_quantized(name)
            && self.dtype(name) == Some(DType::U8)
    }

    /// The stored tensor `name`, or one line naming it.
    fn entry(&self, name: &str) -> Result<&Entry, ModelError> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::Checkpoint {
                file: self.dir.display().to_string(),
                message: format!("tensor `{name}` is missing"),
            })
    }

    /// The quant state bitsandbytes stores beside a packed weight
    /// (`<name>.quant_state.bitsandbytes__nf4`, JSON bytes), checked
    /// against the weight's `shape` and against what this reader
    /// computes: NF4 in blocks of 64, absmax in blocks of 256 when nested.
    fn nf4_state(&self, name: &str, shape: &[i64]) -> Result<Nf4State, ModelError> {
        let key = format!("{name}.quant_state.bitsandbytes__nf4");
        let e = self.entry(&key)?;
        let bad = |message: String| ModelError::Checkpoint {
            file: self.files[e.file].0.display().to_string(),
            message: format!("`{name}`: {message}"),
        };
        let bytes = &self.files[e.file].1[e.tensor.start..e.tensor.end];
        let state: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|err| bad(format!("its quant state is not JSON: {err}")))?;
        let text = |k: &str| state.get(k).and_then(|v| v.as_str());
        let int = |k: &str| state.get(k).and_then(|v| v.as_i64());
        if text("quant_type") != Some("nf4") {
            return Err(bad(format!(
                "quant_type {:?} (only nf4)",
                text("quant_type").unwrap_or("(none)")
            )));
        }
        if int("blocksize") != Some(nf4::BLOCK_SIZE as i64) {
            return Err(bad(format!(
                "blocksize {:?} (only {})",
                state.get("blocksize"),
                nf4::BLOCK_SIZE
            )));
        }
        let stored: Option<Vec<i64>> = state
            .get("shape")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(|d| d.as_i64()).collect());
        if stored.as_deref() != Some(shape) {
            return Err(bad(format!(
                "quantized shape {stored:?}, config.json implies {shape:?}"
            )));
        }
        let nested = state.get("nested_offset").and_then(|v| v.as_f64());
        if nested.is_some() && int("nested_blocksize") != Some(nf4::ABSMAX_BLOCK_SIZE as i64) {
            return Err(bad(format!(
                "nested_blocksize {:?} (only {})",
                state.get("nested_blocksize"),
                nf4::ABSMAX_BLOCK_SIZE
            )));
        }
        let n: i64 = shape.iter().product();
        let blocks = (n + nf4::BLOCK_SIZE as i64 - 1) / nf4::BLOCK_SIZE as i64;
        let size = |key: String, want: i64, dtype: DType| -> Result<(), ModelError> {
            let e = self.entry(&key)?;
            let got: i64 = e.tensor.shape.iter().product();
            if got != want || e.tensor.dtype != dtype {
                return Err(bad(format!(
                    "`{key}` is {} {:?}; {want} values of {dtype} expected",
                    e.tensor.dtype, e.tensor.shape
                )));
            }
            Ok(())
        };
        size(name.to_string(), (n + 1) / 2, DType::U8)?;
        size(
            format!("{name}.quant_map"),
            nf4::NF4_LEVELS.len() as i64,
            DType::F32,
        )?;
        match nested {
            None => size(format!("{name}.absmax"), blocks, DType::F32)?,
            Some(_) => {
                size(format!("{name}.absmax"), blocks, DType::U8)?;
                let groups =
                    (blocks + nf4::ABSMAX_BLOCK_SIZE as i64 - 1) / nf4::ABSMAX_BLOCK_SIZE as i64;
                size(format!("{name}.nested_absmax"), groups, DType::F32)?;
                size(format!("{name}.nested_quant_map"), 256, DType::F32)?;
            }
        }
        // A code book other than NF4's would change every weight.
        let map = self.read(&format!("{name}.quant_map"), DType::F32)?;
        let levels: Vec<u8> = nf4::NF4_LEVELS
            .iter()
            .flat_map(|l| l.to_le_bytes())
            .collect();
        if map.bytes != levels {
            return Err(bad("its quant_map is not the NF4 code book".into()));
        }
        Ok(Nf4State {
            nested_offset: nested.map(|o| o as f32),
        })
    }

    /// A weight stored in bitsandbytes' 4-bit NF4 form, as it is stored:
    /// the packed codes, and the absmax (plain, or quantized again with
    /// its nested absmax, code book and offset).
    pub fn read_nf4(&self, name: &str) -> Result<Nf4Tensor, ModelError> {
        let shape = self
            .config
            .parameter_shape(name)
            .ok_or_else(|| ModelError::Checkpoint {
                file: self.dir.display().to_string(),
                message: format!("`{name}` is no weight of the model"),
            })?;
        let state = self.nf4_state(name, &shape)?;
        let f32s = |key: String| -> Result<Vec<f32>, ModelError> {
            Ok(nf4::f32_values(&self.read(&key, DType::F32)?))
        };
        let raw =
            |key: String| -> Result<Vec<u8>, ModelError> { Ok(self.read(&key, DType::U8)?.bytes) };
        let absmax = match state.nested_offset {
            None => nf4::Absmax::Plain(f32s(format!("{name}.absmax"))?),
            Some(offset) => nf4::Absmax::Double(nf4::DoubleQuant {
                codes: raw(format!("{name}.absmax"))?,
                offset,
                absmax2: f32s(format!("{name}.nested_absmax"))?,
                code: f32s(format!("{name}.nested_quant_map"))?,
                blocksize: nf4::ABSMAX_BLOCK_SIZE,
            }),
        };
        Ok(Nf4Tensor {
            shape: shape.iter().map(|&d| d as usize).collect(),
            codes: raw(name.to_string())?,
            absmax,
        })
    }

    /// Reads one tensor, converted to `dtype` (a weight stored in 4-bit
    /// NF4, dequantized).
    pub fn read(&self, name: &str, dtype: DType) -> Result<Literal, ModelError> {
        if let Some(parts) = self.joined.get(name) {
            let shape = self.config.parameter_shape(name).unwrap_or_default();
            let mut bytes = Vec::new();
            for part in parts {
                bytes.extend(self.read(part, dtype)?.bytes);
            }
            return Ok(Literal {
                ty: TensorType::new(dtype, shape),
                bytes,
            });
        }
        if self.mxfp4.contains(name) {
            let shape = self.config.parameter_shape(name).unwrap_or_default();
            let bytes = |suffix: &str| -> Result<Vec<u8>, ModelError> {
                let e = self.entry(&format!("{name}{suffix}"))?;
                Ok(self.files[e.file].1[e.tensor.start..e.tensor.end].to_vec())
            };
            let values = mxfp4::dequantize(
                &bytes(mxfp4::BLOCKS_SUFFIX)?,
                &bytes(mxfp4::SCALES_SUFFIX)?,
                &shape,
            );
            // Every value is exact in bf16 and f32 up to their range.
            let past = values.iter().filter(|v| v.abs() >= mxfp4::RANGE).count();
            if past > 0 {
                return Err(ModelError::Checkpoint {
                    file: self.dir.display().to_string(),
                    message: format!(
                        "MXFP4 tensor `{name}` has {past} values past bf16's and f32's range (scales too large); the checkpoint is damaged"
                    ),
                });
            }
            return Ok(Literal::from_f64s(TensorType::new(dtype, shape), &values));
        }
        if dtype != DType::U8 && self.is_prequantized(name) {
            return Ok(self.read_nf4(name)?.dequantized_literal(dtype));
        }
        let e = self.entry(name)?;
        let stored = e.tensor.literal(&self.files[e.file].1);
        Ok(if e.tensor.dtype == dtype {
            stored
        } else {
            Literal::from_f64s(
                TensorType::new(dtype, e.tensor.shape.clone()),
                &stored.to_f64s(),
            )
        })
    }
}
