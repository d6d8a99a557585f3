//! `rng_bit_generator`: random bits from an explicit state (functional: the
//! new state is a result).

use super::arity;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::Tensor;
use crate::{DType, Literal, TensorType};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RngAlgorithm {
    ThreeFry,
    Philox,
}

/// `(state: u64[2]) -> (new_state: u64[2], bits: shape)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RngBitGenerator {
    pub algorithm: RngAlgorithm,
    /// The type of the bits (u32 or u64 elements).
    pub shape: TensorType,
}

impl OpRule for RngBitGenerator {
    fn name(&self) -> &'static str {
        "rng_bit_generator"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 1)?;
        let state = &operands[0];
        if *state != TensorType::new(DType::U64, [2]) {
            return Err(format!("the state must be u64[2], got {state}"));
        }
        if !matches!(self.shape.dtype, DType::U32 | DType::U64) {
            return Err(format!("bits must be u32 or u64, got {}", self.shape));
        }
        Ok(vec![state.clone(), self.shape.clone()])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        let a = match self.algorithm {
            RngAlgorithm::ThreeFry => "THREE_FRY",
            RngAlgorithm::Philox => "PHILOX",
        };
        Lowering::Op(
            Spelling::new("stablehlo.rng_bit_generator")
                .attr("rng_algorithm", format!("#stablehlo<rng_algorithm {a}>")),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        let a = match self.algorithm {
            RngAlgorithm::ThreeFry => "rng_three_fry",
            RngAlgorithm::Philox => "rng_philox",
        };
        Lowering::Op(Spelling::new("rng-bit-generator").attr("algorithm", a))
    }
    fn vjp(&self, _: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Ok(vec![None])
    }
    fn eval(&self, _: &[Literal], _: &[TensorType]) -> Result<Vec<Literal>, String> {
        // The bits are XLA's to define; tests check their distribution.
        Err("rng_bit_generator has no host reference".into())
    }
}
