//! Losses of next-token prediction, as HF's causal-LM loss computes them
//! (masked positions excluded, the mean over the counted ones).

use hlo_ir::ops::Gather;
use hlo_ir::{full, iota, DType, Tensor, TensorType};

/// Mean cross-entropy of next-token prediction over masked positions:
/// `sum(mask · (logsumexp(logits) − logit[label])) / max(sum(mask), 1)`,
/// label `t` being token `t + 1`; no one-hot matrix is formed.
pub fn masked_cross_entropy(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> Tensor {
    let (total, count) = masked_cross_entropy_sum(logits, input_ids, loss_mask);
    total / count.maximum(count.scalar_like(1.0))
}

/// The summed cross-entropy over masked positions and their count (f32
/// scalars), from which means over several batches are exact.
pub fn masked_cross_entropy_sum(
    logits: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
) -> (Tensor, Tensor) {
    let d = logits.dims();
    let (b, s, v) = (d[0], d[1], d[2]);
    let n = b * s;
    let lf = logits.cast(DType::F32).reshape(&[n, v]);
    // The max keeps exp in range; its gradient cancels, so autodiff gets none.
    let m = lf.max(&[1]).stop_gradient();
    let lse = m
        + (lf - m.broadcast_in_dim(&[n, v], &[0]))
            .exp()
            .sum(&[1])
            .log();
    // Labels: ids shifted left; the last position has none (mask 0 there).
    let next = input_ids.slice(&[0, 1], &[b, s]);
    let labels =
        Tensor::concat(&[next, full(TensorType::new(DType::I32, [b, 1]), 0.0)], 1).reshape(&[n, 1]);
    let rows = iota(TensorType::new(DType::I32, [n, 1]), 0);
    let picked = lf.gather(
        Tensor::concat(&[rows, labels], 1),
        Gather {
            offset_dims: vec![],
            collapsed_slice_dims: vec![0, 1],
            start_index_map: vec![0, 1],
            index_vector_dim: 1,
            slice_sizes: vec![1, 1],
        },
    );
    let mask = loss_mask.cast(DType::F32).reshape(&[n]);
    (((lse - picked) * mask).sum(&[0]), mask.sum(&[0]))
}
