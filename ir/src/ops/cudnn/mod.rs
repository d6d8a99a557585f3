//! cuDNN's fused (flash) causal attention on CUDA, as XLA's cuDNN custom
//! calls: the forward `__cudnn$fmhaSoftmax` ([`CudnnAttention`]) and the
//! backward `__cudnn$fmhaSoftmaxBackward` ([`CudnnAttentionBackward`]),
//! which the forward's VJP emits. They are spelled as
//! `jax.nn.dot_product_attention(implementation='cudnn')` lowers them
//! (`api_version` 2, a JSON `GpuBackendConfig` holding the
//! `cudnn_fmha_backend_config`, fixed operand and result layouts): XLA's
//! GPU compiler recognises the calls by their target and that config, so
//! nothing else may differ.
//!
//! Q, K and V are `[B, T, N, H]` (K and V with fewer heads for
//! grouped-query attention, which cuDNN takes natively) in bf16 or f16.
//! The forward returns O as the logical `[B, N, T, H]` that cuDNN writes
//! in the layout `{3,1,2,0}` (physically `[B, T, N, H]`, so the transpose
//! the caller applies costs nothing), each query's softmax statistics
//! (the log-sum-exp of its scaled scores, f32 `[B, N, T]`: what the
//! backward recomputes the probabilities from) and a `u8[0]` workspace
//! XLA resizes. The backward takes Q, K, V, the statistics, dO and O (both
//! `[B, T, N, H]`) and returns dQ, dK, dV as `[B, N, T, H]`-shaped
//! logical results (same layout trick) and a workspace.
//!
//! The calls are opaque to XLA's partitioner, so both lower to
//! [`Lowering::Manual`]: on a mesh each runs per device in a
//! manual-sharding region with the batch split over
//! [`CudnnFmha::batch_axes`] and the heads over [`CudnnFmha::head_axes`],
//! and the backend config is written for the per-device shapes.
//!
//! `eval` computes the same attention in f64 on the host (the probabilities
//! unrounded), so programs holding the calls can be interpreted on a CPU.

mod backend_config;
mod reference;

use std::hash::{Hash, Hasher};

use super::arity;
use crate::op::{mlir_string, Lowering, OpRule, Spelling, Vjp};
use crate::trace::apply;
use crate::{DType, Literal, Op, Tensor, TensorType};

/// The forward call's target.
pub const FORWARD_TARGET: &str = "__cudnn$fmhaSoftmax";
/// The backward call's target.
pub const BACKWARD_TARGET: &str = "__cudnn$fmhaSoftmaxBackward";
/// The largest head dimension cuDNN's flash attention takes on Hopper and
/// later GPUs (128 before Hopper); it must also be a multiple of 8.
pub const MAX_HEAD_DIM: i64 = 256;

/// What the forward and backward calls of one attention share.
#[derive(Clone, Debug)]
pub struct CudnnFmha {
    /// Multiplies `q·kᵀ` before the softmax (`fmha_scale`).
    pub scale: f64,
    /// cuDNN's `sliding_window_length`: query `t` sees keys in `(t −
    /// window, t]` (HF's sliding window of that many positions, itself
    /// included). `None`: every earlier key.
    pub window: Option<i64>,
    /// The mesh axes the batch is split over in the manual region.
    pub batch_axes: Vec<String>,
    /// The mesh axes the heads (query and key/value alike) are split over
    /// in the manual region.
    pub head_axes: Vec<String>,
}

// By the scale's bits: ops are compared and hashed (CSE), and a NaN scale
// is refused by the shape rule anyway.
impl PartialEq for CudnnFmha {
    fn eq(&self, other: &Self) -> bool {
        self.scale.to_bits() == other.scale.to_bits()
            && self.window == other.window
            && self.batch_axes == other.batch_axes
            && self.head_axes == other.head_axes
    }
}

impl Eq for CudnnFmha {}

impl Hash for CudnnFmha {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.scale.to_bits().hash(state);
        self.window.hash(state);
        self.batch_axes.hash(state);
        self.head_axes.hash(state);
    }
}

/// `__cudnn$fmhaSoftmax`: `(q, k, v) -> (o [B,N,T,H], stats f32 [B,N,T],
/// workspace u8[0])`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CudnnAttention(pub CudnnFmha);

