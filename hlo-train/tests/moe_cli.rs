//! Qwen3-MoE, Mixtral, gpt-oss, Qwen2-MoE, GLM-4.5 and DeepSeek-V3 through the command line against HF
//! transformers 5 and PyTorch+PEFT (fixtures made by
//! `scripts/make_moe_fixtures.py`): greedy tokens of `generate` equal HF's
//! `generate` with and without a PEFT adapter; one SGD and one AdamW step
//! of the adapter, with the router's load-balancing loss in the loss
//! (`output_router_logits`, coefficient 0.05), equal PyTorch+PEFT's to
//! 1e-6 on one device and on a 2×2×2 mesh of 8 virtual devices, with the
//! router frozen and trained (`modules_to_save`); merging the adapter
//! gives its logits.

mod common;

use common::*;
use hlo_engine::models::io::read_safetensors;

const MODELS: [&str; 6] = [
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "qwen2_moe",
    "glm4_moe",
    "deepseek_v3",
];
/// The families whose router PEFT can save whole (GLM-4.5's and
/// DeepSeek-V3's sigmoid routers are refused: the selection bias is a
/// buffer).
const SAVED_ROUTERS: [&str; 4] = ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"];

#[test]
fn greedy_tokens_equal_hf_generate() {
    for name in MODELS {
        for mesh in [&[][..], &["--mesh", "dp=1,fsdp=2,mp=4", "--dtype", "f32"]] {
            assert_greedy_equals_hf(&family(name), 7, 24, mesh);
        }
    }
}

#[test]
fn greedy_tokens_with_lora_on_the_experts_equal_hf_generate() {
    for name in MODELS {
        let dir = family(name);
        let want = ids(&fixture_tensor(
            &dir,
            "expected_experts.safetensors",
            "greedy_adapter_experts",
        ));
        let prompt = want[..7].join(",");
        for mesh in [&[][..], &["--mesh", "dp=1,fsdp=2,mp=4", "--dtype", "f32"]] {
            let got = greedy_ids(&dir, Some(&dir.join("adapter_experts")), &prompt, 24, mesh);
            let got: Vec<String> = got.iter().map(u64::to_string).collect();
            assert_eq!(got, want[7..], "{name} {mesh:?}");
        }
    }
}

#[test]
fn one_sgd_and_one_adamw_step_with_the_aux_loss_equal_pytorch_peft() {
    for name in MODELS {
        for opt in ["sgd", "adamw"] {
            for mesh in [&[][..], &["--mesh", "dp=2,fsdp=2,mp=2"]] {
                std::fs::remove_dir_all(step_equals_pytorch(&family(name), opt, mesh)).unwrap();
            }
        }
    }
}

#[test]
fn one_step_of_lora_on_the_experts_equals_pytorch_peft() {
    // PEFT's `target_parameters` on both fused expert tensors (one A and B
    // per expert), with the attention projections; the aux loss on.
    let from = ("adapter_experts", "train_step_experts.safetensors");
    for name in MODELS {
        for opt in ["sgd", "adamw"] {
            for mesh in [&[][..], &["--mesh", "dp=2,fsdp=2,mp=2"]] {
                let dir = step_from_equals_pytorch(&family(name), from, opt, mesh);
                std::fs::remove_dir_all(dir).unwrap();
            }
        }
    }
}

#[test]
fn one_step_with_the_router_trained_equals_pytorch_peft() {
    // The router trained on request, as PEFT's `modules_to_save` (`gate`;
    // gpt-oss's `router`, its bias too; scripts/make_moe_router_fixtures.py):
    // its gradient comes through the routing weights and the aux loss.
    // The loss to 2e-6 (4 of f32's steps at 5.66: Mixtral's is 1.4e-6
    // away), the parameters to 1e-6.
    let from = ("adapter_router", "train_step_router.safetensors");
    for name in SAVED_ROUTERS {
        for opt in ["sgd", "adamw"] {
            for mesh in [&[][..], &["--mesh", "dp=2,fsdp=2,mp=2"]] {
                let dir = step_within_of_pytorch(&family(name), from, opt, mesh, 2e-6);
                std::fs::remove_dir_all(dir).unwrap();
            }
        }
    }
}

