//! KTO (TRL 1.16's `KTOTrainer`) beyond its loss (`hlo_models::kto`):
//! its settings, its data (unpaired labelled completions, or preference
//! pairs unpaired, in file order: TRL's sequential sampling, each batch
//! with its KL rows) and its reference, chosen as for DPO.

use hlo_models::adapter::Adapter;
use hlo_models::kto::step::Kto;
use hlo_models::kto::{KtoLoss, KtoLossType};
use hlo_models::preference::Reference;
use hlo_models::train::Loss;

use clap::Args;
use serde::{Deserialize, Serialize};

use super::{Data, Objective, ObjectiveDef, ObjectiveSpecs};
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::named::Named;
use crate::objectives::RunView;
use crate::settings;
use crate::step::StepSpec;

/// KTO's settings (TRL 1.16's `KTOConfig` names and defaults; β and the
/// reference adapter are the preference objectives').
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct KtoSpec {
    /// KTO: its loss, as TRL's loss_type: kto (with the KL estimate from
    /// mismatched prompt/completion pairs) or apo_zero_unpaired.
    #[arg(long, value_parser = settings::named::<KtoLossType>(), default_value = "kto")]
    #[serde(with = "settings::by_name")]
    pub kto_loss_type: KtoLossType,

    /// KTO: the weight of a desirable example's loss.
    #[arg(long, default_value_t = 1.0, value_parser = settings::non_negative)]
    pub desirable_weight: f64,

    /// KTO: the weight of an undesirable example's loss.
    #[arg(long, default_value_t = 1.0, value_parser = settings::non_negative)]
    pub undesirable_weight: f64,
}

impl Default for KtoSpec {
    fn default() -> KtoSpec {
        settings::defaults()
    }
}

impl Named for KtoLossType {
    const ALL: &'static [KtoLossType] = &[KtoLossType::Kto, KtoLossType::ApoZeroUnpaired];
    fn name(self) -> &'static str {
        KtoLossType::name(self)
    }
}

impl KtoSpec {
    /// The traced loss's settings, with β.
    pub fn loss(&self, beta: f64) -> KtoLoss {
        KtoLoss {
            loss_type: self.kto_loss_type,
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
            || settings::names::<KtoSpec>().iter().any(|s| s == name)
    }

    /// `batch` examples a step in one unpacked micro-batch, each with its
    /// KL row where the loss estimates the KL term.
    fn step_spec(&self, step: &StepSpec, specs: &ObjectiveSpecs) -> Result<StepSpec> {
        let mut step = super::one_unpacked_batch(step, "kto", "examples")?;
        if specs.kto.kto_loss_type == KtoLossType::Kto {
            step.batch *= 2;
        }
        Ok(step)
    }

    fn loss(&self, specs: &ObjectiveSpecs, reference: Reference) -> Loss {
        Loss::Kto(Kto {
            loss: specs.kto.loss(specs.beta(Objective::Kto)),
            reference,
            reference_lora: None,
        })
    }

    fn describe(&self, specs: &ObjectiveSpecs, loss: &Loss) -> Option<String> {
        let k = &specs.kto;
        Some(format!(
            "kto ({} loss, beta {}, weights {} desirable / {} undesirable) against {}",
            k.kto_loss_type.name(),
            specs.beta(Objective::Kto),
            k.desirable_weight,
            k.undesirable_weight,
            super::preference::reference_words(loss),
        ))
    }

    fn batch_words(&self, specs: &ObjectiveSpecs, rows: i64) -> String {
        match specs.kto.kto_loss_type {
            KtoLossType::Kto => format!("{} examples (+ {} KL rows)", rows / 2, rows / 2),
            KtoLossType::ApoZeroUnpaired => format!("{rows} examples"),
        }
    }

    fn check_settings(&self, spec: &RunView) -> Result<()> {
        check_settings(spec)
    }

    /// As DPO's ([`super::preference::reference_adapter`]): full
    /// finetuning takes its reference computed before training (the base
    /// as it starts, `--precompute-ref`); a second copy of the base in the
    /// step is refused.
    fn reference(&self, spec: &RunView, model: &Model) -> Result<Option<Adapter>> {
        super::preference::reference_adapter(spec, model)
    }
}

/// Refuses KTO settings that cannot go together (as TRL refuses them).
fn check_settings(spec: &RunView) -> Result<()> {
    let (k, beta) = (&spec.objectives.kto, spec.objectives.beta(Objective::Kto));
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
    if k.kto_loss_type == KtoLossType::Kto && spec.step.batch < 2 {
        return refuse(
            "--batch must be at least 2: the KL estimate pairs each prompt with another example's completion of its batch".into(),
        );
    }
    if spec.eval_data.is_some() {
        return refuse("held-out evaluation of KTO is not built yet; leave out --eval-data".into());
    }
    Ok(())
}
