//! KTO's own settings, declared as `crate::run::settings` declares every
//! setting (β and the reference adapter are the preference objectives').

use hlo_models::kto::KtoLossType;
use serde_json::json;

use crate::run::named::Named;
use crate::run::settings::{named, of, put, Setting};

impl Named for KtoLossType {
    const ALL: &'static [KtoLossType] = &[KtoLossType::Kto, KtoLossType::ApoZeroUnpaired];
    fn name(self) -> &'static str {
        KtoLossType::name(self)
    }
}

pub(crate) static SETTINGS: &[Setting] = &[
    of(
        "kto-loss-type",
        |s| json!(s.objectives.kto.loss_type.name()),
        |s, v| put(&mut s.objectives.kto.loss_type, named(v)?),
    ),
    of(
        "desirable-weight",
        |s| json!(s.objectives.kto.desirable_weight),
        |s, v| put(&mut s.objectives.kto.desirable_weight, v.as_f64()?),
    ),
    of(
        "undesirable-weight",
        |s| json!(s.objectives.kto.undesirable_weight),
        |s, v| put(&mut s.objectives.kto.undesirable_weight, v.as_f64()?),
    ),
];
