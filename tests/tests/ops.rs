//! Every op of the IR, traced, lowered to StableHLO, compiled and run on the
//! CPU plugin, compared with the host reference interpreter (f64 inside each
//! op, rounded to the result dtype) on random inputs. Tolerances per dtype
//! are in `hlo_e2e::tolerance`; integer and pred results must match exactly.
//!
//! One file for the whole op set (over our ~500-line guide): a missing op
//! is easiest to see in one table of cases.

use hlo_e2e::{check_against_reference, client, RandomLiteral, Rng};
use hlo_ir::ops::{DotGeneral, Gather, Precision, Scatter};
use hlo_ir::{constant, fori_loop, full, iota, trace, DType, Literal, Outputs, Tensor, TensorType};
use hlo_runtime::{CompiledFunction, HostArray};

fn ty(d: DType, dims: &[i64]) -> TensorType {
    TensorType::new(d, dims.to_vec())
}

/// Traces `body` over inputs of `types` (named a, b, c, ...) and checks it
/// against the reference on random inputs in [lo, hi).
fn check(name: &str, types: &[TensorType], lo: f64, hi: f64, body: impl Fn(&[Tensor]) -> Outputs) {
    let names: Vec<String> = (0..types.len())
        .map(|i| ((b'a' + i as u8) as char).to_string())
        .collect();
    let inputs: Vec<(&str, TensorType)> = names
        .iter()
        .map(String::as_str)
        .zip(types.iter().cloned())
        .collect();
    let f =
        trace(name, &inputs, |i| body(i.tensors())).unwrap_or_else(|e| panic!("trace {name}: {e}"));
    let mut rng = Rng::from_state(
        name.bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64)),
    );
    let lits: Vec<Literal> = types
        .iter()
        .map(|t| rng.literal(t.clone(), lo, hi))
        .collect();
    check_against_reference(&f, &lits, 1.0);
}

fn one(t: Tensor) -> Outputs {
    Outputs::from(t)
}

const SHAPES: [&[i64]; 3] = [&[7], &[3, 4], &[2, 3, 5]];

#[test]
fn unary_float_ops() {
    type Op = fn(Tensor) -> Tensor;
    let ops: [(&str, Op, f64, f64); 13] = [
        ("neg", |x| -x, -3.0, 3.0),
        ("exp", Tensor::exp, -5.0, 5.0),
        ("log", Tensor::log, 0.01, 10.0),
        ("log1p", Tensor::log1p, -0.9, 5.0),
        ("rsqrt", Tensor::rsqrt, 0.01, 10.0),
        ("sqrt", Tensor::sqrt, 0.0, 10.0),
        ("tanh", Tensor::tanh, -4.0, 4.0),
        ("logistic", Tensor::logistic, -8.0, 8.0),
        ("abs", Tensor::abs, -3.0, 3.0),
        ("sign", Tensor::sign, -3.0, 3.0),
        ("cos", Tensor::cos, -6.0, 6.0),
        ("sin", Tensor::sin, -6.0, 6.0),
        ("floor", Tensor::floor, -6.0, 6.0),
    ];
    for (name, op, lo, hi) in ops {
        for dims in SHAPES {
            check(name, &[ty(DType::F32, dims)], lo, hi, |x| one(op(x[0])));
        }
        check(name, &[ty(DType::F64, &[4, 3])], lo, hi, |x| one(op(x[0])));
        check(name, &[ty(DType::BF16, &[4, 3])], lo, hi, |x| one(op(x[0])));
    }
}

#[test]
fn is_finite_sees_inf_and_nan() {
    let f = trace("is_finite", &[("x", ty(DType::F32, &[5]))], |i| {
        i["x"].is_finite()
    })
    .unwrap();
    let x = Literal::from_f64s(
        ty(DType::F32, &[5]),
        &[1.0, f64::INFINITY, f64::NAN, -0.0, f64::NEG_INFINITY],
    );
    let out = check_against_reference(&f, &[x], 1.0);
    assert_eq!(out[0].to_i128s(), vec![1, 0, 0, 1, 0]);
}

