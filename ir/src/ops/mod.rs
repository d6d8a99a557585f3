//! One module per op (or per family of elementwise ops sharing a table).

mod binary;
mod broadcast_in_dim;
mod compare;
mod concatenate;
mod constant;
mod convert;
mod cudnn;
mod custom_vjp;
mod dot_general;
mod dynamic_slice;
mod gather;
mod pad;
mod reduce;
mod reshape;
mod rng_bit_generator;
mod scan;
mod scatter;
mod select;
mod sharding_constraint;
mod slice;
mod stop_gradient;
mod transpose;
mod unary;
mod while_loop;

pub use binary::BinaryOp;
pub use broadcast_in_dim::BroadcastInDim;
pub use compare::{Compare, ComparisonDirection};
pub use concatenate::Concatenate;
pub use constant::{Constant, Iota};
pub use convert::{BitcastConvert, Convert};
pub use cudnn::{
    cudnn_attention, CudnnAttention, CudnnAttentionBackward, CudnnFmha, BACKWARD_TARGET,
    FORWARD_TARGET, MAX_HEAD_DIM,
};
pub use custom_vjp::CustomVjp;
pub use dot_general::{DotGeneral, Precision};
pub use dynamic_slice::{DynamicSlice, DynamicUpdateSlice};
pub use gather::Gather;
pub use pad::Pad;
pub use reduce::{Reduce, ReduceKind};
pub use reshape::Reshape;
pub use rng_bit_generator::{RngAlgorithm, RngBitGenerator};
pub(crate) use scan::stacked;
pub use scan::Scan;
pub use scatter::Scatter;
pub use select::Select;
pub use sharding_constraint::ShardingConstraint;
pub use slice::Slice;
pub use stop_gradient::{OptimizationBarrier, StopGradient};
pub use transpose::Transpose;
pub use unary::UnaryOp;
pub use while_loop::While;

use crate::{Literal, TensorType};

/// Fails unless there are exactly `n` operands.
pub(crate) fn arity(operands: &[TensorType], n: usize) -> Result<(), String> {
    if operands.len() != n {
        return Err(format!("takes {n} operands, got {}", operands.len()));
    }
    Ok(())
}

/// `array<i64: 1, 0>`: a dense i64 array attribute.
pub(crate) fn mlir_array(v: &[i64]) -> String {
    if v.is_empty() {
        return "array<i64>".into();
    }
    let items: Vec<String> = v.iter().map(i64::to_string).collect();
    format!("array<i64: {}>", items.join(", "))
}

/// `[1, 0]`: a list inside a StableHLO attribute.
pub(crate) fn mlir_list(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// `{1,0}`: a list in HLO text.
pub(crate) fn hlo_list(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(i64::to_string).collect();
    format!("{{{}}}", items.join(","))
}

/// Every entry of `dims` is a distinct dimension below `rank`.
pub(crate) fn check_dims(what: &str, dims: &[i64], rank: usize) -> Result<(), String> {
    let mut seen = vec![false; rank];
    for &d in dims {
        if d < 0 || d as usize >= rank {
            return Err(format!("{what} {d} is out of range for rank {rank}"));
        }
        if seen[d as usize] {
            return Err(format!("{what} {d} appears twice"));
        }
        seen[d as usize] = true;
    }
    Ok(())
}

/// A literal's elements in the number type the interpreter computes with.
pub(crate) enum Elems {
    Float(Vec<f64>),
    Int(Vec<i128>),
}

impl Elems {
    pub(crate) fn of(l: &Literal) -> Elems {
        if l.ty.dtype.is_float() {
            Elems::Float(l.to_f64s())
        } else {
            Elems::Int(l.to_i128s())
        }
    }

    /// Picks elements by source index (`None` = use `fill`).
    pub(crate) fn pick(&self, indices: &[Option<usize>], fill: &Elems) -> Elems {
        match (self, fill) {
            (Elems::Float(v), Elems::Float(f)) => {
                Elems::Float(indices.iter().map(|i| i.map_or(f[0], |i| v[i])).collect())
            }
            (Elems::Int(v), Elems::Int(f)) => {
                Elems::Int(indices.iter().map(|i| i.map_or(f[0], |i| v[i])).collect())
            }
            _ => unreachable!("fill has the operand's dtype"),
        }
    }

    pub(crate) fn into_literal(self, ty: TensorType) -> Literal {
        match self {
            Elems::Float(v) => Literal::from_f64s(ty, &v),
            Elems::Int(v) => Literal::from_i128s(ty, &v),
        }
    }
}

/// Rearranges `l` into type `ty`: element i of the result is element
/// `source[i]` of `l`, or `fill` where `None`.
pub(crate) fn rearrange(
    l: &Literal,
    ty: TensorType,
    source: &[Option<usize>],
    fill: Option<&Literal>,
) -> Literal {
    let fill = fill.map_or_else(
        || Elems::of(&Literal::splat(TensorType::scalar(l.ty.dtype), 0.0)),
        Elems::of,
    );
    Elems::of(l).pick(source, &fill).into_literal(ty)
}
