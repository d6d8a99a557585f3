//! Qwen2, Qwen3, Mistral and Gemma 3 against HF transformers: f32 logits
//! of the fixture models (made by `scripts/make_family_fixtures.py` with
//! transformers 5.17 and PEFT 0.21: odd sizes, non-trivial biases and
//! norms, sliding windows shorter than the prompt, Gemma's local and
//! global layers) with and without a PEFT adapter, on the CPU plugin; the
//! layers as one scan give the same logits; the presets' parameter counts
//! equal HF's.

use std::path::PathBuf;

use hlo_e2e::{assert_f32_logits, expected_tensor, fixture_dir, fixture_logits, max_abs_diff};
use hlo_ir::{DType, Literal};
use hlo_models::decoder::{forward_function, Family, LayerType, ModelConfig};

const FAMILIES: [&str; 4] = ["qwen2", "qwen3", "mistral", "gemma3"];

fn fixture(name: &str) -> PathBuf {
    fixture_dir(&format!("families/{name}"))
}

fn expected(name: &str, key: &str) -> Literal {
    expected_tensor(&fixture(name), key)
}

/// The fixture model `name` in f32 on its input ids.
fn our_logits(name: &str, adapter: bool, scan: bool) -> Vec<f64> {
    fixture_logits(&fixture(name), DType::F32, adapter, scan)
}

#[test]
fn the_fixtures_exercise_each_familys_differences() {
    let c = |name: &str| ModelConfig::from_file(&fixture(name).join("config.json")).unwrap();
    let (qwen2, qwen3, mistral, gemma) = (c("qwen2"), c("qwen3"), c("mistral"), c("gemma3"));
    assert_eq!(qwen2.family, Family::Qwen2);
    assert!(qwen2.qkv_bias && qwen2.tie_word_embeddings);
    // Qwen2's window from max_window_layers = 1 on.
    assert_eq!(
        qwen2.layer_types,
        [LayerType::Full, LayerType::Sliding, LayerType::Sliding]
    );
    assert_eq!(qwen3.family, Family::Qwen3);
    assert!(qwen3.qk_norm && !qwen3.qkv_bias);
    assert_ne!(
        qwen3.head_dim,
        qwen3.hidden_size / qwen3.num_attention_heads
    );
    assert_eq!(mistral.family, Family::Mistral);
    assert_eq!(mistral.layer_types, [LayerType::Sliding; 2]);
    assert_eq!(gemma.family, Family::Gemma3);
    assert!(gemma.mixed_layer_types() && gemma.sandwich_norms && gemma.scale_embeddings);
    assert_eq!(gemma.sliding_rope.as_ref().unwrap().theta, 1e4);
    assert!(gemma.rope.scaling.is_some());
    assert!(gemma.final_logit_softcapping.is_some());
    // Each prompt is longer than every window.
    for (cfg, name) in [(&qwen2, "qwen2"), (&mistral, "mistral"), (&gemma, "gemma3")] {
        let s = expected(name, "input_ids").ty.dims[1];
        assert!(cfg.sliding_window.unwrap() < s, "{name}");
    }
}

#[test]
fn f32_logits_equal_hf() {
    for name in FAMILIES {
        let got = our_logits(name, false, false);
        let want = expected(name, "logits").to_f64s();
        assert_f32_logits(name, &fixture(name), &got, &want);
    }
}

#[test]
fn f32_logits_with_a_peft_adapter_equal_hf() {
    for name in FAMILIES {
        let got = our_logits(name, true, false);
        let want = expected(name, "logits_adapter").to_f64s();
        assert_f32_logits(&format!("{name} + adapter"), &fixture(name), &got, &want);
        // And the adapter matters.
        assert!(max_abs_diff(&want, &expected(name, "logits").to_f64s()) > 0.1);
    }
}

#[test]
fn the_layers_as_one_scan_give_hfs_logits() {
    // Gemma's scanned layers pick their own mask and rotary base by type.
    for name in ["gemma3", "qwen2"] {
        let got = our_logits(name, true, true);
        let want = expected(name, "logits_adapter").to_f64s();
        assert_f32_logits(&format!("{name} scanned"), &fixture(name), &got, &want);
    }
}

#[test]
fn the_forward_function_names_its_inputs_as_hf_does() {
    let c = ModelConfig::from_file(&fixture("gemma3").join("config.json")).unwrap();
    let f = forward_function(&c, DType::F32, 1, 4, None).unwrap();
    let names: Vec<&str> = f.inputs.iter().map(|b| b.name.as_str()).collect();
    for n in [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.pre_feedforward_layernorm.weight",
        "model.layers.3.post_feedforward_layernorm.weight",
    ] {
        assert!(names.contains(&n), "{n}");
    }
    assert!(!names.contains(&"lm_head.weight"));
}

#[test]
fn preset_parameter_counts_equal_hf() {
    let path = fixture_dir("families/param_counts.json");
    let counts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(counts.as_object().unwrap().len(), 7);
    for (name, count) in counts.as_object().unwrap() {
        assert_eq!(
            ModelConfig::preset(name).unwrap().parameter_count(),
            count.as_i64().unwrap(),
            "{name}"
        );
    }
}
