//! KTO (TRL 1.16's `KTOTrainer`) beyond its loss (`hlo_models::kto`):
//! its settings, its data (unpaired labelled completions, or preference
//! pairs unpaired, in file order: TRL's sequential sampling, each batch
//! with its KL rows) and its reference, chosen as for DPO.

pub(crate) mod settings;

use hlo_models::adapter::Adapter;
use hlo_models::decoder::LoraConfig;
use hlo_models::kto::step::Kto;
use hlo_models::kto::{KtoLoss, KtoLossType};
use hlo_models::preference::Reference;
use hlo_models::roles::BatchField;
use hlo_models::train::Loss;

use super::{Data, ObjectiveDef, ObjectiveSpecs};
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::run::settings::Setting;
use crate::run::spec::RunSpec;
use crate::run::step::StepSpec;
use crate::train::checkpoint::RunSettings;

/// KTO's settings (TRL 1.16's names and defaults; β is the preference
/// objectives' `beta`, 0.1).
#[derive(Clone, Debug, PartialEq)]
pub struct KtoSpec {
    /// `kto` (with the KL estimate) or `apo_zero_unpaired`.
    pub loss_type: KtoLossType,
    /// The weight of a desirable example's loss: 1.
    pub desirable_weight: f64,
    /// The weight of an undesirable example's loss: 1.
    pub undesirable_weight: f64,
}

impl Default for KtoSpec {
    fn default() -> KtoSpec {
        KtoSpec {
            loss_type: KtoLossType::Kto,
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
        }
    }
}

impl KtoSpec {
    /// The traced loss's settings, with β.
    pub fn loss(&self, beta: f64) -> KtoLoss {
        KtoLoss {
            loss_type: self.loss_type,
            beta,
            desirable_weight: self.desirable_weight,
            undesirable_weight: self.undesirable_weight,
        }
    }
}

/// KTO as an objective of a run.
pub(crate) struct KtoObjective;

pub(crate) static KTO: KtoObjective = KtoObjective;

impl ObjectiveDef for KtoObjective {
    fn name(&self) -> &'static str {
        "kto"
    }

    fn data(&self) -> Data {
        Data::Unpaired
    }

    /// Its own settings, β and the reference (its adapter, or its
    /// log-probabilities computed before training).
    fn reads(&self, name: &str) -> bool {
        matches!(name, "beta" | "ref-adapter" | "precompute-ref")
            || settings::SETTINGS.iter().any(|s| s.name == name)
    }

    fn settings(&self) -> Vec<&'static [Setting]> {
        vec![settings::SETTINGS]
    }

    /// `batch` examples a step in one unpacked micro-batch, each with its
    /// KL row where the loss estimates the KL term.
    fn step_spec(&self, step: &StepSpec, specs: &ObjectiveSpecs) -> Result<StepSpec> {
        let mut step = super::one_unpacked_batch(step, "kto", "examples")?;
        if specs.kto.loss_type == KtoLossType::Kto {
            step.batch *= 2;
        }
        Ok(step)
    }

    fn loss(&self, specs: &ObjectiveSpecs, reference: Reference) -> Loss {
        Loss::Kto(Kto {
            loss: specs.kto.loss(specs.preference.beta),
            reference,
            reference_lora: None,
        })
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
        if let Loss::Kto(k) = loss {
            *k = k.clone().with_reference_lora(trained, Some(reference));
        }
    }

    fn batch_fields(&self, _packed: bool) -> Vec<BatchField> {
        vec![
            BatchField::InputIds,
            BatchField::LossMask,
            BatchField::Desirable,
        ]
    }

    fn metrics(&self, _specs: &ObjectiveSpecs) -> Vec<&'static str> {
        vec![
            "loss",
            "kl",
            "rewards/chosen",
            "logps/chosen",
            "rewards/rejected",
            "logps/rejected",
            "rewards/margins",
            "entropy",
            "logits/chosen",
            "logits/rejected",
        ]
    }

    fn describe(&self, specs: &ObjectiveSpecs, loss: &Loss) -> Option<String> {
        let k = &specs.kto;
        Some(format!(
            "kto ({} loss, beta {}, weights {} desirable / {} undesirable) against {}",
            k.loss_type.name(),
            specs.preference.beta,
            k.desirable_weight,
            k.undesirable_weight,
            super::preference::reference_words(loss),
        ))
    }

    fn batch_words(&self, specs: &ObjectiveSpecs, rows: i64) -> String {
        match specs.kto.loss_type {
            KtoLossType::Kto => format!("{} examples (+ {} KL rows)", rows / 2, rows / 2),
            KtoLossType::ApoZeroUnpaired => format!("{rows} examples"),
        }
    }

    fn check_settings(&self, spec: &RunSpec) -> Result<()> {
        check_settings(spec)
    }

    fn record_settings(&self, s: &mut RunSettings, spec: &RunSpec) {
        let (k, p) = (&spec.objectives.kto, &spec.objectives.preference);
        s.set("batch", spec.step.batch);
        s.set("beta", p.beta);
        s.set("kto-loss-type", k.loss_type.name());
        s.set("desirable-weight", k.desirable_weight);
        s.set("undesirable-weight", k.undesirable_weight);
        if let Some(dir) = &p.ref_adapter {
            s.set("ref-adapter", crate::run::absolute(dir));
        }
        s.set("precompute-ref", p.precompute_ref);
    }

    /// As DPO's ([`super::preference::reference_adapter`]): full
    /// finetuning takes its reference computed before training (the base
    /// as it starts, `--precompute-ref`); a second copy of the base in the
    /// step is refused.
    fn reference(&self, spec: &RunSpec, model: &Model) -> Result<Option<Adapter>> {
        super::preference::reference_adapter(spec, model)
    }
}

/// Refuses KTO settings that cannot go together (as TRL refuses them).
fn check_settings(spec: &RunSpec) -> Result<()> {
    let (k, beta) = (&spec.objectives.kto, spec.objectives.preference.beta);
    let refuse = |why: String| {
        Err(EngineError::Objective {
            objective: "kto",
            why,
        })
    };
    if !beta.is_finite() || beta <= 0.0 {
        return refuse(format!("--beta must be > 0, not {beta}"));
    }
    for (what, w) in [
        ("desirable-weight", k.desirable_weight),
        ("undesirable-weight", k.undesirable_weight),
    ] {
        if !w.is_finite() || w < 0.0 {
            return refuse(format!("--{what} must be a finite number >= 0, not {w}"));
        }
    }
    if k.loss_type == KtoLossType::Kto && spec.step.batch < 2 {
        return refuse(
            "--batch must be at least 2: the KL estimate pairs each prompt with another example's completion of its batch".into(),
        );
    }
    if spec.eval.data.is_some() {
        return refuse("held-out evaluation of KTO is not built yet; leave out --eval-data".into());
    }
    Ok(())
}
