//! The methods and operators of [`Tensor`]: the tracing DSL model code is
//! written in. NumPy-style broadcasting is made explicit in the graph as
//! `broadcast_in_dim` nodes; dtypes are never promoted implicitly.
//!
//! Longer than our ~500-line guide on purpose: it is the DSL's whole
//! surface in one place (one short method per op or composite), which reads
//! better as one reference than split across files.

use std::ops::{Add, Div, Mul, Neg, Not, Rem, Sub};

use crate::op::Op;
use crate::ops::*;
use crate::trace::{apply, apply1, fail, trace, with_current, Tensor};
use crate::{DType, Literal, TensorType};

/// A constant in the current trace.
pub fn constant(literal: Literal) -> Tensor {
    apply1(Op::Constant(Constant(literal)), &[])
}

/// A tensor of `ty` filled with `value`: a scalar constant broadcast, so a
/// large splat costs nothing to hold or print.
pub fn full(ty: TensorType, value: f64) -> Tensor {
    let scalar = constant(Literal::splat(TensorType::scalar(ty.dtype), value));
    if ty.rank() == 0 {
        scalar
    } else {
        scalar.broadcast_in_dim(&ty.dims, &[])
    }
}

/// `0, 1, 2, ...` along `dimension` of `ty`.
pub fn iota(ty: TensorType, dimension: i64) -> Tensor {
    apply1(Op::Iota(Iota { ty, dimension }), &[])
}

/// The NumPy broadcast of two shapes, or `None` if they do not broadcast.
pub fn broadcast_shapes(a: &[i64], b: &[i64]) -> Option<Vec<i64>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let y = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// Runs `f` as a loop-carried computation: `while cond(carry) { carry = body(carry) }`.
/// `cond` and `body` are traced as their own functions; they may only use
/// the carried values (pass loop-invariant tensors in the carry).
pub fn while_loop(
    init: &[Tensor],
    cond: impl FnOnce(&[Tensor]) -> Tensor,
    body: impl FnOnce(&[Tensor]) -> Vec<Tensor>,
) -> Vec<Tensor> {
    let types: Vec<(String, TensorType)> = init
        .iter()
        .enumerate()
        .map(|(i, t)| (format!("carry.{i}"), t.ty()))
        .collect();
    let scope = with_current(|b| b.scope_name());
    let traced = (|| {
        let c = trace(&format!("{scope}.cond"), &types, |i| {
            vec![("pred", cond(i.tensors()))]
        })?;
        let b = trace(&format!("{scope}.body"), &types, |i| body(i.tensors()))?;
        Ok::<_, crate::TraceError>((c, b))
    })();
    match traced {
        Ok((c, b)) => apply(
            Op::While(While {
                cond: c.into(),
                body: b.into(),
            }),
            init,
            init.len(),
        ),
        Err(e) => {
            let t = fail("while", init, format!("in the loop: {e}"));
            vec![t; init.len()]
        }
    }
}

/// The identity on `values`, which XLA may not optimise across.
pub fn optimization_barrier(values: &[Tensor]) -> Vec<Tensor> {
    apply(
        Op::OptimizationBarrier(OptimizationBarrier),
        values,
        values.len(),
    )
}

/// `for i in lower..upper { carry = body(i, carry) }` with `i` an i32 scalar.
pub fn fori_loop(
    lower: i64,
    upper: i64,
    init: &[Tensor],
    body: impl FnOnce(Tensor, &[Tensor]) -> Vec<Tensor>,
) -> Vec<Tensor> {
    let i0 = full(TensorType::scalar(DType::I32), lower as f64);
    let mut carry = vec![i0];
    carry.extend_from_slice(init);
    let out = while_loop(
        &carry,
        |c| c[0].lt(full(TensorType::scalar(DType::I32), upper as f64)),
        |c| {
            let mut next = vec![c[0] + 1.0];
            next.extend(body(c[0], &c[1..]));
            next
        },
    );
    out[1..].to_vec()
}

