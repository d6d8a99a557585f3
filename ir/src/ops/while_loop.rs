//! `while`: loop-carried values, a condition and a body, each a function of
//! the carried values. Scan over layers is built on it.

use crate::graph::SubFunction;
use crate::op::Vjp;
use crate::op::{OpRule, Region, Spelling};
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
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Spelling {
        Spelling::new("stablehlo.while")
            .region(Region::Function(self.cond.clone()))
            .region(Region::Function(self.body.clone()))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Spelling {
        Spelling::new("while")
            .region(Region::Function(self.cond.clone()))
            .region(Region::Function(self.body.clone()))
    }
    fn vjp(&self, _: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Err(
            "reverse-mode differentiation of a while loop is not supported; \
             a loop with a fixed trip count (scan) will be"
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
