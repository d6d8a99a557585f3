//! The reference interpreter: runs a [`Function`] on host literals, each op
//! by its own `eval` rule (floats computed in f64 and rounded to the result
//! type). Used by constant folding and as the tests' independent reference
//! for what XLA computes.

use crate::{Function, Literal};

/// Why interpretation stopped.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InterpretError {
    #[error("{function} takes {want} inputs, {got} were given")]
    InputCount {
        function: String,
        want: usize,
        got: usize,
    },
    #[error("input `{name}` is {want}, the literal given is {got}")]
    InputType {
        name: String,
        want: String,
        got: String,
    },
    #[error("{op} in `{scope}`: {message}")]
    Op {
        op: String,
        scope: String,
        message: String,
    },
}

/// Evaluates `f` on `inputs`, returning its outputs in order.
pub fn interpret(f: &Function, inputs: &[Literal]) -> Result<Vec<Literal>, InterpretError> {
    if inputs.len() != f.inputs.len() {
        return Err(InterpretError::InputCount {
            function: f.name.clone(),
            want: f.inputs.len(),
            got: inputs.len(),
        });
    }
    let mut env: Vec<Option<Literal>> = vec![None; f.values.len()];
    for (b, lit) in f.inputs.iter().zip(inputs) {
        let want = f.ty(b.value);
        if *want != lit.ty {
            return Err(InterpretError::InputType {
                name: b.name.clone(),
                want: want.to_string(),
                got: lit.ty.to_string(),
            });
        }
        env[b.value.index()] = Some(lit.clone());
    }
    for node in &f.nodes {
        let args: Vec<Literal> = node
            .operands
            .iter()
            .map(|o| {
                env[o.index()]
                    .clone()
                    .expect("verified: defined before use")
            })
            .collect();
        let types: Vec<_> = node.results.iter().map(|r| f.ty(*r).clone()).collect();
        let out = node
            .op
            .eval(&args, &types)
            .map_err(|message| InterpretError::Op {
                op: node.op.name().to_string(),
                scope: node.scope.clone(),
                message,
            })?;
        for (r, lit) in node.results.iter().zip(out) {
            env[r.index()] = Some(lit);
        }
    }
    Ok(f.outputs
        .iter()
        .map(|b| {
            env[b.value.index()]
                .clone()
                .expect("verified: outputs defined")
        })
        .collect())
}
