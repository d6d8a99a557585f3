//! Attention kernels in the tracing DSL: the naive form, which materialises
//! the `[queries, keys]` scores of every head, and the blockwise form (the
//! FlashAttention algorithm), which walks blocks of queries and keys with a
//! running maximum and sum and never holds more than one block of scores.
//!
//! The blockwise form is a [`custom_vjp`]: its forward keeps only the
//! output and each query's log-sum-exp, and its backward recomputes each
//! block's probabilities from them (FlashAttention-2's backward), so
//! neither pass holds anything quadratic in the sequence. Blocks that the
//! mask hides entirely (above the causal diagonal, outside a sliding
//! window) are never visited: each query block loops over its own range
//! of key blocks. Grouped-query attention groups query heads by their
//! key/value head in the products, without copying keys or values.
//!
//! Both compute what HF's eager attention computes: `softmax(scale · q ·
//! kᵀ)` in f32 over the visible keys, the scores rounded to the input's
//! dtype before scaling, probabilities rounded to it before the product
//! with `v`.
//!
//! On CUDA GPUs a third form hands the whole attention to cuDNN's fused
//! (flash) kernels, forward and backward, through XLA's cuDNN custom calls
//! ([`cudnn_attention`]; `hlo_ir::ops::cudnn_attention` spells them). It
//! covers what those calls take ([`cudnn_supports`] says what not, so a
//! caller can fall back); its scores stay in f32 inside the kernel rather
//! than being rounded to the input's dtype first.

use hlo_ir::ops::{CudnnFmha, DotGeneral, MAX_HEAD_DIM};
use hlo_ir::{custom_vjp, full, iota, scope, while_loop, DType, Tensor, TensorType};

/// How the training and eval steps compute attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Scores `[heads, s, s]` in f32: fastest for short sequences.
    Naive,
    /// Blocks of `block` queries against blocks of `block` keys.
    Blockwise { block: i64 },
    /// cuDNN's fused flash attention ([`cudnn_attention`]): CUDA GPUs
    /// only, for the cases [`cudnn_supports`] accepts.
    Cudnn,
}

/// The query and key block the blockwise form uses for `seq` tokens by
/// default: an eighth of the sequence within 64..=256 (what measured
/// fastest on the CPU: 64 at 256 and 512 tokens, 128 at 1,024, 256 at
/// 4,096), or the largest divisor of `seq` below that.
pub fn default_block(seq: i64) -> i64 {
    block_dividing(seq, (seq / 8).clamp(64, 256))
}

/// The largest divisor of `seq` that is at most `at_most` (at least 1).
pub(crate) fn block_dividing(seq: i64, at_most: i64) -> i64 {
    (1..=at_most.min(seq).max(1))
        .rev()
        .find(|b| seq % b == 0)
        .unwrap_or(1)
}

/// Sequences from this length up use the blockwise form under `auto`: on
/// the CPU it is faster than the naive form from 256 tokens (18% at 256,
/// 5× at 4,096) and slower at 128 (BENCHMARKS.md, issue 22).
pub const AUTO_BLOCKWISE_FROM: i64 = 256;

impl AttentionKind {
    /// `auto`: naive below [`AUTO_BLOCKWISE_FROM`] tokens, blockwise with
    /// [`default_block`] from there (when the sequence has a divisor of
    /// at least 32 for a block; otherwise naive).
    pub fn auto(seq: i64) -> AttentionKind {
        let block = default_block(seq);
        if seq >= AUTO_BLOCKWISE_FROM && block >= 32 {
            AttentionKind::Blockwise { block }
        } else {
            AttentionKind::Naive
        }
    }
}

/// One attention as a step would hand it to cuDNN: what
/// [`cudnn_supports`] checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudnnCase {
    /// The dtype of queries, keys and values.
    pub dtype: DType,
    pub head_dim: i64,
    pub heads: i64,
    pub kv_heads: i64,
    /// HF's sliding window (positions a query sees, itself included).
    pub window: Option<i64>,
    /// Rows pack several samples (segment ids).
    pub packed: bool,
    /// gpt-oss's per-head sink logits.
    pub sinks: bool,
}

