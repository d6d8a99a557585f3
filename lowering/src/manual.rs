//! The layout of a manual-sharding region around an op XLA's partitioner
//! cannot split ([`hlo_ir::Lowering::Manual`]), shared by both printers:
//! which axes split each operand and result, and the per-device types the
//! op inside sees.
//!
//! The region is manual over every mesh axis (an axis that splits nothing
//! replicates: each device computes its copy), so nothing inside is left
//! for the partitioner. An axis the mesh lacks, or one that would split
//! some dimension unevenly, is dropped from every value at once: the op
//! must see one consistent split (a query head and its key/value head on
//! the same device).

use hlo_ir::TensorType;
use hlo_partitioner::{Mesh, PartitionSpec};

/// Per value, per dimension, the mesh axes a rule asks to split it over
/// (what [`hlo_ir::Lowering::Manual`] carries).
pub(crate) type Splits<'a> = &'a [Vec<Vec<String>>];

/// The splits a rule asks for: its operands' and its results'.
pub(crate) type Asked<'a> = (Splits<'a>, Splits<'a>);

/// How the values of one region are split, and their per-device types.
pub(crate) struct ManualLayout {
    pub operands: Vec<PartitionSpec>,
    pub results: Vec<PartitionSpec>,
    pub local_operands: Vec<TensorType>,
    pub local_results: Vec<TensorType>,
}

/// The region's layout on `mesh` for values of `types` that ask to be
/// split as `asked` (per value, per dimension, mesh axes).
pub(crate) fn manual_layout(
    mesh: &Mesh,
    (operand_types, operands): (&[TensorType], Splits),
    (result_types, results): (&[TensorType], Splits),
) -> ManualLayout {
    let values: Vec<(&TensorType, &Vec<Vec<String>>)> = operand_types
        .iter()
        .zip(operands)
        .chain(result_types.iter().zip(results))
        .collect();
    let usable = usable_axes(mesh, &values);
    let spec = |dims: &Vec<Vec<String>>| {
        PartitionSpec(
            dims.iter()
                .map(|axes| {
                    axes.iter()
                        .filter(|a| usable.contains(a))
                        .cloned()
                        .collect()
                })
                .collect(),
        )
    };
    let local = |ty: &TensorType, spec: &PartitionSpec| {
        TensorType::new(ty.dtype, spec.shard_shape(mesh, &ty.dims))
    };
    let operands: Vec<PartitionSpec> = operands.iter().map(spec).collect();
    let results: Vec<PartitionSpec> = results.iter().map(spec).collect();
    ManualLayout {
        local_operands: operand_types
            .iter()
            .zip(&operands)
            .map(|(t, s)| local(t, s))
            .collect(),
        local_results: result_types
            .iter()
            .zip(&results)
            .map(|(t, s)| local(t, s))
            .collect(),
        operands,
        results,
    }
}

/// The asked axes that are in `mesh` and split every dimension they are
/// asked for evenly (together with the other usable axes of it).
fn usable_axes(mesh: &Mesh, values: &[(&TensorType, &Vec<Vec<String>>)]) -> Vec<String> {
    let mut usable: Vec<String> = Vec::new();
    for (_, dims) in values {
        for a in dims.iter().flatten() {
            if mesh.axis_index(a).is_some() && !usable.contains(a) {
                usable.push(a.clone());
            }
        }
    }
    // Drop one offending axis at a time until every split is even.
    loop {
        let uneven = values.iter().find_map(|(ty, dims)| {
            dims.iter().enumerate().find_map(|(d, axes)| {
                let kept: Vec<&String> = axes.iter().filter(|a| usable.contains(a)).collect();
                let parts: i64 = kept
                    .iter()
                    .map(|a| mesh.axis_size(a).unwrap_or(1))
                    .product();
                let size = ty.dims.get(d).copied().unwrap_or(1);
                (size % parts != 0).then(|| kept.last().map(|a| (*a).clone()))
            })
        });
        match uneven.flatten() {
            Some(axis) => usable.retain(|a| *a != axis),
            None => return usable,
        }
    }
}

/// Whether `mesh` has more than one device: only then is there a region.
pub(crate) fn needs_region(mesh: Option<&Mesh>) -> Option<&Mesh> {
    mesh.filter(|m| m.size() > 1)
}
