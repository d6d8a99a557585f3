//! Reverse-mode autodiff: a new [`Function`] that computes the original's
//! outputs and the gradients with respect to chosen inputs.
//!
//! Only nodes on a path from a `wrt` input to a differentiated output get
//! backward work: a value is *active* when it depends on a `wrt` input
//! through float values and reaches a seeded output. A rule is asked only
//! for the cotangents of active operands, so frozen weights get no
//! weight-gradient computation at all. Zero cotangents are symbolic (`None`),
//! fan-out contributions are summed once at the end (n − 1 adds), and every
//! gradient's type is checked against its value's. Nodes traced inside
//! [`crate::checkpoint`] are recomputed for the backward pass from
//! barrier-protected inputs instead of keeping their results.

use std::cell::RefCell;
use std::collections::HashMap;

use crate::graph::ValueId;
use crate::op::{Op, Vjp};
use crate::ops::OptimizationBarrier;
use crate::trace::{apply, replay, restore_scope, set_scope, with_current};
use crate::{full, trace, Function, Outputs, Tensor, TensorType, TraceError};

/// Why a gradient could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AutodiffError {
    #[error("{function} has no input named `{name}` to differentiate with respect to")]
    UnknownInput { function: String, name: String },
    #[error("cannot differentiate with respect to `{name}`: it is {ty}, not a float")]
    NotFloat { name: String, ty: String },
    #[error("{function} has no output named `{name}`")]
    UnknownOutput { function: String, name: String },
    #[error("the loss `{name}` must be a float scalar, it is {ty}")]
    BadLoss { name: String, ty: String },
    #[error("gradient of {op} in `{scope}`: {message}")]
    Rule {
        op: String,
        scope: String,
        message: String,
    },
    #[error("tracing the gradient: {0}")]
    Trace(#[from] TraceError),
}

/// Where the backward pass starts.
enum Seeds {
    /// One cotangent input per float output (`cotangents.<output>`).
    Inputs,
    /// The scalar output at this index, seeded with 1.
    Loss(usize),
}

/// `f` extended with cotangent inputs `cotangents.<output>` (one per float
/// output) and gradient outputs `grads.<input>` for each `wrt` input; the
/// original outputs come first.
pub fn vjp(f: &Function, wrt: &[&str]) -> Result<Function, AutodiffError> {
    differentiate(f, wrt, Seeds::Inputs, true)
}

/// `f` with outputs: all of its own (the loss and any auxiliary outputs),
/// then `grads.<input>` for each `wrt` input, of the scalar output `loss`.
///
/// ```
/// use hlo_ir::{interpret, trace, value_and_grad, DType, Literal, TensorType};
/// let t = TensorType::new(DType::F64, [2]);
/// let f = trace("sq", &[("x", t.clone())], |i| vec![("loss", (i["x"] * i["x"]).sum(&[0]))]).unwrap();
/// let g = value_and_grad(&f, "loss", &["x"]).unwrap();
/// let out = interpret(&g, &[Literal::from_f64s(t, &[3.0, -1.0])]).unwrap();
/// assert_eq!(out[1].to_f64s(), vec![6.0, -2.0]);
/// ```
pub fn value_and_grad(f: &Function, loss: &str, wrt: &[&str]) -> Result<Function, AutodiffError> {
    differentiate(f, wrt, Seeds::Loss(loss_index(f, loss)?), true)
}

/// Like [`value_and_grad`], with only the gradients as outputs.
pub fn grad(f: &Function, loss: &str, wrt: &[&str]) -> Result<Function, AutodiffError> {
    differentiate(f, wrt, Seeds::Loss(loss_index(f, loss)?), false)
}

fn loss_index(f: &Function, loss: &str) -> Result<usize, AutodiffError> {
    let i = f
        .outputs
        .iter()
        .position(|b| b.name == loss)
        .ok_or_else(|| AutodiffError::UnknownOutput {
            function: f.name.clone(),
            name: loss.to_string(),
        })?;
    let ty = f.ty(f.outputs[i].value);
    if ty.rank() != 0 || !ty.dtype.is_float() {
        return Err(AutodiffError::BadLoss {
            name: loss.to_string(),
            ty: ty.to_string(),
        });
    }
    Ok(i)
}

/// Values that depend on `wrt` through float values.
fn varying(f: &Function, wrt: &[usize]) -> Vec<bool> {
    let mut varies = vec![false; f.values.len()];
    for &i in wrt {
        varies[f.inputs[i].value.index()] = true;
    }
    for node in &f.nodes {
        if matches!(node.op, Op::StopGradient(_)) {
            continue;
        }
        if node.operands.iter().any(|o| varies[o.index()]) {
            for r in &node.results {
                varies[r.index()] = f.ty(*r).dtype.is_float();
            }
        }
    }
    varies
}

