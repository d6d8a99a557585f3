//! The op set: one closed enum, one rule per op.
//!
//! Every op implements [`OpRule`] in its own module under `ops/`: its shape
//! and dtype rule, its StableHLO and HLO spelling, and its reference
//! semantics (used by constant folding and as the tests' host reference). The
//! VJP rule joins them in the autodiff issue. [`op_set!`] writes the enum and
//! the dispatch, so a variant without a full rule does not compile.

use crate::graph::SubFunction;
use crate::ops::*;
use crate::{DType, Literal, Tensor, TensorType};

/// How a program's op is written in one text format.
#[derive(Clone, Debug, PartialEq)]
pub struct Spelling {
    /// `stablehlo.add` / `add`.
    pub name: String,
    /// `(name, value)` in the format's syntax. MLIR prints them sorted by
    /// name; HLO prints them in this order.
    pub attributes: Vec<(String, String)>,
    /// Nested computations (reduction bodies, loop condition and body).
    pub regions: Vec<Region>,
}

impl Spelling {
    pub fn new(name: impl Into<String>) -> Self {
        Spelling {
            name: name.into(),
            attributes: Vec::new(),
            regions: Vec::new(),
        }
    }

    pub fn attr(mut self, name: &str, value: impl Into<String>) -> Self {
        self.attributes.push((name.to_string(), value.into()));
        self
    }

    pub fn region(mut self, region: Region) -> Self {
        self.regions.push(region);
        self
    }
}

/// A nested computation of an op.
#[derive(Clone, Debug, PartialEq)]
pub enum Region {
    /// `(a, b) -> a ⊕ b` on scalars of one dtype (reduce, scatter).
    Combiner(BinaryOp, DType),
    /// A traced function (a loop's condition or body).
    Function(SubFunction),
}

/// The rule of one op. Errors are plain messages; the tracer adds the op
/// name, the operand types and the scope.
pub trait OpRule {
    /// Short name used in errors and listings (`dot_general`).
    fn name(&self) -> &'static str;
    /// Result types from operand types.
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String>;
    /// The StableHLO spelling (generic MLIR form).
    fn stablehlo(&self, operands: &[TensorType], results: &[TensorType]) -> Spelling;
    /// The HLO text spelling.
    fn hlo(&self, operands: &[TensorType], results: &[TensorType]) -> Spelling;
    /// Reference semantics on host literals.
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String>;
    /// The vector-Jacobian product: cotangents of the operands that need
    /// one, from the cotangents of the results, traced into the current
    /// trace with core ops. `None` is a symbolic zero.
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String>;
}

/// What a VJP rule gets: the forward operands and results (as values of the
/// backward trace), the results' cotangents and which operands need one.
pub struct Vjp<'a> {
    pub operands: &'a [Tensor],
    pub results: &'a [Tensor],
    pub cotangents: &'a [Option<Tensor>],
    pub needs: &'a [bool],
}

impl Vjp<'_> {
    /// The cotangent of a single-result op (the driver only calls a rule
    /// when some result has one).
    pub fn g(&self) -> Tensor {
        self.cotangents[0].expect("a single-result op is differentiated only with a cotangent")
    }

    /// `Some(f())` for operand `i` if it needs a cotangent.
    pub fn when(&self, i: usize, f: impl FnOnce() -> Tensor) -> Option<Tensor> {
        self.needs[i].then(f)
    }
}

macro_rules! op_set {
    ($( $(#[$m:meta])* $variant:ident($ty:ty) ),* $(,)?) => {
        /// An operation of the IR. See the module docs.
        #[derive(Clone, Debug, PartialEq, Eq, Hash)]
        pub enum Op {
            $( $(#[$m])* $variant($ty), )*
        }

        impl Op {
            /// The rule of this op.
            pub fn rule(&self) -> &dyn OpRule {
                match self {
                    $( Op::$variant(x) => x, )*
                }
            }
        }
    };
}

op_set! {
    /// A constant tensor.
    Constant(Constant),
    /// Indices along one dimension.
    Iota(Iota),
    /// `negate`, `exponential`, `tanh`, ... (one operand, same shape).
    Unary(UnaryOp),
    /// `add`, `multiply`, `maximum`, ... (two operands of one type).
    Binary(BinaryOp),
    Compare(Compare),
    Select(Select),
    Convert(Convert),
    BitcastConvert(BitcastConvert),
    BroadcastInDim(BroadcastInDim),
    Reshape(Reshape),
    Transpose(Transpose),
    Slice(Slice),
    DynamicSlice(DynamicSlice),
    DynamicUpdateSlice(DynamicUpdateSlice),
    Concatenate(Concatenate),
    Pad(Pad),
    Reduce(Reduce),
    DotGeneral(DotGeneral),
    Gather(Gather),
    Scatter(Scatter),
    RngBitGenerator(RngBitGenerator),
    ShardingConstraint(ShardingConstraint),
    While(While),
    /// A loop of fixed length over stacked inputs (layers).
    Scan(Scan),
    /// The identity, through which no gradient flows.
    StopGradient(StopGradient),
    /// The identity on several values, which XLA may not look through
    /// (keeps a rematerialized forward from being merged with the original).
    OptimizationBarrier(OptimizationBarrier),
}

impl Op {
    pub fn name(&self) -> &'static str {
        self.rule().name()
    }

    pub fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        self.rule().infer(operands)
    }

    pub fn eval(
        &self,
        operands: &[Literal],
        results: &[TensorType],
    ) -> Result<Vec<Literal>, String> {
        self.rule().eval(operands, results)
    }

    /// True for ops that lower to nothing (their results are their operands).
    pub fn is_identity(&self) -> bool {
        matches!(self, Op::StopGradient(_))
    }
}
