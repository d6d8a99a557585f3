//! KTO (TRL 1.16's `KTOTrainer`): unpaired completions, each labelled
//! desirable or undesirable, against a reference model, with the KL
//! term estimated from mismatched prompt/completion pairs. The math, as
//! pure functions of each example's completion log-probability sums;
//! its place in the step is [`step`].
//!
//! With `r = log π(y|x) − log π_ref(y|x)` an example's log-ratio, and
//! `z = max(0, mean over the batch of (log π(y'|x) − log π_ref(y'|x)))`
//! over the KL rows (each prompt with another example's completion),
//! detached:
//!
//! - `kto`: a desirable example's loss is `1 − σ(β (r − z))`, an
//!   undesirable one's `1 − σ(β (z − r))`;
//! - `apo_zero_unpaired`: `1 − σ(β r)` and `σ(β r)`, no KL term (`z` is
//!   reported as 0).
//!
//! The batch's loss is the mean over its examples of
//! `desirable_weight · loss` or `undesirable_weight · loss`. Its metrics
//! (TRL's names): `kl` (`z`), `rewards/chosen` and `logps/chosen` (the
//! desirable examples' mean `β r` and mean completion log-probability),
//! the same `/rejected` for the undesirable ones, `rewards/margins`
//! (their difference). A batch without a desirable (or undesirable)
//! example gives NaN for its means (and the margin), which a run's report
//! leaves out, as TRL leaves them out.

pub mod step;

use hlo_ir::{DType, Tensor};

use crate::loss::mean;

/// The KTO loss types TRL 1.16 has (`KTOConfig.loss_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KtoLossType {
    /// The KTO paper's loss, with the KL estimate.
    Kto,
    /// APO-zero for unpaired data: no KL estimate.
    ApoZeroUnpaired,
}

impl KtoLossType {
    /// TRL's name.
    pub fn name(self) -> &'static str {
        match self {
            KtoLossType::Kto => "kto",
            KtoLossType::ApoZeroUnpaired => "apo_zero_unpaired",
        }
    }
}

/// KTO's loss settings (TRL's defaults: `kto`, β 0.1, weights 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KtoLoss {
    pub loss_type: KtoLossType,
    pub beta: f64,
    pub desirable_weight: f64,
    pub undesirable_weight: f64,
}

impl Default for KtoLoss {
    fn default() -> KtoLoss {
        KtoLoss {
            loss_type: KtoLossType::Kto,
            beta: 0.1,
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
        }
    }
}

/// A batch's completion log-probability sums (`[examples]` f32 each).
pub struct KtoLogps {
    pub policy: Tensor,
    pub reference: Tensor,
    /// The KL rows' sums under the policy (without gradient) and the
    /// reference, where the loss estimates the KL term.
    pub kl: Option<(Tensor, Tensor)>,
    /// 1 for a desirable example, 0 for an undesirable one.
    pub desirable: Tensor,
}

/// The loss and its metrics by TRL's names.
pub struct KtoOutputs {
    pub loss: Tensor,
    pub metrics: Vec<(&'static str, Tensor)>,
}

impl KtoLoss {
    /// Whether the loss estimates the KL term (and so reads KL rows).
    pub(crate) fn estimates_kl(&self) -> bool {
        self.loss_type == KtoLossType::Kto
    }

    /// The loss of a batch and its metrics (see the module's account).
    pub fn compute(&self, l: KtoLogps) -> KtoOutputs {
        let beta = self.beta;
        let r = l.policy - l.reference;
        let zero = r.sum(&[0]).scalar_like(0.0);
        let kl = match &l.kl {
            Some((policy, reference)) => {
                mean_of(*policy - *reference).maximum(zero).stop_gradient()
            }
            None => zero,
        };
        let sigmoid = |x: Tensor| x.logistic();
        let one = |t: Tensor| t.scalar_like(1.0);
        let (chosen, rejected) = match self.loss_type {
            KtoLossType::Kto => (
                one(r) - sigmoid((r - kl.broadcast_to(&r.dims())) * beta),
                one(r) - sigmoid((kl.broadcast_to(&r.dims()) - r) * beta),
            ),
            KtoLossType::ApoZeroUnpaired => (one(r) - sigmoid(r * beta), sigmoid(r * beta)),
        };
        let d = l.desirable;
        let u = one(d) - d;
        let losses = chosen * d * self.desirable_weight + rejected * u * self.undesirable_weight;
        let rewards = r.stop_gradient() * beta;
        let policy = l.policy.stop_gradient();
        // NaN over no example: a mean the batch cannot give, which the
        // step's report leaves out (as TRL leaves it out).
        let over = |x: Tensor, w: Tensor| (x * w).sum(&[0]) / w.sum(&[0]);
        let (rc, rr) = (over(rewards, d), over(rewards, u));
        KtoOutputs {
            loss: mean_of(losses),
            metrics: vec![
                ("kl", kl),
                ("rewards/chosen", rc),
                ("logps/chosen", over(policy, d)),
                ("rewards/rejected", rr),
                ("logps/rejected", over(policy, u)),
                ("rewards/margins", rc - rr),
            ],
        }
    }
}

/// The mean of a `[n]` f32 vector.
fn mean_of(t: Tensor) -> Tensor {
    let n = t.dims()[0] as f64;
    mean((t.cast(DType::F32).sum(&[0]), t.sum(&[0]).scalar_like(n)))
}
