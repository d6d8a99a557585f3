//! Losses of next-token prediction, as HF's causal-LM loss computes them
//! (masked positions excluded, the mean over the counted ones), from the
//! whole logits or from the last hidden states a chunk of positions at a
//! time ([`chunked_cross_entropy_sum`]), so that `[tokens, vocab]` logits
//! in f32 are never all held at once.

use hlo_ir::ops::Gather;
use hlo_ir::{full, iota, scan, DType, Inputs, Tensor, TensorType};

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
    let (s, hidden) = (d[1], d[2]);
    assert!(
        chunk >= 1 && s % chunk == 0,
        "the loss chunk ({chunk}) must divide the sequence ({s})"
    );
    let chunks = |x: Tensor, tail: &[i64]| position_chunks(x, chunk, tail);
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

/// What preference losses and their metrics read of each position's
/// next-token distribution, `[rows, s]` f32 each (position `t` predicts
/// token `t + 1`; the last position's figures are meaningless): the
/// next token's log-probability, with its gradient; and without gradient
/// the distribution's entropy, the mean of its logits over the
/// vocabulary, and 1 where the next token's logit is the largest (a tie
/// counts) else 0.
#[derive(Clone, Copy)]
pub struct TokenStats {
    pub logps: Tensor,
    pub entropy: Tensor,
    pub mean_logit: Tensor,
    pub top1: Tensor,
}

/// [`TokenStats`] of `logits: [n, vocab]` (f32) and `labels` (`n`
/// elements), each `[n]`.
fn stats_of(logits: Tensor, labels: Tensor) -> [Tensor; 4] {
    let v = logits.dims()[1];
    let frozen = logits.stop_gradient();
    let label = picked(frozen, labels);
    [
        -token_losses(logits, labels, DType::F32),
        entropy_per_position(logits),
        frozen.sum(&[1]) / v as f64,
        label.ge(frozen.max(&[1])).cast(DType::F32),
    ]
}

/// [`TokenStats`] of whole `logits: [b, s, vocab]` for `input_ids`.
pub(crate) fn token_stats(logits: Tensor, input_ids: Tensor) -> TokenStats {
    let d = logits.dims();
    let (b, s, v) = (d[0], d[1], d[2]);
    let lf = logits.cast(DType::F32).reshape(&[b * s, v]);
    let [logps, entropy, mean_logit, top1] =
        stats_of(lf, next_token_labels(input_ids)).map(|t| t.reshape(&[b, s]));
    TokenStats {
        logps,
        entropy,
        mean_logit,
        top1,
    }
}

/// [`TokenStats`] of the logits `head(h)` for the last hidden states `h:
/// [b, s, hidden]`, computed `chunk` positions of every row at a time in
/// a scan (as [`chunked_cross_entropy_sum`] does): never more than `[b,
/// chunk, vocab]` logits at once, forward or backward.
pub(crate) fn chunked_token_stats(
    h: Tensor,
    consts: &[(&str, Tensor)],
    head: impl Fn(&Inputs, Tensor) -> Tensor,
    input_ids: Tensor,
    chunk: i64,
) -> TokenStats {
    let d = h.dims();
    let (b, s, hidden) = (d[0], d[1], d[2]);
    assert!(
        chunk >= 1 && s % chunk == 0,
        "the loss chunk ({chunk}) must divide the sequence ({s})"
    );
    let chunks = |x: Tensor, tail: &[i64]| position_chunks(x, chunk, tail);
    let zero = full(TensorType::scalar(DType::F32), 0.0);
    let (_, ys) = scan(
        &[("unused", zero)],
        &[
            ("h", chunks(h, &[hidden])),
            ("labels", chunks(next_token_labels(input_ids), &[])),
        ],
        consts,
        |c| {
            let logits = head(c, c["h"]).cast(DType::F32);
            let v = logits.dims()[2];
            let stats = stats_of(logits.reshape(&[b * chunk, v]), c["labels"]);
            (
                vec![c["unused"]],
                stats.map(|t| t.reshape(&[b, chunk])).to_vec(),
            )
        },
    );
    // [n, b, chunk] back to [b, s].
    let back = |y: Tensor| y.transpose(&[1, 0, 2]).reshape(&[b, s]);
    TokenStats {
        logps: back(ys[0]),
        entropy: back(ys[1]),
        mean_logit: back(ys[2]),
        top1: back(ys[3]),
    }
}

/// `x: [b, s, ..tail]` as `[s / chunk, b, chunk, ..tail]`: chunks along
/// the sequence, each holding every row (a batch split over devices stays
/// split), to scan over.
fn position_chunks(x: Tensor, chunk: i64, tail: &[i64]) -> Tensor {
    let d = x.dims();
    let mut dims = vec![d[0], d[1] / chunk, chunk];
    dims.extend_from_slice(tail);
    let mut perm = vec![1, 0, 2];
    perm.extend((3..dims.len() as i64).collect::<Vec<_>>());
    x.reshape(&dims).transpose(&perm)
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
    let n = mask.dims().iter().product::<i64>();
    (token_losses(logits, labels, mask.dtype()) * mask.reshape(&[n])).sum(&[0])
}

