//! Distillation in the step: the student's and the teacher's forward over
//! a batch of completions (each row a prompt and the student's completion,
//! right-padded, `loss_mask` on the completion's tokens), the divergence
//! of their next-token distributions and TRL's metrics, and the train step
//! around it. The teacher's weights are inputs of their own, `teacher.`
//! and its HF names, never differentiated.

use hlo_ir::{scope, trace, DType, Outputs, TensorType};

use super::DistillLoss;
use crate::decoder::{base_parameter_types, Decoder, ModelConfig, Params};
use crate::roles::{BatchField, Step};
use crate::train::{loss_inputs, model, step_around, Loss, StepLoss, TrainConfig};
use crate::ModelError;

/// Distillation as a step's loss: its settings and the teacher.
#[derive(Clone, Debug, PartialEq)]
pub struct Distill {
    pub loss: DistillLoss,
    /// The teacher's config (its vocabulary is the student's); None until
    /// the run has opened it (a step cannot be traced without it).
    pub teacher: Option<Box<ModelConfig>>,
}

/// A teacher weight's name among the step's inputs.
pub(crate) fn teacher_name(name: &str) -> String {
    format!("{TEACHER_PREFIX}{name}")
}

/// The teacher weight step input `name` is, if it is one: what owns the
/// teacher's inputs (a session reads them from the teacher's checkpoint,
/// and never trains them).
///
/// ```
/// use hlo_models::distill::step::teacher_of;
/// assert_eq!(teacher_of("teacher.lm_head.weight"), Some("lm_head.weight"));
/// assert_eq!(teacher_of("lm_head.weight"), None);
/// ```
pub fn teacher_of(name: &str) -> Option<&str> {
    name.strip_prefix(TEACHER_PREFIX)
}

const TEACHER_PREFIX: &str = "teacher.";

/// The teacher's weights as step inputs (`teacher.` names, in `dtype`).
pub(crate) fn teacher_inputs(teacher: &ModelConfig, dtype: DType) -> Vec<(String, TensorType)> {
    base_parameter_types(teacher, dtype)
        .into_iter()
        .map(|(n, t)| (teacher_name(&n), t))
        .collect()
}

/// The distillation loss of a batch as one traced function of the train
/// step's inputs by name (the student's weights and LoRA tensors, the
/// teacher's `teacher.` weights, `input_ids`, `loss_mask`): outputs
/// `loss`, then `entropy`.
pub fn distill_loss(
    config: &ModelConfig,
    tc: &TrainConfig,
    distill: &Distill,
) -> Result<hlo_ir::Function, ModelError> {
    let refuse = |why: String| {
        Err(ModelError::ObjectiveBatch {
            objective: "distillation",
            why,
        })
    };
    let Some(teacher) = distill.teacher.as_deref() else {
        return refuse("the step has no teacher (give --teacher)".into());
    };
    if teacher.vocab_size != config.vocab_size {
        return refuse(format!(
            "the teacher's vocabulary ({}) is not the student's ({})",
            teacher.vocab_size, config.vocab_size
        ));
    }
    if tc.packing || tc.grad_accum > 1 {
        return refuse("completions are neither packed nor accumulated".into());
    }
    let t = distill.loss.temperature;
    if !(t.is_finite() && t > 0.0) {
        return refuse(format!("the temperature must be above 0, not {t}"));
    }
    let tc = &TrainConfig {
        loss: Loss::Distill(distill.clone()),
        ..tc.clone()
    };
    let (_, _, mut inputs) = loss_inputs(config, tc)?;
    let teacher_params = base_parameter_types(teacher, tc.dtype);
    inputs.extend(teacher_inputs(teacher, tc.dtype));
    let student = model(config, tc);
    let frozen = Decoder {
        config: teacher,
        lora: None,
        scan_layers: false,
        ..model(config, tc)
    };
    let f = trace("distill_loss", &inputs, |i| {
        let ids = i["input_ids"];
        let h = student.last_hidden(&Params(i), ids, None, tc.dtype);
        let logits = student.lm_head(&Params(i), h);
        let own: Vec<_> = teacher_params
            .iter()
            .map(|(n, _)| (n.clone(), i[teacher_name(n).as_str()]))
            .collect();
        let view = i.with_overrides(&own);
        let teacher_logits = scope("teacher", || {
            let h = frozen.last_hidden(&Params(&view), ids, None, tc.dtype);
            frozen.lm_head(&Params(&view), h).stop_gradient()
        });
        let mask = i["loss_mask"].cast(DType::F32);
        let (loss, entropy) = scope("loss", || {
            let (div, ent) = distill.loss.per_token(logits, teacher_logits);
            let tokens = mask.sum(&[0, 1]);
            let tokens = tokens.maximum(tokens.scalar_like(1.0));
            (
                (div * mask).sum(&[0, 1]) / tokens,
                (ent * mask).sum(&[0, 1]) / tokens,
            )
        });
        Outputs::new().add("loss", loss).add("entropy", entropy)
    })?;
    Ok(f)
}

impl StepLoss for Distill {
    fn name(&self) -> Option<&'static str> {
        Some("distillation")
    }

    fn batch_fields(&self, _fields: &mut Vec<BatchField>) {}

    fn train_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        step_around(config, tc, &distill_loss(config, tc, self)?)
    }

    fn eval_step(&self, _config: &ModelConfig, _tc: &TrainConfig) -> Result<Step, ModelError> {
        Err(ModelError::ObjectiveBatch {
            objective: "distillation",
            why: "held-out scoring of distillation is not built yet".into(),
        })
    }
}
