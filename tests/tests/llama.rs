//! Llama against HF transformers: logits of the fixture models (made by
//! `scripts/make_llama_fixtures.py` with transformers 5.17 and PEFT 0.21)
//! with and without a PEFT adapter, on the CPU plugin.

use hlo_e2e::{assert_f32_logits, expected_tensor, fixture_dir, fixture_logits, max_abs_diff};
use hlo_ir::{DType, Literal};

const MODELS: [&str; 3] = ["gqa_llama3", "mha_tied", "head_dim"];

fn expected(name: &str, key: &str) -> Literal {
    expected_tensor(&fixture_dir(&format!("llama/{name}")), key)
}

/// Runs the fixture model `name` in `dtype` (with its adapter if `adapter`)
/// on the fixture's input ids; returns the logits as f64.
fn our_logits(name: &str, dtype: DType, adapter: bool) -> Vec<f64> {
    fixture_logits(
        &fixture_dir(&format!("llama/{name}")),
        dtype,
        adapter,
        false,
    )
}

#[test]
fn f32_logits_equal_hf() {
    for name in MODELS {
        let got = our_logits(name, DType::F32, false);
        let want = expected(name, "logits").to_f64s();
        assert_f32_logits(name, &fixture_dir(&format!("llama/{name}")), &got, &want);
    }
}

#[test]
fn f32_logits_with_a_peft_adapter_equal_hf() {
    for name in MODELS {
        let got = our_logits(name, DType::F32, true);
        let want = expected(name, "logits_adapter").to_f64s();
        let dir = fixture_dir(&format!("llama/{name}"));
        assert_f32_logits(&format!("{name} + adapter"), &dir, &got, &want);
        // And the adapter matters (B is not zero in the fixture).
        assert!(max_abs_diff(&want, &expected(name, "logits").to_f64s()) > 0.1);
    }
}

#[test]
fn bf16_logits_are_close_to_hf_f32() {
    // bf16 keeps 8 mantissa bits: a logit of magnitude ~5 after a few
    // layers is good to a few hundredths. Stated tolerance: 0.15 absolute.
    for name in MODELS {
        let got = our_logits(name, DType::BF16, true);
        let want = expected(name, "logits_adapter").to_f64s();
        let d = max_abs_diff(&got, &want);
        assert!(d < 0.15, "{name} bf16: max abs diff {d}");
        println!("{name}: bf16 max abs diff {d:.4}");
    }
}
