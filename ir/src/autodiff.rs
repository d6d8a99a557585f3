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

use std::collections::HashMap;

use crate::graph::ValueId;
use crate::op::{Op, Vjp};
use crate::ops::OptimizationBarrier;
use crate::trace::{apply, replay, restore_scope, set_scope, with_current};
use crate::{call, full, trace, Function, Node, Outputs, Tensor, TensorType, TraceError};

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
    let wrt_index = wrt_indices(f, wrt)?;
    let seeded = seeded_outputs(f, &seeds);
    let active = active(f, &wrt_index, &seeded);
    let inputs = grad_inputs(f, &seeds, &seeded);
    // A failing rule stops the backward pass; the trace still completes.
    let mut rule_error = None;
    let name = format!("{}_grad", f.name);
    let g = trace(&name, &inputs, |ins| {
        let tensors = ins.tensors();
        let saved_checkpoint = with_current(|b| b.checkpoint.take());
        // Forward: every node, in its scope.
        let vals = replay(f, &tensors[..f.inputs.len()]);
        let mut backward = Backward::new(f, &active, vals);
        backward.seed(&seeds, &seeded, &tensors[f.inputs.len()..]);
        rule_error = backward.run().err();
        with_current(|b| b.checkpoint = saved_checkpoint);
        backward.outputs(keep_primal, &wrt_index)
    })?;
    match rule_error {
        Some(e) => Err(e),
        None => Ok(g),
    }
}

/// The indices of the `wrt` inputs, each checked to exist and be a float.
fn wrt_indices(f: &Function, wrt: &[&str]) -> Result<Vec<usize>, AutodiffError> {
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
    Ok(wrt_index)
}

/// The indices of the outputs the backward pass starts from.
fn seeded_outputs(f: &Function, seeds: &Seeds) -> Vec<usize> {
    match seeds {
        Seeds::Loss(i) => vec![*i],
        Seeds::Inputs => (0..f.outputs.len())
            .filter(|&i| f.ty(f.outputs[i].value).dtype.is_float())
            .collect(),
    }
}

/// Values that get backward work: varying and useful.
fn active(f: &Function, wrt_index: &[usize], seeded: &[usize]) -> Vec<bool> {
    let varies = varying(f, wrt_index);
    let useful = useful(
        f,
        &seeded
            .iter()
            .map(|&i| f.outputs[i].value)
            .collect::<Vec<_>>(),
    );
    varies.iter().zip(&useful).map(|(a, b)| *a && *b).collect()
}

/// The gradient function's inputs: `f`'s, then with [`Seeds::Inputs`] one
/// `cotangents.<output>` per seeded output.
fn grad_inputs(f: &Function, seeds: &Seeds, seeded: &[usize]) -> Vec<(String, TensorType)> {
    let mut inputs: Vec<(String, TensorType)> = f
        .inputs
        .iter()
        .map(|b| (b.name.clone(), f.ty(b.value).clone()))
        .collect();
    if let Seeds::Inputs = seeds {
        for &i in seeded {
            let b = &f.outputs[i];
            inputs.push((format!("cotangents.{}", b.name), f.ty(b.value).clone()));
        }
    }
    inputs
}

/// The backward pass as it is traced: nodes in reverse, each active node's
/// rule turning its results' cotangents into its operands'.
struct Backward<'a> {
    f: &'a Function,
    active: &'a [bool],
    /// The replayed forward's values, by value index.
    vals: Vec<Option<Tensor>>,
    /// Cotangent contributions per value, summed only when it is read.
    ct: Vec<Vec<Tensor>>,
    /// Rematerialized copies of checkpointed values, per group.
    remat: HashMap<u32, Vec<Option<Tensor>>>,
}

impl<'a> Backward<'a> {
    fn new(f: &'a Function, active: &'a [bool], vals: Vec<Option<Tensor>>) -> Self {
        Backward {
            f,
            active,
            vals,
            ct: vec![Vec::new(); f.values.len()],
            remat: HashMap::new(),
        }
    }

