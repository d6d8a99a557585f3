//! Full training saved as a sharded state on an 8-device mesh
//! (`dp=2, fsdp=4`) and continued on another mesh (`fsdp=8`), on one
//! device, and on the same mesh: each continuation's losses are the
//! uninterrupted run's to 1e-6. `export` writes the run's HF folder
//! from the state (the weights the run itself wrote, byte for byte), and
//! refuses what it cannot export in one line.

mod common;

use common::*;

fn full(steps: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train", "--full", "--batch", "8", "--seq", "16", "--lr", "3e-3", "--steps", steps,
    ]
    .map(String::from)
    .to_vec();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn run_ok(args: &[String]) -> String {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&hlo_train(&refs))
}

const SAVED_ON: [&str; 4] = ["--devices", "8", "--mesh", "dp=2,fsdp=4,mp=1"];

#[test]
fn a_sharded_state_continues_on_another_mesh_as_if_uninterrupted() {
    let dir = scratch("sharded", "resume");
    let whole = dir.join("whole.jsonl");
    let mut args = SAVED_ON.to_vec();
    args.extend(["--metrics", whole.to_str().unwrap()]);
    run_ok(&full("6", &args));
    let reference = losses(&whole);
    assert_eq!(reference.len(), 6);
    for (k, mesh) in [
        &["--devices", "8", "--mesh", "dp=1,fsdp=8,mp=1"][..],
        &["--devices", "1"][..],
        &SAVED_ON[..],
    ]
    .into_iter()
    .enumerate()
    {
        let out = dir.join(format!("run{k}"));
        let o = out.to_str().unwrap();
        let mut first = SAVED_ON.to_vec();
        first.extend(["--out", o]);
        run_ok(&full("3", &first));
        let manifest: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("train_state/manifest.json")).unwrap(),
        )
        .unwrap();
        let saved_mesh = serde_json::json!([["dp", 2], ["fsdp", 4], ["mp", 1]]);
        assert_eq!(manifest["mesh"], saved_mesh);
        let metrics = dir.join(format!("resumed{k}.jsonl"));
        let mut resume = vec!["train", "--resume", o, "--steps", "6", "--metrics"];
        resume.push(metrics.to_str().unwrap());
        resume.extend(mesh);
        ok(&hlo_train(&resume));
        let resumed = losses(&metrics);
        assert_eq!(resumed.len(), 3, "{mesh:?}");
        for (got, want) in resumed.iter().zip(&reference[3..]) {
            assert!(
                (got - want).abs() <= 1e-6 * want.abs(),
                "{mesh:?}: {got} vs {want} uninterrupted"
            );
        }
        // export writes what the run wrote into its own folder.
        let exported = dir.join(format!("hf{k}"));
        let said = ok(&hlo_train(&[
            "export",
            o,
            "--out",
            exported.to_str().unwrap(),
        ]));
        assert!(said.starts_with("export: "), "{said}");
        for f in ["model.safetensors", "config.json", "generation_config.json"] {
            assert_eq!(
                std::fs::read(exported.join(f)).unwrap(),
                std::fs::read(out.join(f)).unwrap(),
                "{f}"
            );
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn export_refuses_what_it_cannot_export() {
    let dir = scratch("sharded", "export-refusals");
    let (lora, hf) = (dir.join("lora"), dir.join("hf"));
    let err = one_line_error(&hlo_train(&[
        "export",
        dir.join("none").to_str().unwrap(),
        "--out",
        hf.to_str().unwrap(),
    ]));
    assert!(err.contains("holds no saved run"), "{err}");
    let mut lora_run = full("1", &["--lora-rank", "4", "--out", lora.to_str().unwrap()]);
    lora_run.retain(|a| a != "--full");
    run_ok(&lora_run);
    let err = one_line_error(&hlo_train(&[
        "export",
        lora.to_str().unwrap(),
        "--out",
        hf.to_str().unwrap(),
    ]));
    assert!(err.contains("is a LoRA run"), "{err}");
    assert!(!hf.exists());
    // A folder holding a model (here the run itself) is never written over.
    let full_run = dir.join("full");
    run_ok(&full("1", &["--out", full_run.to_str().unwrap()]));
    let before = std::fs::read(full_run.join("model.safetensors")).unwrap();
    let err = one_line_error(&hlo_train(&[
        "export",
        full_run.to_str().unwrap(),
        "--out",
        full_run.to_str().unwrap(),
    ]));
    assert!(err.contains("holds a model already"), "{err}");
    assert_eq!(
        std::fs::read(full_run.join("model.safetensors")).unwrap(),
        before
    );
    // A state that is not the config's model: exported and resumed only
    // when it is exactly that model's tensors.
    let export_err = |name: &str, edit: &dyn Fn(&mut serde_json::Value, &mut serde_json::Value)| {
        let run = dir.join(name);
        copy_dir(&full_run, &run);
        let manifest = run.join("train_state/manifest.json");
        let mut m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap())
                .unwrap();
        edit(&mut m, &mut c);
        std::fs::write(&manifest, m.to_string()).unwrap();
        std::fs::write(run.join("config.json"), c.to_string()).unwrap();
        let out = dir.join(format!("{name}-hf"));
        let e = one_line_error(&hlo_train(&[
            "export",
            run.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]));
        assert!(
            !out.join("model.safetensors").exists(),
            "{name}: weights written"
        );
        (run, e)
    };
    let (_, e) = export_err("role", &|m, _| {
        m["tensors"]["lm_head.weight"]["role"] = "optimizer".into();
    });
    assert!(e.contains("has no parameter `lm_head.weight`"), "{e}");
    let (_, e) = export_err("layers", &|_, c| {
        c["num_hidden_layers"] = (c["num_hidden_layers"].as_i64().unwrap() + 1).into();
    });
    assert!(
        e.contains("differs from config.json") && e.contains("has no parameter"),
        "{e}"
    );
    let (extra, e) = export_err("extra", &|m, _| {
        let t = m["tensors"]["lm_head.weight"].clone();
        m["tensors"]["model.extra.weight"] = t;
    });
    assert!(e.contains("holds `model.extra.weight`"), "{e}");
    let e = one_line_error(&hlo_train(&[
        "train",
        "--resume",
        extra.to_str().unwrap(),
        "--steps",
        "2",
    ]));
    assert!(e.contains("holds `model.extra.weight`"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `from`'s files and folders copied into `to`.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}