/// `__cudnn$fmhaSoftmaxBackward`: `(q, k, v, stats, do, o) -> (dq
/// [B,N,T,H], dk [B,Nk,S,H], dv [B,Nk,S,H], workspace u8[0])`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CudnnAttentionBackward(pub CudnnFmha);

/// Causal attention of `q: [B, T, N, H]` over `k`, `v: [B, T, Nk, H]` by
/// cuDNN: returns O as `[B, N, T, H]` (transpose it to `[B, T, N, H]`) and
/// the softmax statistics `[B, N, T]` (f32). Differentiable in `q`, `k`
/// and `v` through O (the statistics have no gradient).
pub fn cudnn_attention(q: Tensor, k: Tensor, v: Tensor, config: CudnnFmha) -> (Tensor, Tensor) {
    let r = apply(Op::CudnnAttention(CudnnAttention(config)), &[q, k, v], 3);
    (r[0], r[1])
}

/// The sizes of one attention: batch `b`, queries `t`, query heads `n`,
/// keys `s`, key/value heads `nk`, head dimension `h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub b: i64,
    pub t: i64,
    pub n: i64,
    pub s: i64,
    pub nk: i64,
    pub h: i64,
    pub dtype: DType,
}

impl Shape {
    /// The sizes of `q: [B,T,N,H]`, `k`, `v: [B,S,Nk,H]`, or why the calls
    /// cannot take them.
    fn of(q: &TensorType, k: &TensorType, v: &TensorType) -> Result<Shape, String> {
        if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
            return Err("q, k and v must be [batch, seq, heads, head_dim]".into());
        }
        if !matches!(q.dtype, DType::BF16 | DType::F16) || k.dtype != q.dtype || v.dtype != q.dtype
        {
            return Err(format!(
                "cuDNN's flash attention takes bf16 or f16 q, k, v of one dtype, got {}, {}, {}",
                q.dtype, k.dtype, v.dtype
            ));
        }
        let (qd, kd) = (&q.dims, &k.dims);
        let shape = Shape {
            b: qd[0],
            t: qd[1],
            n: qd[2],
            s: kd[1],
            nk: kd[2],
            h: qd[3],
            dtype: q.dtype,
        };
        if k.dims != v.dims || kd[0] != shape.b || kd[3] != shape.h {
            return Err(format!(
                "k and v must be [{}, seq, kv_heads, {}] alike, got {k} and {v}",
                shape.b, shape.h
            ));
        }
        if shape.nk < 1 || shape.n % shape.nk != 0 {
            return Err(format!(
                "{} query heads do not group over {} key/value heads",
                shape.n, shape.nk
            ));
        }
        // Causal self-attention: cuDNN aligns the diagonal differently
        // from HF when the key and query lengths differ.
        if shape.s != shape.t {
            return Err(format!(
                "causal self-attention needs as many keys as queries, got {} and {}",
                shape.s, shape.t
            ));
        }
        if shape.h % 8 != 0 || shape.h > MAX_HEAD_DIM {
            return Err(format!(
                "head dimension {} is not a multiple of 8 up to {MAX_HEAD_DIM}",
                shape.h
            ));
        }
        Ok(shape)
    }

    /// Q, dO and O as the calls take them: `[B, T, N, H]`.
    fn queries(&self) -> TensorType {
        TensorType::new(self.dtype, [self.b, self.t, self.n, self.h])
    }

    /// O and dQ as the calls return them: `[B, N, T, H]`.
    fn per_head(&self) -> TensorType {
        TensorType::new(self.dtype, [self.b, self.n, self.t, self.h])
    }

    /// dK and dV as the backward returns them: `[B, Nk, S, H]`.
    fn kv_per_head(&self) -> TensorType {
        TensorType::new(self.dtype, [self.b, self.nk, self.s, self.h])
    }

    /// The softmax statistics: f32 `[B, N, T]`.
    fn stats(&self) -> TensorType {
        TensorType::new(DType::F32, [self.b, self.n, self.t])
    }
}

/// The scratch buffer each call returns, which XLA sizes itself.
fn workspace() -> TensorType {
    TensorType::new(DType::U8, [0])
}

impl CudnnFmha {
    fn check(&self) -> Result<(), String> {
        if !self.scale.is_finite() {
            return Err(format!("the scale must be finite, got {}", self.scale));
        }
        if let Some(w) = self.window.filter(|&w| w < 1) {
            return Err(format!("the sliding window must be at least 1, got {w}"));
        }
        Ok(())
    }