    /// Seeds the seeded outputs: 1 for the loss, else the cotangent inputs
    /// (`cotangent_inputs`, in `seeded` order).
    fn seed(&mut self, seeds: &Seeds, seeded: &[usize], cotangent_inputs: &[Tensor]) {
        let f = self.f;
        match seeds {
            Seeds::Loss(i) => self.ct[f.outputs[*i].value.index()].push(full(
                TensorType::scalar(f.ty(f.outputs[*i].value).dtype),
                1.0,
            )),
            Seeds::Inputs => {
                for (k, &i) in seeded.iter().enumerate() {
                    self.ct[f.outputs[i].value.index()].push(cotangent_inputs[k]);
                }
            }
        }
    }

    /// Every node, last first; stops at the first rule that fails.
    fn run(&mut self) -> Result<(), AutodiffError> {
        for n in (0..self.f.nodes.len()).rev() {
            self.node(n)?;
        }
        Ok(())
    }

    /// Node `n`'s VJP, in a `backward.` scope, when it has active operands
    /// and results and some result has a cotangent.
    fn node(&mut self, n: usize) -> Result<(), AutodiffError> {
        let node = &self.f.nodes[n];
        let needs: Vec<bool> = node
            .operands
            .iter()
            .map(|o| self.active[o.index()])
            .collect();
        if !needs.iter().any(|&x| x) || !node.results.iter().any(|r| self.active[r.index()]) {
            return Ok(());
        }
        let mut cotangents: Vec<Option<Tensor>> = node
            .results
            .iter()
            .map(|r| sum(&self.ct[r.index()]))
            .collect();
        if cotangents.iter().all(Option::is_none) {
            return Ok(());
        }
        let saved = set_scope(format!("backward.{}", node.scope).trim_end_matches('.'));
        let view = self.forward_view(n, &mut cotangents);
        let operands = defined(view, &node.operands);
        let results = defined(view, &node.results);
        let grads = node.op.rule().vjp(&Vjp {
            operands: &operands,
            results: &results,
            cotangents: &cotangents,
            needs: &needs,
        });
        restore_scope(saved);
        let grads = grads.map_err(|message| rule_error(node, message))?;
        self.accumulate(node, grads, &needs)
    }

    /// The forward values node `n`'s rule sees: for a checkpointed node its
    /// group's recomputed copy, built when the backward first reaches the
    /// group (which also routes `cotangents` through the group's barrier).
    fn forward_view(
        &mut self,
        n: usize,
        cotangents: &mut Vec<Option<Tensor>>,
    ) -> &[Option<Tensor>] {
        let (f, vals) = (self.f, &self.vals);
        match f.nodes[n].checkpoint {
            None => vals,
            Some(group) => self.remat.entry(group).or_insert_with(|| {
                let (copy, ordered) = rematerialize(f, group, n, vals, cotangents);
                *cotangents = ordered;
                copy
            }),
        }
    }

    /// Adds the operands' gradients to their cotangents, each checked to
    /// have its operand's type (the last mismatch is the error).
    fn accumulate(
        &mut self,
        node: &Node,
        grads: Vec<Option<Tensor>>,
        needs: &[bool],
    ) -> Result<(), AutodiffError> {
        let mut mismatch = None;
        for ((o, g), need) in node.operands.iter().zip(grads).zip(needs) {
            if let (Some(g), true) = (g, need) {
                let (want, got) = (self.f.ty(*o), g.ty());
                if *want != got {
                    mismatch = Some(rule_error(
                        node,
                        format!("its rule gave a {got} gradient for a {want} operand"),
                    ));
                }
                self.ct[o.index()].push(g);
            }
        }
        mismatch.map_or(Ok(()), Err)
    }

    /// `f`'s outputs if `keep_primal`, then `grads.<input>` per `wrt` input
    /// (zero where no cotangent reached it).
    fn outputs(&self, keep_primal: bool, wrt_index: &[usize]) -> Outputs {
        let f = self.f;
        let mut out = Outputs::new();
        if keep_primal {
            for b in &f.outputs {
                out = out.add(b.name.clone(), self.vals[b.value.index()].expect("defined"));
            }
        }
        for &i in wrt_index {
            let b = &f.inputs[i];
            let g =
                sum(&self.ct[b.value.index()]).unwrap_or_else(|| full(f.ty(b.value).clone(), 0.0));
            out = out.add(format!("grads.{}", b.name), g);
        }
        out
    }
}

