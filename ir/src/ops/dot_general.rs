//! `dot_general`: contraction with batch and contracting dimensions.

use super::{arity, check_dims, hlo_list, mlir_list, Elems};
use crate::literal::round_to;
use crate::op::Vjp;
use crate::op::{Lowering, OpRule, Spelling};
use crate::types::{for_each_index, linear_index};
use crate::Tensor;
use crate::{DType, Literal, TensorType};

/// The precision an operand is computed at (XLA's `PrecisionConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    Default,
    High,
    Highest,
}

impl Precision {
    fn spelling(self) -> (&'static str, &'static str) {
        match self {
            Precision::Default => ("DEFAULT", "default"),
            Precision::High => ("HIGH", "high"),
            Precision::Highest => ("HIGHEST", "highest"),
        }
    }
}

/// Result dimensions: batch dims, then lhs free dims, then rhs free dims.
/// The result dtype is `preferred_element_type` if set (bf16 inputs with f32
/// accumulation and result), else the operands'.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DotGeneral {
    pub lhs_batch: Vec<i64>,
    pub rhs_batch: Vec<i64>,
    pub lhs_contracting: Vec<i64>,
    pub rhs_contracting: Vec<i64>,
    pub precision: Option<Precision>,
    pub preferred_element_type: Option<DType>,
}

impl DotGeneral {
    /// `[.., k] · [k, ..]`: contract lhs's last with rhs's first dimension.
    pub fn matmul(lhs_rank: usize) -> Self {
        DotGeneral {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contracting: vec![lhs_rank as i64 - 1],
            rhs_contracting: vec![0],
            precision: None,
            preferred_element_type: None,
        }
    }

    fn free(rank: usize, batch: &[i64], contracting: &[i64]) -> Vec<usize> {
        (0..rank)
            .filter(|i| !batch.contains(&(*i as i64)) && !contracting.contains(&(*i as i64)))
            .collect()
    }

    /// This op's precision and result type with other dimension numbers:
    /// the gradient contractions compute at the forward's precision.
    fn with_dims(
        &self,
        lhs_batch: &[i64],
        rhs_batch: &[i64],
        lhs_contracting: &[i64],
        rhs_contracting: &[i64],
    ) -> DotGeneral {
        DotGeneral {
            lhs_batch: lhs_batch.to_vec(),
            rhs_batch: rhs_batch.to_vec(),
            lhs_contracting: lhs_contracting.to_vec(),
            rhs_contracting: rhs_contracting.to_vec(),
            precision: self.precision,
            preferred_element_type: self.preferred_element_type,
        }
    }

    /// One operand's gradient: contract `g` with the other operand over the
    /// other's free dims (`g_other_free`, their positions in `g`), then
    /// permute into this operand's dim order.
    fn operand_grad(
        &self,
        g: Tensor,
        this: &Operand,
        other: &Operand,
        g_other_free: &[i64],
    ) -> Tensor {
        let g_batch: Vec<i64> = (0..self.lhs_batch.len() as i64).collect();
        let (g_first, other_first) = this.grad_dim_orders(other);
        let other_free: Vec<i64> = other.free.iter().map(|&i| i as i64).collect();
        // Prefer the order that needs no transpose of the result (a
        // weight gradient `xᵀ·g` then reaches XLA as a plain matmul
        // rather than a transposed one).
        let (grad, owner) = if !is_identity(&g_first) && is_identity(&other_first) {
            let dims = self.with_dims(other.batch, &g_batch, &other_free, g_other_free);
            (
                other.t.dot_general(g.cast(other.t.dtype()), dims),
                other_first,
            )
        } else {
            let dims = self.with_dims(&g_batch, other.batch, g_other_free, &other_free);
            (g.cast(other.t.dtype()).dot_general(other.t, dims), g_first)
        };
        into_dim_order(grad, &owner).cast(this.t.dtype())
    }
}

/// One operand of a `dot_general` as its VJP sees it: the traced value and
/// its dims by role.
struct Operand<'a> {
    t: Tensor,
    batch: &'a [i64],
    free: Vec<usize>,
    contracting: &'a [i64],
}

impl<'a> Operand<'a> {
    fn new(t: Tensor, batch: &'a [i64], contracting: &'a [i64]) -> Self {
        let free = DotGeneral::free(t.rank(), batch, contracting);
        Operand {
            t,
            batch,
            free,
            contracting,
        }
    }

