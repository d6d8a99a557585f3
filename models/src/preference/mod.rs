//! Preference losses over pairs of completions of one prompt, chosen and
//! rejected, as TRL defines them: DPO (its sigmoid loss) and IPO against a
//! reference model, SimPO and ORPO without one. Each reads the policy's
//! per-row log-probabilities of the completion tokens (sums and token
//! counts of [`crate::loss::TokenStats`]' per-position ones), and for
//! DPO and IPO the reference's; the metrics are those TRL logs, by its
//! names.

pub mod step;

use hlo_ir::Tensor;

use crate::cpo::CpoLoss;

/// A method's loss, with its settings (TRL 1.16's names and defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PreferenceLoss {
    /// Direct Preference Optimization, TRL's `sigmoid` loss:
    /// `−logσ(β·h)`, `h` the policy's log-ratio of chosen over rejected
    /// less the reference's, over summed log-probs. (TRL 1.16 applies no
    /// label smoothing to this loss.)
    Dpo { beta: f64 },
    /// IPO: `(h − 1/(2β))²`, `h` as DPO's with each completion's
    /// log-ratio divided by its token count.
    Ipo { beta: f64 },
    /// SimPO as TRL's `CPOTrainer` computes it (no reference):
    /// `−(1−ε)·logσ(β·m − γ) − ε·logσ(−(β·m − γ))`, `m` the difference of
    /// per-token mean log-probs, plus `cpo_alpha` times the chosen
    /// completions' negative log-likelihood (TRL's default 1.0 makes it
    /// CPO-SimPO; 0 is the paper's SimPO).
    Simpo {
        beta: f64,
        gamma: f64,
        label_smoothing: f64,
        cpo_alpha: f64,
    },
    /// CPO as TRL's `CPOTrainer` computes it with `loss_type="sigmoid"`
    /// (no reference): [`crate::cpo`].
    Cpo(CpoLoss),
    /// ORPO (no reference): the chosen rows' negative log-likelihood less
    /// `beta` (the paper's λ) times `logσ` of the log odds ratio of chosen
    /// over rejected (per-token mean log-probs `p`, odds `p − log(1 − eᵖ)`).
    Orpo { beta: f64 },
}

/// The model a preference loss compares the policy with (DPO, IPO), as
/// TRL chooses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reference {
    /// The base with the adapter off: a fresh adapter's starting policy.
    Base,
    /// A frozen adapter of the policy's shapes, read from inputs named
    /// `ref.<LoRA tensor>`: a copy of the adapter training starts from, or
    /// another one.
    Adapter,
    /// The reference's summed log-probabilities of each row, computed once
    /// before training ([`crate::train::reference_logps_step`]) and read
    /// from the batch (`ref_logps`): no reference forward in the step.
    Precomputed,
}

/// The name of the reference adapter's copy of LoRA tensor `name`.
pub fn reference_name(name: &str) -> String {
    format!("{REFERENCE_PREFIX}{name}")
}

/// The LoRA tensor whose reference copy `name` is, if it is one.
///
/// ```
/// use hlo_models::preference::{reference_name, reference_of};
/// let name = "model.layers.0.self_attn.q_proj.lora_a";
/// assert_eq!(reference_of(&reference_name(name)), Some(name));
/// assert_eq!(reference_of(name), None);
/// ```
pub fn reference_of(name: &str) -> Option<&str> {
    name.strip_prefix(REFERENCE_PREFIX)
}

const REFERENCE_PREFIX: &str = "ref.";

/// Per pair (`[pairs]`, f32): the chosen and the rejected completion's
/// summed log-probabilities and token counts.
#[derive(Clone, Copy, Debug)]
pub struct PairLogps {
    pub chosen: Tensor,
    pub rejected: Tensor,
    pub chosen_tokens: Tensor,
    pub rejected_tokens: Tensor,
}

impl PairLogps {
    /// Per-token means (a completion of no tokens counts as one).
    pub fn means(&self) -> (Tensor, Tensor) {
        (
            crate::loss::mean((self.chosen, self.chosen_tokens)),
            crate::loss::mean((self.rejected, self.rejected_tokens)),
        )
    }
}

