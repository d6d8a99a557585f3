//! `compare`: elementwise comparison to pred.

use super::{arity, Elems};
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::Tensor;
use crate::{DType, Literal, TensorType};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ComparisonDirection {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl ComparisonDirection {
    fn spelling(self) -> &'static str {
        use ComparisonDirection::*;
        match self {
            Eq => "EQ",
            Ne => "NE",
            Lt => "LT",
            Le => "LE",
            Gt => "GT",
            Ge => "GE",
        }
    }

    fn holds<T: PartialOrd>(self, a: T, b: T) -> bool {
        use ComparisonDirection::*;
        match self {
            Eq => a == b,
            Ne => a != b,
            Lt => a < b,
            Le => a <= b,
            Gt => a > b,
            Ge => a >= b,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Compare {
    pub direction: ComparisonDirection,
}

fn compare_type(d: DType) -> &'static str {
    if d.is_float() {
        "FLOAT"
    } else if d.is_unsigned() || d == DType::Pred {
        "UNSIGNED"
    } else {
        "SIGNED"
    }
}

impl OpRule for Compare {
    fn name(&self) -> &'static str {
        "compare"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 2)?;
        if operands[0] != operands[1] {
            return Err(format!(
                "operands must have one type, got {} and {}",
                operands[0], operands[1]
            ));
        }
        Ok(vec![operands[0].with_dtype(DType::Pred)])
    }
    fn stablehlo(&self, operands: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.compare")
                .attr(
                    "comparison_direction",
                    format!(
                        "#stablehlo<comparison_direction {}>",
                        self.direction.spelling()
                    ),
                )
                .attr(
                    "compare_type",
                    format!(
                        "#stablehlo<comparison_type {}>",
                        compare_type(operands[0].dtype)
                    ),
                ),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("compare").attr("direction", self.direction.spelling()))
    }
    fn vjp(&self, _: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Ok(vec![None, None])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let r: Vec<i128> = match (Elems::of(&operands[0]), Elems::of(&operands[1])) {
            (Elems::Float(a), Elems::Float(b)) => a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| self.direction.holds(x, y) as i128)
                .collect(),
            (Elems::Int(a), Elems::Int(b)) => a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| self.direction.holds(x, y) as i128)
                .collect(),
            _ => return Err("operands of different kinds".into()),
        };
        Ok(vec![Literal::from_i128s(results[0].clone(), &r)])
    }
}
