//! An ASCII drawing of which device holds which block of a 1-d or 2-d
//! tensor (what `jax.debug.visualize_array_sharding` shows).

use std::collections::BTreeMap;

use crate::{Mesh, PartitionSpec};

/// Draws the blocks of a tensor of `shape` (rank 1 or 2) under `spec`, each
/// labelled with the devices holding it.
///
/// ```
/// use hlo_partitioner::{draw_sharding, Mesh, PartitionSpec};
/// let mesh: Mesh = "dp=1,fsdp=2,mp=2".parse().unwrap();
/// let text = draw_sharding(&mesh, &PartitionSpec::new(&[&["fsdp"], &["mp"]]), &[4, 4]);
/// assert!(text.contains("| 0   | 1   |"));
/// assert!(text.contains("| 2   | 3   |"));
/// ```
pub fn draw_sharding(mesh: &Mesh, spec: &PartitionSpec, shape: &[i64]) -> String {
    let shape2: Vec<i64> = match shape.len() {
        0 => vec![1, 1],
        1 => vec![1, shape[0]],
        _ => shape[..2].to_vec(),
    };
    // For rank 1 the single dimension is the columns.
    let (row_dim, col_dim) = if shape.len() == 1 {
        (None, Some(0))
    } else {
        (Some(0), Some(1))
    };
    let parts = |d: Option<usize>| d.map_or(1, |d| spec.parts(mesh, d));
    let (rows, cols) = (parts(row_dim), parts(col_dim));
    let mut holders: BTreeMap<(i64, i64), Vec<i64>> = BTreeMap::new();
    for device in 0..mesh.size() {
        let block = spec.block_index(mesh, shape.len().max(1), device);
        let r = row_dim.map_or(0, |d| block[d]);
        let c = col_dim.map_or(0, |d| block[d]);
        holders.entry((r, c)).or_default().push(device);
    }
    let label = |r: i64, c: i64| {
        holders.get(&(r, c)).map_or(String::new(), |d| {
            d.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
        })
    };
    let width = (0..rows)
        .flat_map(|r| (0..cols).map(move |c| (r, c)))
        .map(|(r, c)| label(r, c).len())
        .max()
        .unwrap_or(1)
        .max(3);
    let line = format!(
        "+{}\n",
        format!("{}+", "-".repeat(width + 2)).repeat(cols as usize)
    );
    let mut out = format!("{:?} {} over {}\n", shape2, spec, mesh);
    out += &line;
    for r in 0..rows {
        out.push('|');
        for c in 0..cols {
            out += &format!(" {:<width$} |", label(r, c));
        }
        out.push('\n');
        out += &line;
    }
    out
}
