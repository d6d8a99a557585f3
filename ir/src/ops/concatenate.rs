//! `concatenate` along one dimension.

use super::Elems;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::Tensor;
use crate::{Literal, TensorType};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Concatenate {
    pub dimension: i64,
}

impl OpRule for Concatenate {
    fn name(&self) -> &'static str {
        "concatenate"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        let Some(first) = operands.first() else {
            return Err("needs at least one operand".into());
        };
        let d = self.dimension;
        if d < 0 || d as usize >= first.rank() {
            return Err(format!("dimension {d} is out of range for {first}"));
        }
        let mut dims = first.dims.clone();
        dims[d as usize] = 0;
        for t in operands {
            let same_elsewhere = t.rank() == first.rank()
                && t.dims
                    .iter()
                    .zip(&first.dims)
                    .enumerate()
                    .all(|(i, (a, b))| i == d as usize || a == b);
            if t.dtype != first.dtype || !same_elsewhere {
                return Err(format!("{t} does not fit {first} outside dimension {d}"));
            }
            dims[d as usize] += t.dims[d as usize];
        }
        Ok(vec![TensorType::new(first.dtype, dims)])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.concatenate")
                .attr("dimension", format!("{} : i64", self.dimension)),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("concatenate").attr("dimensions", format!("{{{}}}", self.dimension)),
        )
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let g = a.g();
        let gd = g.dims();
        let d = self.dimension as usize;
        let mut offset = 0;
        Ok(a.operands
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let size = x.dims()[d];
                let mut start = vec![0; gd.len()];
                let mut limit = gd.clone();
                start[d] = offset;
                limit[d] = offset + size;
                offset += size;
                a.when(i, || g.slice(&start, &limit))
            })
            .collect())
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        // Row-major: the result is, for each index of the outer dims, the
        // operands' inner blocks one after another.
        let d = self.dimension as usize;
        let out = &results[0];
        let outer: usize = out.dims[..d].iter().product::<i64>() as usize;
        let inner_of = |t: &TensorType| t.dims[d..].iter().product::<i64>() as usize;
        let mut parts: Vec<Elems> = operands.iter().map(Elems::of).collect();
        let mut res = match &parts[0] {
            Elems::Float(_) => Elems::Float(Vec::new()),
            Elems::Int(_) => Elems::Int(Vec::new()),
        };
        for o in 0..outer {
            for (p, l) in parts.iter_mut().zip(operands) {
                let n = inner_of(&l.ty);
                match (&mut res, p) {
                    (Elems::Float(r), Elems::Float(v)) => {
                        r.extend_from_slice(&v[o * n..(o + 1) * n])
                    }
                    (Elems::Int(r), Elems::Int(v)) => r.extend_from_slice(&v[o * n..(o + 1) * n]),
                    _ => unreachable!("same dtype"),
                }
            }
        }
        Ok(vec![res.into_literal(out.clone())])
    }
}
