//! Result layouts for one op from its operands' layouts: what the eager
//! executor compiles each one-op program with. Simple, conservative rules
//! (XLA inserts whatever communication the chosen layouts need, so any
//! choice is correct; these keep values split where that is free).

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
    let same_as_first_split = || {
        operands
            .iter()
            .find(|(t, s)| t.dims == results[0].dims && !s.is_replicated(mesh))
            .map(|(_, s)| legal(dims_of(s, results[0].rank()), &results[0], mesh))
            .unwrap_or_default()
    };
    let one = |spec: PartitionSpec| vec![spec];
    match op {
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Compare(_)
        | Op::Select(_)
        | Op::Convert(_)
        | Op::BitcastConvert(_)
        | Op::StopGradient(_) => one(same_as_first_split()),
        Op::ShardingConstraint(c) => one(legal(c.dims.clone(), &results[0], mesh)),
        Op::OptimizationBarrier(_) => operands.iter().map(|(_, s)| (*s).clone()).collect(),
        Op::BroadcastInDim(b) => {
            let (t, s) = operands[0];
            let mut dims = vec![Vec::new(); results[0].rank()];
            for (i, &r) in b.dims.iter().enumerate() {
                if t.dims[i] == results[0].dims[r as usize] {
                    dims[r as usize] = s.axes(i).to_vec();
                }
            }
            one(legal(dims, &results[0], mesh))
        }
        Op::Transpose(t) => {
            let (_, s) = operands[0];
            one(legal(
                t.permutation
                    .iter()
                    .map(|&p| s.axes(p as usize).to_vec())
                    .collect(),
                &results[0],
                mesh,
            ))
        }
        Op::Reshape(_) => {
            // Keep the layout of leading dimensions that survive unchanged.
            let (t, s) = operands[0];
            let mut dims = Vec::new();
            for (d, (&a, &b)) in t.dims.iter().zip(&results[0].dims).enumerate() {
                if a != b {
                    break;
                }
                dims.push(s.axes(d).to_vec());
            }
            one(legal(dims, &results[0], mesh))
        }
        Op::Reduce(r) => {
            let (t, s) = operands[0];
            let kept: Vec<Vec<String>> = (0..t.rank())
                .filter(|d| !r.dims.contains(&(*d as i64)))
                .map(|d| s.axes(d).to_vec())
                .collect();
            one(legal(kept, &results[0], mesh))
        }
        Op::DotGeneral(g) => {
            let ((lt, ls), (rt, rs)) = (operands[0], operands[1]);
            let free = |rank: usize, batch: &[i64], contracting: &[i64]| -> Vec<usize> {
                (0..rank)
                    .filter(|d| {
                        !batch.contains(&(*d as i64)) && !contracting.contains(&(*d as i64))
                    })
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
            one(legal(dims, &results[0], mesh))
        }
        // Opaque calls in a manual region: split as the region splits them.
        Op::CudnnAttention(_) | Op::CudnnAttentionBackward(_) => {
            let types: Vec<TensorType> = operands.iter().map(|(t, _)| (*t).clone()).collect();
            match op.rule().stablehlo(&types, results) {
                Lowering::Manual { results: dims, .. } => dims
                    .into_iter()
                    .zip(results)
                    .map(|(d, t)| legal(d, t, mesh))
                    .collect(),
                _ => results
                    .iter()
                    .map(|_| PartitionSpec::replicated())
                    .collect(),
            }
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
        | Op::CustomVjp(_) => results
            .iter()
            .map(|_| PartitionSpec::replicated())
            .collect(),
    }
}
