//! `transpose`: result dimension i is operand dimension `permutation[i]`.

use super::{arity, check_dims, hlo_list, mlir_array, rearrange};
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::types::{for_each_index, linear_index};
use crate::Tensor;
use crate::{Literal, TensorType};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Transpose {
    pub permutation: Vec<i64>,
}

impl OpRule for Transpose {
    fn name(&self) -> &'static str {
        "transpose"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        let x = &operands[0];
        if self.permutation.len() != x.rank() {
            return Err(format!(
                "permutation {:?} does not fit {x}",
                self.permutation
            ));
        }
        check_dims("permutation entry", &self.permutation, x.rank())?;
        let dims = self
            .permutation
            .iter()
            .map(|&p| x.dims[p as usize])
            .collect::<Vec<_>>();
        Ok(vec![TensorType::new(x.dtype, dims)])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.transpose").attr("permutation", mlir_array(&self.permutation)),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("transpose").attr("dimensions", hlo_list(&self.permutation)))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let mut inverse = vec![0i64; self.permutation.len()];
        for (i, &p) in self.permutation.iter().enumerate() {
            inverse[p as usize] = i as i64;
        }
        Ok(vec![a.when(0, || a.g().transpose(&inverse))])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let x = &operands[0];
        let mut source = Vec::new();
        let mut xi = vec![0i64; x.ty.rank()];
        for_each_index(&results[0].dims, |ri| {
            for (i, &p) in self.permutation.iter().enumerate() {
                xi[p as usize] = ri[i];
            }
            source.push(Some(linear_index(&x.ty.dims, &xi)));
        });
        Ok(vec![rearrange(x, results[0].clone(), &source, None)])
    }
}
