//! `hlo-train compile` writes the train step `train` would compile with
//! the same flags; `train --executable` loads it instead of compiling and
//! trains bit for bit as a run that compiled it (on the CPU plugin, over
//! 2 devices). Another batch, another model, other devices, another
//! plugin or a changed file are refused in one line; a step compiled for
//! an H100 without one (XLA's CUDA compiler) is refused by the CPU plugin.

mod common;

use std::path::{Path, PathBuf};

use common::*;

const STEP: [&str; 8] = [
    "--batch",
    "4",
    "--seq",
    "16",
    "--steps",
    "6",
    "--devices",
    "2",
];

fn folder(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("compile_cli")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `train` with `STEP`'s flags, a value replaced where `extra` gives the
/// same flag, then the rest of `extra`.
fn train(dir: &Path, name: &str, extra: &[&str]) -> std::process::Output {
    let out = dir.join(name);
    let metrics = dir.join(format!("{name}.jsonl"));
    let mut args = vec!["train"];
    let mut extra = extra.to_vec();
    for pair in STEP.chunks(2) {
        let value = match extra.iter().position(|a| *a == pair[0]) {
            Some(i) => extra.drain(i..i + 2).nth(1).unwrap(),
            None => pair[1],
        };
        args.extend([pair[0], value]);
    }
    args.extend([
        "--out",
        out.to_str().unwrap(),
        "--metrics",
        metrics.to_str().unwrap(),
        "--eval-every",
        "0",
    ]);
    args.extend(extra);
    hlo_train(&args)
}

/// Each logged step's loss and grad norm, as the metrics file has them.
fn figures(dir: &Path, name: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join(format!("{name}.jsonl")))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"loss\""))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            format!("{} {} {}", v["step"], v["loss"], v["grad_norm"])
        })
        .collect()
}

#[test]
fn a_compiled_step_trains_bit_for_bit_and_only_its_own_run() {
    let dir = folder("round_trip");
    let file = dir.join("step.pjrt");
    let mut args = vec!["compile"];
    args.extend(STEP);
    args.extend(["--out", file.to_str().unwrap()]);
    let text = ok(&hlo_train(&args));
    assert!(
        text.contains("for 2 × CPU (mesh dp=1,fsdp=2,mp=1)"),
        "{text}"
    );
    let loaded = train(&dir, "loaded", &["--executable", file.to_str().unwrap()]);
    let header = ok(&loaded);
    assert!(
        header.contains("the train step loaded from") && header.contains("not compiled"),
        "{header}"
    );
    ok(&train(&dir, "compiled", &[]));
    let (a, b) = (figures(&dir, "loaded"), figures(&dir, "compiled"));
    assert!(!a.is_empty());
    assert_eq!(a, b, "the loaded step's losses and grad norms");
    let adapter = |run: &str| {
        std::fs::read(dir.join(run).join("adapter_model.safetensors")).expect("adapter")
    };
    assert_eq!(
        adapter("loaded"),
        adapter("compiled"),
        "the adapters, byte for byte"
    );

    // Another batch, another model, other devices: refused, naming it.
    let path = file.to_str().unwrap();
    let err = one_line_error(&train(&dir, "b8", &["--executable", path, "--batch", "8"]));
    assert!(err.contains("batch: 4 compiled, 8 in this run"), "{err}");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let config = root.join("bench/configs/tiny-bpe.json");
    let tokenizer = root.join("tests/fixtures/tokenizer/tokenizer.json");
    let other = [
        "--executable",
        path,
        "--config",
        config.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
    ];
    let err = one_line_error(&train(&dir, "other_model", &other));
    assert!(err.contains("it is another step than this run's"), "{err}");
    let err = one_line_error(&train(
        &dir,
        "one",
        &["--executable", path, "--devices", "1"],
    ));
    assert!(
        err.contains("compiled for 2 × CPU, and this run has 1 × CPU"),
        "{err}"
    );

    // Another plugin build (its sha256 recorded differs), and a file whose
    // bytes changed.
    let bytes = std::fs::read(&file).unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let sha_at = text.find("\"sha256\":\"").unwrap() + 10;
    let mut other_plugin = bytes.clone();
    other_plugin[sha_at] = if bytes[sha_at] == b'0' { b'1' } else { b'0' };
    let tampered = dir.join("other_plugin.pjrt");
    std::fs::write(&tampered, &other_plugin).unwrap();
    let err = one_line_error(&train(
        &dir,
        "other_plugin",
        &["--executable", tampered.to_str().unwrap()],
    ));
    assert!(
        err.contains("an executable loads only in the plugin build that made it"),
        "{err}"
    );
    let mut cut = bytes.clone();
    cut.truncate(bytes.len() - 100);
    std::fs::write(&tampered, &cut).unwrap();
    let err = one_line_error(&train(
        &dir,
        "cut",
        &["--executable", tampered.to_str().unwrap()],
    ));
    assert!(
        err.contains("do not have the sha256 its manifest records"),
        "{err}"
    );
}

#[test]
fn a_step_compiled_for_an_h100_is_refused_by_the_cpu_plugin() {
    let dir = folder("h100");
    let file = dir.join("step.pjrt");
    let compilers = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.plugins");
    let mut args = vec!["compile", "--target", "h100"];
    args.extend(STEP);
    args.extend(["--out", file.to_str().unwrap()]);
    let text = ok(&hlo_train_env(
        &args,
        &[("HLO_TRAIN_COMPILERS", &compilers)],
    ));
    assert!(
        text.contains("compiled by XLA's CUDA compiler for 2 × H100"),
        "{text}"
    );
    let bytes = std::fs::read(&file).unwrap();
    let manifest = String::from_utf8_lossy(&bytes[..bytes.len().min(4096)]).into_owned();
    assert!(
        manifest.contains("\"device\":\"H100\"") && manifest.contains("xla_cuda_plugin.so"),
        "{manifest}"
    );
    // bf16 by default for a GPU, as a run on one would be.
    assert!(manifest.contains("\"dtype\":\"bf16\""), "{manifest}");
    let err = one_line_error(&train(
        &dir,
        "cpu",
        &["--executable", file.to_str().unwrap()],
    ));
    assert!(
        err.contains("it was compiled by cuda xla_cuda_plugin.so")
            && err.contains("this run's plugin is cpu"),
        "{err}"
    );
}