/// Whether cuDNN's flash attention, as [`cudnn_attention`] emits it, can
/// compute `case`; the reason when not, for the caller to print as it
/// falls back to the naive or blockwise form.
///
/// ```
/// use hlo_ir::DType;
/// use hlo_models::attention::{cudnn_supports, CudnnCase};
/// let case = CudnnCase {
///     dtype: DType::BF16, head_dim: 128, heads: 32, kv_heads: 8,
///     window: None, packed: false, sinks: false,
/// };
/// assert!(cudnn_supports(&case).is_ok());
/// let f32_case = CudnnCase { dtype: DType::F32, ..case };
/// assert!(cudnn_supports(&f32_case).unwrap_err().contains("bf16 or f16"));
/// ```
pub fn cudnn_supports(case: &CudnnCase) -> Result<(), String> {
    if !matches!(case.dtype, DType::BF16 | DType::F16) {
        return Err(format!(
            "cuDNN's flash attention takes bf16 or f16, not {}",
            case.dtype
        ));
    }
    if case.head_dim % 8 != 0 || case.head_dim > MAX_HEAD_DIM {
        return Err(format!(
            "cuDNN's flash attention takes head dimensions that are multiples of 8 up to \
             {MAX_HEAD_DIM} (128 before Hopper), not {}",
            case.head_dim
        ));
    }
    if case.kv_heads < 1 || case.heads % case.kv_heads != 0 {
        return Err(format!(
            "{} query heads do not group over {} key/value heads",
            case.heads, case.kv_heads
        ));
    }
    if case.packed {
        // The call takes packed rows only as per-row segment lengths and
        // offsets (`max_seg_per_batch` > 1), not as segment ids.
        return Err("cuDNN attention of packed rows (segment ids) is not emitted".into());
    }
    if case.sinks {
        return Err("cuDNN's softmax has no attention sinks (gpt-oss)".into());
    }
    if let Some(w) = case.window.filter(|&w| w < 1) {
        return Err(format!("a sliding window of {w} positions"));
    }
    Ok(())
}

/// Causal attention by cuDNN's fused kernels, for `q: [b, heads, s, d]`
/// and `k`, `v: [b, kv_heads, s, d]` (self-attention; grouped-query heads
/// natively) in bf16 or f16, keys within `window` positions when set (HF's
/// sliding window). On a mesh the calls run in a manual region with the
/// batch split over `batch_axes` and the heads over `head_axes` (axes the
/// mesh lacks are ignored). Returns `[b, s, heads·d]`. Check the case with
/// [`cudnn_supports`] first: the op refuses the rest at trace time.
pub fn cudnn_attention(
    (q, k, v): (Tensor, Tensor, Tensor),
    window: Option<i64>,
    scale: f64,
    (batch_axes, head_axes): (&[String], &[String]),
) -> Tensor {
    let (b, nh, s, d) = (q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]);
    // The calls take [b, s, heads, d]; XLA folds these transposes into the
    // ones that made the heads.
    let btnh = |x: Tensor| x.transpose(&[0, 2, 1, 3]);
    let config = CudnnFmha {
        scale,
        window,
        batch_axes: batch_axes.to_vec(),
        head_axes: head_axes.to_vec(),
    };
    let (out, _stats) = hlo_ir::scope("cudnn", || {
        hlo_ir::ops::cudnn_attention(btnh(q), btnh(k), btnh(v), config)
    });
    // O comes as [b, heads, s, d] laid out as [b, s, heads, d]: this
    // transpose is free.
    btnh(out).reshape(&[b, s, nh * d])
}

/// Which keys a query sees, described rather than materialised: earlier
/// keys (causal, always), within a sliding window when `window` is set
/// (`key > query − window`, HF's sliding-window mask) and of the same
/// packed segment when `segments` is set.
#[derive(Clone, Copy)]
pub struct MaskSpec {
    /// The window, an i32 scalar (traced: a scanned layer picks its own).
    pub window: Option<Tensor>,
    /// A bound on the window known when tracing (at least `window`'s
    /// value): key blocks wholly outside it are skipped. `None`: none
    /// skipped for the window (blocks above the diagonal always are).
    pub skip_outside: Option<i64>,
    /// `[b, s]` integer segment ids of packed rows.
    pub segments: Option<Tensor>,
}

