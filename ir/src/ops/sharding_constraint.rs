//! `sharding_constraint`: the identity, with a request that the value be laid
//! out over mesh axes (`jax.lax.with_sharding_constraint`). It lowers to a
//! [`Lowering::ShardingConstraint`]: its sharding is spelled by the
//! lowering's one sharding printer (which knows the mesh); without a mesh it
//! lowers to nothing.

use super::arity;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::Tensor;
use crate::{Literal, TensorType};

/// Per tensor dimension, the mesh axes it is split over (empty: not split).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShardingConstraint {
    pub dims: Vec<Vec<String>>,
}

impl OpRule for ShardingConstraint {
    fn name(&self) -> &'static str {
        "sharding_constraint"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        if self.dims.len() != operands[0].rank() {
            return Err(format!(
                "{} dimension specs for {}",
                self.dims.len(),
                operands[0]
            ));
        }
        Ok(vec![operands[0].clone()])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        // Shardy: `sdy.sharding_constraint` with `sharding = #sdy.sharding<..>`.
        Lowering::ShardingConstraint {
            op: Spelling::new("sdy.sharding_constraint"),
            dims: self.dims.clone(),
        }
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        // GSPMD: the `Sharding` custom call with `sharding={devices=..}`.
        Lowering::ShardingConstraint {
            op: Spelling::new("custom-call").attr("custom_call_target", "\"Sharding\""),
            dims: self.dims.clone(),
        }
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        // The gradient is laid out like the value.
        Ok(vec![a.when(0, || {
            a.g().with_sharding_constraint(self.dims.clone())
        })])
    }
    fn eval(&self, operands: &[Literal], _: &[TensorType]) -> Result<Vec<Literal>, String> {
        Ok(vec![operands[0].clone()])
    }
}
