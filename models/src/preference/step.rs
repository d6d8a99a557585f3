//! The preference losses in the step: one traced function of a batch of
//! pairs (the policy's and the reference's log-probabilities, the loss,
//! TRL's metrics), the train and eval steps around it, and the
//! reference's log-probabilities computed once before training.

use hlo_ir::{full, scope, trace, DType, Outputs, Tensor, TensorType};

use super::{NllSpan, PairLogps, PreferenceLoss, Reference};
use crate::decoder::{LoraConfig, ModelConfig, Params};
use crate::loss::{masked_logps_per_row, mean, TokenStats};
use crate::reference::{where_same, ReferenceModel};
use crate::roles::{BatchField, Step};
use crate::train::{
    loss_inputs, model, role_of, step_around, token_stats_of, StepLoss, TrainConfig,
};
use crate::ModelError;

/// A preference objective: the loss and the model it compares with.
#[derive(Clone, Debug, PartialEq)]
pub struct Preference {
    pub loss: PreferenceLoss,
    pub reference: Reference,
    /// With [`Reference::Adapter`], the reference adapter's own LoRA
    /// settings where they differ from the trained adapter's (another
    /// rank, alpha or target set, as a PEFT model holding two adapters
    /// allows); None: the trained adapter's.
    pub reference_lora: Option<LoraConfig>,
}

impl Preference {
    /// `loss` against `reference`, a reference adapter (if any) with the
    /// trained adapter's settings.
    pub fn new(loss: PreferenceLoss, reference: Reference) -> Preference {
        Preference {
            loss,
            reference,
            reference_lora: None,
        }
    }

    /// This objective with a reference adapter of settings `reference`
    /// beside a trained adapter of settings `trained`: the reference's
    /// own settings kept where they differ (see `reference_lora`).
    pub fn with_reference_lora(
        mut self,
        trained: Option<&LoraConfig>,
        reference: Option<&LoraConfig>,
    ) -> Preference {
        self.reference_lora = crate::reference::own_lora(trained, reference);
        self
    }
}

/// The reference's log-probabilities of a batch of rows, computed once
/// before a preference run with a precomputed reference: each row's summed
/// log-probability of its learned tokens (`logps`, `[rows]` f32), by the
/// base, or with `lora` the base with that adapter (its tensors under the
/// LoRA names). Inputs: the weights (and LoRA tensors), `input_ids`,
/// `loss_mask`.
pub fn reference_logps_step(
    config: &ModelConfig,
    tc: &TrainConfig,
    lora: Option<&LoraConfig>,
) -> Result<Step, ModelError> {
    let plain = tc.scoring(lora);
    let (_, _, inputs) = loss_inputs(config, &plain)?;
    let m = model(config, &plain);
    let function = trace("reference_logps", &inputs, |i| {
        let (ids, mask) = (i["input_ids"], i["loss_mask"]);
        let h = m.last_hidden(&Params(i), ids, None, plain.dtype);
        let logits = m.lm_head(&Params(i), h).cast(DType::F32);
        let (sum, _) = masked_logps_per_row(logits, ids, mask);
        Outputs::new().add("logps", sum)
    })?;
    Ok(Step::new(function, role_of(&plain)))
}

