//! Saving a run so it can be used and continued: the PEFT adapter (or a
//! complete HF model folder when finetuning fully) and `train_state/`
//! (trainable parameters, optimizer moments and step counter as a sharded
//! state, [`sharded`]; the data cursor and the run's effective settings in
//! `state.json`). `train_state/` is built
//! under a temporary name and swapped in whole, so a crash at any moment
//! leaves the previous one (or its `.old` copy) readable; temporaries a
//! killed process left behind are removed by the next run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hlo_ir::Literal;
use hlo_models::adapter::Adapter;
use hlo_models::io::{read_safetensors, write_atomic};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::files::file_fingerprint;
use crate::train::session::Session;

pub mod export;
mod finite;
pub mod sharded;

use finite::check_finite;

/// The settings a run's result depends on, by the name of the flag that
/// sets each (`lr`, `lora-rank`, `data`, ...), plus identities that no flag
/// sets (`model-fingerprint`, `data-fingerprint`). A resumed run takes
/// them all; one given again must be equal.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunSettings(pub BTreeMap<String, Value>);

/// What `train_state/state.json` records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// 3 since the tensors are a sharded state; 2 recorded the settings in
    /// full beside `state.safetensors`; 1 recorded eight of them.
    pub version: u32,
    /// Steps taken.
    pub step: i64,
    /// Samples the loader has handed out (what comes next is fixed by it).
    pub data_cursor: u64,
    #[serde(default)]
    pub settings: RunSettings,
    /// FNV-1a of `state.safetensors`, hex (versions 1 and 2; a sharded
    /// state's checksums are in its manifest).
    #[serde(default)]
    pub checksum: Option<String>,
}

impl RunSettings {
    /// The settings a session knows of itself (shapes, optimizer,
    /// schedule, LoRA, seed): what a run saved through the library alone
    /// records. The CLI adds its data and model identities.
    pub fn of(session: &Session) -> RunSettings {
        RunSettings::of_config(session.config(), session.seed())
    }

    /// The settings of a run of `c` seeded by `seed`: the step's and the
    /// optimizer's as the step decided them (a full finetuning's LoRA
    /// settings and SGD's weight decay, which the step does not read, left
    /// out), the end of a cosine schedule and the dtype.
    pub fn of_config(c: &hlo_models::train::TrainConfig, seed: u64) -> RunSettings {
        use crate::settings::{names, record};
        use crate::step::{LoraSpec, OptimSpec, OptimizerKind, StepSpec};
        let (step, optim) = (StepSpec::decided(c), OptimSpec::decided(c));
        let mut s = RunSettings(record(&step).into_iter().collect());
        if step.full {
            for name in names::<LoraSpec>() {
                s.0.remove(&name);
            }
        }
        s.0.extend(record(&optim));
        if optim.optimizer == OptimizerKind::Sgd {
            s.0.remove("weight-decay");
        }
        if let hlo_models::train::Schedule::Cosine { total, .. } = c.schedule {
            s.set("steps", total);
        }
        s.set("seed", seed);
        let dtype = crate::inputs::model::DtypeSpec {
            dtype: Some(c.dtype),
        };
        s.0.extend(record(&dtype));
        s
    }

    pub fn set(&mut self, key: &str, value: impl Into<Value>) {
        self.0.insert(key.to_string(), value.into());
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key)
    }

    /// Adds `other`'s settings (replacing equal keys).
    pub fn extend(&mut self, other: &RunSettings) {
        for (k, v) in &other.0 {
            self.0.insert(k.clone(), v.clone());
        }
    }

    /// The settings of a version-1 state (eight, under other names).
    fn from_v1(v: &serde_json::Map<String, Value>) -> RunSettings {
        let mut s = RunSettings::default();
        for (old, new) in [
            ("seed", "seed"),
            ("batch", "batch"),
            ("seq", "seq"),
            ("full", "full"),
            ("lora_rank", "lora-rank"),
            ("optimizer", "optimizer"),
        ] {
            if let Some(x) = v.get(old) {
                s.set(new, x.clone());
            }
        }
        s.set(
            "grad-accum",
            v.get("grad_accum").cloned().unwrap_or(Value::from(1)),
        );
        let packed = v.get("packed").and_then(Value::as_bool).unwrap_or(false);
        s.set("packing", if packed { "on" } else { "off" });
        s
    }
}