/// `softmax(scale·q·kᵀ)·v` over the keys `visible` marks, for `q: [b,
/// heads, tq, d]` and `k`, `v: [b, kv_heads, tk, d]`: query heads are
/// grouped by their K/V head in one `dot_general` (no repeat_kv copies),
/// the softmax in f32. `visible` is boolean and broadcasts into `[b,
/// kv_heads, groups, tq, tk]` along `visible_dims`. `sinks` (`[heads]`,
/// gpt-oss) adds one logit per head to each softmax, for no value.
/// Returns `[b, tq, heads·d]`.
pub fn grouped_attention(
    (q, k, v): (Tensor, Tensor, Tensor),
    (visible, visible_dims): (Tensor, &[i64]),
    scale: f64,
    sinks: Option<Tensor>,
) -> Tensor {
    let (qd, kd) = (q.dims(), k.dims());
    let (b, nh, tq, hd) = (qd[0], qd[1], qd[2], qd[3]);
    let (nkv, tk) = (kd[1], kd[2]);
    let dtype = q.dtype();
    // The products come out in the inputs' dtype, as PyTorch's do (one
    // rounding of the f32-accumulated product either way, half the bytes
    // written). The scale multiplies in the dtype: the fixture of
    // PyTorch's bf16 step is 0.051 from ours so, 0.078 with the scale
    // applied in f32 and rounded after (tests/tests/llama_bf16.rs).
    let batched = |lhs_contracting: i64, rhs_contracting: i64| DotGeneral {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contracting: vec![lhs_contracting],
        rhs_contracting: vec![rhs_contracting],
        precision: None,
        preferred_element_type: None,
    };
    let shape = [b, nkv, nh / nkv, tq, tk];
    let scores = q
        .reshape(&[b, nkv, nh / nkv, tq, hd])
        .dot_general(k, batched(4, 3));
    let scores = (scores * scale).cast(DType::F32);
    let scores = visible
        .broadcast_in_dim(&shape, visible_dims)
        .where_(scores, scores.scalar_like(f32::MIN as f64));
    let probs = match sinks {
        None => scores.softmax(4),
        Some(sinks) => {
            // HF concatenates the sink as one more column and drops its
            // probability after the softmax.
            let column = sinks
                .cast(DType::F32)
                .reshape(&[nkv, nh / nkv])
                .broadcast_in_dim(&[b, nkv, nh / nkv, tq, 1], &[1, 2]);
            Tensor::concat(&[scores, column], 4)
                .softmax(4)
                .slice(&[0; 5], &shape)
        }
    };
    let probs = probs.cast(dtype);
    probs
        .dot_general(v, batched(4, 2))
        .reshape(&[b, nh, tq, hd])
        .transpose(&[0, 2, 1, 3])
        .reshape(&[b, tq, nh * hd])
}

