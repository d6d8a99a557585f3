//! `config.json` read exactly as transformers 5.17 reads it where spellings
//! conflict (observed with `scripts/make_peft_variant_fixtures.py
//! --probe-config`): a non-null legacy `rope_scaling` replaces
//! `rope_parameters` whole; the theta is the chosen spelling's own, else the
//! top-level `rope_theta`, else 10000.

use hlo_models::decoder::{LayerType, ModelConfig};
use serde_json::{json, Value};

const LLAMA3: [(&str, f64); 4] = [
    ("factor", 8.0),
    ("low_freq_factor", 1.0),
    ("high_freq_factor", 4.0),
    ("original_max_position_embeddings", 16.0),
];

fn llama3(theta: Option<f64>) -> Value {
    let mut v = json!({"rope_type": "llama3"});
    for (k, x) in LLAMA3 {
        v[k] = json!(x);
    }
    if let Some(t) = theta {
        v["rope_theta"] = json!(t);
    }
    v
}

fn inv_freq(extra: Value) -> Vec<f64> {
    let mut c = json!({
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
        "tie_word_embeddings": false,
    });
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    ModelConfig::from_json(&c.to_string())
        .unwrap()
        .inv_freq(LayerType::Full)
}

/// transformers' inv_freq for these configs (head_dim 8).
const DEFAULT_1E4: [f64; 4] = [1.0, 0.1, 0.01, 0.001];
const DEFAULT_5E5: [f64; 4] = [1.0, 0.037606, 0.00141421, 5.3183e-05];
const LLAMA3_1E4: [f64; 4] = [0.576056, 0.0125, 0.00125, 0.000125];
const LLAMA3_5E5: [f64; 4] = [0.576056, 0.00470075, 0.000176777, 6.64787e-06];

fn assert_freqs(got: &[f64], want: &[f64; 4], case: &str) {
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs(),
            "{case}: {got:?} vs {want:?}"
        );
    }
}

#[test]
fn conflicting_rope_spellings_read_as_transformers_reads_them() {
    let default = |theta: f64| json!({"rope_type": "default", "rope_theta": theta});
    let cases = [
        (
            "a1",
            json!({"rope_parameters": default(1e4), "rope_scaling": llama3(None)}),
            LLAMA3_1E4,
        ),
        (
            "a2",
            json!({"rope_parameters": llama3(Some(1e4)), "rope_scaling": {"rope_type": "default"}}),
            DEFAULT_1E4,
        ),
        (
            "a3",
            json!({"rope_parameters": llama3(Some(1e4)), "rope_scaling": default(5e5)}),
            DEFAULT_5E5,
        ),
        // The 5e5 of rope_parameters is lost to rope_scaling.
        (
            "a4",
            json!({"rope_parameters": default(5e5), "rope_scaling": llama3(None)}),
            LLAMA3_1E4,
        ),
        (
            "a5",
            json!({"rope_theta": 5e5, "rope_parameters": default(5e5), "rope_scaling": llama3(None)}),
            LLAMA3_5E5,
        ),
        (
            "a6",
            json!({"rope_parameters": llama3(Some(5e5)), "rope_scaling": {"rope_type": "default"}}),
            DEFAULT_1E4,
        ),
        (
            "a7",
            json!({"rope_parameters": llama3(Some(5e5)), "rope_scaling": null}),
            LLAMA3_5E5,
        ),
        // A top-level theta only fills a missing one.
        (
            "b",
            json!({"rope_theta": 5e5, "rope_parameters": default(1e4)}),
            DEFAULT_1E4,
        ),
        (
            "b2",
            json!({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default"}}),
            DEFAULT_5E5,
        ),
        (
            "legacy",
            json!({"rope_theta": 5e5, "rope_scaling": llama3(None)}),
            LLAMA3_5E5,
        ),
    ];
    for (case, extra, want) in cases {
        assert_freqs(&inv_freq(extra), &want, case);
    }
}