#[test]
fn unary_integer_ops() {
    check("neg_i32", &[ty(DType::I32, &[3, 4])], -100.0, 100.0, |x| {
        one(-x[0])
    });
    check("abs_i32", &[ty(DType::I32, &[3, 4])], -100.0, 100.0, |x| {
        one(x[0].abs())
    });
    check("sign_i64", &[ty(DType::I64, &[6])], -3.0, 3.0, |x| {
        one(x[0].sign())
    });
    check("not_u32", &[ty(DType::U32, &[6])], 0.0, 4e9, |x| one(!x[0]));
    check("not_pred", &[ty(DType::Pred, &[6])], 0.0, 2.0, |x| {
        one(!x[0])
    });
}

#[test]
fn binary_float_ops_with_broadcasting() {
    type Op = fn(Tensor, Tensor) -> Tensor;
    let ops: [(&str, Op, f64, f64); 7] = [
        ("add", |a, b| a + b, -3.0, 3.0),
        ("sub", |a, b| a - b, -3.0, 3.0),
        ("mul", |a, b| a * b, -3.0, 3.0),
        ("div", |a, b| a / b, 0.5, 3.0),
        ("max", Tensor::maximum, -3.0, 3.0),
        ("min", Tensor::minimum, -3.0, 3.0),
        ("pow", Tensor::pow, 0.1, 2.0),
    ];
    // Equal shapes, a trailing vector, a middle singleton, a scalar.
    let pairs: [(&[i64], &[i64]); 4] = [
        (&[3, 4], &[3, 4]),
        (&[3, 4], &[4]),
        (&[2, 1, 5], &[3, 1]),
        (&[], &[2, 3]),
    ];
    for (name, op, lo, hi) in ops {
        for (a, b) in pairs {
            check(name, &[ty(DType::F32, a), ty(DType::F32, b)], lo, hi, |x| {
                one(op(x[0], x[1]))
            });
        }
        check(
            name,
            &[ty(DType::BF16, &[4, 4]), ty(DType::BF16, &[4])],
            lo,
            hi,
            |x| one(op(x[0], x[1])),
        );
    }
    check(
        "rem_f32",
        &[ty(DType::F32, &[5, 3]), ty(DType::F32, &[3])],
        0.5,
        7.0,
        |x| one(x[0] % x[1]),
    );
    // Scalars on either side of an operator.
    check("scalars", &[ty(DType::F32, &[2, 3])], -2.0, 2.0, |x| {
        one(2.0 * x[0] - 1.5 + x[0] / 4.0)
    });
}

#[test]
fn binary_integer_ops() {
    type Op = fn(Tensor, Tensor) -> Tensor;
    let ops: [(&str, Op); 10] = [
        ("add", |a, b| a + b),
        ("sub", |a, b| a - b),
        ("mul", |a, b| a * b),
        ("div", |a, b| a / b),
        ("rem", |a, b| a % b),
        ("max", Tensor::maximum),
        ("min", Tensor::minimum),
        ("and", Tensor::and),
        ("or", Tensor::or),
        ("xor", Tensor::xor),
    ];
    for (name, op) in ops {
        // Divisors kept away from zero; negative operands exercise truncation.
        check(
            name,
            &[ty(DType::I32, &[4, 5]), ty(DType::I32, &[5])],
            1.0,
            1000.0,
            |x| one(op(x[0], x[1])),
        );
        check(
            name,
            &[ty(DType::I64, &[6]), ty(DType::I64, &[6])],
            -1000.0,
            1000.0,
            |x| one(op(x[0], x[1] * 0.0 + 7.0)),
        );
    }
    check(
        "shifts_u32",
        &[ty(DType::U32, &[8]), ty(DType::U32, &[8])],
        0.0,
        31.0,
        |x| {
            Outputs::new()
                .add("left", x[0].shift_left(x[1]))
                .add("right", (x[0] * 1000.0 + 12345.0).shift_right_logical(x[1]))
        },
    );
    check(
        "logic_pred",
        &[ty(DType::Pred, &[6]), ty(DType::Pred, &[6])],
        0.0,
        2.0,
        |x| {
            Outputs::new()
                .add("and", x[0].and(x[1]))
                .add("or", x[0].or(x[1]))
                .add("xor", x[0].xor(x[1]))
        },
    );
}

