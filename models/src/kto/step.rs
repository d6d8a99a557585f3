//! KTO in the step: one traced function of a batch of unpaired examples
//! (rows `0..B` each prompt with its completion, then, where the loss
//! estimates the KL term, rows `B..2B` each prompt with the completion
//! TRL pairs it with for the estimate), the policy's and the reference's
//! log-probabilities (the reference's read from the batch's `ref_logps`
//! when computed before training), the loss and TRL's metrics; and the
//! train step around it.

use hlo_ir::{scope, trace, DType, Outputs, Tensor};

use super::{KtoLogps, KtoLoss};
use crate::decoder::{LoraConfig, ModelConfig};
use crate::loss::{mean, TokenStats};
use crate::preference::Reference;
use crate::reference::{where_same, ReferenceModel};
use crate::roles::{BatchField, Step};
use crate::train::{
    loss_inputs, model, role_of, step_around, token_stats_of, StepLoss, TrainConfig,
};
use crate::ModelError;

/// KTO as a step's loss: its settings and the model it compares with.
#[derive(Clone, Debug, PartialEq)]
pub struct Kto {
    pub loss: KtoLoss,
    /// The base with the adapter off, a frozen adapter (`ref.` tensors),
    /// or each row's sums computed before training (`ref_logps`).
    pub reference: Reference,
    /// A reference adapter's own LoRA settings, where not the trained
    /// adapter's (as [`crate::train::Preference::reference_lora`]).
    pub reference_lora: Option<LoraConfig>,
}

impl Kto {
    /// KTO with a reference adapter of settings `reference` beside a
    /// trained adapter of settings `trained` (as
    /// [`crate::train::Preference::with_reference_lora`]).
    pub fn with_reference_lora(
        mut self,
        trained: Option<&LoraConfig>,
        reference: Option<&LoraConfig>,
    ) -> Kto {
        self.reference_lora = crate::reference::own_lora(trained, reference);
        self
    }

    /// Examples a batch of `rows` rows holds.
    pub fn examples(&self, rows: i64) -> i64 {
        rows / self.rows_per_example()
    }
}

/// KTO's loss of a batch as one traced function of the train step's
/// inputs by name (weights, LoRA tensors, `input_ids`, `loss_mask` on the
/// completion tokens, `desirable` 1 or 0 a row, and a reference
/// adapter's `ref.` tensors): outputs `loss`, then the metrics by TRL's
/// names.
pub fn kto_loss(
    config: &ModelConfig,
    tc: &TrainConfig,
    kto: &Kto,
) -> Result<hlo_ir::Function, ModelError> {
    let kl = kto.loss.estimates_kl();
    if tc.packing || tc.grad_accum > 1 || (kl && tc.batch % 2 != 0) {
        return Err(ModelError::PreferenceBatch {
            rows: tc.batch,
            packed: tc.packing,
        });
    }
    let (_, _, mut inputs) = loss_inputs(config, tc)?;
    let reference = ReferenceModel::new(
        config,
        tc,
        kto.reference,
        kto.reference_lora.as_ref(),
        &mut inputs,
    )?;
    let policy = model(config, tc);
    let b = kto.examples(tc.batch);
    let f = trace("kto_loss", &inputs, |i| {
        let maskf = i["loss_mask"].cast(DType::F32);
        let stats = |i: &hlo_ir::Inputs| token_stats_of(&policy, i, tc, 1.0);
        let sums = |t: &TokenStats| (t.logps * maskf).sum(&[1]);
        let tokens = scope("policy", || stats(i));
        let mine = sums(&tokens);
        let theirs = match kto.reference {
            // Read from the batch: the same rows' sums, computed once.
            Reference::Precomputed => i[BatchField::RefLogps.name()],
            _ => scope("reference", || {
                let theirs = sums(&reference.stats(i, tc, stats));
                match reference.same(i) {
                    Some(same) => where_same(same, mine, theirs),
                    None => theirs,
                }
            }),
        };
        let first = |t: Tensor| t.slice(&[0], &[b]);
        let desirable = first(i[BatchField::Desirable.name()]);
        let logps = KtoLogps {
            policy: first(mine),
            reference: first(theirs),
            kl: kl.then(|| {
                let last = |t: Tensor| t.slice(&[b], &[2 * b]);
                (last(mine).stop_gradient(), last(theirs))
            }),
            desirable,
        };
        let out = scope("loss", || kto.loss.compute(logps));
        let mut o = Outputs::new().add("loss", out.loss);
        for (name, t) in out.metrics {
            o = o.add(name, t);
        }
        scope("metrics", || token_metrics(o, &tokens, maskf, desirable, b))
    })?;
    Ok(f)
}

/// `o` with KTOTrainer's token statistics of the examples' rows (`0..b`):
/// `entropy` over every completion token, `logits/chosen` and
/// `logits/rejected` the mean logit over the desirable (undesirable)
/// examples' completion tokens.
fn token_metrics(
    o: Outputs,
    tokens: &TokenStats,
    mask: Tensor,
    desirable: Tensor,
    b: i64,
) -> Outputs {
    let seq = mask.dims()[1];
    let rows = |t: Tensor| t.slice(&[0, 0], &[b, seq]);
    let mask = rows(mask);
    let masked = |t: Tensor, m: Tensor| mean(((t * m).sum(&[0, 1]), m.sum(&[0, 1])));
    // NaN over no token: a label the batch lacks (left out of the report).
    let over = |t: Tensor, m: Tensor| (t * m).sum(&[0, 1]) / m.sum(&[0, 1]);
    let by_row = |w: Tensor| mask * w.broadcast_in_dim(&[b, seq], &[0]);
    let undesirable = desirable.scalar_like(1.0) - desirable;
    let logits = rows(tokens.mean_logit).stop_gradient();
    o.add("entropy", masked(rows(tokens.entropy), mask))
        .add("logits/chosen", over(logits, by_row(desirable)))
        .add("logits/rejected", over(logits, by_row(undesirable)))
}

/// The KTO train step ([`kto_loss`], then the same clipping, schedule and
/// optimizer as [`crate::train::train_step`]); one micro-batch a step.
pub(crate) fn kto_train_step(
    config: &ModelConfig,
    tc: &TrainConfig,
    kto: &Kto,
) -> Result<Step, ModelError> {
    let loss_fn = kto_loss(config, tc, kto)?;
    step_around(config, tc, &loss_fn)
}

impl StepLoss for Kto {
    fn name(&self) -> Option<&'static str> {
        Some(self.loss.loss_type.name())
    }

    fn batch_fields(&self, fields: &mut Vec<BatchField>) {
        fields.push(BatchField::Desirable);
        if self.reference == Reference::Precomputed {
            fields.push(BatchField::RefLogps);
        }
    }

    fn train_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        kto_train_step(config, tc, self)
    }

    /// The loss and its metrics, as the train step logs them.
    fn eval_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        let function = kto_loss(config, tc, self)?;
        Ok(Step::new(function, role_of(tc)))
    }

    fn rows_per_example(&self) -> i64 {
        match self.loss.estimates_kl() {
            true => 2,
            false => 1,
        }
    }

    fn reference(&self) -> Option<Reference> {
        Some(self.reference)
    }
}
