//! Tracing: Rust code on [`Tensor`] handles records a [`Function`].
//!
//! Builders live on a thread-local stack (nested traces are loop bodies).
//! A `Tensor` is a `Copy` handle (trace id, value id) into its builder. The
//! first shape or dtype error is recorded on the builder ("sticky") and
//! returned when tracing finishes; later ops on its poisoned results record
//! nothing, so model code needs no `?` after every op.
//!
//! A little over our ~500-line guide: the builder stack, handles, inputs
//! and outputs, scopes and calls share private state and are read together.

use std::cell::RefCell;
use std::fmt;
use std::ops::Index;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::graph::{Binding, Node, ValueDef, ValueId, ValueInfo};
use crate::op::Op;
use crate::{DType, Function, TensorType};

/// A shape or dtype error found while tracing, naming the op and the scope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct TraceError {
    pub op: String,
    /// Dotted scope, empty at top level.
    pub scope: String,
    pub operands: Vec<TensorType>,
    pub message: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scope = if self.scope.is_empty() {
            "top level".to_string()
        } else {
            format!("`{}`", self.scope)
        };
        write!(f, "{} in {scope}: {}", self.op, self.message)?;
        if !self.operands.is_empty() {
            let ops: Vec<String> = self.operands.iter().map(ToString::to_string).collect();
            write!(f, " (operands {})", ops.join(", "))?;
        }
        Ok(())
    }
}

/// A traced value: a cheap handle into the trace that made it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tensor {
    pub(crate) trace: u32,
    pub(crate) value: ValueId,
}

pub(crate) struct Builder {
    id: u32,
    f: Function,
    scope: Vec<String>,
    /// The open rematerialization group, if any.
    pub(crate) checkpoint: Option<u32>,
    error: Option<TraceError>,
    poisoned: Vec<bool>,
}

impl Builder {
    /// The current dotted scope, or the function's name at top level.
    pub(crate) fn scope_name(&self) -> String {
        if self.scope.is_empty() {
            self.f.name.clone()
        } else {
            self.scope.join(".")
        }
    }

    fn new_value(&mut self, ty: TensorType, def: ValueDef, poisoned: bool) -> ValueId {
        let id = ValueId(self.f.values.len() as u32);
        self.f.values.push(ValueInfo { ty, def });
        self.poisoned.push(poisoned);
        id
    }

    fn fail(&mut self, op: &str, operands: Vec<TensorType>, message: String) {
        if self.error.is_none() {
            self.error = Some(TraceError {
                op: op.to_string(),
                scope: self.scope.join("."),
                operands,
                message,
            });
        }
    }

    /// Appends `op` on `operands`; on error records it and returns poisoned
    /// results (`n_results` of them, of the op's own result types where it
    /// can say, since model code reads dims on until the trace ends with
    /// its first error; else typed like the first operand).
    fn push(&mut self, op: Op, operands: &[ValueId], n_results: usize) -> Vec<ValueId> {
        let types: Vec<TensorType> = operands.iter().map(|o| self.f.ty(*o).clone()).collect();
        let results = op.infer(&types);
        let poisoned = |b: &mut Builder, inferred: Option<&Vec<TensorType>>| {
            let tys = match inferred {
                Some(r) if r.len() == n_results => r.clone(),
                _ => {
                    let first = types.first().cloned();
                    vec![first.unwrap_or_else(|| TensorType::scalar(DType::F32)); n_results]
                }
            };
            tys.into_iter()
                .map(|ty| b.new_value(ty, ValueDef::Input(usize::MAX), true))
                .collect()
        };
        if operands.iter().any(|o| self.poisoned[o.index()]) {
            return poisoned(self, results.as_ref().ok());
        }
        if let Some(t) = results
            .iter()
            .flatten()
            .find(|t| t.checked_bytes().is_none())
        {
            self.fail(op.name(), types.clone(), too_large(t));
            return poisoned(self, results.as_ref().ok());
        }
        match results {
            Ok(results) => {
                let node = self.f.nodes.len();
                let ids: Vec<ValueId> = results
                    .into_iter()
                    .enumerate()
                    .map(|(output, ty)| self.new_value(ty, ValueDef::Node { node, output }, false))
                    .collect();
                self.f.nodes.push(Node {
                    op,
                    operands: operands.to_vec(),
                    results: ids.clone(),
                    scope: self.scope.join("."),
                    checkpoint: self.checkpoint,
                });
                ids
            }
            Err(message) => {
                self.fail(op.name(), types.clone(), message);
                poisoned(self, None)
            }
        }
    }
}

