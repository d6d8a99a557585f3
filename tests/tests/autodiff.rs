//! Gradients of every differentiable op and of the composites a Llama LoRA
//! step is made of, checked by central finite differences in f64 on the CPU
//! plugin (relative error < 1e-6), plus structural checks: frozen weights
//! get no weight-gradient work, checkpointing changes nothing numerically.
//!
//! One file for every VJP rule (over our ~500-line guide), as the op set's
//! test is one file: a rule without a check is easiest to spot here.

use hlo_e2e::{arg, check_against_reference, check_grads, client, RandomLiteral, Rng};
use hlo_ir::ops::{DotGeneral, Gather, Scatter};
use hlo_ir::{
    checkpoint, full, iota, scope, trace, value_and_grad, DType, Function, Literal, Op, Outputs,
    Tensor, TensorType,
};
use hlo_runtime::{CompiledFunction, HostArray};

const F64: DType = DType::F64;
const RTOL: f64 = 1e-6;

#[test]
fn unary_ops() {
    type Op1 = fn(Tensor) -> Tensor;
    let ops: [(&str, Op1, f64, f64); 11] = [
        ("neg", |x| -x, -2.0, 2.0),
        ("exp", Tensor::exp, -2.0, 2.0),
        ("log", Tensor::log, 0.5, 3.0),
        ("log1p", Tensor::log1p, -0.5, 2.0),
        ("rsqrt", Tensor::rsqrt, 0.5, 3.0),
        ("sqrt", Tensor::sqrt, 0.5, 3.0),
        ("tanh", Tensor::tanh, -2.0, 2.0),
        ("logistic", Tensor::logistic, -3.0, 3.0),
        ("abs", Tensor::abs, 0.2, 2.0),
        ("cos", Tensor::cos, -3.0, 3.0),
        ("sin", Tensor::sin, -3.0, 3.0),
    ];
    for (name, op, lo, hi) in ops {
        check_grads(name, &[arg("x", F64, &[3, 4], lo, hi)], &["x"], RTOL, |i| {
            vec![op(i["x"])]
        });
    }
    // abs below zero too (away from the kink).
    check_grads(
        "abs_neg",
        &[arg("x", F64, &[5], -2.0, -0.2)],
        &["x"],
        RTOL,
        |i| vec![i["x"].abs()],
    );
}

#[test]
fn binary_ops_with_broadcasting() {
    type Op2 = fn(Tensor, Tensor) -> Tensor;
    let ops: [(&str, Op2, f64, f64); 8] = [
        ("add", |a, b| a + b, -2.0, 2.0),
        ("sub", |a, b| a - b, -2.0, 2.0),
        ("mul", |a, b| a * b, -2.0, 2.0),
        ("div", |a, b| a / b, 0.5, 2.0),
        ("max", Tensor::maximum, -2.0, 2.0),
        ("min", Tensor::minimum, -2.0, 2.0),
        ("pow", Tensor::pow, 0.5, 2.0),
        ("rem", |a, b| a % b, 0.3, 2.0),
    ];
    for (name, op, lo, hi) in ops {
        check_grads(
            name,
            &[arg("a", F64, &[3, 4], lo, hi), arg("b", F64, &[4], lo, hi)],
            &["a", "b"],
            RTOL,
            |i| vec![op(i["a"], i["b"])],
        );
    }
}

#[test]
fn select_and_convert() {
    check_grads(
        "select",
        &[
            arg("a", F64, &[4, 3], -1.0, 1.0),
            arg("b", F64, &[4, 3], -1.0, 1.0),
        ],
        &["a", "b"],
        RTOL,
        |i| vec![i["a"].gt(i["b"]).where_(i["a"] * 2.0, i["b"] * i["b"])],
    );
}