/// The settings that shape a step, as a refusal names them: the model,
/// the step's configuration (as `train_state/` records it) and the mesh.
pub fn step_settings(
    model: &crate::inputs::model::Model,
    tc: &hlo_models::train::TrainConfig,
    mesh: &hlo_partitioner::Mesh,
) -> BTreeMap<String, Value> {
    let mut s = RunSettings::of_config(tc, 0).0;
    s.remove("seed");
    s.insert("model".into(), model.name.clone().into());
    s.insert("mesh".into(), mesh.to_string().into());
    s
}

/// `out` as a folder: made where missing, refused when a file.
pub fn make_out(out: &Path) -> Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(EngineError::OutIsFile {
            out: out.to_path_buf(),
        });
    }
    std::fs::create_dir_all(out).map_err(EngineError::io("create", out))
}

/// Checks that the folder `out` ([`make_out`]) can receive a run before
/// any work is done: a file can be created and removed in it.
/// Temporaries a killed run left there are removed (the caller holds
/// the folder's lock, so none is another live run's).
pub(crate) fn prepare_out(out: &Path) -> Result<()> {
    let probe = out.join(format!(".hlo-train-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe").map_err(EngineError::io("write to", out))?;
    std::fs::remove_file(&probe).map_err(EngineError::io("write to", out))?;
    remove_stale_temporaries(out);
    Ok(())
}

/// Whether the process `pid` is alive (Linux: it has a /proc entry).
fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes what an interrupted writer left in `dir`: `.NAME.tmp-PID`
/// files of dead processes, and `train_state.new/` (a save that did not
/// finish; the swap is the last step of a save).
pub fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let stale = hlo_fs::temporary_writer(&name)
            .is_some_and(|pid| pid != std::process::id() && !alive(pid));
        if stale {
            let _ = std::fs::remove_file(e.path());
        }
    }
    let _ = std::fs::remove_dir_all(dir.join("train_state.new"));
}

/// Whether `dir` holds a saved run (a state a run could continue from).
pub(crate) fn holds_run(dir: &Path) -> bool {
    ["train_state", "train_state.old"]
        .iter()
        .any(|f| dir.join(f).join("state.json").is_file())
}

/// Writes the session's state into `out`: the adapter (PEFT) or an HF
/// model folder, and `train_state/` (sharded: [`sharded`]). Refuses
/// (leaving the previous save) when a trained tensor is not finite.
/// Across processes each process writes its own blocks, and process 0 the
/// manifest, the adapter or HF folder, and the swap.
pub fn save(out: &Path, session: &Session, state: &RunState) -> Result<StateTransfer> {
    save_with(out, session, state, &[])
}

/// A save or a restore of a run's state, timed: what `train` reports.
#[derive(Clone, Debug, PartialEq)]
pub struct StateTransfer {
    /// The step saved or resumed.
    pub step: i64,
    /// The run's folder.
    pub dir: PathBuf,
    /// The state's bytes this process wrote (its shard file) or placed
    /// on its devices.
    pub bytes: u64,
    /// Seconds the state took: writing the shards, manifest and swap; or
    /// reading, checking and placing them.
    pub seconds: f64,
    /// What a save wrote after the state (`adapter` or `HF weights`) and
    /// the seconds it took; None for a restore.
    pub model: Option<(&'static str, f64)>,
}

impl StateTransfer {
    /// The state's rate, GB (1e9 bytes) a second.
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.seconds.max(1e-9)
    }
}

