//! `Function`: a traced program as SSA values and nodes in topological order,
//! with named inputs and outputs.

use std::fmt;
use std::sync::Arc;

use crate::op::Op;
use crate::TensorType;

/// Index of a value in [`Function::values`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Where a value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ValueDef {
    /// The i-th input of the function.
    Input(usize),
    /// Output `output` of node `node`.
    Node { node: usize, output: usize },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ValueInfo {
    pub ty: TensorType,
    pub def: ValueDef,
}

/// One operation applied to earlier values.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    pub op: Op,
    pub operands: Vec<ValueId>,
    pub results: Vec<ValueId>,
    /// Dotted scope the node was traced in (`layers.3.self_attn.q_proj`), or
    /// empty at top level.
    pub scope: String,
    /// The rematerialization group the node belongs to, if it was traced
    /// inside [`crate::checkpoint`]: autodiff recomputes such nodes in the
    /// backward pass rather than keeping their results.
    pub checkpoint: Option<u32>,
}

/// A named input or output (`layers.3.self_attn.q_proj.lora_a`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Binding {
    pub name: String,
    pub value: ValueId,
}

/// A traced, pure program: inputs, nodes in topological order, outputs.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Function {
    pub name: String,
    pub inputs: Vec<Binding>,
    pub outputs: Vec<Binding>,
    pub nodes: Vec<Node>,
    pub values: Vec<ValueInfo>,
}

impl Function {
    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.values[v.index()].ty
    }

    pub fn input_types(&self) -> Vec<TensorType> {
        self.inputs
            .iter()
            .map(|b| self.ty(b.value).clone())
            .collect()
    }

    pub fn output_types(&self) -> Vec<TensorType> {
        self.outputs
            .iter()
            .map(|b| self.ty(b.value).clone())
            .collect()
    }

    /// The input named `name`.
    pub fn input(&self, name: &str) -> Option<&Binding> {
        self.inputs.iter().find(|b| b.name == name)
    }

    /// The output named `name`.
    pub fn output(&self, name: &str) -> Option<&Binding> {
        self.outputs.iter().find(|b| b.name == name)
    }

    /// Checks the invariants every pass relies on: operands defined before
    /// use, result types as the op's rule says. Returns the first violation.
    pub fn verify(&self) -> Result<(), String> {
        let mut defined = vec![false; self.values.len()];
        for (i, b) in self.inputs.iter().enumerate() {
            if self.values[b.value.index()].def != ValueDef::Input(i) {
                return Err(format!("input {} is not defined as input {i}", b.name));
            }
            defined[b.value.index()] = true;
        }
        for (n, node) in self.nodes.iter().enumerate() {
            for o in &node.operands {
                if !defined.get(o.index()).copied().unwrap_or(false) {
                    return Err(format!(
                        "node {n} ({}) uses %{} before it is defined",
                        node.op.name(),
                        o.0
                    ));
                }
            }
            let operand_types: Vec<TensorType> =
                node.operands.iter().map(|&o| self.ty(o).clone()).collect();
            let want = node
                .op
                .infer(&operand_types)
                .map_err(|e| format!("node {n}: {e}"))?;
            let got: Vec<TensorType> = node.results.iter().map(|&r| self.ty(r).clone()).collect();
            if want != got {
                return Err(format!(
                    "node {n} ({}) has result types {got:?}, its rule gives {want:?}",
                    node.op.name()
                ));
            }
            for (k, r) in node.results.iter().enumerate() {
                if self.values[r.index()].def != (ValueDef::Node { node: n, output: k }) {
                    return Err(format!("value %{} is not defined by node {n}", r.0));
                }
                defined[r.index()] = true;
            }
        }
        for b in &self.outputs {
            if !defined.get(b.value.index()).copied().unwrap_or(false) {
                return Err(format!("output {} is never defined", b.name));
            }
        }
        Ok(())
    }
}

/// A function shared by the ops that hold one (a loop's condition and body,
/// a scan's body).
pub type SubFunction = Arc<Function>;

impl fmt::Display for Function {
    /// A compact listing for debugging and error messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ins: Vec<String> = self
            .inputs
            .iter()
            .map(|b| format!("%{}: {} \"{}\"", b.value.0, self.ty(b.value), b.name))
            .collect();
        writeln!(f, "fn {}({}) {{", self.name, ins.join(", "))?;
        for node in &self.nodes {
            let res: Vec<String> = node
                .results
                .iter()
                .map(|r| format!("%{}: {}", r.0, self.ty(*r)))
                .collect();
            let ops: Vec<String> = node.operands.iter().map(|o| format!("%{}", o.0)).collect();
            write!(
                f,
                "  {} = {}({})",
                res.join(", "),
                node.op.name(),
                ops.join(", ")
            )?;
            if !node.scope.is_empty() {
                write!(f, "  @{}", node.scope)?;
            }
            writeln!(f)?;
        }
        let outs: Vec<String> = self
            .outputs
            .iter()
            .map(|b| format!("\"{}\" = %{}", b.name, b.value.0))
            .collect();
        writeln!(f, "  return {}", outs.join(", "))?;
        write!(f, "}}")
    }
}

impl Function {
    /// A function of one node: `op` applied to inputs `x0, x1, ...` of
    /// `operand_types`, its results as outputs `y0, y1, ...` (what the eager
    /// executor compiles per node).
    pub fn single_op(op: Op, operand_types: &[TensorType]) -> Result<Function, String> {
        let results = op.infer(operand_types)?;
        let mut f = Function {
            name: op.name().to_string(),
            ..Function::default()
        };
        for (i, t) in operand_types.iter().enumerate() {
            let v = ValueId(f.values.len() as u32);
            f.values.push(ValueInfo {
                ty: t.clone(),
                def: ValueDef::Input(i),
            });
            f.inputs.push(Binding {
                name: format!("x{i}"),
                value: v,
            });
        }
        let operands: Vec<ValueId> = f.inputs.iter().map(|b| b.value).collect();
        let mut ids = Vec::new();
        for (k, t) in results.into_iter().enumerate() {
            let v = ValueId(f.values.len() as u32);
            f.values.push(ValueInfo {
                ty: t,
                def: ValueDef::Node { node: 0, output: k },
            });
            ids.push(v);
            f.outputs.push(Binding {
                name: format!("y{k}"),
                value: v,
            });
        }
        f.nodes.push(Node {
            op,
            operands,
            results: ids,
            scope: String::new(),
            checkpoint: None,
        });
        Ok(f)
    }
}