#[test]
fn convert_sends_the_gradient_back_in_the_operand_type() {
    // Finite differences cannot see through a rounding to f32, so check the
    // rule exactly: d/dx sum(f32(x) * p) = f64(p), computed in f32.
    let f = trace(
        "convert",
        &[
            ("x", TensorType::new(F64, [4])),
            ("p", TensorType::new(DType::F32, [4])),
        ],
        |i| vec![("loss", (i["x"].cast(DType::F32) * i["p"]).sum(&[0]))],
    )
    .unwrap();
    let g = value_and_grad(&f, "loss", &["x"]).unwrap();
    let p = Literal::from_f64s(TensorType::new(DType::F32, [4]), &[0.1, -2.5, 3.0, 1e-3]);
    let x = Literal::from_f64s(TensorType::new(F64, [4]), &[1.0, 2.0, 3.0, 4.0]);
    let out = check_against_reference(&g, &[x, p.clone()], 1.0);
    assert_eq!(out[1].ty, TensorType::new(F64, [4]));
    assert_eq!(out[1].to_f64s(), p.to_f64s());
}

#[test]
fn shape_ops() {
    let x = |dims: &[i64]| arg("x", F64, dims, -1.0, 1.0);
    check_grads("broadcast_in_dim", &[x(&[3, 1])], &["x"], RTOL, |i| {
        vec![i["x"].broadcast_in_dim(&[2, 3, 4], &[1, 2]).exp()]
    });
    check_grads("broadcast_permuted", &[x(&[3, 4])], &["x"], RTOL, |i| {
        vec![i["x"].broadcast_in_dim(&[4, 2, 3], &[2, 0]).sin()]
    });
    check_grads("reshape", &[x(&[2, 3, 4])], &["x"], RTOL, |i| {
        vec![i["x"].reshape(&[4, 6]).exp()]
    });
    check_grads("transpose", &[x(&[2, 3, 4])], &["x"], RTOL, |i| {
        vec![i["x"].transpose(&[2, 0, 1]).exp()]
    });
    check_grads("slice", &[x(&[6, 7])], &["x"], RTOL, |i| {
        vec![
            i["x"].slice(&[1, 2], &[4, 7]).exp(),
            i["x"].slice_strided(&[0, 1], &[6, 7], &[2, 3]).sin(),
        ]
    });
    check_grads(
        "concat",
        &[x(&[2, 3]), arg("y", F64, &[2, 2], -1.0, 1.0)],
        &["x", "y"],
        RTOL,
        |i| vec![Tensor::concat(&[i["x"], i["y"], i["x"]], 1).exp()],
    );
    check_grads(
        "pad",
        &[x(&[3, 4]), arg("v", F64, &[], -1.0, 1.0)],
        &["x", "v"],
        RTOL,
        |i| {
            vec![
                i["x"].pad(i["v"], &[1, 0], &[2, 3], &[0, 1]).exp(),
                i["x"].pad(i["v"], &[-1, 2], &[0, -2], &[1, 0]).sin(),
            ]
        },
    );
}

#[test]
fn dynamic_slices() {
    check_grads(
        "dynamic",
        &[
            arg("x", F64, &[4, 6], -1.0, 1.0),
            arg("u", F64, &[2, 3], -1.0, 1.0),
        ],
        &["x", "u"],
        RTOL,
        |i| {
            let (r, c) = (
                full(TensorType::scalar(DType::I32), 1.0),
                full(TensorType::scalar(DType::I32), 2.0),
            );
            vec![
                i["x"].dynamic_slice(&[r, c], &[2, 3]).exp(),
                i["x"].dynamic_update_slice(i["u"].sin(), &[c, r]).exp(),
            ]
        },
    );
}

#[test]
fn reductions() {
    check_grads(
        "reduce",
        &[arg("x", F64, &[3, 4, 5], -1.0, 1.0)],
        &["x"],
        RTOL,
        |i| {
            vec![
                i["x"].sum(&[0, 2]).exp(),
                i["x"].max(&[1]),
                i["x"].min(&[0, 1]),
                i["x"].mean(&[2]),
            ]
        },
    );
}