impl Tensor {
    /// A scalar constant of this tensor's dtype.
    pub fn scalar_like(&self, value: f64) -> Tensor {
        full(TensorType::scalar(self.dtype()), value)
    }

    /// `self` broadcast NumPy-style (right-aligned) to `shape`.
    pub fn broadcast_to(&self, shape: &[i64]) -> Tensor {
        let dims = self.dims();
        if dims == shape {
            return *self;
        }
        if dims.len() > shape.len() {
            return fail(
                "broadcast_to",
                &[*self],
                format!("cannot broadcast to the lower-rank {shape:?}"),
            );
        }
        let offset = shape.len() - dims.len();
        let map: Vec<i64> = (0..dims.len() as i64).map(|i| i + offset as i64).collect();
        self.broadcast_in_dim(shape, &map)
    }

    /// `broadcast_in_dim`: operand dimension i becomes result dimension `dims[i]`.
    pub fn broadcast_in_dim(&self, shape: &[i64], dims: &[i64]) -> Tensor {
        apply1(
            Op::BroadcastInDim(BroadcastInDim {
                dims: dims.to_vec(),
                shape: shape.to_vec(),
            }),
            &[*self],
        )
    }

    /// Both operands broadcast to their common shape.
    fn broadcast_pair(self, other: Tensor, op: &str) -> Option<(Tensor, Tensor)> {
        let (a, b) = (self.dims(), other.dims());
        match broadcast_shapes(&a, &b) {
            Some(s) => Some((self.broadcast_to(&s), other.broadcast_to(&s))),
            None => {
                fail(
                    op,
                    &[self, other],
                    format!("shapes {a:?} and {b:?} do not broadcast"),
                );
                None
            }
        }
    }

    fn binary(self, op: BinaryOp, other: Tensor) -> Tensor {
        match self.broadcast_pair(other, op.names().0) {
            Some((a, b)) => apply1(Op::Binary(op), &[a, b]),
            None => fail(op.names().0, &[self, other], String::new()),
        }
    }

    fn unary(self, op: UnaryOp) -> Tensor {
        apply1(Op::Unary(op), &[self])
    }

    pub fn maximum(self, other: Tensor) -> Tensor {
        self.binary(BinaryOp::Max, other)
    }
    pub fn minimum(self, other: Tensor) -> Tensor {
        self.binary(BinaryOp::Min, other)
    }
    pub fn pow(self, other: Tensor) -> Tensor {
        self.binary(BinaryOp::Pow, other)
    }
    pub fn and(self, other: Tensor) -> Tensor {
        self.binary(BinaryOp::And, other)
    }
    pub fn or(self, other: Tensor) -> Tensor {
        self.binary(BinaryOp::Or, other)
    }
    pub fn xor(self, other: Tensor) -> Tensor {
        self.binary(BinaryOp::Xor, other)
    }
    pub fn shift_left(self, other: Tensor) -> Tensor {
        self.binary(BinaryOp::ShiftLeft, other)
    }
    pub fn shift_right_logical(self, other: Tensor) -> Tensor {
        self.binary(BinaryOp::ShiftRightLogical, other)
    }

    pub fn exp(self) -> Tensor {
        self.unary(UnaryOp::Exp)
    }
    pub fn log(self) -> Tensor {
        self.unary(UnaryOp::Log)
    }
    pub fn log1p(self) -> Tensor {
        self.unary(UnaryOp::Log1p)
    }
    pub fn rsqrt(self) -> Tensor {
        self.unary(UnaryOp::Rsqrt)
    }
    pub fn sqrt(self) -> Tensor {
        self.unary(UnaryOp::Sqrt)
    }
    pub fn tanh(self) -> Tensor {
        self.unary(UnaryOp::Tanh)
    }
    /// `1 / (1 + exp(-x))`.
    pub fn logistic(self) -> Tensor {
        self.unary(UnaryOp::Logistic)
    }
    pub fn abs(self) -> Tensor {
        self.unary(UnaryOp::Abs)
    }
    pub fn sign(self) -> Tensor {
        self.unary(UnaryOp::Sign)
    }
    pub fn cos(self) -> Tensor {
        self.unary(UnaryOp::Cos)
    }
    pub fn sin(self) -> Tensor {
        self.unary(UnaryOp::Sin)
    }
    pub fn floor(self) -> Tensor {
        self.unary(UnaryOp::Floor)
    }
    pub fn is_finite(self) -> Tensor {
        self.unary(UnaryOp::IsFinite)
    }

