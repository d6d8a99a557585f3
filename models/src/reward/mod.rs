//! Reward models, as TRL 1.16's `RewardTrainer` trains them: a sequence
//! classifier with one label (`<Family>ForSequenceClassification`, its
//! `score` head on the last token that is not padding) scores both
//! completions of a preference pair, and the Bradley–Terry loss
//! `−log σ(r_chosen − r_rejected − margin)` (mean over the pairs), plus
//! `center_rewards_coefficient · mean((r_chosen + r_rejected)²)` where
//! set, teaches it to score the chosen one higher. The metrics are TRL's,
//! by its names.

pub mod step;

use hlo_ir::{DType, Tensor};

use crate::preference::log_sigmoid;

/// The loss's settings (TRL 1.16's: no centring). Each pair's margin is
/// read from the batch (0 where the data gives none: the same loss).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RewardLoss {
    /// The weight of the mean squared sum of a pair's rewards
    /// (`center_rewards_coefficient`; None: not added).
    pub center_rewards_coefficient: Option<f64>,
}

impl RewardLoss {
    /// The loss and TRL's metrics of `rewards` (`[2B]` f32: the pairs'
    /// chosen completions, then their rejected ones) with each pair's
    /// `margin` (`[B]`).
    pub fn compute(
        &self,
        rewards: Tensor,
        margin: Tensor,
    ) -> (Tensor, Vec<(&'static str, Tensor)>) {
        let b = rewards.dims()[0] / 2;
        let chosen = rewards.slice(&[0], &[b]);
        let rejected = rewards.slice(&[b], &[2 * b]);
        let diff = chosen - rejected;
        let z = diff - margin;
        let pairs = b as f64;
        let mut loss = -log_sigmoid(z).sum(&[0]) / pairs;
        if let Some(c) = self.center_rewards_coefficient {
            let sum = chosen + rejected;
            loss = loss + (sum * sum).sum(&[0]) / pairs * c;
        }
        let r = rewards.stop_gradient();
        let d = diff.stop_gradient();
        let won = d.gt(d.scalar_like(0.0)).cast(DType::F32);
        let metrics = vec![
            ("accuracy", won.sum(&[0]) / pairs),
            ("margin", d.sum(&[0]) / pairs),
            ("min_reward", r.min(&[0])),
            ("mean_reward", r.sum(&[0]) / (2.0 * pairs)),
            ("max_reward", r.max(&[0])),
        ];
        (loss, metrics)
    }
}
