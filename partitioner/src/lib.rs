//! `hlo-partitioner` will own how a program is laid out over devices: `Mesh`
//! (named axes and their sizes over a device order), `PartitionSpec` (per
//! dimension: no axis, one axis or a tuple of axes), ordered regex rule tables
//! (first match wins, default replicated) applied to the named inputs of a
//! traced function, sharding constraints, validation with errors that name the
//! tensor and dimension, per-device memory estimates and an ASCII view of each
//! layout. It depends only on `hlo-ir`; it prints nothing in MLIR or HLO
//! syntax (that is `hlo-lowering`) and runs nothing (that is `hlo-runtime`).
//!
//! It is empty until the partitioner issue lands.