#[test]
fn compare_and_select() {
    for d in [DType::F32, DType::I32, DType::U8] {
        check("compare", &[ty(d, &[3, 4]), ty(d, &[4])], 0.0, 4.0, |x| {
            Outputs::new()
                .add("eq", x[0].eq(x[1]))
                .add("ne", x[0].ne(x[1]))
                .add("lt", x[0].lt(x[1]))
                .add("le", x[0].le(x[1]))
                .add("gt", x[0].gt(x[1]))
                .add("ge", x[0].ge(x[1]))
        });
    }
    check(
        "select",
        &[
            ty(DType::F32, &[3, 4]),
            ty(DType::F32, &[3, 4]),
            ty(DType::F32, &[4]),
        ],
        -1.0,
        1.0,
        |x| one(x[0].gt(x[2]).where_(x[1], x[2])),
    );
}

#[test]
fn convert_and_bitcast() {
    let conversions: [(DType, DType, f64, f64); 9] = [
        (DType::F32, DType::BF16, -10.0, 10.0),
        (DType::F32, DType::F16, -10.0, 10.0),
        (DType::F32, DType::I32, -100.0, 100.0),
        (DType::I32, DType::F32, -1e6, 1e6),
        (DType::F32, DType::Pred, -1.0, 1.0),
        (DType::Pred, DType::F32, 0.0, 2.0),
        (DType::F64, DType::F32, -1e3, 1e3),
        (DType::U8, DType::F32, 0.0, 255.0),
        (DType::BF16, DType::F32, -10.0, 10.0),
    ];
    for (from, to, lo, hi) in conversions {
        if to == DType::F16 && !hlo_e2e::xla_cpu_converts_f16() {
            // Refused with XLA's message, not a crash or a wrong number.
            let f = trace("convert", &[("a", ty(from, &[3, 5]))], |i| {
                one(i["a"].cast(to))
            })
            .unwrap();
            let e = CompiledFunction::new(client(), &f).err();
            assert!(
                e.as_ref()
                    .is_some_and(|e| e.to_string().contains("materialize symbols")),
                "{e:?}"
            );
            continue;
        }
        check("convert", &[ty(from, &[3, 5])], lo, hi, |x| {
            one(x[0].cast(to))
        });
    }
    check("bitcast", &[ty(DType::F32, &[6])], -10.0, 10.0, |x| {
        Outputs::new()
            .add("u32", x[0].bitcast(DType::U32))
            .add("back", x[0].bitcast(DType::I32).bitcast(DType::F32))
    });
}

#[test]
fn constants_and_iota() {
    let mut rng = Rng::from_state(11);
    let literals = [
        rng.literal(ty(DType::F32, &[2, 3]), -5.0, 5.0),
        rng.literal(ty(DType::BF16, &[4]), -5.0, 5.0),
        rng.literal(ty(DType::Pred, &[5]), 0.0, 2.0),
        rng.literal(ty(DType::I64, &[3]), -1e12, 1e12),
        rng.literal(ty(DType::U8, &[2, 2]), 0.0, 255.0),
        Literal::from_f64s(
            ty(DType::F32, &[3]),
            &[f64::INFINITY, f64::NEG_INFINITY, 0.5],
        ),
        Literal::scalar(DType::F64, std::f64::consts::E),
    ];
    for lit in literals {
        let l2 = lit.clone();
        let f = trace("constant", &[] as &[(&str, TensorType)], move |_| {
            constant(l2.clone())
        })
        .unwrap();
        let out = check_against_reference(&f, &[], 1.0);
        assert_eq!(out[0], lit);
    }
    for (d, dims, dim) in [
        (DType::I32, vec![4, 3], 0),
        (DType::F32, vec![2, 5], 1),
        (DType::U32, vec![3, 2, 2], 2),
    ] {
        let f = trace("iota", &[] as &[(&str, TensorType)], |_| {
            iota(ty(d, &dims), dim)
        })
        .unwrap();
        check_against_reference(&f, &[], 1.0);
    }
}

