//! Group Relative Policy Optimization, as TRL 1.16's `GRPOTrainer`
//! computes its loss: each completion's advantage (its reward less its
//! group's mean, scaled, computed on the host: [`advantages`]) weighs the
//! clipped importance ratio of every completion token, plus an optional
//! KL penalty to a reference model, normalised by one of four
//! `loss_type`s. The metrics are those TRL logs from the loss, by its
//! names.

pub mod step;

use hlo_ir::{DType, Tensor};

use crate::loss::mean;

/// How the per-token losses are pooled (TRL's `loss_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrpoLossType {
    /// Each completion's token mean, then the mean over completions.
    Grpo,
    /// The sum over every completion token, over (completions ×
    /// `max_completion_length`): Dr. GRPO's constant normaliser.
    DrGrpo,
    /// The sum over every completion token, over the completion tokens of
    /// the whole generation batch (TRL 1.16's default).
    Dapo,
    /// The sum over every completion token, over this batch's completion
    /// tokens.
    Bnpo,
    /// CISPO: each token's log-probability weighted by its importance
    /// ratio clipped above at `epsilon_high` (without gradient) and its
    /// advantage; pooled as `dapo`.
    Cispo,
    /// SAPO: a soft gate of the ratio, `σ(τ (r − 1)) · 4 / τ`, with τ
    /// the positive or the negative temperature by the advantage's sign;
    /// pooled as `grpo`.
    Sapo,
}

impl GrpoLossType {
    pub const ALL: [GrpoLossType; 6] = [
        GrpoLossType::Grpo,
        GrpoLossType::DrGrpo,
        GrpoLossType::Dapo,
        GrpoLossType::Bnpo,
        GrpoLossType::Cispo,
        GrpoLossType::Sapo,
    ];

    /// The name, as `--loss-type` and TRL spell it.
    pub fn name(self) -> &'static str {
        match self {
            GrpoLossType::Grpo => "grpo",
            GrpoLossType::DrGrpo => "dr_grpo",
            GrpoLossType::Dapo => "dapo",
            GrpoLossType::Bnpo => "bnpo",
            GrpoLossType::Cispo => "cispo",
            GrpoLossType::Sapo => "sapo",
        }
    }

    pub fn parse(s: &str) -> Option<GrpoLossType> {
        GrpoLossType::ALL.into_iter().find(|t| t.name() == s)
    }
}

/// Where the importance ratio is taken (TRL's `importance_sampling_level`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportanceSampling {
    /// Each token's own ratio.
    Token,
    /// One ratio a completion, the exponent of its tokens' mean log-ratio
    /// (GSPO).
    Sequence,
}

impl ImportanceSampling {
    pub const ALL: [ImportanceSampling; 2] =
        [ImportanceSampling::Token, ImportanceSampling::Sequence];

    /// The name, as TRL spells it.
    pub fn name(self) -> &'static str {
        match self {
            ImportanceSampling::Token => "token",
            ImportanceSampling::Sequence => "sequence",
        }
    }
}

/// How rewards become advantages (TRL's `scale_rewards`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleRewards {
    /// Divided by the group's standard deviation (+1e-4).
    Group,
    /// Divided by the whole batch's standard deviation (+1e-4).
    Batch,
    /// Not divided.
    None,
}

impl ScaleRewards {
    pub const ALL: [ScaleRewards; 3] =
        [ScaleRewards::Group, ScaleRewards::Batch, ScaleRewards::None];

    pub fn name(self) -> &'static str {
        match self {
            ScaleRewards::Group => "group",
            ScaleRewards::Batch => "batch",
            ScaleRewards::None => "none",
        }
    }

    pub fn parse(s: &str) -> Option<ScaleRewards> {
        ScaleRewards::ALL.into_iter().find(|t| t.name() == s)
    }
}

