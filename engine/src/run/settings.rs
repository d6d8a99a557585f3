//! The run's own settings that no typed spec declares (the model's and
//! the data's, the run's length, what it writes), each declared once
//! ([`all`]): its name (the `hlo-train train` flag's, so a recipe, a
//! saved state and an error speak one vocabulary), what kind of setting
//! it is, and how a saved value comes back into a [`RunSpec`]. From the
//! table and the typed specs ([`typed`]: the step's and the optimizer's,
//! [`crate::step`]; the objectives', [`crate::objectives`]) follow the
//! saved-settings vocabulary ([`settings`]) and the resume merge and
//! comparison.
//!
//! Adding a setting of the step or the optimizer: a field of
//! [`StepSpec`] or [`OptimSpec`] (flag, default, check, help, record and
//! restore follow), its use, and the decided value it records
//! (`StepSpec::decided`, when `auto` may choose it). Adding one of
//! these: a field on the spec it belongs to, one entry here, the writer
//! that records it (`Run`'s identities), and its flag in the CLI's
//! flag group.

use std::path::PathBuf;

use hlo_models::nf4::Nf4Config;
use serde_json::Value;

use super::spec::RunSpec;
use crate::inputs::dataset::DataSource;
use crate::inputs::model::ModelSource;
use crate::named::Named;
use crate::step::{OptimSpec, StepSpec};

/// How a recorded setting behaves on resume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// What the run computes: one chosen anew must equal the saved one.
    Compared,
    /// How the run's programs are compiled (`xla-option`): one chosen
    /// anew replaces the saved one, never a difference (a resumed run may
    /// work around a compiler bug), as what the run writes is.
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

pub(crate) fn path(v: &Value) -> Option<Option<PathBuf>> {
    match v {
        Value::Null => Some(None),
        v => Some(Some(PathBuf::from(v.as_str()?))),
    }
}

pub(crate) fn text(v: &Value) -> Option<String> {
    v.as_str().map(str::to_string)
}

/// The model's settings, the adapter a run starts from, the objective.
static MODEL: &[Setting] = &[
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
    common("objective", |s, v| {
        put(&mut s.objective, v.as_str()?.parse().ok()?)
    }),
];

/// The run's length and seed (the step's and the optimizer's settings
/// are [`StepSpec`]'s and [`OptimSpec`]'s fields).
static RUN: &[Setting] = &[
    common("seed", |s, v| put(&mut s.seed, v.as_u64()?)),
    common("steps", |s, v| put(&mut s.steps, v.as_i64()?)),
];

/// How the run's programs are compiled (what it writes and how often
/// are [`EvalSpec`](super::spec::EvalSpec)'s and [`ReportSpec`](super::spec::ReportSpec)'s fields).
static COMPILE: &[Setting] = &[Setting {
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
}];

/// Stores a restored value: every `restore` ends so.
pub(crate) fn put<T>(slot: &mut T, value: T) -> Option<()> {
    *slot = value;
    Some(())
}

/// A saved value among a setting's names.
pub(crate) fn named<T: Named>(v: &Value) -> Option<T> {
    T::from_name(v.as_str()?)
}

/// Every setting of the run's own a run records that no typed spec
/// declares, in the order a resumed run takes them back (`quantize`
/// before `double-quant`): the model's and the data's, the run's length,
/// what the run writes. The step's, the optimizer's and the objectives'
/// settings are their specs' fields ([`crate::settings`]).
pub fn all() -> impl Iterator<Item = &'static Setting> {
    MODEL.iter().chain(RUN).chain(COMPILE)
}

/// The settings the typed specs of the step, the optimizer and the data
/// declare (their flags' names), which a resumed run compares (what it writes,
/// [`EvalSpec`](super::spec::EvalSpec)'s and [`ReportSpec`](super::spec::ReportSpec)'s, it replaces when chosen anew).
pub fn typed() -> &'static [String] {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| {
        let mut names = crate::settings::names::<StepSpec>();
        names.extend(crate::settings::names::<OptimSpec>());
        names.extend(crate::settings::names::<DataSource>());
        names
    })
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
        .chain(typed().iter().map(String::as_str))
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
        assert_eq!(names.len(), all().count() + typed().len() + objectives);
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
        for (name, bad) in [("seed", json!("high")), ("model", json!(7))] {
            let s = setting(name).unwrap();
            assert!((s.restore)(&mut spec, &bad).is_none(), "{name}");
        }
    }
}
