//! Sharded states: every process writes the blocks it holds (here two
//! processes are played by one 8-device session, each writing the
//! blocks of its half of the mesh); the state restores bit for bit onto
//! other meshes and one device; `export`'s HF weights are the gathered
//! weights exactly; a damaged or incomplete state, or a non-finite one,
//! is refused.

use std::path::{Path, PathBuf};

use hlo_engine::device::backend::{Backend, BackendOptions};
use hlo_engine::inputs::model::{Model, ModelSource};
use hlo_engine::ir::{DType, Literal};
use hlo_engine::models::checkpoint::hf_layout;
use hlo_engine::models::io::read_safetensors;
use hlo_engine::models::train::TrainConfig;
use hlo_engine::train::checkpoint::export::write_hf_weights;
use hlo_engine::train::checkpoint::sharded::{
    write_process_shards, Manifest, ShardedState, MANIFEST,
};
use hlo_engine::train::checkpoint::{self, RunSettings, RunState, SavedTensors};
use hlo_engine::train::session::{Session, SessionOptions};
use hlo_engine::EngineError;

fn session(mesh: &str) -> Session {
    std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    let mut options = BackendOptions::cpu();
    let mesh: hlo_engine::partitioner::Mesh = mesh.parse().unwrap();
    options.devices = Some(mesh.size() as u32);
    options.mesh = Some(mesh);
    let backend = Backend::open(&options).unwrap();
    let model = Model::open(&ModelSource::Preset("tiny".into())).unwrap();
    let config = TrainConfig::new(DType::F32, 8, 16);
    Session::new(backend, model, config, SessionOptions::default()).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hlo-engine-sharded-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every checkpointed tensor given values no two places share (the step
/// counter 5), so a block put back in the wrong place shows.
fn distinct_state(session: &mut Session) -> Vec<(String, Literal)> {
    let mut tensors = session.checkpoint_tensors().unwrap();
    for (i, (name, lit)) in tensors.iter_mut().enumerate() {
        let n = lit.ty.element_count();
        let values: Vec<f64> = if name == "step" {
            vec![5.0; n]
        } else {
            (0..n).map(|j| i as f64 + j as f64 / n as f64).collect()
        };
        *lit = Literal::from_f64s(lit.ty.clone(), &values);
    }
    session.restore(&tensors).unwrap();
    tensors
}

/// `session`'s state written as two processes of four devices each
/// would write it (process 1 holding the odd mesh positions, so that each
/// holds blocks of the fsdp split and both write), with the manifest.
fn save_as_two_processes(session: &Session, dir: &Path) {
    let arrays = session.state_arrays();
    let halves = [
        write_process_shards(dir, &arrays, 0, 2, |d| d % 2 == 0, "test").unwrap(),
        write_process_shards(dir, &arrays, 1, 2, |d| d % 2 == 1, "test").unwrap(),
    ];
    // Each wrote blocks of its own.
    assert!(halves.iter().all(|h| !h.blocks.is_empty()));
    let manifest = Manifest::new(&arrays, &halves).unwrap();
    let text = serde_json::to_string_pretty(&manifest).unwrap();
    std::fs::write(dir.join(MANIFEST), text).unwrap();
}

#[test]
fn a_state_written_by_two_processes_restores_onto_other_meshes_and_one_device() {
    let mut saved_from = session("dp=2,fsdp=4,mp=1");
    let tensors = distinct_state(&mut saved_from);
    let dir = scratch("restore");
    save_as_two_processes(&saved_from, &dir);
    let saved = SavedTensors::Sharded(Box::new(ShardedState::open(&dir).unwrap()));
    for mesh in ["dp=1,fsdp=8,mp=1", "dp=1,fsdp=1,mp=1", "dp=2,fsdp=2,mp=2"] {
        let mut s = session(mesh);
        s.restore_saved(&saved).unwrap();
        assert_eq!(s.steps_done(), 5, "{mesh}");
        let back = s.checkpoint_tensors().unwrap();
        assert_eq!(back.len(), tensors.len());
        for ((n, a), (m, b)) in back.iter().zip(&tensors) {
            assert_eq!(n, m);
            assert!(a == b, "{mesh}: `{n}` differs after the restore");
        }
    }
    // The HF weights export writes are the gathered weights, exactly.
    let SavedTensors::Sharded(state) = &saved else {
        unreachable!()
    };
    let out = dir.join("hf");
    std::fs::create_dir_all(&out).unwrap();
    write_hf_weights(state, &saved_from.model().config, &out).unwrap();
    let mut exported = read_safetensors(&out.join("model.safetensors")).unwrap();
    let mut gathered = hf_layout(
        &saved_from.model().config,
        saved_from.trained_tensors().unwrap(),
    );
    exported.sort_by(|a, b| a.0.cmp(&b.0));
    gathered.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(exported.len(), gathered.len());
    for ((n, a), (m, b)) in exported.iter().zip(&gathered) {
        assert_eq!(n, m);
        assert!(a == b, "`{n}` exported differs from the gathered weight");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_damaged_or_incomplete_state_is_refused() {
    let mut saved_from = session("dp=2,fsdp=4,mp=1");
    distinct_state(&mut saved_from);
    let dir = scratch("damaged");
    save_as_two_processes(&saved_from, &dir);
    // A flipped byte in one process's file.
    let file = dir.join("shard-00001-of-00002.safetensors");
    let good = std::fs::read(&file).unwrap();
    let mut bad = good.clone();
    let at = bad.len() - 3;
    bad[at] ^= 1;
    std::fs::write(&file, &bad).unwrap();
    let saved = SavedTensors::Sharded(Box::new(ShardedState::open(&dir).unwrap()));
    let err = session("dp=1,fsdp=8,mp=1")
        .restore_saved(&saved)
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not match its checksum"), "{err}");
    drop(saved);
    std::fs::write(&file, &good).unwrap();
    // A manifest that lost one block of a tensor.
    let path = dir.join(MANIFEST);
    let mut manifest: Manifest =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let (name, t) = manifest
        .tensors
        .iter_mut()
        .find(|(_, t)| t.blocks.len() > 1)
        .unwrap();
    let name = name.clone();
    let lost = t.blocks.pop().unwrap();
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    let err = ShardedState::open(&dir).err().unwrap().to_string();
    assert!(err.contains(&format!("`{name}`: its blocks hold")), "{err}");
    // Two blocks at one offset (their sizes still adding up to the
    // tensor's): half of it would be zeros.
    let t = manifest.tensors.get_mut(&name).unwrap();
    t.blocks.push(lost);
    let last = t.blocks.len() - 1;
    t.blocks[last].offset = t.blocks[0].offset.clone();
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    let err = ShardedState::open(&dir).err().unwrap().to_string();
    assert!(
        err.contains(&format!("`{name}`: blocks")) && err.contains("overlap"),
        "{err}"
    );
    // A block past the tensor's end.
    let t = manifest.tensors.get_mut(&name).unwrap();
    t.blocks[last].offset[0] = t.shape[0];
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    let err = ShardedState::open(&dir).err().unwrap().to_string();
    assert!(err.contains("lies outside its shape"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A saved block holding a NaN, its checksum made to match: a restore
/// says the state cannot be resumed (not the save's "nothing was saved").
#[test]
fn a_non_finite_saved_block_is_refused_on_restore() {
    let mut saved_from = session("dp=2,fsdp=4,mp=1");
    distinct_state(&mut saved_from);
    let dir = scratch("non-finite-read");
    save_as_two_processes(&saved_from, &dir);
    let path = dir.join(MANIFEST);
    let mut manifest: Manifest =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let (name, t) = manifest
        .tensors
        .iter_mut()
        .find(|(_, t)| t.dtype == "F32" && t.role == "parameter")
        .unwrap();
    let name = name.clone();
    let block = &mut t.blocks[0];
    let file = dir.join(&block.file);
    let mut bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = 8 + n + header[&block.key]["data_offsets"][0].as_u64().unwrap() as usize;
    let end = 8 + n + header[&block.key]["data_offsets"][1].as_u64().unwrap() as usize;
    bytes[start..start + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    block.crc32 = checkpoint::sharded::block_crc(&bytes[start..end]);
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    let saved = SavedTensors::Sharded(Box::new(ShardedState::open(&dir).unwrap()));
    let err = session("dp=1,fsdp=8,mp=1")
        .restore_saved(&saved)
        .unwrap_err();
    match &err {
        EngineError::NonFiniteSaved { tensor, .. } => assert_eq!(tensor, &name),
        other => panic!("{other}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("cannot be resumed or exported") && !text.contains("nothing was saved"),
        "{text}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_non_finite_optimizer_state_is_never_saved() {
    let mut s = session("dp=2,fsdp=4,mp=1");
    let mut tensors = distinct_state(&mut s);
    let (name, lit) = tensors
        .iter_mut()
        .find(|(n, _)| n.starts_with("opt.v."))
        .unwrap();
    let name = name.clone();
    let mut values = lit.to_f64s();
    values[1] = f64::NAN;
    *lit = Literal::from_f64s(lit.ty.clone(), &values);
    s.restore(&tensors).unwrap();
    let out = scratch("nan").join("run");
    let state = RunState {
        version: 2,
        step: 5,
        data_cursor: 0,
        settings: RunSettings::of(&s),
        checksum: None,
    };
    match checkpoint::save(&out, &s, &state).unwrap_err() {
        EngineError::NonFiniteState { tensor, bad, .. } => assert_eq!((tensor, bad), (name, 1)),
        other => panic!("{other}"),
    }
    // Nothing is left: the folder this save made is gone again.
    assert!(!out.exists(), "{} was left", out.display());
}
