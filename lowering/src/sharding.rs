//! The one printer of each sharding format: Shardy (`sdy`) for StableHLO,
//! GSPMD strings for HLO text. Both spell a (mesh, `PartitionSpec`) pair as
//! JAX does; `tests/fixtures/sharding_strings.json` holds JAX's strings.

use hlo_partitioner::{Mesh, PartitionSpec};

/// `sdy.mesh @mesh = <["dp"=1, "fsdp"=8, "mp"=1]>`.
pub fn sdy_mesh(mesh: &Mesh) -> String {
    let axes: Vec<String> = mesh
        .axes()
        .iter()
        .map(|(n, s)| format!("\"{n}\"={s}"))
        .collect();
    format!("sdy.mesh @mesh = <[{}]>", axes.join(", "))
}

/// `#sdy.sharding<@mesh, [{"fsdp"}, {}]>` for a tensor of rank `rank`.
pub fn sdy_sharding(spec: &PartitionSpec, rank: usize) -> String {
    format!("#sdy.sharding<@mesh, {}>", sdy_dims(spec, rank))
}

/// The per-dimension list: `[{"dp", "fsdp"}, {}]`.
pub(crate) fn sdy_dims(spec: &PartitionSpec, rank: usize) -> String {
    let dims: Vec<String> = (0..rank)
        .map(|d| {
            let axes: Vec<String> = spec.axes(d).iter().map(|a| format!("\"{a}\"")).collect();
            format!("{{{}}}", axes.join(", "))
        })
        .collect();
    format!("[{}]", dims.join(", "))
}

/// The GSPMD sharding of a rank-`rank` tensor: `{replicated}` or
/// `{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}`.
///
/// The tile assignment is the mesh's device array with its axes reordered
/// (each dimension's axes in order, then the unused axes, which replicate)
/// and reshaped to the tile shape. XLA writes it as an iota
/// `<=[dims]T(perm)`: size-1 axes dropped, axes that stay adjacent merged.
pub fn gspmd_sharding(mesh: &Mesh, spec: &PartitionSpec, rank: usize) -> String {
    let tiles: Vec<i64> = (0..rank).map(|d| spec.parts(mesh, d)).collect();
    if tiles.iter().all(|&t| t == 1) {
        return "{replicated}".into();
    }
    let mut order: Vec<usize> = (0..rank)
        .flat_map(|d| {
            spec.axes(d)
                .iter()
                .map(|a| mesh.axis_index(a).expect("validated"))
        })
        .collect();
    let unused: Vec<usize> = (0..mesh.axes().len())
        .filter(|i| !order.contains(i))
        .collect();
    let replicate: i64 = unused.iter().map(|&i| mesh.axes()[i].1).product();
    order.extend(&unused);
    let sizes: Vec<i64> = mesh.axes().iter().map(|(_, s)| *s).collect();
    // Drop size-1 axes, then merge runs that are adjacent in both orders.
    let kept: Vec<usize> = (0..sizes.len()).filter(|&i| sizes[i] > 1).collect();
    let perm: Vec<usize> = order
        .iter()
        .filter(|&&a| sizes[a] > 1)
        .map(|a| kept.iter().position(|k| k == a).expect("kept"))
        .collect();
    let mut groups: Vec<Vec<usize>> = Vec::new(); // runs of `perm`
    for &p in &perm {
        match groups.last_mut() {
            Some(g) if *g.last().expect("non-empty") + 1 == p => g.push(p),
            _ => groups.push(vec![p]),
        }
    }
    // Groups in original (mesh) order give the reshape dims.
    let mut by_start: Vec<&Vec<usize>> = groups.iter().collect();
    by_start.sort_by_key(|g| g[0]);
    let dims: Vec<i64> = by_start
        .iter()
        .map(|g| g.iter().map(|&k| sizes[kept[k]]).product())
        .collect();
    let group_perm: Vec<usize> = groups
        .iter()
        .map(|g| by_start.iter().position(|b| b[0] == g[0]).expect("present"))
        .collect();
    let n: i64 = sizes.iter().product();
    let iota = if group_perm.iter().enumerate().all(|(i, &p)| i == p) {
        format!("<=[{n}]")
    } else {
        let d: Vec<String> = dims.iter().map(i64::to_string).collect();
        let p: Vec<String> = group_perm.iter().map(usize::to_string).collect();
        format!("<=[{}]T({})", d.join(","), p.join(","))
    };
    let mut tile_dims: Vec<String> = tiles.iter().map(i64::to_string).collect();
    let suffix = if replicate > 1 {
        tile_dims.push(replicate.to_string());
        " last_tile_dim_replicate"
    } else {
        ""
    };
    format!("{{devices=[{}]{iota}{suffix}}}", tile_dims.join(","))
}
