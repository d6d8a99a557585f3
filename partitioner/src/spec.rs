//! `PartitionSpec`: which mesh axes split each dimension of a tensor.

use std::fmt;

use crate::{Mesh, ShardingError};

/// Per tensor dimension, the mesh axes (major to minor) it is split over;
/// an empty list leaves the dimension whole. Dimensions past the spec's
/// length are not split. Axes not used anywhere replicate the tensor.
///
/// ```
/// use hlo_partitioner::PartitionSpec;
/// let p = PartitionSpec::parse("P(('dp', 'fsdp'), None)").unwrap();
/// assert_eq!(p, PartitionSpec::new(&[&["dp", "fsdp"], &[]]));
/// assert_eq!(p.to_string(), "P(('dp', 'fsdp'), None)");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct PartitionSpec(pub Vec<Vec<String>>);

impl PartitionSpec {
    pub fn new(dims: &[&[&str]]) -> Self {
        PartitionSpec(
            dims.iter()
                .map(|d| d.iter().map(|s| s.to_string()).collect())
                .collect(),
        )
    }

    /// Nothing split: every device holds the whole tensor.
    pub fn replicated() -> Self {
        PartitionSpec(Vec::new())
    }

    /// The axes of dimension `dim` (none past the spec's length).
    pub fn axes(&self, dim: usize) -> &[String] {
        self.0.get(dim).map_or(&[], Vec::as_slice)
    }

    /// Parses JAX's spelling, with or without `P(...)`: `('fsdp', 'mp')`,
    /// `(('dp', 'fsdp'), None)`, `P()`; also bare `fsdp,mp`.
    pub fn parse(text: &str) -> Result<Self, ShardingError> {
        let bad = |reason: &str| ShardingError::BadSpec {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let mut s = text.trim();
        if let Some(rest) = s
            .strip_prefix("PartitionSpec")
            .or_else(|| s.strip_prefix('P'))
        {
            s = rest.trim();
        }
        if let Some(inner) = s.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
            s = inner;
        }
        let mut dims = Vec::new();
        for item in split_top(s).map_err(|r| bad(&r))? {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            if item == "None" {
                dims.push(Vec::new());
            } else if let Some(inner) = item.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
                let axes: Vec<String> = inner
                    .split(',')
                    .map(|a| unquote(a.trim()))
                    .filter(|a| !a.is_empty())
                    .collect();
                if axes.iter().any(|a| !is_word(a)) {
                    return Err(bad("axis names are words"));
                }
                dims.push(axes);
            } else {
                let a = unquote(item);
                if !is_word(&a) {
                    return Err(bad(&format!(
                        "`{item}` is not an axis name, None or a tuple"
                    )));
                }
                dims.push(vec![a]);
            }
        }
        Ok(PartitionSpec(dims))
    }

    /// Checks the spec against `mesh` for a tensor of `shape` named `tensor`.
    pub fn validate(&self, mesh: &Mesh, shape: &[i64], tensor: &str) -> Result<(), ShardingError> {
        if self.0.len() > shape.len() {
            return Err(ShardingError::RankMismatch {
                tensor: tensor.into(),
                spec: self.to_string(),
                entries: self.0.len(),
                rank: shape.len(),
            });
        }
        let mut seen: Vec<(&str, usize)> = Vec::new();
        for (dim, axes) in self.0.iter().enumerate() {
            for a in axes {
                if mesh.axis_index(a).is_none() {
                    return Err(ShardingError::UnknownAxis {
                        tensor: tensor.into(),
                        dim,
                        axis: a.clone(),
                        mesh: mesh.to_string(),
                    });
                }
                if let Some(&(_, first)) = seen.iter().find(|(n, _)| n == a) {
                    return Err(ShardingError::AxisTwice {
                        tensor: tensor.into(),
                        axis: a.clone(),
                        first,
                        second: dim,
                    });
                }
                seen.push((a, dim));
            }
            let parts = self.parts(mesh, dim);
            if shape[dim] % parts != 0 {
                return Err(ShardingError::NotDivisible {
                    tensor: tensor.into(),
                    dim,
                    size: shape[dim],
                    axes: axes.join("×"),
                    parts,
                });
            }
        }
        Ok(())
    }

    /// How many blocks dimension `dim` is split into.
    pub fn parts(&self, mesh: &Mesh, dim: usize) -> i64 {
        self.axes(dim)
            .iter()
            .map(|a| mesh.axis_size(a).unwrap_or(1))
            .product()
    }

    /// The shape of one device's block.
    pub fn shard_shape(&self, mesh: &Mesh, shape: &[i64]) -> Vec<i64> {
        shape
            .iter()
            .enumerate()
            .map(|(d, &n)| n / self.parts(mesh, d))
            .collect()
    }

    /// Which block (per dimension) device `device` holds.
    pub(crate) fn block_index(&self, mesh: &Mesh, rank: usize, device: i64) -> Vec<i64> {
        let c = mesh.coordinates(device);
        (0..rank)
            .map(|dim| {
                self.axes(dim).iter().fold(0, |acc, a| {
                    let i = mesh.axis_index(a).expect("validated");
                    acc * mesh.axes()[i].1 + c[i]
                })
            })
            .collect()
    }

    /// The start of device `device`'s block in each dimension.
    pub fn shard_offset(&self, mesh: &Mesh, shape: &[i64], device: i64) -> Vec<i64> {
        let block = self.shard_shape(mesh, shape);
        self.block_index(mesh, shape.len(), device)
            .iter()
            .zip(&block)
            .map(|(i, b)| i * b)
            .collect()
    }

    /// The same layout without trailing unsplit dimensions (`P('x', None)`
    /// and `P('x')` are one layout).
    pub fn canonical(&self) -> PartitionSpec {
        let mut dims = self.0.clone();
        while dims.last().is_some_and(Vec::is_empty) {
            dims.pop();
        }
        PartitionSpec(dims)
    }

    /// True when every device holds the whole tensor.
    pub fn is_replicated(&self, mesh: &Mesh) -> bool {
        (0..self.0.len()).all(|d| self.parts(mesh, d) == 1)
    }
}

impl fmt::Display for PartitionSpec {
    /// JAX's spelling: `P('fsdp', 'mp')`, `P(('dp', 'fsdp'), None)`, `P()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let items: Vec<String> = self
            .0
            .iter()
            .map(|axes| match axes.len() {
                0 => "None".to_string(),
                1 => format!("'{}'", axes[0]),
                _ => format!(
                    "({})",
                    axes.iter()
                        .map(|a| format!("'{a}'"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
            .collect();
        write!(f, "P({})", items.join(", "))
    }
}

/// A mesh and a spec: how one tensor is laid out (JAX's `NamedSharding`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sharding {
    pub mesh: Mesh,
    pub spec: PartitionSpec,
}

impl Sharding {
    pub fn new(mesh: Mesh, spec: PartitionSpec) -> Self {
        Sharding { mesh, spec }
    }

    pub fn replicated(mesh: Mesh) -> Self {
        Sharding {
            mesh,
            spec: PartitionSpec::replicated(),
        }
    }
}

fn unquote(s: &str) -> String {
    s.trim_matches(|c| c == '\'' || c == '"').to_string()
}

fn is_word(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Splits on commas outside parentheses.
fn split_top(s: &str) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth < 0 {
                    return Err("unbalanced parentheses".into());
                }
            }
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unbalanced parentheses".into());
    }
    out.push(&s[start..]);
    Ok(out)
}
