//! DPO, IPO, SimPO and ORPO beyond their loss (`hlo_models::preference`):
//! their settings, their reference, and the reference's
//! log-probabilities computed once before training ([`reference`]).

pub mod reference;
pub(crate) mod settings;

use std::path::PathBuf;

use hlo_data::PreferencePair;
use hlo_models::adapter::Adapter;
use hlo_models::decoder::LoraConfig;
use hlo_models::preference::{NllSpan, PreferenceLoss, Reference};
use hlo_models::roles::BatchField;
use hlo_models::train::{Loss, Preference, TrainConfig};

use super::{Data, ObjectiveDef, ObjectiveSpecs};
use crate::device::backend::Backend;
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::run::settings::Setting;
use crate::run::spec::RunSpec;
use crate::run::step::StepSpec;
use crate::train::checkpoint::RunSettings;

/// A preference objective's settings (TRL 1.16's defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct PreferenceSpec {
    /// DPO's and IPO's β (TRL's `beta`), SimPO's β, ORPO's λ (TRL's
    /// `beta` in `ORPOConfig`): 0.1.
    pub beta: f64,
    /// SimPO's target margin γ (`simpo_gamma`): 0.5.
    pub simpo_gamma: f64,
    /// SimPO's label smoothing ε (`CPOConfig.label_smoothing`): 0. (TRL
    /// 1.16's DPO losses here take none.)
    pub label_smoothing: f64,
    /// The weight of the chosen completions' NLL in SimPO (`cpo_alpha`):
    /// 1.0 (0: the paper's SimPO).
    pub cpo_alpha: f64,
    /// DPO's and IPO's reference adapter (None: the policy as training
    /// starts: the base for a fresh adapter, a frozen copy of
    /// `init_adapter`).
    pub ref_adapter: Option<PathBuf>,
    /// Compute the reference's log-probabilities once before training
    /// (no reference forward in the step, nothing of it on the devices
    /// while training; full finetuning then has a reference too).
    pub precompute_ref: bool,
}

impl Default for PreferenceSpec {
    fn default() -> PreferenceSpec {
        PreferenceSpec {
            beta: 0.1,
            simpo_gamma: 0.5,
            label_smoothing: 0.0,
            cpo_alpha: 1.0,
            ref_adapter: None,
            precompute_ref: false,
        }
    }
}

/// A preference method over pairs: its loss under the settings, the
/// settings it reads and the metrics it reports beyond the pairs'.
pub(crate) struct PairMethod {
    name: &'static str,
    loss: fn(&PreferenceSpec) -> PreferenceLoss,
    /// The preference settings it reads besides β.
    reads: &'static [&'static str],
    /// Its metrics between the log-probabilities' and the logits'.
    extra_metrics: &'static [&'static str],
    /// Whether it reports the chosen tokens' entropy and accuracy.
    token_metrics: bool,
}

const REFERENCE: &[&str] = &["ref-adapter", "precompute-ref"];

pub(crate) static DPO: PairMethod = PairMethod {
    name: "dpo",
    loss: |p| PreferenceLoss::Dpo { beta: p.beta },
    reads: REFERENCE,
    extra_metrics: &[],
    token_metrics: true,
};

pub(crate) static IPO: PairMethod = PairMethod {
    name: "ipo",
    loss: |p| PreferenceLoss::Ipo { beta: p.beta },
    reads: REFERENCE,
    extra_metrics: &[],
    token_metrics: true,
};

pub(crate) static SIMPO: PairMethod = PairMethod {
    name: "simpo",
    loss: |p| PreferenceLoss::Simpo {
        beta: p.beta,
        gamma: p.simpo_gamma,
        label_smoothing: p.label_smoothing,
        cpo_alpha: p.cpo_alpha,
    },
    reads: &["simpo-gamma", "label-smoothing", "cpo-alpha"],
    extra_metrics: &["nll_loss"],
    token_metrics: false,
};