#[test]
fn dot_general_batch_and_contracting() {
    let dims = DotGeneral {
        lhs_batch: vec![0],
        rhs_batch: vec![1],
        lhs_contracting: vec![2, 3],
        rhs_contracting: vec![3, 0],
        precision: None,
        preferred_element_type: None,
    };
    check_grads(
        "dot_general",
        &[
            arg("a", F64, &[2, 3, 4, 5], -1.0, 1.0),
            arg("b", F64, &[5, 2, 6, 4], -1.0, 1.0),
        ],
        &["a", "b"],
        RTOL,
        move |i| vec![i["a"].dot_general(i["b"], dims.clone())],
    );
    check_grads(
        "matmul",
        &[
            arg("a", F64, &[2, 5, 7], -1.0, 1.0),
            arg("b", F64, &[7, 3], -1.0, 1.0),
        ],
        &["a", "b"],
        RTOL,
        |i| vec![i["a"].matmul(i["b"]).tanh()],
    );
}

#[test]
fn gather_and_scatter() {
    check_grads(
        "take",
        &[arg("table", F64, &[6, 4], -1.0, 1.0)],
        &["table"],
        RTOL,
        |i| {
            // In range (a gather clamps, its scatter-add transpose drops), with a
            // repeated index: rows [0, 2, 4], [1, 3, 0]; columns [0, 1, 3].
            let ids = iota(TensorType::new(DType::I32, [2, 3]), 1) * 2.0
                + iota(TensorType::new(DType::I32, [2, 3]), 0);
            let ids = ids % full(TensorType::scalar(DType::I32), 5.0);
            let cols = iota(TensorType::new(DType::I32, [3]), 0)
                + iota(TensorType::new(DType::I32, [3]), 0)
                    .eq(full(TensorType::scalar(DType::I32), 2.0))
                    .cast(DType::I32);
            vec![i["table"].take(ids, 0).exp(), i["table"].take(cols, 1)]
        },
    );
    check_grads(
        "gather_windows",
        &[arg("x", F64, &[5, 6], -1.0, 1.0)],
        &["x"],
        RTOL,
        |i| {
            let starts = full(TensorType::new(DType::I32, [2, 2]), 1.0)
                + iota(TensorType::new(DType::I32, [2, 2]), 1) * 2.0;
            let dims = Gather {
                offset_dims: vec![0, 1],
                collapsed_slice_dims: vec![],
                start_index_map: vec![1, 0],
                index_vector_dim: 0,
                slice_sizes: vec![2, 3],
            };
            vec![i["x"].gather(starts, dims).exp()]
        },
    );
    check_grads(
        "scatter",
        &[
            arg("x", F64, &[5, 3], -1.0, 1.0),
            arg("u", F64, &[4, 3], -1.0, 1.0),
        ],
        &["x", "u"],
        RTOL,
        |i| {
            let ids = iota(TensorType::new(DType::I32, [4]), 0)
                % full(TensorType::scalar(DType::I32), 3.0);
            vec![i["x"]
                .scatter_add(ids, i["u"].exp(), Scatter::add_rows(1))
                .sin()]
        },
    );
}

#[test]
fn sharding_constraint_passes_the_gradient() {
    check_grads(
        "constraint",
        &[arg("x", F64, &[4, 2], -1.0, 1.0)],
        &["x"],
        RTOL,
        |i| {
            vec![i["x"]
                .with_sharding_constraint(vec![vec!["fsdp".into()], vec![]])
                .exp()]
        },
    );
}

#[test]
fn stop_gradient_blocks_its_branch() {
    // d/dx [exp(x) · sg(x)] = exp(x) · x: the stopped factor is a constant.
    let f = trace("stop", &[("x", TensorType::new(F64, [3]))], |i| {
        vec![("loss", (i["x"].exp() * i["x"].stop_gradient()).sum(&[0]))]
    })
    .unwrap();
    let g = value_and_grad(&f, "loss", &["x"]).unwrap();
    let xs = [0.5, -1.0, 2.0];
    let out = check_against_reference(
        &g,
        &[Literal::from_f64s(TensorType::new(F64, [3]), &xs)],
        1.0,
    );
    let want: Vec<f64> = xs.iter().map(|x: &f64| x.exp() * x).collect();
    hlo_e2e::assert_close("stop_gradient", &out[1].to_f64s(), &want, (1e-12, 1e-12));
}