    /// The region's split of a `[B, T, N, H]` operand.
    fn queries_split(&self) -> Vec<Vec<String>> {
        vec![
            self.batch_axes.clone(),
            vec![],
            self.head_axes.clone(),
            vec![],
        ]
    }

    /// The region's split of a `[B, N, T, H]` result.
    fn per_head_split(&self) -> Vec<Vec<String>> {
        vec![
            self.batch_axes.clone(),
            self.head_axes.clone(),
            vec![],
            vec![],
        ]
    }

    /// The region's split of the statistics `[B, N, T]`.
    fn stats_split(&self) -> Vec<Vec<String>> {
        vec![self.batch_axes.clone(), self.head_axes.clone(), vec![]]
    }

    /// The forward (`backward` false) or backward call on operands of
    /// types `operands`, in StableHLO or HLO text.
    fn lowering(&self, operands: &[TensorType], backward: bool, stablehlo: bool) -> Lowering {
        let shape = Shape::of(&operands[0], &operands[1], &operands[2])
            .expect("the shape rule accepted these operands");
        let json = backend_config::backend_config(&shape, self, backward);
        let (target, layouts) = if backward {
            let grad = vec![3, 1, 2, 0];
            (
                BACKWARD_TARGET,
                vec![grad.clone(), grad.clone(), grad, vec![0]],
            )
        } else {
            (
                FORWARD_TARGET,
                vec![vec![3, 1, 2, 0], vec![2, 1, 0], vec![0]],
            )
        };
        let op = if stablehlo {
            stablehlo_call(target, &json, operands, &layouts)
        } else {
            hlo_call(target, &json, operands, layouts)
        };
        let (operands, results) = if backward {
            let q = self.queries_split();
            let ins = vec![
                q.clone(),
                q.clone(),
                q.clone(),
                self.stats_split(),
                q.clone(),
                q,
            ];
            let g = self.per_head_split();
            (ins, vec![g.clone(), g.clone(), g, vec![vec![]]])
        } else {
            let q = self.queries_split();
            let outs = vec![self.per_head_split(), self.stats_split(), vec![vec![]]];
            (vec![q.clone(), q.clone(), q], outs)
        };
        Lowering::Manual {
            op,
            operands,
            results,
        }
    }
}

/// Row-major layouts (minor to major) of `types`: what the calls take.
fn row_major(types: &[TensorType]) -> Vec<Vec<i64>> {
    types
        .iter()
        .map(|t| (0..t.rank() as i64).rev().collect())
        .collect()
}

/// `[dense<[3, 2, 1, 0]> : tensor<4xindex>, dense<0> : tensor<1xindex>]`
/// (splat when every entry is equal, as MLIR prints it).
fn mlir_layouts(layouts: &[Vec<i64>]) -> String {
    let each: Vec<String> = layouts
        .iter()
        .map(|l| {
            let values = match l.first() {
                Some(&x) if l.iter().all(|&y| y == x) => x.to_string(),
                _ => super::mlir_list(l),
            };
            format!("dense<{values}> : tensor<{}xindex>", l.len())
        })
        .collect();
    format!("[{}]", each.join(", "))
}

/// `s` as an HLO string literal.
fn hlo_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

fn stablehlo_call(
    target: &str,
    json: &str,
    operands: &[TensorType],
    result_layouts: &[Vec<i64>],
) -> Spelling {
    Spelling::new("stablehlo.custom_call")
        .attr("api_version", "2 : i32")
        .attr("backend_config", mlir_string(json))
        .attr("call_target_name", mlir_string(target))
        .attr("operand_layouts", mlir_layouts(&row_major(operands)))
        .attr("result_layouts", mlir_layouts(result_layouts))
}

fn hlo_call(
    target: &str,
    json: &str,
    operands: &[TensorType],
    result_layouts: Vec<Vec<i64>>,
) -> Spelling {
    let constraints: Vec<String> = operands.iter().map(TensorType::hlo).collect();
    Spelling::new("custom-call")
        .attr("custom_call_target", hlo_string(target))
        .attr(
            "operand_layout_constraints",
            format!("{{{}}}", constraints.join(", ")),
        )
        .attr("api_version", "API_VERSION_STATUS_RETURNING")
        .attr("backend_config", hlo_string(json))
        .result_layouts(result_layouts)
}

