//! `hlo-ir` owns what a traced program *is*: element types, shapes, the closed
//! op set, the `Graph` of SSA values with named inputs and outputs, the tracing
//! `Tensor` API, shape inference, autodiff and graph passes (DCE, CSE, folding).
//!
//! It does not own how a program is sharded (`hlo-partitioner`), printed
//! (`hlo-lowering`) or run (`hlo-runtime`); it depends on no other crate of the
//! workspace, so everything else can speak its vocabulary.
//!
//! Today it holds [`DType`], the element types shared by every layer; the graph
//! and the tracing DSL arrive with the IR issue.

mod dtype;

pub use dtype::{DType, ParseDTypeError};
