//! `hlo-lowering` owns the printing of a traced [`hlo_ir::Function`] as a
//! whole program: StableHLO MLIR text (generic form, `func.func public
//! @main`, scopes as `loc(...)`, names as `jax.arg_info`/`jax.result_info`)
//! for PJRT compilation, and HLO text (`HloModule`, `ENTRY`,
//! `metadata={op_name=...}`) for dumps and review. How each op lowers comes
//! from its rule in `hlo-ir` ([`hlo_ir::Lowering`]: its spelling, nothing
//! for an identity, a sharding constraint, or a rewrite by the passes of
//! `hlo_ir::expand`, which the printers run first); this crate writes module
//! structure, value names, types, regions, locations and shardings. Output
//! is deterministic: the same function prints byte-identical text.
//!
//! With [`hlo_partitioner::FunctionShardings`] it also writes the layout:
//! Shardy (`sdy.mesh`, `sdy.sharding` on arguments and results,
//! `sdy.sharding_constraint` inside) in StableHLO, GSPMD `sharding={...}` in
//! HLO text; each format has one printer (`sharding.rs`). Without shardings
//! a sharding constraint lowers to the identity.
//!
//! It neither builds graphs (`hlo-ir`) nor compiles them (`hlo-runtime`).

mod hlo;
mod manual;
mod sharding;
mod stablehlo;

pub use hlo::{to_hlo_text, to_hlo_text_sharded};
pub use sharding::{gspmd_sharding, sdy_mesh, sdy_sharding};
pub use stablehlo::{to_stablehlo, to_stablehlo_sharded, to_stablehlo_with};

/// What a printer does on meeting an op whose rule says
/// [`hlo_ir::Lowering::Expanded`]: the printers run the rewriting passes
/// themselves, so reaching one is a bug of this crate, never the caller's.
fn unexpanded(op: &str, by: &str) -> ! {
    panic!(
        "hlo-lowering bug: `{op}` reached the printer; `hlo_ir::{by}` rewrites it into other ops \
         before printing"
    )
}