#[test]
fn merged_adapters_give_the_adapters_logits_in_hfs_layout() {
    let tmp = scratch("moe", "merge");
    let keys = |dir: &std::path::Path| -> Vec<String> {
        let mut k: Vec<String> = read_safetensors(&dir.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        k.sort();
        k
    };
    for name in MODELS {
        let dir = family(name);
        for adapter in [
            ("adapter", "expected.safetensors", "logits_adapter"),
            (
                "adapter_experts",
                "expected_experts.safetensors",
                "logits_adapter_experts",
            ),
        ] {
            // gpt-oss's f32 logits move by 1.1e-5 when PEFT itself merges
            // the expert adapter (merge_and_unload against the unmerged
            // model; our merged weights equal PEFT's within 6e-8);
            // DeepSeek-V3's by 1.8e-5 (MOE.md's formula, PEFT's deltas).
            let tol = match name {
                "gpt_oss" | "deepseek_v3" => 2e-5,
                _ => 1e-5,
            };
            assert_merge_of_gives_logits(&dir, adapter, &tmp, tol);
            // The tensors as transformers' save_pretrained wrote the
            // fixture: per expert (Mixtral's under block_sparse_moe;
            // gpt-oss's fused).
            assert_eq!(keys(&tmp.join(name)), keys(&dir), "{name} {}", adapter.0);
        }
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn plan_bench_and_dump_hlo_take_the_moe_families() {
    let dir = scratch("moe", "tools");
    for name in MODELS {
        // Scope names follow HF's module tree: the router and the experts.
        let router = if name == "gpt_oss" {
            "mlp.router"
        } else {
            "mlp.gate"
        };
        assert_tools_take(&family(name), &[router, "mlp.experts"], &dir);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn serve_refuses_lora_on_the_experts_by_name() {
    // The serving tables hold the attention projections' LoRA; an expert
    // adapter is refused, never served without its experts' part.
    let dir = family("qwen3_moe");
    let adapter = format!("ex={}", dir.join("adapter_experts").display());
    let out = hlo_train(&[
        "serve",
        "--port",
        "0",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--adapter",
        &adapter,
    ]);
    let line = one_line_error(&out);
    assert!(
        line.contains("target_parameters") && line.contains("merge"),
        "{line}"
    );
}

#[test]
fn a_fresh_adapter_on_the_experts_and_the_router_trains_and_saves_as_peft_does() {
    let tmp = scratch("moe", "fresh");
    let dir = family("qwen3_moe");
    let out = tmp.join("out");
    let data = expected_rows(&dir, &tmp);
    let text = ok(&hlo_train(&[
        "train",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--lora-targets",
        "q_proj,mlp.experts.gate_up_proj,mlp.experts.down_proj",
        "--lora-rank",
        "2",
        "--modules-to-save",
        "gate",
        "--batch",
        "2",
        "--seq",
        "11",
        "--steps",
        "2",
        "--dtype",
        "f32",
        "--out",
        out.to_str().unwrap(),
    ]));
    // The header names what is trained, as the model has it: the sparse
    // layers' experts.
    assert!(
        text.contains("on experts.gate_up_proj,experts.down_proj (2 of 3 layers); q_proj, training gate whole"),
        "{text}"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        config["target_parameters"],
        serde_json::json!(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    );
    assert_eq!(config["modules_to_save"], serde_json::json!(["gate"]));
    // The routers were trained whole: saved under PEFT's keys, moved
    // from the base's.
    let saved = read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
    let base = read_safetensors(&dir.join("model.safetensors")).unwrap();
    for l in [0, 2] {
        let key = format!("base_model.model.model.layers.{l}.mlp.gate.weight");
        let ours = &saved.iter().find(|(k, _)| *k == key).unwrap().1;
        let theirs = &base
            .iter()
            .find(|(k, _)| *k == format!("model.layers.{l}.mlp.gate.weight"))
            .unwrap()
            .1;
        assert_eq!(ours.ty.dims, theirs.ty.dims, "{key}");
        assert_ne!(ours.to_f64s(), theirs.to_f64s(), "{key}: trained");
    }
    let mut keys: Vec<(String, Vec<i64>)> =
        read_safetensors(&out.join("adapter_model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(k, t)| (k, t.ty.dims))
            .collect();
    keys.sort();
    // 8 experts of rank 2: A [E·r, in], B [out, E·r], gate_up nested one
    // wrapper deeper.
    let layer0 = "base_model.model.model.layers.0.mlp.experts";
    for (key, dims) in [
        (format!("{layer0}.base_layer.lora_A.weight"), vec![16, 40]),
        (format!("{layer0}.base_layer.lora_B.weight"), vec![40, 16]),
        (format!("{layer0}.lora_A.weight"), vec![16, 20]),
        (format!("{layer0}.lora_B.weight"), vec![40, 16]),
    ] {
        assert!(
            keys.contains(&(key.clone(), dims.clone())),
            "{key} {dims:?} in {keys:?}"
        );
    }
    assert!(!keys
        .iter()
        .any(|(k, _)| k.contains("layers.0.mlp.gate_proj")));
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn gate_up_down_targets_become_the_experts_as_peft_reads_them() {
    // PEFT 0.21 on transformers 5 turns `gate_proj`, `up_proj` and
    // `down_proj` targets into the fused experts' parameters on Qwen3-MoE,
    // GLM-4.5 and DeepSeek-V3 (gate_up_proj at twice the rank and alpha):
    // the default targets give the adapter PEFT's own config
    // (families/glm4_moe/adapter_experts was made so by PEFT), and one of
    // gate_proj and up_proj alone is refused, as PEFT refuses it.
    let tmp = scratch("moe", "converted");
    let dir = family("glm4_moe");
    let data = expected_rows(&dir, &tmp);
    let train = |out: &std::path::Path, targets: Option<&str>| {
        let mut args = vec![
            "train",
            "--checkpoint",
            dir.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--lora-rank",
            "4",
            "--lora-alpha",
            "8",
            "--batch",
            "2",
            "--seq",
            "11",
            "--steps",
            "1",
            "--dtype",
            "f32",
            "--out",
            out.to_str().unwrap(),
        ];
        if let Some(t) = targets {
            args.extend(["--lora-targets", t]);
        }
        hlo_train(&args)
    };
    let out = tmp.join("default");
    ok(&train(&out, None));
    let read = |d: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("adapter_config.json")).unwrap())
            .unwrap()
    };
    let (ours, peft) = (read(&out), read(&dir.join("adapter_experts")));
    let set = |v: &serde_json::Value| {
        let mut s: Vec<String> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|x| {
                x.as_str()
                    .unwrap()
                    .trim_start_matches("mlp.experts.")
                    .to_string()
            })
            .collect();
        s.sort();
        s.dedup();
        s
    };
    for key in ["target_modules", "target_parameters"] {
        assert_eq!(set(&ours[key]), set(&peft[key]), "{key}");
    }
    for key in ["rank_pattern", "alpha_pattern", "r", "lora_alpha"] {
        assert_eq!(ours[key], peft[key], "{key}");
    }
    // Neither the shared experts' nor the dense layer's projections.
    let saved = read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
    assert!(
        saved
            .iter()
            .all(|(k, _)| !k.contains("_proj.lora") || k.contains("self_attn")),
        "{:?}",
        saved.iter().map(|(k, _)| k).collect::<Vec<_>>()
    );
    let line = one_line_error(&train(&tmp.join("half"), Some("q_proj,gate_proj")));
    assert!(line.contains("gate_proj and up_proj"), "{line}");
    std::fs::remove_dir_all(tmp).unwrap();
}