/// Why a tensor of type `t` cannot be made: its bytes pass what a
/// program addresses (a user's sizes multiplied past i64).
fn too_large(t: &TensorType) -> String {
    format!(
        "a tensor of {} would hold more bytes than a program can address (2^63); use smaller sizes",
        t.mlir()
    )
}

thread_local! {
    static STACK: RefCell<Vec<Builder>> = const { RefCell::new(Vec::new()) };
}

static NEXT_TRACE: AtomicU32 = AtomicU32::new(1);

/// Runs `f` on the innermost active builder.
pub(crate) fn with_current<R>(f: impl FnOnce(&mut Builder) -> R) -> R {
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        let b = s.last_mut().expect("tensor op outside of hlo_ir::trace");
        f(b)
    })
}

/// The ids of `tensors` in the innermost trace; a tensor of another trace is
/// recorded as an error there (and poisons the result).
fn resolve(b: &mut Builder, op: &str, tensors: &[Tensor]) -> Option<Vec<ValueId>> {
    if tensors.iter().any(|t| t.trace != b.id) {
        b.fail(
            op,
            vec![],
            "uses a tensor of another trace (a loop body must take what it uses as loop-carried values)".into(),
        );
        return None;
    }
    Some(tensors.iter().map(|t| t.value).collect())
}

/// Appends `op` on `operands` to the current trace and returns its results.
pub(crate) fn apply(op: Op, operands: &[Tensor], n_results: usize) -> Vec<Tensor> {
    with_current(|b| {
        let name = op.name();
        let ids = match resolve(b, name, operands) {
            Some(ids) => b.push(op, &ids, n_results),
            None => (0..n_results)
                .map(|_| {
                    b.new_value(
                        TensorType::scalar(DType::F32),
                        ValueDef::Input(usize::MAX),
                        true,
                    )
                })
                .collect(),
        };
        ids.into_iter()
            .map(|value| Tensor { trace: b.id, value })
            .collect()
    })
}

/// Appends a one-result op.
pub(crate) fn apply1(op: Op, operands: &[Tensor]) -> Tensor {
    apply(op, operands, 1)[0]
}

/// Records an error found by a `Tensor` method itself (before any op).
pub(crate) fn fail(op: &str, operands: &[Tensor], message: String) -> Tensor {
    with_current(|b| {
        let types = operands
            .iter()
            .filter(|t| t.trace == b.id)
            .map(|t| b.f.ty(t.value).clone())
            .collect::<Vec<_>>();
        let any_poisoned = operands
            .iter()
            .any(|t| t.trace == b.id && b.poisoned[t.value.index()]);
        if !any_poisoned {
            b.fail(op, types.clone(), message);
        }
        let ty = types
            .first()
            .cloned()
            .unwrap_or_else(|| TensorType::scalar(DType::F32));
        let value = b.new_value(ty, ValueDef::Input(usize::MAX), true);
        Tensor { trace: b.id, value }
    })
}

impl Tensor {
    /// The tensor's type (a poisoned tensor reports a placeholder type).
    pub fn ty(&self) -> TensorType {
        STACK.with(|s| {
            let s = s.borrow();
            let b = s
                .iter()
                .rev()
                .find(|b| b.id == self.trace)
                .expect("tensor used after its trace ended");
            b.f.ty(self.value).clone()
        })
    }

    pub fn dims(&self) -> Vec<i64> {
        self.ty().dims
    }

    pub fn dtype(&self) -> DType {
        self.ty().dtype
    }

    pub fn rank(&self) -> usize {
        self.ty().rank()
    }
}

