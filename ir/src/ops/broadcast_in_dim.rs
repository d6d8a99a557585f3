//! `broadcast_in_dim`: operand dimension i becomes result dimension `dims[i]`.

use super::{arity, check_dims, hlo_list, mlir_array, rearrange};
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::types::{for_each_index, linear_index};
use crate::Tensor;
use crate::{Literal, TensorType};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BroadcastInDim {
    /// Result dimension of each operand dimension.
    pub dims: Vec<i64>,
    /// The result dimensions.
    pub shape: Vec<i64>,
}

impl OpRule for BroadcastInDim {
    fn name(&self) -> &'static str {
        "broadcast_in_dim"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        let x = &operands[0];
        if self.dims.len() != x.rank() {
            return Err(format!(
                "maps {} dimensions but the operand {x} has {}",
                self.dims.len(),
                x.rank()
            ));
        }
        check_dims("broadcast dimension", &self.dims, self.shape.len())?;
        for (i, (&d, &size)) in self.dims.iter().zip(&x.dims).enumerate() {
            let target = self.shape[d as usize];
            if size != 1 && size != target {
                return Err(format!(
                    "operand dimension {i} of size {size} cannot broadcast to size {target}"
                ));
            }
        }
        Ok(vec![TensorType::new(x.dtype, self.shape.clone())])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.broadcast_in_dim")
                .attr("broadcast_dimensions", mlir_array(&self.dims)),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("broadcast").attr("dimensions", hlo_list(&self.dims)))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let x = a.operands[0];
        Ok(vec![a.when(0, || {
            let xd = x.dims();
            // Sum over result dims no operand dim maps to, and over operand
            // dims of size 1 that were stretched.
            let summed: Vec<i64> = (0..self.shape.len() as i64)
                .filter(|r| match self.dims.iter().position(|d| d == r) {
                    None => true,
                    Some(i) => xd[i] == 1 && self.shape[*r as usize] != 1,
                })
                .collect();
            let s = a.g().sum(&summed);
            // What is left is in increasing result-dim order; restore the
            // operand's order, then its size-1 dims.
            let mut kept: Vec<(i64, usize)> = self
                .dims
                .iter()
                .enumerate()
                .filter(|(i, d)| !(xd[*i] == 1 && self.shape[**d as usize] != 1))
                .map(|(i, &d)| (d, i))
                .collect();
            kept.sort();
            let order: Vec<usize> = kept.iter().map(|&(_, i)| i).collect();
            let mut sorted = order.clone();
            sorted.sort();
            let s = if order != sorted {
                let perm: Vec<i64> = sorted
                    .iter()
                    .map(|i| order.iter().position(|o| o == i).expect("present") as i64)
                    .collect();
                s.transpose(&perm)
            } else {
                s
            };
            s.reshape(&xd)
        })])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let x = &operands[0];
        let mut source = Vec::with_capacity(results[0].element_count());
        let mut xi = vec![0i64; x.ty.rank()];
        for_each_index(&self.shape, |ri| {
            for (k, &d) in self.dims.iter().enumerate() {
                xi[k] = if x.ty.dims[k] == 1 { 0 } else { ri[d as usize] };
            }
            source.push(Some(linear_index(&x.ty.dims, &xi)));
        });
        Ok(vec![rearrange(x, results[0].clone(), &source, None)])
    }
}
