//! GRPO's own settings (its loss's; its rollouts' are the shared
//! table's), declared as `crate::run::settings` declares every setting.

use hlo_models::grpo::ImportanceSampling;
use serde_json::json;

use crate::run::named::Named;

use crate::run::settings::{named, of, put, Setting};

impl Named for ImportanceSampling {
    const ALL: &'static [ImportanceSampling] = &ImportanceSampling::ALL;
    fn name(self) -> &'static str {
        ImportanceSampling::name(self)
    }
}

pub(crate) static SETTINGS: &[Setting] = &[
    of(
        "scale-rewards",
        |s| json!(s.objectives.grpo.scale_rewards.name()),
        |s, v| put(&mut s.objectives.grpo.scale_rewards, named(v)?),
    ),
    of(
        "loss-type",
        |s| json!(s.objectives.grpo.loss_type.name()),
        |s, v| put(&mut s.objectives.grpo.loss_type, named(v)?),
    ),
    of(
        "importance-sampling-level",
        |s| json!(s.objectives.grpo.importance_sampling.name()),
        |s, v| put(&mut s.objectives.grpo.importance_sampling, named(v)?),
    ),
    of(
        "use-bias-correction-kl",
        |s| json!(s.objectives.grpo.bias_correction_kl),
        |s, v| put(&mut s.objectives.grpo.bias_correction_kl, v.as_bool()?),
    ),
    of(
        "sapo-temperature-pos",
        |s| json!(s.objectives.grpo.sapo_temperature_pos),
        |s, v| put(&mut s.objectives.grpo.sapo_temperature_pos, v.as_f64()?),
    ),
    of(
        "sapo-temperature-neg",
        |s| json!(s.objectives.grpo.sapo_temperature_neg),
        |s, v| put(&mut s.objectives.grpo.sapo_temperature_neg, v.as_f64()?),
    ),
];
