//! Saving a run so it can be used and continued: the PEFT adapter (or HF
//! weights when finetuning fully) and `train_state/` (trainable
//! parameters, optimizer moments, step counter, data cursor and the
//! settings the run depends on). `train_state/` is built under a
//! temporary name and swapped in whole, so a crash at any moment leaves
//! the previous one (or its `.old` copy) readable.

use std::path::{Path, PathBuf};

use hlo_ir::Literal;
use hlo_models::io::{read_safetensors, write_atomic, write_safetensors};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::session::Session;

/// The settings a saved run depends on: a resumed run must have the same.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSettings {
    pub seed: u64,
    pub batch: i64,
    #[serde(default = "one")]
    pub grad_accum: i64,
    /// Whether rows are packed (after `--packing auto` is resolved); runs
    /// saved before packing existed were unpacked.
    #[serde(default)]
    pub packed: bool,
    pub seq: i64,
    pub full: bool,
    pub lora_rank: i64,
    pub optimizer: String,
}

fn one() -> i64 {
    1
}

/// What `train_state/state.json` records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    pub version: u32,
    /// Steps taken.
    pub step: i64,
    /// Samples the loader has handed out (what comes next is fixed by it).
    pub data_cursor: u64,
    #[serde(flatten)]
    pub settings: RunSettings,
}

impl RunSettings {
    /// The settings of `session`'s run.
    pub fn of(session: &Session) -> RunSettings {
        RunSettings::new(session.config(), session.seed())
    }

    /// The settings of a run of `c` seeded by `seed`.
    pub fn new(c: &hlo_models::train::TrainConfig, seed: u64) -> RunSettings {
        RunSettings {
            seed,
            batch: c.batch,
            grad_accum: c.grad_accum,
            packed: c.packing,
            seq: c.seq,
            full: c.lora.is_none(),
            // The flag's default when finetuning fully, as runs were saved.
            lora_rank: c.lora.as_ref().map_or(8, |l| l.rank),
            optimizer: match c.optimizer {
                hlo_models::train::Optimizer::AdamW { .. } => "adamw",
                hlo_models::train::Optimizer::Sgd => "sgd",
            }
            .to_string(),
        }
    }

    /// Every setting that differs from `now`'s, as `name = saved, this run
    /// has now`.
    pub fn differences(&self, now: &RunSettings) -> Vec<String> {
        let (a, b) = (
            serde_json::to_value(self).unwrap_or_default(),
            serde_json::to_value(now).unwrap_or_default(),
        );
        let mut out = Vec::new();
        if let (Some(a), Some(b)) = (a.as_object(), b.as_object()) {
            for (key, saved) in a {
                let current = &b[key];
                if saved != current {
                    out.push(format!(
                        "the run was saved with {key} = {saved}, this run has {current}"
                    ));
                }
            }
        }
        out
    }
}

/// A saved run read back: its state and tensors.
pub struct Saved {
    pub state: RunState,
    pub tensors: Vec<(String, Literal)>,
}

/// Writes the session's state into `out`: the adapter (PEFT) or HF
/// weights (`model.safetensors` + `config.json`), and `train_state/`.
pub fn save(out: &Path, session: &Session, state: &RunState) -> Result<()> {
    std::fs::create_dir_all(out).map_err(EngineError::io("create", out))?;
    let tensors = session.checkpoint_tensors()?;
    match session.adapter()? {
        Some(adapter) => adapter.save(out, Some(&session.model().name))?,
        None => {
            let trained = session.trained_tensors()?;
            write_safetensors(&out.join("model.safetensors"), &trained)?;
            write_atomic(
                &out.join("config.json"),
                session.model().config.to_json().as_bytes(),
            )?;
        }
    }
    let fresh = out.join("train_state.new");
    let _ = std::fs::remove_dir_all(&fresh);
    std::fs::create_dir_all(&fresh).map_err(EngineError::io("create", &fresh))?;
    write_safetensors(&fresh.join("state.safetensors"), &tensors)?;
    let json = serde_json::to_string_pretty(state)
        .map_err(|e| EngineError::Setting(format!("cannot encode state.json: {e}")))?;
    write_atomic(&fresh.join("state.json"), json.as_bytes())?;
    let current = out.join("train_state");
    let old = out.join("train_state.old");
    if current.exists() {
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&current, &old).map_err(EngineError::io("replace", &current))?;
    }
    std::fs::rename(&fresh, &current).map_err(EngineError::io("write", &current))?;
    // The renames are durable once the folder itself is synced.
    std::fs::File::open(out)
        .and_then(|d| d.sync_all())
        .map_err(EngineError::io("sync", out))?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

/// The folder holding a saved run's state: `train_state/`, or the `.old`
/// copy a crash mid-swap left behind.
fn state_dir(dir: &Path) -> Result<PathBuf> {
    [dir.join("train_state"), dir.join("train_state.old")]
        .into_iter()
        .find(|d| d.join("state.json").is_file())
        .ok_or_else(|| {
            EngineError::Resume(format!(
                "{} has no train_state/ to resume from",
                dir.display()
            ))
        })
}

/// Reads the run saved in `dir`.
pub fn load(dir: &Path) -> Result<Saved> {
    let state_dir = state_dir(dir)?;
    let path = state_dir.join("state.json");
    let text = std::fs::read_to_string(&path).map_err(EngineError::io("read", &path))?;
    let state: RunState = serde_json::from_str(&text).map_err(|e| {
        EngineError::Resume(format!("{} is not a run's state: {e}", path.display()))
    })?;
    let tensors = read_safetensors(&state_dir.join("state.safetensors"))?;
    Ok(Saved { state, tensors })
}
