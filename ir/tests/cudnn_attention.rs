//! cuDNN's attention calls in the IR: their shape rules and refusals, the
//! backward the forward's VJP emits, and their host semantics against
//! attention written with core ops (no plugin: the CPU cannot run them).

use hlo_ir::ops::{cudnn_attention, CudnnFmha, DotGeneral};
use hlo_ir::rng::Rng;
use hlo_ir::{
    interpret, iota, trace, value_and_grad, DType, Function, Literal, Op, Tensor, TensorType,
    TraceError,
};

fn ty(dtype: DType, dims: &[i64]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

fn config(scale: f64, window: Option<i64>) -> CudnnFmha {
    CudnnFmha {
        scale,
        window,
        batch_axes: vec![],
        head_axes: vec![],
    }
}

/// The forward call on `q`, `k`, `v` of these types, or the shape error.
fn forward(types: [TensorType; 3], c: CudnnFmha) -> Result<Function, TraceError> {
    trace(
        "attn",
        &[
            ("q", types[0].clone()),
            ("k", types[1].clone()),
            ("v", types[2].clone()),
        ],
        |i| {
            let (o, stats) = cudnn_attention(i["q"], i["k"], i["v"], c);
            vec![("o", o), ("stats", stats)]
        },
    )
}

#[test]
fn forward_shapes_with_grouped_heads() {
    let (q, kv) = (
        ty(DType::BF16, &[1, 128, 4, 64]),
        ty(DType::BF16, &[1, 128, 2, 64]),
    );
    let f = forward([q, kv.clone(), kv], config(0.125, None)).unwrap();
    assert_eq!(
        f.output_types(),
        vec![
            ty(DType::BF16, &[1, 4, 128, 64]),
            ty(DType::F32, &[1, 4, 128])
        ]
    );
    let node = &f.nodes[0];
    assert!(matches!(node.op, Op::CudnnAttention(_)));
    // The third result is the workspace XLA sizes.
    assert_eq!(*f.ty(node.results[2]), ty(DType::U8, &[0]));
}

#[test]
fn unsupported_cases_are_shape_errors() {
    let bf16 = |d: &[i64]| ty(DType::BF16, d);
    let cases: Vec<([TensorType; 3], CudnnFmha, &str)> = vec![
        (
            [
                ty(DType::F32, &[1, 8, 4, 64]),
                ty(DType::F32, &[1, 8, 2, 64]),
                ty(DType::F32, &[1, 8, 2, 64]),
            ],
            config(0.125, None),
            "bf16 or f16",
        ),
        (
            [
                bf16(&[1, 8, 4, 100]),
                bf16(&[1, 8, 2, 100]),
                bf16(&[1, 8, 2, 100]),
            ],
            config(0.1, None),
            "multiple of 8",
        ),
        (
            [
                bf16(&[1, 8, 4, 512]),
                bf16(&[1, 8, 2, 512]),
                bf16(&[1, 8, 2, 512]),
            ],
            config(0.1, None),
            "up to 256",
        ),
        (
            [
                bf16(&[1, 8, 3, 64]),
                bf16(&[1, 8, 2, 64]),
                bf16(&[1, 8, 2, 64]),
            ],
            config(0.1, None),
            "do not group",
        ),
        (
            [
                bf16(&[1, 8, 4, 64]),
                bf16(&[1, 16, 2, 64]),
                bf16(&[1, 16, 2, 64]),
            ],
            config(0.1, None),
            "as many keys",
        ),
        (
            [
                bf16(&[1, 8, 4, 64]),
                bf16(&[1, 8, 2, 64]),
                bf16(&[1, 8, 1, 64]),
            ],
            config(0.1, None),
            "alike",
        ),
        (
            [
                bf16(&[1, 8, 4, 64]),
                bf16(&[1, 8, 2, 64]),
                bf16(&[1, 8, 2, 64]),
            ],
            config(0.1, Some(0)),
            "window",
        ),
        (
            [
                bf16(&[1, 8, 4, 64]),
                bf16(&[1, 8, 2, 64]),
                bf16(&[1, 8, 2, 64]),
            ],
            config(f64::NAN, None),
            "finite",
        ),
    ];
    for (types, c, want) in cases {
        let err = forward(types.clone(), c).unwrap_err();
        assert_eq!(err.op, "cudnn_attention");
        assert!(err.to_string().contains(want), "{types:?}: {err}");
    }
}

/// `loss = Σ o²` through the call, with the gradients of q, k and v.
fn loss_and_grads(types: [TensorType; 3], c: CudnnFmha) -> Function {
    let f = trace(
        "loss",
        &[
            ("q", types[0].clone()),
            ("k", types[1].clone()),
            ("v", types[2].clone()),
        ],
        |i| {
            let (o, _) = cudnn_attention(i["q"], i["k"], i["v"], c);
            let o = o.cast(DType::F32);
            vec![("loss", (o * o).sum(&[0, 1, 2, 3]))]
        },
    )
    .unwrap();
    value_and_grad(&f, "loss", &["q", "k", "v"]).unwrap()
}

#[test]
fn the_vjp_emits_the_backward_call() {
    let (q, kv) = (
        ty(DType::BF16, &[2, 16, 4, 64]),
        ty(DType::BF16, &[2, 16, 2, 64]),
    );
    let g = loss_and_grads([q.clone(), kv.clone(), kv.clone()], config(0.125, Some(4)));
    let back: Vec<_> = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::CudnnAttentionBackward(_)))
        .collect();
    assert_eq!(back.len(), 1);
    let operands: Vec<TensorType> = back[0].operands.iter().map(|&o| g.ty(o).clone()).collect();
    // Q, K, V, the statistics, dO and O (both as Q).
    assert_eq!(
        operands,
        vec![
            q.clone(),
            kv.clone(),
            kv.clone(),
            ty(DType::F32, &[2, 4, 16]),
            q.clone(),
            q.clone()
        ]
    );
    let results: Vec<TensorType> = back[0].results.iter().map(|&r| g.ty(r).clone()).collect();
    let per_head = |t: &TensorType| ty(DType::BF16, &[t.dims[0], t.dims[2], t.dims[1], t.dims[3]]);
    assert_eq!(
        results,
        vec![
            per_head(&q),
            per_head(&kv),
            per_head(&kv),
            ty(DType::U8, &[0])
        ]
    );
    // The gradients come back as the inputs are shaped.
    assert_eq!(&g.output_types()[1..], &[q, kv.clone(), kv]);
}

