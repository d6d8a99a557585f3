//! Qwen3-MoE and Mixtral through the command line against HF
//! transformers 5 and PyTorch+PEFT (fixtures made by
//! `scripts/make_moe_fixtures.py`): greedy tokens of `generate` equal HF's
//! `generate` with and without a PEFT adapter; one SGD and one AdamW step
//! of the adapter, with the router's load-balancing loss in the loss
//! (`output_router_logits`, coefficient 0.05), equal PyTorch+PEFT's to
//! 1e-6 on one device and on a 2×2×2 mesh of 8 virtual devices; merging
//! the adapter gives its logits.

mod common;

use common::*;

const MODELS: [&str; 2] = ["qwen3_moe", "mixtral"];

#[test]
fn greedy_tokens_equal_hf_generate() {
    for name in MODELS {
        for mesh in [&[][..], &["--mesh", "dp=1,fsdp=2,mp=4", "--dtype", "f32"]] {
            assert_greedy_equals_hf(&family(name), 7, 24, mesh);
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
fn merged_adapters_give_the_adapters_logits() {
    let tmp = scratch("moe", "merge");
    for name in MODELS {
        assert_merge_gives_adapter_logits(&family(name), &tmp, 1e-5);
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn plan_bench_and_dump_hlo_take_the_moe_families() {
    let dir = scratch("moe", "tools");
    for name in MODELS {
        let config = family(name).join("config.json");
        let config = config.to_str().unwrap();
        let mesh = ["--mesh", "dp=2,fsdp=2,mp=2", "--batch", "4", "--seq", "16"];
        let mut args = vec!["plan", "--config", config, "--json"];
        args.extend(mesh);
        let plan: serde_json::Value = serde_json::from_str(&ok(&hlo_train(&args))).unwrap();
        assert_eq!(plan["fits"], true, "{name}: {plan}");
        let out = dir.join(name);
        let mut args = vec![
            "dump-hlo",
            "--config",
            config,
            "--format",
            "stablehlo",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(mesh);
        ok(&hlo_train(&args));
        let text = std::fs::read_to_string(out.join("train_step.stablehlo.mlir")).unwrap();
        // Scope names follow HF's module tree: the router and the experts.
        for m in ["mlp.gate", "mlp.experts"] {
            assert!(text.contains(m), "{name}: no `{m}` in the program");
        }
        let checkpoint = family(name);
        let bench = ok(&hlo_train(&[
            "bench",
            "--checkpoint",
            checkpoint.to_str().unwrap(),
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--dtype",
            "f32",
            "--json",
        ]));
        let bench: serde_json::Value = serde_json::from_str(&bench).unwrap();
        assert!(
            bench["tokens_per_s"].as_f64().unwrap() > 0.0,
            "{name}: {bench}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}