/// Saves made by this process: each process makes the same saves in the
/// same order, so the count names a save's meeting points alike in all.
static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// [`save`], with `extra` files (name, bytes) written into `train_state/`
/// beside the state, replaced with it at once.
pub(crate) fn save_with(
    out: &Path,
    session: &Session,
    state: &RunState,
    extra: &[(String, Vec<u8>)],
) -> Result<StateTransfer> {
    let started = std::time::Instant::now();
    let what = format!("step {}", state.step);
    let adapter = gathered_adapter(session, &what)?;
    let backend = session.backend();
    let main = backend.is_main();
    let group = backend.group().map(|g| &**g);
    let (process, processes) = group.map_or((0, 1), |g| (g.process_id(), g.num_processes()));
    let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let fresh = out.join("train_state.new");
    let made_out = !out.exists();
    if main {
        make_fresh(out, &fresh)?;
    }
    if let Some(g) = group {
        g.all_gather(&format!("save-{n}-begin"), b"")?;
    }
    let arrays = session.state_arrays();
    let written = match write_shards(group, n, &fresh, &arrays, (process, processes), &what) {
        Ok(w) => w,
        Err(e) => {
            if main {
                discard_fresh(out, &fresh, made_out);
            }
            return Err(e);
        }
    };
    let file = fresh.join(sharded::shard_file(process, processes));
    let mut transfer = StateTransfer {
        step: state.step,
        dir: out.to_path_buf(),
        bytes: std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0),
        seconds: 0.0,
        model: None,
    };
    if !main {
        transfer.seconds = started.elapsed().as_secs_f64();
        return Ok(transfer);
    }
    complete_train_state(&fresh, &arrays, &written, state, extra)?;
    swap_in(out, &fresh)?;
    transfer.seconds = started.elapsed().as_secs_f64();
    let what = save_model(out, session, adapter)?;
    transfer.model = Some((what, started.elapsed().as_secs_f64() - transfer.seconds));
    Ok(transfer)
}

/// The trained adapter of a LoRA session (None when finetuning fully),
/// gathered and checked finite before a save writes anything: it is
/// small, and a save refused here leaves the previous one untouched.
fn gathered_adapter(session: &Session, what: &str) -> Result<Option<Adapter>> {
    let Some(lora) = &session.config().lora else {
        return Ok(None);
    };
    let tensors = session.trained_tensors()?;
    check_finite(&tensors, what)?;
    Ok(Some(Adapter {
        lora: lora.clone(),
        tensors,
    }))
}

/// Makes `out` and an empty `fresh` (`train_state.new/`) to build the
/// state in, dropping what an unfinished save left there (process 0).
fn make_fresh(out: &Path, fresh: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(EngineError::io("create", out))?;
    let _ = std::fs::remove_dir_all(fresh);
    std::fs::create_dir_all(fresh).map_err(EngineError::io("create", fresh))?;
    Ok(())
}

/// Writes this process's shards of `arrays` into `fresh` and returns
/// every process's account of its own (across processes, exchanged at
/// save `n`'s meeting point), or the first failure.
fn write_shards(
    group: Option<&crate::device::processes::ProcessGroup>,
    n: u64,
    fresh: &Path,
    arrays: &[sharded::StateArray],
    (process, processes): (u32, u32),
    what: &str,
) -> Result<Vec<sharded::ProcessShards>> {
    let mine = sharded::write_process_shards(fresh, arrays, process, processes, |_| true, what);
    match group {
        Some(g) => exchange_shards(g, n, mine, fresh),
        None => mine.map(|m| vec![m]),
    }
}

/// Undoes a failed save's folders: `fresh`, and `out` too when this save
/// made it (and it is empty), so a failure leaves no trace.
fn discard_fresh(out: &Path, fresh: &Path, made_out: bool) {
    let _ = std::fs::remove_dir_all(fresh);
    if made_out {
        let _ = std::fs::remove_dir(out);
    }
}

