//! Reward models (TRL 1.16's `RewardTrainer`) beyond their loss
//! (`hlo_models::reward`): the model made a sequence classifier of one
//! label (a causal LM's checkpoint gets a new `score` head, a
//! classifier's keeps its own; see `Model::as_reward_model`), its pairs
//! read whole with their margins, LoRA with `score` trained whole beside
//! the adapter (PEFT's `SEQ_CLS` task, `modules_to_save=["score"]`).

use hlo_models::preference::Reference;
use hlo_models::reward::RewardLoss;
use hlo_models::train::Loss;

use clap::Args;
use serde::{Deserialize, Serialize};

use super::{Data, ObjectiveDef, ObjectiveSpecs};
use crate::error::{EngineError, Result};
use crate::objectives::RunView;
use crate::settings;
use crate::step::StepSpec;

/// A reward model's settings (TRL 1.16's `RewardConfig` names and
/// defaults).
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct RewardModelSpec {
    /// Reward model: add this weight times the mean squared sum of each
    /// pair's rewards to the loss, keeping them centred on 0 (TRL's
    /// center_rewards_coefficient; default none).
    #[arg(long, allow_negative_numbers = true, value_parser = settings::finite)]
    pub center_rewards_coefficient: Option<f64>,
}

/// A reward model as an objective of a run.
pub(crate) struct RewardModel;

pub(crate) static REWARD: RewardModel = RewardModel;

impl ObjectiveDef for RewardModel {
    fn name(&self) -> &'static str {
        "reward"
    }

    fn data(&self) -> Data {
        Data::Pairs
    }

    fn reads(&self, name: &str) -> bool {
        settings::names::<RewardModelSpec>()
            .iter()
            .any(|s| s == name)
    }

    /// `batch` pairs a step, twice the rows, unpacked, in one
    /// micro-batch; with LoRA the classifier's head is trained whole
    /// beside the adapter (PEFT's `SEQ_CLS` task saves `score`).
    fn step_spec(&self, step: &StepSpec, _specs: &ObjectiveSpecs) -> Result<StepSpec> {
        let mut step = super::one_unpacked_batch(step, "reward", "pairs")?;
        step.batch *= 2;
        let saved = &mut step.lora.modules_to_save;
        if !step.full && !saved.iter().any(|m| m == "score") {
            saved.push("score".into());
        }
        Ok(step)
    }

    fn loss(&self, specs: &ObjectiveSpecs, _reference: Reference) -> Loss {
        Loss::Reward(RewardLoss {
            center_rewards_coefficient: specs.reward.center_rewards_coefficient,
        })
    }

    fn describe(&self, specs: &ObjectiveSpecs, _loss: &Loss) -> Option<String> {
        Some(match specs.reward.center_rewards_coefficient {
            Some(c) => {
                format!("reward model (Bradley–Terry loss, rewards centred with weight {c})")
            }
            None => "reward model (Bradley–Terry loss)".into(),
        })
    }

    fn check_settings(&self, spec: &RunView) -> Result<()> {
        let refuse = |why: String| {
            Err(EngineError::Objective {
                objective: "reward",
                why,
            })
        };
        if let Some(c) = spec.objectives.reward.center_rewards_coefficient {
            if !c.is_finite() {
                return refuse(format!(
                    "--center-rewards-coefficient must be finite, not {c}"
                ));
            }
        }
        if spec.eval_data.is_some() {
            return refuse(
                "held-out scoring of a reward model is not built yet; leave out --eval-data".into(),
            );
        }
        Ok(())
    }

    fn classifier(&self) -> bool {
        true
    }
}
