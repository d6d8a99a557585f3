//! `hlo-train train --objective distillation --rollouts FILE` against TRL
//! 1.16's own `DistillationTrainer` (fixtures made by
//! `scripts/make_distill_fixtures.py`; formulas in
//! `tests/fixtures/distill/FORMULAS.md`): the tiny f32 Llama as the
//! student (LoRA) and a larger Llama of the same vocabulary as the
//! teacher, on fixed completions of the student — the step's loss and
//! every metric TRL logs to 1e-5 and the adapter after one SGD or AdamW
//! step to 1e-6, for the forward KL, the reverse KL (TRL's default) and
//! the generalized JSD, at two temperatures, from a fresh adapter and
//! another; on one device and on a `dp=1,fsdp=2,mp=2` mesh. Also: online
//! distillation (the student generating), and what it refuses.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::Value;

fn distill(name: &str) -> PathBuf {
    fixture_file("distill", name)
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(distill("expected.json")).unwrap()).unwrap()
}

fn tokenizer() -> String {
    fixture_file("preference", "tokenizer/tokenizer.json")
        .display()
        .to_string()
}

/// The flags of a fixture case, from the settings TRL ran with.
fn flags(settings: &Value) -> Vec<String> {
    let s = |k: &str| settings[k].clone();
    let num = |k: &str| s(k).as_f64().unwrap().to_string();
    let teacher = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(s("teacher").as_str().unwrap());
    let mut f: Vec<String> = [
        "train",
        "--objective",
        "distillation",
        "--checkpoint",
        fixture("gqa_llama3").to_str().unwrap(),
        "--tokenizer",
        &tokenizer(),
        "--teacher",
        teacher.to_str().unwrap(),
        "--rollouts",
        distill("rollouts.jsonl").to_str().unwrap(),
        "--seq",
        "16",
        "--steps",
        "1",
        "--clip-norm",
        "0",
        "--weight-decay",
        "0",
        "--log-every",
        "1",
    ]
    .map(String::from)
    .to_vec();
    for (flag, key) in [
        ("--batch", "per_device_train_batch_size"),
        ("--beta", "beta"),
        ("--temperature", "temperature"),
        ("--max-completion-length", "max_completion_length"),
        ("--lr", "learning_rate"),
    ] {
        f.extend([flag.into(), num(key)]);
    }
    f.extend([
        "--optimizer".into(),
        match s("optim").as_str().unwrap() {
            "sgd" => "sgd".into(),
            _ => "adamw".into(),
        },
    ]);
    let adapter = match s("start").as_str().unwrap() {
        "init" => "adapters/init",
        _ => "adapters/fresh",
    };
    f.extend([
        "--init-adapter".into(),
        fixture_file("grpo", adapter).display().to_string(),
    ]);
    f
}

/// What TRL logs that is not a figure of the step.
const NOT_COMPARED: [&str; 3] = ["epoch", "learning_rate", "num_tokens"];