// ---- composites --------------------------------------------------------

fn rms_norm(x: Tensor, weight: Tensor, eps: f64) -> Tensor {
    let last = x.rank() as i64 - 1;
    let var = (x * x).mean(&[last]);
    let inv = (var + eps).rsqrt();
    let dims = x.dims();
    let keep: Vec<i64> = (0..last).collect();
    x * inv.broadcast_in_dim(&dims, &keep) * weight
}

/// HF's rotate-half rotary embedding of `x: [b, heads, seq, head_dim]`.
fn rope(x: Tensor, theta: f64) -> Tensor {
    let d = x.dims();
    let (seq, hd) = (d[2], d[3]);
    let half = hd / 2;
    let pos = iota(TensorType::new(F64, [seq, half]), 0);
    let i = iota(TensorType::new(F64, [seq, half]), 1);
    let inv_freq = (i * (-2.0 * theta.ln() / hd as f64)).exp();
    let angles = pos * inv_freq;
    let angles = Tensor::concat(&[angles, angles], 1).broadcast_in_dim(&d, &[2, 3]);
    let (x1, x2) = (
        x.slice(&[0, 0, 0, 0], &[d[0], d[1], seq, half]),
        x.slice(&[0, 0, 0, half], &d),
    );
    let rotated = Tensor::concat(&[-x2, x1], 3);
    x * angles.cos() + rotated * angles.sin()
}

/// Causal attention with grouped K/V heads (no repeat_kv copies).
fn gqa_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor {
    // q [b, hq, s, d], k/v [b, hkv, s, d]; hq = hkv * groups.
    let (qd, kd) = (q.dims(), k.dims());
    let (b, hq, s, d, hkv) = (qd[0], qd[1], qd[2], qd[3], kd[1]);
    let groups = hq / hkv;
    let q = q.reshape(&[b, hkv, groups, s, d]);
    // scores [b, hkv, groups, s, t]
    let scores = q.dot_general(
        k,
        DotGeneral {
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 1],
            lhs_contracting: vec![4],
            rhs_contracting: vec![3],
            precision: None,
            preferred_element_type: None,
        },
    ) * (1.0 / (d as f64).sqrt());
    let rows = iota(TensorType::new(DType::I32, [s, s]), 0);
    let cols = iota(TensorType::new(DType::I32, [s, s]), 1);
    let causal = cols
        .le(rows)
        .broadcast_in_dim(&[b, hkv, groups, s, s], &[3, 4]);
    let scores = causal.where_(scores, scores.scalar_like(-1e9));
    let p = scores.softmax(4);
    // [b, hkv, groups, s, d]
    let out = p.dot_general(
        v,
        DotGeneral {
            lhs_batch: vec![0, 1],
            rhs_batch: vec![0, 1],
            lhs_contracting: vec![4],
            rhs_contracting: vec![2],
            precision: None,
            preferred_element_type: None,
        },
    );
    out.reshape(&[b, hq, s, d])
}

fn swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor {
    let g = x.matmul(gate);
    (g * g.logistic() * x.matmul(up)).matmul(down)
}

#[test]
fn softmax_and_cross_entropy() {
    check_grads(
        "softmax",
        &[arg("x", F64, &[3, 5], -2.0, 2.0)],
        &["x"],
        RTOL,
        |i| vec![i["x"].softmax(1)],
    );
    check_grads(
        "cross_entropy",
        &[arg("logits", F64, &[4, 6], -2.0, 2.0)],
        &["logits"],
        RTOL,
        |i| {
            // Mean negative log-likelihood of fixed labels, picked without one-hot.
            let labels = iota(TensorType::new(DType::I32, [4]), 0) + 1.0;
            let logp = i["logits"].log_softmax(1);
            let picked = logp.take(labels.reshape(&[4, 1]), 1).reshape(&[4, 4]);
            let diag = iota(TensorType::new(DType::I32, [4, 4]), 0)
                .eq(iota(TensorType::new(DType::I32, [4, 4]), 1));
            vec![-(diag.where_(picked, picked.scalar_like(0.0)).sum(&[0, 1])) / 4.0]
        },
    );
}

