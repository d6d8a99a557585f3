//! The preference objectives' settings (β and the reference are GRPO's
//! too), declared as `crate::run::settings` declares every setting.

use serde_json::json;

use crate::run::settings::{
    of, path, put, shown_path, Setting, PRECOMPUTED, PREFERENCE_AND_GRPO, REFERENCED, SIMPO,
};
use crate::run::spec::Objective;

pub(crate) static SETTINGS: &[Setting] = &[
    of(
        "beta",
        PREFERENCE_AND_GRPO,
        |s| json!(s.preference.beta),
        |s, v| {
            // The objective's β: GRPO's or a preference method's.
            match s.objective {
                Objective::Grpo => s.grpo.beta = v.as_f64()?,
                _ => s.preference.beta = v.as_f64()?,
            }
            Some(())
        },
    ),
    of(
        "simpo-gamma",
        SIMPO,
        |s| json!(s.preference.simpo_gamma),
        |s, v| put(&mut s.preference.simpo_gamma, v.as_f64()?),
    ),
    of(
        "label-smoothing",
        SIMPO,
        |s| json!(s.preference.label_smoothing),
        |s, v| put(&mut s.preference.label_smoothing, v.as_f64()?),
    ),
    of(
        "cpo-alpha",
        SIMPO,
        |s| json!(s.preference.cpo_alpha),
        |s, v| put(&mut s.preference.cpo_alpha, v.as_f64()?),
    ),
    of(
        "ref-adapter",
        REFERENCED,
        |s| shown_path(&s.preference.ref_adapter),
        |s, v| put(&mut s.preference.ref_adapter, path(v)?),
    ),
    of(
        "precompute-ref",
        PRECOMPUTED,
        |s| json!(s.preference.precompute_ref),
        |s, v| put(&mut s.preference.precompute_ref, v.as_bool()?),
    ),
];
