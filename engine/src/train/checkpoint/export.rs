//! A full-training run's parameters as an HF model folder, streamed from
//! its sharded state: one saved tensor (one layer of a stacked one) in
//! memory at a time, written in files of at most 5 GB with an index, as
//! transformers' `save_pretrained` writes them. What `train` writes into
//! its output folder at each save, and what `hlo-train export` writes
//! anywhere.

use std::borrow::Cow;
use std::path::Path;

use hlo_ir::TensorType;
use hlo_models::checkpoint::hf_parts;
use hlo_models::decoder::{is_stacked, unstacked_names, ModelConfig};
use hlo_models::io::{copy_side_files, write_hf_weights_with, MAX_SHARD_BYTES};
use hlo_models::ModelError;

use super::sharded::ShardedState;
use super::state_dir;
use crate::error::{EngineError, Result};

/// Where an HF tensor's bytes come from: a saved tensor (one layer of it
/// when stacked) and the byte range of that.
struct Source {
    tensor: String,
    layer: Option<i64>,
    range: std::ops::Range<usize>,
}

/// A saved tensor, and its layer when stacked.
type SourceKey = (String, Option<i64>);

/// The HF tensors (name, type) of `state`'s parameters for `config`, and
/// where each comes from.
fn layout(state: &ShardedState, config: &ModelConfig) -> Result<Vec<(String, TensorType, Source)>> {
    let mut plan = Vec::new();
    for (name, t) in &state.manifest().tensors {
        if t.role != "parameter" {
            continue;
        }
        let ty = state.tensor_type(name)?.expect("listed");
        let layers: Vec<(String, TensorType, Option<i64>)> = if is_stacked(name) {
            let layer_ty = TensorType::new(ty.dtype, ty.dims[1..].to_vec());
            unstacked_names(name, ty.dims[0])
                .into_iter()
                .enumerate()
                .map(|(l, n)| (n, layer_ty.clone(), Some(l as i64)))
                .collect()
        } else {
            vec![(name.clone(), ty, None)]
        };
        for (layer_name, layer_ty, layer) in layers {
            for (hf, hf_ty, range) in hf_parts(config, &layer_name, &layer_ty) {
                let tensor = name.clone();
                plan.push((
                    hf,
                    hf_ty,
                    Source {
                        tensor,
                        layer,
                        range,
                    },
                ));
            }
        }
    }
    Ok(plan)
}

/// The HF tensors of the export `plan` are exactly those of `config`'s
/// model, with its shapes; else the first difference (transformers would
/// fill a missing weight with random values, and ignore an extra one).
fn check_against_config(plan: &[(String, TensorType, Source)], config: &ModelConfig) -> Result<()> {
    let mut want: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
    for (name, shape) in config.parameter_shapes() {
        let ty = TensorType::new(hlo_ir::DType::F32, shape);
        for (hf, hf_ty, _) in hf_parts(config, &name, &ty) {
            want.insert(hf, hf_ty.dims);
        }
    }
    let differ = |m: String| {
        Err(EngineError::Export(format!(
            "the saved state differs from config.json: {m}"
        )))
    };
    for (name, ty, _) in plan {
        match want.remove(name) {
            None => {
                return differ(format!(
                    "it holds `{name}`, which the config's model does not have"
                ))
            }
            Some(dims) if dims != ty.dims => {
                return differ(format!(
                    "`{name}` is saved as {:?}, the config's model has {dims:?}",
                    ty.dims
                ))
            }
            Some(_) => {}
        }
    }
    match want.keys().next() {
        Some(missing) => differ(format!(
            "it has no parameter `{missing}`, which the config's model has"
        )),
        None => Ok(()),
    }
}

/// The bytes of `tensor` (layer `layer` of it when stacked).
fn read_source(state: &ShardedState, tensor: &str, layer: Option<i64>) -> Result<Vec<u8>> {
    let ty = state.tensor_type(tensor)?.expect("listed");
    let host = match layer {
        Some(l) => {
            let mut at = vec![0; ty.dims.len()];
            at[0] = l;
            let mut dims = ty.dims.clone();
            dims[0] = 1;
            state.read_region(tensor, &at, &dims)?
        }
        None => state.read(tensor)?,
    };
    Ok(hlo_ir::Literal::from(host).bytes)
}

/// Writes `state`'s parameters into `out` as an HF model's weights
/// (`model.safetensors`, or files of at most 5 GB and their index).
/// Returns the files written.
pub fn write_hf_weights(
    state: &ShardedState,
    config: &ModelConfig,
    out: &Path,
) -> Result<Vec<String>> {
    let plan = layout(state, config)?;
    check_against_config(&plan, config)?;
    let types: Vec<(String, TensorType)> = plan
        .iter()
        .map(|(n, t, _)| (n.clone(), t.clone()))
        .collect();
    // The saved tensor last read: a sparse layer's experts are cut from one.
    let mut last: Option<(SourceKey, Vec<u8>)> = None;
    let files = write_hf_weights_with(out, &types, MAX_SHARD_BYTES, |i| {
        let src = &plan[i].2;
        let key = (src.tensor.clone(), src.layer);
        if last.as_ref().map(|(k, _)| k) != Some(&key) {
            let bytes =
                read_source(state, &src.tensor, src.layer).map_err(|e| ModelError::Checkpoint {
                    file: out.display().to_string(),
                    message: e.to_string(),
                })?;
            last = Some((key, bytes));
        }
        let bytes = &last.as_ref().expect("just read").1;
        if src.range == (0..bytes.len()) {
            return Ok(Cow::Owned(last.take().expect("just read").1));
        }
        Ok(Cow::Owned(bytes[src.range.clone()].to_vec()))
    })?;
    Ok(files)
}

/// `hlo-train export RUN --out DIR`: the full-training run saved in `run`
/// as an HF model folder in `out` (its weights from the sharded state;
/// `config.json`, tokenizer and generation settings copied from `run`).
pub fn export(run: &Path, out: &Path) -> Result<Vec<String>> {
    let dir = state_dir(run).map_err(|_| {
        EngineError::Export(format!(
            "{} holds no saved run (no train_state/)",
            run.display()
        ))
    })?;
    if !dir.join(super::sharded::MANIFEST).is_file() {
        return Err(EngineError::Export(format!(
            "{} was saved by an hlo-train without sharded states; its weights are already the HF folder {}",
            dir.display(),
            run.display()
        )));
    }
    let state = ShardedState::open(&dir)?;
    if state.manifest().tensors.keys().any(|n| n.contains("lora_")) {
        return Err(EngineError::Export(format!(
            "{} is a LoRA run: its PEFT adapter is in that folder (hlo-train merge folds it into the base)",
            run.display()
        )));
    }
    let config_path = run.join("config.json");
    let config = ModelConfig::from_file(&config_path)?;
    if out.exists() && !out.is_dir() {
        return Err(EngineError::OutIsFile {
            out: out.to_path_buf(),
        });
    }
    // A model already there is the user's: never written over.
    let weights = [
        "config.json",
        "model.safetensors",
        hlo_models::io::WEIGHTS_INDEX,
    ];
    if weights.iter().any(|f| out.join(f).exists()) {
        return Err(EngineError::Export(format!(
            "--out {} holds a model already; give an empty or new folder",
            out.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(EngineError::io("create", out))?;
    let files = write_hf_weights(&state, &config, out)?;
    let config_bytes =
        std::fs::read(&config_path).map_err(EngineError::io("read", &config_path))?;
    hlo_models::io::write_atomic(&out.join("config.json"), &config_bytes)?;
    copy_side_files(run, out)?;
    Ok(files)
}
