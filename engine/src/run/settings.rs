//! The run's own settings (not an objective's), each declared once
//! ([`all`]): its name (the `hlo-train train` flag's, so a recipe, a
//! saved state and an error speak one vocabulary), what kind of setting
//! it is, and how a saved value comes back into a [`RunSpec`]. From the
//! table follow the saved-settings vocabulary ([`settings`]) and the
//! resume merge and comparison. An objective's settings are its spec's
//! fields, declared once there (`crate::objectives::settings`).
//!
//! Adding a run setting: a field on the spec it belongs to (its default
//! in that spec's `Default`), one entry here, the writer that records it
//! (`Run`'s identities, or `RunSettings::of_config` for what the step
//! decides), and its flag in the CLI's flag group.

use std::path::PathBuf;

use hlo_models::nf4::Nf4Config;
use serde_json::Value;

use super::spec::RunSpec;
use crate::inputs::model::ModelSource;
use crate::named::Named;
use crate::step::{LoraSpec, Toggle};

/// How a recorded setting behaves on resume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// What the run computes: one chosen anew must equal the saved one.
    Compared,
    /// What shapes what the run writes, not what it computes: one chosen
    /// anew replaces the saved one (never a difference).
    Output,
    /// How the run's programs are compiled (`xla-option`): replaced like
    /// an output setting (a resumed run may work around a compiler bug).
    Compile,
}

/// One setting of a run.
pub struct Setting {
    pub name: &'static str,
    pub kind: Kind,
    /// Takes a saved value back into a spec; None when the value is not
    /// of this setting's kind.
    pub restore: fn(&mut RunSpec, &Value) -> Option<()>,
}

/// A setting every objective reads.
const fn common(name: &'static str, restore: fn(&mut RunSpec, &Value) -> Option<()>) -> Setting {
    Setting {
        name,
        kind: Kind::Compared,
        restore,
    }
}

/// A setting of what the run writes.
const fn output(name: &'static str, restore: fn(&mut RunSpec, &Value) -> Option<()>) -> Setting {
    Setting {
        name,
        kind: Kind::Output,
        restore,
    }
}

pub(crate) fn path(v: &Value) -> Option<Option<PathBuf>> {
    match v {
        Value::Null => Some(None),
        v => Some(Some(PathBuf::from(v.as_str()?))),
    }
}

pub(crate) fn text(v: &Value) -> Option<String> {
    v.as_str().map(str::to_string)
}

/// The model's and the data's settings.
static MODEL_DATA: &[Setting] = &[
    // The model and the data.
    common("model", |s, v| {
        put(&mut s.model, ModelSource::Preset(text(v)?))
    }),
    common("config", |s, v| {
        put(&mut s.model, ModelSource::Config(path(v)??))
    }),
    common("checkpoint", |s, v| {
        put(&mut s.model, ModelSource::Checkpoint(path(v)??))
    }),
    common("init", |s, v| put(&mut s.init, Some(named(v)?))),
    common("quantize", |s, v| {
        (v.as_str()? == "nf4").then_some(())?;
        s.quantize.get_or_insert(Nf4Config {
            double_quant: false,
        });
        Some(())
    }),
    common("double-quant", |s, v| {
        let on = v.as_bool()?;
        if let Some(q) = s.quantize.as_mut() {
            q.double_quant = on;
        }
        Some(())
    }),
    common("dtype", |s, v| {
        put(&mut s.dtype, Some(v.as_str()?.parse().ok()?))
    }),
    common("tokenizer", |s, v| put(&mut s.tokenizer, path(v)?)),
    common("init-adapter", |s, v| put(&mut s.init_adapter, path(v)?)),
    common("data", |s, v| put(&mut s.data.path, path(v)?)),
    common("chat-template", |s, v| {
        put(&mut s.data.chat_template, path(v)?)
    }),
    common("train-on-inputs", |s, v| {
        put(&mut s.data.train_on_inputs, v.as_bool()?)
    }),
    common("train-sampling-strategy", |s, v| {
        put(&mut s.data.sampling, named(v)?)
    }),
    common("objective", |s, v| {
        put(&mut s.objective, v.as_str()?.parse().ok()?)
    }),
];

/// The step's and the optimizer's settings.
static STEP: &[Setting] = &[
    common("seed", |s, v| put(&mut s.seed, v.as_u64()?)),
    common("steps", |s, v| put(&mut s.steps, v.as_i64()?)),
    common("batch", |s, v| put(&mut s.step.batch, v.as_i64()?)),
    common("seq", |s, v| put(&mut s.step.seq, v.as_i64()?)),
    common("grad-accum", |s, v| {
        put(&mut s.step.grad_accum, v.as_i64()?)
    }),
    common("packing", |s, v| put(&mut s.step.packing, toggle(v)?)),
    common("full", |s, v| {
        s.step.lora = match v.as_bool()? {
            true => None,
            false => Some(s.step.lora.clone().unwrap_or_default()),
        };
        Some(())
    }),
    common("optimizer", |s, v| put(&mut s.optim.optimizer, named(v)?)),
    common("weight-decay", |s, v| {
        put(&mut s.optim.weight_decay, v.as_f64()?)
    }),
    common("lr", |s, v| put(&mut s.optim.lr, v.as_f64()?)),
    common("warmup", |s, v| put(&mut s.optim.warmup, v.as_i64()?)),
    common("schedule", |s, v| put(&mut s.optim.schedule, named(v)?)),
    common("clip-norm", |s, v| put(&mut s.optim.clip_norm, v.as_f64()?)),
    common("scan-layers", |s, v| {
        put(&mut s.step.scan_layers, toggle(v)?)
    }),
    common("remat", |s, v| put(&mut s.step.remat, named(v)?)),
    common("attention", |s, v| put(&mut s.step.attention, named(v)?)),
    common("attention-block", |s, v| {
        put(&mut s.step.attention_block, Some(v.as_i64()?))
    }),
    common("loss-chunk", |s, v| {
        put(&mut s.step.loss_chunk, Some(v.as_i64()?))
    }),
];

