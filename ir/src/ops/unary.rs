//! Elementwise ops of one operand.

use super::{arity, Elems};
use crate::literal::round_to;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::Tensor;
use crate::{DType, Literal, TensorType};

/// One-operand elementwise ops. Results have the operand's type, except
/// `IsFinite`, whose result is pred.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Log1p,
    Rsqrt,
    Sqrt,
    Tanh,
    Logistic,
    Abs,
    Sign,
    Not,
    Cos,
    Sin,
    Floor,
    IsFinite,
}

impl UnaryOp {
    /// (StableHLO name, HLO name).
    fn names(self) -> (&'static str, &'static str) {
        use UnaryOp::*;
        match self {
            Neg => ("negate", "negate"),
            Exp => ("exponential", "exponential"),
            Log => ("log", "log"),
            Log1p => ("log_plus_one", "log-plus-one"),
            Rsqrt => ("rsqrt", "rsqrt"),
            Sqrt => ("sqrt", "sqrt"),
            Tanh => ("tanh", "tanh"),
            Logistic => ("logistic", "logistic"),
            Abs => ("abs", "abs"),
            Sign => ("sign", "sign"),
            Not => ("not", "not"),
            Cos => ("cosine", "cosine"),
            Sin => ("sine", "sine"),
            Floor => ("floor", "floor"),
            IsFinite => ("is_finite", "is-finite"),
        }
    }

    fn float_only(self) -> bool {
        use UnaryOp::*;
        !matches!(self, Neg | Abs | Sign | Not)
    }

    fn apply_float(self, x: f64) -> f64 {
        use UnaryOp::*;
        match self {
            Neg => -x,
            Exp => x.exp(),
            Log => x.ln(),
            Log1p => x.ln_1p(),
            Rsqrt => 1.0 / x.sqrt(),
            Sqrt => x.sqrt(),
            Tanh => x.tanh(),
            Logistic => 1.0 / (1.0 + (-x).exp()),
            Abs => x.abs(),
            Sign => {
                if x.is_nan() || x == 0.0 {
                    x
                } else {
                    x.signum()
                }
            }
            Cos => x.cos(),
            Sin => x.sin(),
            Floor => x.floor(),
            IsFinite => x.is_finite() as i32 as f64,
            Not => unreachable!("not is integer-only"),
        }
    }

    fn apply_int(self, x: i128, dtype: DType) -> i128 {
        use UnaryOp::*;
        match self {
            Neg => -x,
            Abs => x.abs(),
            Sign => x.signum(),
            Not if dtype == DType::Pred => (x == 0) as i128,
            Not => !x,
            _ => unreachable!("float-only op on integers"),
        }
    }
}

impl OpRule for UnaryOp {
    fn name(&self) -> &'static str {
        self.names().0
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        let t = &operands[0];
        let d = t.dtype;
        if self.float_only() && !d.is_float() {
            return Err(format!("needs a float operand, got {d}"));
        }
        if *self == UnaryOp::Not && d.is_float() {
            return Err(format!("needs an integer or pred operand, got {d}"));
        }
        if matches!(self, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign) && d == DType::Pred {
            return Err("is not defined for pred".into());
        }
        if matches!(self, UnaryOp::Abs | UnaryOp::Neg) && d.is_unsigned() {
            return Err(format!("is not defined for unsigned {d}"));
        }
        let out = if *self == UnaryOp::IsFinite {
            t.with_dtype(DType::Pred)
        } else {
            t.clone()
        };
        Ok(vec![out])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new(format!("stablehlo.{}", self.names().0)))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new(self.names().1))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        use UnaryOp::*;
        let (x, y, g) = (a.operands[0], a.results[0], a.g());
        let dx = match self {
            Neg => -g,
            Exp => g * y,
            Log => g / x,
            Log1p => g / (x + 1.0),
            // d/dx x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
            Rsqrt => g * y * y * y * -0.5,
            Sqrt => g * 0.5 / y,
            Tanh => g * (1.0 - y * y),
            Logistic => g * y * (1.0 - y),
            Abs => g * x.sign(),
            Cos => -(g * x.sin()),
            Sin => g * x.cos(),
            // Piecewise constant or not real-valued: no gradient.
            Sign | Floor | Not | IsFinite => return Ok(vec![None]),
        };
        Ok(vec![a.when(0, || dx)])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let x = &operands[0];
        let out = &results[0];
        let lit = match Elems::of(x) {
            Elems::Float(v) => {
                // Compute in f64 on the operand's value, round to the result type.
                let r: Vec<f64> = v.iter().map(|&e| self.apply_float(e)).collect();
                let r: Vec<f64> = r.into_iter().map(|e| round_to(out.dtype, e)).collect();
                Literal::from_f64s(out.clone(), &r)
            }
            Elems::Int(v) => {
                let r: Vec<i128> = v.iter().map(|&e| self.apply_int(e, x.ty.dtype)).collect();
                Literal::from_i128s(out.clone(), &r)
            }
        };
        Ok(vec![lit])
    }
}