/// Completes the state in `fresh` once every shard is written: the
/// manifest, `state.json` (as version 3, with no checksum: the manifest
/// holds them) and the `extra` files; all before the swap makes it the
/// run's state.
fn complete_train_state(
    fresh: &Path,
    arrays: &[sharded::StateArray],
    written: &[sharded::ProcessShards],
    state: &RunState,
    extra: &[(String, Vec<u8>)],
) -> Result<()> {
    let manifest = sharded::Manifest::new(arrays, written)?;
    write_json(&fresh.join(sharded::MANIFEST), &manifest)?;
    let state = RunState {
        version: 3,
        checksum: None,
        ..state.clone()
    };
    write_json(&fresh.join("state.json"), &state)?;
    for (name, bytes) in extra {
        write_atomic(&fresh.join(name), bytes)?;
    }
    Ok(())
}

/// Writes the usable model after the state is swapped in: the `adapter`
/// (PEFT), or for full finetuning an HF folder exported from the saved
/// state. Returns what it wrote, as [`StateTransfer::model`] names it.
fn save_model(out: &Path, session: &Session, adapter: Option<Adapter>) -> Result<&'static str> {
    Ok(match adapter {
        Some(a) => {
            a.save(out, Some(&session.model().base_name()))?;
            "adapter"
        }
        None => {
            let saved = sharded::ShardedState::open(&out.join("train_state"))?;
            export::write_hf_weights(&saved, &session.model().config, out)?;
            session.model().save_hf_side_files(out)?;
            "HF weights"
        }
    })
}

/// Every process's account of its shards (`mine` is this one's), or the
/// first failure: this process's own error, else a line naming the
/// process that failed.
fn exchange_shards(
    group: &crate::device::processes::ProcessGroup,
    n: u64,
    mine: Result<sharded::ProcessShards>,
    fresh: &Path,
) -> Result<Vec<sharded::ProcessShards>> {
    let report: std::result::Result<&sharded::ProcessShards, String> =
        mine.as_ref().map_err(|e| e.to_string());
    let bytes = serde_json::to_vec(&report).expect("a report serialises");
    let all = group.all_gather(&format!("save-{n}-written"), &bytes)?;
    mine?;
    all.iter()
        .enumerate()
        .map(|(p, raw)| {
            let failed = |message: String| EngineError::ShardedState {
                path: fresh.to_path_buf(),
                message: format!("process {p} could not write its shards: {message}"),
            };
            match serde_json::from_slice::<std::result::Result<sharded::ProcessShards, String>>(raw)
            {
                Ok(Ok(s)) => Ok(s),
                Ok(Err(message)) => Err(failed(message)),
                Err(e) => Err(failed(format!("its report is not readable: {e}"))),
            }
        })
        .collect()
}

/// `value` as pretty JSON at `path`, atomically.
fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let json = serde_json::to_string_pretty(value).map_err(|cause| EngineError::Json {
        path: path.to_path_buf(),
        cause,
    })?;
    Ok(write_atomic(path, json.as_bytes())?)
}

/// Makes `fresh` the run's `train_state/`: the current one moved to
/// `.old` first, so a crash at any moment leaves one readable.
fn swap_in(out: &Path, fresh: &Path) -> Result<()> {
    let current = out.join("train_state");
    let old = out.join("train_state.old");
    if current.exists() {
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&current, &old).map_err(EngineError::io("replace", &current))?;
    }
    std::fs::rename(fresh, &current).map_err(EngineError::io("write", &current))?;
    // The renames are durable once the folder itself is synced.
    std::fs::File::open(out)
        .and_then(|d| d.sync_all())
        .map_err(EngineError::io("sync", out))?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

/// A saved run read back: its state and tensors.
pub struct Saved {
    pub state: RunState,
    pub tensors: SavedTensors,
}

/// A saved run's tensors: whole (`state.safetensors`, as runs saved
/// before sharded states), or a sharded state read block by block.
pub enum SavedTensors {
    Whole(Vec<(String, Literal)>),
    Sharded(Box<sharded::ShardedState>),
}

