//! RLOO's own settings, declared as `crate::run::settings` declares every
//! setting (its rollouts' settings, β and the reference are GRPO's).

use serde_json::{json, Value};

use crate::run::settings::{of, put, Setting};

/// `[min, max]`, or null for none.
fn range(v: &Value) -> Option<Option<(f64, f64)>> {
    match v {
        Value::Null => Some(None),
        Value::Array(a) if a.len() == 2 => Some(Some((a[0].as_f64()?, a[1].as_f64()?))),
        _ => None,
    }
}

pub(crate) static SETTINGS: &[Setting] = &[
    of(
        "normalize-advantages",
        |s| json!(s.objectives.rloo.normalize_advantages),
        |s, v| put(&mut s.objectives.rloo.normalize_advantages, v.as_bool()?),
    ),
    of(
        "reward-clip-range",
        |s| match s.objectives.rloo.reward_clip_range {
            Some((lo, hi)) => json!([lo, hi]),
            None => Value::Null,
        },
        |s, v| put(&mut s.objectives.rloo.reward_clip_range, range(v)?),
    ),
];
