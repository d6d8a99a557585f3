//! Every tensor of a state read back is finite, or the read is refused
//! naming the first that is not (whole states and sharded ones alike).

use hlo_ir::Literal;

use crate::error::{EngineError, Result};

/// Every tensor of `tensors` is finite, or an error naming the first that
/// is not.
pub(crate) fn check_finite(tensors: &[(String, Literal)], what: &str) -> Result<()> {
    tensors
        .iter()
        .try_for_each(|(name, lit)| check_finite_one(name, lit, what))
}

/// `lit` (tensor `name`, or a block of it) is finite, or an error naming
/// it and `what` it belongs to.
pub(crate) fn check_finite_one(name: &str, lit: &Literal, what: &str) -> Result<()> {
    match lit.non_finite_count() {
        0 => Ok(()),
        bad => Err(EngineError::NonFiniteState {
            what: what.to_string(),
            tensor: name.to_string(),
            bad,
            total: lit.ty.element_count(),
        }),
    }
}