/// A step's loss (the mean over its pairs) and the metrics TRL logs with
/// it, each a scalar.
pub struct PreferenceOutputs {
    pub loss: Tensor,
    pub metrics: Vec<(&'static str, Tensor)>,
}

/// `log σ(x)`, without overflow: `min(x, 0) − log(1 + e^−|x|)`.
pub(crate) fn log_sigmoid(x: Tensor) -> Tensor {
    x.minimum(x.scalar_like(0.0)) - (-x.abs()).exp().log1p()
}

/// The mean over the pairs that hold a chosen completion (`valid`, 1 or
/// 0 per pair): a held-out set's last batch is filled with empty pairs,
/// which count nothing (and whose values, log(0) among them, are never
/// read).
fn masked_mean(x: Tensor, valid: Tensor) -> Tensor {
    let kept = valid.where_(x, x.scalar_like(0.0));
    crate::loss::mean((kept.sum(&[0]), valid.cast(x.dtype()).sum(&[0])))
}

/// The smoothed sigmoid loss of `z` per pair.
pub(crate) fn sigmoid_loss(z: Tensor, label_smoothing: f64) -> Tensor {
    let loss = -log_sigmoid(z);
    if label_smoothing == 0.0 {
        return loss;
    }
    loss * (1.0 - label_smoothing) - log_sigmoid(-z) * label_smoothing
}

impl PreferenceLoss {
    /// The method's name, as `--objective` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            PreferenceLoss::Dpo { .. } => "dpo",
            PreferenceLoss::Ipo { .. } => "ipo",
            PreferenceLoss::Simpo { .. } => "simpo",
            PreferenceLoss::Cpo(_) => "cpo",
            PreferenceLoss::Orpo { .. } => "orpo",
        }
    }

    /// Whether the loss compares with a reference model's log-probs.
    pub fn needs_reference(&self) -> bool {
        matches!(
            self,
            PreferenceLoss::Dpo { .. } | PreferenceLoss::Ipo { .. }
        )
    }

    /// Whether the loss adds the chosen rows' negative log-likelihood:
    /// over their completions (SimPO with `cpo_alpha`) or over every
    /// token but the first (ORPO).
    pub fn nll(&self) -> Option<NllSpan> {
        match *self {
            PreferenceLoss::Simpo { cpo_alpha, .. }
            | PreferenceLoss::Cpo(CpoLoss { cpo_alpha, .. })
                if cpo_alpha != 0.0 =>
            {
                Some(NllSpan::Completion)
            }
            PreferenceLoss::Orpo { .. } => Some(NllSpan::WholeRow),
            _ => None,
        }
    }

    /// The loss of `policy` (against `reference`'s log-probs, which must
    /// be given when [`Self::needs_reference`]; and the chosen rows'
    /// pooled negative log-likelihood `nll` where [`Self::nll`] asks for
    /// it) and its metrics. The reference and every metric carry no
    /// gradient.
    pub fn compute(
        &self,
        policy: PairLogps,
        reference: Option<PairLogps>,
        nll: Option<Tensor>,
    ) -> PreferenceOutputs {
        let valid = policy
            .chosen_tokens
            .gt(policy.chosen_tokens.scalar_like(0.0));
        let mean = |x: Tensor| masked_mean(x, valid);
        let (losses, (chosen_rewards, rejected_rewards), logged, mut extra) =
            self.terms(policy, reference, nll, &mean);
        let (c, r) = (
            chosen_rewards.stop_gradient(),
            rejected_rewards.stop_gradient(),
        );
        let mut metrics = vec![
            ("rewards/chosen", mean(c)),
            ("rewards/rejected", mean(r)),
            ("rewards/accuracies", mean(c.gt(r).cast(c.dtype()))),
            ("rewards/margins", mean(c - r)),
            ("logps/chosen", mean(logged.0.stop_gradient())),
            ("logps/rejected", mean(logged.1.stop_gradient())),
            // Not TRL's: the share of pairs whose chosen completion the
            // policy itself finds likelier (by the log-probs above), which
            // a held-out set reads before training too (the rewards are
            // all 0 then).
            (
                "logps/accuracies",
                mean(logged.0.gt(logged.1).cast(c.dtype()).stop_gradient()),
            ),
        ];
        for (_, t) in extra.iter_mut() {
            *t = t.stop_gradient();
        }
        metrics.extend(extra);
        PreferenceOutputs {
            loss: mean(losses),
            metrics,
        }
    }

    /// The method's per-pair losses, the chosen and rejected rewards (what
    /// each completion's log-prob gained, scaled), the log-probs it logs
    /// (the ones the loss reads: sums or means) and its own metrics.
    fn terms(
        &self,
        policy: PairLogps,
        reference: Option<PairLogps>,
        nll: Option<Tensor>,
        mean: &dyn Fn(Tensor) -> Tensor,
    ) -> PairTerms {
        let (pc, pr) = policy.means();
        let sums = (policy.chosen, policy.rejected);
        match *self {
            PreferenceLoss::Dpo { beta } | PreferenceLoss::Ipo { beta } => {
                let r = reference.expect("DPO and IPO compare with a reference");
                let (rc, rr) = (r.chosen.stop_gradient(), r.rejected.stop_gradient());
                let losses = if let PreferenceLoss::Ipo { .. } = self {
                    let (mc, mr) = r.means();
                    let h = (pc - mc.stop_gradient()) - (pr - mr.stop_gradient());
                    let d = h - 1.0 / (2.0 * beta);
                    d * d
                } else {
                    -log_sigmoid(((policy.chosen - rc) - (policy.rejected - rr)) * beta)
                };
                // IPO's rewards too are of the sums, as TRL logs them.
                let rewards = ((policy.chosen - rc) * beta, (policy.rejected - rr) * beta);
                (losses, rewards, sums, vec![])
            }
            PreferenceLoss::Simpo {
                beta,
                gamma,
                label_smoothing,
                cpo_alpha,
            } => {
                let mut losses = sigmoid_loss((pc - pr) * beta - gamma, label_smoothing);
                let nll = match nll {
                    Some(n) if cpo_alpha != 0.0 => {
                        losses = losses + n * cpo_alpha;
                        n
                    }
                    _ => pc.sum(&[0]).scalar_like(0.0),
                };
                (
                    losses,
                    (pc * beta, pr * beta),
                    (pc, pr),
                    vec![("nll_loss", nll)],
                )
            }
            PreferenceLoss::Cpo(cpo) => {
                let pairs = cpo.pairs(&policy);
                let nll = match nll {
                    Some(n) if cpo.cpo_alpha != 0.0 => n,
                    _ => pc.sum(&[0]).scalar_like(0.0),
                };
                let losses = pairs.losses + nll * cpo.cpo_alpha;
                (losses, pairs.rewards, sums, vec![("nll_loss", nll)])
            }
            PreferenceLoss::Orpo { beta } => {
                let nll = nll.expect("ORPO adds the chosen rows' NLL");
                // log(1 − eᵖ) for p < 0, as log1p(−eᵖ).
                let log_odds = (pc - pr) - ((-pc.exp()).log1p() - (-pr.exp()).log1p());
                let ratio = log_sigmoid(log_odds);
                let extra = vec![
                    ("nll_loss", nll),
                    ("log_odds_ratio", mean(ratio)),
                    ("log_odds_chosen", mean(log_odds)),
                ];
                (nll - ratio * beta, (pc * beta, pr * beta), (pc, pr), extra)
            }
        }
    }
}