/// The preference loss of a batch of pairs as one traced function, of the
/// train step's inputs by name (weights, LoRA tensors, `input_ids` and
/// `loss_mask`, and for ORPO `segment_ids`: 1 on each row's real tokens,
/// 0 on padding): rows `0..P` are each pair's prompt and chosen
/// completion, rows `P..2P` the same prompts and the rejected ones
/// (`tc.batch` = 2P rows, right-padded, one forward over both, as TRL
/// concatenates them), the mask on the completion tokens. Where the loss
/// compares with a reference, it is `reference` (the base with the adapter
/// off, or a frozen adapter read from `ref.` inputs), without gradient.
/// Outputs `loss`, then the metrics by TRL's names.
pub fn preference_loss(
    config: &ModelConfig,
    tc: &TrainConfig,
    preference: &Preference,
) -> Result<hlo_ir::Function, ModelError> {
    let loss = &preference.loss;
    if tc.packing || tc.batch % 2 != 0 {
        return Err(ModelError::PreferenceBatch {
            rows: tc.batch,
            packed: tc.packing,
        });
    }
    let (mut inputs, reference) = preference_inputs(config, tc, preference)?;
    let reference = ReferenceModel::new(
        config,
        tc,
        reference,
        preference.reference_lora.as_ref(),
        &mut inputs,
    )?;
    let policy = model(config, tc);
    let pairs = tc.batch / 2;
    let f = trace("preference_loss", &inputs, |i| {
        let mask = i["loss_mask"];
        let maskf = mask.cast(DType::F32);
        let stats = |i: &hlo_ir::Inputs| token_stats_of(&policy, i, tc, 1.0);
        let pair_logps = |t: &TokenStats| pair_sums(t.logps, maskf, pairs);
        let tokens = scope("policy", || stats(i));
        let mine = pair_logps(&tokens);
        let theirs = loss.needs_reference().then(|| {
            if preference.reference == Reference::Precomputed {
                // Read from the batch: the same rows' sums, computed once.
                let r = i[BatchField::RefLogps.name()];
                let (half, all) = ([pairs], [2 * pairs]);
                return PairLogps {
                    chosen: r.slice(&[0], &half),
                    rejected: r.slice(&half, &all),
                    ..mine
                };
            }
            scope("reference", || {
                let theirs = pair_logps(&reference.stats(i, tc, stats));
                match reference.same(i) {
                    Some(same) => PairLogps {
                        chosen: where_same(same, mine.chosen, theirs.chosen),
                        rejected: where_same(same, mine.rejected, theirs.rejected),
                        ..theirs
                    },
                    None => theirs,
                }
            })
        });
        let nll = loss.nll().map(|span| {
            scope("nll", || match span {
                NllSpan::Completion => -mean((mine.chosen.sum(&[0]), mine.chosen_tokens.sum(&[0]))),
                NllSpan::WholeRow => chosen_nll(tokens.logps, i["segment_ids"], pairs),
            })
        });
        let out = scope("loss", || loss.compute(mine, theirs, nll));
        let mut o = Outputs::new().add("loss", out.loss);
        for (name, t) in out.metrics {
            o = o.add(name, t);
        }
        scope("metrics", || token_metrics(o, loss, &tokens, maskf, pairs))
    })?;
    Ok(f)
}

/// Each pair's summed log-probabilities and token counts, from `logps`
/// (`[2P, seq]`) under the loss mask `maskf`: rows `0..P` chosen, `P..2P`
/// rejected.
fn pair_sums(logps: Tensor, maskf: Tensor, pairs: i64) -> PairLogps {
    let (sum, count) = ((logps * maskf).sum(&[1]), maskf.sum(&[1]));
    let (half, all) = ([pairs], [2 * pairs]);
    PairLogps {
        chosen: sum.slice(&[0], &half),
        rejected: sum.slice(&half, &all),
        chosen_tokens: count.slice(&[0], &half),
        rejected_tokens: count.slice(&half, &all),
    }
}

/// A preference loss's inputs (the step's, and ORPO's real-token mask),
/// and the reference its step runs (the base where the loss compares with
/// none: then nothing of it is traced).
fn preference_inputs(
    config: &ModelConfig,
    tc: &TrainConfig,
    preference: &Preference,
) -> Result<(Vec<(String, TensorType)>, Reference), ModelError> {
    let loss = &preference.loss;
    let (_, _, mut inputs) = loss_inputs(config, tc)?;
    // ORPO's real-token mask (among the batch fields already when `tc`
    // names this loss).
    let segment_ids = BatchField::SegmentIds.name();
    if loss.nll() == Some(NllSpan::WholeRow) && inputs.iter().all(|(n, _)| n != segment_ids) {
        let ty = TensorType::new(DType::I32, [tc.batch, tc.seq]);
        inputs.push((segment_ids.into(), ty));
    }
    let reference = match loss.needs_reference() {
        true => preference.reference,
        false => Reference::Base,
    };
    Ok((inputs, reference))
}

/// `o` with the token statistics each TRL trainer logs: `logits/chosen`
/// and `logits/rejected` ([`logits_means`]); DPOTrainer's `entropy` over
/// every completion token and `mean_token_accuracy` over the chosen
/// ones.
fn token_metrics(
    o: Outputs,
    loss: &PreferenceLoss,
    tokens: &TokenStats,
    mask: Tensor,
    pairs: i64,
) -> Outputs {
    let (chosen, rejected) = logits_means(loss, tokens.mean_logit, mask, pairs);
    let o = o
        .add("logits/chosen", chosen)
        .add("logits/rejected", rejected);
    if !loss.needs_reference() {
        return o;
    }
    let seq = mask.dims()[1];
    let chosen = |t: Tensor| t.slice(&[0, 0], &[pairs, seq]);
    let masked = |t: Tensor, m: Tensor| mean(((t * m).sum(&[0, 1]), m.sum(&[0, 1])));
    o.add("entropy", masked(tokens.entropy, mask)).add(
        "mean_token_accuracy",
        masked(chosen(tokens.top1), chosen(mask)),
    )
}

