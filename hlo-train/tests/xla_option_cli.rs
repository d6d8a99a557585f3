//! `--xla-option KEY=VALUE`: the CPU plugin compiles the run with it, the
//! run records it (train state and recipe), `--resume` and `--recipe` take
//! it back, and a bad option is one line with exit code 2.

mod common;

use common::*;

/// A short run's flags (the tiny preset on the demo task).
const SHORT: [&str; 7] = ["train", "--steps", "1", "--batch", "2", "--seq", "8"];

fn train(extra: &[&str]) -> std::process::Output {
    let mut args = SHORT.to_vec();
    args.extend(extra);
    hlo_train(&args)
}

#[test]
fn a_run_compiles_with_its_options_and_keeps_them() {
    let dir = scratch("xla-option", "kept");
    let out = dir.join("run");
    let out_s = out.to_str().expect("a UTF-8 path");
    let given = "xla_cpu_enable_fast_math=false";
    ok(&train(&["--xla-option", given, "--out", out_s]));
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("train_state/state.json")).expect("state.json"),
    )
    .expect("JSON");
    assert_eq!(
        state["settings"]["xla-option"],
        serde_json::json!([given]),
        "{state}"
    );
    let recipe = std::fs::read_to_string(out.join("recipe.yaml")).expect("recipe.yaml");
    assert!(
        recipe.contains(&format!("xla_option: [\"{given}\"]")),
        "{recipe}"
    );
    // The saved options come back: a resumed run with an option XLA does
    // not know fails at its first compile, naming it.
    let bad_state = state.to_string().replace(given, "xla_no_such_option=true");
    std::fs::write(out.join("train_state/state.json"), bad_state).expect("write state.json");
    let err = one_line_error(&hlo_train(&["train", "--resume", out_s, "--steps", "2"]));
    assert!(err.contains("No such compile option"), "{err}");
    // So does the recipe's.
    let recipe_path = dir.join("recipe.yaml");
    std::fs::write(
        &recipe_path,
        recipe.replace(given, "xla_no_such_option=true"),
    )
    .expect("write the recipe");
    let err = one_line_error(&hlo_train(&[
        "train",
        "--recipe",
        recipe_path.to_str().expect("a UTF-8 path"),
        "--steps",
        "1",
    ]));
    assert!(err.contains("xla_no_such_option"), "{err}");
}

#[test]
fn a_bad_option_is_one_line() {
    for (option, want) in [
        ("Bad-Key=1", "not an XLA flag name"),
        ("xla_cpu_enable_fast_math", "is not KEY=VALUE"),
        ("=1", "not an XLA flag name"),
        ("xla_no_such_option=true", "No such compile option"),
        ("xla_cpu_enable_fast_math=3", "not a valid bool value"),
    ] {
        let err = one_line_error(&train(&["--xla-option", option]));
        assert!(err.contains(want), "{option}: {err} (wanted {want})");
    }
}

/// A value XLA takes for a flag and then aborts the process on (a C++
/// exception Rust cannot catch: exit 134) is refused in one line before
/// anything compiles, by every command that compiles; so is one XLA
/// would spend memory without bound on. A value inside the range runs.
#[test]
fn values_xla_would_abort_on_are_refused_before_compiling() {
    let key = "xla_cpu_parallel_codegen_split_count";
    for value in ["-5", "0", " -5", "4097", "2147483647"] {
        let option = format!("{key}={value}");
        for command in [
            vec!["train", "--steps", "1", "--batch", "2", "--seq", "8"],
            vec!["eval", "--batch", "2", "--seq", "8"],
            vec!["generate", "--prompt", "a", "--max-new-tokens", "2"],
        ] {
            let mut args = command.clone();
            args.extend(["--xla-option", &option]);
            let err = one_line_error(&hlo_train(&args));
            assert!(
                err.contains(&format!("{key}={value}: XLA takes 1 to 4096")),
                "{command:?} {option}: {err}"
            );
        }
    }
    ok(&train(&["--xla-option", &format!("{key}=2")]));
}
