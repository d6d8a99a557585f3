//! The settings whose values are a few names (a flag's choices): each
//! enum says its names once ([`Named`]), and the command line, a saved
//! run and a recipe all read them from there.
//!
//! ```
//! use hlo_engine::named::Named;
//! use hlo_engine::step::RematChoice;
//! assert_eq!(RematChoice::from_name("mlp"), Some(RematChoice::Mlp));
//! assert_eq!(RematChoice::Layers.name(), "layers");
//! ```

use hlo_ir::DType;

/// A setting's value among a fixed set of names.
pub trait Named: Copy + PartialEq + Send + Sync + 'static {
    /// Every value, in the order a flag's help lists them.
    const ALL: &'static [Self];

    /// The value's name, as the flag, a saved run and a recipe spell it.
    fn name(self) -> &'static str;

    /// The value named `name`.
    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|v| v.name() == name)
    }
}

/// The dtypes a run computes in.
impl Named for DType {
    const ALL: &'static [DType] = &[DType::F32, DType::BF16];
    fn name(self) -> &'static str {
        DType::name(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objectives::Objective;
    use crate::step::{AttentionChoice, OptimizerKind, RematChoice, ScheduleKind, Toggle};
    use hlo_models::grpo::{GrpoLossType, ScaleRewards};

    fn round_trips<T: Named + std::fmt::Debug>() {
        for &v in T::ALL {
            assert_eq!(T::from_name(v.name()), Some(v));
        }
        assert_eq!(T::from_name("no such value"), None);
    }

    #[test]
    fn every_name_names_its_value() {
        round_trips::<Objective>();
        round_trips::<Toggle>();
        round_trips::<AttentionChoice>();
        round_trips::<RematChoice>();
        round_trips::<OptimizerKind>();
        round_trips::<ScheduleKind>();
        round_trips::<DType>();
        round_trips::<ScaleRewards>();
        round_trips::<GrpoLossType>();
    }
}
