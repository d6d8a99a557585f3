//! `hlo-train train`: one step against PyTorch+PEFT, the demo learning,
//! resume, a sharded run, and the error paths.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hlo_models::io::read_safetensors;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/llama/gqa_llama3")
}

fn hlo_train(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hlo-train"))
        .args(args)
        .env_remove("HLO_TRAIN_PLUGIN")
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn one_line_error(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).trim_end().to_string();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    err
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hlo-train-train-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The fixture's two rows of input ids as `{"input_ids"}` JSONL.
fn fixture_rows(dir: &Path) -> PathBuf {
    let expected = read_safetensors(&fixture().join("expected.safetensors")).unwrap();
    let ids = expected
        .iter()
        .find(|(k, _)| k == "input_ids")
        .unwrap()
        .1
        .to_i128s();
    let lines: Vec<String> = ids
        .chunks(9)
        .map(|r| serde_json::json!({ "input_ids": r }).to_string())
        .collect();
    let path = dir.join("rows.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

fn losses(metrics: &Path) -> Vec<f64> {
    metric(metrics, "loss")
        .into_iter()
        .map(|(_, v)| v)
        .collect()
}

/// (step, value) of every metrics line that has `key` (train lines have
/// `loss`, eval lines `eval_loss`).
fn metric(metrics: &Path, key: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["step"].as_u64()?, v[key].as_f64()?)))
        .collect()
}

