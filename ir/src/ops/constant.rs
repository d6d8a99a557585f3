//! `constant` and `iota`.

use super::{arity, Elems};
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::types::for_each_index;
use crate::Tensor;
use crate::{Literal, TensorType};

/// A constant tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Constant(pub Literal);

impl Constant {
    fn mlir_value(&self) -> String {
        let l = &self.0;
        if l.ty.element_count() > 0 && l.is_splat() {
            format!("dense<{}> : {}", l.mlir_element(0), l.ty.mlir())
        } else if l.ty.dtype == crate::DType::Pred {
            // MLIR's hex form packs i1 differently across versions; a nested
            // list of true/false means the same to all of them.
            fn nest(l: &Literal, dim: usize, offset: &mut usize) -> String {
                if dim == l.ty.rank() {
                    *offset += 1;
                    return l.mlir_element(*offset - 1);
                }
                let items: Vec<String> = (0..l.ty.dims[dim])
                    .map(|_| nest(l, dim + 1, offset))
                    .collect();
                format!("[{}]", items.join(", "))
            }
            format!("dense<{}> : {}", nest(l, 0, &mut 0), l.ty.mlir())
        } else {
            let hex: String = l.bytes.iter().map(|b| format!("{b:02X}")).collect();
            format!("dense<\"0x{hex}\"> : {}", l.ty.mlir())
        }
    }

    /// `{ {1, 2}, {3, 4} }` nested by dimension, or a bare scalar.
    fn hlo_value(&self) -> String {
        let l = &self.0;
        fn nest(l: &Literal, dim: usize, offset: &mut usize) -> String {
            if dim == l.ty.rank() {
                let s = l.hlo_element(*offset);
                *offset += 1;
                return s;
            }
            let items: Vec<String> = (0..l.ty.dims[dim])
                .map(|_| nest(l, dim + 1, offset))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        nest(l, 0, &mut 0)
    }
}

impl OpRule for Constant {
    fn name(&self) -> &'static str {
        "constant"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 0)?;
        Ok(vec![self.0.ty.clone()])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("stablehlo.constant").attr("value", self.mlir_value()))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        // HLO writes the value as the operand list: `constant({1, 2})`.
        Lowering::Op(Spelling::new("constant").literal(self.hlo_value()))
    }
    fn vjp(&self, _: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Ok(vec![])
    }
    fn eval(&self, _: &[Literal], _: &[TensorType]) -> Result<Vec<Literal>, String> {
        Ok(vec![self.0.clone()])
    }
}

/// `0, 1, 2, ...` along `dimension`, broadcast over the others.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Iota {
    pub ty: TensorType,
    pub dimension: i64,
}

impl OpRule for Iota {
    fn name(&self) -> &'static str {
        "iota"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 0)?;
        if self.dimension < 0 || self.dimension as usize >= self.ty.rank() {
            return Err(format!(
                "dimension {} is out of range for {}",
                self.dimension, self.ty
            ));
        }
        if self.ty.dtype == crate::DType::Pred {
            return Err("iota of pred is not defined".into());
        }
        Ok(vec![self.ty.clone()])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.iota")
                .attr("iota_dimension", format!("{} : i64", self.dimension)),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("iota").attr("iota_dimension", self.dimension.to_string()))
    }
    fn vjp(&self, _: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Ok(vec![])
    }
    fn eval(&self, _: &[Literal], _: &[TensorType]) -> Result<Vec<Literal>, String> {
        let mut v = Vec::with_capacity(self.ty.element_count());
        for_each_index(&self.ty.dims, |idx| {
            v.push(idx[self.dimension as usize] as i128)
        });
        Ok(vec![Elems::Int(v).into_literal(self.ty.clone())])
    }
}
