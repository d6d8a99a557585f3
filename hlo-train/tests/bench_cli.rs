//! `hlo-train bench`: the JSON object's figures agree with each other and
//! with a FLOP count made here from the config's dimensions; presets,
//! `--config` and `--checkpoint` all run; bad input is one line.

mod common;

use common::*;

use serde_json::Value;

fn bench_json(args: &[&str]) -> Value {
    let mut all = vec!["bench", "--json", "--steps", "3", "--warmup-steps", "1"];
    all.extend_from_slice(args);
    let out = hlo_train(&all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    serde_json::from_str(text.trim()).unwrap()
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("`{key}` missing in {v}"))
}

/// One LoRA step's FLOPs for the fixture config, counted per projection:
/// forward 2 per weight and token plus attention's `4·L·s·H·d`, backward the
/// same again for activations, and 6 per LoRA weight and token.
fn fixture_lora_flops(batch: f64, seq: f64, rank: f64) -> f64 {
    let config: Value =
        serde_json::from_slice(&std::fs::read(fixture("gqa_llama3").join("config.json")).unwrap())
            .unwrap();
    let g = |k: &str| config[k].as_f64().unwrap();
    let (h, i, l, v) = (
        g("hidden_size"),
        g("intermediate_size"),
        g("num_hidden_layers"),
        g("vocab_size"),
    );
    let (nh, nkv, hd) = (
        g("num_attention_heads"),
        g("num_key_value_heads"),
        g("head_dim"),
    );
    // (in, out) of q, k, v, o, gate, up, down.
    let projections = [
        (h, nh * hd),
        (h, nkv * hd),
        (h, nkv * hd),
        (nh * hd, h),
        (h, i),
        (h, i),
        (i, h),
    ];
    let weights: f64 = projections.iter().map(|(a, b)| a * b).sum::<f64>() * l + h * v;
    let lora: f64 = projections.iter().map(|(a, b)| rank * (a + b)).sum::<f64>() * l;
    let forward = 2.0 * weights + 4.0 * l * seq * nh * hd;
    (2.0 * forward + 6.0 * lora) * batch * seq
}

#[test]
fn bench_json_figures_are_consistent() {
    let path = fixture("gqa_llama3").join("config.json");
    let v = bench_json(&[
        "--config",
        path.to_str().unwrap(),
        "--batch",
        "4",
        "--seq",
        "16",
        "--peak-tflops",
        "0.5",
    ]);
    let step = num(&v, "step_time_s");
    assert!(step > 0.0 && step < 10.0, "{v}");
    let tokens = num(&v, "tokens_per_s");
    assert!((tokens * step / 64.0 - 1.0).abs() < 1e-9, "{v}");
    let mfu = num(&v, "mfu");
    let expect = fixture_lora_flops(4.0, 16.0, 8.0) / step / 0.5e12;
    assert!((mfu / expect - 1.0).abs() < 1e-9, "mfu {mfu} vs {expect}");
    assert!(num(&v, "compile_s") > 0.0, "{v}");
    // The arguments alone hold every f32 weight of the model.
    let weights = 4.0
        * (128.0 * 32.0 * 2.0 + 2.0 * (32.0 * 32.0 * 2.0 + 32.0 * 16.0 * 2.0 + 3.0 * 32.0 * 64.0));
    assert!(num(&v, "peak_bytes") >= weights, "{v}");
    assert_eq!(v["mode"], "lora");
    assert_eq!(v["platform"], "cpu");
}

#[test]
fn bench_runs_presets_checkpoints_and_meshes() {
    let v = bench_json(&["--model", "tiny", "--batch", "8", "--seq", "16"]);
    assert!(num(&v, "tokens_per_s") > 0.0, "{v}");
    assert!(num(&v, "mfu") > 0.0 && num(&v, "mfu") < 1.5, "{v}");
    let v = bench_json(&[
        "--checkpoint",
        fixture("gqa_llama3").to_str().unwrap(),
        "--batch",
        "2",
        "--seq",
        "8",
        "--full",
    ]);
    assert_eq!(v["mode"], "full");
    let v = bench_json(&[
        "--model",
        "tiny",
        "--batch",
        "8",
        "--seq",
        "16",
        "--mesh",
        "dp=1,fsdp=2,mp=1",
        "--scan-layers",
        "on",
    ]);
    assert_eq!(v["mesh"], "dp=1,fsdp=2,mp=1");
    assert_eq!(v["scan_layers"], true);
}

#[test]
fn bench_bad_input_is_one_line() {
    for args in [
        vec!["bench", "--config", "/nonexistent/config.json"],
        vec!["bench", "--model", "tiny", "--batch", "0"],
        vec![
            "bench",
            "--model",
            "tiny",
            "--mesh",
            "dp=1,fsdp=3,mp=1",
            "--batch",
            "4",
        ],
    ] {
        let out = hlo_train(&args);
        let err = String::from_utf8_lossy(&out.stderr).trim_end().to_string();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}
