//! Graph passes: dead-code elimination, common-subexpression elimination,
//! folding of small constant expressions ([`simplify`] runs all three), and
//! the rewritings that printing needs ([`expand`]): custom-VJP calls
//! inlined ([`inline_custom_vjps`]) and scans into while loops
//! ([`lower_scans`]). Each returns a new, verified function with the same
//! inputs and outputs.

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

/// What the printers run first: every op whose rule lowers to
/// [`crate::Lowering::Expanded`] rewritten into ops they print.
pub fn expand(f: &Function) -> Function {
    lower_scans(&inline_custom_vjps(f))
}

/// `f` retraced with `special` given the first say on each node (as
/// [`crate::trace::replay_with`]): what the rewriting passes share.
fn rewrite(f: &Function, special: &crate::trace::Special, what: &str) -> Function {
    let inputs: Vec<(String, crate::TensorType)> = f
        .inputs
        .iter()
        .map(|b| (b.name.clone(), f.ty(b.value).clone()))
        .collect();
    crate::trace(&f.name, &inputs, |i| {
        let vals = crate::trace::replay_with(f, i.tensors(), special);
        let mut out = crate::Outputs::new();
        for b in &f.outputs {
            out = out.add(
                b.name.clone(),
                vals[b.value.index()].expect("outputs are defined"),
            );
        }
        out
    })
    .unwrap_or_else(|e| panic!("{what} gave an invalid function: {e}"))
}

/// Replaces every `custom_vjp` (also inside loop and scan bodies) by its
/// forward function's ops: the backward rule matters only to autodiff,
/// which has run by the time a program is printed.
pub fn inline_custom_vjps(f: &Function) -> Function {
    if !has_custom_vjp(f) {
        return f.clone();
    }
    let special = |node: &crate::Node, operands: &[crate::Tensor]| match &node.op {
        Op::CustomVjp(c) => Some(crate::call(&inline_custom_vjps(&c.forward), operands)),
        Op::Scan(s) if has_custom_vjp(&s.body) => Some(crate::trace::apply(
            Op::Scan(crate::ops::Scan {
                body: inline_custom_vjps(&s.body).into(),
                ..s.clone()
            }),
            operands,
            node.results.len(),
        )),
        Op::While(w) if has_custom_vjp(&w.cond) || has_custom_vjp(&w.body) => {
            Some(crate::trace::apply(
                Op::While(crate::ops::While {
                    cond: inline_custom_vjps(&w.cond).into(),
                    body: inline_custom_vjps(&w.body).into(),
                }),
                operands,
                operands.len(),
            ))
        }
        _ => None,
    };
    rewrite(f, &special, "inlining a custom_vjp")
}

fn has_custom_vjp(f: &Function) -> bool {
    f.nodes.iter().any(|n| match &n.op {
        Op::CustomVjp(_) => true,
        Op::Scan(s) => has_custom_vjp(&s.body),
        Op::While(w) => has_custom_vjp(&w.cond) || has_custom_vjp(&w.body),
        _ => false,
    })
}

/// Rewrites every `scan` (also inside loop bodies and other scans) into a
/// `while` over dynamic slices and dynamic updates, as JAX lowers scans. A
/// scan's rule lowers to [`crate::Lowering::Expanded`] by this pass: the
/// printers of `hlo-lowering` run it first.
pub fn lower_scans(f: &Function) -> Function {
    if !has_scan(f) {
        return f.clone();
    }
    let special = |node: &crate::Node, operands: &[crate::Tensor]| match &node.op {
        Op::Scan(s) => Some(expand_scan(s, operands)),
        Op::While(w) if has_scan(&w.cond) || has_scan(&w.body) => Some(crate::trace::apply(
            Op::While(crate::ops::While {
                cond: lower_scans(&w.cond).into(),
                body: lower_scans(&w.body).into(),
            }),
            operands,
            operands.len(),
        )),
        _ => None,
    };
    rewrite(f, &special, "lowering a scan")
}

fn has_scan(f: &Function) -> bool {
    f.nodes.iter().any(|n| match &n.op {
        Op::Scan(_) => true,
        Op::While(w) => has_scan(&w.cond) || has_scan(&w.body),
        _ => false,
    })
}

/// One scan as a `while`: the loop state is (i, carry, ys buffers, carry
/// history buffers, xs, consts).
fn expand_scan(s: &crate::ops::Scan, operands: &[crate::Tensor]) -> Vec<crate::Tensor> {
    use crate::{full, DType, Tensor, TensorType};
    let (c, x) = (s.num_carry, s.num_xs);
    let body = lower_scans(&s.body);
    let ny = body.outputs.len() - c;
    let y_types: Vec<TensorType> = body.output_types()[c..].to_vec();
    let carry_types: Vec<TensorType> = body.input_types()[..c].to_vec();
    let n = s.length;
    let mut state = vec![full(TensorType::scalar(DType::I32), 0.0)];
    state.extend_from_slice(&operands[..c]);
    state.extend(y_types.iter().map(|t| full(crate::ops::stacked(n, t), 0.0)));
    state.extend(
        carry_types
            .iter()
            .map(|t| full(crate::ops::stacked(n, t), 0.0)),
    );
    state.extend_from_slice(&operands[c..]);
    let reverse = s.reverse;
    let out = crate::while_loop(
        &state,
        |st| st[0].lt(full(TensorType::scalar(DType::I32), n as f64)),
        |st| {
            let i = st[0];
            let idx = if reverse { (n - 1) as f64 - i } else { i };
            let zero = full(TensorType::scalar(DType::I32), 0.0);
            let at = |rank: usize| {
                let mut v = vec![idx];
                v.extend(std::iter::repeat_n(zero, rank - 1));
                v
            };
            let carry = &st[1..1 + c];
            let ys = &st[1 + c..1 + c + ny];
            let hist = &st[1 + c + ny..1 + 2 * c + ny];
            let xs = &st[1 + 2 * c + ny..1 + 2 * c + ny + x];
            let consts = &st[1 + 2 * c + ny + x..];
            let mut args: Vec<Tensor> = carry.to_vec();
            for t in xs {
                let d = t.dims();
                let mut size = d.clone();
                size[0] = 1;
                args.push(t.dynamic_slice(&at(d.len()), &size).reshape(&d[1..]));
            }
            args.extend_from_slice(consts);
            let put = |buf: Tensor, v: Tensor| {
                let mut d = vec![1];
                d.extend(v.dims());
                buf.dynamic_update_slice(v.reshape(&d), &at(d.len()))
            };
            let new_hist: Vec<Tensor> = hist.iter().zip(carry).map(|(h, v)| put(*h, *v)).collect();
            let r = crate::call(&body, &args);
            let new_ys: Vec<Tensor> = ys.iter().zip(&r[c..]).map(|(b, v)| put(*b, *v)).collect();
            let mut next = vec![i + 1.0];
            next.extend_from_slice(&r[..c]);
            next.extend(new_ys);
            next.extend(new_hist);
            next.extend_from_slice(xs);
            next.extend_from_slice(consts);
            next
        },
    );
    let mut results: Vec<Tensor> = out[1..1 + c].to_vec();
    results.extend_from_slice(&out[1 + c..1 + c + ny]);
    results.extend_from_slice(&out[1 + c + ny..1 + 2 * c + ny]);
    results
}
