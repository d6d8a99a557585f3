//! The settings whose values are a few names (a flag's choices): each
//! enum says its names once ([`Named`]), and the command line, a saved
//! run and a recipe all read them from there.
//!
//! ```
//! use hlo_engine::run::named::Named;
//! use hlo_engine::run::step::RematChoice;
//! assert_eq!(RematChoice::from_name("mlp"), Some(RematChoice::Mlp));
//! assert_eq!(RematChoice::Layers.name(), "layers");
//! ```

use hlo_ir::DType;
use hlo_models::grpo::{GrpoLossType, ScaleRewards};

use super::spec::{Objective, OBJECTIVES};
use super::step::{AttentionChoice, OptimizerKind, RematChoice, ScheduleKind, Toggle};

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

impl Named for Objective {
    const ALL: &'static [Objective] = &OBJECTIVES;
    fn name(self) -> &'static str {
        Objective::name(self)
    }
}

impl Named for Toggle {
    const ALL: &'static [Toggle] = &[Toggle::On, Toggle::Off, Toggle::Auto];
    fn name(self) -> &'static str {
        match self {
            Toggle::On => "on",
            Toggle::Off => "off",
            Toggle::Auto => "auto",
        }
    }
}

impl Named for AttentionChoice {
    const ALL: &'static [AttentionChoice] = &[
        AttentionChoice::Auto,
        AttentionChoice::Naive,
        AttentionChoice::Blockwise,
        AttentionChoice::Cudnn,
    ];
    fn name(self) -> &'static str {
        match self {
            AttentionChoice::Auto => "auto",
            AttentionChoice::Naive => "naive",
            AttentionChoice::Blockwise => "blockwise",
            AttentionChoice::Cudnn => "cudnn",
        }
    }
}

impl Named for RematChoice {
    const ALL: &'static [RematChoice] = &[
        RematChoice::Auto,
        RematChoice::None,
        RematChoice::Mlp,
        RematChoice::Layers,
    ];
    fn name(self) -> &'static str {
        match self {
            RematChoice::Auto => "auto",
            RematChoice::None => "none",
            RematChoice::Mlp => "mlp",
            RematChoice::Layers => "layers",
        }
    }
}

impl Named for OptimizerKind {
    const ALL: &'static [OptimizerKind] = &[OptimizerKind::AdamW, OptimizerKind::Sgd];
    fn name(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Sgd => "sgd",
        }
    }
}

impl Named for ScheduleKind {
    const ALL: &'static [ScheduleKind] = &[ScheduleKind::Constant, ScheduleKind::Cosine];
    fn name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Cosine => "cosine",
        }
    }
}

/// The dtypes a run computes in.
impl Named for DType {
    const ALL: &'static [DType] = &[DType::F32, DType::BF16];
    fn name(self) -> &'static str {
        DType::name(self)
    }
}

impl Named for ScaleRewards {
    const ALL: &'static [ScaleRewards] = &ScaleRewards::ALL;
    fn name(self) -> &'static str {
        ScaleRewards::name(self)
    }
}

impl Named for GrpoLossType {
    const ALL: &'static [GrpoLossType] = &GrpoLossType::ALL;
    fn name(self) -> &'static str {
        GrpoLossType::name(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