#[test]
fn shape_ops() {
    check(
        "broadcast_in_dim",
        &[ty(DType::F32, &[3, 1])],
        -1.0,
        1.0,
        |x| one(x[0].broadcast_in_dim(&[2, 3, 4], &[1, 2])),
    );
    check("broadcast_to", &[ty(DType::I32, &[4])], -9.0, 9.0, |x| {
        one(x[0].broadcast_to(&[2, 3, 4]))
    });
    check("reshape", &[ty(DType::F32, &[2, 3, 4])], -1.0, 1.0, |x| {
        one(x[0].reshape(&[4, 6]))
    });
    check("transpose", &[ty(DType::F32, &[2, 3, 4])], -1.0, 1.0, |x| {
        one(x[0].transpose(&[2, 0, 1]))
    });
    check("slice", &[ty(DType::F32, &[6, 7])], -1.0, 1.0, |x| {
        Outputs::new()
            .add("plain", x[0].slice(&[1, 2], &[4, 7]))
            .add("strided", x[0].slice_strided(&[0, 1], &[6, 7], &[2, 3]))
    });
    check(
        "concat",
        &[
            ty(DType::F32, &[2, 3]),
            ty(DType::F32, &[2, 1]),
            ty(DType::F32, &[2, 4]),
        ],
        -1.0,
        1.0,
        |x| one(Tensor::concat(&[x[0], x[1], x[2]], 1)),
    );
    check("pad", &[ty(DType::F32, &[3, 4])], -1.0, 1.0, |x| {
        let v = x[0].scalar_like(9.5);
        Outputs::new()
            .add("edges", x[0].pad(v, &[1, 0], &[2, 3], &[0, 0]))
            .add("interior", x[0].pad(v, &[0, 1], &[0, 0], &[1, 2]))
            .add("crop", x[0].pad(v, &[-1, 2], &[0, -2], &[0, 0]))
    });
}

#[test]
fn dynamic_slices_with_runtime_starts() {
    // Starts are inputs; the second set is out of range and must clamp.
    for starts in [[1i64, 2], [5, -3]] {
        let f = trace(
            "dynamic",
            &[
                ("x", ty(DType::F32, &[4, 6])),
                ("u", ty(DType::F32, &[2, 3])),
                ("i", ty(DType::I32, &[])),
                ("j", ty(DType::I32, &[])),
            ],
            |i| {
                Outputs::new()
                    .add("slice", i["x"].dynamic_slice(&[i["i"], i["j"]], &[2, 3]))
                    .add(
                        "update",
                        i["x"].dynamic_update_slice(i["u"], &[i["i"], i["j"]]),
                    )
            },
        )
        .unwrap();
        let mut rng = Rng::from_state(5);
        let inputs = [
            rng.literal(ty(DType::F32, &[4, 6]), -1.0, 1.0),
            rng.literal(ty(DType::F32, &[2, 3]), 5.0, 6.0),
            Literal::scalar(DType::I32, starts[0] as f64),
            Literal::scalar(DType::I32, starts[1] as f64),
        ];
        check_against_reference(&f, &inputs, 1.0);
    }
}

#[test]
fn reductions() {
    for (dims, axes) in [
        (&[2i64, 3, 4][..], &[0i64, 2][..]),
        (&[5, 6], &[1]),
        (&[7], &[0]),
        (&[3, 4], &[0, 1]),
    ] {
        check("reduce_f32", &[ty(DType::F32, dims)], -2.0, 2.0, |x| {
            Outputs::new()
                .add("sum", x[0].sum(axes))
                .add("max", x[0].max(axes))
                .add("min", x[0].min(axes))
                .add("mean", x[0].mean(axes))
        });
    }
    check(
        "reduce_i32",
        &[ty(DType::I32, &[4, 5])],
        -100.0,
        100.0,
        |x| {
            Outputs::new()
                .add("sum", x[0].sum(&[1]))
                .add("max", x[0].max(&[0]))
                .add("min", x[0].min(&[0, 1]))
        },
    );
    check("reduce_bf16", &[ty(DType::BF16, &[4, 8])], -2.0, 2.0, |x| {
        one(x[0].max(&[1]))
    });
}