/// The loss's settings (TRL 1.16's names and defaults: `dapo`, β 0, ε 0.2,
/// ε_high = ε, temperature 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrpoLoss {
    pub loss_type: GrpoLossType,
    /// The KL penalty's weight (0: no reference model).
    pub beta: f64,
    /// The ratio is clipped to `[1 − epsilon, 1 + epsilon_high]`.
    pub epsilon: f64,
    pub epsilon_high: f64,
    /// The sampling temperature: the logits are divided by it before the
    /// log-probabilities are taken, as TRL does.
    pub temperature: f64,
    /// `dr_grpo`'s normaliser (tokens per completion).
    pub max_completion_length: i64,
    /// Rollouts are reused (`num_iterations` > 1): the ratio's
    /// denominator is read from the batch (`old_logps`, the policy's
    /// log-probabilities when the rollouts were made) rather than being
    /// the current ones without gradient.
    pub old_logps: bool,
    /// Token or sequence ratios (GSPO).
    pub importance_sampling: ImportanceSampling,
    /// The KL estimate weighted by the importance ratio (with its
    /// gradient): TRL's `use_bias_correction_kl`, true by default.
    pub bias_correction_kl: bool,
    /// SAPO's temperatures for a positive and a non-positive advantage
    /// (1.0 and 1.05).
    pub sapo_temperature_pos: f64,
    pub sapo_temperature_neg: f64,
}

impl Default for GrpoLoss {
    fn default() -> Self {
        GrpoLoss {
            loss_type: GrpoLossType::Dapo,
            beta: 0.0,
            epsilon: 0.2,
            epsilon_high: 0.2,
            temperature: 1.0,
            max_completion_length: 256,
            old_logps: false,
            importance_sampling: ImportanceSampling::Token,
            bias_correction_kl: true,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
        }
    }
}

/// The step's loss and the metrics TRL logs from the loss, each a scalar.
pub struct GrpoOutputs {
    pub loss: Tensor,
    pub metrics: Vec<(&'static str, Tensor)>,
}

/// The per-token inputs of [`GrpoLoss::compute`], each `[rows, seq]` f32
/// aligned as the loss mask is (position `t` holds token `t + 1`'s
/// value), and the advantages `[rows]`.
pub struct GrpoTokens {
    /// The policy's log-probabilities (with gradient).
    pub logps: Tensor,
    /// 1 on completion tokens (the mask after the first EOS is 0).
    pub mask: Tensor,
    pub advantages: Tensor,
    /// The policy's log-probabilities when the rollouts were made.
    pub old_logps: Option<Tensor>,
    /// The reference's log-probabilities (when `beta` is not 0).
    pub ref_logps: Option<Tensor>,
    /// The entropy of each position's next-token distribution.
    pub entropy: Tensor,
}

impl GrpoLoss {
    /// The loss and metrics of `t`.
    pub fn compute(&self, t: GrpoTokens) -> GrpoOutputs {
        let d = t.logps.dims();
        let rows = d[0];
        let zero = t.logps.scalar_like(0.0);
        let mask = t.mask;
        let on = mask.gt(zero);
        let masked = |x: Tensor| on.where_(x, zero);
        let old = match t.old_logps {
            Some(o) if self.old_logps => o,
            _ => t.logps.stop_gradient(),
        };
        let n = mask.sum(&[1]);
        let per_row_mean = |x: Tensor| (x * mask).sum(&[1]) / n.maximum(n.scalar_like(1.0));
        let coef_1 = match self.importance_sampling {
            ImportanceSampling::Token => masked(t.logps - old).exp(),
            ImportanceSampling::Sequence => per_row_mean(masked(t.logps - old))
                .exp()
                .broadcast_in_dim(&d, &[0]),
        };
        let adv = t.advantages.broadcast_in_dim(&d, &[0]);
        let mut per_token = self.policy_term(coef_1, adv, t.logps);
        let kl = (self.beta != 0.0).then(|| {
            let r = t
                .ref_logps
                .expect("a KL penalty reads the reference's log-probs");
            let diff = masked(r - t.logps);
            let kl = diff.exp() - diff - 1.0;
            // TRL's `use_bias_correction_kl` (its default): the estimate
            // weighted by the importance ratio (with its gradient).
            match self.bias_correction_kl {
                true => kl * coef_1,
                false => kl,
            }
        });
        if let Some(kl) = kl {
            per_token = per_token + kl * self.beta;
        }
        let total = |x: Tensor| (masked(x) * mask).sum(&[0, 1]);
        let tokens = mask.sum(&[0, 1]);
        let loss = match self.loss_type {
            GrpoLossType::Grpo | GrpoLossType::Sapo => {
                per_row_mean(masked(per_token)).sum(&[0]) / rows as f64
            }
            GrpoLossType::DrGrpo => total(per_token) / (rows * self.max_completion_length) as f64,
            GrpoLossType::Dapo | GrpoLossType::Bnpo | GrpoLossType::Cispo => {
                mean((total(per_token), tokens))
            }
        };
        // Metrics: token means over the batch, and per-row extremes.
        let token_mean = |x: Tensor| mean((total(x.stop_gradient()), tokens));
        let mut metrics = Vec::new();
        if let Some(kl) = kl {
            metrics.push(("kl", token_mean(kl)));
        }
        metrics.push(("entropy", token_mean(t.entropy)));
        metrics.extend(self.clip_metrics(coef_1.stop_gradient(), &t.advantages, mask));
        GrpoOutputs { loss, metrics }
    }

