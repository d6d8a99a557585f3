//! `reshape`: same elements in row-major order, new dimensions.

use super::arity;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::Tensor;
use crate::{Literal, TensorType};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reshape {
    pub shape: Vec<i64>,
}

impl OpRule for Reshape {
    fn name(&self) -> &'static str {
        "reshape"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        let x = &operands[0];
        let out = TensorType::new(x.dtype, self.shape.clone());
        if self.shape.iter().any(|&d| d < 0) || out.element_count() != x.element_count() {
            return Err(format!("cannot reshape {x} to {out}"));
        }
        Ok(vec![out])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("stablehlo.reshape"))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("reshape"))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let x = a.operands[0];
        Ok(vec![a.when(0, || a.g().reshape(&x.dims()))])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        Ok(vec![Literal {
            ty: results[0].clone(),
            bytes: operands[0].bytes.clone(),
        }])
    }
}
