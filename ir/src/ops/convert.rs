//! `convert` (value-preserving cast) and `bitcast_convert` (same bits).

use super::arity;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::Tensor;
use crate::{DType, Literal, TensorType};

/// Converts values to another element type (floats to integers truncate
/// towards zero; anything to pred is `!= 0`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Convert(pub DType);

impl OpRule for Convert {
    fn name(&self) -> &'static str {
        "convert"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        Ok(vec![operands[0].with_dtype(self.0)])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("stablehlo.convert"))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("convert"))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        // The gradient goes back in the operand's type.
        let from = a.operands[0].dtype();
        Ok(vec![if from.is_float() && self.0.is_float() {
            a.when(0, || a.g().cast(from))
        } else {
            None
        }])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let x = &operands[0];
        let out = results[0].clone();
        let lit = if self.0 == DType::Pred {
            let v: Vec<i128> = x.to_f64s().iter().map(|&e| (e != 0.0) as i128).collect();
            Literal::from_i128s(out, &v)
        } else if x.ty.dtype.is_float() {
            Literal::from_f64s(out, &x.to_f64s())
        } else {
            Literal::from_i128s(out, &x.to_i128s())
        };
        Ok(vec![lit])
    }
}

/// Reinterprets the bits of each element as another type of the same width.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BitcastConvert(pub DType);

impl OpRule for BitcastConvert {
    fn name(&self) -> &'static str {
        "bitcast_convert"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        let from = operands[0].dtype;
        if from.size_in_bytes() != self.0.size_in_bytes()
            || from == DType::Pred
            || self.0 == DType::Pred
        {
            return Err(format!(
                "cannot reinterpret {from} as {} (widths differ)",
                self.0
            ));
        }
        Ok(vec![operands[0].with_dtype(self.0)])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("stablehlo.bitcast_convert"))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("bitcast-convert"))
    }
    fn vjp(&self, _: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Ok(vec![None])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        Ok(vec![Literal {
            ty: results[0].clone(),
            bytes: operands[0].bytes.clone(),
        }])
    }
}