    fn compare(self, direction: ComparisonDirection, other: Tensor) -> Tensor {
        match self.broadcast_pair(other, "compare") {
            Some((a, b)) => apply1(Op::Compare(Compare { direction }), &[a, b]),
            None => fail("compare", &[self, other], String::new()),
        }
    }
    pub fn eq(self, other: Tensor) -> Tensor {
        self.compare(ComparisonDirection::Eq, other)
    }
    pub fn ne(self, other: Tensor) -> Tensor {
        self.compare(ComparisonDirection::Ne, other)
    }
    pub fn lt(self, other: Tensor) -> Tensor {
        self.compare(ComparisonDirection::Lt, other)
    }
    pub fn le(self, other: Tensor) -> Tensor {
        self.compare(ComparisonDirection::Le, other)
    }
    pub fn gt(self, other: Tensor) -> Tensor {
        self.compare(ComparisonDirection::Gt, other)
    }
    pub fn ge(self, other: Tensor) -> Tensor {
        self.compare(ComparisonDirection::Ge, other)
    }

    /// `self ? on_true : on_false` elementwise, `self` a pred; all three broadcast.
    pub fn where_(self, on_true: Tensor, on_false: Tensor) -> Tensor {
        let shape = broadcast_shapes(&self.dims(), &on_true.dims())
            .and_then(|s| broadcast_shapes(&s, &on_false.dims()));
        match shape {
            Some(s) => apply1(
                Op::Select(Select),
                &[
                    self.broadcast_to(&s),
                    on_true.broadcast_to(&s),
                    on_false.broadcast_to(&s),
                ],
            ),
            None => fail(
                "select",
                &[self, on_true, on_false],
                "shapes do not broadcast".into(),
            ),
        }
    }

    /// Value conversion to `dtype` (a no-op if already of it).
    pub fn cast(self, dtype: DType) -> Tensor {
        if self.dtype() == dtype {
            return self;
        }
        apply1(Op::Convert(Convert(dtype)), &[self])
    }

    /// Reinterprets the bits as `dtype` of the same width.
    pub fn bitcast(self, dtype: DType) -> Tensor {
        apply1(Op::BitcastConvert(BitcastConvert(dtype)), &[self])
    }

    pub fn reshape(self, shape: &[i64]) -> Tensor {
        if self.dims() == shape {
            return self;
        }
        apply1(
            Op::Reshape(Reshape {
                shape: shape.to_vec(),
            }),
            &[self],
        )
    }

    pub fn transpose(self, permutation: &[i64]) -> Tensor {
        apply1(
            Op::Transpose(Transpose {
                permutation: permutation.to_vec(),
            }),
            &[self],
        )
    }

    /// `self[start[0]..limit[0], ...]`.
    pub fn slice(self, start: &[i64], limit: &[i64]) -> Tensor {
        self.slice_strided(start, limit, &vec![1; start.len()])
    }

    pub fn slice_strided(self, start: &[i64], limit: &[i64], strides: &[i64]) -> Tensor {
        apply1(
            Op::Slice(Slice {
                start: start.to_vec(),
                limit: limit.to_vec(),
                strides: strides.to_vec(),
            }),
            &[self],
        )
    }

    /// A `sizes` box at runtime `starts` (integer scalars), clamped inside.
    pub fn dynamic_slice(self, starts: &[Tensor], sizes: &[i64]) -> Tensor {
        let mut operands = vec![self];
        operands.extend_from_slice(starts);
        apply1(
            Op::DynamicSlice(DynamicSlice {
                sizes: sizes.to_vec(),
            }),
            &operands,
        )
    }

