//! Whole-program snapshots of what the lowering emits for a two-layer MLP,
//! kept in the top-level `snapshots/` folder. A change to the printers shows
//! up here as a diff to review like code.

use hlo_ir::DType;
use hlo_models::mlp::two_layer_mlp;

fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path("../../snapshots");
    s.set_prepend_module_to_snapshot(false);
    s
}

#[test]
fn mlp_stablehlo() {
    let f = two_layer_mlp(8, 16, 32, 4, DType::F32).unwrap();
    settings().bind(|| insta::assert_snapshot!("mlp.stablehlo", hlo_lowering::to_stablehlo(&f)));
}

#[test]
fn mlp_hlo() {
    let f = two_layer_mlp(8, 16, 32, 4, DType::F32).unwrap();
    settings().bind(|| insta::assert_snapshot!("mlp.hlo", hlo_lowering::to_hlo_text(&f)));
}

#[test]
fn printing_is_deterministic() {
    // Two traces of the same program print byte-identical text.
    let a = two_layer_mlp(2, 3, 5, 7, DType::BF16).unwrap();
    let b = two_layer_mlp(2, 3, 5, 7, DType::BF16).unwrap();
    assert_eq!(
        hlo_lowering::to_stablehlo(&a),
        hlo_lowering::to_stablehlo(&b)
    );
    assert_eq!(hlo_lowering::to_hlo_text(&a), hlo_lowering::to_hlo_text(&b));
}

#[test]
fn mlp_runs_and_matches_reference() {
    let f = two_layer_mlp(8, 16, 32, 4, DType::F32).unwrap();
    let mut rng = hlo_e2e::Rng(21);
    let inputs: Vec<_> = f
        .input_types()
        .into_iter()
        .map(|t| rng.literal(t, -1.0, 1.0))
        .collect();
    hlo_e2e::check_against_reference(&f, &inputs, 2.0);
}