pub(crate) static ORPO: PairMethod = PairMethod {
    name: "orpo",
    loss: |p| PreferenceLoss::Orpo { beta: p.beta },
    reads: &[],
    extra_metrics: &["nll_loss", "log_odds_ratio", "log_odds_chosen"],
    token_metrics: false,
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

    fn settings(&self) -> Vec<&'static [Setting]> {
        vec![settings::SETTINGS]
    }

    /// `batch` pairs a step, so twice the rows, unpacked, in one
    /// micro-batch (what such a step can take: packing and accumulation
    /// are refused).
    fn step_spec(&self, step: &StepSpec, _specs: &ObjectiveSpecs) -> Result<StepSpec> {
        let mut step = super::one_unpacked_batch(step, self.name, "pairs")?;
        step.batch *= 2;
        Ok(step)
    }

    fn loss(&self, specs: &ObjectiveSpecs, reference: Reference) -> Loss {
        Loss::Preference(Preference::new((self.loss)(&specs.preference), reference))
    }

    fn reference_in_step(&self) -> bool {
        true
    }

    fn with_reference_lora(
        &self,
        loss: &mut Loss,
        trained: Option<&LoraConfig>,
        reference: &LoraConfig,
    ) {
        if let Loss::Preference(p) = loss {
            *p = p.clone().with_reference_lora(trained, Some(reference));
        }
    }

    fn batch_fields(&self, _packed: bool) -> Vec<BatchField> {
        let mut fields = vec![BatchField::InputIds, BatchField::LossMask];
        // ORPO's likelihood term counts each row's real tokens.
        if (self.loss)(&PreferenceSpec::default()).nll() == Some(NllSpan::WholeRow) {
            fields.push(BatchField::SegmentIds);
        }
        fields
    }

    fn metrics(&self, _specs: &ObjectiveSpecs) -> Vec<&'static str> {
        let mut m = vec![
            "loss",
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
            "logps/accuracies",
        ];
        m.extend(self.extra_metrics);
        m.extend(["logits/chosen", "logits/rejected"]);
        if self.token_metrics {
            m.extend(["entropy", "mean_token_accuracy"]);
        }
        m
    }

    fn describe(&self, _specs: &ObjectiveSpecs, loss: &Loss) -> Option<String> {
        Some(format!("{} against {}", self.name, reference_words(loss)))
    }

    fn check_settings(&self, spec: &RunSpec) -> Result<()> {
        let beta = spec.objectives.preference.beta;
        if beta.is_nan() || beta <= 0.0 {
            return Err(EngineError::Objective {
                objective: self.name,
                why: format!("--beta must be > 0, not {beta}"),
            });
        }
        Ok(())
    }

    fn record_settings(&self, settings: &mut RunSettings, spec: &RunSpec) {
        record_settings(settings, spec)
    }

    fn reference(&self, spec: &RunSpec, model: &Model) -> Result<Option<Adapter>> {
        reference_adapter(spec, model)
    }
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
pub(crate) fn reference_adapter(spec: &RunSpec, model: &Model) -> Result<Option<Adapter>> {
    let objective = spec.objective;
    let refuse = |why: String| EngineError::Objective {
        objective: objective.name(),
        why,
    };
    let needs = spec.objective.reads("ref-adapter");
    // (A reference setting given to an objective without one is refused
    // by `RunSpec::check_objective_settings`.)
    if !needs {
        return Ok(None);
    }
    if spec.step.lora.is_none() {
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

/// A preference objective's settings, as a run records them with its
/// identities: `batch` counts pairs (the step's rows are twice as many).
pub(crate) fn record_settings(s: &mut crate::train::checkpoint::RunSettings, spec: &RunSpec) {
    s.set("batch", spec.step.batch);
    let p = &spec.objectives.preference;
    s.set("beta", p.beta);
    s.set("simpo-gamma", p.simpo_gamma);
    s.set("label-smoothing", p.label_smoothing);
    s.set("cpo-alpha", p.cpo_alpha);
    if let Some(dir) = &p.ref_adapter {
        s.set("ref-adapter", crate::run::absolute(dir));
    }
    s.set("precompute-ref", p.precompute_ref);
}
