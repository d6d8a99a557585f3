//! The tiny model's LoRA step compiled by XLA's own GPU compilers, with
//! no GPU (`make setup-targets` installs them into `.plugins/`): for one
//! H100 and for 2 × MI300X by `plan`, and for 2 × H100 and one MI300X by
//! `dump-hlo --optimized`. The GPU program's arguments are the step's
//! state and batch, byte for byte what the CPU compile of the same
//! program takes; without the compiler `plan` falls back to that CPU
//! compile and says what to install.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value;

/// The installed compilers (`make setup-targets`), which these tests
/// need: they fail, not skip, without them.
fn compilers() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.plugins");
    for plugin in ["cuda/xla_cuda_plugin.so", "rocm/xla_rocm_plugin.so"] {
        assert!(
            dir.join(plugin).is_file(),
            "{plugin} is not installed: run `make setup-targets`"
        );
    }
    dir
}

const STEP: [&str; 6] = ["--batch", "4", "--seq", "64", "--lora-rank", "8"];

fn plan(extra: &[&str], compilers: &Path) -> std::process::Output {
    let mut args = vec!["plan"];
    args.extend(STEP);
    args.extend(extra);
    hlo_train_env(&args, &[("HLO_TRAIN_COMPILERS", compilers)])
}

fn xla(v: &Value, field: &str) -> u64 {
    v["per_device"]["xla"][field].as_u64().expect(field)
}

#[test]
fn plan_compiles_the_step_for_an_h100_and_two_mi300x() {
    let dir = compilers();
    let gpu: Value = serde_json::from_str(&ok(&plan(&["--target", "h100", "--json"], &dir)))
        .expect("one JSON object");
    let by = &gpu["compiled_by"];
    assert_eq!(by["target_compiler"], true, "{gpu}");
    assert_eq!(by["compiler"], "XLA's CUDA compiler for one H100", "{gpu}");
    // The same step compiled on the CPU plugin, the compiler missing.
    let out = plan(&["--target", "h100", "--json"], Path::new(NO_COMPILERS));
    let cpu: Value = serde_json::from_str(&ok(&out)).expect("one JSON object");
    assert_eq!(cpu["compiled_by"]["target_compiler"], false);
    let fallback = cpu["compiled_by"]["fallback"].as_str().expect("why not");
    assert!(fallback.contains("run `make setup-targets`"), "{fallback}");
    // Arguments are the program's parameters: the same bytes whichever
    // compiler, and at least the state the plan counts.
    assert_eq!(xla(&gpu, "argument_bytes"), xla(&cpu, "argument_bytes"));
    let p = &gpu["per_device"];
    let state: u64 = ["weights_bytes", "lora_bytes", "optimizer_bytes"]
        .iter()
        .map(|k| p[k].as_u64().unwrap())
        .sum();
    assert!(xla(&gpu, "argument_bytes") >= state, "{p}");
    assert!(xla(&gpu, "temp_bytes") > 0, "{p}");
    assert!(gpu["policy_estimate_bytes"].as_u64().is_some());
    // Text: which figure decided the fit, and the fallback said.
    let text = ok(&plan(&["--target", "h100"], Path::new(NO_COMPILERS)));
    assert!(
        text.contains("the fit is decided by the CPU compile standing in for the H100"),
        "{text}"
    );
    // A broken install (a plugin file that is none): the CPU stands in,
    // and the plan says how to install the compiler again.
    let broken = tempfile_dir("broken_compilers");
    std::fs::create_dir_all(broken.join("cuda")).unwrap();
    std::fs::write(broken.join("cuda/xla_cuda_plugin.so"), "not a plugin").unwrap();
    let v: Value = serde_json::from_str(&ok(&plan(&["--target", "h100", "--json"], &broken)))
        .expect("one JSON object");
    let why = v["compiled_by"]["fallback"].as_str().expect("why not");
    assert!(
        why.contains("does not load")
            && why.contains("run `make setup-targets` to install it again"),
        "{why}"
    );
    // An SPMD step over 2 × MI300X (gfx942).
    let text = ok(&plan(&["--target", "mi300x", "--devices", "2"], &dir));
    assert!(
        text.contains("compiled by XLA's ROCm compiler for 2 × MI300X")
            && text.contains("the fit is decided by XLA's own figure for the MI300X"),
        "{text}"
    );
}

#[test]
fn dump_hlo_writes_what_the_gpu_compiler_optimized() {
    let dir = compilers();
    let out_dir = tempfile_dir("dump_optimized");
    let run = |target: &str, devices: &str| {
        let mut args = vec!["dump-hlo", "--target", target, "--optimized", "--devices"];
        args.push(devices);
        args.extend(STEP);
        let out = out_dir.to_str().unwrap();
        args.extend(["--out", out]);
        ok(&hlo_train_env(&args, &[("HLO_TRAIN_COMPILERS", &dir)]))
    };
    // Two H100s: the fsdp-split weights are gathered.
    let summary = run("h100", "2");
    let hlo = std::fs::read_to_string(out_dir.join("train_step.h100.optimized.hlo.txt"))
        .expect("the optimized HLO written");
    assert!(
        hlo.starts_with("HloModule"),
        "{}",
        &hlo[..200.min(hlo.len())]
    );
    assert!(
        summary.contains("compiled by XLA's CUDA compiler for 2 × H100"),
        "{summary}"
    );
    assert!(summary.contains("fusions: "), "{summary}");
    let gathers = hlo.matches(" all-gather-start(").count() + hlo.matches(" all-gather(").count();
    assert!(gathers > 0, "an fsdp step gathers its weights");
    assert!(
        summary.contains(&format!("{gathers} all-gather (")),
        "{gathers} all-gathers in the text: {summary}"
    );
    assert!(
        summary.contains("memory per device: arguments"),
        "{summary}"
    );
    // One MI300X: no collectives.
    let summary = run("mi300x", "1");
    assert!(
        summary.contains("ROCm compiler for one MI300X"),
        "{summary}"
    );
    assert!(summary.contains("collectives: none"), "{summary}");
    assert!(out_dir
        .join("train_step.mi300x.optimized.hlo.txt")
        .is_file());
}

/// A fresh folder under the target directory for one test.
fn tempfile_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Where XLA's figure for the policy's first form does not fit (3 MB for
/// a step whose estimate fits them, XLA's is 3.6 MB), `plan` compiles the
/// policy's next forms and takes the first that fits by XLA's figure.
#[test]
fn xla_s_figure_overrules_the_estimate_s_choice() {
    let dir = compilers();
    let out = plan(
        &[
            "--target",
            "h100",
            "--device-memory",
            "0.003",
            "--no-suggestions",
            "--json",
        ],
        &dir,
    );
    let v: Value = serde_json::from_str(&ok(&out)).expect("one JSON object");
    assert_eq!(v["fits"], true, "{v}");
    assert!(v["per_device"]["total_bytes"].as_u64().unwrap() <= 3_000_000);
    let why = v["rechosen"].as_str().expect("rechosen");
    assert!(
        why.contains("the policy's first form (layers unrolled, cudnn attention)")
            && why.contains("over 3.00 MB"),
        "{why}"
    );
    let choices = v["choices"].as_str().unwrap();
    assert!(
        choices.contains("each MLP recomputed") && choices.contains("does not fit"),
        "{choices}"
    );
}
