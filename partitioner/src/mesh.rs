//! The device mesh.

use std::fmt;
use std::str::FromStr;

use crate::ShardingError;

/// Named axes with sizes; device `d` sits at the row-major coordinate of `d`
/// (the order JAX's `Mesh(np.array(devices).reshape(sizes), names)` uses).
///
/// ```
/// let mesh: hlo_partitioner::Mesh = "dp=2,fsdp=2,mp=2".parse().unwrap();
/// assert_eq!(mesh.size(), 8);
/// assert_eq!(mesh.coordinates(5), vec![1, 0, 1]);
/// assert_eq!(mesh.to_string(), "dp=2,fsdp=2,mp=2");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    axes: Vec<(String, i64)>,
}

impl Mesh {
    /// The most devices a mesh may span: far above any machine's, far
    /// below where products of a mesh's sizes with shapes overflow.
    pub const MAX_DEVICES: i64 = 1 << 20;

    /// A mesh of `(name, size)` axes; names must be distinct, sizes >= 1,
    /// and their product at most [`Mesh::MAX_DEVICES`] (so that no count
    /// of devices, blocks or bytes derived from it can overflow).
    pub fn new(axes: &[(&str, i64)]) -> Result<Mesh, ShardingError> {
        let text = axes
            .iter()
            .map(|(n, s)| format!("{n}={s}"))
            .collect::<Vec<_>>()
            .join(",");
        let bad = |reason: String| ShardingError::BadMesh {
            text: text.clone(),
            reason,
        };
        if axes.is_empty() {
            return Err(bad("it has no axes".into()));
        }
        for (i, (name, size)) in axes.iter().enumerate() {
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(bad(format!("axis name `{name}` is not a word")));
            }
            if *size < 1 {
                return Err(bad(format!("axis `{name}` has size {size}")));
            }
            if axes[..i].iter().any(|(n, _)| n == name) {
                return Err(bad(format!("axis `{name}` appears twice")));
            }
        }
        let devices = axes
            .iter()
            .try_fold(1i64, |p, (_, s)| p.checked_mul(*s))
            .filter(|&p| p <= Self::MAX_DEVICES);
        if devices.is_none() {
            return Err(bad(format!(
                "its sizes multiply to more than {} devices",
                Self::MAX_DEVICES
            )));
        }
        Ok(Mesh {
            axes: axes.iter().map(|(n, s)| (n.to_string(), *s)).collect(),
        })
    }

    /// One device, one axis of each of `dp`, `fsdp` and `mp`.
    pub fn single() -> Mesh {
        Mesh::new(&[("dp", 1), ("fsdp", 1), ("mp", 1)]).expect("valid")
    }

    pub fn axes(&self) -> &[(String, i64)] {
        &self.axes
    }

    /// Number of devices.
    pub fn size(&self) -> i64 {
        self.axes.iter().map(|(_, s)| s).product()
    }

    pub fn axis_index(&self, name: &str) -> Option<usize> {
        self.axes.iter().position(|(n, _)| n == name)
    }

    pub fn axis_size(&self, name: &str) -> Option<i64> {
        self.axis_index(name).map(|i| self.axes[i].1)
    }

    /// The mesh coordinate of device `d` (row-major).
    pub fn coordinates(&self, d: i64) -> Vec<i64> {
        let mut c = vec![0; self.axes.len()];
        let mut rest = d;
        for (i, (_, s)) in self.axes.iter().enumerate().rev() {
            c[i] = rest % s;
            rest /= s;
        }
        c
    }

    /// Fails unless the mesh covers exactly `devices` devices.
    pub fn check_devices(&self, devices: usize) -> Result<(), ShardingError> {
        if self.size() != devices as i64 {
            return Err(ShardingError::DeviceCount {
                mesh: self.to_string(),
                mesh_devices: self.size(),
                devices,
            });
        }
        Ok(())
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.axes.iter().map(|(n, s)| format!("{n}={s}")).collect();
        f.write_str(&parts.join(","))
    }
}

impl FromStr for Mesh {
    type Err = ShardingError;

    /// `dp=1,fsdp=8,mp=1`.
    fn from_str(s: &str) -> Result<Mesh, ShardingError> {
        let bad = |reason: String| ShardingError::BadMesh {
            text: s.to_string(),
            reason,
        };
        let mut axes = Vec::new();
        for part in s.split(',') {
            let (name, size) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("`{part}` is not NAME=SIZE")))?;
            let size: i64 = size
                .trim()
                .parse()
                .map_err(|_| bad(format!("`{size}` is not a size")))?;
            axes.push((name.trim().to_string(), size));
        }
        let refs: Vec<(&str, i64)> = axes.iter().map(|(n, s)| (n.as_str(), *s)).collect();
        Mesh::new(&refs).map_err(|e| match e {
            ShardingError::BadMesh { reason, .. } => bad(reason),
            other => other,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_whose_product_overflows_or_passes_the_cap_are_refused() {
        for text in [
            "dp=4611686018427387904,fsdp=4,mp=1",
            "dp=9223372036854775807,fsdp=2,mp=2",
            "dp=1024,fsdp=1025,mp=1",
        ] {
            let e = text.parse::<Mesh>().unwrap_err().to_string();
            assert!(e.contains("multiply to more than 1048576 devices"), "{e}");
        }
        let edge: Mesh = "dp=1024,fsdp=1024,mp=1".parse().unwrap();
        assert_eq!(edge.size(), Mesh::MAX_DEVICES);
    }
}
