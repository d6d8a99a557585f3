//! Result layouts for one op from its operands' layouts: what the eager
//! executor compiles each one-op program with. Simple, conservative rules
//! (XLA inserts whatever communication the chosen layouts need, so any
//! choice is correct; these keep values split where that is free).

use hlo_ir::ops::{BroadcastInDim, DotGeneral, Reduce, Transpose};
use hlo_ir::{Lowering, Op, TensorType};

use crate::{Mesh, PartitionSpec};

/// Drops axes that would be used twice or do not divide their dimension.
fn legal(mut dims: Vec<Vec<String>>, ty: &TensorType, mesh: &Mesh) -> PartitionSpec {
    let mut used: Vec<String> = Vec::new();
    for (d, axes) in dims.iter_mut().enumerate() {
        axes.retain(|a| {
            let fresh = !used.contains(a) && mesh.axis_index(a).is_some();
            if fresh {
                used.push(a.clone());
            }
            fresh
        });
        let parts: i64 = axes
            .iter()
            .map(|a| mesh.axis_size(a).unwrap_or(1))
            .product();
        if ty.dims.get(d).is_none_or(|&n| n % parts != 0) {
            for a in axes.drain(..) {
                used.retain(|u| u != &a);
            }
        }
    }
    dims.truncate(ty.rank());
    while dims.last().is_some_and(Vec::is_empty) {
        dims.pop();
    }
    PartitionSpec(dims)
}

fn dims_of(spec: &PartitionSpec, rank: usize) -> Vec<Vec<String>> {
    (0..rank).map(|d| spec.axes(d).to_vec()).collect()
}

/// The layout of each result of `op`, given its operands' layouts.
pub fn propagate(
    op: &Op,
    operands: &[(&TensorType, &PartitionSpec)],
    results: &[TensorType],
    mesh: &Mesh,
) -> Vec<PartitionSpec> {
    let one = |spec: PartitionSpec| vec![spec];
    match op {
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Compare(_)
        | Op::Select(_)
        | Op::Convert(_)
        | Op::BitcastConvert(_)
        | Op::StopGradient(_) => one(elementwise(operands, &results[0], mesh)),
        Op::ShardingConstraint(c) => one(legal(c.dims.clone(), &results[0], mesh)),
        Op::OptimizationBarrier(_) => operands.iter().map(|(_, s)| (*s).clone()).collect(),
        Op::BroadcastInDim(b) => one(broadcast_in_dim(b, operands[0], &results[0], mesh)),
        Op::Transpose(t) => one(transpose(t, operands[0], &results[0], mesh)),
        Op::Reshape(_) => one(reshape(operands[0], &results[0], mesh)),
        Op::Reduce(r) => one(reduce(r, operands[0], &results[0], mesh)),
        Op::DotGeneral(g) => one(dot_general(g, operands[0], operands[1], &results[0], mesh)),
        Op::CudnnAttention(_) | Op::CudnnAttentionBackward(_) => {
            manual_region(op, operands, results, mesh)
        }
        // Data-dependent or reshaping ops: replicated results.
        Op::Constant(_)
        | Op::Iota(_)
        | Op::Slice(_)
        | Op::DynamicSlice(_)
        | Op::DynamicUpdateSlice(_)
        | Op::Concatenate(_)
        | Op::Pad(_)
        | Op::Gather(_)
        | Op::Scatter(_)
        | Op::RngBitGenerator(_)
        | Op::While(_)
        | Op::Scan(_)
        | Op::CustomVjp(_) => replicated(results),
    }
}

/// Every result replicated: the safe answer where a split cannot be read
/// off the operands.
fn replicated(results: &[TensorType]) -> Vec<PartitionSpec> {
    results
        .iter()
        .map(|_| PartitionSpec::replicated())
        .collect()
}

/// Elementwise ops: the layout of the first split operand of the result's
/// shape (a broadcast scalar or replicated operand says nothing).
fn elementwise(
    operands: &[(&TensorType, &PartitionSpec)],
    result: &TensorType,
    mesh: &Mesh,
) -> PartitionSpec {
    operands
        .iter()
        .find(|(t, s)| t.dims == result.dims && !s.is_replicated(mesh))
        .map(|(_, s)| legal(dims_of(s, result.rank()), result, mesh))
        .unwrap_or_default()
}

