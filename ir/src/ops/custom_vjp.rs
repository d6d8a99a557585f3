//! `custom_vjp`: a computation with its own backward rule
//! (`jax.custom_vjp`). The forward function returns the outputs and
//! residuals (what the backward needs, as FlashAttention keeps the
//! log-sum-exp instead of the probabilities); the backward function maps
//! the operands, outputs, residuals and the outputs' cotangents to the
//! float operands' cotangents. Autodiff calls the backward instead of
//! differentiating the forward's ops.
//!
//! Results: the outputs, then the residuals (the VJP rule reads them from
//! its forward results; [`crate::custom_vjp`] hands the caller only the
//! outputs). It lowers to [`Lowering::Expanded`]: the printers inline the
//! forward first ([`crate::inline_custom_vjps`]).

use crate::graph::SubFunction;
use crate::op::{Lowering, OpRule, Vjp};
use crate::{call, full, Literal, Tensor, TensorType};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CustomVjp {
    /// `operands -> (outputs, residuals)`.
    pub forward: SubFunction,
    /// `(operands, outputs, residuals, cotangents of the outputs) ->` one
    /// cotangent per float operand, in operand order.
    pub backward: SubFunction,
    pub num_outputs: usize,
}

impl OpRule for CustomVjp {
    fn name(&self) -> &'static str {
        "custom_vjp"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        if self.forward.input_types() != operands {
            return Err(format!(
                "the forward takes {:?}, got {operands:?}",
                self.forward.input_types()
            ));
        }
        let results = self.forward.output_types();
        if results.len() < self.num_outputs {
            return Err(format!(
                "the forward returns {} values, fewer than its {} outputs",
                results.len(),
                self.num_outputs
            ));
        }
        let mut want: Vec<TensorType> = operands.to_vec();
        want.extend(results.iter().cloned());
        want.extend(results[..self.num_outputs].iter().cloned());
        if self.backward.input_types() != want {
            return Err(format!(
                "the backward takes {:?}, it must take (operands, outputs, residuals, \
                 cotangents) {want:?}",
                self.backward.input_types()
            ));
        }
        let grads: Vec<TensorType> = operands
            .iter()
            .filter(|t| t.dtype.is_float())
            .cloned()
            .collect();
        if self.backward.output_types() != grads {
            return Err(format!(
                "the backward returns {:?}, it must return the float operands' cotangents {grads:?}",
                self.backward.output_types()
            ));
        }
        Ok(results)
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Expanded {
            by: "inline_custom_vjps",
        }
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Expanded {
            by: "inline_custom_vjps",
        }
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let mut args: Vec<Tensor> = a.operands.to_vec();
        args.extend_from_slice(a.results);
        for (c, r) in a.cotangents.iter().zip(a.results).take(self.num_outputs) {
            args.push(c.unwrap_or_else(|| full(r.ty(), 0.0)));
        }
        let mut grads = call(&self.backward, &args).into_iter();
        Ok(a.operands
            .iter()
            .zip(a.needs)
            .map(|(o, &need)| {
                let g = o.dtype().is_float().then(|| grads.next()).flatten();
                g.filter(|_| need)
            })
            .collect())
    }
    fn eval(&self, operands: &[Literal], _: &[TensorType]) -> Result<Vec<Literal>, String> {
        crate::interpret(&self.forward, operands).map_err(|e| e.to_string())
    }
}