#[test]
fn rms_norm_rope_attention_swiglu() {
    check_grads(
        "rms_norm",
        &[
            arg("x", F64, &[2, 3, 8], -1.0, 1.0),
            arg("w", F64, &[8], 0.5, 1.5),
        ],
        &["x", "w"],
        RTOL,
        |i| vec![rms_norm(i["x"], i["w"], 1e-5)],
    );
    check_grads(
        "rope",
        &[arg("x", F64, &[1, 2, 5, 8], -1.0, 1.0)],
        &["x"],
        RTOL,
        |i| vec![rope(i["x"], 10000.0)],
    );
    check_grads(
        "gqa_attention",
        &[
            arg("q", F64, &[1, 4, 5, 4], -1.0, 1.0),
            arg("k", F64, &[1, 2, 5, 4], -1.0, 1.0),
            arg("v", F64, &[1, 2, 5, 4], -1.0, 1.0),
        ],
        &["q", "k", "v"],
        RTOL,
        |i| {
            vec![gqa_attention(
                rope(i["q"], 500000.0),
                rope(i["k"], 500000.0),
                i["v"],
            )]
        },
    );
    check_grads(
        "swiglu",
        &[
            arg("x", F64, &[3, 6], -1.0, 1.0),
            arg("gate", F64, &[6, 10], -0.5, 0.5),
            arg("up", F64, &[6, 10], -0.5, 0.5),
            arg("down", F64, &[10, 6], -0.5, 0.5),
        ],
        &["x", "gate", "up", "down"],
        RTOL,
        |i| vec![swiglu(i["x"], i["gate"], i["up"], i["down"])],
    );
}

/// `x·W + (alpha/r)·(x·A)·B`, as PEFT's LoRA linear layer computes it.
fn lora(x: Tensor, w: Tensor, a: Tensor, b: Tensor, scale: f64) -> Tensor {
    x.matmul(w) + x.matmul(a).matmul(b) * scale
}

#[test]
fn lora_gradients_for_adapters_only() {
    let (din, dout, r) = (12, 10, 4);
    let g = check_grads(
        "lora",
        &[
            arg("x", F64, &[2, 5, din], -1.0, 1.0),
            arg("w", F64, &[din, dout], -0.5, 0.5),
            arg("a", F64, &[din, r], -0.5, 0.5),
            arg("b", F64, &[r, dout], -0.5, 0.5),
        ],
        &["a", "b"],
        RTOL,
        |i| vec![lora(i["x"], i["w"], i["a"], i["b"], 16.0 / r as f64).tanh()],
    );
    // No dot_general anywhere produces the frozen kernel's shape (in either
    // orientation): W gets no gradient work. dA and dB are computed.
    let dots: Vec<Vec<i64>> = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::DotGeneral(_)))
        .map(|n| g.ty(n.results[0]).dims.clone())
        .collect();
    let is = |d: &[i64], a: i64, b: i64| d == [a, b] || d == [b, a];
    assert!(dots.iter().all(|d| !is(d, din, dout)), "{dots:?}");
    assert!(
        dots.iter().any(|d| is(d, din, r)),
        "dA is computed: {dots:?}"
    );
    assert!(
        dots.iter().any(|d| is(d, r, dout)),
        "dB is computed: {dots:?}"
    );
    // And the gradient outputs are exactly A's and B's.
    let names: Vec<&str> = g.outputs.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, vec!["loss", "grads.a", "grads.b"]);
}

#[test]
fn integer_inputs_are_refused_by_name() {
    let f = trace(
        "ints",
        &[
            ("x", TensorType::new(F64, [3])),
            ("ids", TensorType::new(DType::I32, [3])),
        ],
        |i| vec![("loss", (i["x"] * i["ids"].cast(F64)).sum(&[0]))],
    )
    .unwrap();
    let err = value_and_grad(&f, "loss", &["x", "ids"]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cannot differentiate with respect to `ids`: it is i32[3], not a float"
    );
    let err = value_and_grad(&f, "loss", &["nope"]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "ints has no input named `nope` to differentiate with respect to"
    );
    let err = value_and_grad(&f, "missing", &["x"]).unwrap_err();
    assert_eq!(err.to_string(), "ints has no output named `missing`");
}