    /// This operand's dims in the order its gradient's contraction yields
    /// them: as `g · other` (batch, free in g order, then the dims paired
    /// with the other's contracting dims, in the other's dim order), and as
    /// `other · g` (batch, paired dims, free).
    fn grad_dim_orders(&self, other: &Operand) -> (Vec<i64>, Vec<i64>) {
        let mut pairs: Vec<(i64, i64)> = other
            .contracting
            .iter()
            .zip(self.contracting)
            .map(|(&o, &t)| (o, t))
            .collect();
        pairs.sort();
        let mut g_first: Vec<i64> = self.batch.to_vec();
        g_first.extend(self.free.iter().map(|&i| i as i64));
        g_first.extend(pairs.iter().map(|&(_, t)| t));
        let mut other_first: Vec<i64> = self.batch.to_vec();
        other_first.extend(pairs.iter().map(|&(_, t)| t));
        other_first.extend(self.free.iter().map(|&i| i as i64));
        (g_first, other_first)
    }
}

/// Whether `dims` is `0, 1, 2, ..`: the permutation that moves nothing.
fn is_identity(dims: &[i64]) -> bool {
    dims.iter().enumerate().all(|(i, &d)| i as i64 == d)
}

/// `grad`, whose dim `k` is the operand's dim `owner[k]`, transposed into the
/// operand's dim order (no transpose when it already is).
fn into_dim_order(grad: Tensor, owner: &[i64]) -> Tensor {
    let perm: Vec<i64> = (0..owner.len() as i64)
        .map(|d| owner.iter().position(|&o| o == d).expect("every dim") as i64)
        .collect();
    if is_identity(&perm) {
        grad
    } else {
        grad.transpose(&perm)
    }
}

