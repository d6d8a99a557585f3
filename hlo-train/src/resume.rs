//! `train --resume DIR`: the run continues with every setting it was saved
//! with. Settings are recorded by flag name; a flag the command line does
//! not give takes its saved value, and one it gives must equal it (every
//! difference is listed at once). `--steps` may extend a constant schedule;
//! a cosine schedule ends where it was planned to.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::Path;

use std::path::Path as FsPath;

use anyhow::{bail, Result};
use hlo_engine::checkpoint::RunSettings;
use hlo_engine::{Dataset, Model, ModelSource};
use serde_json::Value;

use crate::train::TrainArgs;

/// The settings that are flags of `train`, by long name. (A setting that
/// names a file is compared by the file's identity too: `*-fingerprint`.)
pub const FLAG_SETTINGS: [&str; 33] = [
    "model",
    "config",
    "checkpoint",
    "quantize",
    "double-quant",
    "dtype",
    "tokenizer",
    "init-adapter",
    "data",
    "chat-template",
    "train-on-inputs",
    "seed",
    "steps",
    "batch",
    "seq",
    "grad-accum",
    "packing",
    "full",
    "lora-rank",
    "lora-alpha",
    "lora-targets",
    "use-rslora",
    "optimizer",
    "weight-decay",
    "lr",
    "warmup",
    "schedule",
    "clip-norm",
    "scan-layers",
    "remat",
    "attention",
    "attention-block",
    "loss-chunk",
];

/// Flags that pick the model; one given replaces all saved ones.
const MODEL_FLAGS: [&str; 3] = ["model", "config", "checkpoint"];

/// The clap id of a flag (its field name).
fn id(flag: &str) -> String {
    flag.replace('-', "_")
}

/// The arguments of the resumed run: `argv` (`hlo-train train ...`) with
/// every saved setting it does not give put before its own flags.
pub fn effective_argv(
    argv: &[OsString],
    given: &BTreeSet<String>,
    saved: &RunSettings,
) -> Vec<OsString> {
    let model_given = MODEL_FLAGS.iter().any(|f| given.contains(&id(f)));
    let mut out: Vec<OsString> = argv.iter().take(2).cloned().collect();
    for flag in FLAG_SETTINGS {
        let Some(value) = saved.get(flag) else {
            continue;
        };
        if given.contains(&id(flag)) || (model_given && MODEL_FLAGS.contains(&flag)) {
            continue;
        }
        // A block size belongs to the attention it was saved with.
        if flag == "attention-block" && given.contains("attention") {
            continue;
        }
        match value {
            Value::Bool(true) => out.push(format!("--{flag}").into()),
            Value::Bool(false) | Value::Null => {}
            Value::String(s) => out.extend([format!("--{flag}").into(), s.into()]),
            other => out.extend([format!("--{flag}").into(), other.to_string().into()]),
        }
    }
    out.extend(argv.iter().skip(2).cloned());
    out
}

/// Every setting the command line gives that differs from the saved run,
/// and every identity that changed, as one line each.
pub fn differences(
    saved: &RunSettings,
    now: &RunSettings,
    given: &BTreeSet<String>,
    saved_step: i64,
    dir: &Path,
) -> Vec<String> {
    let mut out = Vec::new();
    let show = |v: Option<&Value>| match v {
        None | Some(Value::Null) => "(none)".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    for (key, what) in [
        (
            "model-fingerprint",
            "the base model (its config.json or weight files)",
        ),
        ("data-fingerprint", "the training data"),
    ] {
        if let (Some(a), Some(b)) = (saved.get(key), now.get(key)) {
            if a != b {
                out.push(format!("{what} changed since the run was saved"));
            }
        }
    }
    for flag in FLAG_SETTINGS {
        if !given.contains(&id(flag)) {
            continue;
        }
        let (a, b) = (saved.get(flag), now.get(flag));
        // A moved model or data file is the same if its identity is.
        let moved_same = match flag {
            "model" | "config" | "checkpoint" => {
                saved.get("model-fingerprint") == now.get("model-fingerprint")
            }
            "data" => saved.get("data-fingerprint") == now.get("data-fingerprint"),
            _ => false,
        };
        if a == b || moved_same {
            continue;
        }
        if flag == "steps" && saved.get("schedule") != Some(&Value::from("cosine")) {
            continue; // a constant schedule may be extended
        }
        if flag == "steps" {
            out.push(format!(
                "the run's cosine schedule ends at step {}, --steps {} would reshape it (continue without --steps, or start a new run from this adapter with --init-adapter {})",
                show(a),
                show(b),
                dir.display()
            ));
            continue;
        }
        out.push(format!(
            "--{flag} was {} when the run was saved, this run has {}",
            show(a),
            show(b)
        ));
    }
    if let Some(steps) = now.get("steps").and_then(Value::as_i64) {
        let cosine = saved.get("schedule") == Some(&Value::from("cosine"));
        if steps <= saved_step {
            out.push(if given.contains("steps") {
                format!("the run is at step {saved_step} already, --steps {steps} leaves nothing to train")
            } else if cosine {
                format!(
                    "the run finished its cosine schedule at step {saved_step}: start a new run from it with --init-adapter {}",
                    dir.display()
                )
            } else {
                format!("the run reached its last step ({saved_step}): give a larger --steps to train further")
            });
        }
    }
    out
}

/// Refuses `differences` in one line.
pub fn refuse(differences: &[String]) -> Result<()> {
    if differences.is_empty() {
        return Ok(());
    }
    bail!(
        "--resume: {} (a resumed run keeps the settings it was saved with)",
        differences.join("; ")
    )
}

/// Parses the `train` arguments of `argv`.
pub fn parse(argv: &[OsString]) -> Result<TrainArgs> {
    use clap::Parser;
    match crate::Cli::try_parse_from(argv) {
        Ok(crate::Cli {
            command: crate::Command::Train(args),
        }) => Ok(*args),
        Ok(_) => bail!("not a train command"),
        Err(e) => bail!("{}", crate::usage_error(&e)),
    }
}

/// An absolute path, for what a run records.
fn absolute(p: &FsPath) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_path_buf())
        .display()
        .to_string()
}

/// The settings a run records beyond the session's own: which model,
/// tokenizer, adapter and data (with their identities), and its length.
pub fn cli_settings(args: &TrainArgs, model: &Model, data: &Dataset) -> Result<RunSettings> {
    let mut s = RunSettings::default();
    match model.source() {
        ModelSource::Preset(name) => s.set("model", name.as_str()),
        ModelSource::Config(p) => s.set("config", absolute(p)),
        ModelSource::Checkpoint(p) => s.set("checkpoint", absolute(p)),
    }
    s.set("model-fingerprint", model.fingerprint()?);
    // The base as the run holds it (a bitsandbytes checkpoint's own NF4 too).
    if let Some(q) = model.config.quantization {
        s.set("quantize", "nf4");
        s.set("double-quant", q.double_quant);
    }
    for (key, path) in [
        ("tokenizer", &args.tokenizer.tokenizer),
        ("init-adapter", &args.init_adapter),
        ("data", &args.data),
        ("chat-template", &args.chat.chat_template),
    ] {
        if let Some(p) = path {
            s.set(key, absolute(p));
        }
    }
    s.set("data-fingerprint", data.fingerprint.as_str());
    s.set("train-on-inputs", args.chat.train_on_inputs);
    s.set("steps", args.steps);
    Ok(s)
}