    /// `self` with `update` written at runtime `starts`, clamped inside.
    pub fn dynamic_update_slice(self, update: Tensor, starts: &[Tensor]) -> Tensor {
        let mut operands = vec![self, update];
        operands.extend_from_slice(starts);
        apply1(Op::DynamicUpdateSlice(DynamicUpdateSlice), &operands)
    }

    /// Joins `tensors` along `axis`.
    pub fn concat(tensors: &[Tensor], axis: i64) -> Tensor {
        apply1(Op::Concatenate(Concatenate { dimension: axis }), tensors)
    }

    pub fn pad(self, value: Tensor, low: &[i64], high: &[i64], interior: &[i64]) -> Tensor {
        apply1(
            Op::Pad(Pad {
                low: low.to_vec(),
                high: high.to_vec(),
                interior: interior.to_vec(),
            }),
            &[self, value],
        )
    }

    fn reduce(self, kind: ReduceKind, axes: &[i64]) -> Tensor {
        let d = self.dtype();
        let init = match kind {
            ReduceKind::Sum => 0.0,
            ReduceKind::Max if d.is_float() => f64::NEG_INFINITY,
            ReduceKind::Min if d.is_float() => f64::INFINITY,
            ReduceKind::Max => int_limits(d).0,
            ReduceKind::Min => int_limits(d).1,
        };
        let init = full(TensorType::scalar(d), init);
        apply1(
            Op::Reduce(Reduce {
                kind,
                dims: axes.to_vec(),
            }),
            &[self, init],
        )
    }

    /// Sum over `axes` (dropped from the result).
    pub fn sum(self, axes: &[i64]) -> Tensor {
        self.reduce(ReduceKind::Sum, axes)
    }
    pub fn max(self, axes: &[i64]) -> Tensor {
        self.reduce(ReduceKind::Max, axes)
    }
    pub fn min(self, axes: &[i64]) -> Tensor {
        self.reduce(ReduceKind::Min, axes)
    }
    /// Mean over `axes` (dropped from the result).
    pub fn mean(self, axes: &[i64]) -> Tensor {
        let dims = self.dims();
        let n: i64 = axes.iter().filter_map(|&a| dims.get(a as usize)).product();
        self.sum(axes) / (n.max(1) as f64)
    }

    /// `reduced` (the result of reducing `self` over `axes`) broadcast back
    /// to `self`'s shape.
    fn expand_back(self, reduced: Tensor, axes: &[i64]) -> Tensor {
        let dims = self.dims();
        let kept: Vec<i64> = (0..dims.len() as i64)
            .filter(|i| !axes.contains(i))
            .collect();
        reduced.broadcast_in_dim(&dims, &kept)
    }

    /// `exp(x - max) / sum(exp(x - max))` along `axis`, in the input dtype.
    /// The max only keeps `exp` in range and its gradient cancels, so it is
    /// a constant to autodiff (no compare/select mask in the backward pass).
    pub fn softmax(self, axis: i64) -> Tensor {
        let m = self.expand_back(self.max(&[axis]).stop_gradient(), &[axis]);
        let e = (self - m).exp();
        e / self.expand_back(e.sum(&[axis]), &[axis])
    }

    /// `x - max - log(sum(exp(x - max)))` along `axis` (the max a constant
    /// to autodiff, as in [`Tensor::softmax`]).
    pub fn log_softmax(self, axis: i64) -> Tensor {
        let shifted = self - self.expand_back(self.max(&[axis]).stop_gradient(), &[axis]);
        let lse = shifted.exp().sum(&[axis]).log();
        shifted - self.expand_back(lse, &[axis])
    }

    pub fn dot_general(self, rhs: Tensor, dims: DotGeneral) -> Tensor {
        apply1(Op::DotGeneral(dims), &[self, rhs])
    }

