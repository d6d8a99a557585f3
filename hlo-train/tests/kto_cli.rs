//! `hlo-train train --objective kto` against TRL 1.16's own KTOTrainer
//! (fixtures made by `scripts/make_kto_fixtures.py`; formulas in
//! `tests/fixtures/kto/FORMULAS.md`): on the tiny f32 Llama and four
//! unpaired examples (or four preference pairs, unpaired), one step's loss
//! and every metric the run writes equal TRL's first step's to 1e-5, and
//! the adapter it saves after one SGD or AdamW step equals TRL's to 1e-6:
//! both loss types (`kto`, `apo_zero_unpaired`), from a fresh adapter (the
//! base as the reference), from `--init-adapter` (a frozen copy of it) and
//! with `--ref-adapter` (a reference unlike the policy, so the log-ratios
//! and the KL estimate are not 0); pre-tokenized and string rows; on one
//! device and on a `dp=1,fsdp=2,mp=2` mesh.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::Value;

fn kto(name: &str) -> PathBuf {
    fixture_file("kto", name)
}

fn preference(name: &str) -> PathBuf {
    fixture_file("preference", name)
}

/// Every case of `expected.json`, `expected_ref.json` and
/// `expected_precompute.json`.
fn expected() -> Value {
    let read = |f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(kto(f)).unwrap()).unwrap()
    };
    let mut all = read("expected.json");
    for more in [
        "expected_ref.json",
        "expected_precompute.json",
        "expected_full.json",
    ] {
        if let (Some(a), Value::Object(b)) = (all.as_object_mut(), read(more)) {
            a.extend(b);
        }
    }
    all
}

/// The flags of case `<loss>.<start>.<optimizer>[.<variant>]`: TRL's
/// settings (SGD lr 0.1 or AdamW lr 1e-3 without weight decay, no
/// clipping, β 0.1), the adapter it starts from and its reference.
fn flags(name: &str) -> Vec<String> {
    let parts: Vec<&str> = name.split('.').collect();
    let (loss, start, optimizer) = (parts[0], parts[1], parts[2]);
    let paired = parts.get(3) == Some(&"paired");
    let checkpoint = fixture("gqa_llama3");
    let mut f: Vec<String> = [
        "--objective",
        "kto",
        "--kto-loss-type",
        if loss == "apo" {
            "apo_zero_unpaired"
        } else {
            "kto"
        },
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--batch",
        if paired { "8" } else { "4" },
        "--seq",
        "16",
        "--steps",
        "1",
        "--clip-norm",
        "0",
        "--optimizer",
        optimizer,
    ]
    .map(String::from)
    .to_vec();
    // Full finetuning's AdamW step is smaller: one gradient entry sits
    // at AdamW's eps, where f32 and f64 part (make_kto_fixtures.py).
    let more: &[&str] = match (optimizer, start) {
        ("sgd", _) => &["--lr", "0.1"],
        (_, "full") => &["--lr", "1e-4", "--weight-decay", "0"],
        _ => &["--lr", "1e-3", "--weight-decay", "0"],
    };
    f.extend(more.iter().map(|s| s.to_string()));
    if parts.contains(&"precompute") {
        f.push("--precompute-ref".into());
    }
    if parts.get(3) == Some(&"weights") {
        f.extend(["--desirable-weight", "1.5", "--undesirable-weight", "0.5"].map(String::from));
    }
    let adapter = |a: &str| preference(&format!("adapters/{a}")).display().to_string();
    match start {
        // Every weight trained, the reference the base as it starts,
        // scored before training (TRL's precompute_ref_log_probs).
        "full" => f.extend(["--full", "--precompute-ref"].map(String::from)),
        "fresh" => f.extend(["--init-adapter".into(), adapter("fresh")]),
        "init" => f.extend(["--init-adapter".into(), adapter("init")]),
        _ => f.extend([
            "--init-adapter".into(),
            adapter("fresh"),
            "--ref-adapter".into(),
            adapter("ref"),
        ]),
    }
    let tokenizer = preference("tokenizer/tokenizer.json").display().to_string();
    match paired {
        true => f.extend([
            "--data".into(),
            preference("data.jsonl").display().to_string(),
            "--tokenizer".into(),
            tokenizer,
        ]),
        false => f.extend(["--data".into(), kto("data_ids.jsonl").display().to_string()]),
    }
    f
}

