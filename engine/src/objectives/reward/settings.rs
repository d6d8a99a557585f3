//! A reward model's own settings, declared as `crate::run::settings`
//! declares every setting.

use serde_json::{json, Value};

use crate::run::settings::{of, put, Setting};

pub(crate) static SETTINGS: &[Setting] = &[of(
    "center-rewards-coefficient",
    |s| match s.objectives.reward.center_rewards_coefficient {
        Some(c) => json!(c),
        None => Value::Null,
    },
    |s, v| {
        let c = match v {
            Value::Null => None,
            v => Some(v.as_f64()?),
        };
        put(&mut s.objectives.reward.center_rewards_coefficient, c)
    },
)];
