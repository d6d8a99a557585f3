//! `config.json` read exactly as transformers 5.17 reads it where spellings
//! conflict (observed with `scripts/make_peft_variant_fixtures.py
//! --probe-config`): a non-null legacy `rope_scaling` replaces
//! `rope_parameters` whole; the theta is the chosen spelling's own, else the
//! top-level `rope_theta`, else 10000.

use hlo_models::decoder::{ExpertStyle, LayerType, ModelConfig, RopeScaling};
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

/// The families' `config.json` variants of `tests/fixtures/families/
/// config_cases.json` (absent fields, older spellings) resolved as
/// transformers 5.17 resolves them (`scripts/make_family_fixtures.py`).
#[test]
fn family_configs_read_as_transformers_reads_them() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/families/config_cases.json");
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let c = ModelConfig::from_json(&case["config"].to_string())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let want = &case["resolved"];
        let types: Vec<&str> = c.layer_types.iter().map(|t| t.name()).collect();
        assert_eq!(json!(types), want["layer_types"], "{name}");
        assert_eq!(json!(c.sliding_window), want["sliding_window"], "{name}");
        assert_eq!(json!(c.head_dim), want["head_dim"], "{name}");
        assert_eq!(
            json!(c.num_key_value_heads),
            want["num_key_value_heads"],
            "{name}"
        );
        assert_eq!(
            json!(c.tie_word_embeddings),
            want["tie_word_embeddings"],
            "{name}"
        );
        assert_eq!(
            c.query_pre_attn_scalar,
            want["query_pre_attn_scalar"].as_f64(),
            "{name}"
        );
        for (kind, rope) in want["rope"].as_object().unwrap() {
            let kind = match kind.as_str() {
                "full_attention" => LayerType::Full,
                _ => LayerType::Sliding,
            };
            let ours = c.rope_of(kind);
            assert_eq!(ours.theta, rope["rope_theta"].as_f64().unwrap(), "{name}");
            let (rope_type, factor) = match &ours.scaling {
                None => ("default", None),
                Some(RopeScaling::Linear { factor }) => ("linear", Some(*factor)),
                Some(RopeScaling::Llama3(s)) => ("llama3", Some(s.factor)),
                Some(RopeScaling::Yarn(y)) => ("yarn", Some(y.factor)),
            };
            assert_eq!(rope_type, rope["rope_type"], "{name}");
            assert_eq!(factor, rope["factor"].as_f64(), "{name}");
        }
    }
}

