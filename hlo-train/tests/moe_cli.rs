//! Qwen3-MoE, Mixtral and gpt-oss through the command line against HF
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

const MODELS: [&str; 3] = ["qwen3_moe", "mixtral", "gpt_oss"];

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
    for name in MODELS {
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
            // model; our merged weights equal PEFT's within 6e-8).
            let tol = if name == "gpt_oss" { 2e-5 } else { 1e-5 };
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
    let input = fixture_tensor(&dir, "expected.safetensors", "input_ids");
    let rows: Vec<String> = input
        .to_i128s()
        .chunks(input.ty.dims[1] as usize)
        .map(|r| serde_json::json!({ "input_ids": r }).to_string())
        .collect();
    let data = tmp.join("rows.jsonl");
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let text = ok(&hlo_train(&[
        "train",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--lora-targets",
        "q_proj,gate_proj,mlp.experts.gate_up_proj,mlp.experts.down_proj",
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
    // layers' experts, no `gate_proj` but the dense layer's.
    assert!(
        text.contains("on experts.gate_up_proj,experts.down_proj (2 of 3 layers); q_proj; gate_proj (1 of 3 layers), training gate whole"),
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
    // wrapper deeper; gate_proj only in the dense layer 1.
    let layer0 = "base_model.model.model.layers.0.mlp.experts";
    for (key, dims) in [
        (format!("{layer0}.base_layer.lora_A.weight"), vec![16, 40]),
        (format!("{layer0}.base_layer.lora_B.weight"), vec![40, 16]),
        (format!("{layer0}.lora_A.weight"), vec![16, 20]),
        (format!("{layer0}.lora_B.weight"), vec![40, 16]),
        (
            "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight".into(),
            vec![2, 40],
        ),
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