/// Values from which a seeded output can be reached.
fn useful(f: &Function, seeds: &[ValueId]) -> Vec<bool> {
    let mut useful = vec![false; f.values.len()];
    for s in seeds {
        useful[s.index()] = true;
    }
    for node in f.nodes.iter().rev() {
        if node.results.iter().any(|r| useful[r.index()]) {
            for o in &node.operands {
                useful[o.index()] = true;
            }
        }
    }
    useful
}

/// Sums contributions (n − 1 adds); `None` when there are none.
fn sum(contributions: &[Tensor]) -> Option<Tensor> {
    let mut it = contributions.iter().copied();
    let first = it.next()?;
    Some(it.fold(first, |acc, t| acc + t))
}

fn differentiate(
    f: &Function,
    wrt: &[&str],
    seeds: Seeds,
    keep_primal: bool,
) -> Result<Function, AutodiffError> {
    let mut wrt_index = Vec::new();
    for name in wrt {
        let i = f
            .inputs
            .iter()
            .position(|b| b.name == *name)
            .ok_or_else(|| AutodiffError::UnknownInput {
                function: f.name.clone(),
                name: name.to_string(),
            })?;
        let ty = f.ty(f.inputs[i].value);
        if !ty.dtype.is_float() {
            return Err(AutodiffError::NotFloat {
                name: name.to_string(),
                ty: ty.to_string(),
            });
        }
        wrt_index.push(i);
    }
    let seeded: Vec<usize> = match seeds {
        Seeds::Loss(i) => vec![i],
        Seeds::Inputs => (0..f.outputs.len())
            .filter(|&i| f.ty(f.outputs[i].value).dtype.is_float())
            .collect(),
    };
    let varies = varying(f, &wrt_index);
    let useful = useful(
        f,
        &seeded
            .iter()
            .map(|&i| f.outputs[i].value)
            .collect::<Vec<_>>(),
    );
    let active: Vec<bool> = varies.iter().zip(&useful).map(|(a, b)| *a && *b).collect();

    let mut inputs: Vec<(String, TensorType)> = f
        .inputs
        .iter()
        .map(|b| (b.name.clone(), f.ty(b.value).clone()))
        .collect();
    if let Seeds::Inputs = seeds {
        for &i in &seeded {
            let b = &f.outputs[i];
            inputs.push((format!("cotangents.{}", b.name), f.ty(b.value).clone()));
        }
    }
    let rule_error: RefCell<Option<AutodiffError>> = RefCell::new(None);
    let name = format!("{}_grad", f.name);
    let g = trace(&name, &inputs, |ins| {
        let tensors = ins.tensors();
        let saved_checkpoint = with_current(|b| b.checkpoint.take());
        // Forward: every node, in its scope.
        let vals = replay(f, &tensors[..f.inputs.len()]);
        // Seeds.
        let mut ct: Vec<Vec<Tensor>> = vec![Vec::new(); f.values.len()];
        match seeds {
            Seeds::Loss(i) => ct[f.outputs[i].value.index()].push(full(
                TensorType::scalar(f.ty(f.outputs[i].value).dtype),
                1.0,
            )),
            Seeds::Inputs => {
                for (k, &i) in seeded.iter().enumerate() {
                    ct[f.outputs[i].value.index()].push(tensors[f.inputs.len() + k]);
                }
            }
        }
        // Rematerialized copies of checkpointed values, per group.
        let mut remat: HashMap<u32, Vec<Option<Tensor>>> = HashMap::new();
        // Backward.
        for (n, node) in f.nodes.iter().enumerate().rev() {
            if rule_error.borrow().is_some() {
                break;
            }
            let needs: Vec<bool> = node.operands.iter().map(|o| active[o.index()]).collect();
            if !needs.iter().any(|&x| x) || !node.results.iter().any(|r| active[r.index()]) {
                continue;
            }
            let mut cotangents: Vec<Option<Tensor>> =
                node.results.iter().map(|r| sum(&ct[r.index()])).collect();
            if cotangents.iter().all(Option::is_none) {
                continue;
            }
            let saved = set_scope(format!("backward.{}", node.scope).trim_end_matches('.'));
            // Forward values the rule sees: recomputed for checkpointed nodes.
            let view: Vec<Option<Tensor>> = match node.checkpoint {
                None => vals.clone(),
                Some(group) => {
                    let copy = remat.entry(group).or_insert_with(|| {
                        let (copy, ordered) = rematerialize(f, group, n, &vals, &cotangents);
                        cotangents = ordered;
                        copy
                    });
                    copy.clone()
                }
            };
            let operands: Vec<Tensor> = node
                .operands
                .iter()
                .map(|o| view[o.index()].expect("defined"))
                .collect();
            let results: Vec<Tensor> = node
                .results
                .iter()
                .map(|r| view[r.index()].expect("defined"))
                .collect();
            let grads = node.op.rule().vjp(&Vjp {
                operands: &operands,
                results: &results,
                cotangents: &cotangents,
                needs: &needs,
            });
            restore_scope(saved);
            let grads = match grads {
                Ok(g) => g,
                Err(message) => {
                    *rule_error.borrow_mut() = Some(AutodiffError::Rule {
                        op: node.op.name().into(),
                        scope: node.scope.clone(),
                        message,
                    });
                    break;
                }
            };
            for ((o, g), need) in node.operands.iter().zip(grads).zip(&needs) {
                if let (Some(g), true) = (g, need) {
                    let (want, got) = (f.ty(*o), g.ty());
                    if *want != got {
                        *rule_error.borrow_mut() = Some(AutodiffError::Rule {
                            op: node.op.name().into(),
                            scope: node.scope.clone(),
                            message: format!("its rule gave a {got} gradient for a {want} operand"),
                        });
                    }
                    ct[o.index()].push(g);
                }
            }
        }
        with_current(|b| b.checkpoint = saved_checkpoint);
        let mut out = Outputs::new();
        if keep_primal {
            for b in &f.outputs {
                out = out.add(b.name.clone(), vals[b.value.index()].expect("defined"));
            }
        }
        for &i in &wrt_index {
            let b = &f.inputs[i];
            let g = sum(&ct[b.value.index()]).unwrap_or_else(|| full(f.ty(b.value).clone(), 0.0));
            out = out.add(format!("grads.{}", b.name), g);
        }
        out
    })?;
    if let Some(e) = rule_error.into_inner() {
        return Err(e);
    }
    Ok(g)
}

