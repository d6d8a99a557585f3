//! QLoRA (`--quantize nf4`) through the command line against HF
//! transformers, PEFT and bitsandbytes (fixtures made by
//! `scripts/make_qlora_fixtures.py`): a tiny Llama's original f32 weights
//! quantized on load give the logits HF computes on the same weights after
//! bitsandbytes' NF4 round trip (with and without a PEFT adapter, with and
//! without double quantization, on one device and on a 1×2×2 mesh where
//! the codes and block scales are split as the weights are); one SGD and
//! one AdamW step of the adapter equal PyTorch+PEFT's on that base; the
//! checkpoints transformers saves in bitsandbytes' 4-bit format give the
//! same logits as quantizing on load.

mod common;

use std::path::PathBuf;

use common::*;
use hlo_engine::models::io::read_safetensors;

fn qlora(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/qlora")
        .join(name)
}

const MESH: [&str; 4] = ["--mesh", "dp=1,fsdp=2,mp=2", "--dtype", "f32"];

/// The fixture's first row of ids, as a prompt.
fn prompt() -> String {
    let input = fixture_tensor(&qlora("llama"), "expected.safetensors", "input_ids");
    ids(&input)[..input.ty.dims[1] as usize].join(",")
}

/// The first `got.len()` values of `file`'s `key` against `got`.
fn assert_logits(got: &[f64], file: &str, key: &str, what: &str) {
    let all = fixture_tensor(&qlora("llama"), file, key).to_f64s();
    let d = max_diff(got, &all[..got.len()]);
    assert!(
        d < 1e-5,
        "{what}: logits differ from {file}'s {key} by {d:e}"
    );
}

