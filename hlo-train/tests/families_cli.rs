//! Qwen2, Qwen3, Mistral and Gemma 3 through the command line against
//! HF transformers and PyTorch+PEFT (fixtures made by
//! `scripts/make_family_fixtures.py`): greedy tokens of `generate` (KV
//! cache, sliding windows shorter than the prompt) equal HF's `generate`,
//! with and without a PEFT adapter; one SGD and one AdamW step from the
//! adapter equal PyTorch+PEFT's to 1e-6 on one device and on a 2×2×2
//! mesh of 8 virtual devices (Gemma's mixed layers also scanned); merging
//! the adapter gives its logits.

mod common;

use common::*;

const FAMILIES: [&str; 4] = ["qwen2", "qwen3", "mistral", "gemma3"];

/// On one device and on a 1×2×4 mesh of 8 virtual devices (weights by the
/// partition rules, biases over `mp`, the cache over K/V heads).
const MESHES: [&[&str]; 2] = [&[], &["--mesh", "dp=1,fsdp=2,mp=4", "--dtype", "f32"]];

#[test]
fn greedy_tokens_equal_hf_generate() {
    for name in FAMILIES {
        for mesh in MESHES {
            assert_greedy_equals_hf(&family(name), 7, 24, mesh);
        }
    }
}

#[test]
fn f32_prompt_logits_on_eight_devices_equal_hf() {
    let tmp = scratch("families", "mesh_logits");
    for name in FAMILIES {
        let dir = family(name);
        let input = fixture_tensor(&dir, "expected.safetensors", "input_ids");
        let prompt = ids(&input)[..input.ty.dims[1] as usize].join(",");
        let out = tmp.join(format!("{name}.safetensors"));
        for (adapter, key) in [
            (None, "logits"),
            (Some(dir.join("adapter")), "logits_adapter"),
        ] {
            let got = dump_logits(&dir, adapter.as_deref(), &prompt, &out, MESHES[1]);
            let all = fixture_tensor(&dir, "expected.safetensors", key).to_f64s();
            let want = &all[..got.len()];
            let d = max_diff(&got, want);
            // f32 rounding, relative to the logits' size (up to ~6 here):
            // the 8 devices sum their partial products in another order
            // than HF, and XLA's CPU code differs between machines (one
            // passed 1e-5, another gave 1.27e-5 for qwen2's adapter logits
            // every run, about 18 f32 ulps at that size).
            let scale = want.iter().fold(1f64, |m, x| m.max(x.abs()));
            assert!(
                d < 4e-6 * scale,
                "{name} {key} on 8 devices: logits differ by {d:e} (largest logit {scale})"
            );
        }
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

/// One step of `opt` from the fixture's adapter: see [`step_equals_pytorch`].
fn one_step_equals_peft(name: &str, opt: &str, extra: &[&str]) {
    std::fs::remove_dir_all(step_equals_pytorch(&family(name), opt, extra)).unwrap();
}

#[test]
fn one_sgd_and_one_adamw_step_equal_pytorch_peft_on_one_device() {
    for name in FAMILIES {
        for opt in ["sgd", "adamw"] {
            one_step_equals_peft(name, opt, &[]);
        }
    }
}

#[test]
fn one_sgd_and_one_adamw_step_equal_pytorch_peft_on_eight_devices() {
    for name in FAMILIES {
        for opt in ["sgd", "adamw"] {
            one_step_equals_peft(name, opt, &["--mesh", "dp=2,fsdp=2,mp=2"]);
        }
    }
}

#[test]
fn scanned_layers_train_as_pytorch_peft_does() {
    // Gemma's local and global layers in one scan; Qwen2's biases stacked.
    for name in ["gemma3", "qwen2"] {
        one_step_equals_peft(name, "sgd", &["--scan-layers", "on"]);
    }
    one_step_equals_peft(
        "gemma3",
        "adamw",
        &["--scan-layers", "on", "--mesh", "dp=2,fsdp=2,mp=2"],
    );
}

#[test]
fn blockwise_attention_and_a_chunked_loss_train_as_pytorch_peft_does() {
    // Blocks of one token (every window and the diagonal cut blocks) and
    // one position of each row per loss chunk; then Gemma scanned on a
    // mesh with one block of the whole row.
    let blocks = [
        "--attention",
        "blockwise",
        "--attention-block",
        "1",
        "--loss-chunk",
        "1",
    ];
    for name in FAMILIES {
        one_step_equals_peft(name, "sgd", &blocks);
    }
    let llama = fixture("gqa_llama3");
    let blocks_of_3 = ["--attention-block", "3", "--loss-chunk", "3"];
    std::fs::remove_dir_all(step_equals_pytorch(&llama, "sgd", &blocks_of_3)).unwrap();
    one_step_equals_peft(
        "gemma3",
        "adamw",
        &[
            "--attention",
            "blockwise",
            "--scan-layers",
            "on",
            "--mesh",
            "dp=2,fsdp=2,mp=2",
        ],
    );
}

#[test]
fn merged_adapters_give_the_adapters_logits() {
    let tmp = scratch("families", "merge");
    for name in FAMILIES {
        assert_merge_gives_adapter_logits(&family(name), &tmp, 1e-5);
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn plan_bench_and_dump_hlo_take_every_family() {
    let dir = scratch("families", "tools");
    for name in FAMILIES {
        // Scope names follow the family's module tree.
        let marks: &[&str] = match name {
            "qwen3" => &["self_attn.q_norm"],
            "gemma3" => &["pre_feedforward_layernorm", "self_attn.k_norm"],
            _ => &["self_attn.q_proj"],
        };
        assert_tools_take(&family(name), marks, &dir);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn help_lists_every_preset() {
    let help = ok(&hlo_train(&["train", "--help"]));
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for preset in hlo_engine::models::decoder::PRESETS {
        assert!(flat.contains(preset), "--help does not name `{preset}`");
    }
}
