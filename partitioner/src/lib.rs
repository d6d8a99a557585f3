//! `hlo-partitioner` owns how a program is laid out over devices: the
//! [`Mesh`] (named axes and sizes over devices in row-major order), the
//! [`PartitionSpec`] (per tensor dimension: no axis, one axis or several),
//! ordered regex [`Rules`] (first match wins, default replicated) applied to
//! the named inputs and outputs of a traced function, validation with errors
//! that name the tensor and dimension, which block of a tensor each device
//! holds, and an ASCII drawing of a layout.
//!
//! It holds no model's rules (each model family brings its own, in
//! `hlo-models`). It depends only on `hlo-ir`. The text spellings of a sharding (Shardy's
//! `#sdy.sharding<...>`, GSPMD's `{devices=[...]}`) belong to `hlo-lowering`;
//! moving bytes to devices belongs to `hlo-runtime`.
//!
//! ```
//! use hlo_partitioner::{Mesh, PartitionSpec};
//! let mesh: Mesh = "dp=2,fsdp=4,mp=1".parse().unwrap();
//! let spec = PartitionSpec::parse("(('dp','fsdp'), None)").unwrap();
//! spec.validate(&mesh, &[16, 512], "batch").unwrap();
//! assert_eq!(spec.shard_shape(&mesh, &[16, 512]), vec![2, 512]);
//! ```

mod error;
mod mesh;
mod propagate;
mod rules;
mod spec;
mod view;

pub use error::ShardingError;
pub use mesh::Mesh;
pub use propagate::propagate;
pub use rules::{FunctionShardings, Rules};
pub use spec::{PartitionSpec, Sharding};
pub use view::draw_sharding;
