//! `slice`: a strided box with static bounds.

use super::{arity, mlir_array, rearrange};
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::types::{for_each_index, linear_index};
use crate::Tensor;
use crate::{Literal, TensorType};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Slice {
    pub start: Vec<i64>,
    pub limit: Vec<i64>,
    pub strides: Vec<i64>,
}

impl OpRule for Slice {
    fn name(&self) -> &'static str {
        "slice"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        let x = &operands[0];
        let r = x.rank();
        if self.start.len() != r || self.limit.len() != r || self.strides.len() != r {
            return Err(format!("bounds need {r} entries each for {x}"));
        }
        let mut dims = Vec::with_capacity(r);
        for i in 0..r {
            let (s, l, st) = (self.start[i], self.limit[i], self.strides[i]);
            if s < 0 || l > x.dims[i] || s > l || st < 1 {
                return Err(format!(
                    "dimension {i}: [{s}:{l}:{st}] is not a valid slice of size {}",
                    x.dims[i]
                ));
            }
            dims.push((l - s + st - 1) / st);
        }
        Ok(vec![TensorType::new(x.dtype, dims)])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.slice")
                .attr("start_indices", mlir_array(&self.start))
                .attr("limit_indices", mlir_array(&self.limit))
                .attr("strides", mlir_array(&self.strides)),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        let ranges: Vec<String> = (0..self.start.len())
            .map(|i| format!("[{}:{}:{}]", self.start[i], self.limit[i], self.strides[i]))
            .collect();
        Lowering::Op(Spelling::new("slice").attr("slice", format!("{{{}}}", ranges.join(", "))))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let (x, g) = (a.operands[0], a.g());
        Ok(vec![a.when(0, || {
            // Put the slice back where it came from, zeros elsewhere.
            let (xd, gd) = (x.dims(), g.dims());
            let high: Vec<i64> = (0..xd.len())
                .map(|i| {
                    let last = if gd[i] == 0 {
                        self.start[i] - 1
                    } else {
                        self.start[i] + (gd[i] - 1) * self.strides[i]
                    };
                    xd[i] - last - 1
                })
                .collect();
            let interior: Vec<i64> = self.strides.iter().map(|s| s - 1).collect();
            g.pad(g.scalar_like(0.0), &self.start, &high, &interior)
        })])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let x = &operands[0];
        let mut source = Vec::new();
        let mut xi = vec![0i64; x.ty.rank()];
        for_each_index(&results[0].dims, |ri| {
            for k in 0..ri.len() {
                xi[k] = self.start[k] + ri[k] * self.strides[k];
            }
            source.push(Some(linear_index(&x.ty.dims, &xi)));
        });
        Ok(vec![rearrange(x, results[0].clone(), &source, None)])
    }
}