/// Fails unless `ty` is `want` (`what` names the operand).
fn expect(what: &str, ty: &TensorType, want: &TensorType) -> Result<(), String> {
    if ty != want {
        return Err(format!("{what} must be {want}, got {ty}"));
    }
    Ok(())
}

impl OpRule for CudnnAttention {
    fn name(&self) -> &'static str {
        "cudnn_attention"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 3)?;
        self.0.check()?;
        let shape = Shape::of(&operands[0], &operands[1], &operands[2])?;
        Ok(vec![shape.per_head(), shape.stats(), workspace()])
    }
    fn stablehlo(&self, operands: &[TensorType], _: &[TensorType]) -> Lowering {
        self.0.lowering(operands, false, true)
    }
    fn hlo(&self, operands: &[TensorType], _: &[TensorType]) -> Lowering {
        self.0.lowering(operands, false, false)
    }
    fn vjp(&self, a: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        if a.cotangents[1].is_some() {
            return Err("cuDNN's softmax statistics have no gradient rule".into());
        }
        let Some(d_out) = a.cotangents[0] else {
            return Ok(vec![None, None, None]);
        };
        // The backward takes dO and O as [B, T, N, H], as Q.
        let swap = |x: Tensor| x.transpose(&[0, 2, 1, 3]);
        let operands = [
            a.operands[0],
            a.operands[1],
            a.operands[2],
            a.results[1],
            swap(d_out),
            swap(a.results[0]),
        ];
        let grads = apply(
            Op::CudnnAttentionBackward(CudnnAttentionBackward(self.0.clone())),
            &operands,
            4,
        );
        Ok((0..3).map(|i| a.when(i, || swap(grads[i]))).collect())
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let shape = Shape::of(&operands[0].ty, &operands[1].ty, &operands[2].ty)?;
        let [q, k, v] = [0, 1, 2].map(|i| operands[i].to_f64s());
        let (o, stats) = reference::forward(&shape, &self.0, &q, &k, &v);
        Ok(vec![
            Literal::from_f64s(results[0].clone(), &o),
            Literal::from_f64s(results[1].clone(), &stats),
            Literal::from_f64s(results[2].clone(), &[]),
        ])
    }
}

impl OpRule for CudnnAttentionBackward {
    fn name(&self) -> &'static str {
        "cudnn_attention_backward"
    }
    fn infer(&self, operands: &[TensorType]) -> Result<Vec<TensorType>, String> {
        arity(operands, 6)?;
        self.0.check()?;
        let shape = Shape::of(&operands[0], &operands[1], &operands[2])?;
        expect("the softmax statistics", &operands[3], &shape.stats())?;
        expect("dO", &operands[4], &shape.queries())?;
        expect("O", &operands[5], &shape.queries())?;
        Ok(vec![
            shape.per_head(),
            shape.kv_per_head(),
            shape.kv_per_head(),
            workspace(),
        ])
    }
    fn stablehlo(&self, operands: &[TensorType], _: &[TensorType]) -> Lowering {
        self.0.lowering(operands, true, true)
    }
    fn hlo(&self, operands: &[TensorType], _: &[TensorType]) -> Lowering {
        self.0.lowering(operands, true, false)
    }
    fn vjp(&self, _: &Vjp) -> Result<Vec<Option<Tensor>>, String> {
        Err("cuDNN's attention backward has no derivative (no second-order gradients)".into())
    }
    fn eval(&self, operands: &[Literal], results: &[TensorType]) -> Result<Vec<Literal>, String> {
        let shape = Shape::of(&operands[0].ty, &operands[1].ty, &operands[2].ty)?;
        let x: Vec<Vec<f64>> = operands.iter().map(Literal::to_f64s).collect();
        let (dq, dk, dv) = reference::backward(
            &shape,
            &self.0,
            (&x[0], &x[1], &x[2]),
            &x[3],
            (&x[4], &x[5]),
        );
        Ok(vec![
            Literal::from_f64s(results[0].clone(), &dq),
            Literal::from_f64s(results[1].clone(), &dk),
            Literal::from_f64s(results[2].clone(), &dv),
            Literal::from_f64s(results[3].clone(), &[]),
        ])
    }
}
