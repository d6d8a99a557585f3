//! What the command-line tests share: running the binary, checking its
//! one-line errors, fixtures and scratch folders.
#![allow(dead_code)] // each test file uses some of these

use std::path::{Path, PathBuf};

use hlo_engine::ir::Literal;
use hlo_engine::models::io::read_safetensors;
use std::process::{Command, Output};

/// The rows of a family fixture (`input_ids` of `dir`'s
/// expected.safetensors) as a JSONL file of token ids in `scratch_dir`.
pub fn expected_rows(dir: &Path, scratch_dir: &Path) -> PathBuf {
    let ids = fixture_tensor(dir, "expected.safetensors", "input_ids");
    let lines: Vec<String> = ids
        .to_i128s()
        .chunks(ids.ty.dims[1] as usize)
        .map(|r| serde_json::json!({ "input_ids": r }).to_string())
        .collect();
    let data = scratch_dir.join("rows.jsonl");
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    data
}

/// Runs `hlo-train` with `args` (the plugin from flags only, never from
/// the environment; hub ids from the HF cache only, never the network; one
/// process, whatever launched the tests).
pub fn hlo_train(args: &[&str]) -> Output {
    hlo_train_env(args, &[])
}

/// [`hlo_train`] with environment variables set (`HF_HUB_CACHE`, say).
pub fn hlo_train_env(args: &[&str], env: &[(&str, &Path)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hlo-train"))
        .args(args)
        .env_remove("HLO_TRAIN_PLUGIN")
        // Tests run as one process even inside a SLURM or torchrun job.
        .env_remove("SLURM_JOB_ID")
        .env_remove("WORLD_SIZE")
        .env_remove("HLO_TRAIN_RUN_TOKEN")
        .env("HF_HUB_OFFLINE", "1")
        // Plans for a GPU compile on the CPU plugin, standing in for the
        // GPU's compiler (fast, and the figures the tests were written
        // for); tests of the GPU compilers set it to `.plugins`.
        .env("HLO_TRAIN_COMPILERS", NO_COMPILERS)
        .envs(env.iter().copied())
        .output()
        .expect("run hlo-train")
}

/// Where no GPU compiler is installed.
pub const NO_COMPILERS: &str = "/nonexistent/hlo-train-compilers";

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A successful run's stdout.
pub fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}", stderr(out));
    String::from_utf8(out.stdout.clone()).expect("UTF-8 output")
}

/// A failed run: exit code 2, exactly one line on stderr starting
/// `error: `, no panic or backtrace. Returns the line.
pub fn one_line_error(out: &Output) -> String {
    let err = stderr(out).trim_end().to_string();
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!err.contains("RUST_BACKTRACE"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    assert!(err.starts_with("error: "), "{err}");
    err
}

/// The HF fixture model `name` (tests/fixtures/llama/NAME).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/llama")
        .join(name)
}

/// A fresh, empty folder for one test: `hlo-train-<group>-<pid>-<name>`.
pub fn scratch(group: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hlo-train-{group}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create a scratch folder");
    d
}

/// The two rows of input ids of fixture model `gqa_llama3`.
pub fn fixture_ids() -> Vec<Vec<i128>> {
    expected("gqa_llama3", "input_ids")
        .to_i128s()
        .chunks(9)
        .map(<[i128]>::to_vec)
        .collect()
}

/// The fixture's two rows of input ids as `{"input_ids"}` JSONL.
pub fn fixture_rows(dir: &Path) -> PathBuf {
    let lines: Vec<String> = fixture_ids()
        .iter()
        .map(|r| serde_json::json!({ "input_ids": r }).to_string())
        .collect();
    let path = dir.join("rows.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// The largest absolute difference between two equally long slices.
pub fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

pub fn losses(metrics: &Path) -> Vec<f64> {
    metric(metrics, "loss")
        .into_iter()
        .map(|(_, v)| v)
        .collect()
}

/// (step, value) of every metrics line that has `key` (train lines have
/// `loss`, eval lines `eval_loss`).
pub fn metric(metrics: &Path, key: &str) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v["step"].as_u64()?, v[key].as_f64()?)))
        .collect()
}

pub const DEMO: [&str; 14] = [
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

/// The prompt logits `generate --dump-logits` writes for `prompt` (ids,
/// comma-separated) with the model in `dir` (and `adapter`), with `extra`
/// flags.
pub fn dump_logits(
    dir: &Path,
    adapter: Option<&Path>,
    prompt: &str,
    out: &Path,
    extra: &[&str],
) -> Vec<f64> {
    let mut args = vec![
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt-ids",
        prompt,
        "--max-new-tokens",
        "1",
        "--dump-logits",
        out.to_str().unwrap(),
    ];
    if let Some(a) = adapter {
        args.extend(["--adapter", a.to_str().unwrap()]);
    }
    args.extend(extra);
    ok(&hlo_train(&args));
    let t = read_safetensors(out).unwrap();
    assert_eq!(t[0].0, "logits");
    t[0].1.to_f64s()
}

/// Tensor `key` of fixture model `name`'s `expected.safetensors`.
pub fn expected(name: &str, key: &str) -> Literal {
    read_safetensors(&fixture(name).join("expected.safetensors"))
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("{name}: no `{key}`"))
        .1
}