/// A method's per-pair losses, its chosen and rejected rewards, the
/// chosen and rejected log-probs it logs, and its own metrics.
type PairTerms = (
    Tensor,
    (Tensor, Tensor),
    (Tensor, Tensor),
    Vec<(&'static str, Tensor)>,
);

/// Which of the chosen rows' tokens a preference loss's negative
/// log-likelihood counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NllSpan {
    /// The completion's tokens (the loss mask).
    Completion,
    /// Every real token after the first, prompt included.
    WholeRow,
}

#[cfg(test)]
mod tests {
    use super::*;
    use hlo_ir::{interpret, trace, DType, Literal, Outputs, TensorType};

    // Three pairs: summed log-probs and token counts, policy and reference.
    const CHOSEN: [f64; 3] = [-4.0, -9.5, -2.25];
    const REJECTED: [f64; 3] = [-6.5, -8.0, -7.0];
    const CHOSEN_TOKENS: [f64; 3] = [2.0, 5.0, 3.0];
    const REJECTED_TOKENS: [f64; 3] = [4.0, 3.0, 6.0];
    const REF_CHOSEN: [f64; 3] = [-4.5, -9.0, -3.0];
    const REF_REJECTED: [f64; 3] = [-6.0, -8.5, -6.0];

    /// The pairs above, as [`run_on`] takes them.
    const PAIRS: [&[f64]; 6] = [
        &CHOSEN,
        &REJECTED,
        &CHOSEN_TOKENS,
        &REJECTED_TOKENS,
        &REF_CHOSEN,
        &REF_REJECTED,
    ];

    /// The loss and metrics `loss` computes on the pairs above, by name.
    fn run(loss: PreferenceLoss) -> Vec<(String, f64)> {
        run_on(loss, PAIRS)
    }

