//! `hlo-train plan` answers for the devices the user names: one device of
//! the target unless `--mesh` or `--devices` says otherwise, and a step
//! that does not fit exits 1 with the nearest settings that do, each of
//! which plans as fitting when run.

mod common;

use common::*;

use serde_json::Value;

/// The tiny step both tests plan: 3.6 MB on one device (naive attention
/// fixed: an H100's `auto` would plan cuDNN's, as blockwise).
const STEP: [(&str, &str); 4] = [
    ("--batch", "8"),
    ("--seq", "32"),
    ("--target", "h100"),
    ("--attention", "naive"),
];

/// `plan` with `STEP`'s flags, each replaced by `changes`' where they
/// name it, then the other changes.
fn plan_args(changes: &[(String, String)], extra: &[&str]) -> Vec<String> {
    let mut flags: Vec<(String, String)> = STEP
        .iter()
        .map(|(f, v)| (f.to_string(), v.to_string()))
        .collect();
    for (flag, value) in changes {
        match flags.iter_mut().find(|(f, _)| f == flag) {
            Some(kept) => kept.1 = value.clone(),
            None => flags.push((flag.clone(), value.clone())),
        }
    }
    let mut args = vec!["plan".to_string()];
    for (f, v) in flags {
        args.extend([f, v]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run(args: &[String]) -> std::process::Output {
    hlo_train(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// `--batch 4 --grad-accum 2` as flag and value pairs.
fn pairs(flags: &str) -> Vec<(String, String)> {
    let words: Vec<&str> = flags.split_whitespace().collect();
    words
        .chunks(2)
        .map(|p| {
            assert_eq!(p.len(), 2, "a flag without a value in `{flags}`");
            (p[0].to_string(), p[1].to_string())
        })
        .collect()
}

#[test]
fn without_a_mesh_the_plan_is_for_one_device_of_the_target() {
    // Not fitting, without the search: the report, then what does not fit.
    let out = run(&plan_args(
        &[],
        &["--device-memory", "0.003", "--no-suggestions"],
    ));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "mesh dp=1,fsdp=1,mp=1",
        "planned for one H100 (no --mesh or --devices given); --devices N plans N",
        "of 3.00 MB (--device-memory) on H100: does NOT fit",
        "does NOT fit on one H100 (3.58 MB of 3.00 MB).",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    assert!(!text.contains("Nearest settings"), "{text}");
    // With no time left to search, the settings are named, not planned.
    let out = run(&plan_args(
        &[],
        &["--device-memory", "0.003", "--search-seconds", "0.001"],
    ));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("None of the nearby settings planned fits;")
            && text.contains("were not planned for lack of time"),
        "{text}"
    );
    let err = stderr(&out);
    assert!(
        err.contains("--remat layers: not planned: its compile")
            && err.contains("would end past plan's 0s (--search-seconds)"),
        "{err}"
    );
    // Without --target: one device of the default target.
    let text = ok(&hlo_train(&["plan", "--batch", "8", "--seq", "32"]));
    assert!(
        text.contains("planned for one MI300X (no --mesh or --devices given)"),
        "{text}"
    );
    // --devices plans that many, unremarked.
    let text = ok(&run(&plan_args(&[], &["--devices", "2"])));
    assert!(
        text.contains("mesh dp=1,fsdp=2,mp=1") && !text.contains("planned for one"),
        "{text}"
    );
}

#[test]
fn a_step_that_does_not_fit_exits_1_with_settings_that_fit() {
    // 3.6 MB in 3 MB, with time to plan every setting however slow the
    // machine (the default 60 s is a user's wait, not a test's).
    let out = run(&plan_args(
        &[],
        &[
            "--device-memory",
            "0.003",
            "--search-seconds",
            "600",
            "--json",
        ],
    ));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["fits"], false);
    assert_eq!(v["mesh"], "dp=1,fsdp=1,mp=1");
    assert_eq!(v["device_memory_bytes"], 3_000_000);
    let suggestions = v["suggestions"].as_array().expect("a suggestions array");
    let flags: Vec<&str> = suggestions
        .iter()
        .map(|s| s["flags"].as_str().unwrap())
        .collect();
    assert!(flags.len() >= 4, "{v}");
    for want in [
        "--batch 4 --grad-accum 2",
        "--remat layers",
        "--quantize nf4",
    ] {
        assert!(flags.contains(&want), "{want} in {flags:?}");
    }
    assert!(flags.iter().any(|f| f.starts_with("--seq ")), "{flags:?}");
    assert!(
        flags.iter().any(|f| f.starts_with("--devices ")),
        "{flags:?}"
    );
    for s in suggestions {
        assert!(s["total_bytes"].as_u64().unwrap() <= 3_000_000, "{s}");
    }
    // Each suggestion, run, fits with the bytes the search planned.
    let runs: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = suggestions
            .iter()
            .map(|s| {
                let f = s["flags"].as_str().unwrap();
                let args = plan_args(&pairs(f), &["--device-memory", "0.003", "--json"]);
                scope.spawn(move || run(&args))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (s, out) in suggestions.iter().zip(&runs) {
        let again: Value = serde_json::from_str(&ok(out)).unwrap();
        assert_eq!(again["fits"], true, "{s}: {again}");
        assert_eq!(again["per_device"]["total_bytes"], s["total_bytes"], "{s}");
    }
}

#[test]
fn a_grpo_plan_counts_its_rollouts_and_suggests_only_what_grpo_takes() {
    // 16 completions (4 prompts × 4) of up to 8 tokens in rows of 32 on
    // the tiny model (2 layers, 2 KV heads of 16 dimensions, bf16 on an
    // H100): the generator prefills the 24 prompt tokens a row holds in a
    // bucket of 32 into a cache of 128 positions.
    let grpo = [
        "--objective",
        "grpo",
        "--num-generations",
        "4",
        "--max-completion-length",
        "8",
        "--json",
    ];
    let batch = [("--batch".to_string(), "16".to_string())];
    let v: Value = serde_json::from_str(&ok(&run(&plan_args(&batch, &grpo)))).unwrap();
    assert_eq!(v["objective"], "grpo");
    // The text names the GRPO step and its groups.
    let text = ok(&run(&plan_args(&batch, &grpo[..grpo.len() - 1])));
    assert!(
        text.contains("LoRA grpo step, batch 16 completions (4 prompts × 4) × seq"),
        "{text}"
    );
    let r = &v["rollout"];
    assert_eq!(
        (r["prompt_tokens"].as_i64(), r["cache_tokens"].as_i64()),
        (Some(32), Some(128))
    );
    let (k_and_v, layers, rows, heads, positions, dims, bf16) = (2, 2, 16, 2, 128, 16, 2);
    assert_eq!(
        r["cache_bytes"].as_u64(),
        Some(k_and_v * layers * rows * heads * positions * dims * bf16)
    );
    let total = v["per_device"]["total_bytes"].as_u64().unwrap();
    assert!(total >= r["total_bytes"].as_u64().unwrap(), "{v}");
    // Not fitting: whole groups of completions a step, never more
    // micro-batches (GRPO takes none).
    let mut tight = grpo.to_vec();
    tight.extend(["--device-memory", "0.003"]);
    let out = run(&plan_args(&batch, &tight));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let flags: Vec<String> = v["suggestions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["flags"].as_str().unwrap().to_string())
        .collect();
    assert!(
        !flags.iter().any(|f| f.contains("--grad-accum")),
        "{flags:?}"
    );
    for f in &flags {
        if let Some(b) = f.strip_prefix("--batch ") {
            assert_eq!(b.parse::<i64>().unwrap() % 4, 0, "{flags:?}");
        }
    }
    // GRPO's settings belong to GRPO.
    let err = stderr(&run(&plan_args(&[], &["--num-generations", "4"])));
    assert!(err.contains("they need --objective grpo"), "{err}");
}

/// The throughput a plan projects follows from its own figures: the
/// step's tokens over its compute time at peak (the bound), scaled by
/// `--mfu`, and 20 tokens a parameter of the model (the tiny one, 107840
/// parameters) over that rate.
#[test]
fn the_throughput_projection_follows_from_the_steps_compute() {
    let out = run(&plan_args(
        &pairs("--grad-accum 2"),
        &["--mfu", "0.5", "--json"],
    ));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let t = &v["throughput"];
    let compute_ms = v["communication_total"]["compute_ms"].as_f64().unwrap();
    let tokens = (8 * 2 * 32) as f64;
    assert_eq!(t["tokens_per_step"].as_f64(), Some(tokens));
    let bound = tokens / (compute_ms / 1e3);
    close(
        "bound",
        t["bound_tokens_per_s"].as_f64().unwrap(),
        bound,
        1e-12,
    );
    close(
        "at 50%",
        t["tokens_per_s"].as_f64().unwrap(),
        bound / 2.0,
        1e-12,
    );
    assert_eq!(t["budget_tokens"].as_f64(), Some(20.0 * 107840.0));
    let hours = 20.0 * 107840.0 / (bound / 2.0) / 3600.0;
    close("hours", t["budget_hours"].as_f64().unwrap(), hours, 1e-12);
    // Said in the report too.
    let text = ok(&run(&plan_args(&[], &[])));
    assert!(
        text.contains("throughput (256 tokens a step): at most"),
        "{text}"
    );
    assert!(text.contains("at 40% MFU (--mfu, assumed)"), "{text}");
}

/// The text and `--json` of `plan` say the same of the step's loss and
/// reference: KTO runs its reference's forward in the step (JSON
/// `"reference": "base"`, not null), DPO's precomputed reference is
/// named so in both, RLOO scores its reference outside the step, SFT has
/// none; the `plan:` line is the JSON's `model`, `training`, `loss`,
/// `batch`, `seq` and `mesh`.
#[test]
fn plan_text_and_json_agree_on_the_loss_and_its_reference() {
    for (objective, extra, reference, words) in [
        (
            "kto",
            None,
            Some("base"),
            " kto (with the reference's forward) step",
        ),
        (
            "dpo",
            Some("--precompute-ref"),
            Some("precomputed"),
            " dpo (reference precomputed) step",
        ),
        ("rloo", None, None, " rloo step"),
        ("sft", None, None, "LoRA step"),
    ] {
        let mut args = vec![
            "plan",
            "--model",
            "tiny",
            "--target",
            "cpu",
            "--batch",
            "4",
            "--seq",
            "16",
            "--objective",
            objective,
        ];
        args.extend(extra);
        let text = ok(&hlo_train(&args));
        args.push("--json");
        let v: Value = serde_json::from_str(&ok(&hlo_train(&args))).unwrap();
        assert_eq!(v["reference"].as_str(), reference, "{objective}: {v}");
        let line = text.lines().next().unwrap();
        assert!(line.contains(words), "{objective}: {line}");
        let loss = v["loss"]
            .as_str()
            .map_or(String::new(), |l| format!(" {l}"));
        let training = match v["training"].as_str().unwrap() {
            "lora" => "LoRA",
            other => other,
        };
        let want = format!(
            "plan: {} ({} parameters, {}), {training}{loss}",
            v["model"].as_str().unwrap(),
            v["parameters"],
            v["dtype"].as_str().unwrap()
        );
        assert!(
            line.starts_with(&want),
            "{objective}: {line} (JSON: {want})"
        );
        let shape = format!(
            "step, batch {} × seq {}, mesh {}",
            v["batch"].as_str().unwrap(),
            v["seq"],
            v["mesh"].as_str().unwrap()
        );
        assert!(line.contains(&shape), "{objective}: {line} (JSON: {shape})");
    }
}