/// The tensors of `ids` in `vals`, all defined.
fn defined(vals: &[Option<Tensor>], ids: &[ValueId]) -> Vec<Tensor> {
    ids.iter()
        .map(|v| vals[v.index()].expect("defined"))
        .collect()
}

/// A failing VJP rule of `node`, named by its op and scope.
fn rule_error(node: &Node, message: String) -> AutodiffError {
    AutodiffError::Rule {
        op: node.op.name().into(),
        scope: node.scope.clone(),
        message,
    }
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
    let v = ScanVjp::new(s, a);
    let names: Vec<&str> = v
        .wrt
        .iter()
        .map(|&i| s.body.inputs[i].name.as_str())
        .collect();
    let g = vjp(&s.body, &names).map_err(|e| format!("differentiating the scan body: {e}"))?;
    let carry_init = v.carry_init();
    let xs = v.xs();
    let consts = v.consts();
    fn as_str(v: &[(String, Tensor)]) -> Vec<(&str, Tensor)> {
        v.iter().map(|(n, t)| (n.as_str(), *t)).collect()
    }
    let (final_carry, ys) = crate::tensor::scan_with(
        &as_str(&carry_init),
        &as_str(&xs),
        &as_str(&consts),
        !s.reverse,
        |inp| v.step(&g, inp),
    );
    Ok(v.operand_cotangents(&final_carry, &ys))
}

/// A scan's VJP as it is built: the forward scan, what its rule got, and
/// which body inputs and outputs the body's VJP covers (indices into the
/// body's inputs and outputs).
struct ScanVjp<'a, 'b> {
    s: &'a crate::ops::Scan,
    a: &'a Vjp<'b>,
    in_types: Vec<TensorType>,
    out_types: Vec<TensorType>,
    /// Body inputs to differentiate: float carries always (the gradient
    /// flows through them), float xs and consts when asked for.
    wrt: Vec<usize>,
    /// `wrt` split into carries, xs and consts.
    carry_wrt: Vec<usize>,
    x_wrt: Vec<usize>,
    k_wrt: Vec<usize>,
    /// Float body outputs: the body's VJP takes a cotangent for each.
    float_out: Vec<usize>,
}

impl<'a, 'b> ScanVjp<'a, 'b> {
    fn new(s: &'a crate::ops::Scan, a: &'a Vjp<'b>) -> Self {
        let (c, x) = (s.num_carry, s.num_xs);
        let body = &s.body;
        let in_types = body.input_types();
        let out_types = body.output_types();
        let wrt: Vec<usize> = (0..body.inputs.len())
            .filter(|&i| in_types[i].dtype.is_float() && (i < c || a.needs[i]))
            .collect();
        let float_out: Vec<usize> = (0..body.outputs.len())
            .filter(|&o| out_types[o].dtype.is_float())
            .collect();
        let carry_wrt: Vec<usize> = wrt.iter().copied().filter(|&i| i < c).collect();
        let x_wrt: Vec<usize> = wrt
            .iter()
            .copied()
            .filter(|&i| (c..c + x).contains(&i))
            .collect();
        let k_wrt: Vec<usize> = wrt.iter().copied().filter(|&i| i >= c + x).collect();
        ScanVjp {
            s,
            a,
            in_types,
            out_types,
            wrt,
            carry_wrt,
            x_wrt,
            k_wrt,
            float_out,
        }
    }

    /// The cotangent of the scan's result `r` (of type `t`), zero if none.
    fn ct(&self, r: usize, t: &TensorType) -> Tensor {
        self.a.cotangents[r].unwrap_or_else(|| full(t.clone(), 0.0))
    }

    /// Backward carry: d(carry) for float carries, running sums for consts.
    fn carry_init(&self) -> Vec<(String, Tensor)> {
        let mut carry_init: Vec<(String, Tensor)> = self
            .carry_wrt
            .iter()
            .map(|&i| (format!("g_carry.{i}"), self.ct(i, &self.in_types[i])))
            .collect();
        carry_init.extend(
            self.k_wrt
                .iter()
                .map(|&i| (format!("g_const.{i}"), full(self.in_types[i].clone(), 0.0))),
        );
        carry_init
    }