/// Recomputes checkpoint `group`'s nodes from its inputs passed through an
/// optimization barrier together with the cotangents of node `at` (so the
/// recomputation can neither be merged with the forward nor run before the
/// backward reaches it). Returns the value table with the group's values
/// replaced, and the cotangents as they come out of the barrier.
fn rematerialize(
    f: &Function,
    group: u32,
    at: usize,
    vals: &[Option<Tensor>],
    cotangents: &[Option<Tensor>],
) -> (Vec<Option<Tensor>>, Vec<Option<Tensor>>) {
    let nodes: Vec<&crate::Node> = f.nodes[..=at]
        .iter()
        .filter(|n| n.checkpoint == Some(group))
        .collect();
    let inside: std::collections::HashSet<ValueId> = nodes
        .iter()
        .flat_map(|n| n.results.iter().copied())
        .collect();
    let mut outside: Vec<ValueId> = nodes
        .iter()
        .flat_map(|n| n.operands.iter().copied())
        .filter(|v| !inside.contains(v))
        .collect();
    outside.sort();
    outside.dedup();
    let mut barrier_in: Vec<Tensor> = outside
        .iter()
        .map(|v| vals[v.index()].expect("defined"))
        .collect();
    let cts: Vec<Tensor> = cotangents.iter().flatten().copied().collect();
    barrier_in.extend(&cts);
    let barrier_out = apply(
        Op::OptimizationBarrier(OptimizationBarrier),
        &barrier_in,
        barrier_in.len(),
    );
    let mut copy = vals.to_vec();
    for (v, t) in outside.iter().zip(&barrier_out) {
        copy[v.index()] = Some(*t);
    }
    let mut rest = barrier_out[outside.len()..].iter();
    let ordered = cotangents
        .iter()
        .map(|c| c.map(|_| *rest.next().expect("one per cotangent")))
        .collect();
    for node in nodes {
        let operands: Vec<Tensor> = node
            .operands
            .iter()
            .map(|o| copy[o.index()].expect("defined"))
            .collect();
        let saved = set_scope(&format!("remat.{}", node.scope));
        let results = apply(node.op.clone(), &operands, node.results.len());
        restore_scope(saved);
        for (r, t) in node.results.iter().zip(results) {
            copy[r.index()] = Some(t);
        }
    }
    (copy, ordered)
}

