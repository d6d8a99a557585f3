//! What each op's rule says about how it lowers: the printers of
//! `hlo-lowering` dispatch on it.

use hlo_ir::ops::{OptimizationBarrier, ShardingConstraint, StopGradient};
use hlo_ir::{
    lower_scans, optimization_barrier, scan, trace, while_loop, DType, Function, Lowering, Op,
    Spelling, TensorType,
};

fn f32(dims: &[i64]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

fn axes(dims: &[&[&str]]) -> Vec<Vec<String>> {
    dims.iter()
        .map(|d| d.iter().map(|a| a.to_string()).collect())
        .collect()
}

/// Both formats' lowering of `op` applied to `operands`.
fn lowerings(op: &Op, operands: &[TensorType]) -> [Lowering; 2] {
    let results = op.infer(operands).unwrap();
    [
        op.rule().stablehlo(operands, &results),
        op.rule().hlo(operands, &results),
    ]
}

#[test]
fn stop_gradient_lowers_to_the_identity() {
    let op = Op::StopGradient(StopGradient);
    assert!(op.is_identity());
    assert_eq!(
        lowerings(&op, &[f32(&[2])]),
        [Lowering::Identity, Lowering::Identity]
    );
}

#[test]
fn a_sharding_constraint_lowers_to_shardy_and_gspmd_spellings() {
    let dims = axes(&[&["dp", "fsdp"], &[]]);
    let op = Op::ShardingConstraint(ShardingConstraint { dims: dims.clone() });
    assert!(!op.is_identity());
    let [stablehlo, hlo] = lowerings(&op, &[f32(&[4, 8])]);
    assert_eq!(
        stablehlo,
        Lowering::ShardingConstraint {
            op: Spelling::new("sdy.sharding_constraint"),
            dims: dims.clone(),
        }
    );
    assert_eq!(
        hlo,
        Lowering::ShardingConstraint {
            op: Spelling::new("custom-call").attr("custom_call_target", "\"Sharding\""),
            dims,
        }
    );
}

#[test]
fn an_optimization_barrier_is_one_tupled_op_in_hlo() {
    let op = Op::OptimizationBarrier(OptimizationBarrier);
    let [stablehlo, hlo] = lowerings(&op, &[f32(&[2]), f32(&[3])]);
    assert_eq!(
        stablehlo,
        Lowering::Op(Spelling::new("stablehlo.optimization_barrier"))
    );
    assert_eq!(hlo, Lowering::Op(Spelling::new("opt-barrier").tupled()));
}

/// A function with a scan in a scan's body and a scan in a loop's body.
fn nested_scans() -> Function {
    trace(
        "nested",
        &[("x", f32(&[4])), ("xs", f32(&[3, 2, 4]))],
        |i| {
            let (carry, ys) = scan(&[("h", i["x"])], &[("row", i["xs"])], &[], |b| {
                let (inner, _) = scan(&[("g", b["h"])], &[("r", b["row"])], &[], |c| {
                    (vec![(c["g"] + c["r"]).tanh().stop_gradient()], vec![])
                });
                (vec![inner[0]], vec![inner[0]])
            });
            let looped = while_loop(
                &[carry[0], i["xs"]],
                |s| s[0].sum(&[0]).lt(s[0].scalar_like(100.0)),
                |s| {
                    let (c, _) = scan(&[("h", s[0])], &[("row", s[1])], &[], |b| {
                        (vec![b["h"] + b["row"].sum(&[0])], vec![])
                    });
                    vec![c[0], s[1]]
                },
            );
            let kept = optimization_barrier(&[looped[0], ys[0]]);
            vec![("h", kept[0]), ("ys", kept[1])]
        },
    )
    .unwrap()
}

/// Every node's lowerings, also inside loop conditions and bodies and scan
/// bodies, with `is_identity` checked against them on the way.
fn all_lowerings(f: &Function, out: &mut Vec<(&'static str, Lowering)>) {
    for node in &f.nodes {
        let operands: Vec<TensorType> = node.operands.iter().map(|&o| f.ty(o).clone()).collect();
        for l in lowerings(&node.op, &operands) {
            assert_eq!(
                node.op.is_identity(),
                l == Lowering::Identity,
                "{}",
                node.op.name()
            );
            out.push((node.op.name(), l));
        }
        match &node.op {
            Op::While(w) => {
                all_lowerings(&w.cond, out);
                all_lowerings(&w.body, out);
            }
            Op::Scan(s) => all_lowerings(&s.body, out),
            _ => {}
        }
    }
}

#[test]
fn a_scan_is_expanded_by_lower_scans_which_leaves_none() {
    let f = nested_scans();
    let mut before = Vec::new();
    all_lowerings(&f, &mut before);
    let scans: Vec<&Lowering> = before
        .iter()
        .filter(|(name, _)| *name == "scan")
        .map(|(_, l)| l)
        .collect();
    assert_eq!(scans.len(), 6, "three scans, two formats each");
    for l in scans {
        assert_eq!(*l, Lowering::Expanded { by: "lower_scans" });
    }
    let mut after = Vec::new();
    all_lowerings(&lower_scans(&f), &mut after);
    assert!(after.iter().any(|(name, _)| *name == "while"));
    for (name, l) in &after {
        assert!(
            !matches!(l, Lowering::Expanded { .. }),
            "`{name}` is left to expand after lower_scans"
        );
    }
}
