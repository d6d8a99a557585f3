//! `dynamic_slice` and `dynamic_update_slice`: a box whose start indices are
//! runtime scalars, clamped so the box stays inside the operand.

use super::{hlo_list, mlir_array, rearrange, Elems};
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::types::{for_each_index, linear_index};
use crate::Tensor;
use crate::{Literal, TensorType};

/// Start indices: one integer scalar per dimension, all of one dtype.
fn check_indices(indices: &[TensorType], rank: usize) -> Result<(), String> {
    if indices.len() != rank {
        return Err(format!("needs {rank} start indices, got {}", indices.len()));
    }
    for (i, t) in indices.iter().enumerate() {
        if t.rank() != 0 || !t.dtype.is_integer() || t.dtype != indices[0].dtype {
            return Err(format!(
                "start index {i} must be an integer scalar like the others, got {t}"
            ));
        }
    }
    Ok(())
}

/// Clamped start of each dimension.
fn starts(indices: &[Literal], dims: &[i64], sizes: &[i64]) -> Vec<i64> {
    indices
        .iter()
        .enumerate()
        .map(|(k, l)| (l.to_i128s()[0] as i64).clamp(0, dims[k] - sizes[k]))
        .collect()
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DynamicSlice {
    pub sizes: Vec<i64>,
}

impl OpRule for DynamicSlice {
    fn name(&self) -> &'static str {
        "dynamic_slice"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        let Some((x, indices)) = operands.split_first() else {
            return Err("needs an operand".into());
        };
        check_indices(indices, x.rank())?;
        if self.sizes.len() != x.rank() {
            return Err(format!("slice sizes {:?} do not fit {x}", self.sizes));
        }
        for (i, (&s, &d)) in self.sizes.iter().zip(&x.dims).enumerate() {
            if s < 0 || s > d {
                return Err(format!("slice size {s} of dimension {i} exceeds {d}"));
            }
        }
        Ok(vec![TensorType::new(x.dtype, self.sizes.clone())])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("stablehlo.dynamic_slice").attr("slice_sizes", mlir_array(&self.sizes)),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("dynamic-slice").attr("dynamic_slice_sizes", hlo_list(&self.sizes)),
        )
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let x = a.operands[0];
        let mut out = vec![a.when(0, || {
            crate::full(x.ty(), 0.0).dynamic_update_slice(a.g(), &a.operands[1..])
        })];
        out.extend(a.operands[1..].iter().map(|_| None));
        Ok(out)
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let x = &operands[0];
        let start = starts(&operands[1..], &x.ty.dims, &self.sizes);
        let mut source = Vec::new();
        let mut xi = vec![0i64; x.ty.rank()];
        for_each_index(&self.sizes, |ri| {
            for k in 0..ri.len() {
                xi[k] = start[k] + ri[k];
            }
            source.push(Some(linear_index(&x.ty.dims, &xi)));
        });
        Ok(vec![rearrange(x, results[0].clone(), &source, None)])
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DynamicUpdateSlice;

impl OpRule for DynamicUpdateSlice {
    fn name(&self) -> &'static str {
        "dynamic_update_slice"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        if operands.len() < 2 {
            return Err("needs an operand and an update".into());
        }
        let (x, update, indices) = (&operands[0], &operands[1], &operands[2..]);
        check_indices(indices, x.rank())?;
        if update.dtype != x.dtype || update.rank() != x.rank() {
            return Err(format!("update {update} does not fit operand {x}"));
        }
        for (i, (&u, &d)) in update.dims.iter().zip(&x.dims).enumerate() {
            if u > d {
                return Err(format!("update dimension {i} of size {u} exceeds {d}"));
            }
        }
        Ok(vec![x.clone()])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("stablehlo.dynamic_update_slice"))
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(Spelling::new("dynamic-update-slice"))
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let (u, starts, g) = (a.operands[1], &a.operands[2..], a.g());
        let mut out = vec![
            a.when(0, || {
                g.dynamic_update_slice(crate::full(u.ty(), 0.0), starts)
            }),
            a.when(1, || g.dynamic_slice(starts, &u.dims())),
        ];
        out.extend(starts.iter().map(|_| None));
        Ok(out)
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let (x, update) = (&operands[0], &operands[1]);
        let start = starts(&operands[2..], &x.ty.dims, &update.ty.dims);
        let mut out = Elems::of(x);
        let upd = Elems::of(update);
        let mut xi = vec![0i64; x.ty.rank()];
        let mut u = 0usize;
        for_each_index(&update.ty.dims, |ui| {
            for k in 0..ui.len() {
                xi[k] = start[k] + ui[k];
            }
            let at = linear_index(&x.ty.dims, &xi);
            match (&mut out, &upd) {
                (Elems::Float(o), Elems::Float(v)) => o[at] = v[u],
                (Elems::Int(o), Elems::Int(v)) => o[at] = v[u],
                _ => unreachable!("same dtype"),
            }
            u += 1;
        });
        Ok(vec![out.into_literal(results[0].clone())])
    }
}
