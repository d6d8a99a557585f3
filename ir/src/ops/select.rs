//! `select(pred, on_true, on_false)`.

use super::{arity, Elems};
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::Tensor;
use crate::{DType, Literal, TensorType};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Select;

impl OpRule for Select {
    fn name(&self) -> &'static str {
        "select"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 3)?;
        let (p, t, f) = (&operands[0], &operands[1], &operands[2]);
        if p.dtype != DType::Pred {
            return Err(format!("the predicate must be pred, got {p}"));
        }
        if t != f {
            return Err(format!("the branches must have one type, got {t} and {f}"));
        }
        if p.dims != t.dims && p.rank() != 0 {
            return Err(format!(
                "the predicate {p} must be a scalar or have the shape of {t}"
            ));
        }
        Ok(vec![t.clone()])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("stablehlo.select"))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("select"))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let (p, g) = (a.operands[0], a.g());
        let zero = g.scalar_like(0.0);
        Ok(vec![
            None,
            a.when(1, || p.where_(g, zero)),
            a.when(2, || p.where_(zero, g)),
        ])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let p = operands[0].to_i128s();
        let n = results[0].element_count();
        let pick = |i: usize| p[if p.len() == 1 { 0 } else { i }] != 0;
        let out = match (Elems::of(&operands[1]), Elems::of(&operands[2])) {
            (Elems::Float(t), Elems::Float(f)) => {
                Elems::Float((0..n).map(|i| if pick(i) { t[i] } else { f[i] }).collect())
            }
            (Elems::Int(t), Elems::Int(f)) => {
                Elems::Int((0..n).map(|i| if pick(i) { t[i] } else { f[i] }).collect())
            }
            _ => return Err("branches of different kinds".into()),
        };
        Ok(vec![out.into_literal(results[0].clone())])
    }
}