/// A literal's values as id strings.
pub fn ids(l: &Literal) -> Vec<String> {
    l.to_i128s().iter().map(|v| v.to_string()).collect()
}

/// A copy of fixture model `name`'s files (not its adapter folders) in
/// `to`.
pub fn copy_model(name: &str, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap().flatten() {
        if e.path().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    to.to_path_buf()
}

/// `train` for one step of the fixture model's two rows from adapter
/// `init` (`--batch 2 --seq 9 --steps 1`), with `extra` flags.
pub fn step_from_adapter(init: &Path, data: &Path, extra: &[&str]) -> Output {
    train_from_adapter(&fixture("gqa_llama3"), init, data, (2, 9), extra)
}

/// `train` for one step of the model in `checkpoint` from adapter `init`
/// on `data` in rows of `(batch, seq)`, with `extra` flags.
pub fn train_from_adapter(
    checkpoint: &Path,
    init: &Path,
    data: &Path,
    (batch, seq): (i64, i64),
    extra: &[&str],
) -> Output {
    let (batch, seq) = (batch.to_string(), seq.to_string());
    let mut args = vec![
        "train",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--init-adapter",
        init.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--batch",
        &batch,
        "--seq",
        &seq,
        "--steps",
        "1",
    ];
    args.extend(extra);
    hlo_train(&args)
}

/// `merge` of `adapter` into the model in `checkpoint`, written to `out`.
pub fn merge(checkpoint: &Path, adapter: &Path, out: &Path) -> Output {
    hlo_train(&[
        "merge",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
}

/// The model family fixture `name` (tests/fixtures/families/NAME).
pub fn family(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/families")
        .join(name)
}

/// Tensor `key` of the safetensors file `file` in fixture folder `dir`.
pub fn fixture_tensor(dir: &Path, file: &str, key: &str) -> Literal {
    read_safetensors(&dir.join(file))
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("{}/{file}: no `{key}`", dir.display()))
        .1
}

/// The ids `generate --greedy --ignore-eos` prints for `n` new tokens
/// after `prompt` (ids, comma-separated) with the model in `dir` (and
/// `adapter`), with `extra` flags.
pub fn greedy_ids(
    dir: &Path,
    adapter: Option<&Path>,
    prompt: &str,
    n: usize,
    extra: &[&str],
) -> Vec<u64> {
    let n = n.to_string();
    let dir = dir.to_str().unwrap();
    let mut args = vec![
        "generate",
        "--checkpoint",
        dir,
        "--prompt-ids",
        prompt,
        "--max-new-tokens",
        &n,
        "--ignore-eos",
        "--greedy",
    ];
    let adapter = adapter.map(|a| a.to_str().unwrap().to_string());
    if let Some(a) = &adapter {
        args.extend(["--adapter", a]);
    }
    args.extend(extra);
    ok(&hlo_train(&args))
        .trim()
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect()
}

/// One `opt` step (`sgd` at lr 0.05 or `adamw` at 1e-3, no clipping, f32)
/// of the fixture model in `dir` from its adapter on its rows of input ids,
/// with `extra` flags: the first loss equals PyTorch's within f32
/// rounding of the forward (`ModelConfig::f32_forward_bound`, twice: a
/// log-sum-exp less a logit) and every tensor of the trained adapter
/// PyTorch+PEFT's to 1e-6 (`dir`'s
/// `train_step.safetensors`). An AdamW parameter whose gradient nearly
/// cancels (|g| < 1e-5; PyTorch's g from its SGD step) is held to 1e-5:
/// AdamW's first step moves it by lr·g/(|g| + 1e-8), which turns f32
/// rounding of g (~1e-8) into ~1e-6. Returns the run's scratch folder
/// (its metrics file is `m.jsonl`) for further checks; the caller removes it.
pub fn step_equals_pytorch(dir: &Path, opt: &str, extra: &[&str]) -> PathBuf {
    step_from_equals_pytorch(dir, ("adapter", "train_step.safetensors"), opt, extra)
}

/// [`step_equals_pytorch`] from the adapter folder `adapter` of `dir`,
/// against the steps in `dir`'s file `steps`.
pub fn step_from_equals_pytorch(
    dir: &Path,
    from: (&str, &str),
    opt: &str,
    extra: &[&str],
) -> PathBuf {
    step_within_of_pytorch(dir, from, opt, extra, 1e-6)
}

/// [`step_from_equals_pytorch`] with the loss within `loss_tol` at least
/// (the parameters still within 1e-6).
pub fn step_within_of_pytorch(
    dir: &Path,
    (adapter, steps): (&str, &str),
    opt: &str,
    extra: &[&str],
    loss_tol: f64,
) -> PathBuf {
    let name = dir.file_name().unwrap().to_str().unwrap();
    let tag = format!(
        "{name}_{adapter}_{opt}_{}",
        extra.join("_").replace(['=', ',', '/'], "-")
    );
    let scratch_dir = scratch("step", &tag);
    let ids = fixture_tensor(dir, "expected.safetensors", "input_ids");
    let data = expected_rows(dir, &scratch_dir);
    let (out, metrics) = (scratch_dir.join("out"), scratch_dir.join("m.jsonl"));
    let adapter = dir.join(adapter);
    let lr = if opt == "sgd" { "0.05" } else { "1e-3" };
    let mut args = vec![
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
    let shape = (ids.ty.dims[0], ids.ty.dims[1]);
    ok(&train_from_adapter(dir, &adapter, &data, shape, &args));
    let want = |key: &str| fixture_tensor(dir, steps, key).to_f64s();
    let (loss, want_loss) = (losses(&metrics)[0], want(&format!("{opt}.loss"))[0]);
    // The loss is log-sum-exps less logits: f32 rounding of the forward
    // as the order of its sums gives it (the CPU's vector width).
    let config =
        hlo_engine::models::decoder::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let loss_tol = loss_tol.max(2.0 * config.f32_forward_bound(shape.1, want_loss));
    assert!(
        (loss - want_loss).abs() < loss_tol,
        "{tag}: loss {loss}, PyTorch {want_loss} (within {loss_tol:e})"
    );
    let ours = read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
    let start = read_safetensors(&adapter.join("adapter_model.safetensors")).unwrap();
    assert_eq!(ours.len(), start.len(), "{tag}: the adapter's tensors");
    let (mut worst, mut ill_conditioned) = (0.0f64, 0);
    for (key, t) in ours {
        let theirs = want(&format!("{opt}.{key}"));
        let p0 = start.iter().find(|(k, _)| *k == key).unwrap().1.to_f64s();
        let sgd = want(&format!("sgd.{key}"));
        for (i, (ours, theirs)) in t.to_f64s().into_iter().zip(theirs).enumerate() {
            let g = (p0[i] - sgd[i]) / 0.05;
            let d = (ours - theirs).abs();
            let tol = if opt == "adamw" && g.abs() < 1e-5 {
                ill_conditioned += 1;
                1e-5
            } else {
                worst = worst.max(d);
                1e-6
            };
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
    scratch_dir
}

/// The fixture model in `dir` with its adapter gives HF's (PEFT's) prompt
/// logits of its first row of input ids through `generate --dump-logits`,
/// and so does `merge` of the adapter without it, within `tol`; the
/// merged folder keeps the model's config. Scratch files go in `tmp`.
pub fn assert_merge_gives_adapter_logits(dir: &Path, tmp: &Path, tol: f64) {
    let expected = ("adapter", "expected.safetensors", "logits_adapter");
    assert_merge_of_gives_logits(dir, expected, tmp, tol);
}

/// [`assert_merge_gives_adapter_logits`] for `dir`'s adapter folder
/// `adapter` whose logits are `key` of `dir`'s file `file`; the merged
/// folder is left in `tmp/<model name>`.
pub fn assert_merge_of_gives_logits(
    dir: &Path,
    (adapter, file, key): (&str, &str, &str),
    tmp: &Path,
    tol: f64,
) {
    let name = dir.file_name().unwrap().to_str().unwrap();
    let input = fixture_tensor(dir, "expected.safetensors", "input_ids");
    let prompt = ids(&input)[..input.ty.dims[1] as usize].join(",");
    let all = fixture_tensor(dir, file, key).to_f64s();
    let want = &all[..all.len() / input.ty.dims[0] as usize];
    let adapter = dir.join(adapter);
    let got = dump_logits(
        dir,
        Some(&adapter),
        &prompt,
        &tmp.join("a.safetensors"),
        &[],
    );
    let d = max_diff(&got, want);
    assert!(d < tol, "{name}: prompt logits differ by {d}");
    // Folding the adapter in gives the same logits without it.
    let merged = tmp.join(name);
    ok(&merge(dir, &adapter, &merged));
    let model_type = |d: &Path| {
        let text = std::fs::read_to_string(d.join("config.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["model_type"].clone()
    };
    assert_eq!(model_type(&merged), model_type(dir), "{name}");
    let got = dump_logits(&merged, None, &prompt, &tmp.join("m.safetensors"), &[]);
    let d = max_diff(&got, want);
    assert!(d < tol, "{name} merged: logits differ by {d}");
}

/// `generate --greedy` of the fixture model in `dir`, with `extra` flags,
/// gives HF's greedy tokens (`greedy`, and `greedy_adapter` with its PEFT
/// adapter): `new` tokens after the first `prompt_len` of them.
pub fn assert_greedy_equals_hf(dir: &Path, prompt_len: usize, new: usize, extra: &[&str]) {
    for (adapter, key) in [
        (None, "greedy"),
        (Some(dir.join("adapter")), "greedy_adapter"),
    ] {
        let want = ids(&fixture_tensor(dir, "expected.safetensors", key));
        let prompt = want[..prompt_len].join(",");
        let got = greedy_ids(dir, adapter.as_deref(), &prompt, new, extra);
        let got: Vec<String> = got.iter().map(u64::to_string).collect();
        assert_eq!(got, want[prompt_len..], "{} {key} {extra:?}", dir.display());
    }
}

/// `plan` (on a 2×2×2 mesh: fits), `dump-hlo` (the train step's StableHLO
/// holds each of `marks`, scope names) and `bench` (2 steps) take the
/// fixture model in `dir`; files go in `tmp`.
pub fn assert_tools_take(dir: &Path, marks: &[&str], tmp: &Path) {
    let name = dir.file_name().unwrap().to_str().unwrap();
    let config = dir.join("config.json");
    let config = config.to_str().unwrap();
    let mesh = ["--mesh", "dp=2,fsdp=2,mp=2", "--batch", "4", "--seq", "16"];
    let mut args = vec!["plan", "--config", config, "--json"];
    args.extend(mesh);
    let plan: serde_json::Value = serde_json::from_str(&ok(&hlo_train(&args))).unwrap();
    assert_eq!(plan["fits"], true, "{name}: {plan}");
    let out = tmp.join(name);
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
    for m in marks {
        assert!(text.contains(m), "{name}: no `{m}` in the program");
    }
    let bench = ok(&hlo_train(&[
        "bench",
        "--checkpoint",
        dir.to_str().unwrap(),
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

/// A copy of adapter folder `from` in `to` whose `adapter_config.json`
/// lists its `target_modules` in the reverse order (PEFT writes them from
/// a set, in no fixed order): the same adapter.
pub fn with_targets_reversed(from: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
    let file = to.join("adapter_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let targets = config["target_modules"].as_array_mut().unwrap();
    assert!(targets.len() > 1, "{}: one target", from.display());
    targets.reverse();
    std::fs::write(&file, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    to.to_path_buf()
}

/// `args` with the value of each flag of `extra` already among them
/// replaced by `extra`'s, the others appended.
pub fn with_flags(mut args: Vec<String>, extra: &[&str]) -> Vec<String> {
    let mut k = 0;
    while k < extra.len() {
        let value = extra.get(k + 1).filter(|v| !v.starts_with("--"));
        match (args.iter().position(|a| a == extra[k]), value) {
            (Some(at), Some(v)) => {
                args[at + 1] = v.to_string();
                k += 2;
            }
            _ => {
                args.push(extra[k].to_string());
                k += 1;
            }
        }
    }
    args
}

/// `got` within `tol` (relative above 1) of a reference trainer's `want`.
pub fn close(what: &str, got: f64, want: f64, tol: f64) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "{what}: {got} against TRL's {want}"
    );
}

/// Every tensor of the adapter saved in `out` equals `name.<key>` of the
/// fixture files `theirs` (keys as PEFT writes them) within `tol`.
pub fn assert_adapter_as_fixture(out: &Path, theirs: &[PathBuf], name: &str, tol: f64) {
    let ours =
        hlo_engine::models::io::read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
    let mut all = Vec::new();
    for f in theirs {
        all.extend(hlo_engine::models::io::read_safetensors(f).unwrap());
    }
    assert!(!ours.is_empty());
    for (key, t) in &ours {
        let trl = &all
            .iter()
            .find(|(k, _)| *k == format!("{name}.{key}"))
            .unwrap_or_else(|| panic!("{name}: {key} in the fixture"))
            .1;
        let d = max_diff(&t.to_f64s(), &trl.to_f64s());
        assert!(d < tol, "{name}: {key} differs by {d:e}");
    }
}

/// A file of the fixture folder `tests/fixtures/<group>`.
pub fn fixture_file(group: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(group)
        .join(name)
}
