//! `while`: loop-carried values, a condition and a body, each a function of
//! the carried values. Not differentiable (its trip count is unknown until it
//! runs); a loop of fixed length is a [`super::Scan`], which
//! [`crate::lower_scans`] rewrites into a `while` for printing.

use crate::graph::SubFunction;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Region, Spelling};
use crate::Tensor;
use crate::{DType, Literal, TensorType};

/// The most iterations the reference interpreter runs before giving up.
const MAX_ITERATIONS: usize = 10_000_000;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct While {
    /// `(carry...) -> pred[]`.
    pub cond: SubFunction,
    /// `(carry...) -> (carry...)`.
    pub body: SubFunction,
}

impl OpRule for While {
    fn name(&self) -> &'static str {
        "while"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        let carry = operands.to_vec();
        if self.cond.input_types() != carry {
            return Err(format!(
                "the condition takes {:?}, the loop carries {carry:?}",
                self.cond.input_types()
            ));
        }
        if self.cond.output_types() != vec![TensorType::scalar(DType::Pred)] {
            return Err(format!(
                "the condition must return one pred, it returns {:?}",
                self.cond.output_types()
            ));
        }
        if self.body.input_types() != carry || self.body.output_types() != carry {
            return Err(format!(
                "the body maps {:?} to {:?}, the loop carries {carry:?}",
                self.body.input_types(),
                self.body.output_types()
            ));
        }
        Ok(carry)
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.while")
                .region(Region::Cond(self.cond.clone()))
                .region(Region::Body(self.body.clone())),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        // HLO's `while` carries one tuple.
        Lowering::Op(
            Spelling::new("while")
                .tupled()
                .region(Region::Cond(self.cond.clone()))
                .region(Region::Body(self.body.clone())),
        )
    }
    fn vjp(&self, _: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Err(
            "a while loop, whose trip count is known only when it runs, has no VJP; \
             write a loop of fixed length with `scan`, which is differentiable"
                .into(),
        )
    }
    fn eval(&self, operands: &[Literal], _: &[TensorType]) -> Result<Vec<Literal>, String> {
        let mut carry = operands.to_vec();
        for _ in 0..MAX_ITERATIONS {
            let go = crate::interpret(&self.cond, &carry).map_err(|e| e.to_string())?;
            if go[0].to_i128s()[0] == 0 {
                return Ok(carry);
            }
            carry = crate::interpret(&self.body, &carry).map_err(|e| e.to_string())?;
        }
        Err(format!("did not finish in {MAX_ITERATIONS} iterations"))
    }
}
