//! `reduce` over some dimensions with a sum, max or min body.

use super::{arity, check_dims, hlo_list, mlir_array, BinaryOp, Elems};
use crate::literal::round_to;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Region, Spelling};
use crate::types::for_each_index;
use crate::Tensor;
use crate::{Literal, TensorType};

/// The combiner of a reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    Sum,
    Max,
    Min,
}

impl ReduceKind {
    pub fn combiner(self) -> BinaryOp {
        match self {
            ReduceKind::Sum => BinaryOp::Add,
            ReduceKind::Max => BinaryOp::Max,
            ReduceKind::Min => BinaryOp::Min,
        }
    }
}

/// `reduce(x, init)`: combines the elements of `x` over `dims`, starting
/// from the scalar `init` (0 for a sum, -inf for a max, ...).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reduce {
    pub kind: ReduceKind,
    pub dims: Vec<i64>,
}

impl OpRule for Reduce {
    fn name(&self) -> &'static str {
        "reduce"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 2)?;
        let (x, init) = (&operands[0], &operands[1]);
        if init.rank() != 0 || init.dtype != x.dtype {
            return Err(format!(
                "the initial value must be a {} scalar, got {init}",
                x.dtype
            ));
        }
        check_dims("reduced dimension", &self.dims, x.rank())?;
        if self.kind == ReduceKind::Sum && x.dtype == crate::DType::Pred {
            return Err("cannot sum pred".into());
        }
        let dims = (0..x.rank())
            .filter(|i| !self.dims.contains(&(*i as i64)))
            .map(|i| x.dims[i])
            .collect::<Vec<_>>();
        Ok(vec![TensorType::new(x.dtype, dims)])
    }
    fn stablehlo(&self, operands: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.reduce")
                .attr("dimensions", mlir_array(&self.dims))
                .region(Region::Combiner(self.kind.combiner(), operands[0].dtype)),
        )
    }
    fn hlo(&self, operands: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("reduce")
                .attr("dimensions", hlo_list(&self.dims))
                .region(Region::Combiner(self.kind.combiner(), operands[0].dtype)),
        )
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let (x, out, g) = (a.operands[0], a.results[0], a.g());
        let xd = x.dims();
        let kept: Vec<i64> = (0..xd.len() as i64)
            .filter(|i| !self.dims.contains(i))
            .collect();
        let back = |t: Tensor| t.broadcast_in_dim(&xd, &kept);
        let dx = match self.kind {
            ReduceKind::Sum => a.when(0, || back(g)),
            // To the positions that attain the extreme, shared among ties.
            ReduceKind::Max | ReduceKind::Min => a.when(0, || {
                let hit = x.eq(back(out)).cast(x.dtype());
                let count = hit.sum(&self.dims);
                back(g / count) * hit
            }),
        };
        let all: Vec<i64> = (0..g.rank() as i64).collect();
        let dinit = match self.kind {
            ReduceKind::Sum => a.when(1, || g.sum(&all)),
            _ => None,
        };
        Ok(vec![dx, dinit])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let (x, init) = (&operands[0], &operands[1]);
        let out = &results[0];
        let kept: Vec<usize> = (0..x.ty.rank())
            .filter(|i| !self.dims.contains(&(*i as i64)))
            .collect();
        let n = out.element_count();
        // Map each input element to its output slot.
        let mut slot = Vec::with_capacity(x.ty.element_count());
        for_each_index(&x.ty.dims, |xi| {
            let mut off = 0usize;
            for &k in &kept {
                off = off * x.ty.dims[k] as usize + xi[k] as usize;
            }
            slot.push(off);
        });
        let op = self.kind.combiner();
        let lit = match (Elems::of(x), Elems::of(init)) {
            (Elems::Float(v), Elems::Float(i)) => {
                // Accumulate in f64: the reference is more exact than the device.
                let mut acc = vec![i[0]; n];
                for (e, s) in v.iter().zip(&slot) {
                    acc[*s] = op.apply_float(acc[*s], *e);
                }
                let acc: Vec<f64> = acc.into_iter().map(|a| round_to(out.dtype, a)).collect();
                Literal::from_f64s(out.clone(), &acc)
            }
            (Elems::Int(v), Elems::Int(i)) => {
                let mut acc = vec![i[0]; n];
                for (e, s) in v.iter().zip(&slot) {
                    acc[*s] = op.apply_int(acc[*s], *e, out.dtype);
                }
                Literal::from_i128s(out.clone(), &acc)
            }
            _ => return Err("operands of different kinds".into()),
        };
        Ok(vec![lit])
    }
}