    /// The loss and metrics of `loss` on pairs given as (policy chosen,
    /// rejected, their token counts, reference chosen, rejected).
    fn run_on(loss: PreferenceLoss, pairs: [&[f64]; 6]) -> Vec<(String, f64)> {
        let ty = TensorType::new(DType::F64, [pairs[0].len() as i64]);
        let names = ["c", "r", "cn", "rn", "rc", "rr"];
        let types: Vec<(&str, TensorType)> = names.iter().map(|n| (*n, ty.clone())).collect();
        let mut keys = vec!["loss".to_string()];
        let f = trace("preference", &types, |i| {
            let policy = PairLogps {
                chosen: i["c"],
                rejected: i["r"],
                chosen_tokens: i["cn"],
                rejected_tokens: i["rn"],
            };
            let reference = PairLogps {
                chosen: i["rc"],
                rejected: i["rr"],
                ..policy
            };
            // The pooled NLL of the chosen completions, given as the caller
            // computes it.
            let nll = -i["c"].sum(&[0]) / i["cn"].sum(&[0]);
            let out = loss.compute(
                policy,
                loss.needs_reference().then_some(reference),
                loss.nll().map(|_| nll),
            );
            let mut o = Outputs::new().add("loss", out.loss);
            for (name, t) in out.metrics {
                keys.push(name.to_string());
                o = o.add(name, t);
            }
            o
        })
        .unwrap();
        let lits: Vec<Literal> = pairs
            .iter()
            .map(|v| Literal::from_f64s(ty.clone(), v))
            .collect();
        let out = interpret(&f, &lits).unwrap();
        keys.into_iter()
            .zip(out.iter().map(|l| l.to_f64s()[0]))
            .collect()
    }

    fn get(out: &[(String, f64)], key: &str) -> f64 {
        out.iter().find(|(k, _)| k == key).unwrap().1
    }

    fn log_sigmoid(x: f64) -> f64 {
        -(1.0 + (-x).exp()).ln()
    }

    fn mean(v: impl Iterator<Item = f64>) -> f64 {
        let v: Vec<f64> = v.collect();
        v.iter().sum::<f64>() / v.len() as f64
    }

    fn close(got: f64, want: f64, what: &str) {
        assert!((got - want).abs() < 1e-12, "{what}: {got} against {want}");
    }

    /// The rewards metrics of per-pair rewards `c` and `r`, and the logged
    /// chosen log-probs `logps`.
    fn check_rewards(out: &[(String, f64)], c: &[f64], r: &[f64], logps: &[f64]) {
        close(
            get(out, "rewards/chosen"),
            mean(c.iter().copied()),
            "chosen",
        );
        close(
            get(out, "rewards/rejected"),
            mean(r.iter().copied()),
            "rejected",
        );
        let acc = mean(c.iter().zip(r).map(|(a, b)| f64::from(u8::from(a > b))));
        close(get(out, "rewards/accuracies"), acc, "accuracies");
        let margin = mean(c.iter().zip(r).map(|(a, b)| a - b));
        close(get(out, "rewards/margins"), margin, "margins");
        close(
            get(out, "logps/chosen"),
            mean(logps.iter().copied()),
            "logps",
        );
    }

    #[test]
    fn dpo_is_the_sigmoid_loss_of_the_log_ratio_against_the_reference() {
        let beta = 0.1;
        let out = run(PreferenceLoss::Dpo { beta });
        let h: Vec<f64> = (0..3)
            .map(|k| (CHOSEN[k] - REJECTED[k]) - (REF_CHOSEN[k] - REF_REJECTED[k]))
            .collect();
        let want = mean(h.iter().map(|h| -log_sigmoid(beta * h)));
        close(get(&out, "loss"), want, "loss");
        let c: Vec<f64> = (0..3).map(|k| beta * (CHOSEN[k] - REF_CHOSEN[k])).collect();
        let r: Vec<f64> = (0..3)
            .map(|k| beta * (REJECTED[k] - REF_REJECTED[k]))
            .collect();
        check_rewards(&out, &c, &r, &CHOSEN);
    }

