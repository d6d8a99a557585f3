//! DPO, IPO, SimPO and ORPO beyond their loss (`hlo_models::preference`):
//! their settings, their reference, and the reference's
//! log-probabilities computed once before training ([`reference`](mod@reference)).

pub mod reference;

use std::path::PathBuf;

use hlo_data::PreferencePair;
use hlo_models::adapter::Adapter;
use hlo_models::preference::{PreferenceLoss, Reference};
use hlo_models::train::{Loss, Preference, TrainConfig};

use clap::Args;
use serde::{Deserialize, Serialize};

use super::{Data, Objective, ObjectiveDef, ObjectiveSpecs};
use crate::device::backend::Backend;
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::objectives::RunView;
use crate::settings;
use crate::step::StepSpec;

/// The preference objectives' settings (TRL 1.16's names and defaults;
/// β and the reference adapter are the rollout objectives' too).
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct PreferenceSpec {
    /// The preference loss's β: DPO's and IPO's (the reference's weight),
    /// SimPO's reward scale, CPO's, ORPO's λ, KTO's (default 0.1); GRPO's
    /// KL penalty weight (default 0: no reference model), RLOO's (default
    /// 0.05) and distillation's (default 1).
    #[arg(long, value_parser = settings::non_negative)]
    pub beta: Option<f64>,

    /// SimPO's target reward margin γ.
    #[arg(long, default_value_t = 0.5, allow_negative_numbers = true)]
    pub simpo_gamma: f64,

    /// SimPO's and CPO's label smoothing ε (TRL's label_smoothing): the
    /// loss mixes in ε of the loss with chosen and rejected swapped.
    #[arg(long, default_value_t = 0.0, value_parser = settings::label_smoothing)]
    pub label_smoothing: f64,

    /// SimPO's and CPO's weight of the chosen completions' NLL (TRL's
    /// cpo_alpha; 0: the paper's SimPO, CPO without its behaviour
    /// cloning term).
    #[arg(long, default_value_t = 1.0, value_parser = settings::non_negative)]
    pub cpo_alpha: f64,

    /// The reference model of DPO, IPO, KTO and of GRPO's and RLOO's KL
    /// penalty: this PEFT adapter on the base (same
    /// LoRA settings as the trained one). Default: the policy as training
    /// starts (the base for a fresh adapter, a frozen copy of
    /// --init-adapter).
    #[arg(long, value_parser = settings::hub_adapter)]
    #[serde(serialize_with = "settings::absolute_path")]
    pub ref_adapter: Option<PathBuf>,

    /// DPO, IPO and KTO: compute the reference's log-probabilities of every
    /// pair once before training, so the step runs no reference forward
    /// and the reference holds no device memory while training (and full
    /// finetuning has a reference: the base as it starts).
    #[arg(long)]
    pub precompute_ref: bool,
}

impl Default for PreferenceSpec {
    fn default() -> PreferenceSpec {
        settings::defaults()
    }
}

/// The preference objectives' β unless `--beta` says otherwise (TRL's
/// `DPOConfig`'s, `CPOConfig`'s, `ORPOConfig`'s and `KTOConfig`'s).
pub(crate) const DEFAULT_BETA: f64 = 0.1;

/// A preference method over pairs: its loss under the settings and β,
/// and the settings it reads.
pub(crate) struct PairMethod {
    name: &'static str,
    objective: Objective,
    /// Its loss under the settings and β.
    loss: fn(&PreferenceSpec, f64) -> PreferenceLoss,
    /// The preference settings it reads besides β.
    reads: &'static [&'static str],
}

const REFERENCE: &[&str] = &["ref-adapter", "precompute-ref"];

pub(crate) static DPO: PairMethod = PairMethod {
    name: "dpo",
    objective: Objective::Dpo,
    loss: |_, beta| PreferenceLoss::Dpo { beta },
    reads: REFERENCE,
};

pub(crate) static IPO: PairMethod = PairMethod {
    name: "ipo",
    objective: Objective::Ipo,
    loss: |_, beta| PreferenceLoss::Ipo { beta },
    reads: REFERENCE,
};