/// The metrics TRL logs that a run writes too.
const COMPARED: [&str; 10] = [
    "grad_norm",
    "kl",
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "logps/chosen",
    "logps/rejected",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
];

/// Runs case `name` with `extra` flags; checks the step's loss and
/// metrics and the saved adapter against TRL's.
fn check(name: &str, extra: &[&str]) {
    let tmp = scratch("kto", &format!("{name}{}", extra.len()));
    let (out, metrics) = (tmp.join("run"), tmp.join("metrics.jsonl"));
    let mut args: Vec<String> = vec!["train".into()];
    args.extend(flags(name));
    for (flag, path) in [("--out", &out), ("--metrics", &metrics)] {
        args.extend([flag.into(), path.display().to_string()]);
    }
    let args = with_flags(args, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let said = ok(&hlo_train(&args));
    let want = &expected()[name];
    let text = std::fs::read_to_string(&metrics).unwrap();
    let step: Value = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|l| l.get("loss").is_some())
        .unwrap();
    // The step's log line shows KTO's own figures, as TRL logs them.
    let line = said.lines().find(|l| l.starts_with("step ")).unwrap();
    for key in [
        "kl",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
    ] {
        let shown = format!(" {key} {:.4}", step[key].as_f64().unwrap());
        assert!(line.contains(&shown), "{line}: no{shown}");
    }
    let what = |k: &str| format!("{name} {extra:?}: {k}");
    let trl = want["loss"].as_f64().unwrap();
    close(&what("loss"), step["loss"].as_f64().unwrap(), trl, 1e-5);
    for key in COMPARED {
        let trl = want["metrics"][key].as_f64().unwrap();
        let got = step[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{}", what(key)));
        close(&what(key), got, trl, 1e-5);
    }
    // The run's recipe holds KTO's settings, no other objective's.
    let recipe = std::fs::read_to_string(out.join("recipe.yaml")).unwrap();
    assert!(
        recipe.contains("kto_loss_type") && !recipe.contains("simpo_gamma"),
        "{recipe}"
    );
    if name.contains(".full.") {
        assert_weights_as_fixture(&out, name);
    } else {
        let theirs = [
            "expected.safetensors",
            "expected_ref.safetensors",
            "expected_precompute.safetensors",
        ]
        .map(kto);
        assert_adapter_as_fixture(&out, &theirs, name, 1e-6);
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

/// Every weight of the HF folder a full finetuning run saved in `out`
/// equals case `name`'s after TRL's step: to 1e-6 after SGD; after AdamW
/// to 1e-5, a tenth of its learning rate, because one entry's gradient
/// (layer 1's v_proj, 6.5e-9) sits at AdamW's eps of 1e-8, where two f32
/// sums of the same gradient move the update by up to a tenth of the rate
/// (make_kto_fixtures.py measures TRL's own f32 against f64: 4.5e-6; every
/// other weight agrees to 1e-6).
fn assert_weights_as_fixture(out: &std::path::Path, name: &str) {
    let tol = if name.ends_with("adamw") { 1e-5 } else { 1e-6 };
    use hlo_engine::models::io::read_safetensors;
    let ours = read_safetensors(&out.join("model.safetensors")).unwrap();
    let theirs = read_safetensors(&kto("expected_full.safetensors")).unwrap();
    let mut compared = 0;
    for (key, t) in &theirs {
        let Some(tensor) = key.strip_prefix(&format!("{name}.")) else {
            continue;
        };
        let mine = &ours
            .iter()
            .find(|(k, _)| k == tensor)
            .unwrap_or_else(|| panic!("{name}: {tensor} is not written"))
            .1;
        let d = max_diff(&mine.to_f64s(), &t.to_f64s());
        assert!(d < tol, "{name}: {tensor} differs by {d:e}");
        compared += 1;
    }
    assert_eq!(compared, ours.len(), "{name}: every weight compared");
}

/// Full finetuning, its reference computed before training (the base as
/// it starts), for both loss types and both optimizers.
#[test]
fn full_finetuning_with_a_precomputed_reference_equals_trl() {
    for name in [
        "kto.full.sgd",
        "kto.full.adamw",
        "apo.full.sgd",
        "apo.full.adamw",
    ] {
        check(name, &[]);
    }
}

#[test]
fn kto_and_apo_equal_trl_against_the_base_and_a_copy_of_the_adapter() {
    for loss in ["kto", "apo"] {
        for start in ["fresh", "init"] {
            for optimizer in ["sgd", "adamw"] {
                check(&format!("{loss}.{start}.{optimizer}"), &[]);
            }
        }
    }
    check("kto.fresh.sgd.weights", &[]);
}

/// A reference unlike the policy: the log-ratios, rewards and the KL
/// estimate are not 0 (clamped at 0 in the paired case, whose mean KL
/// difference is negative).
#[test]
fn kto_equals_trl_against_another_adapter_with_its_kl_estimate() {
    for name in [
        "kto.ref.sgd",
        "kto.ref.adamw",
        "apo.ref.sgd",
        "kto.ref.sgd.paired",
    ] {
        check(name, &[]);
    }
}

/// A batch without an undesirable example (the first four of the pairs,
/// unpaired: every chosen side first) has no `rewards/rejected`, and no
/// margin: the run's metrics leave them out, as TRL's do.
#[test]
fn a_mean_over_a_label_the_batch_lacks_is_left_out() {
    let tmp = scratch("kto", "one_label");
    let metrics = tmp.join("metrics.jsonl");
    let mut args = flags("kto.fresh.sgd.paired");
    args.insert(0, "train".into());
    let args = with_flags(
        args,
        &["--batch", "4", "--metrics", metrics.to_str().unwrap()],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&hlo_train(&args));
    let line: Value =
        serde_json::from_str(std::fs::read_to_string(&metrics).unwrap().trim()).unwrap();
    for key in [
        "loss",
        "kl",
        "rewards/chosen",
        "logps/chosen",
        "logits/chosen",
    ] {
        assert!(line[key].is_number(), "{key} in {line}");
    }
    for key in [
        "rewards/rejected",
        "logps/rejected",
        "logits/rejected",
        "rewards/margins",
    ] {
        assert!(line.get(key).is_none(), "{key} in {line}");
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

/// Preference pairs unpaired as TRL unpairs them; string rows through
/// the fixture's tokenizer are the pre-tokenized ones; a 1×2×2 mesh
/// computes the same step.
#[test]
fn pairs_string_rows_and_a_mesh_equal_trl() {
    check("kto.fresh.sgd.paired", &[]);
    let tokenizer = preference("tokenizer/tokenizer.json");
    let data = kto("data.jsonl");
    let strings = [
        "--data",
        data.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
    ];
    check("kto.ref.sgd", &strings);
    check(
        "kto.ref.sgd",
        &["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"],
    );
}

/// The reference's log-probabilities computed before training
/// (`--precompute-ref`, TRL's `precompute_ref_log_probs`): each example's
/// and its KL row's, the step then running no reference forward.
#[test]
fn a_reference_computed_before_training_equals_trl() {
    for name in [
        "kto.fresh.sgd.precompute",
        "kto.ref.sgd.precompute",
        "apo.ref.sgd.precompute",
        "kto.ref.adamw.precompute",
    ] {
        check(name, &[]);
    }
    check(
        "kto.ref.sgd.precompute",
        &["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"],
    );
}

/// Examples past the last whole batch are not trained (a step's shape is
/// fixed; TRL trains a shorter last batch): the header says how many.
#[test]
fn the_header_says_which_examples_a_whole_batch_leaves_out() {
    let mut args = flags("kto.fresh.sgd.paired");
    args.insert(0, "train".into());
    let args = with_flags(args, &["--batch", "3"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let said = ok(&hlo_train(&args));
    let data = said.lines().find(|l| l.starts_with("data: ")).unwrap();
    let n: usize = data["data: ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(data.contains(" examples,"), "{data}");
    let past = n % 3;
    assert!(
        past > 0,
        "the fixture's {n} examples fill whole batches of 3"
    );
    assert!(
        data.contains(&format!(
            "; {past} examples past the last whole batch of 3 left out"
        )),
        "{data}"
    );
}