#[test]
fn fan_out_is_summed_once() {
    // x feeds four consumers: four contributions, three adds for x's gradient.
    let f = trace("fan", &[("x", TensorType::new(F64, [3]))], |i| {
        let x = i["x"];
        vec![("loss", (x.exp() + x.sin() + x.cos() + x.tanh()).sum(&[0]))]
    })
    .unwrap();
    let g = hlo_ir::grad(&f, "loss", &["x"]).unwrap();
    let adds_in_backward = g
        .nodes
        .iter()
        .filter(|n| n.scope.starts_with("backward") || n.scope.is_empty())
        .filter(|n| matches!(n.op, Op::Binary(hlo_ir::ops::BinaryOp::Add)))
        .count();
    // Forward has 3 adds too (at top-level scope); backward adds: exactly 3.
    let forward_adds = 3;
    assert_eq!(adds_in_backward - forward_adds, 3);
}

fn two_layers(marked: bool) -> Function {
    let t = |d: &[i64]| TensorType::new(F64, d.to_vec());
    trace(
        "remat",
        &[("x", t(&[4, 6])), ("w0", t(&[6, 6])), ("w1", t(&[6, 3]))],
        |i| {
            let layer = || (i["x"].matmul(i["w0"]).tanh() * 2.0).exp().sin();
            let h = if marked {
                checkpoint("layers.0", layer)
            } else {
                scope("layers.0", layer)
            };
            vec![("loss", h.matmul(i["w1"]).tanh().sum(&[0, 1]))]
        },
    )
    .unwrap()
}

#[test]
fn checkpointed_scope_gives_the_same_gradients() {
    let plain = value_and_grad(&two_layers(false), "loss", &["w0", "w1"]).unwrap();
    let remat = value_and_grad(&two_layers(true), "loss", &["w0", "w1"]).unwrap();
    // The checkpointed version recomputes layers.0 behind a barrier.
    assert!(remat
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::OptimizationBarrier(_))));
    assert!(remat
        .nodes
        .iter()
        .any(|n| n.scope.starts_with("remat.layers.0")));
    assert!(!plain
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::OptimizationBarrier(_))));
    let mut rng = Rng::from_state(77);
    let inputs: Vec<Literal> = plain
        .input_types()
        .into_iter()
        .map(|t| rng.literal(t, -0.5, 0.5))
        .collect();
    let a = check_against_reference(&plain, &inputs, 1.0);
    let b = check_against_reference(&remat, &inputs, 1.0);
    for (x, y) in a.iter().zip(&b) {
        hlo_e2e::assert_close("remat vs plain", &x.to_f64s(), &y.to_f64s(), (1e-12, 1e-12));
    }
}

#[test]
fn bf16_matmul_gradients_accumulate_in_f32() {
    // bf16 weights, f32 preferred element type: the gradients come back in
    // bf16 (their values' type) from f32-accumulated products.
    let t = |d: DType, dims: &[i64]| TensorType::new(d, dims.to_vec());
    let f = trace(
        "mixed",
        &[
            ("x", t(DType::BF16, &[4, 8])),
            ("a", t(DType::BF16, &[8, 2])),
        ],
        |i| {
            let y = i["x"].dot_general(
                i["a"],
                DotGeneral {
                    preferred_element_type: Some(DType::F32),
                    ..DotGeneral::matmul(2)
                },
            );
            vec![("loss", (y * y).sum(&[0, 1]))]
        },
    )
    .unwrap();
    let g = value_and_grad(&f, "loss", &["a"]).unwrap();
    assert_eq!(g.output_types()[1], t(DType::BF16, &[8, 2]));
    let backward_dots: Vec<&hlo_ir::Node> = g
        .nodes
        .iter()
        .filter(|n| {
            matches!(&n.op, Op::DotGeneral(d) if d.preferred_element_type == Some(DType::F32))
                && n.scope.starts_with("backward")
        })
        .collect();
    assert_eq!(backward_dots.len(), 1);
    let mut rng = Rng::from_state(5);
    let inputs: Vec<Literal> = g
        .input_types()
        .into_iter()
        .map(|t| rng.literal(t, -1.0, 1.0))
        .collect();
    check_against_reference(&g, &inputs, 1.0);
}