/// Runs `f` with `name` appended to the current scope (`layers.3`, then
/// `self_attn`, ...). Scopes name nodes in errors, MLIR locations and HLO
/// metadata.
pub fn scope<R>(name: &str, f: impl FnOnce() -> R) -> R {
    with_current(|b| b.scope.push(name.to_string()));
    let r = f();
    with_current(|b| {
        b.scope.pop();
    });
    r
}

static NEXT_CHECKPOINT: AtomicU32 = AtomicU32::new(1);

/// Like [`scope`], and marks what `f` traces for rematerialization: the
/// gradient recomputes it in the backward pass instead of keeping its
/// activations (a nested checkpoint joins the outer one).
pub fn checkpoint<R>(name: &str, f: impl FnOnce() -> R) -> R {
    let outer = with_current(|b| {
        let outer = b.checkpoint;
        if outer.is_none() {
            b.checkpoint = Some(NEXT_CHECKPOINT.fetch_add(1, Ordering::Relaxed));
        }
        outer
    });
    let r = scope(name, f);
    with_current(|b| b.checkpoint = outer);
    r
}

/// Replaces the current scope path (autodiff replays nodes in their scope).
pub(crate) fn set_scope(path: &str) -> Vec<String> {
    with_current(|b| {
        let new = if path.is_empty() {
            Vec::new()
        } else {
            vec![path.to_string()]
        };
        std::mem::replace(&mut b.scope, new)
    })
}

/// Restores a scope saved by [`set_scope`].
pub(crate) fn restore_scope(saved: Vec<String>) {
    with_current(|b| b.scope = saved);
}

/// The named inputs of a trace.
#[derive(Clone)]
pub struct Inputs {
    names: Vec<String>,
    tensors: Vec<Tensor>,
}

impl Inputs {
    pub fn get(&self, name: &str) -> Option<Tensor> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| self.tensors[i])
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// These inputs with the named ones bound to other tensors, and names
    /// they lack added: a model function called on them reads `overrides`
    /// in their place (a preference loss's reference reads its own LoRA
    /// tensors so, on modules the policy's adapter may not target).
    pub fn with_overrides(&self, overrides: &[(String, Tensor)]) -> Inputs {
        let mut out = self.clone();
        for (name, t) in overrides {
            match out.names.iter().position(|n| n == name) {
                Some(i) => out.tensors[i] = *t,
                None => {
                    out.names.push(name.clone());
                    out.tensors.push(*t);
                }
            }
        }
        out
    }
}

impl Index<usize> for Inputs {
    type Output = Tensor;
    fn index(&self, i: usize) -> &Tensor {
        &self.tensors[i]
    }
}

impl Index<&str> for Inputs {
    type Output = Tensor;
    /// Panics on a name the trace did not declare (a bug in model code).
    fn index(&self, name: &str) -> &Tensor {
        let i = self
            .names
            .iter()
            .position(|n| n == name)
            .unwrap_or_else(|| panic!("no input named `{name}`"));
        &self.tensors[i]
    }
}

/// The named outputs a traced closure returns.
#[derive(Default)]
pub struct Outputs(pub Vec<(String, Tensor)>);

impl Outputs {
    pub fn new() -> Self {
        Outputs(Vec::new())
    }

    pub fn add(mut self, name: impl Into<String>, t: Tensor) -> Self {
        self.0.push((name.into(), t));
        self
    }
}

impl From<Tensor> for Outputs {
    fn from(t: Tensor) -> Self {
        Outputs(vec![("out".into(), t)])
    }
}

impl<S: Into<String>> From<Vec<(S, Tensor)>> for Outputs {
    fn from(v: Vec<(S, Tensor)>) -> Self {
        Outputs(v.into_iter().map(|(n, t)| (n.into(), t)).collect())
    }
}

impl From<Vec<Tensor>> for Outputs {
    fn from(v: Vec<Tensor>) -> Self {
        Outputs(
            v.into_iter()
                .enumerate()
                .map(|(i, t)| (i.to_string(), t))
                .collect(),
        )
    }
}

