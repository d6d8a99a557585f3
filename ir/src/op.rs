//! The op set: one closed enum, one rule per op.
//!
//! Every op implements [`OpRule`] in its own module under `ops/`: its shape
//! and dtype rule, how it lowers to StableHLO and to HLO text (a
//! [`Lowering`]), its reference semantics (used by constant folding and as
//! the tests' host reference) and its VJP rule (used by [`crate::vjp`]).
//! [`op_set!`] writes the enum and the dispatch, so a variant without a full
//! rule does not compile.

use crate::graph::SubFunction;
use crate::ops::*;
use crate::{DType, Literal, Tensor, TensorType};

/// How an op lowers to one text format: what [`OpRule::stablehlo`] and
/// [`OpRule::hlo`] answer, and what the printers of `hlo-lowering` dispatch
/// on.
#[derive(Clone, Debug, PartialEq)]
pub enum Lowering {
    /// One op of the format, spelled so.
    Op(Spelling),
    /// Nothing is printed: each result is its operand (`stop_gradient`,
    /// which matters only to autodiff).
    Identity,
    /// `with_sharding_constraint`: in a program with a mesh, the op `op`
    /// plus a `sharding` attribute, which the lowering's one sharding
    /// printer writes from `dims` and the mesh (Shardy's
    /// `sdy.sharding_constraint`, GSPMD's `Sharding` custom call). In a
    /// program without a mesh, nothing is printed and the result is the
    /// operand.
    ShardingConstraint {
        op: Spelling,
        /// Per dimension, the mesh axes it is split over (empty: not split).
        dims: Vec<Vec<String>>,
    },
    /// An op XLA's partitioner cannot split (an opaque custom call such as
    /// cuDNN's attention). In a program over a mesh of more than one
    /// device, the op runs per device inside a manual-sharding region
    /// (Shardy's `sdy.manual_computation`; GSPMD's `{manual}` sharding
    /// between `SPMDFullToShardShape` and `SPMDShardToFullShape`), manual
    /// over every mesh axis, its operands and results split as `operands`
    /// and `results` say (the printer drops axes the mesh lacks or that do
    /// not divide a dimension, from every value at once); the printer asks
    /// the rule again for the spelling at the per-device types. Otherwise
    /// `op` alone, which is the spelling at the types asked for.
    Manual {
        op: Spelling,
        /// Per operand, per dimension, the mesh axes it is split over.
        operands: Vec<Vec<Vec<String>>>,
        /// Per result, per dimension, the mesh axes it is split over.
        results: Vec<Vec<Vec<String>>>,
    },
    /// Never printed: the `hlo_ir` pass named `by` rewrites the op into
    /// others first (`scan` into a `while` by [`crate::lower_scans`], as
    /// JAX lowers scans). The printers run the pass themselves, so one that
    /// meets such an op has a bug.
    Expanded { by: &'static str },
}

/// `s` as an MLIR string literal (`"` as `\22`, as MLIR prints it):
/// how ops spell text attributes and the printer spells locations.
pub fn mlir_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\22"),
            '\\' => out.push_str("\\5C"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// How an op is written in one text format.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Spelling {
    /// `stablehlo.add` / `add`.
    pub name: String,
    /// `(name, value)` in the format's syntax. MLIR prints them sorted by
    /// name; HLO prints them in this order.
    pub attributes: Vec<(String, String)>,
    /// Nested computations (reduction bodies, loop condition and body).
    pub regions: Vec<Region>,
    /// HLO text only: a literal written in place of the operand list
    /// (`constant({1, 2})`).
    pub literal: Option<String>,
    /// HLO text only: the operands go in as one tuple and the results come
    /// back as one (`while`, `opt-barrier`); the printer packs and unpacks
    /// them.
    pub tupled: bool,
    /// HLO text only: each result's layout (minor to major) where the op
    /// fixes it (a custom call's `result_layouts`), written into the result
    /// types; `None`: the default row-major layouts.
    pub result_layouts: Option<Vec<Vec<i64>>>,
}

impl Spelling {
    pub fn new(name: impl Into<String>) -> Self {
        Spelling {
            name: name.into(),
            ..Spelling::default()
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

    /// See [`Spelling::literal`].
    pub fn literal(mut self, text: impl Into<String>) -> Self {
        self.literal = Some(text.into());
        self
    }

    /// See [`Spelling::tupled`].
    pub fn tupled(mut self) -> Self {
        self.tupled = true;
        self
    }

    /// See [`Spelling::result_layouts`].
    pub fn result_layouts(mut self, layouts: Vec<Vec<i64>>) -> Self {
        self.result_layouts = Some(layouts);
        self
    }
}

/// A nested computation of an op.
#[derive(Clone, Debug, PartialEq)]
pub enum Region {
    /// `(a, b) -> a ⊕ b` on scalars of one dtype (reduce, scatter; HLO's
    /// `to_apply`).
    Combiner(BinaryOp, DType),
    /// A loop's condition: the carried values to a `pred[]` (HLO's
    /// `condition`).
    Cond(SubFunction),
    /// A loop's body: the carried values to their next values (HLO's
    /// `body`, which returns them as one tuple).
    Body(SubFunction),
}

/// The rule of one op. Errors are plain messages; the tracer adds the op
/// name, the operand types and the scope.
pub trait OpRule {
    /// Short name used in errors and listings (`dot_general`).
    fn name(&self) -> &'static str;
    /// Result types from operand types.
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String>;
    /// How the op lowers to StableHLO (generic MLIR form).
    fn stablehlo(&self, operands: &[TensorType], results: &[TensorType]) -> Lowering;
    /// How the op lowers to HLO text.
    fn hlo(&self, operands: &[TensorType], results: &[TensorType]) -> Lowering;
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
    /// A computation with its own backward rule.
    CustomVjp(CustomVjp),
    /// The identity, through which no gradient flows.
    StopGradient(StopGradient),
    /// The identity on several values, which XLA may not look through
    /// (keeps a rematerialized forward from being merged with the original).
    OptimizationBarrier(OptimizationBarrier),
    /// cuDNN's fused causal attention (XLA's `__cudnn$fmhaSoftmax`).
    CudnnAttention(CudnnAttention),
    /// Its backward (`__cudnn$fmhaSoftmaxBackward`), which the forward's
    /// VJP emits.
    CudnnAttentionBackward(CudnnAttentionBackward),
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

    /// True for ops that compute nothing: each result is its operand. Agrees
    /// with their rules, which lower them to [`Lowering::Identity`].
    pub fn is_identity(&self) -> bool {
        matches!(self, Op::StopGradient(_))
    }
}
