//! Losses of next-token prediction, as HF's causal-LM loss computes them
//! (masked positions excluded, the mean over the counted ones), from the
//! whole logits or from the last hidden states a chunk of positions at a
//! time ([`chunked_cross_entropy_sum`]), so that `[tokens, vocab]` logits
//! in f32 are never all held at once.

use hlo_ir::ops::Gather;
use hlo_ir::{full, iota, scan, DType, Inputs, Tensor, TensorType};

/// Mean cross-entropy of next-token prediction over masked positions:
/// `sum(mask · (logsumexp(logits) − logit[label])) / max(sum(mask), 1)`,
/// label `t` being token `t + 1`; no one-hot matrix is formed.
pub fn masked_cross_entropy(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> Tensor {
    mean(masked_cross_entropy_sum(logits, input_ids, loss_mask))
}

/// `total / max(count, 1)`.
pub fn mean((total, count): (Tensor, Tensor)) -> Tensor {
    total / count.maximum(count.scalar_like(1.0))
}

/// The summed cross-entropy over masked positions and their count (f32
/// scalars; f64 for f64 logits), from which means over several batches
/// are exact.
pub fn masked_cross_entropy_sum(
    logits: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
) -> (Tensor, Tensor) {
    let mask = loss_mask.cast(logits.dtype().accumulator());
    let total = token_losses_sum(logits, next_token_labels(input_ids), mask);
    let all: Vec<i64> = (0..mask.rank() as i64).collect();
    (total, mask.sum(&all))
}

/// [`masked_cross_entropy_sum`] of the logits `head(h)` for the last
/// hidden states `h: [b, s, hidden]`, computed `chunk` positions of every
/// row at a time in a scan (`chunk` divides `s`): only `[b, chunk, vocab]`
/// logits exist at once, in the forward and (the scan's gradient
/// recomputes them per chunk) in the backward. `head` runs inside the
/// scan's body, so it reads the head's weights from its inputs: `consts`,
/// by their names.
pub fn chunked_cross_entropy_sum(
    h: Tensor,
    consts: &[(&str, Tensor)],
    head: impl Fn(&Inputs, Tensor) -> Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    chunk: i64,
) -> (Tensor, Tensor) {
    let d = h.dims();
    let (b, s, hidden) = (d[0], d[1], d[2]);
    assert!(
        chunk >= 1 && s % chunk == 0,
        "the loss chunk ({chunk}) must divide the sequence ({s})"
    );
    let n = s / chunk;
    // Chunks along the sequence, each holding every row: a batch split
    // over devices stays split.
    let chunks = |x: Tensor, tail: &[i64]| {
        let mut dims = vec![b, n, chunk];
        dims.extend_from_slice(tail);
        let mut perm = vec![1, 0, 2];
        perm.extend((3..dims.len() as i64).collect::<Vec<_>>());
        x.reshape(&dims).transpose(&perm)
    };
    let mask = loss_mask.cast(h.dtype().accumulator());
    let zero = full(TensorType::scalar(mask.dtype()), 0.0);
    let (carry, _) = scan(
        &[("total", zero)],
        &[
            ("h", chunks(h, &[hidden])),
            ("labels", chunks(next_token_labels(input_ids), &[])),
            ("mask", chunks(mask, &[])),
        ],
        consts,
        |c| {
            let logits = head(c, c["h"]);
            let part = token_losses_sum(logits, c["labels"], c["mask"]);
            (vec![c["total"] + part], vec![])
        },
    );
    (carry[0], mask.sum(&[0, 1]))
}

/// Labels of next-token prediction: `input_ids` shifted left by one; the
/// last position has none (0, its mask is 0 there).
fn next_token_labels(input_ids: Tensor) -> Tensor {
    let d = input_ids.dims();
    let (b, s) = (d[0], d[1]);
    let next = input_ids.slice(&[0, 1], &[b, s]);
    Tensor::concat(&[next, full(TensorType::new(DType::I32, [b, 1]), 0.0)], 1)
}

/// `sum(mask · (logsumexp(logits) − logit[label]))` in f32 (f64), for
/// `logits: [.., vocab]` and `labels`, `mask` (of that dtype) of the
/// leading shape.
fn token_losses_sum(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor {
    let d = logits.dims();
    let v = d[d.len() - 1];
    let n: i64 = d[..d.len() - 1].iter().product();
    let lf = logits.cast(mask.dtype()).reshape(&[n, v]);
    // The max keeps exp in range; its gradient cancels, so autodiff gets none.
    let m = lf.max(&[1]).stop_gradient();
    let lse = m
        + (lf - m.broadcast_in_dim(&[n, v], &[0]))
            .exp()
            .sum(&[1])
            .log();
    let rows = iota(TensorType::new(DType::I32, [n, 1]), 0);
    let picked = lf.gather(
        Tensor::concat(&[rows, labels.reshape(&[n, 1])], 1),
        Gather {
            offset_dims: vec![],
            collapsed_slice_dims: vec![0, 1],
            start_index_map: vec![0, 1],
            index_vector_dim: 1,
            slice_sizes: vec![1, 1],
        },
    );
    ((lse - picked) * mask.reshape(&[n])).sum(&[0])
}

/// Positions per chunk of the chunked loss for rows of `seq` tokens,
/// `batch` rows and `vocab` logits: whole rows (no scan) while `[batch,
/// seq, vocab]` f32 logits stay under 256 MiB, otherwise the largest
/// divisor of `seq` that keeps one chunk's logits under that.
pub fn default_loss_chunk(batch: i64, seq: i64, vocab: i64) -> i64 {
    const BUDGET: i64 = 256 << 20;
    let per_position = (batch * vocab * 4).max(1);
    let most = (BUDGET / per_position).max(1);
    if seq <= most {
        seq
    } else {
        crate::attention::block_dividing(seq, most)
    }
}