#[test]
fn dot_general_dimension_numbers() {
    // lhs [b=2, m=3, k1=4, k2=5], rhs [k2=5, b=2, n=6, k1=4]: batch lhs 0 /
    // rhs 1, contracting (2, 3) with (3, 0), in a non-sorted order.
    let dims = DotGeneral {
        lhs_batch: vec![0],
        rhs_batch: vec![1],
        lhs_contracting: vec![2, 3],
        rhs_contracting: vec![3, 0],
        precision: Some(Precision::Highest),
        preferred_element_type: None,
    };
    let d2 = dims.clone();
    check(
        "dot_general",
        &[ty(DType::F32, &[2, 3, 4, 5]), ty(DType::F32, &[5, 2, 6, 4])],
        -1.0,
        1.0,
        move |x| one(x[0].dot_general(x[1], d2.clone())),
    );
    // bf16 operands, f32 accumulation and result.
    let mixed = DotGeneral {
        preferred_element_type: Some(DType::F32),
        precision: None,
        ..dims
    };
    check(
        "dot_bf16_f32",
        &[
            ty(DType::BF16, &[2, 3, 4, 5]),
            ty(DType::BF16, &[5, 2, 6, 4]),
        ],
        -1.0,
        1.0,
        move |x| one(x[0].dot_general(x[1], mixed.clone())),
    );
    check(
        "matmul",
        &[ty(DType::F32, &[2, 5, 7]), ty(DType::F32, &[7, 3])],
        -1.0,
        1.0,
        |x| one(x[0].matmul(x[1])),
    );
    check(
        "batched_matmul",
        &[ty(DType::F32, &[2, 5, 7]), ty(DType::F32, &[2, 7, 3])],
        -1.0,
        1.0,
        |x| one(x[0].matmul(x[1])),
    );
    check(
        "dot_i32",
        &[ty(DType::I32, &[3, 4]), ty(DType::I32, &[4, 2])],
        -10.0,
        10.0,
        |x| one(x[0].matmul(x[1])),
    );
}

#[test]
fn gather_and_take() {
    // An embedding lookup, a take along a middle axis with 2-d indices (one
    // out of range: clamped), and a gather of 2x3 windows at (row, col)
    // index vectors stored along dimension 0 of the indices.
    let f = trace(
        "gather",
        &[
            ("table", ty(DType::F32, &[10, 4])),
            ("ids", ty(DType::I32, &[2, 3])),
            ("x", ty(DType::F32, &[3, 5, 2])),
            ("starts", ty(DType::I32, &[2, 4])),
        ],
        |i| {
            let windows = Gather {
                offset_dims: vec![0, 1],
                collapsed_slice_dims: vec![],
                start_index_map: vec![1, 0],
                index_vector_dim: 0,
                slice_sizes: vec![2, 3],
            };
            Outputs::new()
                .add("embed", i["table"].take(i["ids"], 0))
                .add("middle", i["x"].take(i["ids"], 1))
                .add("windows", i["table"].gather(i["starts"], windows))
        },
    )
    .unwrap();
    let ids = Literal::from_f64s(ty(DType::I32, &[2, 3]), &[0.0, 3.0, 9.0, 4.0, 4.0, 7.0]);
    let starts = Literal::from_f64s(
        ty(DType::I32, &[2, 4]),
        &[0.0, 1.0, 2.0, 5.0, 0.0, 3.0, 8.0, 9.0],
    );
    let mut rng = Rng::from_state(3);
    let table = rng.literal(ty(DType::F32, &[10, 4]), -1.0, 1.0);
    let x = rng.literal(ty(DType::F32, &[3, 5, 2]), -1.0, 1.0);
    let out = check_against_reference(&f, &[table.clone(), ids, x, starts], 1.0);
    // The lookup is the table's rows (exact), independently of the reference.
    let t = table.to_f64s();
    assert_eq!(&out[0].to_f64s()[4..8], &t[12..16]);
}