/// The folder holding a saved run's state: `train_state/`, or the `.old`
/// copy a crash mid-swap left behind.
pub(crate) fn state_dir(dir: &Path) -> Result<PathBuf> {
    [dir.join("train_state"), dir.join("train_state.old")]
        .into_iter()
        .find(|d| d.join("state.json").is_file())
        .ok_or_else(|| {
            EngineError::Resume(format!(
                "{} has no train_state/ to resume from (a run stopped before its first save keeps none): start it again with --out {}",
                dir.display(),
                dir.display()
            ))
        })
}

/// The settings of the run saved in `dir` (only its `state.json` is read),
/// or None when `dir` holds no run: what a command reading the run's
/// adapter takes its defaults from.
pub(crate) fn saved_settings(dir: &Path) -> Result<Option<RunSettings>> {
    let Ok(state_dir) = state_dir(dir) else {
        return Ok(None);
    };
    let path = state_dir.join("state.json");
    let text = std::fs::read_to_string(&path).map_err(EngineError::io("read", &path))?;
    let raw: Value = serde_json::from_str(&text).map_err(|cause| EngineError::Json {
        path: path.clone(),
        cause,
    })?;
    Ok(raw.get("settings").map(|s| {
        RunSettings(
            s.as_object()
                .map(|m| m.clone().into_iter().collect())
                .unwrap_or_default(),
        )
    }))
}

/// Reads and checks the run saved in `dir`: the checksum, the step and
/// cursor, the step counter tensor, and that every tensor is finite.
pub fn load(dir: &Path) -> Result<Saved> {
    let state_dir = state_dir(dir)?;
    let path = state_dir.join("state.json");
    let bad = |m: String| EngineError::Resume(format!("{}: {m}", path.display()));
    let text = std::fs::read_to_string(&path).map_err(EngineError::io("read", &path))?;
    let raw: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let object = raw
        .as_object()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    let step = object
        .get("step")
        .and_then(Value::as_i64)
        .filter(|&s| s >= 0)
        .ok_or_else(|| bad("`step` is not a step count".into()))?;
    let data_cursor = object
        .get("data_cursor")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("`data_cursor` is not a sample count".into()))?;
    let version = object.get("version").and_then(Value::as_u64).unwrap_or(1) as u32;
    let state = if version >= 2 {
        serde_json::from_value::<RunState>(raw.clone())
            .map_err(|e| bad(format!("not a run's state: {e}")))?
    } else {
        RunState {
            version,
            step,
            data_cursor,
            settings: RunSettings::from_v1(object),
            checksum: None,
        }
    };
    let counter_matches = |saved: f64| -> Result<()> {
        if saved as i64 != step {
            return Err(bad(format!(
                "`step` is {step} but the saved step counter is {saved}"
            )));
        }
        Ok(())
    };
    if state_dir.join(sharded::MANIFEST).is_file() {
        let sharded = sharded::ShardedState::open(&state_dir)?;
        if sharded.tensor_type("step")?.is_some() {
            counter_matches(
                sharded
                    .read("step")?
                    .to_f64_vec()
                    .first()
                    .copied()
                    .unwrap_or(-1.0),
            )?;
        }
        return Ok(Saved {
            state,
            tensors: SavedTensors::Sharded(Box::new(sharded)),
        });
    }
    let weights = state_dir.join("state.safetensors");
    if let Some(want) = &state.checksum {
        let got = file_fingerprint(&weights)?;
        if &got != want {
            return Err(bad(format!(
                "state.safetensors does not match its checksum ({got}, saved {want}): the file was changed or damaged"
            )));
        }
    }
    let tensors = read_safetensors(&weights)?;
    if let Some((_, counter)) = tensors.iter().find(|(n, _)| n == "step") {
        counter_matches(counter.to_f64s().first().copied().unwrap_or(-1.0))?;
    }
    check_finite(&tensors, &format!("the state saved in {}", dir.display()))?;
    Ok(Saved {
        state,
        tensors: SavedTensors::Whole(tensors),
    })
}
