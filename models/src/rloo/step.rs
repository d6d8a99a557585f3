//! RLOO's loss in the step: one traced function of a batch of rollouts
//! and the train step around it. The rollouts' old and reference
//! log-probabilities are scored outside the step (GRPO's scoring
//! program, [`crate::train::token_logps_step`]).

use hlo_ir::{scope, trace, DType, Outputs};

use super::{RlooLoss, RlooTokens};
use crate::decoder::ModelConfig;
use crate::loss::TokenStats;
use crate::roles::{BatchField, Step};
use crate::train::{loss_inputs, model, step_around, token_stats_of, Loss, StepLoss, TrainConfig};
use crate::ModelError;

/// RLOO's loss of a batch of rollouts as one traced function of the
/// train step's inputs by name: weights, LoRA tensors, `input_ids` (each
/// row a prompt and one of its completions, right-padded), `loss_mask`
/// (on the completion's tokens), `advantages`, and `old_logps` where the
/// loss reads them. Outputs `loss`, then the metrics by TRL's names.
pub fn rloo_loss(
    config: &ModelConfig,
    tc: &TrainConfig,
    loss: &RlooLoss,
) -> Result<hlo_ir::Function, ModelError> {
    let refuse = |why: String| {
        Err(ModelError::ObjectiveBatch {
            objective: "RLOO",
            why,
        })
    };
    if tc.packing || tc.grad_accum > 1 {
        return refuse("rollouts are neither packed nor accumulated".into());
    }
    if loss.temperature.is_nan() || loss.temperature <= 0.0 {
        return refuse(format!(
            "the temperature must be above 0, not {}",
            loss.temperature
        ));
    }
    let tc = &TrainConfig {
        loss: Loss::Rloo(*loss),
        ..tc.clone()
    };
    let (_, _, inputs) = loss_inputs(config, tc)?;
    let policy = model(config, tc);
    let f = trace("rloo_loss", &inputs, |i| {
        let TokenStats { logps, entropy, .. } = token_stats_of(&policy, i, tc, loss.temperature);
        let field = |f: BatchField| i[f.name()];
        let (l, metrics) = scope("loss", || {
            loss.compute(RlooTokens {
                logps,
                mask: i["loss_mask"].cast(DType::F32),
                advantages: field(BatchField::Advantages),
                old_logps: loss.old_logps.then(|| field(BatchField::OldLogps)),
                entropy,
            })
        });
        let mut o = Outputs::new().add("loss", l);
        for (name, t) in metrics {
            o = o.add(name, t);
        }
        o
    })?;
    Ok(f)
}

impl StepLoss for RlooLoss {
    fn name(&self) -> Option<&'static str> {
        Some("rloo")
    }

    fn batch_fields(&self, fields: &mut Vec<BatchField>) {
        fields.push(BatchField::Advantages);
        if self.old_logps {
            fields.push(BatchField::OldLogps);
        }
    }

    /// [`rloo_loss`], then the same clipping, schedule and optimizer as
    /// every step.
    fn train_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        step_around(config, tc, &rloo_loss(config, tc, self)?)
    }

    fn eval_step(&self, _config: &ModelConfig, _tc: &TrainConfig) -> Result<Step, ModelError> {
        Err(ModelError::ObjectiveBatch {
            objective: "RLOO",
            why: "RLOO has no held-out loss".into(),
        })
    }
}