/// The adapter's settings (a run that resumes or starts from an adapter
/// takes the adapter's own unless one of these is chosen).
pub(crate) static LORA: &[Setting] = &[
    common("lora-rank", |s, v| {
        lora(s, |l| put(&mut l.rank, v.as_i64()?))
    }),
    common("lora-alpha", |s, v| {
        lora(s, |l| put(&mut l.alpha, v.as_f64()?))
    }),
    common("lora-targets", |s, v| {
        lora(s, |l| {
            let targets = v.as_str()?.split(',').map(|t| t.trim().to_string());
            put(&mut l.targets, targets.collect())
        })
    }),
    common("use-rslora", |s, v| {
        lora(s, |l| put(&mut l.use_rslora, v.as_bool()?))
    }),
    common("modules-to-save", |s, v| {
        lora(s, |l| {
            put(&mut l.modules_to_save, LoraSpec::modules_from(v.as_str()?))
        })
    }),
];

/// What the run writes, and how its programs are compiled.
static OUTPUT: &[Setting] = &[
    output("eval-data", |s, v| put(&mut s.eval.data, path(v)?)),
    output("eval-every", |s, v| put(&mut s.eval.every, v.as_i64()?)),
    output("save-every", |s, v| {
        put(&mut s.output.save_every, v.as_i64()?)
    }),
    output("metrics", |s, v| put(&mut s.report.metrics, path(v)?)),
    output("tensorboard", |s, v| {
        put(&mut s.report.tensorboard, path(v)?)
    }),
    output("log-every", |s, v| {
        put(&mut s.report.log_every, v.as_i64()?)
    }),
    Setting {
        name: "xla-option",
        kind: Kind::Compile,
        restore: |s, v| {
            s.backend.xla_options = v
                .as_array()?
                .iter()
                .map(|o| hlo_runtime::parse_xla_option(o.as_str()?).ok())
                .collect::<Option<_>>()?;
            Some(())
        },
    },
];

/// Stores a restored value: every `restore` ends so.
pub(crate) fn put<T>(slot: &mut T, value: T) -> Option<()> {
    *slot = value;
    Some(())
}

fn toggle(v: &Value) -> Option<Toggle> {
    named(v)
}

/// A saved value among a setting's names.
pub(crate) fn named<T: Named>(v: &Value) -> Option<T> {
    T::from_name(v.as_str()?)
}

/// Sets a LoRA setting, which a full-finetuning spec does not hold.
fn lora(s: &mut RunSpec, set: impl FnOnce(&mut LoraSpec) -> Option<()>) -> Option<()> {
    match s.step.lora.as_mut() {
        Some(l) => set(l),
        None => Some(()),
    }
}

/// Every setting of the run's own a run records, in the order a resumed
/// run takes them back (`full` before the LoRA settings, `quantize`
/// before `double-quant`): the model's and the data's, the step's, the
/// adapter's, what the run writes. The objectives' settings are their specs' fields
/// ([`crate::objectives::settings`]).
pub fn all() -> impl Iterator<Item = &'static Setting> {
    MODEL_DATA.iter().chain(STEP).chain(LORA).chain(OUTPUT)
}

/// The setting named `name`.
pub fn setting(name: &str) -> Option<&'static Setting> {
    all().find(|s| s.name == name)
}

/// The settings a resumed run must agree on ([`Kind::Compared`], and
/// every objective's), by name.
pub fn settings() -> impl Iterator<Item = &'static str> {
    let objectives = crate::objectives::ObjectiveSpecs::names().iter();
    all()
        .filter(|s| s.kind == Kind::Compared)
        .map(|s| s.name)
        .chain(objectives.map(String::as_str))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_setting_is_declared_once() {
        let mut names: Vec<&str> = settings().chain(all().map(|s| s.name)).collect();
        names.sort_unstable();
        names.dedup();
        let objectives = crate::objectives::ObjectiveSpecs::names().len();
        assert_eq!(names.len(), all().count() + objectives);
    }

    #[test]
    fn every_objective_setting_is_read_by_an_objective() {
        for name in crate::objectives::ObjectiveSpecs::names() {
            assert!(
                crate::objectives::OBJECTIVES
                    .iter()
                    .any(|o| o.def().reads(name)),
                "no objective reads {name}"
            );
        }
    }

    #[test]
    fn a_value_of_another_kind_restores_nothing() {
        let mut spec = RunSpec::default();
        for (name, bad) in [("lr", json!("high")), ("optimizer", json!("lion"))] {
            let s = setting(name).unwrap();
            assert!((s.restore)(&mut spec, &bad).is_none(), "{name}");
        }
    }
}
