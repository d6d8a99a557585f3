//! `hlo-train train --objective rloo --rollouts FILE` against TRL 1.16's
//! own `RLOOTrainer` (fixtures made by `scripts/make_rloo_fixtures.py`;
//! formulas in `tests/fixtures/rloo/FORMULAS.md`): on the tiny f32 Llama
//! and GRPO's fixture rollouts (two prompts of four fixed completions
//! each), every step's loss, gradient norm and every metric the run
//! writes equal TRL's to 1e-5, and the adapter it saves after the last
//! step equals TRL's to 1e-6 — with and without β (the KL penalty in the
//! reward, against the base, a copy of the adapter training starts from
//! or another adapter), μ = 1 and μ = 2, normalised advantages, clipped
//! rewards, ε_high, a temperature, AdamW and two logged rewards with
//! TRL's `reward_weights`; on one device and on a `dp=1,fsdp=2,mp=2`
//! mesh. Also: RLOO online (generating), resumed between iterations, and
//! the settings it refuses.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value;

fn rloo(name: &str) -> PathBuf {
    fixture_file("rloo", name)
}

fn grpo(name: &str) -> PathBuf {
    fixture_file("grpo", name)
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(rloo("expected.json")).unwrap()).unwrap()
}

/// The flags of a fixture case, from the settings TRL ran with.
fn flags(settings: &Value) -> Vec<String> {
    let s = |k: &str| settings[k].clone();
    let num = |k: &str| s(k).as_f64().unwrap().to_string();
    let mut f: Vec<String> = vec![
        "--objective".into(),
        "rloo".into(),
        "--checkpoint".into(),
        fixture("gqa_llama3").display().to_string(),
        "--tokenizer".into(),
        fixture_file("preference", "tokenizer/tokenizer.json")
            .display()
            .to_string(),
        "--rollouts".into(),
        grpo(s("rollouts").as_str().unwrap()).display().to_string(),
        "--seq".into(),
        "16".into(),
        "--clip-norm".into(),
        "0".into(),
        "--optimizer".into(),
        match s("optim").as_str().unwrap() {
            "sgd" => "sgd".into(),
            _ => "adamw".into(),
        },
        "--weight-decay".into(),
        "0".into(),
        "--log-every".into(),
        "1".into(),
    ];
    for (flag, key) in [
        ("--batch", "per_device_train_batch_size"),
        ("--num-generations", "num_generations"),
        ("--steps", "max_steps"),
        ("--beta", "beta"),
        ("--num-iterations", "num_iterations"),
        ("--epsilon", "epsilon"),
        ("--max-completion-length", "max_completion_length"),
        ("--temperature", "temperature"),
        ("--lr", "learning_rate"),
    ] {
        f.extend([flag.into(), num(key)]);
    }
    if let Some(w) = s("reward_weights").as_array() {
        let names = s("reward_funcs");
        let pairs: Vec<String> = (names.as_array().unwrap().iter().zip(w))
            .map(|(n, w)| format!("{}:{}", n.as_str().unwrap(), w))
            .collect();
        f.extend(["--reward-weights".into(), pairs.join(",")]);
    }
    if let Some(e) = s("epsilon_high_given").as_f64() {
        f.extend(["--epsilon-high".into(), e.to_string()]);
    }
    if s("normalize_advantages").as_bool() == Some(true) {
        f.push("--normalize-advantages".into());
    }
    if let Some(r) = s("reward_clip_range").as_array() {
        let r: Vec<String> = r.iter().map(|v| v.as_f64().unwrap().to_string()).collect();
        f.extend(["--reward-clip-range".into(), r.join(",")]);
    }
    let adapter = |a: &str| grpo(a).display().to_string();
    match s("start").as_str().unwrap() {
        "fresh" => f.extend(["--init-adapter".into(), adapter("adapters/fresh")]),
        "init" => f.extend(["--init-adapter".into(), adapter("adapters/init")]),
        "ref" => f.extend([
            "--init-adapter".into(),
            adapter("adapters/init"),
            "--ref-adapter".into(),
            adapter("adapters/ref"),
        ]),
        other => panic!("start {other}"),
    }
    f
}

/// What TRL logs that is not a figure of the step: the schedule's
/// position, and `num_tokens` (a running count).
const NOT_COMPARED: [&str; 3] = ["epoch", "learning_rate", "num_tokens"];

/// The metrics file's line of each step.
fn steps_written(metrics: &Path) -> Vec<Value> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|l| l.get("loss").is_some())
        .collect()
}