#[test]
fn vjp_takes_cotangents_as_inputs() {
    let f = trace("v", &[("x", TensorType::new(F64, [3]))], |i| {
        Outputs::new()
            .add("y", i["x"].exp())
            .add("n", i["x"].cast(DType::I32))
    })
    .unwrap();
    let g = hlo_ir::vjp(&f, &["x"]).unwrap();
    let names: Vec<&str> = g.inputs.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, vec!["x", "cotangents.y"]);
    let exe = CompiledFunction::new(client(), &g).unwrap();
    let out = exe
        .run(&[
            HostArray::new(&[3], &[0.0f64, 1.0, 2.0]).unwrap(),
            HostArray::new(&[3], &[1.0f64, 2.0, 0.5]).unwrap(),
        ])
        .unwrap();
    let grads = out[2].to_vec::<f64>().unwrap();
    let want = [1.0, 2.0 * 1f64.exp(), 0.5 * 2f64.exp()];
    for (a, b) in grads.iter().zip(want) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
}

#[test]
fn scan_forward_and_gradients() {
    // Three "layers" of h = tanh(h·W_i + b_i) · s, stacked; s a shared const.
    let (n, d) = (3i64, 4i64);
    let f = |name: &str| {
        let t = |dims: &[i64]| TensorType::new(F64, dims.to_vec());
        trace(
            name,
            &[
                ("h", t(&[2, d])),
                ("w", t(&[n, d, d])),
                ("b", t(&[n, d])),
                ("s", t(&[])),
            ],
            |i| {
                let (carry, ys) = hlo_ir::scan(
                    &[("h", i["h"])],
                    &[("w", i["w"]), ("b", i["b"])],
                    &[("s", i["s"])],
                    |l| {
                        let h = (l["h"].matmul(l["w"]) + l["b"]).tanh() * l["s"];
                        (vec![h], vec![h.sum(&[0, 1])])
                    },
                );
                vec![carry[0], ys[0]]
            },
        )
        .unwrap()
    };
    // Against the reference interpreter (which runs the scan itself)...
    let g = f("scan");
    let mut rng = Rng::from_state(31);
    let inputs: Vec<Literal> = g
        .input_types()
        .into_iter()
        .map(|t| rng.literal(t, -0.5, 0.5))
        .collect();
    check_against_reference(&g, &inputs, 1.0);
    // ...and its gradients by finite differences, for every input.
    check_grads(
        "scan_grads",
        &[
            arg("h", F64, &[2, d], -1.0, 1.0),
            arg("w", F64, &[n, d, d], -0.5, 0.5),
            arg("b", F64, &[n, d], -0.5, 0.5),
            arg("s", F64, &[], 0.5, 1.5),
        ],
        &["h", "w", "b", "s"],
        RTOL,
        |i| {
            let (carry, ys) = hlo_ir::scan(
                &[("h", i["h"])],
                &[("w", i["w"]), ("b", i["b"])],
                &[("s", i["s"])],
                |l| {
                    let h = (l["h"].matmul(l["w"]) + l["b"]).tanh() * l["s"];
                    (vec![h], vec![(h * h).sum(&[0, 1])])
                },
            );
            vec![carry[0], ys[0]]
        },
    );
}

