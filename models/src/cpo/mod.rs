//! CPO, Contrastive Preference Optimization, as TRL 1.16's `CPOTrainer`
//! computes it with `loss_type="sigmoid"` (no reference model): per pair,
//! `−(1−ε)·logσ(β·h) − ε·logσ(−β·h)`, `h` the difference of the chosen
//! and the rejected completion's summed log-probabilities, plus
//! `cpo_alpha` times the chosen completions' negative log-likelihood
//! (the behaviour-cloning term; TRL's default 1). Its rewards are β times
//! the summed log-probabilities. SimPO is the same trainer's
//! `loss_type="simpo"` over per-token means ([`crate::preference`]).

use hlo_ir::Tensor;

use crate::preference::{sigmoid_loss, PairLogps};

/// CPO's settings (TRL 1.16's `CPOConfig` names; defaults β 0.1,
/// `label_smoothing` 0, `cpo_alpha` 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpoLoss {
    pub beta: f64,
    pub label_smoothing: f64,
    pub cpo_alpha: f64,
}

/// Each pair's loss before the NLL term, and the chosen and rejected
/// rewards, of one step.
pub struct CpoPairs {
    pub losses: Tensor,
    pub rewards: (Tensor, Tensor),
}

impl CpoLoss {
    /// The per-pair sigmoid loss over `policy`'s summed log-probabilities,
    /// and their rewards.
    pub fn pairs(&self, policy: &PairLogps) -> CpoPairs {
        let h = policy.chosen - policy.rejected;
        CpoPairs {
            losses: sigmoid_loss(h * self.beta, self.label_smoothing),
            rewards: (policy.chosen * self.beta, policy.rejected * self.beta),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hlo_ir::{interpret, trace, DType, Literal, TensorType};

    /// `−(1−ε)·logσ(βh) − ε·logσ(−βh)` and the rewards, on the host in f64.
    #[test]
    fn the_sigmoid_loss_and_rewards_are_of_the_summed_log_probabilities() {
        let (chosen, rejected) = ([-4.0, -9.5, -2.25], [-6.5, -8.0, -7.0]);
        let loss = CpoLoss {
            beta: 0.3,
            label_smoothing: 0.1,
            cpo_alpha: 1.0,
        };
        let ty = TensorType::new(DType::F64, [3]);
        let types = [("c", ty.clone()), ("r", ty.clone()), ("n", ty.clone())];
        let f = trace("cpo", &types, |i| {
            let p = loss.pairs(&PairLogps {
                chosen: i["c"],
                rejected: i["r"],
                chosen_tokens: i["n"],
                rejected_tokens: i["n"],
            });
            hlo_ir::Outputs::new()
                .add("losses", p.losses)
                .add("chosen", p.rewards.0)
                .add("rejected", p.rewards.1)
        })
        .unwrap();
        let lit = |v: &[f64]| Literal::from_f64s(ty.clone(), v);
        let out = interpret(&f, &[lit(&chosen), lit(&rejected), lit(&[1.0; 3])]).unwrap();
        let log_sigmoid = |x: f64| -(1.0 + (-x).exp()).ln();
        for k in 0..3 {
            let z = 0.3 * (chosen[k] - rejected[k]);
            let want = -0.9 * log_sigmoid(z) - 0.1 * log_sigmoid(-z);
            assert!((out[0].to_f64s()[k] - want).abs() < 1e-12, "{k}");
            assert!((out[1].to_f64s()[k] - 0.3 * chosen[k]).abs() < 1e-12);
            assert!((out[2].to_f64s()[k] - 0.3 * rejected[k]).abs() < 1e-12);
        }
    }
}
