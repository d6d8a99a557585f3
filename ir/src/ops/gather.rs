//! `gather`: slices of the operand at runtime start indices (embedding
//! lookups are the common case). Batching dimensions are not supported.

use super::{arity, check_dims, hlo_list, mlir_array, mlir_list, rearrange};
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::types::{for_each_index, linear_index};
use crate::Tensor;
use crate::{Literal, TensorType};

/// Dimension numbers as StableHLO defines them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Gather {
    /// Result dimensions that index into a slice.
    pub offset_dims: Vec<i64>,
    /// Operand dimensions whose slice size is 1 and that the result drops.
    pub collapsed_slice_dims: Vec<i64>,
    /// Operand dimension that each component of an index vector starts.
    pub start_index_map: Vec<i64>,
    /// Dimension of the indices holding the index vectors (may equal the
    /// indices' rank: then each index is a scalar).
    pub index_vector_dim: i64,
    pub slice_sizes: Vec<i64>,
}

impl Gather {
    /// Rows of a `[vocab, dim]` table at `ids` of any shape: `ids[..] -> [.., dim]`.
    pub fn take_rows(ids_rank: usize, row_size: i64) -> Self {
        Gather {
            offset_dims: vec![ids_rank as i64],
            collapsed_slice_dims: vec![0],
            start_index_map: vec![0],
            index_vector_dim: ids_rank as i64,
            slice_sizes: vec![1, row_size],
        }
    }

    /// The dims of `indices` that are not the index vector dimension.
    fn batch_dims(&self, indices: &TensorType) -> Vec<usize> {
        (0..indices.rank())
            .filter(|&d| d as i64 != self.index_vector_dim)
            .collect()
    }

    fn index_vector_len(&self, indices: &TensorType) -> i64 {
        if self.index_vector_dim as usize == indices.rank() {
            1
        } else {
            indices.dims[self.index_vector_dim as usize]
        }
    }
}

impl OpRule for Gather {
    fn name(&self) -> &'static str {
        "gather"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 2)?;
        let (x, idx) = (&operands[0], &operands[1]);
        if !idx.dtype.is_integer() {
            return Err(format!("indices must be integers, got {idx}"));
        }
        if self.index_vector_dim < 0 || self.index_vector_dim as usize > idx.rank() {
            return Err(format!(
                "index_vector_dim {} is out of range for {idx}",
                self.index_vector_dim
            ));
        }
        if self.slice_sizes.len() != x.rank() {
            return Err(format!("slice_sizes {:?} do not fit {x}", self.slice_sizes));
        }
        for (d, (&s, &n)) in self.slice_sizes.iter().zip(&x.dims).enumerate() {
            if s < 0 || s > n {
                return Err(format!("slice size {s} of dimension {d} exceeds {n}"));
            }
        }
        check_dims(
            "collapsed_slice_dims entry",
            &self.collapsed_slice_dims,
            x.rank(),
        )?;
        for &c in &self.collapsed_slice_dims {
            if self.slice_sizes[c as usize] > 1 {
                return Err(format!(
                    "collapsed dimension {c} has slice size {}",
                    self.slice_sizes[c as usize]
                ));
            }
        }
        check_dims("start_index_map entry", &self.start_index_map, x.rank())?;
        if self.index_vector_len(idx) != self.start_index_map.len() as i64 {
            return Err(format!(
                "index vectors have {} components but start_index_map has {}",
                self.index_vector_len(idx),
                self.start_index_map.len()
            ));
        }
        let batch = self.batch_dims(idx);
        let rank = batch.len() + self.offset_dims.len();
        check_dims("offset_dims entry", &self.offset_dims, rank)?;
        if self.offset_dims.windows(2).any(|w| w[0] > w[1]) {
            return Err("offset_dims must be sorted".into());
        }
        let offsets: Vec<i64> = (0..x.rank())
            .filter(|d| !self.collapsed_slice_dims.contains(&(*d as i64)))
            .map(|d| self.slice_sizes[d])
            .collect();
        if offsets.len() != self.offset_dims.len() {
            return Err(format!(
                "{} offset dims for {} uncollapsed slice dimensions",
                self.offset_dims.len(),
                offsets.len()
            ));
        }
        let (mut o, mut b) = (offsets.iter(), batch.iter());
        let dims = (0..rank as i64)
            .map(|p| {
                if self.offset_dims.contains(&p) {
                    *o.next().expect("counted")
                } else {
                    idx.dims[*b.next().expect("counted")]
                }
            })
            .collect::<Vec<_>>();
        Ok(vec![TensorType::new(x.dtype, dims)])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        let dimension_numbers = format!(
            "#stablehlo.gather<offset_dims = {}, collapsed_slice_dims = {}, start_index_map = {}, index_vector_dim = {}>",
            mlir_list(&self.offset_dims),
            mlir_list(&self.collapsed_slice_dims),
            mlir_list(&self.start_index_map),
            self.index_vector_dim
        );
        Lowering::Op(
            Spelling::new("stablehlo.gather")
                .attr("dimension_numbers", dimension_numbers)
                .attr("slice_sizes", mlir_array(&self.slice_sizes))
                .attr("indices_are_sorted", "false"),
        )
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("gather")
                .attr("offset_dims", hlo_list(&self.offset_dims))
                .attr("collapsed_slice_dims", hlo_list(&self.collapsed_slice_dims))
                .attr("start_index_map", hlo_list(&self.start_index_map))
                .attr("index_vector_dim", self.index_vector_dim.to_string())
                .attr("slice_sizes", hlo_list(&self.slice_sizes)),
        )
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let (x, idx) = (a.operands[0], a.operands[1]);
        // Scatter-add the slices back into zeros of the operand's shape.
        Ok(vec![
            a.when(0, || {
                crate::full(x.ty(), 0.0).scatter_add(
                    idx,
                    a.g(),
                    super::Scatter {
                        update_window_dims: self.offset_dims.clone(),
                        inserted_window_dims: self.collapsed_slice_dims.clone(),
                        scatter_dims_to_operand_dims: self.start_index_map.clone(),
                        index_vector_dim: self.index_vector_dim,
                    },
                )
            }),
            None,
        ])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let (x, idx) = (&operands[0], &operands[1]);
        let out = &results[0];
        let indices = idx.to_i128s();
        let ivd = self.index_vector_dim as usize;
        let mut source = Vec::with_capacity(out.element_count());
        let mut xi = vec![0i64; x.ty.rank()];
        for_each_index(&out.dims, |oi| {
            let batch: Vec<i64> = (0..oi.len() as i64)
                .filter(|p| !self.offset_dims.contains(p))
                .map(|p| oi[p as usize])
                .collect();
            let mut offsets = self.offset_dims.iter().map(|&p| oi[p as usize]);
            let mut start = vec![0i64; x.ty.rank()];
            for (k, &d) in self.start_index_map.iter().enumerate() {
                let mut pos = batch.clone();
                if ivd < idx.ty.rank() {
                    pos.insert(ivd, k as i64);
                }
                start[d as usize] = indices[linear_index(&idx.ty.dims, &pos)] as i64;
            }
            for d in 0..x.ty.rank() {
                let s = start[d].clamp(0, x.ty.dims[d] - self.slice_sizes[d]);
                let off = if self.collapsed_slice_dims.contains(&(d as i64)) {
                    0
                } else {
                    offsets.next().expect("counted")
                };
                xi[d] = s + off;
            }
            source.push(Some(linear_index(&x.ty.dims, &xi)));
        });
        Ok(vec![rearrange(x, out.clone(), &source, None)])
    }
}