/// Traces `f` on inputs of the given names and types into a [`Function`].
///
/// ```
/// use hlo_ir::{trace, DType, TensorType};
/// let t = TensorType::new(DType::F32, [2, 3]);
/// let f = trace("axpy", &[("a", TensorType::scalar(DType::F32)), ("x", t.clone()), ("y", t)], |i| {
///     i["a"] * i["x"] + i["y"]
/// })
/// .unwrap();
/// assert_eq!(f.outputs.len(), 1);
/// ```
pub fn trace<N, O>(
    name: &str,
    inputs: &[(N, TensorType)],
    f: impl FnOnce(&Inputs) -> O,
) -> Result<Function, TraceError>
where
    N: AsRef<str>,
    O: Into<Outputs>,
{
    check_input_names_unique(inputs)?;
    let id = NEXT_TRACE.fetch_add(1, Ordering::Relaxed);
    let mut b = new_builder(id, name);
    check_input_sizes(inputs)?;
    let args = bind_inputs(&mut b, inputs);
    let (mut b, outputs) = run_on_stack(b, &args, f);
    bind_outputs(&mut b, outputs);
    finish_trace(b)
}

/// Rejects a repeated input name: inputs are found by name, so two of one
/// name would leave one unread.
fn check_input_names_unique<N: AsRef<str>>(inputs: &[(N, TensorType)]) -> Result<(), TraceError> {
    let mut seen = std::collections::HashSet::new();
    if let Some((n, ty)) = inputs.iter().find(|(n, _)| !seen.insert(n.as_ref())) {
        return Err(TraceError {
            op: "input".into(),
            scope: String::new(),
            operands: vec![ty.clone()],
            message: format!("the input `{}` is named twice", n.as_ref()),
        });
    }
    Ok(())
}

/// Rejects an input whose byte size overflows, before any value is made of it.
fn check_input_sizes<N: AsRef<str>>(inputs: &[(N, TensorType)]) -> Result<(), TraceError> {
    if let Some((n, ty)) = inputs.iter().find(|(_, t)| t.checked_bytes().is_none()) {
        return Err(TraceError {
            op: "input".into(),
            scope: String::new(),
            operands: vec![ty.clone()],
            message: format!("`{}`: {}", n.as_ref(), too_large(ty)),
        });
    }
    Ok(())
}

/// A fresh builder for trace `id`, with an empty function called `name`.
fn new_builder(id: u32, name: &str) -> Builder {
    Builder {
        id,
        f: Function {
            name: name.to_string(),
            ..Function::default()
        },
        scope: Vec::new(),
        checkpoint: None,
        error: None,
        poisoned: Vec::new(),
    }
}

/// Makes one input value per input, in order, binds each under its name, and
/// returns the tensors `f` will see.
fn bind_inputs<N: AsRef<str>>(b: &mut Builder, inputs: &[(N, TensorType)]) -> Inputs {
    let mut tensors = Vec::with_capacity(inputs.len());
    for (i, (n, ty)) in inputs.iter().enumerate() {
        let value = b.new_value(ty.clone(), ValueDef::Input(i), false);
        b.f.inputs.push(Binding {
            name: n.as_ref().to_string(),
            value,
        });
        tensors.push(Tensor { trace: b.id, value });
    }
    Inputs {
        names: inputs.iter().map(|(n, _)| n.as_ref().to_string()).collect(),
        tensors,
    }
}

/// Runs `f` with `b` as the current builder, and takes `b` back with what `f`
/// returned; the builder is popped even if `f` panics, so the stack stays
/// consistent.
fn run_on_stack<O: Into<Outputs>>(
    b: Builder,
    args: &Inputs,
    f: impl FnOnce(&Inputs) -> O,
) -> (Builder, Outputs) {
    STACK.with(|s| s.borrow_mut().push(b));
    struct PopOnUnwind;
    impl Drop for PopOnUnwind {
        fn drop(&mut self) {
            STACK.with(|s| {
                s.borrow_mut().pop();
            });
        }
    }
    let guard = PopOnUnwind;
    let outputs: Outputs = f(args).into();
    std::mem::forget(guard);
    let b = STACK.with(|s| s.borrow_mut().pop()).expect("pushed above");
    (b, outputs)
}

