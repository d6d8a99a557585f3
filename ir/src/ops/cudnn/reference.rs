//! The calls' semantics on the host, in f64: causal (optionally windowed)
//! grouped-query attention and its FlashAttention-style backward from the
//! softmax statistics. Used by `eval` (constant folding, the interpreter);
//! cuDNN rounds its probabilities to the input dtype before the second
//! product, which this reference does not.

use super::{CudnnFmha, Shape};

/// Index helpers for the row-major layouts the calls use.
impl Shape {
    /// Element `[b, t, n, h]` of a `[B, T, N, H]` tensor.
    fn q_at(&self, b: i64, t: i64, n: i64) -> usize {
        (((b * self.t + t) * self.n + n) * self.h) as usize
    }

    /// Element `[b, j, kn, 0]` of a `[B, S, Nk, H]` tensor.
    fn k_at(&self, b: i64, j: i64, kn: i64) -> usize {
        (((b * self.s + j) * self.nk + kn) * self.h) as usize
    }

    /// Element `[b, n, t, 0]` of a `[B, N, T, H]` tensor.
    fn o_at(&self, b: i64, n: i64, t: i64) -> usize {
        (((b * self.n + n) * self.t + t) * self.h) as usize
    }

    /// Element `[b, kn, j, 0]` of a `[B, Nk, S, H]` tensor.
    fn kv_grad_at(&self, b: i64, kn: i64, j: i64) -> usize {
        (((b * self.nk + kn) * self.s + j) * self.h) as usize
    }

    /// The key/value head of query head `n`.
    fn group(&self, n: i64) -> i64 {
        n / (self.n / self.nk)
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The keys query `t` sees: `(t − window, t]`.
fn visible(config: &CudnnFmha, t: i64) -> std::ops::RangeInclusive<i64> {
    let first = config.window.map_or(0, |w| (t - w + 1).max(0));
    first..=t
}

/// Scaled scores of query `(b, t, n)` against its visible keys.
fn scores(
    shape: &Shape,
    config: &CudnnFmha,
    q: &[f64],
    k: &[f64],
    (b, t, n): (i64, i64, i64),
) -> Vec<f64> {
    let h = shape.h as usize;
    let qi = shape.q_at(b, t, n);
    let kn = shape.group(n);
    visible(config, t)
        .map(|j| {
            let kj = shape.k_at(b, j, kn);
            config.scale * dot(&q[qi..qi + h], &k[kj..kj + h])
        })
        .collect()
}

/// `(O [B,N,T,H], stats [B,N,T])` of `q`, `k`, `v` laid out as the
/// forward call takes them.
pub(super) fn forward(
    shape: &Shape,
    config: &CudnnFmha,
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let h = shape.h as usize;
    let mut o = vec![0.0; (shape.b * shape.n * shape.t) as usize * h];
    let mut stats = Vec::with_capacity((shape.b * shape.n * shape.t) as usize);
    for b in 0..shape.b {
        for n in 0..shape.n {
            for t in 0..shape.t {
                let s = scores(shape, config, q, k, (b, t, n));
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let oi = shape.o_at(b, n, t);
                for (j, x) in visible(config, t).zip(&s) {
                    let p = (x - m).exp() / l;
                    let vj = shape.k_at(b, j, shape.group(n));
                    for d in 0..h {
                        o[oi + d] += p * v[vj + d];
                    }
                }
                stats.push(m + l.ln());
            }
        }
    }
    (o, stats)
}

/// `(dQ [B,N,T,H], dK [B,Nk,S,H], dV [B,Nk,S,H])` from the forward's
/// operands, its statistics and `(dO, O)` (both `[B,T,N,H]`).
pub(super) fn backward(
    shape: &Shape,
    config: &CudnnFmha,
    (q, k, v): (&[f64], &[f64], &[f64]),
    stats: &[f64],
    (d_out, out): (&[f64], &[f64]),
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let h = shape.h as usize;
    let mut dq = vec![0.0; q.len()];
    let mut dk = vec![0.0; k.len()];
    let mut dv = vec![0.0; v.len()];
    for b in 0..shape.b {
        for n in 0..shape.n {
            let kn = shape.group(n);
            for t in 0..shape.t {
                let qi = shape.q_at(b, t, n);
                let (doi, dqi) = (&d_out[qi..qi + h], shape.o_at(b, n, t));
                // D = rowsum(dO ∘ O): the softmax's correction term.
                let delta = dot(doi, &out[qi..qi + h]);
                let lse = stats[((b * shape.n + n) * shape.t + t) as usize];
                let s = scores(shape, config, q, k, (b, t, n));
                for (j, x) in visible(config, t).zip(&s) {
                    let p = (x - lse).exp();
                    let (kj, gj) = (shape.k_at(b, j, kn), shape.kv_grad_at(b, kn, j));
                    let ds = p * (dot(doi, &v[kj..kj + h]) - delta) * config.scale;
                    for d in 0..h {
                        dv[gj + d] += p * doi[d];
                        dq[dqi + d] += ds * k[kj + d];
                        dk[gj + d] += ds * q[qi + d];
                    }
                }
            }
        }
    }
    (dq, dk, dv)
}
