//! Tokenizer, presets, parameter counts, graph building at 405B, and PEFT
//! adapter round trips, against the HF fixtures.

use std::path::{Path, PathBuf};

use hlo_data::tokenizer::Tokenizer;
use hlo_ir::{DType, Op};
use hlo_models::adapter::Adapter;
use hlo_models::decoder::{forward_function, LoraConfig, ModelConfig, DEFAULT_TARGETS};
use hlo_models::io::read_safetensors;
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

#[test]
fn tokenizer_encodings_equal_hf_tokenizers() {
    let t = Tokenizer::from_file(&fixtures().join("tokenizer/tokenizer.json")).unwrap();
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tokenizer/encodings.json")).unwrap(),
    )
    .unwrap();
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = |k: &str| {
            case[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect::<Vec<_>>()
        };
        assert_eq!(t.encode(text, true).unwrap(), ids("ids"), "{text:?}");
        assert_eq!(
            t.encode(text, false).unwrap(),
            ids("ids_no_special"),
            "{text:?}"
        );
        assert_eq!(
            t.decode(&ids("ids")).unwrap(),
            case["decoded"].as_str().unwrap(),
            "{text:?}"
        );
    }
    let bytes = Tokenizer::bytes();
    assert_eq!(bytes.encode("hé", true).unwrap(), vec![256, 104, 195, 169]);
    assert_eq!(bytes.decode(&[256, 104, 195, 169, 257]).unwrap(), "hé");
}

#[test]
fn preset_parameter_counts_equal_hf() {
    let counts: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("llama/param_counts.json")).unwrap(),
    )
    .unwrap();
    for (name, count) in counts.as_object().unwrap() {
        assert_eq!(
            ModelConfig::preset(name).unwrap().parameter_count(),
            count.as_i64().unwrap(),
            "{name}"
        );
    }
    assert_eq!(
        ModelConfig::preset("llama3.1-405b")
            .unwrap()
            .parameter_count(),
        405_853_388_800
    );
    assert!(ModelConfig::preset("llama9").is_err());
}

#[test]
fn the_405b_graph_builds_from_abstract_shapes() {
    // Speed is a benchmark matter; here: it builds, with every layer.
    let c = ModelConfig::preset("llama3.1-405b").unwrap();
    let lora = LoraConfig::new(8, 16.0, &DEFAULT_TARGETS, false).unwrap();
    let f = forward_function(&c, DType::BF16, 1, 16, Some(&lora)).unwrap();
    assert_eq!(f.inputs.len(), c.parameter_shapes().len() + 126 * 7 * 2 + 1);
    let dots = f
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::DotGeneral(_)))
        .count();
    // 7 projections + 7·2 LoRA products + 2 attention products per layer,
    // and the head (the rotary angles are a broadcast product).
    assert_eq!(dots, 126 * (7 + 14 + 2) + 1);
}

#[test]
fn configs_in_both_transformers_spellings() {
    // transformers 4: rope_theta and rope_scaling at top level.
    let v4 = r#"{"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "max_position_embeddings": 131072,
        "tie_word_embeddings": false, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}"#;
    assert_eq!(
        ModelConfig::from_json(v4).unwrap(),
        ModelConfig::preset("llama3.1-8b").unwrap()
    );
    // transformers 5: rope_parameters with rope_theta inside (the fixtures).
    let c = ModelConfig::from_file(&fixtures().join("llama/gqa_llama3/config.json")).unwrap();
    assert_eq!(c.rope.theta, 500000.0);
    assert!(c.rope.scaling.is_some());
    for (bad, why) in [
        (r#"{"vocab_size": 8}"#, "not a model config.json"),
        (
            &v4.replace("\"llama3\"", "\"longrope\""),
            "unsupported: rope type `longrope`",
        ),
        (
            &v4.replace("\"llama\"", "\"olmoe\""),
            "unsupported: model_type `olmoe` (hlo-train runs LlamaForCausalLM, Qwen2ForCausalLM",
        ),
        (
            &v4.replace("\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"),
            "not a multiple",
        ),
    ] {
        let err = ModelConfig::from_json(bad).unwrap_err().to_string();
        assert!(err.contains(why), "{err}");
    }
}

#[test]
fn adapters_round_trip_in_peft_layout() {
    for name in ["gqa_llama3", "mha_tied", "head_dim"] {
        let dir = fixtures().join("llama").join(name);
        let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let a = Adapter::load(&dir.join("adapter"), &config).unwrap();
        assert_eq!(a.lora.rank, 4);
        assert_eq!(a.lora.use_rslora, name == "mha_tied");
        let out = std::env::temp_dir().join(format!("hlo-adapter-{}-{name}", std::process::id()));
        a.save(&out, Some("tiny")).unwrap();
        // Same keys, shapes and values as the adapter PEFT wrote.
        let mut theirs = read_safetensors(&dir.join("adapter/adapter_model.safetensors")).unwrap();
        let mut ours = read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
        theirs.sort_by(|x, y| x.0.cmp(&y.0));
        ours.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(ours, theirs, "{name}");
        assert_eq!(Adapter::load(&out, &config).unwrap(), a);
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["peft_type"], "LORA");
        assert_eq!(cfg["r"], 4);
        std::fs::remove_dir_all(out).unwrap();
    }
}

#[test]
fn fresh_adapters_are_initialised_as_peft_does() {
    let c = ModelConfig::preset("tiny").unwrap();
    let lora = LoraConfig::new(8, 16.0, &["q_proj", "v_proj"], false).unwrap();
    let a = Adapter::init(&c, &lora, 0);
    assert_eq!(a.tensors.len(), 2 * 2 * 2);
    for (name, t) in &a.tensors {
        let v = t.to_f64s();
        if name.ends_with("lora_b") {
            assert!(v.iter().all(|&x| x == 0.0), "{name}: B starts at zero");
        } else {
            let bound = 1.0 / (t.ty.dims[0] as f64).sqrt();
            assert!(
                v.iter().all(|&x| x.abs() <= bound) && v.iter().any(|&x| x.abs() > bound / 2.0),
                "{name}"
            );
        }
    }
    assert!(LoraConfig::new(0, 16.0, &["q_proj"], false).is_err());
    assert!(LoraConfig::new(8, 16.0, &["qkv"], false).is_err());
}
