//! Tracing, shape errors and graph passes, without a plugin.

use hlo_ir::ops::DotGeneral;
use hlo_ir::{
    cse, dce, fold_constants, full, interpret, scope, simplify, trace, while_loop, DType, Function,
    Literal, Op, Outputs, TensorType,
};

fn f32(dims: &[i64]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

#[test]
fn shape_error_names_op_scope_and_operands() {
    let err = trace("bad", &[("x", f32(&[8, 16])), ("w", f32(&[32, 4]))], |i| {
        scope("layers.3", || {
            scope("self_attn", || scope("q_proj", || i["x"].matmul(i["w"])))
        })
    })
    .unwrap_err();
    assert_eq!(err.op, "dot_general");
    assert_eq!(err.scope, "layers.3.self_attn.q_proj");
    assert_eq!(err.operands, vec![f32(&[8, 16]), f32(&[32, 4])]);
    assert_eq!(
        err.to_string(),
        "dot_general in `layers.3.self_attn.q_proj`: contracting dimension sizes differ: lhs dim 1 is 16, \
         rhs dim 0 is 32 (operands f32[8,16], f32[32,4])"
    );
}

#[test]
fn the_first_error_sticks_and_later_ops_do_not_panic() {
    let err = trace("bad", &[("x", f32(&[2, 3])), ("y", f32(&[4]))], |i| {
        let z = i["x"] + i["y"]; // does not broadcast
                                 // Everything below works on a poisoned value and reports nothing.
        let w = z.matmul(i["x"]).tanh().sum(&[0, 1, 7]).reshape(&[99]);
        let t = w.transpose(&[3, 2]);
        Outputs::new().add("t", t)
    })
    .unwrap_err();
    assert_eq!(err.op, "add");
    assert_eq!(err.scope, "");
    assert!(
        err.message.contains("[2, 3] and [4] do not broadcast"),
        "{err}"
    );
    assert!(err.to_string().starts_with("add in top level:"), "{err}");
}

#[test]
fn errors_of_each_kind_are_reported_not_panicked() {
    // Each closure makes one mistake; each must come back as an error.
    type Case = fn(&hlo_ir::Inputs) -> hlo_ir::Tensor;
    let cases: Vec<(&str, Case)> = vec![
        ("reshape", |i| i["x"].reshape(&[5])),
        ("transpose", |i| i["x"].transpose(&[0, 0])),
        ("slice", |i| i["x"].slice(&[0, 0], &[3, 9])),
        ("reduce", |i| i["x"].sum(&[2])),
        ("convert", |i| i["x"].bitcast(DType::F64)),
        ("select", |i| i["x"].where_(i["x"], i["x"])),
        ("exponential", |i| i["x"].cast(DType::I32).exp()),
        ("concatenate", |i| {
            hlo_ir::Tensor::concat(&[i["x"], i["x"].cast(DType::BF16)], 0)
        }),
        ("gather", |i| i["x"].take(i["x"], 0)),
        ("broadcast_to", |i| i["x"].broadcast_to(&[3])),
        ("matmul", |i| i["x"].sum(&[0]).matmul(i["x"].sum(&[0]))),
    ];
    for (name, case) in cases {
        let err = trace("case", &[("x", f32(&[2, 3]))], case).unwrap_err();
        assert!(
            !err.message.is_empty() || !err.op.is_empty(),
            "{name}: {err:?}"
        );
        let _ = err.to_string();
    }
}

#[test]
fn loop_bodies_must_not_capture_outer_tensors() {
    let err = trace("loop", &[("x", f32(&[3])), ("w", f32(&[3]))], |i| {
        let w = i["w"];
        while_loop(
            &[i["x"]],
            |c| c[0].sum(&[0]).lt(full(f32(&[]), 10.0)),
            move |c| vec![c[0] + w],
        )[0]
    })
    .unwrap_err();
    assert_eq!(err.op, "while");
    assert!(err.message.contains("another trace"), "{err}");
}

fn count(f: &Function, pred: impl Fn(&Op) -> bool) -> usize {
    f.nodes.iter().filter(|n| pred(&n.op)).count()
}

#[test]
fn dce_removes_unused_work_and_cse_merges_duplicates() {
    let f = trace("p", &[("x", f32(&[4, 4]))], |i| {
        let unused = i["x"].matmul(i["x"]).exp();
        let _ = unused;
        let a = i["x"].tanh();
        let b = i["x"].tanh();
        a + b
    })
    .unwrap();
    assert_eq!(count(&f, |o| matches!(o, Op::DotGeneral(_))), 1);
    let d = dce(&f);
    assert_eq!(count(&d, |o| matches!(o, Op::DotGeneral(_))), 0);
    assert_eq!(count(&d, |o| matches!(o, Op::Unary(_))), 2);
    let c = cse(&d);
    assert_eq!(count(&c, |o| matches!(o, Op::Unary(_))), 1);
    for g in [&d, &c] {
        assert_eq!(g.verify(), Ok(()));
    }
    let x = Literal::from_f64s(
        f32(&[4, 4]),
        &(0..16).map(|v| v as f64 / 10.0).collect::<Vec<_>>(),
    );
    assert_eq!(
        interpret(&f, std::slice::from_ref(&x)).unwrap(),
        interpret(&c, &[x]).unwrap()
    );
}

#[test]
fn small_constant_expressions_fold() {
    let f = trace("fold", &[("x", f32(&[3]))], |i| {
        let k = (full(f32(&[3]), 2.0) * 3.0).exp(); // constant: folds
        i["x"] * k
    })
    .unwrap();
    let folded = simplify(&f);
    assert_eq!(count(&folded, |o| matches!(o, Op::Unary(_))), 0);
    assert_eq!(count(&folded, |o| matches!(o, Op::Binary(_))), 1);
    let x = Literal::from_f64s(f32(&[3]), &[1.0, -1.0, 0.5]);
    assert_eq!(
        interpret(&f, std::slice::from_ref(&x)).unwrap(),
        interpret(&folded, &[x]).unwrap()
    );
    // Above the size limit nothing folds.
    let big = fold_constants(&f, 2);
    assert_eq!(count(&big, |o| matches!(o, Op::Unary(_))), 1);
}

#[test]
fn dot_general_preferred_type_and_dims() {
    let f = trace(
        "dot",
        &[
            ("a", TensorType::new(DType::BF16, [2, 3, 4])),
            ("b", TensorType::new(DType::BF16, [2, 4, 5])),
        ],
        |i| {
            i["a"].dot_general(
                i["b"],
                DotGeneral {
                    lhs_batch: vec![0],
                    rhs_batch: vec![0],
                    lhs_contracting: vec![2],
                    rhs_contracting: vec![1],
                    precision: None,
                    preferred_element_type: Some(DType::F32),
                },
            )
        },
    )
    .unwrap();
    assert_eq!(f.output_types(), vec![f32(&[2, 3, 5])]);
}

#[test]
fn inputs_and_outputs_keep_their_dotted_names() {
    let f = trace(
        "names",
        &[("layers.3.self_attn.q_proj.lora_a", f32(&[4, 2]))],
        |i| {
            Outputs::new().add(
                "grads.layers.3.self_attn.q_proj.lora_a",
                i["layers.3.self_attn.q_proj.lora_a"] * 2.0,
            )
        },
    )
    .unwrap();
    assert_eq!(f.inputs[0].name, "layers.3.self_attn.q_proj.lora_a");
    assert!(f.output("grads.layers.3.self_attn.q_proj.lora_a").is_some());
}