/// The log-probabilities of each row's masked next tokens, summed, and
/// how many there are (`[rows]` each, f32; f64 for f64 logits): what
/// preference losses compare between a chosen and a rejected completion.
/// `logits: [rows, s, vocab]`, `input_ids` and `loss_mask: [rows, s]`,
/// the mask at `t` counting token `t + 1` as in
/// [`masked_cross_entropy_sum`].
pub(crate) fn masked_logps_per_row(
    logits: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
) -> (Tensor, Tensor) {
    let d = loss_mask.dims();
    let mask = loss_mask.cast(logits.dtype().accumulator());
    let nll = token_losses(logits, next_token_labels(input_ids), mask.dtype());
    let per_row = (nll.reshape(&d) * mask).sum(&[1]);
    (-per_row, mask.sum(&[1]))
}

/// The entropy of each position's next-token distribution, `[rows, s]`
/// (f32), without gradient.
fn entropy_per_position(logits: Tensor) -> Tensor {
    let d = logits.dims();
    let (n, v) = (d[..d.len() - 1].iter().product::<i64>(), d[d.len() - 1]);
    let l = logits.stop_gradient().cast(DType::F32).reshape(&[n, v]);
    let m = l.max(&[1]);
    let shifted = l - m.broadcast_in_dim(&[n, v], &[0]);
    let z = shifted.exp().sum(&[1]);
    // H = log z − Σ p·shifted, with p = exp(shifted) / z.
    let h = z.log() - (shifted.exp() * shifted).sum(&[1]) / z;
    h.reshape(&d[..d.len() - 1])
}

/// `logsumexp(logits) − logit[label]` of every position, flattened
/// (`[n]`, in `dtype`), for `logits: [.., vocab]` and `labels` of the
/// leading shape.
fn token_losses(logits: Tensor, labels: Tensor, dtype: DType) -> Tensor {
    let d = logits.dims();
    let v = d[d.len() - 1];
    let n: i64 = d[..d.len() - 1].iter().product();
    let lf = logits.cast(dtype).reshape(&[n, v]);
    // The max keeps exp in range; its gradient cancels, so autodiff gets none.
    let m = lf.max(&[1]).stop_gradient();
    let lse = m
        + (lf - m.broadcast_in_dim(&[n, v], &[0]))
            .exp()
            .sum(&[1])
            .log();
    lse - picked(lf, labels)
}

/// `lf[i, labels[i]]` of `lf: [n, vocab]` and `labels` of `n` elements
/// (any shape, read row-major).
fn picked(lf: Tensor, labels: Tensor) -> Tensor {
    let n = lf.dims()[0];
    let rows = iota(TensorType::new(DType::I32, [n, 1]), 0);
    lf.gather(
        Tensor::concat(&[rows, labels.reshape(&[n, 1])], 1),
        Gather {
            offset_dims: vec![],
            collapsed_slice_dims: vec![0, 1],
            start_index_map: vec![0, 1],
            index_vector_dim: 1,
            slice_sizes: vec![1, 1],
        },
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use hlo_ir::{interpret, trace, Literal, Outputs};

    /// Deterministic values in about [-2, 2].
    fn values(n: usize, seed: u64) -> Vec<f64> {
        (0..n)
            .map(|k| {
                let x = (k as u64 + 1).wrapping_mul(6364136223846793005) ^ seed;
                ((x >> 11) % 4001) as f64 / 1000.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn per_row_logps_are_the_rows_masked_next_token_log_probabilities() {
        let (rows, s, v) = (3usize, 5usize, 7usize);
        let logits = values(rows * s * v, 3);
        let ids: Vec<f64> = (0..rows * s).map(|k| ((k * 5 + 2) % v) as f64).collect();
        // Row 0 learns 3 tokens, row 1 one, row 2 none.
        let mask: Vec<f64> = [[0., 1., 1., 1., 0.], [0., 0., 0., 1., 0.], [0.; 5]]
            .concat()
            .to_vec();
        let types = [
            ("logits", TensorType::new(DType::F64, [3, 5, 7])),
            ("input_ids", TensorType::new(DType::I32, [3, 5])),
            ("loss_mask", TensorType::new(DType::F32, [3, 5])),
        ];
        let f = trace("logps", &types, |i| {
            let (sum, count) = masked_logps_per_row(i["logits"], i["input_ids"], i["loss_mask"]);
            Outputs::new().add("sum", sum).add("count", count)
        })
        .unwrap();
        let out = interpret(
            &f,
            &[
                Literal::from_f64s(types[0].1.clone(), &logits),
                Literal::from_f64s(types[1].1.clone(), &ids),
                Literal::from_f64s(types[2].1.clone(), &mask),
            ],
        )
        .unwrap();
        for r in 0..rows {
            let (mut want, mut count) = (0.0, 0.0);
            for t in 0..s - 1 {
                if mask[r * s + t] == 0.0 {
                    continue;
                }
                let row = &logits[(r * s + t) * v..(r * s + t + 1) * v];
                let lse = row.iter().map(|x| x.exp()).sum::<f64>().ln();
                want += row[ids[r * s + t + 1] as usize] - lse;
                count += 1.0;
            }
            let got = out[0].to_f64s()[r];
            assert!((got - want).abs() < 1e-12, "row {r}: {got} against {want}");
            assert_eq!(out[1].to_f64s()[r], count);
        }
    }
}