/// `x·w` through `custom_vjp` with a hand-written backward that reads a
/// residual (`w` transposed), an integer operand (a row mask) that gets
/// no cotangent, and softplus of the product as a second output.
fn masked_product(x: Tensor, w: Tensor, keep: Tensor) -> Vec<Tensor> {
    hlo_ir::custom_vjp(
        &[("x", x), ("w", w), ("keep", keep)],
        |i| {
            let on = i["keep"].ne(i["keep"].scalar_like(0.0));
            let y = i["x"].matmul(i["w"]);
            let on = on.broadcast_in_dim(&y.dims(), &[0]);
            let y = on.where_(y, y.scalar_like(0.0));
            let soft = (y.exp() + 1.0).log();
            (vec![y, soft], vec![i["w"].transpose(&[1, 0])])
        },
        |i| {
            let y = i["output.0"];
            let on = i["keep"]
                .ne(i["keep"].scalar_like(0.0))
                .broadcast_in_dim(&y.dims(), &[0]);
            // d softplus(y) = logistic(y); both outputs flow back through y.
            let gy = i["cotangent.0"] + i["cotangent.1"] * y.logistic();
            let gy = on.where_(gy, gy.scalar_like(0.0));
            vec![
                Some(gy.matmul(i["residual.0"])),
                Some(i["x"].transpose(&[1, 0]).matmul(gy)),
                None,
            ]
        },
    )
}

#[test]
fn custom_vjp_backward_gives_the_gradients() {
    let keep = TensorType::new(DType::I32, [3]);
    let body = |i: &hlo_ir::Inputs| {
        let keep = hlo_ir::constant(Literal::from_f64s(
            TensorType::new(DType::I32, [3]),
            &[1.0, 0.0, 1.0],
        ));
        masked_product(i["x"], i["w"], keep)
    };
    check_grads(
        "custom_vjp",
        &[
            arg("x", F64, &[3, 4], -1.0, 1.0),
            arg("w", F64, &[4, 2], -1.0, 1.0),
        ],
        &["x", "w"],
        RTOL,
        body,
    );
    // Inside a scan body (a layer's attention is one), also by differences.
    check_grads(
        "custom_vjp_in_scan",
        &[
            arg("x", F64, &[3, 4], -1.0, 1.0),
            arg("w", F64, &[2, 4, 4], -0.7, 0.7),
        ],
        &["x", "w"],
        RTOL,
        |i| {
            let (carry, _) = hlo_ir::scan(&[("h", i["x"])], &[("w", i["w"])], &[], |l| {
                let keep = hlo_ir::constant(Literal::from_f64s(
                    TensorType::new(DType::I32, [3]),
                    &[1.0, 1.0, 0.0],
                ));
                let out = masked_product(l["h"], l["w"], keep);
                (vec![out[1].tanh()], vec![])
            });
            vec![carry[0]]
        },
    );
    // An integer operand is accepted and gets no gradient.
    let f = trace(
        "int_operand",
        &[("x", TensorType::new(F64, [3, 4])), ("keep", keep)],
        |i| {
            let w = full(TensorType::new(F64, [4, 2]), 0.5);
            let out = masked_product(i["x"], w, i["keep"]);
            vec![("loss", out[1].sum(&[0, 1]))]
        },
    )
    .unwrap();
    assert!(value_and_grad(&f, "loss", &["keep"]).is_err());
    value_and_grad(&f, "loss", &["x"]).unwrap();
}

#[test]
fn custom_vjp_uses_its_rule_not_the_forward_ops() {
    // A straight-through estimator: floor forward, identity backward.
    // Differentiating floor's ops would give zero.
    let t = TensorType::new(F64, [3]);
    let f = trace("ste", &[("x", t.clone())], |i| {
        let y = hlo_ir::custom_vjp(
            &[("x", i["x"])],
            |i| (vec![i["x"].floor()], vec![]),
            |i| vec![Some(i["cotangent.0"] * 3.0)],
        );
        vec![("loss", y[0].sum(&[0]))]
    })
    .unwrap();
    let g = value_and_grad(&f, "loss", &["x"]).unwrap();
    let x = Literal::from_f64s(t, &[0.5, 1.7, -2.2]);
    let out = check_against_reference(&g, &[x], 1.0);
    assert_eq!(out[0].to_f64s(), vec![-2.0]);
    assert_eq!(out[1].to_f64s(), vec![3.0, 3.0, 3.0]);
    // The printed program holds the forward only.
    let text = hlo_lowering::to_hlo_text(&g);
    assert!(text.contains("floor("), "{text}");
}