/// The VJP of a scan: a scan in the other direction over the body's VJP,
/// reading the forward carries from the scan's carry history, carrying the
/// carry's cotangent and the sum of the consts' cotangents, stacking the
/// xs' cotangents.
pub(crate) fn scan_vjp(s: &crate::ops::Scan, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
    use crate::{call, full};
    let (c, x) = (s.num_carry, s.num_xs);
    let body = &s.body;
    let k = body.inputs.len() - c - x;
    let ny = body.outputs.len() - c;
    let float = |t: &TensorType| t.dtype.is_float();
    let in_types = body.input_types();
    let out_types = body.output_types();
    // Body inputs to differentiate: float carries always (the gradient
    // flows through them), float xs and consts when asked for.
    let wrt: Vec<usize> = (0..body.inputs.len())
        .filter(|&i| float(&in_types[i]) && (i < c || a.needs[i]))
        .collect();
    let names: Vec<&str> = wrt.iter().map(|&i| body.inputs[i].name.as_str()).collect();
    let g = vjp(body, &names).map_err(|e| format!("differentiating the scan body: {e}"))?;
    let float_out: Vec<usize> = (0..body.outputs.len())
        .filter(|&o| float(&out_types[o]))
        .collect();
    let carry_wrt: Vec<usize> = wrt.iter().copied().filter(|&i| i < c).collect();
    let x_wrt: Vec<usize> = wrt
        .iter()
        .copied()
        .filter(|&i| (c..c + x).contains(&i))
        .collect();
    let k_wrt: Vec<usize> = wrt.iter().copied().filter(|&i| i >= c + x).collect();
    let zero = |t: &TensorType| full(t.clone(), 0.0);
    let ct = |r: usize, t: &TensorType| a.cotangents[r].unwrap_or_else(|| zero(t));
    // Backward carry: d(carry) for float carries, running sums for consts.
    let mut carry_init: Vec<(String, Tensor)> = carry_wrt
        .iter()
        .map(|&i| (format!("g_carry.{i}"), ct(i, &in_types[i])))
        .collect();
    carry_init.extend(
        k_wrt
            .iter()
            .map(|&i| (format!("g_const.{i}"), zero(&in_types[i]))),
    );
    // Backward xs: the forward carries, xs, the ys' and history's cotangents.
    let hist_at = c + ny;
    let mut xs: Vec<(String, Tensor)> = (0..c)
        .map(|i| (format!("hist.{i}"), a.results[hist_at + i]))
        .collect();
    xs.extend((0..x).map(|j| (format!("x.{j}"), a.operands[c + j])));
    let y_float: Vec<usize> = float_out.iter().copied().filter(|&o| o >= c).collect();
    xs.extend(y_float.iter().map(|&o| {
        (
            format!("gy.{o}"),
            ct(o, &crate::ops::stacked(s.length, &out_types[o])),
        )
    }));
    xs.extend(carry_wrt.iter().map(|&i| {
        (
            format!("ghist.{i}"),
            ct(hist_at + i, &crate::ops::stacked(s.length, &in_types[i])),
        )
    }));
    let consts: Vec<(String, Tensor)> = (0..k)
        .map(|j| (format!("k.{j}"), a.operands[c + x + j]))
        .collect();
    fn as_str(v: &[(String, Tensor)]) -> Vec<(&str, Tensor)> {
        v.iter().map(|(n, t)| (n.as_str(), *t)).collect()
    }
    let body_in = |i: usize, inp: &crate::Inputs| -> Tensor {
        if i < c {
            inp[format!("hist.{i}").as_str()]
        } else if i < c + x {
            inp[format!("x.{}", i - c).as_str()]
        } else {
            inp[format!("k.{}", i - c - x).as_str()]
        }
    };
    let (final_carry, ys) = crate::tensor::scan_with(
        &as_str(&carry_init),
        &as_str(&xs),
        &as_str(&consts),
        !s.reverse,
        |inp| {
            let mut args: Vec<Tensor> = (0..body.inputs.len()).map(|i| body_in(i, inp)).collect();
            for &o in &float_out {
                args.push(if o < c {
                    if carry_wrt.contains(&o) {
                        inp[format!("g_carry.{o}").as_str()]
                    } else {
                        zero(&out_types[o])
                    }
                } else {
                    inp[format!("gy.{o}").as_str()]
                });
            }
            let r = call(&g, &args);
            let grads = &r[body.outputs.len()..];
            let grad_of = |i: usize| grads[wrt.iter().position(|&w| w == i).expect("in wrt")];
            let mut carry: Vec<Tensor> = carry_wrt
                .iter()
                .map(|&i| grad_of(i) + inp[format!("ghist.{i}").as_str()])
                .collect();
            carry.extend(
                k_wrt
                    .iter()
                    .map(|&i| inp[format!("g_const.{i}").as_str()] + grad_of(i)),
            );
            let ys: Vec<Tensor> = x_wrt.iter().map(|&i| grad_of(i)).collect();
            (carry, ys)
        },
    );
    let mut out: Vec<Option<Tensor>> = vec![None; a.operands.len()];
    for (n, &i) in carry_wrt.iter().enumerate() {
        out[i] = a.needs[i].then_some(final_carry[n]);
    }
    for (n, &i) in k_wrt.iter().enumerate() {
        out[i] = a.needs[i].then_some(final_carry[carry_wrt.len() + n]);
    }
    for (n, &i) in x_wrt.iter().enumerate() {
        out[i] = Some(ys[n]);
    }
    Ok(out)
}
