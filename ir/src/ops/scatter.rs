//! `scatter` with an add body: the transpose of `gather` (embedding
//! gradients). Updates outside the operand are dropped.

use super::{arity, check_dims, hlo_list, mlir_list, BinaryOp, Elems};
use crate::literal::round_to;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Region, Spelling};
use crate::types::{for_each_index, linear_index};
use crate::Tensor;
use crate::{Literal, TensorType};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scatter {
    pub update_window_dims: Vec<i64>,
    pub inserted_window_dims: Vec<i64>,
    pub scatter_dims_to_operand_dims: Vec<i64>,
    pub index_vector_dim: i64,
}

impl Scatter {
    /// The transpose of [`super::Gather::take_rows`]: add `[.., dim]` rows
    /// into a `[vocab, dim]` table at `ids[..]`.
    pub fn add_rows(ids_rank: usize) -> Self {
        Scatter {
            update_window_dims: vec![ids_rank as i64],
            inserted_window_dims: vec![0],
            scatter_dims_to_operand_dims: vec![0],
            index_vector_dim: ids_rank as i64,
        }
    }
}

impl OpRule for Scatter {
    fn name(&self) -> &'static str {
        "scatter"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 3)?;
        let (x, idx, upd) = (&operands[0], &operands[1], &operands[2]);
        if !idx.dtype.is_integer() {
            return Err(format!("indices must be integers, got {idx}"));
        }
        if upd.dtype != x.dtype {
            return Err(format!(
                "updates {upd} must have the operand's dtype {}",
                x.dtype
            ));
        }
        if x.dtype == crate::DType::Pred {
            return Err("cannot add pred".into());
        }
        let ivd = self.index_vector_dim;
        if ivd < 0 || ivd as usize > idx.rank() {
            return Err(format!("index_vector_dim {ivd} is out of range for {idx}"));
        }
        let vec_len = if ivd as usize == idx.rank() {
            1
        } else {
            idx.dims[ivd as usize]
        };
        if vec_len != self.scatter_dims_to_operand_dims.len() as i64 {
            return Err(format!(
                "index vectors have {vec_len} components but scatter_dims_to_operand_dims has {}",
                self.scatter_dims_to_operand_dims.len()
            ));
        }
        check_dims(
            "update_window_dims entry",
            &self.update_window_dims,
            upd.rank(),
        )?;
        check_dims(
            "inserted_window_dims entry",
            &self.inserted_window_dims,
            x.rank(),
        )?;
        check_dims(
            "scatter_dims_to_operand_dims entry",
            &self.scatter_dims_to_operand_dims,
            x.rank(),
        )?;
        if self.update_window_dims.len() + self.inserted_window_dims.len() != x.rank() {
            return Err(format!(
                "{} window dims and {} inserted dims do not make the operand's rank {}",
                self.update_window_dims.len(),
                self.inserted_window_dims.len(),
                x.rank()
            ));
        }
        let idx_batch: Vec<i64> = (0..idx.rank())
            .filter(|&d| d as i64 != ivd)
            .map(|d| idx.dims[d])
            .collect();
        let upd_scatter: Vec<i64> = (0..upd.rank())
            .filter(|d| !self.update_window_dims.contains(&(*d as i64)))
            .map(|d| upd.dims[d])
            .collect();
        if idx_batch != upd_scatter {
            return Err(format!(
                "update scatter dimensions {upd_scatter:?} do not match the index batch {idx_batch:?}"
            ));
        }
        Ok(vec![x.clone()])
    }
    fn stablehlo(&self, operands: &[TensorType], _: &[TensorType]) -> Lowering {
        let dimension_numbers = format!(
            "#stablehlo.scatter<update_window_dims = {}, inserted_window_dims = {}, scatter_dims_to_operand_dims = {}, index_vector_dim = {}>",
            mlir_list(&self.update_window_dims),
            mlir_list(&self.inserted_window_dims),
            mlir_list(&self.scatter_dims_to_operand_dims),
            self.index_vector_dim
        );
        Lowering::Op(
            Spelling::new("stablehlo.scatter")
                .attr("scatter_dimension_numbers", dimension_numbers)
                .attr("indices_are_sorted", "false")
                .attr("unique_indices", "false")
                .region(Region::Combiner(BinaryOp::Add, operands[0].dtype)),
        )
    }
    fn hlo(&self, operands: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Op(
            Spelling::new("scatter")
                .attr("update_window_dims", hlo_list(&self.update_window_dims))
                .attr("inserted_window_dims", hlo_list(&self.inserted_window_dims))
                .attr(
                    "scatter_dims_to_operand_dims",
                    hlo_list(&self.scatter_dims_to_operand_dims),
                )
                .attr("index_vector_dim", self.index_vector_dim.to_string())
                .region(Region::Combiner(BinaryOp::Add, operands[0].dtype)),
        )
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let (x, idx, upd, g) = (a.operands[0], a.operands[1], a.operands[2], a.g());
        let ud = upd.dims();
        Ok(vec![
            a.when(0, || g),
            None,
            a.when(2, || {
                // Gather the windows the updates were added to.
                let mut window = self.update_window_dims.iter().map(|&d| ud[d as usize]);
                let slice_sizes: Vec<i64> = (0..x.rank() as i64)
                    .map(|d| {
                        if self.inserted_window_dims.contains(&d) {
                            1
                        } else {
                            window.next().expect("counted")
                        }
                    })
                    .collect();
                g.gather(
                    idx,
                    super::Gather {
                        offset_dims: self.update_window_dims.clone(),
                        collapsed_slice_dims: self.inserted_window_dims.clone(),
                        start_index_map: self.scatter_dims_to_operand_dims.clone(),
                        index_vector_dim: self.index_vector_dim,
                        slice_sizes,
                    },
                )
            }),
        ])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let (x, idx, upd) = (&operands[0], &operands[1], &operands[2]);
        let out = &results[0];
        let indices = idx.to_i128s();
        let ivd = self.index_vector_dim as usize;
        let mut acc: Vec<f64> = x.to_f64s();
        let mut acc_int: Vec<i128> = x.to_i128s();
        let values = Elems::of(upd);
        let mut u = 0usize;
        let mut xi = vec![0i64; x.ty.rank()];
        for_each_index(&upd.ty.dims, |ui| {
            let scatter: Vec<i64> = (0..ui.len() as i64)
                .filter(|p| !self.update_window_dims.contains(p))
                .map(|p| ui[p as usize])
                .collect();
            let mut window = self.update_window_dims.iter().map(|&p| ui[p as usize]);
            let mut start = vec![0i64; x.ty.rank()];
            for (k, &d) in self.scatter_dims_to_operand_dims.iter().enumerate() {
                let mut pos = scatter.clone();
                if ivd < idx.ty.rank() {
                    pos.insert(ivd, k as i64);
                }
                start[d as usize] = indices[linear_index(&idx.ty.dims, &pos)] as i64;
            }
            let mut inside = true;
            for d in 0..x.ty.rank() {
                let w = if self.inserted_window_dims.contains(&(d as i64)) {
                    0
                } else {
                    window.next().expect("counted")
                };
                xi[d] = start[d] + w;
                inside &= xi[d] >= 0 && xi[d] < x.ty.dims[d];
            }
            if inside {
                let at = linear_index(&x.ty.dims, &xi);
                match &values {
                    Elems::Float(v) => acc[at] += v[u],
                    Elems::Int(v) => acc_int[at] += v[u],
                }
            }
            u += 1;
        });
        let lit = match values {
            Elems::Float(_) => {
                let r: Vec<f64> = acc.into_iter().map(|a| round_to(out.dtype, a)).collect();
                Literal::from_f64s(out.clone(), &r)
            }
            Elems::Int(_) => Literal::from_i128s(out.clone(), &acc_int),
        };
        Ok(vec![lit])
    }
}
