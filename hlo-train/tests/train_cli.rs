//! `hlo-train train`: one step against PyTorch+PEFT, the demo learning,
//! remat and scan, a sharded run, eager mode, and the error paths.

mod common;

use common::*;

use hlo_engine::models::io::read_safetensors;

#[test]
fn one_step_from_a_peft_adapter_equals_pytorch_peft() {
    let dir = scratch("train", "onestep");
    let data = fixture_rows(&dir);
    let want = read_safetensors(&fixture("gqa_llama3").join("train_step.safetensors")).unwrap();
    for opt in ["sgd", "adamw"] {
        let run = step_equals_pytorch(
            &fixture("gqa_llama3"),
            opt,
            &["--eval-data", data.to_str().unwrap()],
        );
        // The eval step on the same rows before training: PyTorch's loss too.
        let loss = want
            .iter()
            .find(|(k, _)| k == &format!("{opt}.loss"))
            .unwrap()
            .1
            .to_f64s()[0];
        let eval = metric(&run.join("m.jsonl"), "eval_loss");
        assert_eq!(eval[0].0, 0);
        assert!(
            (eval[0].1 - loss).abs() < 1e-5,
            "{opt}: eval {eval:?}, PyTorch {loss}"
        );
        assert_eq!(eval.last().unwrap().0, 1);
        std::fs::remove_dir_all(run).unwrap();
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_demo_learns() {
    let dir = scratch("train", "demo");
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
    assert!(
        out.contains("before:\n") && out.contains("after:\n"),
        "{out}"
    );
    // Each prompt on a line of its own: the trained adapter writes the
    // word in capitals.
    assert!(out.contains("  rust=    \"RUST\""), "{out}");
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
    let dir = scratch("train", "remat");
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
fn a_2_4_1_mesh_gives_the_single_device_losses() {
    let dir = scratch("train", "mesh");
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
    let dir = scratch("train", "errors");
    let data = dir.join("bad.jsonl");
    let cases: [(&str, &str); 5] = [
        ("{\"text\": \"ok\"}\nnot json\n", "bad.jsonl:2: not JSON"),
        (
            "{\"text\": \"ok\"}\n\n{\"input_ids\": [1, 2], \"labels\": [1]}\n",
            "bad.jsonl:3: labels has 1 entries, input_ids 2",
        ),
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
        (
            vec!["--clip-norm", "inf"],
            "invalid value 'inf' for '--clip-norm",
        ),
        (vec!["--seq", "1"], "invalid value '1' for '--seq"),
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
            && err.contains("(the checkpoint of step 1 is kept)"),
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
    let dir = fixture("gqa_llama3");
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

#[test]
fn a_run_says_what_it_keeps() {
    // No --out: nothing is kept, and the run says so.
    let text = ok(&hlo_train(&[
        "train", "--steps", "2", "--batch", "2", "--seq", "8",
    ]));
    assert!(text.contains("nothing saved (no --out)"), "{text}");
    // A loss that turns non-finite before anything was saved claims no
    // checkpoint.
    let dir = scratch("train", "kept");
    let out = dir.join("run");
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
        "--out",
        out.to_str().unwrap(),
    ]));
    assert!(err.contains("is NaN") || err.contains("is inf"), "{err}");
    assert!(err.ends_with("(no checkpoint was saved)"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}