/// Binds each output in order; one from another trace is recorded as the
/// trace's error (if it is the first) and left out.
fn bind_outputs(b: &mut Builder, outputs: Outputs) {
    for (name, t) in outputs.0 {
        if t.trace != b.id {
            b.fail(
                "output",
                vec![],
                format!("output `{name}` is a tensor of another trace"),
            );
            continue;
        }
        b.f.outputs.push(Binding {
            name,
            value: t.value,
        });
    }
}

/// The traced function, or the first error recorded while tracing, or an
/// error for an output that is a poisoned (untraced) value.
fn finish_trace(b: Builder) -> Result<Function, TraceError> {
    if let Some(e) = b.error {
        return Err(e);
    }
    if let Some(b2) = b.f.outputs.iter().find(|o| b.poisoned[o.value.index()]) {
        return Err(TraceError {
            op: "output".into(),
            scope: String::new(),
            operands: vec![],
            message: format!("output `{}` is not a traced value", b2.name),
        });
    }
    debug_assert_eq!(b.f.verify(), Ok(()));
    Ok(b.f)
}

/// Replays `f`'s nodes into the current trace on `args` (its inputs), each in
/// its own scope under the current one; returns the value of every value of
/// `f` (by value id).
pub(crate) fn replay(f: &Function, args: &[Tensor]) -> Vec<Option<Tensor>> {
    replay_with(f, args, &|_, _| None)
}

/// A replay hook: a node's results computed another way, or `None`.
pub(crate) type Special = dyn Fn(&crate::graph::Node, &[Tensor]) -> Option<Vec<Tensor>>;

/// Like [`replay`], with `special` given the first say on each node: it may
/// return the node's results computed some other way.
pub(crate) fn replay_with(f: &Function, args: &[Tensor], special: &Special) -> Vec<Option<Tensor>> {
    let mut vals: Vec<Option<Tensor>> = vec![None; f.values.len()];
    for (b, t) in f.inputs.iter().zip(args) {
        vals[b.value.index()] = Some(*t);
    }
    let outer = with_current(|b| b.scope.join("."));
    for node in &f.nodes {
        let operands: Vec<Tensor> = node
            .operands
            .iter()
            .map(|o| vals[o.index()].expect("defined before use"))
            .collect();
        let path = match (outer.is_empty(), node.scope.is_empty()) {
            (true, _) => node.scope.clone(),
            (false, true) => outer.clone(),
            (false, false) => format!("{outer}.{}", node.scope),
        };
        let saved = set_scope(&path);
        let results = special(node, &operands)
            .unwrap_or_else(|| apply(node.op.clone(), &operands, node.results.len()));
        restore_scope(saved);
        for (r, t) in node.results.iter().zip(results) {
            vals[r.index()] = Some(t);
        }
    }
    vals
}

/// Inlines `f` into the current trace: its outputs, computed from `args`.
/// A wrong number or type of arguments is recorded as a trace error.
pub fn call(f: &Function, args: &[Tensor]) -> Vec<Tensor> {
    let types: Vec<TensorType> = args.iter().map(Tensor::ty).collect();
    if types != f.input_types() {
        let t = fail(
            "call",
            args,
            format!(
                "{} takes {:?}, got {types:?}",
                f.name,
                f.input_types()
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
            ),
        );
        return vec![t; f.outputs.len()];
    }
    let vals = replay(f, args);
    f.outputs
        .iter()
        .map(|b| vals[b.value.index()].expect("defined"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn an_input_named_twice_is_refused() {
        let ty = TensorType::new(DType::F32, [2]);
        let err = trace("twice", &[("x", ty.clone()), ("x", ty)], |i| {
            Outputs::new().add("y", i["x"])
        })
        .unwrap_err();
        assert!(err.to_string().contains("`x` is named twice"), "{err}");
    }
}