pub(crate) static SIMPO: PairMethod = PairMethod {
    name: "simpo",
    objective: Objective::Simpo,
    loss: |p, beta| PreferenceLoss::Simpo {
        beta,
        gamma: p.simpo_gamma,
        label_smoothing: p.label_smoothing,
        cpo_alpha: p.cpo_alpha,
    },
    reads: &["simpo-gamma", "label-smoothing", "cpo-alpha"],
};

pub(crate) static ORPO: PairMethod = PairMethod {
    name: "orpo",
    objective: Objective::Orpo,
    loss: |_, beta| PreferenceLoss::Orpo { beta },
    reads: &[],
};

impl ObjectiveDef for PairMethod {
    fn name(&self) -> &'static str {
        self.name
    }

    fn data(&self) -> Data {
        Data::Pairs
    }

    fn reads(&self, name: &str) -> bool {
        name == "beta" || self.reads.contains(&name)
    }

    fn step_spec(&self, step: &StepSpec, _specs: &ObjectiveSpecs) -> Result<StepSpec> {
        pairs_step(step, self.name)
    }

    fn loss(&self, specs: &ObjectiveSpecs, reference: Reference) -> Loss {
        Loss::Preference(Preference::new(
            (self.loss)(&specs.preference, specs.beta(self.objective)),
            reference,
        ))
    }

    fn describe(&self, _specs: &ObjectiveSpecs, loss: &Loss) -> Option<String> {
        Some(format!("{} against {}", self.name, reference_words(loss)))
    }

    fn check_settings(&self, spec: &RunView) -> Result<()> {
        check_beta(spec, self.objective)
    }

    fn reference(&self, spec: &RunView, model: &Model) -> Result<Option<Adapter>> {
        reference_adapter(spec, model)
    }
}

/// `batch` pairs a step, so twice the rows, unpacked, in one micro-batch
/// (what such a step can take: packing and accumulation are refused).
pub(crate) fn pairs_step(step: &StepSpec, objective: &'static str) -> Result<StepSpec> {
    let mut step = super::one_unpacked_batch(step, objective, "pairs")?;
    step.batch *= 2;
    Ok(step)
}

/// Refuses a β a pair method cannot take (TRL's: above 0).
pub(crate) fn check_beta(spec: &RunView, objective: Objective) -> Result<()> {
    let beta = spec.objectives.beta(objective);
    if beta.is_nan() || beta <= 0.0 {
        return Err(EngineError::Objective {
            objective: objective.name(),
            why: format!("--beta must be > 0, not {beta}"),
        });
    }
    Ok(())
}

/// What a step minimising `loss` compares with, in words.
pub(crate) fn reference_words(loss: &Loss) -> &'static str {
    match loss.step_loss().reference() {
        None => "no reference model",
        Some(Reference::Base) => "the base (adapter off)",
        Some(Reference::Adapter) => "a frozen reference adapter",
        Some(Reference::Precomputed) => {
            "the reference's log-probabilities computed before training"
        }
    }
}

/// DPO's and IPO's reference adapter, as TRL 1.16 chooses the reference:
/// `--ref-adapter`, else a frozen copy of the adapter training started
/// from (read again on resume), else None: the base with the adapter off
/// (a fresh adapter's starting policy). Refused where the objective has
/// no reference, or would need a second copy of the base.
pub(crate) fn reference_adapter(spec: &RunView, model: &Model) -> Result<Option<Adapter>> {
    let objective = spec.objective;
    let refuse = |why: String| EngineError::Objective {
        objective: objective.name(),
        why,
    };
    let needs = spec.objective.reads("ref-adapter");
    // (A reference setting given to an objective without one is refused
    // by `RunView::check_objective_settings`.)
    if !needs {
        return Ok(None);
    }
    if spec.step.full {
        if spec.objectives.preference.precompute_ref {
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
    match &tc.loss {
        Loss::Preference(p) if p.reference == Reference::Precomputed => Ok(Some(
            reference::precompute(backend, model, tc, reference, pairs, seed)?,
        )),
        _ => Ok(None),
    }
}