#[test]
fn nf4_logits_equal_hf_on_the_dequantized_weights() {
    let tmp = scratch("qlora", "logits");
    let out = tmp.join("logits.safetensors");
    let dir = qlora("llama");
    for mesh in [&[][..], &MESH[..]] {
        for (adapter, key) in [
            (None, "logits"),
            (Some(dir.join("adapter")), "logits_adapter"),
        ] {
            let mut extra = vec!["--quantize", "nf4"];
            extra.extend(mesh);
            let got = dump_logits(&dir, adapter.as_deref(), &prompt(), &out, &extra);
            assert_logits(&got, "expected.safetensors", key, &format!("{extra:?}"));
        }
    }
    let got = dump_logits(
        &dir,
        None,
        &prompt(),
        &out,
        &["--quantize", "nf4", "--double-quant"],
    );
    assert_logits(
        &got,
        "expected_double_quant.safetensors",
        "logits",
        "double quant",
    );
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn bitsandbytes_checkpoints_give_the_logits_of_quantizing_on_load() {
    let tmp = scratch("qlora", "bnb");
    let out = tmp.join("logits.safetensors");
    let on_load = dump_logits(
        &qlora("llama"),
        None,
        &prompt(),
        &out,
        &["--quantize", "nf4"],
    );
    let stored = dump_logits(&qlora("llama_bnb4bit"), None, &prompt(), &out, &[]);
    assert_eq!(
        stored, on_load,
        "the same codes and scales, the same program"
    );
    assert_logits(&stored, "expected_bnb.safetensors", "logits", "bnb 4-bit");
    // The flag changes nothing there, and cannot change how it is stored.
    let flagged = dump_logits(
        &qlora("llama_bnb4bit"),
        None,
        &prompt(),
        &out,
        &["--quantize", "nf4"],
    );
    assert_eq!(flagged, stored);
    let double = dump_logits(&qlora("llama_bnb4bit_dq"), None, &prompt(), &out, &[]);
    assert_logits(
        &double,
        "expected_bnb.safetensors",
        "logits_double_quant",
        "bnb 4-bit, double quant",
    );
    let refused = hlo_train(&[
        "generate",
        "--checkpoint",
        qlora("llama_bnb4bit_dq").to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--quantize",
        "nf4",
    ]);
    let line = one_line_error(&refused);
    assert!(line.contains("with double quantization"), "{line}");
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn one_step_on_the_nf4_base_equals_pytorch_peft() {
    for opt in ["sgd", "adamw"] {
        std::fs::remove_dir_all(step_equals_pytorch(
            &qlora("llama"),
            opt,
            &["--quantize", "nf4"],
        ))
        .unwrap();
    }
    // NF4 layers run as a scan unless told otherwise: unrolled too, on a
    // mesh that splits the codes and scales over fsdp and mp.
    let mut extra = vec!["--quantize", "nf4", "--scan-layers", "off"];
    extra.extend(["--mesh", "dp=1,fsdp=2,mp=2"]);
    std::fs::remove_dir_all(step_equals_pytorch(&qlora("llama"), "sgd", &extra)).unwrap();
}

#[test]
fn merging_a_qlora_adapter_writes_the_dequantized_base_plus_the_adapter_in_bf16() {
    let tmp = scratch("qlora", "merge");
    let adapter = qlora("llama").join("adapter");
    let (on_load, stored) = (tmp.join("on_load"), tmp.join("stored"));
    ok(&hlo_train(&[
        "merge",
        "--checkpoint",
        qlora("llama").to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--out",
        on_load.to_str().unwrap(),
        "--quantize",
        "nf4",
    ]));
    ok(&merge(&qlora("llama_bnb4bit"), &adapter, &stored));
    let a = read_safetensors(&on_load.join("model.safetensors")).unwrap();
    let b = read_safetensors(&stored.join("model.safetensors")).unwrap();
    let q = "model.layers.1.self_attn.q_proj.weight";
    let weight =
        |t: &[(String, hlo_engine::ir::Literal)]| t.iter().find(|(n, _)| n == q).unwrap().1.clone();
    assert_eq!(weight(&a).bytes, weight(&b).bytes, "the same NF4 base");
    // The merged projections hold bf16 values, as PEFT's, written (like
    // every tensor) in the dtype config.json names: the base's f32.
    let w = weight(&a);
    let rounded = hlo_engine::ir::Literal::from_f64s(
        w.ty.with_dtype(hlo_engine::ir::DType::BF16),
        &w.to_f64s(),
    );
    assert_eq!(rounded.to_f64s(), w.to_f64s(), "bf16 values");
    for (dir, tensors) in [(&on_load, &a), (&stored, &b)] {
        let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
        assert!(!config.contains("quantization_config"), "{config}");
        let json: serde_json::Value = serde_json::from_str(&config).unwrap();
        assert_eq!(json["dtype"], "float32", "{config}");
        for (name, t) in tensors.iter() {
            assert_eq!(t.ty.dtype, hlo_engine::ir::DType::F32, "{name}");
        }
    }
    // The merged model (bf16 projections, run in f32) gives the adapter's
    // logits on the NF4 base to within the rounding of its weights to bf16.
    let out = tmp.join("logits.safetensors");
    for dir in [&on_load, &stored] {
        let got = dump_logits(dir, None, &prompt(), &out, &["--dtype", "f32"]);
        let all =
            fixture_tensor(&qlora("llama"), "expected.safetensors", "logits_adapter").to_f64s();
        let d = max_diff(&got, &all[..got.len()]);
        assert!(d < 0.05, "{}: merged logits differ by {d:e}", dir.display());
        let base = fixture_tensor(&qlora("llama"), "expected.safetensors", "logits").to_f64s();
        assert!(
            max_diff(&got, &base[..got.len()]) > 0.2,
            "the adapter is folded in"
        );
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn the_8b_qlora_step_plans_into_a_24_gb_card() {
    let out = ok(&hlo_train(&[
        "plan",
        "--model",
        "llama3.1-8b",
        "--quantize",
        "nf4",
        "--batch",
        "1",
        "--seq",
        "4096",
        "--target",
        "rtx4090",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["mesh"], "dp=1,fsdp=1,mp=1", "batch 1: one device");
    assert_eq!(v["fits"], true, "{v}");
    // Llama 3.1 8B's projections: 32 layers of q, o (4096²), k, v (1024 ×
    // 4096) and gate, up, down (14336 × 4096), at 4 bits a value plus an
    // f32 per 64 values.
    let per_layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096;
    let values = 32u64 * per_layer;
    let want = values / 2 + values / 64 * 4;
    let p = &v["per_device"];
    assert_eq!(p["nf4_weights_bytes"].as_u64(), Some(want), "{p}");
    // The embeddings and the LM head stay in bf16.
    let rest = p["weights_bytes"].as_u64().unwrap() - want;
    assert_eq!(rest, 2 * 128256 * 4096 * 2 + (2 * 32 + 1) * 4096 * 2);
    assert!(p["total_bytes"].as_u64().unwrap() < 24_000_000_000);
}

#[test]
fn greedy_tokens_on_the_nf4_base_equal_hf_generate() {
    // Decoding through the KV cache: the decode program dequantizes too.
    assert_greedy_equals_hf(&qlora("llama"), 5, 16, &["--quantize", "nf4"]);
    // A bitsandbytes checkpoint, with the adapter trained on that base.
    let adapter = qlora("llama").join("adapter");
    for (adapter, key) in [
        (None, "greedy"),
        (Some(adapter.as_path()), "greedy_adapter"),
    ] {
        let want = ids(&fixture_tensor(
            &qlora("llama"),
            "expected.safetensors",
            key,
        ));
        let got = greedy_ids(
            &qlora("llama_bnb4bit"),
            adapter,
            &want[..5].join(","),
            16,
            &[],
        );
        let got: Vec<String> = got.iter().map(u64::to_string).collect();
        assert_eq!(got, want[5..], "bnb 4-bit {key}");
    }
}

/// What eval prints for `args` (with --json).
fn eval_loss(args: &[&str]) -> f64 {
    let mut a = vec!["eval", "--json"];
    a.extend(args);
    let v: serde_json::Value = serde_json::from_str(&ok(&hlo_train(&a))).unwrap();
    v["eval_loss"].as_f64().unwrap()
}

#[test]
fn a_qlora_runs_adapter_is_read_with_its_runs_settings_by_eval_generate_and_merge() {
    let dir = scratch("qlora", "eval");
    let (out, data, metrics) = (dir.join("run"), dir.join("rows.jsonl"), dir.join("m.jsonl"));
    let rows: Vec<String> = (0..6)
        .map(|r| {
            let ids: Vec<String> = (0..12)
                .map(|t| ((r * 31 + t * 7) % 128).to_string())
                .collect();
            format!("{{\"input_ids\": [{}]}}", ids.join(", "))
        })
        .collect();
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let (ckpt, out_s) = (qlora("llama"), out.to_str().unwrap().to_string());
    let (data_s, metrics_s) = (data.to_str().unwrap(), metrics.to_str().unwrap());
    let ckpt_s = ckpt.to_str().unwrap();
    let shape = ["--seq", "16", "--batch", "2"];
    let mut train = vec!["train", "--quantize", "nf4", "--steps", "3", "--lr", "1e-2"];
    train.extend(["--checkpoint", ckpt_s]);
    train.extend(shape);
    train.extend(["--data", data_s, "--eval-data", data_s, "--out", &out_s]);
    train.extend(["--metrics", metrics_s]);
    ok(&hlo_train(&train));
    let (step, want) = *metric(&metrics, "eval_loss").last().unwrap();
    assert_eq!(step, 3);
    let mut given = vec!["--adapter", &out_s, "--data", data_s];
    given.extend(shape);
    let mut flags = given.clone();
    flags.extend(["--checkpoint", ckpt_s, "--quantize", "nf4"]);
    let got = eval_loss(&flags);
    assert!(
        (got - want).abs() < 1e-5,
        "eval {got} against the run's {want}"
    );
    // Without them, the base (checkpoint and NF4) the run beside the
    // adapter was trained on, said on stderr.
    let default = eval_loss(&given);
    assert!(
        (default - want).abs() < 1e-5,
        "eval {default} against {want}"
    );
    let mut a = vec!["eval"];
    a.extend(&given);
    let e = stderr(&hlo_train(&a));
    assert!(
        e.contains("--quantize nf4") && e.contains("qlora/llama"),
        "{e}"
    );

    // generate: the same greedy tokens as with the flags repeated.
    let generate = |extra: &[&str]| {
        let mut a = vec!["generate", "--adapter", &out_s, "--prompt-ids", "1,5,9,13"];
        a.extend(["--max-new-tokens", "6"]);
        a.extend(extra);
        ok(&hlo_train(&a))
    };
    assert_eq!(
        generate(&[]),
        generate(&["--checkpoint", ckpt_s, "--quantize", "nf4"])
    );
    // merge: the run's checkpoint and NF4, byte for byte.
    let (m1, m2) = (dir.join("m1"), dir.join("m2"));
    ok(&hlo_train(&[
        "merge",
        "--adapter",
        &out_s,
        "--out",
        m1.to_str().unwrap(),
    ]));
    let mut a = vec!["merge", "--adapter", &out_s, "--out", m2.to_str().unwrap()];
    a.extend(["--checkpoint", ckpt_s, "--quantize", "nf4"]);
    ok(&hlo_train(&a));
    for f in ["model.safetensors", "config.json"] {
        assert_eq!(
            std::fs::read(m1.join(f)).unwrap(),
            std::fs::read(m2.join(f)).unwrap(),
            "{f}"
        );
    }
    // plan: the run's step from its recipe (NF4 base, rows of 16).
    let plan: serde_json::Value =
        serde_json::from_str(&ok(&hlo_train(&["plan", "--recipe", &out_s, "--json"]))).unwrap();
    assert_eq!(plan["seq"], 16, "{plan}");
    assert!(
        plan["per_device"]["nf4_weights_bytes"].as_u64().unwrap() > 0,
        "{plan}"
    );
    // Adapters of runs that differ in a setting not given are refused.
    let other = dir.join("other");
    let mut a = vec!["train", "--steps", "1", "--checkpoint", ckpt_s];
    a.extend(shape);
    a.extend(["--data", data_s, "--out", other.to_str().unwrap()]);
    ok(&hlo_train(&a));
    let mut a = vec!["generate", "--adapter", &out_s, "--adapter"];
    a.extend([other.to_str().unwrap(), "--prompt-ids", "1,5"]);
    let line = one_line_error(&hlo_train(&a));
    assert!(line.contains("differ in --quantize"), "{line}");
    a.extend(["--quantize", "nf4"]);
    ok(&hlo_train(&a));

    // An adapter without its run: the f32 base, another number.
    let bare = dir.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(out.join(f), bare.join(f)).unwrap();
    }
    let mut a = vec!["--adapter", bare.to_str().unwrap(), "--data", data_s];
    a.extend(["--checkpoint", ckpt_s]);
    a.extend(shape);
    assert!((eval_loss(&a) - want).abs() > 1e-4);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn nf4_bases_of_the_moe_families_equal_bitsandbytes() {
    // The nn.Linears bitsandbytes quantizes beyond q/k/v/o/gate/up/down
    // (scripts/make_qlora_moe_fixtures.py): Qwen2-MoE's one-row
    // shared_expert_gate, DeepSeek-V3's latent projections; the experts
    // and routers stay as they are, as transformers leaves them. Quantized
    // on load from the f32 weights: one SGD and one AdamW step equal
    // PyTorch+PEFT's on bitsandbytes' dequantized values, and greedy
    // tokens HF's, with and without the adapter.
    for name in ["qwen2_moe", "deepseek_v3"] {
        for opt in ["sgd", "adamw"] {
            let dir = step_equals_pytorch(&qlora(name), opt, &["--quantize", "nf4"]);
            std::fs::remove_dir_all(dir).unwrap();
        }
        assert_greedy_equals_hf(&qlora(name), 5, 16, &["--quantize", "nf4"]);
    }
    // The latent projections' codes and scales split over fsdp and mp.
    let extra = ["--quantize", "nf4", "--mesh", "dp=1,fsdp=2,mp=2"];
    let dir = step_equals_pytorch(&qlora("deepseek_v3"), "sgd", &extra);
    std::fs::remove_dir_all(dir).unwrap();
}