/// [`grouped_attention`] computed blockwise, for `q: [b, heads, s, d]` and
/// `k`, `v: [b, kv_heads, s, d]` (self-attention: queries and keys are the
/// same `s` positions) with `block` dividing `s`. Returns `[b, s,
/// heads·d]`. A head's sink starts its running maximum and sum (the
/// sink's own term), so every block after folds in as usual; its
/// gradient is `−Σ p_sink · (dO·O)` over the head's queries.
pub fn blockwise_attention(
    (q, k, v): (Tensor, Tensor, Tensor),
    mask: MaskSpec,
    scale: f64,
    block: i64,
    sinks: Option<Tensor>,
) -> Tensor {
    let (qd, kd) = (q.dims(), k.dims());
    let (b, nh, s, d) = (qd[0], qd[1], qd[2], qd[3]);
    let nkv = kd[1];
    assert!(
        block >= 1 && s % block == 0,
        "the attention block ({block}) must divide the sequence ({s})"
    );
    let g = nh / nkv;
    let grouped = q.reshape(&[b, nkv, g, s, d]);
    let shape = Shape {
        b,
        nkv,
        g,
        s,
        d,
        block,
        dtype: q.dtype(),
        acc: q.dtype().accumulator(),
        scale,
        skip_outside: mask.skip_outside,
    };
    let mut operands = vec![("q", grouped), ("k", k), ("v", v)];
    if let Some(sinks) = sinks {
        operands.push(("sinks", sinks));
    }
    if let Some(w) = mask.window {
        operands.push(("window", w));
    }
    if let Some(seg) = mask.segments {
        operands.push(("segments", seg));
    }
    let out = scope("blockwise", || {
        custom_vjp(
            &operands,
            |i| {
                let sinks = i.get("sinks").map(|t| shape.sink_rows(t));
                let (out, lse) = shape.forward(Mask::of(i), i["q"], i["k"], i["v"], sinks);
                (vec![out], vec![lse])
            },
            |i| {
                let (out, lse) = (i["output.0"], i["residual.0"]);
                let (dq, dk, dv, delta) = shape.backward(
                    Mask::of(i),
                    (i["q"], i["k"], i["v"]),
                    (out, lse),
                    i["cotangent.0"],
                );
                let mut grads = vec![Some(dq), Some(dk), Some(dv)];
                if let Some(sinks) = i.get("sinks") {
                    // ∂/∂sink = −Σ p_sink·D over the batch and the queries.
                    let rows = [b, nkv, g, s];
                    let p_sink =
                        (shape.sink_rows(sinks).broadcast_in_dim(&rows, &[1, 2]) - lse).exp();
                    let d = -(p_sink * delta).sum(&[0, 3]);
                    grads.push(Some(d.reshape(&[nh]).cast(sinks.dtype())));
                }
                grads.extend([None, None]);
                grads
            },
        )[0]
    });
    out.reshape(&[b, nh, s, d])
        .transpose(&[0, 2, 1, 3])
        .reshape(&[b, s, nh * d])
}

/// The static shape of one blockwise attention, shared by its passes.
#[derive(Clone, Copy)]
struct Shape {
    b: i64,
    nkv: i64,
    g: i64,
    s: i64,
    d: i64,
    block: i64,
    dtype: DType,
    /// What scores, sums and gradients accumulate in
    /// ([`DType::accumulator`]).
    acc: DType,
    scale: f64,
    skip_outside: Option<i64>,
}

/// The mask's traced values inside one pass (inputs of its function).
#[derive(Clone, Copy)]
struct Mask {
    window: Option<Tensor>,
    segments: Option<Tensor>,
}

impl Mask {
    fn of(i: &hlo_ir::Inputs) -> Mask {
        Mask {
            window: i.get("window"),
            segments: i.get("segments"),
        }
    }

    /// As loop-carried values (loop bodies see only their carry).
    fn carried(&self) -> Vec<Tensor> {
        self.window.iter().chain(&self.segments).copied().collect()
    }

    /// From the tail of a carry laid out by [`Mask::carried`].
    fn in_carry(&self, rest: &[Tensor]) -> Mask {
        let mut it = rest.iter().copied();
        let window = self.window.and_then(|_| it.next());
        let segments = self.segments.and_then(|_| it.next());
        Mask { window, segments }
    }
}

fn i32_scalar(v: i64) -> Tensor {
    full(TensorType::scalar(DType::I32), v as f64)
}

