//! Graph passes: dead-code elimination, common-subexpression elimination and
//! folding of small constant expressions. Each returns a new, verified
//! function with the same inputs and outputs.

use std::collections::HashMap;

use crate::graph::{Binding, Node, ValueDef, ValueId, ValueInfo};
use crate::op::Op;
use crate::ops::Constant;
use crate::{Function, Literal};

/// A new function built node by node from an old one.
struct Rebuild {
    f: Function,
    /// Old value id → new value id.
    map: Vec<Option<ValueId>>,
}

impl Rebuild {
    fn new(old: &Function) -> Self {
        let mut f = Function {
            name: old.name.clone(),
            ..Function::default()
        };
        let mut map = vec![None; old.values.len()];
        for (i, b) in old.inputs.iter().enumerate() {
            let id = ValueId(f.values.len() as u32);
            f.values.push(ValueInfo {
                ty: old.ty(b.value).clone(),
                def: ValueDef::Input(i),
            });
            f.inputs.push(Binding {
                name: b.name.clone(),
                value: id,
            });
            map[b.value.index()] = Some(id);
        }
        Rebuild { f, map }
    }

    fn get(&self, old: ValueId) -> ValueId {
        self.map[old.index()].expect("operands are rebuilt before their users")
    }

    /// Appends a node whose result types are `types` (already known valid).
    fn push(
        &mut self,
        op: Op,
        operands: Vec<ValueId>,
        types: Vec<crate::TensorType>,
        from: &Node,
    ) -> Vec<ValueId> {
        let node = self.f.nodes.len();
        let results: Vec<ValueId> = types
            .into_iter()
            .enumerate()
            .map(|(output, ty)| {
                let id = ValueId(self.f.values.len() as u32);
                self.f.values.push(ValueInfo {
                    ty,
                    def: ValueDef::Node { node, output },
                });
                id
            })
            .collect();
        self.f.nodes.push(Node {
            op,
            operands,
            results: results.clone(),
            scope: from.scope.clone(),
            checkpoint: from.checkpoint,
        });
        results
    }

    fn finish(mut self, old: &Function) -> Function {
        self.f.outputs = old
            .outputs
            .iter()
            .map(|b| Binding {
                name: b.name.clone(),
                value: self.get(b.value),
            })
            .collect();
        debug_assert_eq!(self.f.verify(), Ok(()));
        self.f
    }
}

/// Removes nodes none of whose results reach an output. Every op is pure,
/// so this never changes what the function computes.
pub fn dce(f: &Function) -> Function {
    let mut live = vec![false; f.values.len()];
    for b in &f.outputs {
        live[b.value.index()] = true;
    }
    let mut keep = vec![false; f.nodes.len()];
    for (n, node) in f.nodes.iter().enumerate().rev() {
        if node.results.iter().any(|r| live[r.index()]) {
            keep[n] = true;
            for o in &node.operands {
                live[o.index()] = true;
            }
        }
    }
    let mut r = Rebuild::new(f);
    for (n, node) in f.nodes.iter().enumerate() {
        if !keep[n] {
            continue;
        }
        let operands = node.operands.iter().map(|&o| r.get(o)).collect();
        let types = node.results.iter().map(|&v| f.ty(v).clone()).collect();
        let new = r.push(node.op.clone(), operands, types, node);
        for (old, new) in node.results.iter().zip(new) {
            r.map[old.index()] = Some(new);
        }
    }
    r.finish(f)
}

/// Merges nodes that apply the same op to the same operands (in the same
/// rematerialization group). The first node's scope is kept.
pub fn cse(f: &Function) -> Function {
    let mut r = Rebuild::new(f);
    let mut seen: HashMap<(Op, Vec<ValueId>, Option<u32>), Vec<ValueId>> = HashMap::new();
    for node in &f.nodes {
        let operands: Vec<ValueId> = node.operands.iter().map(|&o| r.get(o)).collect();
        let key = (node.op.clone(), operands.clone(), node.checkpoint);
        let new = match seen.get(&key) {
            Some(existing) => existing.clone(),
            None => {
                let types = node.results.iter().map(|&v| f.ty(v).clone()).collect();
                let new = r.push(node.op.clone(), operands, types, node);
                seen.insert(key, new.clone());
                new
            }
        };
        for (old, new) in node.results.iter().zip(new) {
            r.map[old.index()] = Some(new);
        }
    }
    r.finish(f)
}

/// Replaces nodes whose operands are all constant (or iota) and whose
/// results have at most `max_elements` elements by constants, evaluated by
/// the reference interpreter. Large constants are left to XLA.
pub fn fold_constants(f: &Function, max_elements: usize) -> Function {
    let mut r = Rebuild::new(f);
    // Known literal of each *new* value.
    let mut known: HashMap<ValueId, Literal> = HashMap::new();
    for node in &f.nodes {
        let operands: Vec<ValueId> = node.operands.iter().map(|&o| r.get(o)).collect();
        let types: Vec<_> = node.results.iter().map(|&v| f.ty(v).clone()).collect();
        let small = types.iter().all(|t| t.element_count() <= max_elements);
        let args: Option<Vec<Literal>> = operands.iter().map(|o| known.get(o).cloned()).collect();
        let source_op = matches!(node.op, Op::Constant(_) | Op::Iota(_));
        let folded = match args {
            Some(args) if small && (source_op || !operands.is_empty()) => {
                node.op.eval(&args, &types).ok()
            }
            _ => None,
        };
        let new = match folded {
            Some(lits) if !source_op => {
                let mut ids = Vec::new();
                for lit in lits {
                    let ty = lit.ty.clone();
                    let id = r.push(Op::Constant(Constant(lit.clone())), vec![], vec![ty], node)[0];
                    known.insert(id, lit);
                    ids.push(id);
                }
                ids
            }
            other => {
                let ids = r.push(node.op.clone(), operands, types, node);
                if let Some(lits) = other {
                    for (id, lit) in ids.iter().zip(lits) {
                        known.insert(*id, lit);
                    }
                }
                ids
            }
        };
        for (old, new) in node.results.iter().zip(new) {
            r.map[old.index()] = Some(new);
        }
    }
    r.finish(f)
}

/// Folding, then CSE, then DCE: what JIT compilation runs before lowering.
pub fn simplify(f: &Function) -> Function {
    dce(&cse(&fold_constants(f, 64)))
}