impl OpRule for DotGeneral {
    fn name(&self) -> &'static str {
        "dot_general"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 2)?;
        let (l, r) = (&operands[0], &operands[1]);
        if l.dtype != r.dtype {
            return Err(format!(
                "operand dtypes differ: {} and {}",
                l.dtype, r.dtype
            ));
        }
        if l.dtype == DType::Pred {
            return Err("is not defined for pred".into());
        }
        if self.lhs_batch.len() != self.rhs_batch.len() {
            return Err("lhs and rhs need as many batch dimensions".into());
        }
        if self.lhs_contracting.len() != self.rhs_contracting.len() {
            return Err("lhs and rhs need as many contracting dimensions".into());
        }
        let lhs_all: Vec<i64> = self
            .lhs_batch
            .iter()
            .chain(&self.lhs_contracting)
            .copied()
            .collect();
        let rhs_all: Vec<i64> = self
            .rhs_batch
            .iter()
            .chain(&self.rhs_contracting)
            .copied()
            .collect();
        check_dims("lhs dimension", &lhs_all, l.rank())?;
        check_dims("rhs dimension", &rhs_all, r.rank())?;
        for (&a, &b) in self.lhs_batch.iter().zip(&self.rhs_batch) {
            if l.dims[a as usize] != r.dims[b as usize] {
                return Err(format!(
                    "batch dimension sizes differ: lhs dim {a} is {}, rhs dim {b} is {}",
                    l.dims[a as usize], r.dims[b as usize]
                ));
            }
        }
        for (&a, &b) in self.lhs_contracting.iter().zip(&self.rhs_contracting) {
            if l.dims[a as usize] != r.dims[b as usize] {
                return Err(format!(
                    "contracting dimension sizes differ: lhs dim {a} is {}, rhs dim {b} is {}",
                    l.dims[a as usize], r.dims[b as usize]
                ));
            }
        }
        let mut dims: Vec<i64> = self.lhs_batch.iter().map(|&a| l.dims[a as usize]).collect();
        dims.extend(
            Self::free(l.rank(), &self.lhs_batch, &self.lhs_contracting)
                .iter()
                .map(|&i| l.dims[i]),
        );
        dims.extend(
            Self::free(r.rank(), &self.rhs_batch, &self.rhs_contracting)
                .iter()
                .map(|&i| r.dims[i]),
        );
        Ok(vec![TensorType::new(
            self.preferred_element_type.unwrap_or(l.dtype),
            dims,
        )])
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        let mut parts = Vec::new();
        if !self.lhs_batch.is_empty() {
            parts.push(format!(
                "lhs_batching_dimensions = {}",
                mlir_list(&self.lhs_batch)
            ));
            parts.push(format!(
                "rhs_batching_dimensions = {}",
                mlir_list(&self.rhs_batch)
            ));
        }
        parts.push(format!(
            "lhs_contracting_dimensions = {}",
            mlir_list(&self.lhs_contracting)
        ));
        parts.push(format!(
            "rhs_contracting_dimensions = {}",
            mlir_list(&self.rhs_contracting)
        ));
        let mut s = Spelling::new("stablehlo.dot_general").attr(
            "dot_dimension_numbers",
            format!("#stablehlo.dot<{}>", parts.join(", ")),
        );
        if let Some(p) = self.precision {
            let p = format!("#stablehlo<precision {}>", p.spelling().0);
            s = s.attr("precision_config", format!("[{p}, {p}]"));
        }
        Lowering::Op(s)
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        let mut s = Spelling::new("dot");
        if !self.lhs_batch.is_empty() {
            s = s.attr("lhs_batch_dims", hlo_list(&self.lhs_batch));
        }
        s = s.attr("lhs_contracting_dims", hlo_list(&self.lhs_contracting));
        if !self.rhs_batch.is_empty() {
            s = s.attr("rhs_batch_dims", hlo_list(&self.rhs_batch));
        }
        s = s.attr("rhs_contracting_dims", hlo_list(&self.rhs_contracting));
        if let Some(p) = self.precision {
            let p = p.spelling().1;
            s = s.attr("operand_precision", format!("{{{p},{p}}}"));
        }
        Lowering::Op(s)
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        let g = a.g();
        let lhs = Operand::new(a.operands[0], &self.lhs_batch, &self.lhs_contracting);
        let rhs = Operand::new(a.operands[1], &self.rhs_batch, &self.rhs_contracting);
        // g dims: [batch.., lhs free.., rhs free..].
        let nb = self.lhs_batch.len();
        let g_lf: Vec<i64> = (nb..nb + lhs.free.len()).map(|i| i as i64).collect();
        let g_rf: Vec<i64> = (nb + lhs.free.len()..nb + lhs.free.len() + rhs.free.len())
            .map(|i| i as i64)
            .collect();
        Ok(vec![
            a.when(0, || self.operand_grad(g, &lhs, &rhs, &g_rf)),
            a.when(1, || self.operand_grad(g, &rhs, &lhs, &g_lf)),
        ])
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let (l, r) = (&operands[0], &operands[1]);
        let out = &results[0];
        let lf = Self::free(l.ty.rank(), &self.lhs_batch, &self.lhs_contracting);
        let rf = Self::free(r.ty.rank(), &self.rhs_batch, &self.rhs_contracting);
        let cdims: Vec<i64> = self
            .lhs_contracting
            .iter()
            .map(|&a| l.ty.dims[a as usize])
            .collect();
        let nb = self.lhs_batch.len();
        let (lv, rv) = match (Elems::of(l), Elems::of(r)) {
            (Elems::Float(a), Elems::Float(b)) => (a, b),
            (Elems::Int(a), Elems::Int(b)) => (
                a.into_iter().map(|v| v as f64).collect(),
                b.into_iter().map(|v| v as f64).collect(),
            ),
            _ => return Err("operands of different kinds".into()),
        };
        let mut res = Vec::with_capacity(out.element_count());
        let mut li = vec![0i64; l.ty.rank()];
        let mut ri = vec![0i64; r.ty.rank()];
        for_each_index(&out.dims, |oi| {
            for (k, (&a, &b)) in self.lhs_batch.iter().zip(&self.rhs_batch).enumerate() {
                li[a as usize] = oi[k];
                ri[b as usize] = oi[k];
            }
            for (k, &a) in lf.iter().enumerate() {
                li[a] = oi[nb + k];
            }
            for (k, &b) in rf.iter().enumerate() {
                ri[b] = oi[nb + lf.len() + k];
            }
            let mut acc = 0f64;
            for_each_index(&cdims, |ci| {
                for (k, (&a, &b)) in self
                    .lhs_contracting
                    .iter()
                    .zip(&self.rhs_contracting)
                    .enumerate()
                {
                    li[a as usize] = ci[k];
                    ri[b as usize] = ci[k];
                }
                acc += lv[linear_index(&l.ty.dims, &li)] * rv[linear_index(&r.ty.dims, &ri)];
            });
            res.push(round_to(out.dtype, acc));
        });
        Ok(vec![Literal::from_f64s(out.clone(), &res)])
    }
}
