//! `hlo-lowering` will own the printing of a traced function (with its
//! shardings) as StableHLO MLIR text, with Shardy `sdy` annotations, for PJRT
//! compilation, and as HLO text with GSPMD `sharding={...}` strings for dumps
//! and snapshots: one printer per format, op names as `loc(...)` and
//! `metadata={op_name=...}`, deterministic value naming so the same function
//! prints byte-identical text. It neither builds graphs (`hlo-ir`) nor
//! compiles them (`hlo-runtime`).
//!
//! It is empty until the IR issue lands.