#[test]
fn scatter_add_accumulates_duplicates() {
    let f = trace(
        "scatter",
        &[
            ("table", ty(DType::F32, &[6, 3])),
            ("ids", ty(DType::I32, &[2, 2])),
            ("rows", ty(DType::F32, &[2, 2, 3])),
        ],
        |i| i["table"].scatter_add(i["ids"], i["rows"], Scatter::add_rows(2)),
    )
    .unwrap();
    let ids = Literal::from_f64s(ty(DType::I32, &[2, 2]), &[1.0, 4.0, 1.0, 0.0]);
    let mut rng = Rng::from_state(9);
    let table = rng.literal(ty(DType::F32, &[6, 3]), -1.0, 1.0);
    let rows = rng.literal(ty(DType::F32, &[2, 2, 3]), -1.0, 1.0);
    let out = check_against_reference(&f, &[table.clone(), ids, rows.clone()], 1.0);
    // Row 1 received two updates.
    let (t, r, o) = (table.to_f64s(), rows.to_f64s(), out[0].to_f64s());
    for c in 0..3 {
        let want = (t[3 + c] as f32 + r[c] as f32 + r[6 + c] as f32) as f64;
        assert!((o[3 + c] - want).abs() < 1e-6);
    }
}

#[test]
fn while_and_fori_loop() {
    check(
        "fori",
        &[ty(DType::F32, &[3]), ty(DType::F32, &[3])],
        -1.0,
        1.0,
        |x| {
            // carry = carry * 0.5 + i * w, five times
            let r = fori_loop(0, 5, &[x[0], x[1]], |i, c| {
                vec![c[0] * 0.5 + i.cast(DType::F32) * c[1], c[1]]
            });
            one(r[0])
        },
    );
}

#[test]
fn sharding_constraint_is_the_identity_on_one_device() {
    check("constraint", &[ty(DType::F32, &[4, 2])], -1.0, 1.0, |x| {
        one(x[0].with_sharding_constraint(vec![vec!["fsdp".into()], vec![]]) * 2.0)
    });
}

#[test]
fn composites_softmax_log_softmax_mean() {
    check("softmax", &[ty(DType::F32, &[3, 7])], -5.0, 5.0, |x| {
        Outputs::new()
            .add("softmax", x[0].softmax(1))
            .add("log_softmax", x[0].log_softmax(0))
            .add("mean", x[0].mean(&[1]))
    });
}

#[test]
fn rng_bits_are_uniform_and_deterministic() {
    // No host reference defines XLA's bits; check what a user relies on:
    // same state, same bits; a new state; uniform floats in [0, 1).
    let state_ty = ty(DType::U64, &[2]);
    let f = trace("rng", &[("state", state_ty.clone())], |i| {
        let (state, bits) = i["state"].rng_bits(ty(DType::U32, &[64, 64]));
        // 23 random mantissa bits under exponent 0: a float in [1, 2).
        let one_bits = full(ty(DType::U32, &[]), 0x3f80_0000 as f64);
        let mantissa = bits.shift_right_logical(full(ty(DType::U32, &[]), 9.0));
        let u = mantissa.or(one_bits).bitcast(DType::F32) - 1.0;
        Outputs::new().add("state", state).add("u", u)
    })
    .unwrap();
    let exe = CompiledFunction::new(client(), &f).unwrap();
    let run = |seed: u64| {
        let out = exe
            .run(&[HostArray::new(&[2], &[seed, 0u64]).unwrap()])
            .unwrap();
        (
            out[0].to_vec::<u64>().unwrap(),
            out[1].to_vec::<f32>().unwrap(),
        )
    };
    let (s1, u1) = run(42);
    let (_, u1_again) = run(42);
    let (_, u2) = run(43);
    assert_eq!(u1, u1_again);
    assert_ne!(u1, u2);
    assert_ne!(s1, vec![42, 0]);
    let n = u1.len() as f64;
    let mean = u1.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = u1.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    assert!(u1.iter().all(|&v| (0.0..1.0).contains(&v)));
    // 4096 samples: mean 1/2 ± 4.5 sigma (sigma = 0.0045), variance 1/12.
    assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    assert!((var - 1.0 / 12.0).abs() < 0.01, "variance {var}");
}
