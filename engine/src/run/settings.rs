//! The run's own settings by name (the `hlo-train train` flags', so a
//! recipe, a saved state and an error speak one vocabulary): those a
//! resumed run compares ([`settings`]): the fields of the typed specs
//! ([`typed`]: the step's and the optimizer's, [`crate::step`]; what the
//! run trains, [`TrainingSpec`]; the base model's and the tokenizer's,
//! [`BaseSpec`] and [`TokenizerSpec`]; the data's, [`DataSource`]) and
//! the objectives' ([`crate::objectives`]). Each is declared once, as a
//! field, whose flag, default, check, help, record and restore follow.
//! What the run writes ([`EvalSpec`](super::spec::EvalSpec),
//! [`ReportSpec`](super::spec::ReportSpec)) and how its programs are
//! compiled ([`CompilerSpec`](crate::device::backend::CompilerSpec)) are
//! replaced when given anew, never compared.

use super::spec::TrainingSpec;
use crate::inputs::dataset::DataSource;
use crate::inputs::model::{BaseSpec, TokenizerSpec};
use crate::step::{OptimSpec, StepSpec};

/// The settings the typed specs of the step, the optimizer, what the run
/// trains, the base model, the tokenizer and the data declare (their
/// flags' names): a resumed run compares them.
pub fn typed() -> &'static [String] {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| {
        let mut names = crate::settings::names::<StepSpec>();
        names.extend(crate::settings::names::<OptimSpec>());
        names.extend(crate::settings::names::<TrainingSpec>());
        names.extend(crate::settings::names::<BaseSpec>());
        names.extend(crate::settings::names::<TokenizerSpec>());
        names.extend(crate::settings::names::<DataSource>());
        names
    })
}

/// The settings a resumed run must agree on, by name: the typed specs'
/// and every objective's.
pub fn settings() -> impl Iterator<Item = &'static str> {
    let objectives = crate::objectives::ObjectiveSpecs::names().iter();
    typed().iter().chain(objectives).map(String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_setting_is_declared_once() {
        let mut names: Vec<&str> = settings().collect();
        let all = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all, "a name declared twice");
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
}