    /// Each token's policy term (before the KL penalty) under the loss
    /// type, from the importance ratio `coef_1` and the advantages `adv`
    /// (both `[rows, seq]`).
    fn policy_term(&self, coef_1: Tensor, adv: Tensor, logps: Tensor) -> Tensor {
        match self.loss_type {
            GrpoLossType::Cispo => {
                let clamped = coef_1.minimum(coef_1.scalar_like(self.epsilon_high));
                -(clamped.stop_gradient() * adv * logps)
            }
            GrpoLossType::Sapo => {
                let pos = adv.gt(adv.scalar_like(0.0));
                let tau = pos.where_(
                    adv.scalar_like(self.sapo_temperature_pos)
                        .broadcast_to(&adv.dims()),
                    adv.scalar_like(self.sapo_temperature_neg)
                        .broadcast_to(&adv.dims()),
                );
                let soft = ((coef_1 - 1.0) * tau).logistic() * 4.0 / tau;
                -(soft * adv)
            }
            _ => {
                let coef_2 = coef_1
                    .maximum(coef_1.scalar_like(1.0 - self.epsilon))
                    .minimum(coef_1.scalar_like(1.0 + self.epsilon_high));
                -(coef_1 * adv).minimum(coef_2 * adv)
            }
        }
    }