    /// Matrix product: `[.., m, k] · [k, n]`, or batched `[b.., m, k] · [b.., k, n]`.
    pub fn matmul(self, rhs: Tensor) -> Tensor {
        let (l, r) = (self.rank(), rhs.rank());
        if l >= 1 && r == 2 {
            return self.dot_general(rhs, DotGeneral::matmul(l));
        }
        if l == r && l >= 3 {
            let batch: Vec<i64> = (0..l as i64 - 2).collect();
            return self.dot_general(
                rhs,
                DotGeneral {
                    lhs_batch: batch.clone(),
                    rhs_batch: batch,
                    lhs_contracting: vec![l as i64 - 1],
                    rhs_contracting: vec![l as i64 - 2],
                    precision: None,
                    preferred_element_type: None,
                },
            );
        }
        fail(
            "matmul",
            &[self, rhs],
            format!("ranks {l} and {r} do not make a matrix product"),
        )
    }

    /// Elements at integer `indices` along `axis`: the result has shape
    /// `dims[..axis] ++ indices.dims ++ dims[axis+1..]` (an embedding lookup
    /// is `table.take(ids, 0)`).
    pub fn take(self, indices: Tensor, axis: i64) -> Tensor {
        let dims = self.dims();
        let ir = indices.rank() as i64;
        if axis < 0 || axis as usize >= dims.len() {
            return fail(
                "take",
                &[self, indices],
                format!("axis {axis} is out of range"),
            );
        }
        let mut slice_sizes = dims.clone();
        slice_sizes[axis as usize] = 1;
        let offset_dims: Vec<i64> = (0..dims.len() as i64)
            .filter(|&d| d != axis)
            .map(|d| if d < axis { d } else { d - 1 + ir })
            .collect();
        apply1(
            Op::Gather(Gather {
                offset_dims,
                collapsed_slice_dims: vec![axis],
                start_index_map: vec![axis],
                index_vector_dim: ir,
                slice_sizes,
            }),
            &[self, indices],
        )
    }

    pub fn gather(self, indices: Tensor, dims: Gather) -> Tensor {
        apply1(Op::Gather(dims), &[self, indices])
    }

    /// Adds `updates` into `self` at `indices` (the transpose of `gather`).
    pub fn scatter_add(self, indices: Tensor, updates: Tensor, dims: Scatter) -> Tensor {
        apply1(Op::Scatter(dims), &[self, indices, updates])
    }

    /// `(new_state, bits)` from a `u64[2]` state.
    pub fn rng_bits(self, shape: TensorType) -> (Tensor, Tensor) {
        let r = apply(
            Op::RngBitGenerator(RngBitGenerator {
                algorithm: RngAlgorithm::ThreeFry,
                shape,
            }),
            &[self],
            2,
        );
        (r[0], r[1])
    }

    /// The same value, through which no gradient flows.
    pub fn stop_gradient(self) -> Tensor {
        apply1(Op::StopGradient(StopGradient), &[self])
    }

    /// Asks the partitioner to lay this value out over mesh axes: one list
    /// of axis names per dimension (empty: not split).
    pub fn with_sharding_constraint(self, dims: Vec<Vec<String>>) -> Tensor {
        apply1(Op::ShardingConstraint(ShardingConstraint { dims }), &[self])
    }
}

/// (min, max) of an integer dtype, as f64 (exact up to 2^53; used for
/// reduction identities only).
fn int_limits(d: DType) -> (f64, f64) {
    match d {
        DType::Pred | DType::U8 | DType::U32 | DType::U64 => {
            (0.0, ((1u128 << d.bits()) - 1) as f64)
        }
        _ => (
            -((1u128 << (d.bits() - 1)) as f64),
            ((1u128 << (d.bits() - 1)) - 1) as f64,
        ),
    }
}

macro_rules! arith {
    ($trait:ident, $method:ident, $op:expr) => {
        impl $trait for Tensor {
            type Output = Tensor;
            fn $method(self, rhs: Tensor) -> Tensor {
                self.binary($op, rhs)
            }
        }
        impl $trait<f64> for Tensor {
            type Output = Tensor;
            fn $method(self, rhs: f64) -> Tensor {
                self.binary($op, self.scalar_like(rhs))
            }
        }
        impl $trait<Tensor> for f64 {
            type Output = Tensor;
            fn $method(self, rhs: Tensor) -> Tensor {
                rhs.scalar_like(self).binary($op, rhs)
            }
        }
    };
}