/// Causal (windowed) grouped attention with core ops in f32: `q: [b, t,
/// n, h]`, `k`, `v: [b, t, nk, h]`, output `[b, t, n, h]`.
fn core_attention(q: Tensor, k: Tensor, v: Tensor, scale: f64, window: Option<i64>) -> Tensor {
    let (qd, kd) = (q.dims(), k.dims());
    let (b, t, n, h, nk) = (qd[0], qd[1], qd[2], qd[3], kd[2]);
    let g = n / nk;
    let q = q.cast(DType::F32).reshape(&[b, t, nk, g, h]);
    let (k, v) = (k.cast(DType::F32), v.cast(DType::F32));
    let dims = |lb: &[i64], rb: &[i64], lc: i64, rc: i64| DotGeneral {
        lhs_batch: lb.to_vec(),
        rhs_batch: rb.to_vec(),
        lhs_contracting: vec![lc],
        rhs_contracting: vec![rc],
        precision: None,
        preferred_element_type: None,
    };
    // [b, nk, t, g, s]
    let scores = q.dot_general(k, dims(&[0, 2], &[0, 2], 4, 3)) * scale;
    let sq = TensorType::new(DType::I32, [t, t]);
    let (rows, cols) = (iota(sq.clone(), 0), iota(sq, 1));
    let mut on = cols.le(rows);
    if let Some(w) = window {
        on = on.and(cols.gt(rows - w as f64));
    }
    let shape = [b, nk, t, g, t];
    let scores = on
        .broadcast_in_dim(&shape, &[2, 4])
        .where_(scores, scores.scalar_like(-1e30));
    let p = scores.softmax(4);
    // [b, nk, t, g, h] -> [b, t, n, h]
    p.dot_general(v, dims(&[0, 1], &[0, 2], 4, 1))
        .transpose(&[0, 2, 1, 3, 4])
        .reshape(&[b, t, n, h])
}

#[test]
fn host_semantics_and_gradients_match_core_attention() {
    let (q, kv) = (
        ty(DType::BF16, &[2, 12, 4, 8]),
        ty(DType::BF16, &[2, 12, 2, 8]),
    );
    let types = [q.clone(), kv.clone(), kv.clone()];
    for window in [None, Some(5)] {
        let c = config(0.3, window);
        let got = loss_and_grads(types.clone(), c);
        let want = trace(
            "loss",
            &[("q", q.clone()), ("k", kv.clone()), ("v", kv.clone())],
            |i| {
                // Rounded to bf16 as the call's output is.
                let o = core_attention(i["q"], i["k"], i["v"], 0.3, window)
                    .cast(DType::BF16)
                    .cast(DType::F32);
                vec![("loss", (o * o).sum(&[0, 1, 2, 3]))]
            },
        )
        .unwrap();
        let want = value_and_grad(&want, "loss", &["q", "k", "v"]).unwrap();
        let mut rng = Rng::from_state(5);
        let inputs: Vec<Literal> = types
            .iter()
            .map(|t| {
                let v: Vec<f64> = (0..t.element_count())
                    .map(|_| rng.uniform(-1.0, 1.0))
                    .collect();
                Literal::from_f64s(t.clone(), &v)
            })
            .collect();
        let (a, b) = (
            interpret(&got, &inputs).unwrap(),
            interpret(&want, &inputs).unwrap(),
        );
        for (k, (x, y)) in a.iter().zip(&b).enumerate() {
            let (x, y) = (x.to_f64s(), y.to_f64s());
            let scale = y.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            let err = x
                .iter()
                .zip(&y)
                .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
            // bf16 results: a few ulps of the largest entry.
            assert!(
                err <= 0.02 * scale,
                "window {window:?}, output {k}: {err} vs {scale}"
            );
        }
    }
}
