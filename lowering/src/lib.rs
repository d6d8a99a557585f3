//! `hlo-lowering` owns the printing of a traced [`hlo_ir::Function`] as a
//! whole program: StableHLO MLIR text (generic form, `func.func public
//! @main`, scopes as `loc(...)`, names as `jax.arg_info`/`jax.result_info`)
//! for PJRT compilation, and HLO text (`HloModule`, `ENTRY`,
//! `metadata={op_name=...}`) for dumps and review. Each op's own spelling
//! comes from its rule in `hlo-ir`; this crate writes module structure,
//! value names, types, regions and locations. Output is deterministic: the
//! same function prints byte-identical text.
//!
//! It neither builds graphs (`hlo-ir`) nor compiles them (`hlo-runtime`).
//! Sharding annotations (Shardy `sdy`, GSPMD strings) arrive with the
//! partitioner; until then a sharding constraint lowers to the identity.

mod hlo;
mod stablehlo;

pub use hlo::to_hlo_text;
pub use stablehlo::to_stablehlo;