arith!(Add, add, BinaryOp::Add);
arith!(Sub, sub, BinaryOp::Sub);
arith!(Mul, mul, BinaryOp::Mul);
arith!(Div, div, BinaryOp::Div);
arith!(Rem, rem, BinaryOp::Rem);

/// Logical not for pred, bitwise not for integers.
impl Not for Tensor {
    type Output = Tensor;
    fn not(self) -> Tensor {
        self.unary(UnaryOp::Not)
    }
}

impl Neg for Tensor {
    type Output = Tensor;
    fn neg(self) -> Tensor {
        self.unary(UnaryOp::Neg)
    }
}

/// `jax.lax.scan`: runs `body` `length` times (the leading size of the
/// `xs`), threading `carry`, slicing each of `xs` per iteration and passing
/// `consts` unchanged; returns the final carry and the stacked per-iteration
/// outputs. `body` receives its inputs by the names given here and returns
/// `(new carry, outputs)`; like a loop body it may use only its inputs.
pub fn scan(
    carry: &[(&str, Tensor)],
    xs: &[(&str, Tensor)],
    consts: &[(&str, Tensor)],
    body: impl FnOnce(&crate::Inputs) -> (Vec<Tensor>, Vec<Tensor>),
) -> (Vec<Tensor>, Vec<Tensor>) {
    scan_with(carry, xs, consts, false, body)
}

/// [`scan`] in either direction (`reverse` walks the stacks from the end).
pub(crate) fn scan_with(
    carry: &[(&str, Tensor)],
    xs: &[(&str, Tensor)],
    consts: &[(&str, Tensor)],
    reverse: bool,
    body: impl FnOnce(&crate::Inputs) -> (Vec<Tensor>, Vec<Tensor>),
) -> (Vec<Tensor>, Vec<Tensor>) {
    let length = xs
        .first()
        .map_or(1, |(_, t)| t.dims().first().copied().unwrap_or(1));
    let mut inputs: Vec<(String, TensorType)> =
        carry.iter().map(|(n, t)| (n.to_string(), t.ty())).collect();
    for (n, t) in xs {
        let ty = t.ty();
        inputs.push((
            n.to_string(),
            TensorType::new(ty.dtype, ty.dims.get(1..).unwrap_or(&[]).to_vec()),
        ));
    }
    inputs.extend(consts.iter().map(|(n, t)| (n.to_string(), t.ty())));
    let scope = with_current(|b| b.scope_name());
    let mut operands: Vec<Tensor> = carry.iter().map(|(_, t)| *t).collect();
    operands.extend(xs.iter().map(|(_, t)| *t));
    operands.extend(consts.iter().map(|(_, t)| *t));
    let traced = trace(&format!("{scope}.scan_body"), &inputs, |i| {
        let (c, ys) = body(i);
        let mut out = crate::Outputs::new();
        for (k, t) in c.into_iter().enumerate() {
            out = out.add(format!("carry.{k}"), t);
        }
        for (k, t) in ys.into_iter().enumerate() {
            out = out.add(format!("y.{k}"), t);
        }
        out
    });
    match traced {
        Ok(f) => {
            let n_out = f.outputs.len() + carry.len();
            let op = Op::Scan(Scan {
                body: f.into(),
                length,
                num_carry: carry.len(),
                num_xs: xs.len(),
                reverse,
            });
            let r = apply(op, &operands, n_out);
            let ny = n_out - 2 * carry.len();
            (
                r[..carry.len()].to_vec(),
                r[carry.len()..carry.len() + ny].to_vec(),
            )
        }
        Err(e) => {
            let t = fail("scan", &operands, format!("in the body: {e}"));
            (vec![t; carry.len()], Vec::new())
        }
    }
}

