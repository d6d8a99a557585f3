//! Qwen2, Qwen3, Mistral and Gemma 3 through the command line against
//! HF transformers and PyTorch+PEFT (fixtures made by
//! `scripts/make_family_fixtures.py`): greedy tokens of `generate` (KV
//! cache, sliding windows shorter than the prompt) equal HF's `generate`,
//! with and without a PEFT adapter; one SGD and one AdamW step from the
//! adapter equal PyTorch+PEFT's to 1e-6 on one device and on a 2×2×2
//! mesh of 8 virtual devices (Gemma's mixed layers also scanned); merging
//! the adapter gives its logits.

mod common;

use std::path::{Path, PathBuf};

use common::*;

use hlo_engine::ir::Literal;
use hlo_engine::models::io::read_safetensors;

const FAMILIES: [&str; 4] = ["qwen2", "qwen3", "mistral", "gemma3"];

fn family(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/families")
        .join(name)
}

fn tensor(name: &str, file: &str, key: &str) -> Literal {
    read_safetensors(&family(name).join(file))
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("{name}/{file}: no `{key}`"))
        .1
}

/// The fixture's rows of input ids as `{"input_ids"}` JSONL in `dir`.
fn rows(name: &str, dir: &Path) -> (PathBuf, i64, i64) {
    let ids = tensor(name, "expected.safetensors", "input_ids");
    let (b, s) = (ids.ty.dims[0], ids.ty.dims[1]);
    let lines: Vec<String> = ids
        .to_i128s()
        .chunks(s as usize)
        .map(|r| serde_json::json!({ "input_ids": r }).to_string())
        .collect();
    let path = dir.join(format!("{name}.jsonl"));
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    (path, b, s)
}

#[test]
fn greedy_tokens_equal_hf_generate() {
    for name in FAMILIES {
        for (adapter, key) in [(false, "greedy"), (true, "greedy_adapter")] {
            let want = ids(&tensor(name, "expected.safetensors", key));
            let dir = family(name);
            let adapter_dir = dir.join("adapter");
            let prompt = want[..7].join(",");
            let mut args = vec![
                "generate",
                "--checkpoint",
                dir.to_str().unwrap(),
                "--prompt-ids",
                &prompt,
                "--max-new-tokens",
                "24",
                "--ignore-eos",
                "--greedy",
            ];
            if adapter {
                args.extend(["--adapter", adapter_dir.to_str().unwrap()]);
            }
            let got = ok(&hlo_train(&args));
            assert_eq!(got.trim(), want[7..].join(","), "{name} {key}");
        }
    }
}