/// Runs case `name` with `extra` flags; checks the step's figures and
/// the adapter it saves against TRL's.
fn check(name: &str, extra: &[&str]) {
    let want = &expected()[name];
    let tmp = scratch("distill", &format!("{name}{}", extra.len()));
    let (out, metrics) = (tmp.join("run"), tmp.join("metrics.jsonl"));
    let mut args = flags(&want["settings"]);
    for (flag, path) in [("--out", &out), ("--metrics", &metrics)] {
        args.extend([flag.into(), path.display().to_string()]);
    }
    let args = with_flags(args, extra);
    ok(&hlo_train(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    let line: Value = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .find(|l: &Value| l.get("loss").is_some())
        .unwrap();
    let what = |k: &str| format!("{name} {extra:?}: {k}");
    close(
        &what("loss"),
        line["loss"].as_f64().unwrap(),
        want["loss"].as_f64().unwrap(),
        1e-5,
    );
    for (key, v) in want["logged"].as_object().unwrap() {
        if NOT_COMPARED.contains(&key.as_str()) {
            continue;
        }
        let got = line[key.as_str()]
            .as_f64()
            .unwrap_or_else(|| panic!("{} is not written", what(key)));
        close(&what(key), got, v.as_f64().unwrap(), 1e-5);
    }
    // The run's recipe holds distillation's settings, no rollout
    // objective's groups or rewards.
    let recipe = std::fs::read_to_string(out.join("recipe.yaml")).unwrap();
    assert!(
        recipe.contains("teacher:")
            && recipe.contains("beta:")
            && !recipe.contains("num_generations")
            && !recipe.contains("reward"),
        "{recipe}"
    );
    let lr = want["settings"]["learning_rate"].as_f64().unwrap();
    let tol = 1e-6 * (lr / 0.1).max(1.0);
    assert_adapter_as_fixture(&out, &[distill("expected.safetensors")], name, tol);
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn forward_and_reverse_kl_the_jsd_temperatures_and_adamw_equal_trl() {
    let cases = expected();
    let names: Vec<&String> = cases
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| !k.starts_with('_'))
        .collect();
    assert!(names.len() >= 6, "{names:?}");
    for name in names {
        check(name, &[]);
    }
}

#[test]
fn a_mesh_equals_trl() {
    let mesh = ["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"];
    for name in ["b1.0.t1.0", "b0.5.t0.7"] {
        check(name, &mesh);
    }
}

/// Online: the student generates a completion of each prompt and learns
/// the teacher's distributions over them; the run reports TRL's figures
/// and no rewards.
#[test]
fn online_distillation_generates_and_reports_no_rewards() {
    let tmp = scratch("distill", "online");
    let prompts = tmp.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\":\"XYZ=\"}\n{\"prompt\":\"KP=\"}\n{\"prompt\":\"AB=\"}\n{\"prompt\":\"CD=\"}\n",
    )
    .unwrap();
    let metrics = tmp.join("metrics.jsonl");
    let teacher = fixture_file("qlora", "llama");
    ok(&hlo_train(&[
        "train",
        "--objective",
        "distillation",
        "--checkpoint",
        fixture("gqa_llama3").to_str().unwrap(),
        "--tokenizer",
        &tokenizer(),
        "--teacher",
        teacher.to_str().unwrap(),
        "--data",
        prompts.to_str().unwrap(),
        "--batch",
        "4",
        "--max-completion-length",
        "4",
        "--seq",
        "16",
        "--steps",
        "2",
        "--metrics",
        metrics.to_str().unwrap(),
        "--out",
        tmp.join("run").to_str().unwrap(),
    ]));
    let lines: Vec<Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        let loss = l["loss"].as_f64().unwrap();
        assert!(loss.is_finite() && loss >= 0.0, "a divergence: {l}");
        assert!(l["completions/mean_length"].as_f64().is_some(), "{l}");
        assert!(l.get("reward").is_none(), "no rewards: {l}");
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn a_teacher_it_cannot_use_and_settings_it_does_not_read_are_refused_in_one_line() {
    let base = |extra: &[&str]| {
        let mut args: Vec<String> = [
            "train",
            "--objective",
            "distillation",
            "--checkpoint",
            fixture("gqa_llama3").to_str().unwrap(),
            "--tokenizer",
            &tokenizer(),
            "--rollouts",
            distill("rollouts.jsonl").to_str().unwrap(),
            "--batch",
            "8",
            "--seq",
            "16",
            "--steps",
            "1",
        ]
        .map(String::from)
        .to_vec();
        args.extend(extra.iter().map(|s| s.to_string()));
        one_line_error(&hlo_train(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        ))
    };
    let other_vocab = fixture("head_dim");
    let cases: [(Vec<&str>, &str); 5] = [
        (vec![], "give --teacher DIR"),
        (
            vec!["--teacher", other_vocab.to_str().unwrap()],
            "has a vocabulary of 112, the student 128",
        ),
        (
            vec!["--teacher", other_vocab.to_str().unwrap(), "--beta", "1.5"],
            "--beta must be in [0, 1]",
        ),
        (
            vec![
                "--teacher",
                other_vocab.to_str().unwrap(),
                "--num-generations",
                "4",
            ],
            "distillation has no such setting; leave out --num-generations (it is read by grpo, rloo)",
        ),
        (
            vec![
                "--teacher",
                other_vocab.to_str().unwrap(),
                "--reward",
                "length",
            ],
            "distillation has no such setting; leave out --reward (it is read by grpo, rloo)",
        ),
    ];
    for (extra, says) in cases {
        let e = base(&extra);
        assert!(e.contains(says), "{extra:?}: {e}");
    }
}
