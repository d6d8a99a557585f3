//! The preference objectives' settings (β and the reference are the
//! rollout objectives' too), declared as `crate::run::settings` declares every setting.

use serde_json::json;

use crate::run::settings::{of, path, put, shown_path, Setting};

pub(crate) static SETTINGS: &[Setting] = &[
    of(
        "beta",
        |s| json!(s.objectives.preference.beta),
        |s, v| {
            // One β, whichever objective reads it (GRPO's has its own
            // default, 0).
            let beta = v.as_f64()?;
            s.objectives.rollouts.beta = beta;
            put(&mut s.objectives.preference.beta, beta)
        },
    ),
    of(
        "simpo-gamma",
        |s| json!(s.objectives.preference.simpo_gamma),
        |s, v| put(&mut s.objectives.preference.simpo_gamma, v.as_f64()?),
    ),
    of(
        "label-smoothing",
        |s| json!(s.objectives.preference.label_smoothing),
        |s, v| put(&mut s.objectives.preference.label_smoothing, v.as_f64()?),
    ),
    of(
        "cpo-alpha",
        |s| json!(s.objectives.preference.cpo_alpha),
        |s, v| put(&mut s.objectives.preference.cpo_alpha, v.as_f64()?),
    ),
    of(
        "ref-adapter",
        |s| shown_path(&s.objectives.preference.ref_adapter),
        |s, v| put(&mut s.objectives.preference.ref_adapter, path(v)?),
    ),
    of(
        "precompute-ref",
        |s| json!(s.objectives.preference.precompute_ref),
        |s, v| put(&mut s.objectives.preference.precompute_ref, v.as_bool()?),
    ),
];
