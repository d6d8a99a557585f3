//! REINFORCE Leave-One-Out, as TRL 1.16's `RLOOTrainer` computes its
//! loss: each completion's advantage (its reward, less the KL penalty,
//! less the mean reward of the other completions of its prompt: computed
//! on the host, [`leave_one_out`]) weighs the clipped importance ratio of
//! the whole sequence (the exponent of its summed log-ratio), and the
//! loss is the mean over sequences. The metrics are those TRL logs from
//! the loss, by its names.

pub mod step;

use hlo_ir::{DType, Tensor};

/// The loss's settings (TRL 1.16's names and defaults: ε 0.2, ε_high =
/// ε, temperature 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RlooLoss {
    /// The sequence ratio is clipped to `[1 − epsilon, 1 + epsilon_high]`.
    pub epsilon: f64,
    pub epsilon_high: f64,
    /// The sampling temperature: the logits are divided by it before the
    /// log-probabilities are taken, as TRL does.
    pub temperature: f64,
    /// Rollouts are reused (`num_iterations` > 1): the ratio's
    /// denominator is read from the batch (`old_logps`) rather than being
    /// the current log-probabilities without gradient.
    pub old_logps: bool,
}

impl Default for RlooLoss {
    fn default() -> Self {
        RlooLoss {
            epsilon: 0.2,
            epsilon_high: 0.2,
            temperature: 1.0,
            old_logps: false,
        }
    }
}

/// The per-token inputs of [`RlooLoss::compute`], each `[rows, seq]` f32
/// aligned as the loss mask is, and the advantages `[rows]`.
pub struct RlooTokens {
    /// The policy's log-probabilities (with gradient).
    pub logps: Tensor,
    /// 1 on completion tokens.
    pub mask: Tensor,
    pub advantages: Tensor,
    /// The policy's per-token log-probabilities when the rollouts were
    /// made (read where [`RlooLoss::old_logps`]).
    pub old_logps: Option<Tensor>,
    /// The entropy of each position's next-token distribution.
    pub entropy: Tensor,
}

impl RlooLoss {
    /// The loss and TRL's metrics of `t`: `entropy` and the clipped
    /// shares of sequences.
    pub fn compute(&self, t: RlooTokens) -> (Tensor, Vec<(&'static str, Tensor)>) {
        let rows = t.logps.dims()[0] as f64;
        let zero = t.logps.scalar_like(0.0);
        let on = t.mask.gt(zero);
        let masked = |x: Tensor| on.where_(x, zero);
        let old = match t.old_logps {
            Some(o) if self.old_logps => o,
            _ => t.logps.stop_gradient(),
        };
        // One ratio a sequence: its tokens' log-probabilities summed.
        let log_ratio = (masked(t.logps) - masked(old)).sum(&[1]);
        let coef_1 = log_ratio.exp();
        let coef_2 = coef_1
            .maximum(coef_1.scalar_like(1.0 - self.epsilon))
            .minimum(coef_1.scalar_like(1.0 + self.epsilon_high));
        let a = t.advantages;
        let per_sequence = -(coef_1 * a).minimum(coef_2 * a);
        let loss = per_sequence.sum(&[0]) / rows;
        let tokens = t.mask.sum(&[0, 1]);
        let entropy = (masked(t.entropy.stop_gradient()) * t.mask).sum(&[0, 1])
            / tokens.maximum(tokens.scalar_like(1.0));
        let mut metrics = vec![("entropy", entropy)];
        metrics.extend(self.clip_metrics(coef_1.stop_gradient(), a.stop_gradient()));
        (loss, metrics)
    }

    /// The shares of sequences whose ratio `c` is clipped below (with a
    /// negative advantage `a`), above (with a positive one), or either;
    /// with the smallest and largest, as TRL logs them.
    fn clip_metrics(&self, c: Tensor, a: Tensor) -> Vec<(&'static str, Tensor)> {
        let rows = c.dims()[0] as f64;
        let zero = a.scalar_like(0.0);
        let low = c.lt(c.scalar_like(1.0 - self.epsilon)).and(a.lt(zero));
        let high = c.gt(c.scalar_like(1.0 + self.epsilon_high)).and(a.gt(zero));
        let region = low.or(high).cast(DType::F32);
        let (low, high) = (low.cast(DType::F32), high.cast(DType::F32));
        let share = |x: Tensor| x.sum(&[0]) / rows;
        vec![
            ("clip_ratio/low_mean", share(low)),
            ("clip_ratio/low_min", low.min(&[0])),
            ("clip_ratio/high_mean", share(high)),
            ("clip_ratio/high_max", high.max(&[0])),
            ("clip_ratio/region_mean", share(region)),
        ]
    }
}

/// How rewards become RLOO's advantages (TRL 1.16's settings).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeaveOneOut {
    /// Completions per prompt, consecutive in the batch.
    pub group: usize,
    /// The KL penalty's weight: each reward less β times its completion's
    /// summed per-token log-ratio of the policy to the reference.
    pub beta: f64,
    /// Rewards clamped to `[min, max]` before the penalty
    /// (`reward_clip_range`).
    pub clip: Option<(f64, f64)>,
    /// The advantages standardised over the batch
    /// (`normalize_advantages`).
    pub normalize: bool,
}

