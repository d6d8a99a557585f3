//! How the printers write ops whose rule does not lower to one plain op:
//! identities, sharding constraints (with and without a mesh), scans, and
//! HLO's tupled and literal forms.

use hlo_ir::{constant, optimization_barrier, scan, trace, DType, Function, Literal, TensorType};
use hlo_lowering::{to_hlo_text, to_hlo_text_sharded, to_stablehlo, to_stablehlo_sharded};
use hlo_partitioner::{FunctionShardings, Mesh};

fn f32(dims: &[i64]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

fn axes(dims: &[&[&str]]) -> Vec<Vec<String>> {
    dims.iter()
        .map(|d| d.iter().map(|a| a.to_string()).collect())
        .collect()
}

/// `tanh(x)` under a sharding constraint and a stop_gradient.
fn constrained() -> Function {
    trace("constrained", &[("x", f32(&[4, 8]))], |i| {
        i["x"]
            .tanh()
            .with_sharding_constraint(axes(&[&["dp"], &["mp"]]))
            .stop_gradient()
            .exp()
    })
    .unwrap()
}

fn mesh() -> Mesh {
    "dp=2,fsdp=1,mp=2".parse().unwrap()
}

#[test]
fn identities_print_nothing() {
    let f = constrained();
    let text = to_stablehlo(&f);
    assert!(!text.contains("stop_gradient"), "{text}");
    assert!(!text.contains("sharding_constraint"), "{text}");
    assert!(
        text.contains("%1 = \"stablehlo.exponential\"(%0)"),
        "{text}"
    );
    let text = to_hlo_text(&f);
    assert!(!text.contains("custom-call"), "{text}");
    assert!(
        text.contains("exponential(f32[4,8]{1,0} %tanh.2)"),
        "{text}"
    );
}

#[test]
fn a_sharding_constraint_prints_with_a_mesh() {
    let f = constrained();
    let s = FunctionShardings::replicated(&f, &mesh());
    let text = to_stablehlo_sharded(&f, &s);
    assert!(
        text.contains(
            "%1 = \"sdy.sharding_constraint\"(%0) {sharding = #sdy.sharding<@mesh, [{\"dp\"}, {\"mp\"}]>} \
             : (tensor<4x8xf32>) -> tensor<4x8xf32>\n"
        ),
        "{text}"
    );
    assert!(text.contains("\"stablehlo.exponential\"(%1)"), "{text}");
    let text = to_hlo_text_sharded(&f, &s);
    assert!(
        text.contains(
            "%custom-call.3 = f32[4,8]{1,0} custom-call(f32[4,8]{1,0} %tanh.2), \
             custom_call_target=\"Sharding\", sharding={devices=[2,2]<=[4]}\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("exponential(f32[4,8]{1,0} %custom-call.3)"),
        "{text}"
    );
}

#[test]
fn a_scan_prints_as_a_while_loop() {
    let f = trace("layers", &[("x", f32(&[4])), ("xs", f32(&[3, 4]))], |i| {
        let (carry, ys) = scan(&[("h", i["x"])], &[("row", i["xs"])], &[], |b| {
            let h = (b["h"] + b["row"]).tanh();
            (vec![h], vec![h])
        });
        vec![("h", carry[0]), ("ys", ys[0])]
    })
    .unwrap();
    let text = to_stablehlo(&f);
    assert!(text.contains("\"stablehlo.while\""), "{text}");
    assert!(!text.contains("scan"), "{text}");
    let text = to_hlo_text(&f);
    assert!(text.contains(" while(("), "{text}");
    assert!(
        text.contains(", condition=%jit_layers_cond.") && text.contains(", body=%jit_layers_body."),
        "{text}"
    );
    assert!(!text.contains("scan"), "{text}");
}

#[test]
fn hlo_tuples_barrier_operands_and_writes_constants_in_place() {
    let f = trace("barrier", &[("x", f32(&[2]))], |i| {
        let c = constant(Literal::from_f64s(f32(&[2]), &[1.0, 2.5]));
        optimization_barrier(&[i["x"], c])
    })
    .unwrap();
    let text = to_hlo_text(&f);
    let want = "\
  %constant.2 = f32[2]{0} constant({1.0, 2.5})
  %tuple.3 = (f32[2]{0}, f32[2]{0}) tuple(f32[2]{0} %Arg_0.1, f32[2]{0} %constant.2)
  %opt-barrier.4 = (f32[2]{0}, f32[2]{0}) opt-barrier((f32[2]{0}, f32[2]{0}) %tuple.3)
  %get-tuple-element.5 = f32[2]{0} get-tuple-element((f32[2]{0}, f32[2]{0}) %opt-barrier.4), index=0
  %get-tuple-element.6 = f32[2]{0} get-tuple-element((f32[2]{0}, f32[2]{0}) %opt-barrier.4), index=1
";
    assert!(text.contains(want), "{text}");
    let text = to_stablehlo(&f);
    assert!(
        text.contains("%1:2 = \"stablehlo.optimization_barrier\"(%arg0, %0)"),
        "{text}"
    );
}