    #[test]
    fn ipo_is_the_squared_distance_of_the_mean_log_ratio_from_half_over_beta() {
        let beta = 0.5;
        let out = run(PreferenceLoss::Ipo { beta });
        let m = |v: [f64; 3], n: [f64; 3], k: usize| v[k] / n[k];
        let want = mean((0..3).map(|k| {
            let h = (m(CHOSEN, CHOSEN_TOKENS, k) - m(REJECTED, REJECTED_TOKENS, k))
                - (m(REF_CHOSEN, CHOSEN_TOKENS, k) - m(REF_REJECTED, REJECTED_TOKENS, k));
            (h - 1.0 / (2.0 * beta)).powi(2)
        }));
        close(get(&out, "loss"), want, "loss");
        // The rewards are of the sums, as TRL logs them.
        let c: Vec<f64> = (0..3).map(|k| beta * (CHOSEN[k] - REF_CHOSEN[k])).collect();
        let r: Vec<f64> = (0..3)
            .map(|k| beta * (REJECTED[k] - REF_REJECTED[k]))
            .collect();
        check_rewards(&out, &c, &r, &CHOSEN);
    }

    #[test]
    fn simpo_and_orpo_read_mean_log_probs_and_the_chosen_nll() {
        let (beta, gamma, alpha) = (2.0, 0.5, 1.0);
        let out = run(PreferenceLoss::Simpo {
            beta,
            gamma,
            label_smoothing: 0.0,
            cpo_alpha: alpha,
        });
        let pc: Vec<f64> = (0..3).map(|k| CHOSEN[k] / CHOSEN_TOKENS[k]).collect();
        let pr: Vec<f64> = (0..3).map(|k| REJECTED[k] / REJECTED_TOKENS[k]).collect();
        let nll = -CHOSEN.iter().sum::<f64>() / CHOSEN_TOKENS.iter().sum::<f64>();
        let want = mean((0..3).map(|k| -log_sigmoid(beta * (pc[k] - pr[k]) - gamma))) + alpha * nll;
        close(get(&out, "loss"), want, "simpo loss");
        let c: Vec<f64> = pc.iter().map(|p| beta * p).collect();
        let r: Vec<f64> = pr.iter().map(|p| beta * p).collect();
        check_rewards(&out, &c, &r, &pc);
        close(get(&out, "nll_loss"), nll, "simpo nll");

        // Label smoothing ε: (1 − ε)·(−logσ(z)) + ε·(−logσ(−z)).
        let eps = 0.2;
        let smoothed = run(PreferenceLoss::Simpo {
            beta,
            gamma,
            label_smoothing: eps,
            cpo_alpha: 0.0,
        });
        let want = mean((0..3).map(|k| {
            let z = beta * (pc[k] - pr[k]) - gamma;
            -(1.0 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
        }));
        close(get(&smoothed, "loss"), want, "smoothed simpo loss");

        let lambda = 0.1;
        let out = run(PreferenceLoss::Orpo { beta: lambda });
        let odds = |p: f64| p - (1.0 - p.exp()).ln();
        let ratio: Vec<f64> = (0..3)
            .map(|k| log_sigmoid(odds(pc[k]) - odds(pr[k])))
            .collect();
        close(get(&out, "nll_loss"), nll, "nll");
        close(
            get(&out, "log_odds_ratio"),
            mean(ratio.iter().copied()),
            "ratio",
        );
        let want = nll - lambda * mean(ratio.iter().copied());
        close(get(&out, "loss"), want, "orpo loss");
        let c: Vec<f64> = pc.iter().map(|p| lambda * p).collect();
        let r: Vec<f64> = pr.iter().map(|p| lambda * p).collect();
        check_rewards(&out, &c, &r, &pc);
    }

    #[test]
    fn empty_pairs_count_nothing_and_the_policys_own_preference_is_reported() {
        // The three pairs, then two empty ones (a held-out set's last
        // batch): every figure is the three pairs'.
        let pad = |v: &[f64]| [v, &[0.0, 0.0]].concat();
        let padded: Vec<Vec<f64>> = PAIRS.iter().map(|v| pad(v)).collect();
        let simpo = PreferenceLoss::Simpo {
            beta: 0.1,
            gamma: 0.5,
            label_smoothing: 0.0,
            cpo_alpha: 0.0,
        };
        for loss in [
            PreferenceLoss::Dpo { beta: 0.1 },
            PreferenceLoss::Ipo { beta: 0.1 },
            simpo,
            PreferenceLoss::Orpo { beta: 0.1 },
        ] {
            let want = run(loss);
            let got = run_on(
                loss,
                [
                    &padded[0], &padded[1], &padded[2], &padded[3], &padded[4], &padded[5],
                ],
            );
            for ((k, a), (_, b)) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-12, "{loss:?} {k}: {a} against {b}");
            }
        }
        // The policy prefers the chosen side in pairs 1 and 3 (sums).
        let out = run(PreferenceLoss::Dpo { beta: 0.1 });
        close(get(&out, "logps/accuracies"), 2.0 / 3.0, "logps/accuracies");
    }
}