/// RLOO's advantages, with the penalised rewards they came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Advantages {
    pub advantages: Vec<f64>,
    /// Each reward clipped and penalised, as the baselines read them.
    pub rewards: Vec<f64>,
    /// Per completion, whether its group's penalised rewards have a zero
    /// (unbiased) standard deviation: TRL's `frac_reward_zero_std`.
    pub zero_std: Vec<bool>,
}

/// The unbiased standard deviation (0 for fewer than two values).
fn unbiased_std(x: &[f64]) -> f64 {
    if x.len() < 2 {
        return 0.0;
    }
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    (x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1.0)).sqrt()
}

/// Advantages of `rewards` (one per completion; consecutive groups of a
/// prompt) with each completion's summed KL estimate `kl` (empty without
/// the penalty), as TRL 1.16's `RLOOTrainer`: the reward clipped, less
/// β·KL, less the mean of the other completions' of its group; then,
/// with `normalize`, standardised over the batch (unbiased deviation
/// plus 1e-4).
pub fn leave_one_out(rewards: &[f64], kl: &[f64], rule: &LeaveOneOut) -> Advantages {
    let group = rule.group.max(1);
    let penalised: Vec<f64> = rewards
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            let r = match rule.clip {
                Some((lo, hi)) => r.clamp(lo, hi),
                None => r,
            };
            r - rule.beta * kl.get(i).copied().unwrap_or(0.0)
        })
        .collect();
    let mut advantages = Vec::with_capacity(rewards.len());
    let mut zero_std = Vec::with_capacity(rewards.len());
    for g in penalised.chunks(group) {
        let sum: f64 = g.iter().sum();
        let zero = unbiased_std(g).abs() <= 1e-8;
        for &r in g {
            advantages.push(match g.len() {
                1 => 0.0,
                n => r - (sum - r) / (n - 1) as f64,
            });
            zero_std.push(zero);
        }
    }
    if rule.normalize {
        let n = advantages.len().max(1) as f64;
        let m = advantages.iter().sum::<f64>() / n;
        let s = unbiased_std(&advantages) + 1e-4;
        for a in &mut advantages {
            *a = (*a - m) / s;
        }
    }
    Advantages {
        advantages,
        rewards: penalised,
        zero_std,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_baseline_is_the_mean_of_the_others() {
        let rule = LeaveOneOut {
            group: 3,
            beta: 0.0,
            clip: None,
            normalize: false,
        };
        let a = leave_one_out(&[1.0, 0.0, 2.0, 5.0, 5.0, 5.0], &[], &rule);
        assert_eq!(a.advantages, vec![0.0, -1.5, 1.5, 0.0, 0.0, 0.0]);
        assert_eq!(a.zero_std, vec![false, false, false, true, true, true]);
        // The penalty and the clip come first; the baseline sees them.
        let rule = LeaveOneOut {
            beta: 0.5,
            clip: Some((-1.0, 1.0)),
            ..rule
        };
        let a = leave_one_out(&[3.0, 0.0, 1.0], &[2.0, 0.0, -2.0], &rule);
        assert_eq!(a.rewards, vec![0.0, 0.0, 2.0]);
        assert_eq!(a.advantages, vec![-1.0, -1.0, 2.0]);
        let n = leave_one_out(
            &[3.0, 0.0, 1.0],
            &[2.0, 0.0, -2.0],
            &LeaveOneOut {
                normalize: true,
                ..rule
            },
        );
        // Mean 0, unbiased std sqrt(3): each over sqrt(3) + 1e-4.
        let s = 3f64.sqrt() + 1e-4;
        assert!((n.advantages[2] - 2.0 / s).abs() < 1e-12);
    }
}
