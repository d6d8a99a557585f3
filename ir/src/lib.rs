//! `hlo-ir` owns what a traced program *is*: element types, tensor types and
//! literals, the closed op set (one rule per op: shape rule, VJP rule, how
//! it lowers to StableHLO and HLO — a spelling, an identity, a sharding
//! constraint, or expanded by a pass — and reference semantics), the [`Function`] of SSA values with
//! named inputs and outputs, the tracing [`Tensor`] API, the reference
//! interpreter, graph passes (DCE, CSE, constant folding) and reverse-mode
//! autodiff ([`vjp`], [`value_and_grad`], [`grad`]), and the seeded
//! generator and FNV fingerprint every crate shares ([`rng`]).
//!
//! It does not own how a program is sharded (`hlo-partitioner`), printed as a
//! whole module (`hlo-lowering`) or run (`hlo-runtime`); it depends on no
//! other crate of the workspace, so everything else speaks its vocabulary.
//!
//! ```
//! use hlo_ir::{scope, trace, DType, TensorType};
//! let f = trace(
//!     "mlp",
//!     &[("x", TensorType::new(DType::F32, [4, 8])), ("w", TensorType::new(DType::F32, [8, 2]))],
//!     |i| scope("layers.0", || i["x"].matmul(i["w"]).tanh()),
//! )
//! .unwrap();
//! assert_eq!(f.output_types(), vec![TensorType::new(DType::F32, [4, 2])]);
//! assert_eq!(f.nodes[0].scope, "layers.0");
//! ```

mod autodiff;
mod dtype;
mod graph;
mod interpret;
mod literal;
mod op;
pub mod ops;
mod passes;
pub mod rng;
mod tensor;
mod trace;
mod types;

pub use autodiff::{grad, value_and_grad, vjp, AutodiffError};
pub use dtype::{DType, ParseDTypeError};
pub use graph::{Binding, Function, Node, SubFunction, ValueDef, ValueId, ValueInfo};
pub use interpret::{interpret, InterpretError};
pub use literal::{round_to, wrap_to, Literal};
pub use op::{mlir_string, Lowering, Op, OpRule, Region, Spelling, Vjp};
pub use passes::{cse, dce, expand, fold_constants, inline_custom_vjps, lower_scans, simplify};
pub use tensor::{
    broadcast_shapes, constant, custom_vjp, fori_loop, full, iota, optimization_barrier, scan,
    while_loop,
};
pub use trace::{call, checkpoint, scope, trace, Inputs, Outputs, Tensor, TraceError};
pub use types::TensorType;