    /// The clipping metrics TRL logs for the loss type (`c`: the ratio
    /// without gradient, `[rows, seq]`): the clipped shares for the
    /// clipped losses, CISPO's `cispo_clip_ratio`, none for SAPO. With
    /// sequence ratios a share is over completions, not tokens.
    fn clip_metrics(
        &self,
        c: Tensor,
        advantages: &Tensor,
        mask: Tensor,
    ) -> Vec<(&'static str, Tensor)> {
        let d = c.dims();
        let zero = c.scalar_like(0.0);
        let a = advantages.stop_gradient().broadcast_in_dim(&d, &[0]);
        let f32_of = |b: Tensor| b.cast(DType::F32);
        let n = mask.sum(&[1]);
        let has = n.gt(n.scalar_like(0.0));
        // Per row: the share of its tokens clipped (with sequence ratios,
        // the row's own value).
        let row_share = |x: Tensor| (x * mask).sum(&[1]) / n.maximum(n.scalar_like(1.0));
        let global = |x: Tensor| match self.importance_sampling {
            ImportanceSampling::Token => mean(((x * mask).sum(&[0, 1]), mask.sum(&[0, 1]))),
            ImportanceSampling::Sequence => row_share(x).sum(&[0]) / d[0] as f64,
        };
        let high = f32_of(c.gt(c.scalar_like(1.0 + self.epsilon_high)).and(a.gt(zero)));
        match self.loss_type {
            GrpoLossType::Sapo => return Vec::new(),
            GrpoLossType::Cispo => {
                let clipped = f32_of(c.gt(c.scalar_like(self.epsilon_high)).and(a.gt(zero)));
                return vec![("cispo_clip_ratio", global(clipped))];
            }
            _ => {}
        }
        let low = f32_of(c.lt(c.scalar_like(1.0 - self.epsilon)).and(a.lt(zero)));
        let region = f32_of(
            c.lt(c.scalar_like(1.0 - self.epsilon))
                .and(a.lt(zero))
                .or(c.gt(c.scalar_like(1.0 + self.epsilon_high)).and(a.gt(zero))),
        );
        // Rows without tokens are left out of the min and max, as TRL's
        // nanmin/nanmax do.
        let low_min = has
            .where_(row_share(low), n.scalar_like(f64::INFINITY))
            .min(&[0]);
        let high_max = has
            .where_(row_share(high), n.scalar_like(f64::NEG_INFINITY))
            .max(&[0]);
        vec![
            ("clip_ratio/low_mean", global(low)),
            ("clip_ratio/low_min", low_min),
            ("clip_ratio/high_mean", global(high)),
            ("clip_ratio/high_max", high_max),
            ("clip_ratio/region_mean", global(region)),
        ]
    }
}

/// Advantages of `rewards` (one per completion; consecutive groups of
/// `group` completions of one prompt), as TRL 1.16 computes them: the
/// reward less its group's mean, divided (unless `scale` is `None`) by the
/// group's or the batch's unbiased standard deviation plus 1e-4. Also
/// returns, per completion, whether that deviation is zero (TRL's
/// `frac_reward_zero_std` is their share).
pub fn advantages(rewards: &[f64], group: usize, scale: ScaleRewards) -> (Vec<f64>, Vec<bool>) {
    let group = group.max(1);
    let std = |x: &[f64]| {
        let n = x.len() as f64;
        if x.len() < 2 {
            return 0.0;
        }
        let m = x.iter().sum::<f64>() / n;
        (x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1.0)).sqrt()
    };
    let batch_std = std(rewards);
    let mut adv = Vec::with_capacity(rewards.len());
    let mut zero = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group) {
        let m = g.iter().sum::<f64>() / g.len() as f64;
        let s = match scale {
            ScaleRewards::Batch => batch_std,
            _ => std(g),
        };
        for r in g {
            let a = r - m;
            adv.push(match scale {
                ScaleRewards::None => a,
                _ => a / (s + 1e-4),
            });
            zero.push(s.abs() <= 1e-8);
        }
    }
    (adv, zero)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantages_are_normalised_per_group_with_an_unbiased_std() {
        let (a, zero) = advantages(&[1.0, 0.0, 0.0, 1.0, 2.0, 2.0], 3, ScaleRewards::Group);
        // Group 1: mean 1/3, std sqrt(((2/3)² + 2·(1/3)²)/2) = sqrt(1/3).
        let s = (1.0f64 / 3.0).sqrt() + 1e-4;
        assert!((a[0] - (2.0 / 3.0) / s).abs() < 1e-12);
        assert!((a[1] + (1.0 / 3.0) / s).abs() < 1e-12);
        assert_eq!(zero, vec![false; 6]);
        let (a, zero) = advantages(&[3.0, 3.0, 1.0, 2.0], 2, ScaleRewards::None);
        assert_eq!(a, vec![0.0, 0.0, -0.5, 0.5]);
        assert_eq!(zero, vec![true, true, false, false]);
        let (b, _) = advantages(&[3.0, 3.0, 1.0, 2.0], 2, ScaleRewards::Batch);
        // Batch std of [3, 3, 1, 2]: mean 2.25, unbiased var 0.9167.
        let s = (2.75f64 / 3.0).sqrt() + 1e-4;
        assert!((b[2] + 0.5 / s).abs() < 1e-12);
    }

    #[test]
    fn loss_types_parse_by_trl_names() {
        for t in GrpoLossType::ALL {
            assert_eq!(GrpoLossType::parse(t.name()), Some(t));
        }
        // TRL 1.16's vespo and luspo are not built.
        assert_eq!(GrpoLossType::parse("vespo"), None);
    }
}