/// The pooled negative log-likelihood of the chosen rows (`0..pairs`)
/// over every real token after the first (`segment_ids` > 0), as ORPO's,
/// from each position's next-token log-probability `logps: [rows, s]`.
fn chosen_nll(logps: Tensor, segment_ids: Tensor, pairs: i64) -> Tensor {
    let d = segment_ids.dims();
    let s = d[1];
    let rows = |t: Tensor| t.slice(&[0, 0], &[pairs, s]);
    // Position t predicts token t + 1: counted when that token is real.
    let real = segment_ids
        .gt(segment_ids.scalar_like(0.0))
        .cast(DType::F32);
    let next = Tensor::concat(
        &[
            real.slice(&[0, 1], &[d[0], s]),
            full(TensorType::new(DType::F32, [d[0], 1]), 0.0),
        ],
        1,
    );
    let (m, lp) = (rows(next), rows(logps));
    -mean(((lp * m).sum(&[0, 1]), m.sum(&[0, 1])))
}

/// `logits/chosen` and `logits/rejected` as each TRL trainer logs them,
/// from each position's mean logit over the vocabulary (`[rows, s]`):
/// DPO's and IPO's the mean of the positions scoring completion tokens
/// (token-weighted over the batch); CPO's (SimPO) the mean over the
/// half's every position, padding included; ORPO's the same less each
/// row's last position.
fn logits_means(
    loss: &PreferenceLoss,
    mean_logit: Tensor,
    mask: Tensor,
    pairs: i64,
) -> (Tensor, Tensor) {
    let s = mean_logit.dims()[1];
    let half = |k: i64, t: Tensor, cols: i64| t.slice(&[k * pairs, 0], &[(k + 1) * pairs, cols]);
    let mean_of = |k: i64| match loss {
        PreferenceLoss::Dpo { .. } | PreferenceLoss::Ipo { .. } => {
            let m = half(k, mask, s);
            let n = m.sum(&[0, 1]);
            (half(k, mean_logit, s) * m).sum(&[0, 1]) / n.maximum(n.scalar_like(1.0))
        }
        PreferenceLoss::Simpo { .. } | PreferenceLoss::Cpo(_) => {
            half(k, mean_logit, s).mean(&[0, 1])
        }
        PreferenceLoss::Orpo { .. } => half(k, mean_logit, s - 1).mean(&[0, 1]),
    };
    (mean_of(0), mean_of(1))
}

/// The preference train step ([`preference_loss`] under `loss`, against
/// `reference`, then the same clipping, schedule and optimizer as
/// [`train_step`]): inputs are the loss's (weights, LoRA tensors, the
/// pair batch, the reference adapter's `ref.` tensors), the optimizer
/// state and the step counter; outputs `loss`, `grad_norm`, `lr`, the
/// loss's metrics by TRL's names, then the updated state. One
/// micro-batch per step.
pub fn preference_train_step(
    config: &ModelConfig,
    tc: &TrainConfig,
    preference: &Preference,
) -> Result<Step, ModelError> {
    if tc.grad_accum > 1 {
        return Err(ModelError::PreferenceBatch {
            rows: tc.rows(),
            packed: tc.packing,
        });
    }
    let loss_fn = preference_loss(config, tc, preference)?;
    step_around(config, tc, &loss_fn)
}

impl StepLoss for Preference {
    fn name(&self) -> Option<&'static str> {
        Some(self.loss.name())
    }

    fn batch_fields(&self, fields: &mut Vec<BatchField>) {
        // ORPO's likelihood term counts each row's real tokens.
        if self.loss.nll() == Some(NllSpan::WholeRow) {
            fields.push(BatchField::SegmentIds);
        }
        if self.reference() == Some(Reference::Precomputed) {
            fields.push(BatchField::RefLogps);
        }
    }

    fn train_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        preference_train_step(config, tc, self)
    }

    /// The loss and its metrics, as the train step logs them.
    fn eval_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        let function = preference_loss(config, tc, self)?;
        Ok(Step::new(function, role_of(tc)))
    }

    fn rows_per_example(&self) -> i64 {
        2
    }

    fn reference(&self) -> Option<Reference> {
        self.loss.needs_reference().then_some(self.reference)
    }
}
