//! A reward model's loss in the step: one traced function of a batch of
//! preference pairs (rows `0..B` the chosen sequences, `B..2B` the
//! rejected ones, right-padded), the train step around it, and the
//! scoring program `hlo-train score` and GRPO's model rewards run.

use hlo_ir::{scope, trace, DType, Outputs, Tensor};

use super::RewardLoss;
use crate::decoder::{Head, ModelConfig, Params};
use crate::roles::{BatchField, Step};
use crate::train::{loss_inputs, model, role_of, step_around, Loss, StepLoss, TrainConfig};
use crate::ModelError;

/// Each row's reward (`[rows]` f32): the classifier's one logit, pooled
/// at the row's last real token that is not padding (`segment_ids` > 0
/// marks the real tokens).
fn rewards_of(m: &crate::decoder::Decoder, i: &hlo_ir::Inputs, tc: &TrainConfig) -> Tensor {
    let ids = i["input_ids"];
    let h = m.last_hidden(&Params(i), ids, None, tc.dtype);
    let segments = i[BatchField::SegmentIds.name()];
    let real = segments.gt(segments.scalar_like(0.0));
    let logits = m
        .classify(&Params(i), h, ids, real)
        .expect("a reward model has a classifier head");
    logits.reshape(&[ids.dims()[0]])
}

/// The checks of a step a reward model takes: one label, rows of whole
/// pairs, neither packed nor accumulated.
fn check(config: &ModelConfig, tc: &TrainConfig) -> Result<(), ModelError> {
    let refuse = |why: String| {
        Err(ModelError::ObjectiveBatch {
            objective: "reward",
            why,
        })
    };
    match config.head {
        Head::SequenceClassification { num_labels: 1, .. } => {}
        Head::SequenceClassification { num_labels, .. } => {
            return refuse(format!(
                "a reward model scores with one label; this classifier has {num_labels}"
            ))
        }
        Head::CausalLm => return refuse("the model has no classifier head (score)".into()),
    }
    if tc.packing || tc.grad_accum > 1 || tc.batch % 2 != 0 {
        return Err(ModelError::PreferenceBatch {
            rows: tc.batch,
            packed: tc.packing,
        });
    }
    Ok(())
}

/// The reward model's loss of a batch of pairs as one traced function of
/// the train step's inputs by name (weights, LoRA tensors, `input_ids`,
/// `segment_ids`, `margin`): outputs
/// `loss`, then TRL's metrics.
pub fn reward_loss(
    config: &ModelConfig,
    tc: &TrainConfig,
    loss: &RewardLoss,
) -> Result<hlo_ir::Function, ModelError> {
    check(config, tc)?;
    let tc = &TrainConfig {
        loss: Loss::Reward(*loss),
        ..tc.clone()
    };
    let (_, _, inputs) = loss_inputs(config, tc)?;
    let m = model(config, tc);
    let pairs = tc.batch / 2;
    let f = trace("reward_loss", &inputs, |i| {
        let rewards = rewards_of(&m, i, tc);
        let margin = i[BatchField::Margin.name()].slice(&[0], &[pairs]);
        let (l, metrics) = scope("loss", || loss.compute(rewards, margin));
        metrics
            .into_iter()
            .fold(Outputs::new().add("loss", l), |o, (name, t)| o.add(name, t))
    })?;
    Ok(f)
}

/// Each row's reward (`scores`, `[rows]` f32) under a reward model (its
/// LoRA tensors too, where `tc` has an adapter). Inputs: the weights (and
/// LoRA tensors), `input_ids`, `segment_ids` (> 0 on real tokens).
pub fn score_step(config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
    let plain = TrainConfig {
        loss: Loss::Reward(RewardLoss::default()),
        ..tc.clone()
    };
    check(
        config,
        &TrainConfig {
            batch: 2,
            ..plain.clone()
        },
    )?;
    let (_, _, mut inputs) = loss_inputs(config, &plain)?;
    let unread = [BatchField::LossMask.name(), BatchField::Margin.name()];
    inputs.retain(|(n, _)| !unread.contains(&n.as_str()));
    let m = model(config, &plain);
    let function = trace("reward_scores", &inputs, |i| {
        Outputs::new().add("scores", rewards_of(&m, i, &plain).cast(DType::F32))
    })?;
    Ok(Step::new(function, role_of(&plain)))
}

impl StepLoss for RewardLoss {
    fn name(&self) -> Option<&'static str> {
        Some("reward")
    }

    fn batch_fields(&self, fields: &mut Vec<BatchField>) {
        if !fields.contains(&BatchField::SegmentIds) {
            fields.push(BatchField::SegmentIds);
        }
        fields.push(BatchField::Margin);
    }

    fn train_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        step_around(config, tc, &reward_loss(config, tc, self)?)
    }

    fn eval_step(&self, _config: &ModelConfig, _tc: &TrainConfig) -> Result<Step, ModelError> {
        Err(ModelError::ObjectiveBatch {
            objective: "reward",
            why: "held-out scoring of a reward model is not built yet".into(),
        })
    }

    fn rows_per_example(&self) -> i64 {
        2
    }
}