/// One step of `opt` from the fixture's adapter on its rows with `extra`
/// flags: the first loss and the trained adapter equal PyTorch+PEFT's.
fn one_step_equals_peft(name: &str, opt: &str, extra: &[&str]) {
    let tag = format!("{name}_{opt}_{}", extra.join("_").replace(['=', ','], "-"));
    let dir = scratch("families", &tag);
    let (data, batch, seq) = rows(name, &dir);
    let (out, metrics) = (dir.join("out"), dir.join("m.jsonl"));
    let lr = if opt == "sgd" { "0.05" } else { "1e-3" };
    let (batch, seq) = (batch.to_string(), seq.to_string());
    let (checkpoint, adapter) = (family(name), family(name).join("adapter"));
    let mut args = vec![
        "train",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--init-adapter",
        adapter.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--batch",
        &batch,
        "--seq",
        &seq,
        "--steps",
        "1",
        "--optimizer",
        opt,
        "--lr",
        lr,
        "--clip-norm",
        "0",
        "--dtype",
        "f32",
        "--out",
        out.to_str().unwrap(),
        "--metrics",
        metrics.to_str().unwrap(),
    ];
    args.extend(extra);
    ok(&hlo_train(&args));
    let want_loss = tensor(name, "train_step.safetensors", &format!("{opt}.loss")).to_f64s()[0];
    let loss = losses(&metrics)[0];
    assert!(
        (loss - want_loss).abs() < 1e-6,
        "{tag}: loss {loss}, PyTorch {want_loss}"
    );
    let ours = read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
    assert_eq!(
        ours.len(),
        2 * 7 * {
            let c: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(family(name).join("config.json")).unwrap(),
            )
            .unwrap();
            c["num_hidden_layers"].as_u64().unwrap() as usize
        }
    );
    let start = read_safetensors(&adapter.join("adapter_model.safetensors")).unwrap();
    let (mut worst, mut ill_conditioned) = (0.0f64, 0);
    for (key, t) in ours {
        let theirs = tensor(name, "train_step.safetensors", &format!("{opt}.{key}")).to_f64s();
        // PyTorch's gradient, from its SGD step (lr 0.05) off the same start.
        let p0 = &start.iter().find(|(k, _)| *k == key).unwrap().1.to_f64s();
        let sgd = tensor(name, "train_step.safetensors", &format!("sgd.{key}")).to_f64s();
        for (i, (ours, theirs)) in t.to_f64s().into_iter().zip(theirs).enumerate() {
            let g = (p0[i] - sgd[i]) / 0.05;
            // AdamW's first step moves a parameter by lr·g/(|g| + 1e-8):
            // where the gradient nearly cancels, f32 rounding of g (~1e-8,
            // reduction order) becomes ~1e-6 of the update.
            let tol = if opt == "adamw" && g.abs() < 1e-5 {
                ill_conditioned += 1;
                1e-5
            } else {
                worst = worst.max((ours - theirs).abs());
                1e-6
            };
            let d = (ours - theirs).abs();
            assert!(
                d < tol,
                "{tag} {key}[{i}]: differs from PyTorch+PEFT by {d:e} (gradient {g:e})"
            );
        }
    }
    println!(
        "{tag}: loss differs by {:e}, parameters by {worst:e} ({ill_conditioned} with |g| < 1e-5 held to 1e-5)",
        (loss - want_loss).abs()
    );
    std::fs::remove_dir_all(dir).unwrap();
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
fn merged_adapters_give_the_adapters_logits() {
    let tmp = scratch("families", "merge");
    for name in FAMILIES {
        let input = tensor(name, "expected.safetensors", "input_ids");
        let row: Vec<String> = ids(&input)[..input.ty.dims[1] as usize].to_vec();
        let prompt = row.join(",");
        let all = tensor(name, "expected.safetensors", "logits_adapter").to_f64s();
        let want = &all[..all.len() / input.ty.dims[0] as usize];
        let with_adapter = dump_logits(
            &family(name),
            Some(&family(name).join("adapter")),
            &prompt,
            &tmp.join("a.safetensors"),
        );
        assert!(max_diff(&with_adapter, want) < 1e-5, "{name}");
        let merged = tmp.join(name);
        ok(&hlo_train(&[
            "merge",
            "--checkpoint",
            family(name).to_str().unwrap(),
            "--adapter",
            family(name).join("adapter").to_str().unwrap(),
            "--out",
            merged.to_str().unwrap(),
        ]));
        // The merged folder is the family's: its config kept.
        let model_type = |dir: &Path| {
            let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
            serde_json::from_str::<serde_json::Value>(&text).unwrap()["model_type"].clone()
        };
        assert_eq!(model_type(&merged), model_type(&family(name)), "{name}");
        let got = dump_logits(&merged, None, &prompt, &tmp.join("m.safetensors"));
        let d = max_diff(&got, want);
        assert!(d < 1e-5, "{name} merged: logits differ by {d}");
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn plan_bench_and_dump_hlo_take_every_family() {
    let dir = scratch("families", "tools");
    for name in FAMILIES {
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
        // Scope names follow the family's module tree.
        let marks: &[&str] = match name {
            "qwen3" => &["self_attn.q_norm"],
            "gemma3" => &["pre_feedforward_layernorm", "self_attn.k_norm"],
            _ => &["self_attn.q_proj"],
        };
        for m in marks {
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

#[test]
fn help_lists_every_preset() {
    let help = ok(&hlo_train(&["train", "--help"]));
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for preset in hlo_engine::models::decoder::PRESETS {
        assert!(flat.contains(preset), "--help does not name `{preset}`");
    }
}
