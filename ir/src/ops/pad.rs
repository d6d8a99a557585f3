//! `pad`: edge padding (negative crops) and interior padding.

use super::{arity, mlir_array, rearrange};
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::types::{for_each_index, linear_index};
use crate::Tensor;
use crate::{Literal, TensorType};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pad {
    pub low: Vec<i64>,
    pub high: Vec<i64>,
    pub interior: Vec<i64>,
}

impl OpRule for Pad {
    fn name(&self) -> &'static str {
        "pad"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 2)?;
        let (x, v) = (&operands[0], &operands[1]);
        if v.rank() != 0 || v.dtype != x.dtype {
            return Err(format!(
                "the padding value must be a {} scalar, got {v}",
                x.dtype
            ));
        }
        let r = x.rank();
        if self.low.len() != r || self.high.len() != r || self.interior.len() != r {
            return Err(format!("padding needs {r} entries each for {x}"));
        }
        let mut dims = Vec::with_capacity(r);
        for i in 0..r {
            if self.interior[i] < 0 {
                return Err(format!(
                    "interior padding {} of dimension {i} is negative",
                    self.interior[i]
                ));
            }
            let d = x.dims[i];
            let size = self.low[i] + self.high[i] + d + (d - 1).max(0) * self.interior[i];
            if size < 0 {
                return Err(format!("dimension {i} would have negative size {size}"));
            }
            dims.push(size);
        }
        Ok(vec![TensorType::new(x.dtype, dims)])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.pad")
                .attr("edge_padding_low", mlir_array(&self.low))
                .attr("edge_padding_high", mlir_array(&self.high))
                .attr("interior_padding", mlir_array(&self.interior)),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        let dims: Vec<String> = (0..self.low.len())
            .map(|i| format!("{}_{}_{}", self.low[i], self.high[i], self.interior[i]))
            .collect();
        Lowering::Op(Spelling::new("pad").attr("padding", dims.join("x")))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let g = a.g();
        // Undo the edges (a negative pad crops), then take every
        // (interior + 1)-th element.
        let dx = || {
            let neg = |v: &[i64]| v.iter().map(|x| -x).collect::<Vec<_>>();
            let zeros = vec![0; self.low.len()];
            let unpadded = g.pad(
                g.scalar_like(0.0),
                &neg(&self.low),
                &neg(&self.high),
                &zeros,
            );
            let strides: Vec<i64> = self.interior.iter().map(|i| i + 1).collect();
            unpadded.slice_strided(&zeros, &unpadded.dims(), &strides)
        };
        let dx_value = if a.needs[0] || a.needs[1] {
            Some(dx())
        } else {
            None
        };
        let all: Vec<i64> = (0..g.rank() as i64).collect();
        let dv = a.needs[1].then(|| {
            let inside = dx_value.expect("computed above").sum(&all);
            g.sum(&all) - inside
        });
        Ok(vec![if a.needs[0] { dx_value } else { None }, dv])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let x = &operands[0];
        let out = &results[0];
        let mut source = vec![None; out.element_count()];
        let mut ri = vec![0i64; x.ty.rank()];
        for_each_index(&x.ty.dims, |xi| {
            let mut inside = true;
            for k in 0..xi.len() {
                ri[k] = self.low[k] + xi[k] * (self.interior[k] + 1);
                inside &= ri[k] >= 0 && ri[k] < out.dims[k];
            }
            if inside {
                source[linear_index(&out.dims, &ri)] = Some(linear_index(&x.ty.dims, xi));
            }
        });
        Ok(vec![rearrange(x, out.clone(), &source, Some(&operands[1]))])
    }
}
