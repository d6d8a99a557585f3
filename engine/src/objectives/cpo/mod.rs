//! CPO (TRL 1.16's `CPOTrainer` with `loss_type="sigmoid"`) beyond its
//! loss (`hlo_models::cpo`): a preference method over pairs without a
//! reference, reading β and the settings it shares with SimPO (the same
//! trainer's other loss): `--label-smoothing` and `--cpo-alpha`.

use hlo_models::cpo::CpoLoss;
use hlo_models::preference::{PreferenceLoss, Reference};
use hlo_models::train::{Loss, Preference};

use super::preference::{check_beta, pairs_step, reference_words};
use super::{Data, Objective, ObjectiveDef, ObjectiveSpecs};
use crate::error::Result;
use crate::objectives::RunView;
use crate::step::StepSpec;

/// CPO as an objective of a run.
pub(crate) struct Cpo;

pub(crate) static CPO: Cpo = Cpo;

impl ObjectiveDef for Cpo {
    fn name(&self) -> &'static str {
        "cpo"
    }

    fn data(&self) -> Data {
        Data::Pairs
    }

    /// β, and the label smoothing and NLL weight of `CPOConfig`.
    fn reads(&self, name: &str) -> bool {
        matches!(name, "beta" | "label-smoothing" | "cpo-alpha")
    }

    fn step_spec(&self, step: &StepSpec, _specs: &ObjectiveSpecs) -> Result<StepSpec> {
        pairs_step(step, "cpo")
    }

    fn loss(&self, specs: &ObjectiveSpecs, reference: Reference) -> Loss {
        let p = &specs.preference;
        let cpo = CpoLoss {
            beta: specs.beta(Objective::Cpo),
            label_smoothing: p.label_smoothing,
            cpo_alpha: p.cpo_alpha,
        };
        Loss::Preference(Preference::new(PreferenceLoss::Cpo(cpo), reference))
    }

    fn describe(&self, _specs: &ObjectiveSpecs, loss: &Loss) -> Option<String> {
        Some(format!("cpo against {}", reference_words(loss)))
    }

    fn check_settings(&self, spec: &RunView) -> Result<()> {
        check_beta(spec, Objective::Cpo)
    }
}