    /// Backward xs: the forward carries, xs, the ys' and history's cotangents.
    fn xs(&self) -> Vec<(String, Tensor)> {
        let (s, a) = (self.s, self.a);
        let (c, x) = (s.num_carry, s.num_xs);
        // The scan's results: the final carry, the ys, the carry history.
        let ny = s.body.outputs.len() - c;
        let hist_at = c + ny;
        let mut xs: Vec<(String, Tensor)> = (0..c)
            .map(|i| (format!("hist.{i}"), a.results[hist_at + i]))
            .collect();
        xs.extend((0..x).map(|j| (format!("x.{j}"), a.operands[c + j])));
        let y_float: Vec<usize> = self.float_out.iter().copied().filter(|&o| o >= c).collect();
        xs.extend(y_float.iter().map(|&o| {
            (
                format!("gy.{o}"),
                self.ct(o, &crate::ops::stacked(s.length, &self.out_types[o])),
            )
        }));
        xs.extend(self.carry_wrt.iter().map(|&i| {
            (
                format!("ghist.{i}"),
                self.ct(
                    hist_at + i,
                    &crate::ops::stacked(s.length, &self.in_types[i]),
                ),
            )
        }));
        xs
    }

    /// Backward consts: the forward's.
    fn consts(&self) -> Vec<(String, Tensor)> {
        let (c, x) = (self.s.num_carry, self.s.num_xs);
        let k = self.s.body.inputs.len() - c - x;
        (0..k)
            .map(|j| (format!("k.{j}"), self.a.operands[c + x + j]))
            .collect()
    }

    /// One backward step: the body's VJP `g` at this step's forward inputs,
    /// its gradients added to the carried cotangents and sums.
    fn step(&self, g: &Function, inp: &crate::Inputs) -> (Vec<Tensor>, Vec<Tensor>) {
        let r = call(g, &self.body_vjp_args(inp));
        let grads = &r[self.s.body.outputs.len()..];
        let grad_of = |i: usize| grads[self.wrt.iter().position(|&w| w == i).expect("in wrt")];
        let mut carry: Vec<Tensor> = self
            .carry_wrt
            .iter()
            .map(|&i| grad_of(i) + inp[format!("ghist.{i}").as_str()])
            .collect();
        carry.extend(
            self.k_wrt
                .iter()
                .map(|&i| inp[format!("g_const.{i}").as_str()] + grad_of(i)),
        );
        let ys: Vec<Tensor> = self.x_wrt.iter().map(|&i| grad_of(i)).collect();
        (carry, ys)
    }

    /// The body VJP's arguments at one step: the body's inputs (the carry
    /// from the history), then a cotangent per float output (zero for a
    /// carry the gradient does not flow through).
    fn body_vjp_args(&self, inp: &crate::Inputs) -> Vec<Tensor> {
        let (c, x) = (self.s.num_carry, self.s.num_xs);
        let mut args: Vec<Tensor> = (0..self.s.body.inputs.len())
            .map(|i| {
                if i < c {
                    inp[format!("hist.{i}").as_str()]
                } else if i < c + x {
                    inp[format!("x.{}", i - c).as_str()]
                } else {
                    inp[format!("k.{}", i - c - x).as_str()]
                }
            })
            .collect();
        for &o in &self.float_out {
            args.push(if o < c {
                if self.carry_wrt.contains(&o) {
                    inp[format!("g_carry.{o}").as_str()]
                } else {
                    full(self.out_types[o].clone(), 0.0)
                }
            } else {
                inp[format!("gy.{o}").as_str()]
            });
        }
        args
    }

    /// The scan operands' cotangents from the backward scan's final carry
    /// and stacked ys (`None` for operands that need none).
    fn operand_cotangents(&self, final_carry: &[Tensor], ys: &[Tensor]) -> Vec<Option<Tensor>> {
        let needs = self.a.needs;
        let mut out: Vec<Option<Tensor>> = vec![None; self.a.operands.len()];
        for (n, &i) in self.carry_wrt.iter().enumerate() {
            out[i] = needs[i].then_some(final_carry[n]);
        }
        for (n, &i) in self.k_wrt.iter().enumerate() {
            out[i] = needs[i].then_some(final_carry[self.carry_wrt.len() + n]);
        }
        for (n, &i) in self.x_wrt.iter().enumerate() {
            out[i] = Some(ys[n]);
        }
        out
    }
}
