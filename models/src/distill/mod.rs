//! On-policy distillation, as TRL 1.16's `DistillationTrainer` computes
//! its loss: over the tokens of completions the student generated, the
//! generalized Jensen–Shannon divergence between the student's and a
//! frozen teacher's next-token distributions (both at a temperature),
//! `β` interpolating from the forward KL (0) to the reverse KL (1, TRL's
//! default); the mean over the completion tokens. The teacher is another
//! checkpoint of the same vocabulary, run inside the step on its own
//! weights (`teacher.` inputs).

pub mod step;

use hlo_ir::{DType, Tensor};

/// The loss's settings (TRL 1.16's names and defaults: β 1, temperature 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DistillLoss {
    /// 0: KL(teacher ‖ student); 1: KL(student ‖ teacher); between, the
    /// generalized JSD with the mixture `(1 − β)·p_student + β·p_teacher`.
    pub beta: f64,
    /// Both models' logits are divided by it before the softmax (it is
    /// also the student's sampling temperature).
    pub temperature: f64,
}

impl Default for DistillLoss {
    fn default() -> Self {
        DistillLoss {
            beta: 1.0,
            temperature: 1.0,
        }
    }
}

/// `log_softmax` over the last axis of `x` (`[.., V]` f32).
fn log_softmax(x: Tensor) -> Tensor {
    let d = x.dims();
    let last = d.len() as i64 - 1;
    let keep: Vec<i64> = (0..last).collect();
    let max = x.stop_gradient().max(&[last]);
    let shifted = x - max.broadcast_in_dim(&d, &keep);
    let lse = shifted.exp().sum(&[last]).log();
    shifted - lse.broadcast_in_dim(&d, &keep)
}

impl DistillLoss {
    /// Each position's divergence and the student's entropy (`[rows,
    /// seq]` each) from the student's and the teacher's logits (`[rows,
    /// seq, V]`, f32, before the temperature); the gradient reaches the
    /// student only.
    pub fn per_token(&self, student: Tensor, teacher: Tensor) -> (Tensor, Tensor) {
        let d = student.dims();
        let last = d.len() as i64 - 1;
        let t = self.temperature;
        let scaled = |x: Tensor| match t == 1.0 {
            true => x,
            false => x / t,
        };
        let ls = log_softmax(scaled(student.cast(DType::F32)));
        let lt = log_softmax(scaled(teacher.cast(DType::F32))).stop_gradient();
        let (ps, pt) = (ls.exp(), lt.exp());
        let sum = |x: Tensor| x.sum(&[last]);
        let divergence = if self.beta == 0.0 {
            sum(pt * (lt - ls))
        } else if self.beta == 1.0 {
            sum(ps * (ls - lt))
        } else {
            let b = self.beta;
            let a = ls + (1.0 - b).ln();
            let c = lt + b.ln();
            // log m = logaddexp(a, c), stably.
            let hi = a.maximum(c);
            let log_m = hi + ((a - hi).exp() + (c - hi).exp()).log();
            sum(pt * (lt - log_m)) * b + sum(ps * (ls - log_m)) * (1.0 - b)
        };
        let entropy = -sum(ps.stop_gradient() * ls.stop_gradient());
        (divergence, entropy)
    }
}