/// Each operand dimension keeps its axes where it lands, unless it is
/// broadcast there (size 1 stretched).
fn broadcast_in_dim(
    b: &BroadcastInDim,
    (t, s): (&TensorType, &PartitionSpec),
    result: &TensorType,
    mesh: &Mesh,
) -> PartitionSpec {
    let mut dims = vec![Vec::new(); result.rank()];
    for (i, &r) in b.dims.iter().enumerate() {
        if t.dims[i] == result.dims[r as usize] {
            dims[r as usize] = s.axes(i).to_vec();
        }
    }
    legal(dims, result, mesh)
}

/// The operand's axes, permuted with its dimensions.
fn transpose(
    t: &Transpose,
    (_, s): (&TensorType, &PartitionSpec),
    result: &TensorType,
    mesh: &Mesh,
) -> PartitionSpec {
    legal(
        t.permutation
            .iter()
            .map(|&p| s.axes(p as usize).to_vec())
            .collect(),
        result,
        mesh,
    )
}

/// Keep the layout of leading dimensions that survive unchanged.
fn reshape(
    (t, s): (&TensorType, &PartitionSpec),
    result: &TensorType,
    mesh: &Mesh,
) -> PartitionSpec {
    let mut dims = Vec::new();
    for (d, (&a, &b)) in t.dims.iter().zip(&result.dims).enumerate() {
        if a != b {
            break;
        }
        dims.push(s.axes(d).to_vec());
    }
    legal(dims, result, mesh)
}

/// The kept dimensions keep their axes; reduced ones drop theirs.
fn reduce(
    r: &Reduce,
    (t, s): (&TensorType, &PartitionSpec),
    result: &TensorType,
    mesh: &Mesh,
) -> PartitionSpec {
    let kept: Vec<Vec<String>> = (0..t.rank())
        .filter(|d| !r.dims.contains(&(*d as i64)))
        .map(|d| s.axes(d).to_vec())
        .collect();
    legal(kept, result, mesh)
}

/// Result dimensions in `dot_general` order (batch, lhs free, rhs free),
/// each with the axes of the operand dimension it comes from.
fn dot_general(
    g: &DotGeneral,
    (lt, ls): (&TensorType, &PartitionSpec),
    (rt, rs): (&TensorType, &PartitionSpec),
    result: &TensorType,
    mesh: &Mesh,
) -> PartitionSpec {
    let free = |rank: usize, batch: &[i64], contracting: &[i64]| -> Vec<usize> {
        (0..rank)
            .filter(|d| !batch.contains(&(*d as i64)) && !contracting.contains(&(*d as i64)))
            .collect()
    };
    let mut dims: Vec<Vec<String>> = g
        .lhs_batch
        .iter()
        .map(|&d| ls.axes(d as usize).to_vec())
        .collect();
    dims.extend(
        free(lt.rank(), &g.lhs_batch, &g.lhs_contracting)
            .into_iter()
            .map(|d| ls.axes(d).to_vec()),
    );
    dims.extend(
        free(rt.rank(), &g.rhs_batch, &g.rhs_contracting)
            .into_iter()
            .map(|d| rs.axes(d).to_vec()),
    );
    legal(dims, result, mesh)
}

/// Opaque calls in a manual region: split as the region splits them.
fn manual_region(
    op: &Op,
    operands: &[(&TensorType, &PartitionSpec)],
    results: &[TensorType],
    mesh: &Mesh,
) -> Vec<PartitionSpec> {
    let types: Vec<TensorType> = operands.iter().map(|(t, _)| (*t).clone()).collect();
    match op.rule().stablehlo(&types, results) {
        Lowering::Manual { results: dims, .. } => dims
            .into_iter()
            .zip(results)
            .map(|(d, t)| legal(d, t, mesh))
            .collect(),
        _ => replicated(results),
    }
}