/// Every figure TRL logged at each of `want`'s steps, as the run wrote it.
fn assert_steps_as_trl(what: &str, want: &Value, lines: &[Value]) {
    for trl in want["steps"].as_array().unwrap() {
        let step = trl["step"].as_u64().unwrap();
        let ours = lines
            .iter()
            .find(|l| l["step"] == step)
            .unwrap_or_else(|| panic!("{what}: step {step}"));
        for (key, v) in trl["logged"].as_object().unwrap() {
            if NOT_COMPARED.contains(&key.as_str()) {
                continue;
            }
            let k = format!("{what}: step {step} {key}");
            let got = ours[key.as_str()]
                .as_f64()
                .unwrap_or_else(|| panic!("{k} is not written"));
            close(&k, got, v.as_f64().unwrap(), 1e-5);
        }
        // What TRL logs only when it generates, the run writes only then.
        for key in ["reward", "kl"] {
            if trl["logged"].get(key).is_none() {
                assert!(ours.get(key).is_none(), "{what}: step {step} {key}");
            }
        }
    }
}

/// Runs the case `name` with `extra` flags; checks every step's figures
/// and the adapter saved after the last (to 1e-6 per 0.1 of learning
/// rate: rounding grows with the step).
fn check(name: &str, extra: &[&str]) {
    let want = &expected()[name];
    let tmp = scratch("rloo", &format!("{name}{}", extra.len()));
    let (out, metrics) = (tmp.join("run"), tmp.join("metrics.jsonl"));
    let mut args: Vec<String> = vec!["train".into()];
    args.extend(flags(&want["settings"]));
    for (flag, path) in [("--out", &out), ("--metrics", &metrics)] {
        args.extend([flag.into(), path.display().to_string()]);
    }
    let args = with_flags(args, extra);
    ok(&hlo_train(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    let what = format!("{name} {extra:?}");
    assert_steps_as_trl(&what, want, &steps_written(&metrics));
    let last = want["steps"].as_array().unwrap().len();
    let lr = want["settings"]["learning_rate"].as_f64().unwrap();
    let tol = 1e-6 * (lr / 0.1).max(1.0);
    assert_adapter_as_fixture(
        &out,
        &[rloo("expected.safetensors")],
        &format!("{name}.step{last}"),
        tol,
    );
    // The run's recipe holds RLOO's settings and its rollouts', not
    // GRPO's loss settings.
    let recipe = std::fs::read_to_string(out.join("recipe.yaml")).unwrap();
    assert!(
        recipe.contains("normalize_advantages")
            && recipe.contains("num_generations")
            && !recipe.contains("loss_type"),
        "{recipe}"
    );
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn with_and_without_the_kl_penalty_once_and_twice_equals_trl() {
    for name in [
        "b0.0.mu1",
        "b0.0.mu2",
        "b0.05.mu1",
        "b0.05.mu2",
        "b0.05.mu1.init",
        "b0.05.mu2.init",
        "b0.05.mu1.ref",
        "b0.05.mu2.ref",
        "b0.5.mu1.ref",
    ] {
        check(name, &[]);
    }
}

#[test]
fn normalising_clipping_temperature_adamw_and_two_rewards_equal_trl() {
    for name in [
        "b0.0.mu1.norm",
        "b0.05.mu1.ref.norm",
        "b0.05.mu1.ref.clip",
        "b0.0.mu2.eps_high",
        "b0.05.mu2.ref.temp0.7",
        "b0.0.mu1.adamw",
        "b0.05.mu2.ref.adamw",
        "b0.0.mu1.tied",
        "b0.0.mu1.two_rewards",
    ] {
        check(name, &[]);
    }
}

#[test]
fn a_mesh_equals_trl() {
    let mesh = ["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"];
    for name in ["b0.05.mu2.ref", "b0.0.mu2.eps_high", "b0.05.mu1.ref.norm"] {
        check(name, &mesh);
    }
}

/// A μ = 2 run saved after its first step and resumed ends as TRL's two
/// steps: the batch, its advantages and old log-probabilities are saved
/// with the run.
#[test]
fn a_run_resumed_between_two_iterations_ends_as_trl() {
    let name = "b0.05.mu2.ref";
    let want = &expected()[name];
    let tmp = scratch("rloo", "resume-mu2");
    let (out, metrics) = (tmp.join("run"), tmp.join("metrics.jsonl"));
    let mut args = vec!["train".to_string()];
    args.extend(flags(&want["settings"]));
    for (flag, path) in [("--out", &out), ("--metrics", &metrics)] {
        args.extend([flag.into(), path.display().to_string()]);
    }
    let args = with_flags(args, &["--steps", "1"]);
    ok(&hlo_train(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    assert!(out.join("train_state/rollout_batch.json").is_file());
    let resume = ["train", "--resume", out.to_str().unwrap(), "--steps", "2"];
    ok(&hlo_train(&resume));
    assert_steps_as_trl(name, want, &steps_written(&metrics));
    let theirs = [rloo("expected.safetensors")];
    assert_adapter_as_fixture(&out, &theirs, &format!("{name}.step2"), 1e-6);
    std::fs::remove_dir_all(tmp).unwrap();
}

/// Online: the policy generates each prompt's completions, a rule rewards
/// them, and RLOO's figures are written under TRL's names.
#[test]
fn online_rloo_generates_rewards_and_reports_as_trl_names() {
    let tmp = scratch("rloo", "online");
    let prompts = tmp.join("prompts.jsonl");
    // Printable ASCII the fixture tokenizer keeps one id a byte.
    let rows: String = ["XYZ=", "KP=", "AB=", "CD="]
        .iter()
        .map(|p| format!("{{\"prompt\":\"{p}\"}}\n"))
        .collect();
    std::fs::write(&prompts, rows).unwrap();
    let metrics = tmp.join("metrics.jsonl");
    ok(&hlo_train(&[
        "train",
        "--objective",
        "rloo",
        "--checkpoint",
        fixture("gqa_llama3").to_str().unwrap(),
        "--tokenizer",
        fixture_file("preference", "tokenizer/tokenizer.json")
            .to_str()
            .unwrap(),
        "--data",
        prompts.to_str().unwrap(),
        "--reward",
        "length",
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
    let lines = steps_written(&metrics);
    assert_eq!(lines.len(), 2);
    for l in &lines {
        // TRL's defaults: two completions a prompt, β 0.05 (so a KL).
        for key in [
            "reward",
            "kl",
            "frac_reward_zero_std",
            "clip_ratio/region_mean",
        ] {
            assert!(l[key].as_f64().is_some(), "{key} in {l}");
        }
        // The length reward is −tokens / max: within [−1, 0].
        let r = l["rewards/length/mean"].as_f64().unwrap();
        assert!((-1.0..=0.0).contains(&r), "{l}");
    }
    // The charts name the objective: RLOO's reward, not GRPO's.
    let svg = |name: &str| std::fs::read_to_string(tmp.join("run").join(name)).unwrap();
    let (rewards, loss) = (svg("reward.svg"), svg("loss.svg"));
    assert!(
        rewards.contains("RLOO reward") && !rewards.contains("GRPO"),
        "{rewards}"
    );
    assert!(loss.contains("RLOO loss"), "{loss}");
    std::fs::remove_dir_all(tmp).unwrap();
}

/// GRPO's loss settings are not RLOO's, RLOO's are not GRPO's, and a
/// clip range must be one.
#[test]
fn settings_of_another_objective_or_out_of_range_are_refused_in_one_line() {
    let base = |objective: &str| -> Vec<String> {
        let mut f = flags(&expected()["b0.0.mu1"]["settings"]);
        let k = f.iter().position(|a| a == "rloo").unwrap();
        f[k] = objective.into();
        let mut args = vec!["train".to_string()];
        args.extend(f);
        args
    };
    for (objective, extra, says) in [
        (
            "rloo",
            &["--loss-type", "grpo"][..],
            "--loss-type is a GRPO setting",
        ),
        (
            "rloo",
            &["--scale-rewards", "none"],
            "--scale-rewards is a GRPO setting",
        ),
        (
            "grpo",
            &["--normalize-advantages"],
            "--normalize-advantages is a RLOO setting",
        ),
        (
            "grpo",
            &["--reward-clip-range", "0,1"],
            "--reward-clip-range is a RLOO setting",
        ),
        ("rloo", &["--reward-clip-range", "1,0"], "not MIN,MAX"),
        ("rloo", &["--reward-clip-range", "x"], "not MIN,MAX"),
        (
            "rloo",
            &["--num-generations", "3"],
            "--objective rloo: --batch 8 must be a multiple of --num-generations 3",
        ),
        (
            "rloo",
            &["--eval-data", "x.jsonl"],
            "--objective rloo: RLOO has no held-out loss",
        ),
    ] {
        let args = with_flags(base(objective), extra);
        let out = hlo_train(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let e = one_line_error(&out);
        assert!(e.contains(says), "{objective} {extra:?}: {e}");
    }
}
