//! Errors of meshes, specs and rules, each naming what is wrong and where.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardingError {
    #[error("bad mesh `{text}`: {reason} (expected e.g. dp=1,fsdp=8,mp=1)")]
    BadMesh { text: String, reason: String },
    #[error("the mesh {mesh} has {mesh_devices} devices but there are {devices}")]
    DeviceCount {
        mesh: String,
        mesh_devices: i64,
        devices: usize,
    },
    #[error("bad partition spec `{text}`: {reason}")]
    BadSpec { text: String, reason: String },
    #[error("`{tensor}`: dimension {dim} uses axis `{axis}`, which the mesh {mesh} does not have")]
    UnknownAxis {
        tensor: String,
        dim: usize,
        axis: String,
        mesh: String,
    },
    #[error("`{tensor}`: axis `{axis}` is used twice (dimensions {first} and {second})")]
    AxisTwice {
        tensor: String,
        axis: String,
        first: usize,
        second: usize,
    },
    #[error(
        "`{tensor}`: dimension {dim} of size {size} does not divide over {axes} ({parts} parts)"
    )]
    NotDivisible {
        tensor: String,
        dim: usize,
        size: i64,
        axes: String,
        parts: i64,
    },
    #[error("`{tensor}`: the spec {spec} has {entries} entries for a rank-{rank} tensor")]
    RankMismatch {
        tensor: String,
        spec: String,
        entries: usize,
        rank: usize,
    },
    #[error("bad rule {index}: {reason}")]
    BadRule { index: usize, reason: String },
}
