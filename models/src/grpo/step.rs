//! GRPO's loss in the step: one traced function of a batch of rollouts,
//! the train step around it, and the per-token log-probabilities of a
//! policy or its reference scored outside the step.

use hlo_ir::{scope, trace, DType, Outputs};

use super::{GrpoLoss, GrpoTokens};
use crate::decoder::{LoraConfig, ModelConfig};
use crate::loss::TokenStats;
use crate::roles::{BatchField, Step};
use crate::train::{
    loss_inputs, model, role_of, step_around, token_stats_of, Loss, StepLoss, TrainConfig,
};
use crate::ModelError;

/// GRPO's loss of a batch of rollouts as one traced function, of the
/// train step's inputs by name: weights, LoRA tensors, `input_ids` (each
/// row a prompt and one of its completions, right-padded), `loss_mask`
/// (on the completion's tokens), `advantages`, and `old_logps` and
/// `ref_token_logps` where `loss` reads them. The logits are divided by
/// the sampling temperature before the log-probabilities are taken.
/// Outputs `loss`, then the metrics by TRL's names.
pub fn grpo_loss(
    config: &ModelConfig,
    tc: &TrainConfig,
    loss: &GrpoLoss,
) -> Result<hlo_ir::Function, ModelError> {
    if tc.packing || tc.grad_accum > 1 {
        return Err(ModelError::GrpoBatch {
            why: "rollouts are neither packed nor accumulated".into(),
        });
    }
    if loss.temperature.is_nan() || loss.temperature <= 0.0 {
        return Err(ModelError::GrpoBatch {
            why: format!("the temperature must be above 0, not {}", loss.temperature),
        });
    }
    let tc = &TrainConfig {
        loss: Loss::Grpo(*loss),
        ..tc.clone()
    };
    let (_, _, inputs) = loss_inputs(config, tc)?;
    let policy = model(config, tc);
    let f = trace("grpo_loss", &inputs, |i| {
        let TokenStats { logps, entropy, .. } = token_stats_of(&policy, i, tc, loss.temperature);
        let field = |f: BatchField| i[f.name()];
        let out = scope("loss", || {
            loss.compute(GrpoTokens {
                logps,
                mask: i["loss_mask"].cast(DType::F32),
                advantages: field(BatchField::Advantages),
                old_logps: loss.old_logps.then(|| field(BatchField::OldLogps)),
                ref_logps: (loss.beta != 0.0).then(|| field(BatchField::RefTokenLogps)),
                entropy,
            })
        });
        let mut o = Outputs::new().add("loss", out.loss);
        for (name, t) in out.metrics {
            o = o.add(name, t);
        }
        o
    })?;
    Ok(f)
}

/// The GRPO train step ([`grpo_loss`], then the same clipping, schedule
/// and optimizer as [`train_step`]); outputs `loss`, `grad_norm`, `lr`,
/// the loss's metrics, then the updated state.
pub fn grpo_train_step(
    config: &ModelConfig,
    tc: &TrainConfig,
    loss: &GrpoLoss,
) -> Result<Step, ModelError> {
    let loss_fn = grpo_loss(config, tc, loss)?;
    step_around(config, tc, &loss_fn)
}

/// Each row's per-token log-probabilities (`logps`, `[rows, seq]` f32,
/// aligned as the loss mask, logits divided by `temperature`) under the
/// base, or with `lora` the base with that adapter (its tensors under the
/// LoRA names): a GRPO rollout's old log-probabilities (the policy) and
/// its reference's. Inputs: the weights (and LoRA tensors), `input_ids`.
pub fn token_logps_step(
    config: &ModelConfig,
    tc: &TrainConfig,
    lora: Option<&LoraConfig>,
    temperature: f64,
) -> Result<Step, ModelError> {
    let plain = tc.scoring(lora);
    let (_, _, mut inputs) = loss_inputs(config, &plain)?;
    inputs.retain(|(n, _)| n != BatchField::LossMask.name());
    let m = model(config, &plain);
    let function = trace("token_logps", &inputs, |i| {
        let logps = token_stats_of(&m, i, &plain, temperature).logps;
        Outputs::new().add("logps", logps)
    })?;
    Ok(Step::new(function, role_of(&plain)))
}

impl StepLoss for GrpoLoss {
    fn name(&self) -> Option<&'static str> {
        Some("grpo")
    }

    fn batch_fields(&self, fields: &mut Vec<BatchField>) {
        fields.push(BatchField::Advantages);
        if self.old_logps {
            fields.push(BatchField::OldLogps);
        }
        if self.beta != 0.0 {
            fields.push(BatchField::RefTokenLogps);
        }
    }

    fn train_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        grpo_train_step(config, tc, self)
    }

    fn eval_step(&self, _config: &ModelConfig, _tc: &TrainConfig) -> Result<Step, ModelError> {
        Err(ModelError::GrpoBatch {
            why: "GRPO has no held-out loss".into(),
        })
    }
}