impl Shape {
    /// A `dot_general` of two blocks accumulating in `acc`.
    fn product(
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
            precision: None,
            preferred_element_type: (self.dtype != self.acc).then_some(self.acc),
        }
    }

    fn blocks(&self) -> i64 {
        self.s / self.block
    }

    /// The key blocks `[first, last]` that query block `i` sees.
    fn key_range(&self, i: Tensor) -> (Tensor, Tensor) {
        let bl = self.block as f64;
        let last = i;
        let first = match self.skip_outside {
            // The first key any query of the block sees: i·B − W + 1.
            Some(w) => ((i * bl - (w - 1) as f64).maximum(i32_scalar(0))) / bl,
            None => i32_scalar(0),
        };
        (first, last)
    }

    /// The query blocks `[first, last]` that see key block `j`.
    fn query_range(&self, j: Tensor) -> (Tensor, Tensor) {
        let bl = self.block as f64;
        let last = match self.skip_outside {
            // The last query that sees key (j+1)·B − 1: it + W − 1.
            Some(w) => {
                ((j * bl + (bl + (w - 2) as f64)) / bl).minimum(i32_scalar(self.blocks() - 1))
            }
            None => i32_scalar(self.blocks() - 1),
        };
        (j, last)
    }

    /// Which keys of block `j` the queries of block `i` see, `[b?, B, B]`
    /// broadcast into a block of scores `[b, kv, g, B, B]`.
    fn visible(&self, mask: Mask, i: Tensor, j: Tensor) -> Tensor {
        let bl = self.block;
        let sq = TensorType::new(DType::I32, [bl, bl]);
        let queries = iota(sq.clone(), 0) + i * bl as f64;
        let keys = iota(sq, 1) + j * bl as f64;
        let mut on = keys.le(queries);
        if let Some(w) = mask.window {
            let w = w.broadcast_in_dim(&[bl, bl], &[]);
            on = on.and(keys.gt(queries - w));
        }
        let full_shape = [self.b, self.nkv, self.g, bl, bl];
        match mask.segments {
            None => on.broadcast_in_dim(&full_shape, &[3, 4]),
            Some(seg) => {
                let rows =
                    |start: Tensor| seg.dynamic_slice(&[i32_scalar(0), start], &[self.b, bl]);
                let (sq_, sk) = (rows(i * bl as f64), rows(j * bl as f64));
                let same = sq_
                    .broadcast_in_dim(&[self.b, bl, bl], &[0, 1])
                    .eq(sk.broadcast_in_dim(&[self.b, bl, bl], &[0, 2]));
                same.and(on.broadcast_in_dim(&[self.b, bl, bl], &[1, 2]))
                    .broadcast_in_dim(&full_shape, &[0, 3, 4])
            }
        }
    }

    /// Block `n` of the sequence axis `axis` of `x`.
    fn block_of(&self, x: Tensor, axis: usize, n: Tensor) -> Tensor {
        let mut dims = x.dims();
        let mut starts: Vec<Tensor> = dims.iter().map(|_| i32_scalar(0)).collect();
        starts[axis] = n * self.block as f64;
        dims[axis] = self.block;
        x.dynamic_slice(&starts, &dims)
    }

    /// `x` with `update` written as block `n` of axis `axis`.
    fn put_block(&self, x: Tensor, update: Tensor, axis: usize, n: Tensor) -> Tensor {
        let mut starts: Vec<Tensor> = x.dims().iter().map(|_| i32_scalar(0)).collect();
        starts[axis] = n * self.block as f64;
        x.dynamic_update_slice(update, &starts)
    }

    /// Scaled scores of query block `qi: [b, kv, g, B, d]` against key
    /// block `kj: [b, kv, B, d]`, f32, rounded as the naive form rounds
    /// them.
    fn scores(&self, qi: Tensor, kj: Tensor) -> Tensor {
        let raw = qi.dot_general(kj, self.product(&[0, 1], &[0, 1], &[4], &[3]));
        (raw.cast(self.dtype) * self.scale).cast(self.acc)
    }

    /// The sinks `[heads]` as `[kv, g]` in the accumulator's dtype.
    fn sink_rows(&self, sinks: Tensor) -> Tensor {
        sinks.cast(self.acc).reshape(&[self.nkv, self.g])
    }

    /// The output `[b, kv, g, s, d]` and each query's log-sum-exp `[b, kv,
    /// g, s]` (f32), the sinks' terms (`[kv, g]`) included.
    fn forward(
        &self,
        mask: Mask,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Option<Tensor>,
    ) -> (Tensor, Tensor) {
        let (b, nkv, g, s, d, bl) = (self.b, self.nkv, self.g, self.s, self.d, self.block);
        let out = full(TensorType::new(self.dtype, [b, nkv, g, s, d]), 0.0);
        let lse = full(TensorType::new(self.acc, [b, nkv, g, s]), 0.0);
        // Each query block's running maximum and sum start empty, or at
        // the sink's term (maximum itself, sum exp(0)).
        let rows = TensorType::new(self.acc, [b, nkv, g, bl]);
        let (m0, l0) = match sinks {
            None => (full(rows.clone(), f32::MIN as f64), full(rows, 0.0)),
            Some(sk) => (sk.broadcast_in_dim(&rows.dims, &[1, 2]), full(rows, 1.0)),
        };
        let mut init = vec![i32_scalar(0), out, lse, q, k, v, m0, l0];
        init.extend(mask.carried());
        let done = while_loop(
            &init,
            |c| c[0].lt(i32_scalar(self.blocks())),
            |c| {
                let (i, out, lse, q, k, v) = (c[0], c[1], c[2], c[3], c[4], c[5]);
                let (m0, l0) = (c[6], c[7]);
                let mask = mask.in_carry(&c[8..]);
                let qi = self.block_of(q, 3, i);
                let (first, last) = self.key_range(i);
                let acc = full(TensorType::new(self.acc, [b, nkv, g, bl, d]), 0.0);
                let (m, l) = (m0, l0);
                let mut inner = vec![first, last, acc, m, l, qi, k, v, i];
                inner.extend(mask.carried());
                let r = while_loop(
                    &inner,
                    |c| c[0].le(c[1]),
                    |c| {
                        let (j, last, acc, m, l, qi, k, v, i) =
                            (c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8]);
                        let mask = mask.in_carry(&c[9..]);
                        let (kj, vj) = (self.block_of(k, 2, j), self.block_of(v, 2, j));
                        let visible = self.visible(mask, i, j);
                        let scores = self.scores(qi, kj);
                        let block_max = visible
                            .where_(scores, scores.scalar_like(f32::MIN as f64))
                            .max(&[4]);
                        let m_new = m.maximum(block_max);
                        let rows = [b, nkv, g, bl, bl];
                        let p = visible.where_(
                            (scores - m_new.broadcast_in_dim(&rows, &[0, 1, 2, 3])).exp(),
                            scores.scalar_like(0.0),
                        );
                        let alpha = (m - m_new).exp();
                        let l = alpha * l + p.sum(&[4]);
                        let pv = p
                            .cast(self.dtype)
                            .dot_general(vj, self.product(&[0, 1], &[0, 1], &[4], &[2]));
                        let acc =
                            alpha.broadcast_in_dim(&[b, nkv, g, bl, d], &[0, 1, 2, 3]) * acc + pv;
                        let mut next = vec![j + 1.0, last, acc, m_new, l, qi, k, v, i];
                        next.extend(mask.carried());
                        next
                    },
                );
                let (acc, m, l) = (r[2], r[3], r[4]);
                let oi =
                    (acc / l.broadcast_in_dim(&[b, nkv, g, bl, d], &[0, 1, 2, 3])).cast(self.dtype);
                let out = self.put_block(out, oi, 3, i);
                let lse = self.put_block(lse, m + l.log(), 3, i);
                let mut next = vec![i + 1.0, out, lse, q, k, v, m0, l0];
                next.extend(mask.carried());
                next
            },
        );
        (done[1], done[2])
    }

    /// The cotangents of `q` (`[b, kv, g, s, d]`), `k` and `v` from the
    /// output's cotangent `dout`, recomputing each block's probabilities
    /// from the log-sum-exp; and `D = rowsum(dO ∘ O)` `[b, kv, g, s]`.
    fn backward(
        &self,
        mask: Mask,
        (q, k, v): (Tensor, Tensor, Tensor),
        (out, lse): (Tensor, Tensor),
        dout: Tensor,
    ) -> (Tensor, Tensor, Tensor, Tensor) {
        let (b, nkv, g, s, d, bl) = (self.b, self.nkv, self.g, self.s, self.d, self.block);
        // D_i = rowsum(dO ∘ O): the softmax's correction term.
        let delta = (dout.cast(self.acc) * out.cast(self.acc)).sum(&[4]);
        let dq = full(TensorType::new(self.acc, [b, nkv, g, s, d]), 0.0);
        let dk = full(TensorType::new(self.acc, [b, nkv, s, d]), 0.0);
        let dv = full(TensorType::new(self.acc, [b, nkv, s, d]), 0.0);
        let mut init = vec![i32_scalar(0), dq, dk, dv, q, k, v, dout, lse, delta];
        init.extend(mask.carried());
        let done = while_loop(
            &init,
            |c| c[0].lt(i32_scalar(self.blocks())),
            |c| {
                let (j, dq, dk, dv) = (c[0], c[1], c[2], c[3]);
                let (q, k, v, dout, lse, delta) = (c[4], c[5], c[6], c[7], c[8], c[9]);
                let mask = mask.in_carry(&c[10..]);
                let (kj, vj) = (self.block_of(k, 2, j), self.block_of(v, 2, j));
                let (first, last) = self.query_range(j);
                let dkj = full(TensorType::new(self.acc, [b, nkv, bl, d]), 0.0);
                let dvj = full(TensorType::new(self.acc, [b, nkv, bl, d]), 0.0);
                let mut inner = vec![first, last, dkj, dvj, dq, kj, vj, j, q, dout, lse, delta];
                inner.extend(mask.carried());
                let r = while_loop(
                    &inner,
                    |c| c[0].le(c[1]),
                    |c| {
                        let (i, last, dkj, dvj, dq, kj, vj, j) =
                            (c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]);
                        let (q, dout, lse, delta) = (c[8], c[9], c[10], c[11]);
                        let mask = mask.in_carry(&c[12..]);
                        let qi = self.block_of(q, 3, i);
                        let doi = self.block_of(dout, 3, i);
                        let rows = [b, nkv, g, bl, bl];
                        let lse_i = self
                            .block_of(lse, 3, i)
                            .broadcast_in_dim(&rows, &[0, 1, 2, 3]);
                        let delta_i = self
                            .block_of(delta, 3, i)
                            .broadcast_in_dim(&rows, &[0, 1, 2, 3]);
                        let visible = self.visible(mask, i, j);
                        let scores = self.scores(qi, kj);
                        let p = visible.where_((scores - lse_i).exp(), scores.scalar_like(0.0));
                        // dV_j += Pᵀ·dO_i (over the group's heads and queries).
                        let dvj = dvj
                            + p.cast(self.dtype)
                                .dot_general(doi, self.product(&[0, 1], &[0, 1], &[2, 3], &[2, 3]));
                        let dp = doi.dot_general(vj, self.product(&[0, 1], &[0, 1], &[4], &[3]));
                        let ds = (p * (dp - delta_i) * self.scale).cast(self.dtype);
                        let dqi = ds.dot_general(kj, self.product(&[0, 1], &[0, 1], &[4], &[2]));
                        let dq = self.put_block(dq, self.block_of(dq, 3, i) + dqi, 3, i);
                        let dkj = dkj
                            + ds.dot_general(qi, self.product(&[0, 1], &[0, 1], &[2, 3], &[2, 3]));
                        let mut next = vec![i + 1.0, last, dkj, dvj, dq, kj, vj, j];
                        next.extend([q, dout, lse, delta]);
                        next.extend(mask.carried());
                        next
                    },
                );
                let (dkj, dvj, dq) = (r[2], r[3], r[4]);
                let dk = self.put_block(dk, dkj, 2, j);
                let dv = self.put_block(dv, dvj, 2, j);
                let mut next = vec![j + 1.0, dq, dk, dv, q, k, v, dout, lse, delta];
                next.extend(mask.carried());
                next
            },
        );
        (
            done[1].cast(self.dtype),
            done[2].cast(self.dtype),
            done[3].cast(self.dtype),
            done[9],
        )
    }
}
