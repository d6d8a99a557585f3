//! Elementwise ops of two operands of the same type (the tracer makes
//! broadcasting explicit before they are built).

use super::{arity, Elems};
use crate::literal::round_to;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::Tensor;
use crate::{DType, Literal, TensorType};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
    Pow,
    Rem,
    And,
    Or,
    Xor,
    ShiftLeft,
    ShiftRightLogical,
}

impl BinaryOp {
    /// (StableHLO name, HLO name).
    pub fn names(self) -> (&'static str, &'static str) {
        use BinaryOp::*;
        match self {
            Add => ("add", "add"),
            Sub => ("subtract", "subtract"),
            Mul => ("multiply", "multiply"),
            Div => ("divide", "divide"),
            Max => ("maximum", "maximum"),
            Min => ("minimum", "minimum"),
            Pow => ("power", "power"),
            Rem => ("remainder", "remainder"),
            And => ("and", "and"),
            Or => ("or", "or"),
            Xor => ("xor", "xor"),
            ShiftLeft => ("shift_left", "shift-left"),
            ShiftRightLogical => ("shift_right_logical", "shift-right-logical"),
        }
    }

    /// The dtypes the op accepts, as a check.
    fn accepts(self, d: DType) -> Result<(), String> {
        use BinaryOp::*;
        let ok = match self {
            And | Or | Xor => !d.is_float(),
            ShiftLeft | ShiftRightLogical => d.is_integer(),
            Pow => d.is_float(),
            _ => d != DType::Pred,
        };
        if ok {
            Ok(())
        } else {
            Err(format!("is not defined for {d}"))
        }
    }

    /// The op on f64 values (floats), NaN-propagating for max/min as XLA is.
    pub(crate) fn apply_float(self, a: f64, b: f64) -> f64 {
        use BinaryOp::*;
        match self {
            Add => a + b,
            Sub => a - b,
            Mul => a * b,
            Div => a / b,
            Max | Min if a.is_nan() || b.is_nan() => f64::NAN,
            Max => a.max(b),
            Min => a.min(b),
            Pow => a.powf(b),
            Rem => a % b,
            _ => unreachable!("integer-only op on floats"),
        }
    }

    /// The op on integers of `dtype` (results wrapped later).
    pub(crate) fn apply_int(self, a: i128, b: i128, dtype: DType) -> i128 {
        use BinaryOp::*;
        let bits = dtype.bits() as i128;
        let unsigned = |v: i128| v & ((1i128 << bits) - 1);
        match self {
            Add => a + b,
            Sub => a - b,
            Mul => a.wrapping_mul(b),
            // XLA: x / 0 = -1 and x % 0 = x for integers.
            Div if b == 0 => -1,
            Div => a / b,
            Rem if b == 0 => a,
            Rem => a % b,
            Max => a.max(b),
            Min => a.min(b),
            And => a & b,
            Or => a | b,
            Xor => a ^ b,
            ShiftLeft if b < 0 || b >= bits => 0,
            ShiftLeft => a << b,
            ShiftRightLogical if b < 0 || b >= bits => 0,
            ShiftRightLogical => unsigned(a) >> b,
            Pow => unreachable!("pow is float-only"),
        }
    }
}

impl OpRule for BinaryOp {
    fn name(&self) -> &'static str {
        self.names().0
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 2)?;
        if operands[0] != operands[1] {
            return Err(format!(
                "operands must have one type, got {} and {}",
                operands[0], operands[1]
            ));
        }
        self.accepts(operands[0].dtype)?;
        Ok(vec![operands[0].clone()])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new(format!("stablehlo.{}", self.names().0)))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new(self.names().1))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        use BinaryOp::*;
        let (x, y, out, g) = (a.operands[0], a.operands[1], a.results[0], a.g());
        let zero = || x.scalar_like(0.0);
        // Ties share the gradient equally, as JAX does.
        let extreme = |p: Tensor, q: Tensor| {
            let wins = if *self == Max { p.gt(q) } else { p.lt(q) };
            wins.where_(g, p.eq(q).where_(g * 0.5, zero()))
        };
        let (dx, dy) = match self {
            Add => (a.when(0, || g), a.when(1, || g)),
            Sub => (a.when(0, || g), a.when(1, || -g)),
            Mul => (a.when(0, || g * y), a.when(1, || g * x)),
            Div => (a.when(0, || g / y), a.when(1, || -(g * out / y))),
            Max | Min => (a.when(0, || extreme(x, y)), a.when(1, || extreme(y, x))),
            // d/dx x^y = y x^(y-1); d/dy x^y = x^y log x (0 where x = 0).
            Pow => (
                a.when(0, || g * y * x.pow(y - 1.0)),
                a.when(1, || x.eq(zero()).where_(zero(), g * out * x.log())),
            ),
            // x - y·trunc(x/y): d/dx = 1, d/dy = -trunc(x/y).
            Rem => (
                a.when(0, || g),
                a.when(1, || {
                    let q = x / y;
                    -(g * q.sign() * q.abs().floor())
                }),
            ),
            And | Or | Xor | ShiftLeft | ShiftRightLogical => (None, None),
        };
        Ok(vec![dx, dy])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let out = results[0].clone();
        let lit = match (Elems::of(&operands[0]), Elems::of(&operands[1])) {
            (Elems::Float(a), Elems::Float(b)) => {
                let r: Vec<f64> = a
                    .iter()
                    .zip(&b)
                    .map(|(&x, &y)| round_to(out.dtype, self.apply_float(x, y)))
                    .collect();
                Literal::from_f64s(out, &r)
            }
            (Elems::Int(a), Elems::Int(b)) => {
                let d = out.dtype;
                let r: Vec<i128> = a
                    .iter()
                    .zip(&b)
                    .map(|(&x, &y)| self.apply_int(x, y, d))
                    .collect();
                Literal::from_i128s(out, &r)
            }
            _ => return Err("operands of different kinds".into()),
        };
        Ok(vec![lit])
    }
}