#[test]
fn one_step_from_a_peft_adapter_equals_pytorch_peft() {
    let dir = scratch("onestep");
    let data = fixture_rows(&dir);
    let want = read_safetensors(&fixture().join("train_step.safetensors")).unwrap();
    for (opt, lr) in [("sgd", "0.05"), ("adamw", "1e-3")] {
        let out = dir.join(opt);
        let metrics = dir.join(format!("{opt}.jsonl"));
        ok(&hlo_train(&[
            "train",
            "--checkpoint",
            fixture().to_str().unwrap(),
            "--init-adapter",
            fixture().join("adapter").to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--batch",
            "2",
            "--seq",
            "9",
            "--steps",
            "1",
            "--optimizer",
            opt,
            "--lr",
            lr,
            "--clip-norm",
            "0",
            "--out",
            out.to_str().unwrap(),
            "--metrics",
            metrics.to_str().unwrap(),
            "--eval-data",
            data.to_str().unwrap(),
        ]));
        let loss = want
            .iter()
            .find(|(k, _)| k == &format!("{opt}.loss"))
            .unwrap()
            .1
            .to_f64s()[0];
        let first = losses(&metrics)[0];
        assert!(
            (first - loss).abs() < 1e-5,
            "{opt}: first loss {first}, PyTorch {loss}"
        );
        // The eval step on the same rows before training: PyTorch's loss too.
        let eval = metric(&metrics, "eval_loss");
        assert_eq!(eval[0].0, 0);
        assert!(
            (eval[0].1 - loss).abs() < 1e-5,
            "{opt}: eval {eval:?}, PyTorch {loss}"
        );
        assert_eq!(eval.last().unwrap().0, 1);
        let ours = read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
        assert_eq!(ours.len(), 28);
        for (key, t) in ours {
            let theirs = &want
                .iter()
                .find(|(k, _)| k == &format!("{opt}.{key}"))
                .unwrap_or_else(|| panic!("{key}"))
                .1;
            let d = t
                .to_f64s()
                .iter()
                .zip(theirs.to_f64s())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(d < 1e-4, "{opt} {key}: differs by {d}");
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

const DEMO: [&str; 14] = [
    "train",
    "--batch",
    "16",
    "--seq",
    "16",
    "--lr",
    "3e-3",
    "--schedule",
    "cosine",
    "--warmup",
    "20",
    "--lora-rank",
    "16",
    "--lora-alpha",
];

#[test]
fn the_demo_learns() {
    let dir = scratch("demo");
    let metrics = dir.join("m.jsonl");
    let mut args = DEMO.to_vec();
    args.extend([
        "32",
        "--steps",
        "400",
        "--log-every",
        "100",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    let out = ok(&hlo_train(&args));
    assert!(out.contains("before: ") && out.contains("after: "), "{out}");
    let l = losses(&metrics);
    assert_eq!(l.len(), 400);
    assert!(l[399] < l[0] * 0.5, "loss {} -> {}", l[0], l[399]);
    // The held-out demo draw is evaluated every 100 steps and falls too.
    let eval = metric(&metrics, "eval_loss");
    let steps: Vec<u64> = eval.iter().map(|e| e.0).collect();
    assert_eq!(steps, [0, 100, 200, 300, 400]);
    assert!(eval[4].1 < eval[0].1 * 0.5, "eval loss {eval:?}");
    assert!(out.contains("eval    400/400 eval_loss"), "{out}");
    // Every train line has the promised fields.
    let first: serde_json::Value = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v.get("eval_loss").is_none())
        .unwrap();
    for k in [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_s",
        "mfu",
    ] {
        assert!(first.get(k).is_some(), "{k}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn remat_and_scan_keep_the_losses() {
    let dir = scratch("remat");
    let run = |name: &str, extra: &[&str]| {
        let metrics = dir.join(format!("{name}.jsonl"));
        let mut a: Vec<&str> = DEMO.to_vec();
        a.extend(["16", "--steps", "4", "--metrics", metrics.to_str().unwrap()]);
        a.extend(extra);
        ok(&hlo_train(&a));
        losses(&metrics)
    };
    let plain = run("plain", &["--remat", "none"]);
    assert_eq!(plain.len(), 4);
    for (name, extra) in [
        ("remat", &["--remat", "layers"][..]),
        ("scan", &["--scan-layers", "on"][..]),
    ] {
        let other = run(name, extra);
        for (a, b) in plain.iter().zip(&other) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "{name}: {plain:?} vs {other:?}"
            );
        }
    }
}

#[test]
fn resume_reproduces_the_losses_exactly() {
    let dir = scratch("resume");
    // Packed rows too: the data cursor then counts samples, not rows.
    for packing in ["off", "on"] {
        let common = |steps: &str| {
            let mut a: Vec<String> = DEMO.iter().map(|s| s.to_string()).collect();
            a.extend(
                ["32", "--steps", steps, "--packing", packing]
                    .iter()
                    .map(|s| s.to_string()),
            );
            a
        };
        let run = |extra: &[&str], steps: &str| {
            let mut a = common(steps);
            a.extend(extra.iter().map(|s| s.to_string()));
            let refs: Vec<&str> = a.iter().map(String::as_str).collect();
            ok(&hlo_train(&refs));
        };
        let (whole, first, second) = (
            dir.join(format!("whole_{packing}.jsonl")),
            dir.join(format!("first_{packing}.jsonl")),
            dir.join(format!("second_{packing}.jsonl")),
        );
        let out = dir.join(format!("out_{packing}"));
        run(&["--metrics", whole.to_str().unwrap()], "8");
        run(
            &[
                "--metrics",
                first.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
            "4",
        );
        run(
            &[
                "--metrics",
                second.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--resume",
                out.to_str().unwrap(),
            ],
            "8",
        );
        let (w, a, b) = (losses(&whole), losses(&first), losses(&second));
        assert_eq!(a, w[..4], "{packing}");
        assert_eq!(b, w[4..], "{packing}");
    }
    let common = |steps: &str| {
        let mut a: Vec<String> = DEMO.iter().map(|s| s.to_string()).collect();
        a.extend(["32", "--steps", steps].iter().map(|s| s.to_string()));
        a
    };
    let out = dir.join("out_off");
    // A resume with other flags is refused.
    let mut bad = common("8");
    bad.extend([
        "--resume".to_string(),
        out.to_str().unwrap().to_string(),
        "--seed".to_string(),
        "5".to_string(),
    ]);
    let refs: Vec<&str> = bad.iter().map(String::as_str).collect();
    let err = one_line_error(&hlo_train(&refs));
    assert!(
        err.contains("the run was saved with seed = 0, this run has 5"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_2_4_1_mesh_gives_the_single_device_losses() {
    let dir = scratch("mesh");
    let (one, eight) = (dir.join("one.jsonl"), dir.join("eight.jsonl"));
    let base = [
        "train", "--batch", "8", "--seq", "16", "--steps", "3", "--lr", "3e-3",
    ];
    let mut a = base.to_vec();
    a.extend(["--metrics", one.to_str().unwrap()]);
    ok(&hlo_train(&a));
    let mut b = base.to_vec();
    b.extend([
        "--mesh",
        "dp=2,fsdp=4,mp=1",
        "--metrics",
        eight.to_str().unwrap(),
    ]);
    let out = ok(&hlo_train(&b));
    assert!(out.contains("dp=2,fsdp=4,mp=1"), "{out}");
    for (x, y) in losses(&one).iter().zip(losses(&eight)) {
        assert!(((x - y) / x).abs() < 1e-4, "{x} vs {y}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_input_gives_one_clear_line() {
    let dir = scratch("errors");
    let data = dir.join("bad.jsonl");
    let cases: [(&str, &str); 5] = [
        ("{\"text\": \"ok\"}\nnot json\n", "bad.jsonl:2: not JSON"),
        ("{\"text\": \"ok\"}\n\n", "bad.jsonl:2: empty line"),
        (
            "{\"question\": \"no\"}\n",
            "bad.jsonl:1: expected {\"text\"}",
        ),
        (
            "{\"input_ids\": [1, 9999]}\n",
            "bad.jsonl:1: token id 9999 is outside the vocabulary (size 264)",
        ),
        ("{\"prompt\": \"a\"}\n", "bad.jsonl:1: expected"),
    ];
    for (content, want) in cases {
        std::fs::write(&data, content).unwrap();
        let err = one_line_error(&hlo_train(&[
            "train",
            "--data",
            data.to_str().unwrap(),
            "--steps",
            "1",
        ]));
        assert!(err.contains(want), "{err} (wanted {want})");
    }
    for (args, want) in [
        (
            vec!["--lora-rank", "0"],
            "invalid value '0' for '--lora-rank",
        ),
        (vec!["--lr=-1"], "invalid value '-1' for '--lr"),
        (vec!["--lr", "0"], "--lr must be positive"),
        (
            vec!["--clip-norm", "inf"],
            "invalid value 'inf' for '--clip-norm",
        ),
        (vec!["--seq", "1"], "--seq must be at least 2"),
        (vec!["--save-every", "2"], "--save-every needs --out"),
        (
            vec!["--data", "/nonexistent.jsonl"],
            "cannot read /nonexistent.jsonl",
        ),
        (
            vec!["--mesh", "dp=1,fsdp=3,mp=1"],
            "does not divide over fsdp (3 parts)",
        ),
        (vec!["--resume", "/nonexistent"], "has no train_state/"),
        (
            vec!["--lora-targets", "q_proj,qkv"],
            "unknown LoRA target `qkv`",
        ),
    ] {
        let mut a = vec!["train", "--steps", "1", "--batch", "2"];
        if !args.contains(&"--seq") {
            a.extend(["--seq", "8"]);
        }
        a.extend(args);
        let err = one_line_error(&hlo_train(&a));
        assert!(err.contains(want), "{err} (wanted {want})");
    }
    // A diverging run stops at the first non-finite loss, naming the step.
    let err = one_line_error(&hlo_train(&[
        "train",
        "--steps",
        "5",
        "--batch",
        "2",
        "--seq",
        "8",
        "--optimizer",
        "sgd",
        "--lr",
        "1e30",
        "--clip-norm",
        "0",
    ]));
    assert!(err.contains("step ") && err.contains("stopped"), "{err}");
    // Eager with --trace-values names the first op that made a non-finite
    // value, and the last good checkpoint stays.
    let out = dir.join("diverged");
    let err = one_line_error(&hlo_train(&[
        "train",
        "--steps",
        "5",
        "--batch",
        "2",
        "--seq",
        "8",
        "--optimizer",
        "sgd",
        "--lr",
        "1e30",
        "--clip-norm",
        "0",
        "--eager",
        "--trace-values",
        ".",
        "--out",
        out.to_str().unwrap(),
        "--save-every",
        "1",
    ]));
    assert!(
        err.contains("step 2: the first non-finite value comes from `dot_general` in scope `model.layers.0.self_attn`")
            && err.contains("the last saved checkpoint is kept"),
        "{err}"
    );
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("train_state/state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 1);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn eager_training_and_value_tracing() {
    let out = ok(&hlo_train(&[
        "train",
        "--eager",
        "--batch",
        "4",
        "--seq",
        "8",
        "--steps",
        "2",
        "--trace-values",
        r"layers\.0\.mlp$",
    ]));
    assert!(out.contains("trace model.layers.0.mlp"), "{out}");
    assert!(out.contains("non-finite 0"), "{out}");
    assert!(
        out.contains("eager: ") && out.contains("op cache hit rate"),
        "{out}"
    );
    // Tracing values needs eager mode; a bad regex is one clear line.
    let err = one_line_error(&hlo_train(&["train", "--trace-values", "x"]));
    assert!(err.contains("--eager"), "{err}");
    let err = one_line_error(&hlo_train(&[
        "train",
        "--eager",
        "--trace-values",
        "(",
        "--steps",
        "1",
    ]));
    assert!(err.contains("is not a regex"), "{err}");
}

#[test]
fn eager_generation_equals_jit() {
    let dir = fixture();
    let args = [
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
    ];
    let jit = ok(&hlo_train(&args));
    let mut eager_args = args.to_vec();
    eager_args.push("--eager");
    assert_eq!(ok(&hlo_train(&eager_args)), jit);
}

/// Metrics rows as (step, loss).
fn step_losses(metrics: &Path) -> Vec<(u64, f64)> {
    metric(metrics, "loss")
}

#[test]
fn sigkill_mid_save_leaves_a_resumable_checkpoint() {
    let dir = scratch("kill");
    let out = dir.join("out");
    let args = |steps: &str, metrics: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = DEMO.iter().map(|s| s.to_string()).collect();
        a.extend(["16", "--steps", steps, "--metrics"].map(String::from));
        a.push(metrics.to_str().unwrap().into());
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let whole = dir.join("whole.jsonl");
    ok(&hlo_train(
        &args("400", &whole, &[])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    ));
    let reference = step_losses(&whole);
    let saved = || {
        ["train_state", "train_state.old"]
            .iter()
            .any(|d| out.join(d).join("state.json").is_file())
    };
    // Saving after every step, the run spends most of its time saving: kill
    // it (SIGKILL) at several moments, resuming each time from what is on disk.
    let out_s = out.to_str().unwrap().to_string();
    for (k, delay_ms) in [0u64, 37, 110, 250].into_iter().enumerate() {
        let metrics = dir.join(format!("killed{k}.jsonl"));
        let mut extra = vec!["--out", &out_s, "--save-every", "1"];
        if saved() {
            extra.extend(["--resume", &out_s]);
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_hlo-train"))
            .args(args("400", &metrics, &extra))
            .env_remove("HLO_TRAIN_PLUGIN")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Once the run is in its loop (a few steps logged), a little later.
        for _ in 0..2400 {
            if step_losses(&metrics).len() >= 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
    }
    assert!(saved(), "no checkpoint survived the kills");
    // Finish from what is on disk: the losses are the uninterrupted run's.
    let last = dir.join("last.jsonl");
    ok(&hlo_train(
        &args("400", &last, &["--out", &out_s, "--resume", &out_s])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    ));
    let resumed = step_losses(&last);
    assert!(!resumed.is_empty() && resumed.last().unwrap().0 == 400);
    let first = resumed[0].0;
    assert!(first > 1, "nothing was kept from the killed runs");
    for (step, loss) in &resumed {
        let want = reference[*step as usize - 1];
        assert_eq!(want.0, *step);
        assert!(
            (loss - want.1).abs() <= 1e-6 * want.1.abs(),
            "step {step}: {loss} vs {}",
            want.1
        );
    }
}

#[test]
fn sigterm_saves_and_stops() {
    let dir = scratch("sigterm");
    let out = dir.join("out");
    let metrics = dir.join("m.jsonl");
    let mut a: Vec<String> = DEMO.iter().map(|s| s.to_string()).collect();
    a.extend(["16", "--steps", "100000", "--metrics"].map(String::from));
    a.push(metrics.to_str().unwrap().into());
    a.extend(["--out".into(), out.to_str().unwrap().into()]);
    let child = Command::new(env!("CARGO_BIN_EXE_hlo-train"))
        .args(&a)
        .env_remove("HLO_TRAIN_PLUGIN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for training to start, then ask it to stop.
    for _ in 0..600 {
        if step_losses(&metrics).len() > 5 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(
        stdout.contains("stopped by a signal after step"),
        "{stdout}"
    );
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("train_state/state.json")).unwrap())
            .unwrap();
    // The checkpoint is of the last step the metrics show.
    let last = step_losses(&metrics).last().unwrap().0;
    assert_eq!(state["step"].as_u64().unwrap(), last);
}

/// JSONL rows of random ids (`{"input_ids"}`) with these lengths.
fn random_rows(dir: &Path, lengths: impl Iterator<Item = u64>, seed: u64) -> PathBuf {
    let mut rng = seed;
    let lines: Vec<String> = lengths
        .map(|n| {
            let ids: Vec<u64> = (0..n)
                .map(|_| {
                    rng = rng
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (rng >> 33) % 128
                })
                .collect();
            serde_json::json!({ "input_ids": ids }).to_string()
        })
        .collect();
    let data = dir.join("rows.jsonl");
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    data
}

/// One SGD step (`train --steps 1 --optimizer sgd` with `args`): the
/// first loss, the updated adapter and stdout.
fn sgd_step(
    dir: &Path,
    name: &str,
    args: &[&str],
) -> (f64, Vec<(String, hlo_ir::Literal)>, String) {
    let out = dir.join(name);
    let metrics = dir.join(format!("metrics_{name}.jsonl"));
    let mut a = vec![
        "train",
        "--steps",
        "1",
        "--optimizer",
        "sgd",
        "--out",
        out.to_str().unwrap(),
    ];
    a.extend(["--metrics", metrics.to_str().unwrap()]);
    a.extend_from_slice(args);
    let stdout = ok(&hlo_train(&a));
    (
        losses(&metrics)[0],
        read_safetensors(&out.join("adapter_model.safetensors")).unwrap(),
        stdout,
    )
}

/// [`sgd_step`] on the fixture model from its PEFT adapter.
fn one_sgd_step(
    dir: &Path,
    data: &Path,
    name: &str,
    extra: &[&str],
) -> (f64, Vec<(String, hlo_ir::Literal)>, String) {
    let (model, adapter) = (fixture(), fixture().join("adapter"));
    let mut a = vec![
        "--checkpoint",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ];
    a.extend([
        "--init-adapter",
        adapter.to_str().unwrap(),
        "--lr",
        "0.05",
        "--clip-norm",
        "0",
    ]);
    a.extend_from_slice(extra);
    sgd_step(dir, name, &a)
}

/// The largest difference between two adapters' tensors.
fn max_diff(a: &[(String, hlo_ir::Literal)], b: &[(String, hlo_ir::Literal)]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|((_, x), (_, y))| {
            x.to_f64s()
                .into_iter()
                .zip(y.to_f64s())
                .map(|(p, q)| (p - q).abs())
                .collect::<Vec<_>>()
        })
        .fold(0.0, f64::max)
}

#[test]
fn grad_accum_4_of_batch_2_equals_batch_8() {
    let dir = scratch("accum");
    // Rows of different lengths, so the micro-batches count different
    // numbers of tokens: the loss must be normalised by all of them.
    let data = random_rows(&dir, (0..8).map(|r| 3 + r % 7), 7);
    let seq = ["--seq", "9"];
    let (_, whole, _) = one_sgd_step(
        &dir,
        &data,
        "whole",
        &[&seq[..], &["--batch", "8"]].concat(),
    );
    let start = read_safetensors(&fixture().join("adapter/adapter_model.safetensors")).unwrap();
    assert!(
        max_diff(&whole, &start) > 1e-3,
        "the step moved the adapter"
    );
    for (name, extra) in [
        ("accum", &["--batch", "2", "--grad-accum", "4"][..]),
        (
            "accum_mesh",
            &[
                "--batch",
                "2",
                "--grad-accum",
                "4",
                "--mesh",
                "dp=1,fsdp=2,mp=1",
            ][..],
        ),
    ] {
        let (_, accum, _) = one_sgd_step(&dir, &data, name, &[&seq[..], extra].concat());
        let d = max_diff(&whole, &accum);
        assert!(d < 1e-5, "{name}: {d}");
    }
}

#[test]
fn masked_user_turns_contribute_nothing() {
    let dir = scratch("chat");
    let chat = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat/llama_style");
    // Two conversations that differ only in a user turn after the last
    // reply: masked, and after everything learned, it can change nothing.
    let data = |name: &str, last: &str| {
        let line = serde_json::json!({"messages": [
            {"role": "user", "content": "cat="},
            {"role": "assistant", "content": "CAT"},
            {"role": "user", "content": last},
        ]});
        let p = dir.join(name);
        std::fs::write(&p, format!("{line}\n")).unwrap();
        p
    };
    let (a, b) = (data("a.jsonl", "thanks!"), data("b.jsonl", "no way?"));
    let run = |data: &Path, name: &str, extra: &[&str]| {
        let mut args = vec![
            "--data",
            data.to_str().unwrap(),
            "--chat-template",
            chat.to_str().unwrap(),
        ];
        args.extend(["--batch", "1", "--seq", "320", "--lr", "0.5"]);
        args.extend_from_slice(extra);
        let (loss, adapter, _) = sgd_step(&dir, name, &args);
        (loss, adapter)
    };
    let ((la, wa), (lb, wb)) = (run(&a, "a", &[]), run(&b, "b", &[]));
    assert!(la > 0.0, "the reply is learned");
    assert_eq!(la, lb);
    for ((k, x), (_, y)) in wa.iter().zip(&wb) {
        assert_eq!(x.to_f64s(), y.to_f64s(), "{k}");
    }
    // Learning the inputs too, the trailing turn counts.
    let (la, _) = run(&a, "a_all", &["--train-on-inputs"]);
    let (lb, _) = run(&b, "b_all", &["--train-on-inputs"]);
    assert_ne!(la, lb);
}

#[test]
fn a_packed_step_equals_the_unpacked_one() {
    let dir = scratch("packing");
    // Six samples of 3..8 tokens: 33 tokens, one packed row of 33 slots.
    let data = random_rows(&dir, 3..9, 11);
    let (lu, wu, _) = one_sgd_step(
        &dir,
        &data,
        "unpacked",
        &["--seq", "33", "--batch", "6", "--packing", "off"],
    );
    let (lp, wp, stdout) = one_sgd_step(
        &dir,
        &data,
        "packed",
        &["--seq", "33", "--batch", "1", "--packing", "on"],
    );
    assert!(
        stdout.contains("packing on: 100.0% of the slots hold real tokens"),
        "{stdout}"
    );
    assert!((lu - lp).abs() < 1e-5, "loss unpacked {lu}, packed {lp}");
    let d = max_diff(&wu, &wp);
    assert!(d < 1e-5, "adapters differ by {d}");
}
