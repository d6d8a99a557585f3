//! Runs are never silently lost or changed: a folder holding a run is not
//! overwritten, a resumed run keeps every setting it was saved with (all
//! differences listed at once), its state is checked on the way in and
//! out, and the output folder is checked before any work.

mod common;

use std::path::Path;

use common::*;
use hlo_engine::models::io::{read_safetensors, write_safetensors};
use hlo_engine::train::checkpoint::sharded::block_crc;

/// A short tiny-model run on the demo task.
fn tiny(steps: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["train", "--batch", "4", "--seq", "16", "--steps", steps]
        .map(String::from)
        .to_vec();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn run(args: &[String]) -> std::process::Output {
    hlo_train(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn state(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("train_state/state.json")).unwrap())
        .unwrap()
}

/// The one shard file of a one-process run's saved state.
fn shard(out: &Path) -> std::path::PathBuf {
    out.join("train_state/shard-00000-of-00001.safetensors")
}

#[test]
fn a_folder_holding_a_run_is_not_overwritten() {
    let dir = scratch("safety", "overwrite");
    let out = dir.join("run");
    let o = out.to_str().unwrap();
    ok(&run(&tiny("6", &["--out", o])));
    let before = std::fs::read(shard(&out)).unwrap();
    let err = one_line_error(&run(&tiny("3", &["--out", o])));
    assert!(
        err.contains(&format!("--out {o} holds a run already"))
            && err.contains("--resume")
            && err.contains("--overwrite"),
        "{err}"
    );
    // Nothing changed.
    assert_eq!(state(&out)["step"], 6);
    assert_eq!(std::fs::read(shard(&out)).unwrap(), before);
    // --overwrite replaces it.
    ok(&run(&tiny("3", &["--out", o, "--overwrite"])));
    assert_eq!(state(&out)["step"], 3);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_resume_that_changes_settings_lists_every_difference() {
    let dir = scratch("safety", "differences");
    let out = dir.join("run");
    let o = out.to_str().unwrap();
    ok(&run(&tiny(
        "4",
        &["--out", o, "--schedule", "cosine", "--warmup", "1"],
    )));
    let err = one_line_error(&hlo_train(&[
        "train",
        "--resume",
        o,
        "--lora-targets",
        "q_proj,v_proj",
        "--lora-alpha",
        "32",
        "--use-rslora",
        "--seq",
        "32",
    ]));
    for want in [
        "--lora-targets was q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj when the run was saved, this run has q_proj,v_proj",
        "--lora-alpha was 16.0 when the run was saved, this run has 32.0",
        "--use-rslora was false when the run was saved, this run has true",
        "--seq was 16 when the run was saved, this run has 32",
    ] {
        assert!(err.contains(want), "{want} not in: {err}");
    }
    // A cosine schedule cannot be stretched; the message says what to do.
    let err = one_line_error(&hlo_train(&["train", "--resume", o, "--steps", "8"]));
    assert!(
        err.contains("cosine schedule ends at step 4")
            && err.contains(&format!("--init-adapter {o}")),
        "{err}"
    );
    // Other data is refused, named by its identity.
    let data = dir.join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"hello world\"}\n").unwrap();
    let err = one_line_error(&hlo_train(&[
        "train",
        "--resume",
        o,
        "--data",
        data.to_str().unwrap(),
    ]));
    assert!(
        err.contains("the training data changed since the run was saved"),
        "{err}"
    );
    assert_eq!(state(&out)["step"], 4);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_changed_base_model_is_refused() {
    let dir = scratch("safety", "base");
    let base = copy_model("gqa_llama3", &dir.join("base"));
    let data = dir.join("rows.jsonl");
    std::fs::write(
        &data,
        "{\"input_ids\": [1, 5, 9, 12, 30, 7]}\n{\"input_ids\": [1, 8, 3, 44]}\n",
    )
    .unwrap();
    let out = dir.join("run");
    let o = out.to_str().unwrap();
    let b = base.to_str().unwrap();
    let d = data.to_str().unwrap();
    ok(&hlo_train(&[
        "train",
        "--checkpoint",
        b,
        "--data",
        d,
        "--batch",
        "2",
        "--seq",
        "8",
        "--steps",
        "2",
        "--out",
        o,
    ]));
    // Another model, named on the command line.
    let other = copy_model("mha_tied", &dir.join("other"));
    let err = one_line_error(&hlo_train(&[
        "train",
        "--resume",
        o,
        "--checkpoint",
        other.to_str().unwrap(),
        "--steps",
        "4",
    ]));
    assert!(
        err.contains("the base model (its config.json or weight files) changed")
            && err.contains("--checkpoint was"),
        "{err}"
    );
    // The same folder, its weights replaced.
    std::fs::copy(
        fixture("head_dim").join("model.safetensors"),
        base.join("model.safetensors"),
    )
    .unwrap();
    std::fs::copy(
        fixture("head_dim").join("config.json"),
        base.join("config.json"),
    )
    .unwrap();
    let err = one_line_error(&hlo_train(&["train", "--resume", o, "--steps", "4"]));
    assert!(
        err.contains("the base model (its config.json or weight files) changed"),
        "{err}"
    );
    // The adapter names its base by absolute path, so PEFT finds it from
    // any directory.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    let named = config["base_model_name_or_path"].as_str().unwrap();
    assert!(Path::new(named).is_absolute(), "{named}");
    assert_eq!(
        Path::new(named),
        std::fs::canonicalize(&base).unwrap().as_path()
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn saved_state_is_checked_on_the_way_in() {
    let dir = scratch("safety", "integrity");
    let out = dir.join("run");
    let o = out.to_str().unwrap();
    ok(&run(&tiny("2", &["--out", o])));
    let state_file = shard(&out);
    let json_file = out.join("train_state/state.json");
    let manifest_file = out.join("train_state/manifest.json");
    let good_manifest = std::fs::read_to_string(&manifest_file).unwrap();
    let (good_bytes, good_json) = (
        std::fs::read(&state_file).unwrap(),
        std::fs::read_to_string(&json_file).unwrap(),
    );
    // A flipped byte.
    let mut bytes = good_bytes.clone();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x40;
    std::fs::write(&state_file, &bytes).unwrap();
    let err = one_line_error(&hlo_train(&["train", "--resume", o, "--steps", "4"]));
    assert!(err.contains("does not match its checksum"), "{err}");
    std::fs::write(&state_file, &good_bytes).unwrap();
    // A step that makes no sense.
    std::fs::write(&json_file, good_json.replace("\"step\": 2", "\"step\": -1")).unwrap();
    let err = one_line_error(&hlo_train(&["train", "--resume", o, "--steps", "4"]));
    assert!(err.contains("`step` is not a step count"), "{err}");
    // A state with a NaN (checksum made to match): refused, not trained on.
    let mut tensors = read_safetensors(&state_file).unwrap();
    let (name, lit) = tensors
        .iter_mut()
        .find(|(n, _)| n.ends_with("lora_a"))
        .unwrap();
    let name = name.clone();
    let mut values = lit.to_f64s();
    values[0] = f64::NAN;
    *lit = hlo_engine::ir::Literal::from_f64s(lit.ty.clone(), &values);
    write_safetensors(&state_file, &tensors).unwrap();
    std::fs::write(&json_file, &good_json).unwrap();
    // The block's checksum made to match (one device: the block is the tensor).
    let (_, lit) = tensors.iter().find(|(n, _)| n == &name).unwrap();
    let mut manifest: serde_json::Value = serde_json::from_str(&good_manifest).unwrap();
    manifest["tensors"][&name]["blocks"][0]["crc32"] = block_crc(&lit.bytes).into();
    std::fs::write(&manifest_file, manifest.to_string()).unwrap();
    let err = one_line_error(&hlo_train(&["train", "--resume", o, "--steps", "4"]));
    assert!(
        err.contains(&format!("`{name}` has 1 non-finite values")),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_run_that_diverges_saves_nothing_non_finite() {
    let dir = scratch("safety", "diverge");
    let out = dir.join("run");
    let o = out.to_str().unwrap();
    // A learning rate the f32 schedule cannot hold is refused at once.
    let err = one_line_error(&run(&tiny("2", &["--lr", "1e39"])));
    assert!(err.contains("invalid value '1e39' for '--lr"), "{err}");
    // An update that makes the parameters non-finite stops the run before
    // it is saved; what was saved before stays, and is finite.
    let err = one_line_error(&run(&tiny(
        "6",
        &[
            "--lr",
            "1e30",
            "--optimizer",
            "sgd",
            "--clip-norm",
            "0",
            "--out",
            o,
            "--save-every",
            "1",
        ],
    )));
    assert!(
        err.contains("non-finite") || err.contains("stopped"),
        "{err}"
    );
    if shard(&out).is_file() {
        for (name, lit) in read_safetensors(&shard(&out)).unwrap() {
            assert!(
                lit.to_f64s().iter().all(|v| v.is_finite()),
                "{name} saved non-finite"
            );
        }
        for (name, lit) in read_safetensors(&out.join("adapter_model.safetensors")).unwrap() {
            assert!(
                lit.to_f64s().iter().all(|v| v.is_finite()),
                "{name} saved non-finite"
            );
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_output_folder_is_checked_before_training() {
    let dir = scratch("safety", "out");
    let file = dir.join("a_file");
    std::fs::write(&file, "x").unwrap();
    let err = one_line_error(&run(&tiny("2", &["--out", file.to_str().unwrap()])));
    assert!(err.contains("is a file, not a folder"), "{err}");
    // A folder nothing can be written to (sysfs refuses even root).
    let err = one_line_error(&run(&tiny("2", &["--out", "/sys/kernel/hlo-train-out"])));
    assert!(
        err.contains("cannot create /sys/kernel/hlo-train-out"),
        "{err}"
    );
    // Temporaries a killed writer left behind are removed.
    let out = dir.join("run");
    std::fs::create_dir_all(out.join("train_state.new")).unwrap();
    std::fs::write(out.join(".adapter_model.safetensors.tmp-999999999"), "x").unwrap();
    ok(&run(&tiny("1", &["--out", out.to_str().unwrap()])));
    assert!(!out.join("train_state.new").exists());
    assert!(!out
        .join(".adapter_model.safetensors.tmp-999999999")
        .exists());
    // --peak-tflops must be a positive number.
    for bad in ["nan", "-1"] {
        let err = one_line_error(&run(&tiny("1", &["--peak-tflops", bad])));
        assert!(err.contains("--peak-tflops"), "{err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_resumed_run_appends_to_its_metrics() {
    let dir = scratch("safety", "metrics");
    let out = dir.join("run");
    let metrics = dir.join("m.jsonl");
    let (o, m) = (out.to_str().unwrap(), metrics.to_str().unwrap());
    ok(&run(&tiny("3", &["--out", o, "--metrics", m])));
    ok(&hlo_train(&[
        "train",
        "--resume",
        o,
        "--steps",
        "5",
        "--metrics",
        m,
    ]));
    let steps: Vec<u64> = metric(&metrics, "loss").iter().map(|s| s.0).collect();
    assert_eq!(steps, [1, 2, 3, 4, 5]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn merge_removes_what_a_killed_merge_left() {
    let dir = scratch("safety", "merge");
    let out = dir.join("merged");
    std::fs::create_dir_all(&out).unwrap();
    let stale = out.join(".model.safetensors.tmp-999999999");
    std::fs::write(&stale, vec![0u8; 1024]).unwrap();
    let model = fixture("gqa_llama3");
    ok(&merge(&model, &model.join("adapter"), &out));
    assert!(!stale.exists());
    assert!(out.join("model.safetensors").is_file());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_resume_alone_keeps_the_metrics_eval_tensorboard_and_cadences() {
    let dir = scratch("safety", "resume-alone");
    let out = dir.join("run");
    let (metrics, tb, held) = (dir.join("m.jsonl"), dir.join("tb"), dir.join("held.jsonl"));
    std::fs::write(&held, "{\"text\": \"cat=CAT\"}\n{\"text\": \"dog=DOG\"}\n").unwrap();
    let p = |p: &Path| p.to_str().unwrap().to_string();
    let first = [
        "--out",
        &p(&out),
        "--metrics",
        &p(&metrics),
        "--tensorboard",
        &p(&tb),
        "--eval-data",
        &p(&held),
        "--eval-every",
        "2",
        "--log-every",
        "2",
    ];
    ok(&run(&tiny("4", &first)));
    // Only how far to go: everything else comes back from the folder.
    ok(&hlo_train(&["train", "--resume", &p(&out), "--steps", "8"]));
    let steps: Vec<u64> = metric(&metrics, "loss").iter().map(|s| s.0).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<u64>>());
    let evals: Vec<u64> = metric(&metrics, "eval_loss").iter().map(|s| s.0).collect();
    for step in [2, 4, 6, 8] {
        assert!(evals.contains(&step), "no eval at step {step}: {evals:?}");
    }
    // The resumed run continues in the run's own folder: a second file.
    let events = std::fs::read_dir(tb.join("run")).unwrap().count();
    assert!(events >= 2, "{events} event files");
    let recipe = std::fs::read_to_string(out.join("recipe.yaml")).unwrap();
    let held_abs = std::fs::canonicalize(&held).unwrap();
    assert!(
        recipe.contains(&format!("eval_data: {}\n", held_abs.display())),
        "{recipe}"
    );
    assert!(recipe.contains("eval_every: 2\n"), "{recipe}");
    assert!(recipe.contains("log_every: 2\n"), "{recipe}");
    // A flag given again replaces the saved one.
    let other = dir.join("other.jsonl");
    ok(&hlo_train(&[
        "train",
        "--resume",
        &p(&out),
        "--steps",
        "9",
        "--metrics",
        &p(&other),
    ]));
    assert_eq!(
        metric(&other, "loss")
            .iter()
            .map(|s| s.0)
            .collect::<Vec<_>>(),
        [9]
    );
    assert_eq!(metric(&metrics, "loss").len(), 8);
    std::fs::remove_dir_all(dir).unwrap();
}
