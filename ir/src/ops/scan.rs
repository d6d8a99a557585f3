//! `scan`: a loop with a fixed trip count over stacked inputs, the form
//! layers are stacked in (`jax.lax.scan`). Differentiable, unlike `while`:
//! its VJP is a reverse scan of the body's VJP.
//!
//! Operands: `carry` (`num_carry` values), `xs` (`num_xs` values, each
//! `[length, ...]`, sliced per iteration), then loop-invariant `consts`.
//! The body maps `(carry, x slices, consts) -> (carry, y slices)`. Results:
//! the final carry, the stacked `ys` (`[length, ...]`), and the carry at the
//! start of every iteration (`[length, ...]`, what the VJP needs; unused, it
//! costs nothing after XLA's dead-code elimination).
//!
//! It lowers to [`Lowering::Expanded`]: the printers never see a scan, as
//! [`crate::lower_scans`] first rewrites it into a `while` over dynamic
//! slices (as JAX lowers `scan`).

use crate::graph::SubFunction;
use crate::op::{Lowering, OpRule, Vjp};
use crate::{Literal, Tensor, TensorType};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scan {
    pub body: SubFunction,
    pub length: i64,
    pub num_carry: usize,
    pub num_xs: usize,
    /// Iterate from the last index to the first.
    pub reverse: bool,
}

/// `[length] ++ dims`.
pub(crate) fn stacked(length: i64, t: &TensorType) -> TensorType {
    let mut dims = vec![length];
    dims.extend(&t.dims);
    TensorType::new(t.dtype, dims)
}

impl Scan {
    fn num_ys(&self) -> usize {
        self.body.outputs.len() - self.num_carry
    }
}

impl OpRule for Scan {
    fn name(&self) -> &'static str {
        "scan"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        let (c, x) = (self.num_carry, self.num_xs);
        if operands.len() < c + x {
            return Err(format!(
                "needs {c} carries and {x} stacked inputs, got {} operands",
                operands.len()
            ));
        }
        if self.length < 1 {
            return Err(format!("length must be positive, got {}", self.length));
        }
        let body_in = self.body.input_types();
        if body_in.len() != operands.len() {
            return Err(format!(
                "the body takes {} inputs, the scan has {} operands",
                body_in.len(),
                operands.len()
            ));
        }
        for (i, (o, b)) in operands.iter().zip(&body_in).enumerate() {
            let want = if (c..c + x).contains(&i) {
                stacked(self.length, b)
            } else {
                b.clone()
            };
            if *o != want {
                return Err(format!("operand {i} is {o}, the body needs {want}"));
            }
        }
        let body_out = self.body.output_types();
        if body_out.len() < c || body_out[..c] != body_in[..c] {
            return Err(format!(
                "the body must return its carry {:?} first",
                &body_in[..c]
            ));
        }
        let mut out: Vec<TensorType> = body_out[..c].to_vec();
        out.extend(body_out[c..].iter().map(|t| stacked(self.length, t)));
        out.extend(body_in[..c].iter().map(|t| stacked(self.length, t)));
        Ok(out)
    }
    fn stablehlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Expanded { by: "lower_scans" }
    }
    fn hlo(&self, _: &[TensorType], _: &[TensorType]) -> Lowering {
        Lowering::Expanded { by: "lower_scans" }
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        crate::autodiff::scan_vjp(self, a)
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let (c, x) = (self.num_carry, self.num_xs);
        let mut carry: Vec<Literal> = operands[..c].to_vec();
        let consts = &operands[c + x..];
        let ny = self.num_ys();
        let mut ys: Vec<Vec<u8>> = vec![Vec::new(); ny];
        let mut hist: Vec<Vec<u8>> = vec![Vec::new(); c];
        let mut ys_rows: Vec<Vec<Vec<u8>>> = vec![vec![Vec::new(); self.length as usize]; ny];
        let mut hist_rows: Vec<Vec<Vec<u8>>> = vec![vec![Vec::new(); self.length as usize]; c];
        for step in 0..self.length {
            let i = if self.reverse {
                self.length - 1 - step
            } else {
                step
            } as usize;
            let mut args = carry.clone();
            for xs in &operands[c..c + x] {
                let row = xs.bytes.len() / self.length as usize;
                let ty = TensorType::new(xs.ty.dtype, xs.ty.dims[1..].to_vec());
                args.push(Literal {
                    ty,
                    bytes: xs.bytes[i * row..(i + 1) * row].to_vec(),
                });
            }
            args.extend_from_slice(consts);
            for (k, cv) in carry.iter().enumerate() {
                hist_rows[k][i] = cv.bytes.clone();
            }
            let out = crate::interpret(&self.body, &args).map_err(|e| e.to_string())?;
            for (k, y) in out[c..].iter().enumerate() {
                ys_rows[k][i] = y.bytes.clone();
            }
            carry = out[..c].to_vec();
        }
        for k in 0..ny {
            ys[k] = ys_rows[k].concat();
        }
        for k in 0..c {
            hist[k] = hist_rows[k].concat();
        }
        let mut out = carry;
        out.extend(
            ys.into_iter()
                .zip(&results[c..c + ny])
                .map(|(b, t)| Literal {
                    ty: t.clone(),
                    bytes: b,
                }),
        );
        out.extend(
            hist.into_iter()
                .zip(&results[c + ny..])
                .map(|(b, t)| Literal {
                    ty: t.clone(),
                    bytes: b,
                }),
        );
        Ok(out)
    }
}
