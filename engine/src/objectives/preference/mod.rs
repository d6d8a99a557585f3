//! DPO, IPO, SimPO and ORPO beyond their loss (`hlo_models::preference`):
//! the reference's log-probabilities computed once before training
//! ([`reference`]).

pub mod reference;
pub(crate) mod settings;

use hlo_data::PreferencePair;
use hlo_models::adapter::Adapter;
use hlo_models::preference::Reference;
use hlo_models::train::TrainConfig;

use crate::device::backend::Backend;
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::run::spec::RunSpec;

/// DPO's and IPO's reference adapter, as TRL 1.16 chooses the reference:
/// `--ref-adapter`, else a frozen copy of the adapter training started
/// from (read again on resume), else None: the base with the adapter off
/// (a fresh adapter's starting policy). Refused where the objective has
/// no reference, or would need a second copy of the base.
pub(crate) fn reference_adapter(spec: &RunSpec, model: &Model) -> Result<Option<Adapter>> {
    let objective = spec.objective;
    let refuse = |why: String| EngineError::Preference {
        objective: objective.name(),
        why,
    };
    let needs = spec
        .objective
        .preference_loss(&spec.preference)
        .is_some_and(|l| l.needs_reference());
    // (A reference setting given to an objective without one is refused
    // by `RunSpec::check_objective_settings`.)
    if !needs {
        return Ok(None);
    }
    if spec.step.lora.is_none() {
        if spec.preference.precompute_ref {
            // The base as training starts, scored before it changes.
            return Ok(None);
        }
        return Err(refuse(
            "full finetuning would keep a second copy of the base as the reference; add --precompute-ref (its log-probabilities computed before training) or train LoRA".into(),
        ));
    }
    let Some(dir) = super::reference_dir(spec) else {
        return Ok(None);
    };
    let adapter = Adapter::load(dir, &model.config)?;
    if !adapter.lora.modules_to_save.is_empty() {
        return Err(refuse(format!(
            "the reference adapter {} saves whole modules ({}), which a reference adapter cannot",
            dir.display(),
            adapter.lora.modules_to_save.join(", ")
        )));
    }
    Ok(Some(adapter))
}

/// Each pair's reference log-probabilities when `tc`'s reference is
/// precomputed (None otherwise).
pub(crate) fn reference_scores(
    backend: &Backend,
    model: &Model,
    tc: &TrainConfig,
    reference: Option<&Adapter>,
    pairs: &[PreferencePair],
    seed: u64,
) -> Result<Option<Vec<[f32; 2]>>> {
    match tc.loss.preference().map(|p| p.reference) {
        Some(Reference::Precomputed) => Ok(Some(reference::precompute(
            backend, model, tc, reference, pairs, seed,
        )?)),
        _ => Ok(None),
    }
}

/// A preference objective's settings, as a run records them with its
/// identities: `batch` counts pairs (the step's rows are twice as many).
pub(crate) fn record_settings(s: &mut crate::train::checkpoint::RunSettings, spec: &RunSpec) {
    s.set("batch", spec.step.batch);
    let p = &spec.preference;
    s.set("beta", p.beta);
    s.set("simpo-gamma", p.simpo_gamma);
    s.set("label-smoothing", p.label_smoothing);
    s.set("cpo-alpha", p.cpo_alpha);
    if let Some(dir) = &p.ref_adapter {
        s.set("ref-adapter", crate::run::absolute(dir));
    }
    s.set("precompute-ref", p.precompute_ref);
}