/// `jax.custom_vjp`: the outputs of `forward` on `operands`, whose
/// gradient autodiff takes from `backward` instead of differentiating
/// `forward`'s ops.
///
/// `forward` receives the operands by name and returns `(outputs,
/// residuals)`: the residuals are kept for the backward pass and never
/// seen by the caller. `backward` receives the operands by their names,
/// the outputs as `output.K`, the residuals as `residual.K` and the
/// outputs' cotangents as `cotangent.K`, and returns one cotangent per
/// operand (`None`: zero; always `None` for an integer operand). Like a
/// loop body, each may use only its inputs.
///
/// ```
/// use hlo_ir::{custom_vjp, interpret, trace, value_and_grad, DType, Literal, TensorType};
/// let t = TensorType::scalar(DType::F64);
/// // exp(x), whose backward reuses the forward's result.
/// let f = trace("exp", &[("x", t.clone())], |i| {
///     let y = custom_vjp(
///         &[("x", i["x"])],
///         |i| (vec![i["x"].exp()], vec![]),
///         |i| vec![Some(i["cotangent.0"] * i["output.0"])],
///     );
///     vec![("loss", y[0])]
/// })
/// .unwrap();
/// let g = value_and_grad(&f, "loss", &["x"]).unwrap();
/// let out = interpret(&g, &[Literal::from_f64s(t, &[1.0])]).unwrap();
/// assert_eq!(out[1].to_f64s(), vec![std::f64::consts::E]);
/// ```
pub fn custom_vjp(
    operands: &[(&str, Tensor)],
    forward: impl FnOnce(&crate::Inputs) -> (Vec<Tensor>, Vec<Tensor>),
    backward: impl FnOnce(&crate::Inputs) -> Vec<Option<Tensor>>,
) -> Vec<Tensor> {
    let scope = with_current(|b| b.scope_name());
    let args: Vec<Tensor> = operands.iter().map(|(_, t)| *t).collect();
    let inputs: Vec<(String, TensorType)> = operands
        .iter()
        .map(|(n, t)| (n.to_string(), t.ty()))
        .collect();
    let mut num_outputs = 0;
    let traced = (|| {
        let fwd = trace(&format!("{scope}.forward"), &inputs, |i| {
            let (outputs, residuals) = forward(i);
            num_outputs = outputs.len();
            let mut out = crate::Outputs::new();
            for (k, t) in outputs.iter().enumerate() {
                out = out.add(format!("output.{k}"), *t);
            }
            for (k, t) in residuals.iter().enumerate() {
                out = out.add(format!("residual.{k}"), *t);
            }
            out
        })?;
        let mut bwd_inputs = inputs.clone();
        let results = fwd.output_types();
        for (k, t) in results.iter().enumerate() {
            let name = if k < num_outputs {
                format!("output.{k}")
            } else {
                format!("residual.{}", k - num_outputs)
            };
            bwd_inputs.push((name, t.clone()));
        }
        for (k, t) in results[..num_outputs].iter().enumerate() {
            bwd_inputs.push((format!("cotangent.{k}"), t.clone()));
        }
        let bwd = trace(&format!("{scope}.backward"), &bwd_inputs, |i| {
            let grads = backward(i);
            let mut out = crate::Outputs::new();
            for (k, ((name, ty), g)) in inputs.iter().zip(grads).enumerate() {
                if ty.dtype.is_float() {
                    out = out.add(
                        format!("grad.{k}.{name}"),
                        g.unwrap_or_else(|| full(ty.clone(), 0.0)),
                    );
                }
            }
            out
        })?;
        Ok::<_, crate::TraceError>((fwd, bwd))
    })();
    match traced {
        Ok((fwd, bwd)) => {
            let n = fwd.outputs.len();
            let op = Op::CustomVjp(CustomVjp {
                forward: fwd.into(),
                backward: bwd.into(),
                num_outputs,
            });
            apply(op, &args, n)[..num_outputs].to_vec()
        }
        Err(e) => {
            let t = fail("custom_vjp", &args, format!("{e}"));
            vec![t; num_outputs.max(1)]
        }
    }
}