#[test]
fn unsupported_architectures_and_settings_are_refused_naming_what_runs() {
    let small = json!({
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    });
    let with = |extra: Value| {
        let mut c = small.clone();
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        ModelConfig::from_json(&c.to_string())
            .map(|_| ())
            .expect_err(&c.to_string())
            .to_string()
    };
    let runs = "(hlo-train runs LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Gemma3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Glm4MoeForCausalLM, DeepseekV3ForCausalLM, GptOssForCausalLM)";
    for (extra, why) in [
        (
            json!({"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"]}),
            format!("unsupported: model_type `olmoe` {runs}"),
        ),
        (
            json!({"architectures": ["DeepseekV2ForCausalLM"]}),
            format!("unsupported: architectures [\"DeepseekV2ForCausalLM\"] {runs}"),
        ),
        // What the new families' classes can set and is not computed.
        (
            json!({"model_type": "deepseek_v3", "num_key_value_heads": 2, "attention_bias": true}),
            "unsupported: attention_bias = true (biases on DeepSeek-V3's latent projections)".to_string(),
        ),
        (
            json!({"model_type": "deepseek_v3", "num_key_value_heads": 2}),
            "unsupported: num_key_value_heads = 2 with 4 attention heads (multi-head latent attention expands the latent into every head)".to_string(),
        ),
        (
            json!({"model_type": "glm4_moe", "n_routed_experts": 6, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2}),
            "unsupported: n_group = 4, topk_group = 2 with 6 experts, 2 a token".to_string(),
        ),
        (
            json!({"model_type": "llama", "partial_rotary_factor": 0.5}),
            "unsupported: partial_rotary_factor = 0.5".to_string(),
        ),
        // Families whose attention is not computed: refused naming it,
        // by model_type or, without one, by architecture.
        (
            json!({"model_type": "deepseek_v32", "index_topk": 2048}),
            format!("unsupported: DeepSeek-V3.2's sparse attention (DSA: a lightning indexer keeps index_topk keys per query) (model_type `deepseek_v32`, DeepseekV32ForCausalLM) is not computed {runs}"),
        ),
        (
            json!({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}),
            format!("unsupported: Qwen3-Next's linear attention (Gated DeltaNet layers between the gated attention ones) (model_type `qwen3_next`, Qwen3NextForCausalLM) is not computed {runs}"),
        ),
        (
            json!({"architectures": ["Qwen3NextForCausalLM"]}),
            format!("unsupported: Qwen3-Next's linear attention (Gated DeltaNet layers between the gated attention ones) (model_type `qwen3_next`, Qwen3NextForCausalLM) is not computed {runs}"),
        ),
        (
            json!({"model_type": "llama4_text", "attention_chunk_size": 8192}),
            format!("unsupported: Llama 4's chunked attention (attention_chunk_size, with NoPE layers) (model_type `llama4_text`, Llama4ForCausalLM) is not computed {runs}"),
        ),
        (
            json!({"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}),
            format!("unsupported: Llama 4's chunked attention (attention_chunk_size, with NoPE layers) (model_type `llama4`, Llama4ForConditionalGeneration) is not computed {runs}"),
        ),
        // Gemma 3's multimodal checkpoints (4B and up).
        (
            json!({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}),
            format!("unsupported: model_type `gemma3` {runs}"),
        ),
        // A sequence classifier is read (a reward model); a token
        // classifier is not.
        (
            json!({"model_type": "qwen2", "architectures": ["Qwen2ForTokenClassification"]}),
            "unsupported: architectures [\"Qwen2ForTokenClassification\"] for model_type `qwen2`"
                .into(),
        ),
        (
            json!({"model_type": "qwen3", "attention_bias": true}),
            "unsupported: attention_bias = true".into(),
        ),
        (
            json!({"model_type": "gemma3_text", "use_bidirectional_attention": true}),
            "unsupported: use_bidirectional_attention = true".into(),
        ),
        (
            json!({"model_type": "gemma3_text", "hidden_activation": "gelu"}),
            "unsupported: hidden_activation `gelu` (only gelu_pytorch_tanh)".into(),
        ),
        (
            json!({"model_type": "qwen2", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}),
            "unsupported: rope type `longrope` (only default, linear, llama3 and yarn)".into(),
        ),
        (
            json!({"model_type": "qwen2", "layer_types": ["full_attention"]}),
            "unsupported: layer_types has 1 entries for num_hidden_layers = 2".into(),
        ),
        (
            json!({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}),
            "unsupported: sliding_attention layers without a sliding_window".into(),
        ),
        (
            json!({"model_type": "gemma3_text", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
            "unsupported: rope_parameters not keyed by layer type".into(),
        ),
        (
            json!({"model_type": "mistral", "sliding_window": 0}),
            "unsupported: sliding_window = 0".into(),
        ),
    ] {
        let err = with(extra.clone());
        assert!(err.starts_with(&why), "{extra}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // DeepSeek's two yarn mscales on another family: transformers'
    // `_compute_yarn_parameters` takes their ratio as the cos/sin factor
    // (1 here); only DeepSeek-V3's attention scales its scores by more.
    let mut c = small.clone();
    c["model_type"] = json!("qwen3");
    c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 32768, "mscale": 1.0, "mscale_all_dim": 1.0});
    let c = ModelConfig::from_json(&c.to_string()).unwrap();
    assert_eq!(c.rope_attention_scaling(LayerType::Full), 1.0);
}

/// Mixture-of-experts configs with fields absent take the config classes'
/// defaults (transformers 5.24's `Qwen3MoeConfig`, `MixtralConfig`), and
/// settings not computed are refused.
#[test]
fn moe_configs_read_as_transformers_reads_them() {
    let small = |extra: Value| {
        let mut c = json!({
            "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 4, "num_attention_heads": 4,
        });
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        ModelConfig::from_json(&c.to_string())
    };
    let q = small(json!({"model_type": "qwen3_moe"})).unwrap();
    let m = q.moe.as_ref().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.moe_intermediate_size),
        (128, 8, 768)
    );
    assert!(!m.norm_topk_prob && !m.output_router_logits && !m.f32_routing_weights);
    assert_eq!(m.router_aux_loss_coef, 0.001);
    assert_eq!(m.sparse_layers, [true; 4]);
    // Qwen3-MoE's head_dim is hidden / heads when absent (dense Qwen3's 128).
    assert_eq!((q.num_key_value_heads, q.head_dim), (4, 8));
    assert!(q.qk_norm && q.sliding_window.is_none());
    // transformers 5 writes `num_local_experts`; the Hub's configs say
    // `num_experts`.
    let q =
        small(json!({"model_type": "qwen3_moe", "num_local_experts": 6, "num_experts_per_tok": 2}))
            .unwrap();
    assert_eq!(q.moe.unwrap().num_experts, 6);
    let q = small(json!({
        "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 2,
        "decoder_sparse_step": 2, "mlp_only_layers": [3],
    }))
    .unwrap();
    assert_eq!(
        q.moe.as_ref().unwrap().sparse_layers,
        [false, true, false, false]
    );
    assert!(q.mixed_mlps());
    // No experts at all: every MLP dense.
    assert!(small(json!({"model_type": "qwen3_moe", "num_experts": 0}))
        .unwrap()
        .moe
        .is_none());
    // (Mixtral's 8 K/V heads by default need 8 heads.)
    let x = small(json!({"model_type": "mixtral", "num_attention_heads": 8})).unwrap();
    let m = x.moe.as_ref().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.moe_intermediate_size),
        (8, 2, 48)
    );
    assert!(m.norm_topk_prob && m.f32_routing_weights);
    // Mixtral's window is none unless given; its norms' eps 1e-5.
    assert_eq!(x.sliding_window, None);
    assert_eq!(x.rms_norm_eps, 1e-5);
    assert_eq!(x.num_key_value_heads, 8);
    let x = small(json!({"model_type": "mixtral", "num_attention_heads": 8, "sliding_window": 3}))
        .unwrap();
    assert_eq!(x.layer_types, [LayerType::Sliding; 4]);
    for (extra, why) in [
        (
            json!({"model_type": "mixtral", "num_attention_heads": 8, "router_jitter_noise": 0.1}),
            "router_jitter_noise = 0.1",
        ),
        (
            json!({"model_type": "mixtral", "num_attention_heads": 8, "num_local_experts": 2, "num_experts_per_tok": 3}),
            "num_experts_per_tok = 3 with 2 experts",
        ),
        (
            json!({"model_type": "qwen3_moe", "num_experts": 4, "num_local_experts": 8}),
            "num_local_experts = 8 and num_experts = 4 disagree",
        ),
        (
            json!({"model_type": "qwen3_moe", "attention_bias": true}),
            "attention_bias = true",
        ),
        (
            json!({"model_type": "gpt_oss", "num_key_value_heads": 2, "swiglu_limit": -1.0}),
            "swiglu_limit = -1",
        ),
        (
            json!({"model_type": "gpt_oss", "num_key_value_heads": 2,
                "quantization_config": {"quant_method": "fp8"}}),
            "quant_method `fp8`",
        ),
    ] {
        let err = small(extra.clone()).unwrap_err().to_string();
        assert!(err.contains(why), "{extra}: {err}");
    }
    // gpt-oss (`GptOssConfig`'s defaults): biases on q/k/v/o, sinks,
    // layers alternating sliding (window 128) and full, yarn over theta
    // 150000, 128 experts of which 4 a token, swiglu 1.702 / 7; the
    // released MXFP4 experts are read dequantized.
    let g = small(json!({"model_type": "gpt_oss", "num_key_value_heads": 2,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}))
    .unwrap();
    assert!(g.qkv_bias && g.o_bias && g.attention_sinks && g.quantization.is_none());
    assert_eq!(
        g.layer_types,
        [
            LayerType::Sliding,
            LayerType::Full,
            LayerType::Sliding,
            LayerType::Full
        ]
    );
    assert_eq!((g.sliding_window, g.rms_norm_eps), (Some(128), 1e-5));
    assert_eq!(g.rope.theta, 150000.0);
    match &g.rope.scaling {
        Some(RopeScaling::Yarn(y)) => {
            assert_eq!(
                (y.factor, y.beta_fast, y.beta_slow, y.truncate),
                (32.0, 32.0, 1.0, false)
            );
            assert!((y.attention_factor - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-12);
        }
        other => panic!("{other:?}"),
    }
    let m = g.moe.as_ref().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.moe_intermediate_size),
        (128, 4, 48)
    );
    assert_eq!(
        m.style,
        ExpertStyle::GptOss {
            swiglu_alpha: 1.702,
            swiglu_limit: 7.0
        }
    );
    let unbiased =
        small(json!({"model_type": "gpt_oss", "num_key_value_heads": 2, "attention_bias": false}))
            .unwrap();
    assert!(!unbiased.qkv_bias && !unbiased.o_bias);
    // Written out and read back, the same.
    for c in [q, x, g, unbiased] {
        assert_eq!(ModelConfig::from_json(&c.to_json()).unwrap(), c);
    }
}
