//! `stop_gradient` and `optimization_barrier`: identities that matter only
//! to autodiff and to XLA's optimizer.

use super::arity;
use crate::op::{Lowering, OpRule, Spelling, Vjp};
use crate::{Literal, Tensor, TensorType};

/// The identity, through which no gradient flows. Lowers to nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StopGradient;

impl OpRule for StopGradient {
    fn name(&self) -> &'static str {
        "stop_gradient"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        Ok(vec![operands[0].clone()])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Identity
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Identity
    }
    fn vjp(&self, _: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Ok(vec![None])
    }
    fn eval(&self, operands: &[Literal], _: &[TensorType]) -> Result<Vec<Literal>, String> {
        Ok(vec![operands[0].clone()])
    }
}

/// The identity on several values that XLA may not see through: what is
/// computed from its results cannot be merged with (or hoisted to) what was
/// computed from its operands. Rematerialization relies on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OptimizationBarrier;

impl OpRule for OptimizationBarrier {
    fn name(&self) -> &'static str {
        "optimization_barrier"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        Ok(operands.to_vec())
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("stablehlo.optimization_barrier"))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        // HLO's `opt-barrier` takes and returns one tuple.
        Lowering::Op(Spelling::new("opt-barrier").tupled())
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Ok(a.cotangents
            .iter()
            .zip(a.needs)
            .map(|(c, &n)| if n { *c } else { None })
            .collect())
    }
    fn eval(&self, operands: &[Literal], _: &[TensorType]) -> Result<Vec<Literal>, String> {
        Ok(operands.to_vec())
    }
}
