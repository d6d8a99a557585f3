//! `hlo-train train --objective dpo|ipo|simpo|orpo|cpo` against TRL 1.16's
//! own trainers (fixtures made by `scripts/make_preference_fixtures.py`;
//! formulas in `tests/fixtures/preference/FORMULAS.md`): on the tiny f32
//! Llama and four pairs, one step's loss and every metric the run writes
//! equal TRL's first step's to 1e-5, and the adapter it saves after one
//! SGD or AdamW step equals TRL's to 1e-6: from a fresh adapter (the base
//! as the reference), from `--init-adapter` (a frozen copy of it) and
//! with `--ref-adapter`; pre-tokenized pairs and string pairs through the
//! fixture's tokenizer; on one device and on a `dp=1,fsdp=2,mp=2` mesh.
//! The held-out evaluation gives the same figures before the first step.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use hlo_engine::models::io::read_safetensors;
use serde_json::Value;

fn preference(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/preference")
        .join(name)
}

/// Every case of `expected.json`, `expected_more.json`,
/// `expected_two.json` and CPO's `cpo/expected.json`.
fn expected() -> Value {
    let read = |f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(preference(f)).unwrap()).unwrap()
    };
    let mut all = read("expected.json");
    for more in [
        "expected_more.json",
        "expected_two.json",
        "cpo/expected.json",
    ] {
        if let (Some(a), Value::Object(b)) = (all.as_object_mut(), read(more)) {
            a.extend(b);
        }
    }
    all
}

/// A fixture case: `<method>.<start>.<optimizer>[.<variant>]`.
struct Case {
    method: &'static str,
    start: &'static str,
    optimizer: &'static str,
    /// `chat`: conversational pairs; `nf4`: the 128-wide QLoRA fixture
    /// base in NF4, with its own adapters (cases of `expected_more`).
    variant: Option<&'static str>,
}

impl Case {
    fn new(method: &'static str, start: &'static str, optimizer: &'static str) -> Case {
        Case {
            method,
            start,
            optimizer,
            variant: None,
        }
    }

    fn name(&self) -> String {
        let name = format!("{}.{}.{}", self.method, self.start, self.optimizer);
        match self.variant {
            Some(v) => format!("{name}.{v}"),
            None => name,
        }
    }

    /// The flags of the case: TRL's settings (SGD lr 0.1 or AdamW lr 1e-3
    /// without weight decay, no clipping, β 0.1), the adapter the case
    /// starts from and its reference.
    fn flags(&self) -> Vec<String> {
        let objective = match self.method {
            "simpo_a0" => "simpo",
            "cpo_ls" | "cpo_a0" => "cpo",
            m => m,
        };
        let nf4 = self.variant == Some("nf4");
        let checkpoint = match nf4 {
            true => fixture("../qlora/llama"),
            false => fixture("gqa_llama3"),
        };
        let mut f: Vec<String> = [
            "--objective",
            objective,
            "--checkpoint",
            checkpoint.to_str().unwrap(),
            "--batch",
            "4",
            "--seq",
            // The conversations' rows are longer (up to 23 tokens).
            if self.variant == Some("chat") {
                "32"
            } else {
                "16"
            },
            "--steps",
            "1",
            "--clip-norm",
            "0",
            "--optimizer",
            self.optimizer,
        ]
        .map(String::from)
        .to_vec();
        f.extend(
            match self.optimizer {
                "sgd" => vec!["--lr", "0.1"],
                _ => vec!["--lr", "1e-3", "--weight-decay", "0"],
            }
            .into_iter()
            .map(String::from),
        );
        let settings: &[&str] = match self.method {
            "simpo_a0" | "cpo_a0" => &["--cpo-alpha", "0"],
            "cpo_ls" => &["--label-smoothing", "0.1", "--cpo-alpha", "0.5"],
            _ => &[],
        };
        f.extend(settings.iter().map(|s| s.to_string()));
        if nf4 {
            f.extend(["--quantize".into(), "nf4".into()]);
        }
        let folder = if nf4 { "adapters_nf4" } else { "adapters" };
        let adapter = |a: &str| preference(&format!("{folder}/{a}")).display().to_string();
        // TRL's fresh adapter (B = 0): as the policy it equals the base,
        // so a frozen copy of it is the base as the reference.
        match self.start {
            "fresh" => f.extend(["--init-adapter".into(), adapter("fresh")]),
            "init" => f.extend(["--init-adapter".into(), adapter("init")]),
            // `ref_other`: a reference of another rank, alpha and target
            // set than the trained adapter's (PEFT's two adapters).
            reference => f.extend([
                "--init-adapter".into(),
                adapter("fresh"),
                "--ref-adapter".into(),
                adapter(reference),
            ]),
        }
        f
    }
}

/// The metrics TRL logs that a run writes too. `logits/*` of SimPO and
/// ORPO average padding positions, which depend on the row length: not
/// compared there.
fn compared(method: &str) -> Vec<&'static str> {
    let mut keys = vec![
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ];
    match method {
        "dpo" | "ipo" => keys.extend([
            "logits/chosen",
            "logits/rejected",
            "entropy",
            "mean_token_accuracy",
        ]),
        "orpo" => keys.extend(["nll_loss", "log_odds_ratio", "log_odds_chosen"]),
        _ => keys.push("nll_loss"),
    }
    keys
}

/// Runs `case` with `extra` flags over `data`; checks the step's loss,
/// gradient norm and metrics, the held-out figures before it, and the
/// saved adapter against TRL's.
fn check(case: &Case, data: &Path, extra: &[&str]) {
    let name = case.name();
    let tmp = scratch("preference", &format!("{name}{}", extra.len()));
    let (out, metrics) = (tmp.join("run"), tmp.join("metrics.jsonl"));
    let mut args: Vec<String> = vec!["train".into()];
    args.extend(case.flags());
    for (flag, path) in [
        ("--data", data),
        ("--eval-data", data),
        ("--out", &out),
        ("--metrics", &metrics),
    ] {
        args.extend([flag.into(), path.display().to_string()]);
    }
    let args = with_flags(args, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&hlo_train(&args));
    let want = &expected()[&name];
    let lines: Vec<Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let step = lines.iter().find(|l| l.get("loss").is_some()).unwrap();
    let before = lines.iter().find(|l| l["step"] == 0).unwrap();
    let what = |k: &str| format!("{name} {extra:?}: {k}");
    close(
        &what("loss"),
        step["loss"].as_f64().unwrap(),
        want["loss"].as_f64().unwrap(),
        1e-5,
    );
    close(
        &what("eval_loss"),
        before["eval_loss"].as_f64().unwrap(),
        want["loss"].as_f64().unwrap(),
        1e-5,
    );
    close(
        &what("grad_norm"),
        step["grad_norm"].as_f64().unwrap(),
        want["metrics"]["grad_norm"].as_f64().unwrap(),
        1e-5,
    );
    for key in compared(case.method) {
        let trl = want["metrics"][key].as_f64().unwrap();
        let got = step[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{}", what(key)));
        close(&what(key), got, trl, 1e-5);
        let held = before[format!("eval_{key}")].as_f64().unwrap();
        close(&what(&format!("eval_{key}")), held, trl, 1e-5);
    }
    // The run's recipe holds its objective's settings, no other's.
    let recipe = std::fs::read_to_string(out.join("recipe.yaml")).unwrap();
    assert!(
        recipe.contains("\nbeta: ") && !recipe.contains("num_generations"),
        "{recipe}"
    );
    let theirs = [
        "expected.safetensors",
        "expected_more.safetensors",
        "expected_two.safetensors",
        "cpo/expected.safetensors",
    ]
    .map(preference);
    assert_adapter_as_fixture(&out, &theirs, &name, 1e-6);
    std::fs::remove_dir_all(tmp).unwrap();
}

fn ids() -> PathBuf {
    preference("data_ids.jsonl")
}

#[test]
fn dpo_and_ipo_equal_trl_against_the_base_a_copy_of_the_adapter_and_another_adapter() {
    for method in ["dpo", "ipo"] {
        for start in ["fresh", "init", "ref"] {
            let case = Case::new(method, start, "sgd");
            check(&case, &ids(), &[]);
        }
    }
    for (method, start) in [("dpo", "ref"), ("ipo", "init")] {
        let case = Case::new(method, start, "adamw");
        check(&case, &ids(), &[]);
    }
}

/// A reference adapter with its own LoRA settings (rank 2, alpha 6 on
/// q_proj, o_proj and down_proj, beside a trained rank-4 adapter on q_proj
/// and v_proj), as a PEFT model holding both adapters computes it: on one
/// device and on a mesh.
#[test]
fn a_reference_adapter_of_other_lora_settings_equals_peft_holding_both() {
    for (method, optimizer) in [("dpo", "sgd"), ("dpo", "adamw"), ("ipo", "sgd")] {
        check(&Case::new(method, "ref_other", optimizer), &ids(), &[]);
    }
    let case = Case::new("dpo", "ref_other", "sgd");
    let mesh = ["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"];
    check(&case, &ids(), &mesh);
}

/// PEFT writes `target_modules` from a set: a reference adapter listing
/// them in another order is the same adapter, and the same step.
#[test]
fn a_reference_adapter_listing_its_modules_in_another_order_is_the_same() {
    let tmp = scratch("preference", "reversed_targets");
    let reversed = with_targets_reversed(&preference("adapters/ref"), &tmp.join("ref"));
    let case = Case::new("dpo", "ref", "sgd");
    check(
        &case,
        &ids(),
        &["--ref-adapter", reversed.to_str().unwrap()],
    );
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn simpo_and_orpo_equal_trl_from_a_fresh_and_a_trained_adapter() {
    for method in ["simpo", "simpo_a0", "orpo"] {
        for start in ["fresh", "init"] {
            let case = Case::new(method, start, "sgd");
            check(&case, &ids(), &[]);
        }
    }
    for method in ["simpo", "orpo"] {
        let case = Case::new(method, "init", "adamw");
        check(&case, &ids(), &[]);
    }
}

/// CPO (`CPOTrainer`, `loss_type="sigmoid"`) with its NLL term at TRL's
/// default weight, with label smoothing and half the weight, and without
/// it; on one device and on a 1×2×2 mesh.
#[test]
fn cpo_equals_trl_on_one_device_and_a_mesh() {
    for (method, start, optimizer) in [
        ("cpo", "fresh", "sgd"),
        ("cpo", "init", "sgd"),
        ("cpo", "init", "adamw"),
        ("cpo_ls", "init", "adamw"),
        ("cpo_a0", "fresh", "sgd"),
    ] {
        check(&Case::new(method, start, optimizer), &ids(), &[]);
    }
    let mesh = ["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"];
    check(&Case::new("cpo", "init", "sgd"), &ids(), &mesh);
    check(&Case::new("cpo_ls", "fresh", "sgd"), &ids(), &mesh);
}

/// For each method, string pairs through the fixture's tokenizer (TRL's
/// EOS text appended) are the pre-tokenized pairs, and a 1×2×2 mesh
/// computes the same step.
#[test]
fn string_pairs_and_a_mesh_equal_trl() {
    let tokenizer = preference("tokenizer/tokenizer.json");
    let tokenizer = tokenizer.to_str().unwrap();
    for method in ["dpo", "ipo", "simpo", "orpo"] {
        let case = Case::new(method, "init", "sgd");
        check(
            &case,
            &preference("data.jsonl"),
            &["--tokenizer", tokenizer],
        );
        check(
            &case,
            &ids(),
            &["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"],
        );
        // The LM head and the losses' statistics 4 positions at a time.
        check(&case, &ids(), &["--loss-chunk", "4"]);
    }
    let case = Case::new("dpo", "ref", "adamw");
    check(
        &case,
        &ids(),
        &["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"],
    );
}

/// Conversational pairs (an explicit prompt of one and of three turns, and
/// conversations sharing their first message as the prompt) through the
/// fixture's chat template: TRL's ids, loss, metrics and step.
#[test]
fn conversational_pairs_through_the_chat_template_equal_trl() {
    let dir = preference("chat_tokenizer");
    let tokenizer = dir.join("tokenizer.json");
    let flags = [
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--chat-template",
        dir.to_str().unwrap(),
    ];
    for (method, start) in [("dpo", "init"), ("dpo", "fresh"), ("orpo", "init")] {
        let case = Case {
            variant: Some("chat"),
            ..Case::new(method, start, "sgd")
        };
        check(&case, &preference("data_chat.jsonl"), &flags);
        // TRL's ids for those rows, pre-tokenized, compute the same.
        check(&case, &preference("data_chat_ids.jsonl"), &[]);
    }
}

/// Metrics of the first step or evaluation of a run's metrics file: the
/// train line of `step`, or the eval line (`eval_` keys) of `step`.
fn line(metrics: &Path, step: u64, eval: bool) -> Value {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|l| l["step"] == step && l.get("eval_loss").is_some() == eval)
        .unwrap()
}

/// A fresh adapter of our own (no `--init-adapter`) compares with the
/// base: its first step's figures are TRL's for a fresh adapter (B = 0,
/// so its A does not matter yet); a held-out set in batches of 3 pairs
/// (the last one filled with empty pairs) averages over its 4 pairs; a
/// resumed run (the reference read again from `--init-adapter`) ends
/// where a straight one does.
#[test]
fn a_fresh_adapter_a_ragged_held_out_set_and_a_resumed_run() {
    let tmp = scratch("preference", "fresh-resume");
    let want = &expected()["dpo.fresh.sgd"];
    let data = ids();
    let data = data.to_str().unwrap();
    let checkpoint = fixture("gqa_llama3");
    let base = [
        "train",
        "--objective",
        "dpo",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--data",
        data,
        "--seq",
        "16",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--clip-norm",
        "0",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lora-targets",
        "q_proj,v_proj",
    ];
    let run = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend(extra);
        ok(&hlo_train(&args))
    };
    let fresh = tmp.join("fresh.jsonl");
    let out = run(&[
        "--batch",
        "4",
        "--steps",
        "1",
        "--metrics",
        fresh.to_str().unwrap(),
    ]);
    assert!(out.contains("dpo against the base (adapter off)"), "{out}");
    let step = line(&fresh, 1, false);
    let keys = [
        "loss",
        "rewards/chosen",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ];
    for key in keys {
        let trl = want["metrics"][key]
            .as_f64()
            .or(want[key].as_f64())
            .unwrap();
        close(
            &format!("fresh {key}"),
            step[key].as_f64().unwrap(),
            trl,
            1e-5,
        );
    }
    let held = tmp.join("held.jsonl");
    run(&[
        "--batch",
        "3",
        "--steps",
        "1",
        "--eval-data",
        data,
        "--metrics",
        held.to_str().unwrap(),
    ]);
    let before = line(&held, 0, true);
    for key in keys {
        let trl = want["metrics"][key]
            .as_f64()
            .or(want[key].as_f64())
            .unwrap();
        let name = match key {
            "loss" => "eval_loss".to_string(),
            k => format!("eval_{k}"),
        };
        close(&name, before[&name].as_f64().unwrap(), trl, 1e-5);
    }
    // Two steps, then one more on resume, against three straight.
    let init = preference("adapters/init");
    let init = init.to_str().unwrap();
    let (a, b) = (tmp.join("straight"), tmp.join("resumed"));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    run(&[
        "--batch",
        "2",
        "--steps",
        "3",
        "--init-adapter",
        init,
        "--out",
        a,
    ]);
    run(&[
        "--batch",
        "2",
        "--steps",
        "2",
        "--init-adapter",
        init,
        "--out",
        b,
    ]);
    ok(&hlo_train(&["train", "--resume", b, "--steps", "3"]));
    let (x, y) = (
        read_safetensors(&Path::new(a).join("adapter_model.safetensors")).unwrap(),
        read_safetensors(&Path::new(b).join("adapter_model.safetensors")).unwrap(),
    );
    for ((k, t), (_, u)) in x.iter().zip(&y) {
        let d = max_diff(&t.to_f64s(), &u.to_f64s());
        assert!(d < 1e-6, "{k}: the resumed run differs by {d:e}");
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

/// `data --objective dpo` shows each pair's two sides with the
/// completions marked, as the step learns them (TRL's EOS text appended
/// to string completions), and what a run takes of them.
#[test]
fn data_shows_pairs_with_their_completions_marked() {
    let tokenizer = preference("tokenizer/tokenizer.json");
    let out = ok(&hlo_train(&[
        "data",
        "--objective",
        "dpo",
        "--data",
        preference("data.jsonl").to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--seq",
        "16",
        "--batch",
        "2",
        "--steps",
        "4",
        "--samples",
        "1",
    ]));
    let want = [
        "pair 1 of 4: prompt 5 tokens, chosen 4 and rejected 2 after it",
        "  chosen   <|begin_of_text|>XYZ=⟦ZYX<|end_of_text|>⟧",
        "  rejected <|begin_of_text|>XYZ=⟦Q<|end_of_text|>⟧",
        "4 pairs, 70 tokens, 28 learned within --seq 16; 0 sides cut to --seq; 0 pairs whose prompt fills the row",
        "4 steps of 2 pairs take 2.00 epochs of the 4 pairs that teach something",
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want, "{out}");
}

/// QLoRA: the 128-wide fixture base quantized to NF4 on load, as
/// bitsandbytes quantizes it for TRL (f32 LoRA: TRL 1.16's DPOTrainer
/// would cast the adapter to bf16 on a 4-bit base; the fixture undoes
/// that, see FORMULAS.md).
#[test]
fn nf4_bases_equal_trl() {
    for (method, start, optimizer) in [
        ("dpo", "init", "sgd"),
        ("dpo", "fresh", "sgd"),
        ("dpo", "init", "adamw"),
        ("ipo", "init", "sgd"),
        ("orpo", "init", "sgd"),
    ] {
        let case = Case {
            variant: Some("nf4"),
            ..Case::new(method, start, optimizer)
        };
        check(&case, &ids(), &[]);
    }
    // Codes and block scales split over a 1×2×2 mesh as the weights.
    let case = Case {
        variant: Some("nf4"),
        ..Case::new("dpo", "init", "sgd")
    };
    check(
        &case,
        &ids(),
        &["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"],
    );
}

/// `--precompute-ref`: the reference's log-probabilities computed before
/// training give TRL's step (against another adapter, where no pair ties:
/// a tie's reward accuracy would hang on rounding between two programs),
/// on one device and on a mesh; full finetuning then has a reference too.
#[test]
fn a_precomputed_reference_equals_trl_and_lets_full_finetuning_run() {
    for (method, optimizer) in [("dpo", "sgd"), ("ipo", "sgd"), ("dpo", "adamw")] {
        let case = Case::new(method, "ref", optimizer);
        check(&case, &ids(), &["--precompute-ref"]);
    }
    let case = Case::new("dpo", "ref", "sgd");
    check(
        &case,
        &ids(),
        &[
            "--precompute-ref",
            "--devices",
            "4",
            "--mesh",
            "dp=1,fsdp=2,mp=2",
        ],
    );
    // Full finetuning: the reference is the base as training starts, so
    // the first loss is log 2, and the policy then moves away from it.
    let tmp = scratch("preference", "full");
    let metrics = tmp.join("m.jsonl");
    let out = ok(&hlo_train(&[
        "train",
        "--objective",
        "dpo",
        "--full",
        "--precompute-ref",
        "--checkpoint",
        fixture("gqa_llama3").to_str().unwrap(),
        "--data",
        ids().to_str().unwrap(),
        "--batch",
        "4",
        "--seq",
        "16",
        "--steps",
        "5",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--metrics",
        metrics.to_str().unwrap(),
    ]));
    assert!(out.contains("computed before training"), "{out}");
    let loss = losses(&metrics);
    assert!((loss[0] - std::f64::consts::LN_2).abs() < 1e-6, "{loss:?}");
    assert!(loss[4] < loss[0] - 1e-3, "{loss:?}");
    // The tiny preset's random base, drawn with the run's seed for the
    // reference as for the step: a fresh adapter starts at log 2.
    let seeded = tmp.join("seeded.jsonl");
    ok(&hlo_train(&[
        "train",
        "--objective",
        "dpo",
        "--precompute-ref",
        "--seed",
        "3",
        "--batch",
        "4",
        "--seq",
        "16",
        "--steps",
        "1",
        "--metrics",
        seeded.to_str().unwrap(),
    ]));
    let first = losses(&seeded)[0];
    assert!((first - std::f64::consts::LN_2).abs() < 1e-6, "{first}");
    std::fs::remove_dir_all(tmp).unwrap();
}

/// `plan --objective` plans the step a run would take: twice the rows of
/// `--batch` pairs, DPO's reference forward on top of SFT's bytes, less
/// with `--precompute-ref`.
#[test]
fn plan_accounts_for_the_pairs_and_the_reference() {
    let plan = |extra: &[&str]| -> Value {
        let mut args = vec![
            "plan",
            "--model",
            "tiny",
            "--target",
            "cpu",
            "--seq",
            "64",
            "--lora-rank",
            "16",
            "--json",
        ];
        args.extend(extra);
        serde_json::from_str(&ok(&hlo_train(&args))).unwrap()
    };
    let total = |v: &Value| v["per_device"]["total_bytes"].as_u64().unwrap();
    let sft = plan(&["--batch", "8"]);
    let dpo = plan(&["--objective", "dpo", "--batch", "4"]);
    let pre = plan(&["--objective", "dpo", "--batch", "4", "--precompute-ref"]);
    assert_eq!(
        (sft["rows"].as_i64(), dpo["rows"].as_i64()),
        (Some(8), Some(8))
    );
    assert_eq!(
        (dpo["objective"].as_str(), dpo["reference"].as_str()),
        (Some("dpo"), Some("base"))
    );
    assert_eq!(pre["reference"].as_str(), Some("precomputed"));
    assert!(total(&dpo) > total(&pre), "{} {}", total(&dpo), total(&pre));
    assert!(total(&dpo) > total(&sft), "{} {}", total(&dpo), total(&sft));
    // With logits too large to hold whole (Qwen3 0.6B's vocabulary of
    // 151,936: 1.2 GB of f32 logits for 8 rows of 256, a chunk of 16
    // positions at a time), the pairs' step holds what the SFT step of as
    // many rows does, give or take the reference's forward, which keeps
    // nothing for a gradient.
    let chunked = |objective: &str, batch: &str| -> Value {
        let args = [
            "plan",
            "--model",
            "qwen3-0.6b",
            "--target",
            "cpu",
            "--json",
            "--objective",
            objective,
            "--batch",
            batch,
            "--seq",
            "256",
            "--loss-chunk",
            "16",
        ];
        serde_json::from_str(&ok(&hlo_train(&args))).unwrap()
    };
    let (sft, dpo) = (chunked("sft", "8"), chunked("dpo", "4"));
    assert_eq!(dpo["loss_chunk"].as_i64(), Some(16));
    let ratio = total(&dpo) as f64 / total(&sft) as f64;
    assert!(
        ratio <= 1.15,
        "DPO {} against SFT {}",
        total(&dpo),
        total(&sft)
    );
}

/// `eval --objective` scores held-out pairs as a run's own held-out
/// evaluation does: the policy before its first step, against its
/// reference, gives TRL's first step's loss and metrics over the same
/// four pairs.
#[test]
fn eval_scores_held_out_pairs_with_trls_metrics() {
    let adapter = |a: &str| preference(&format!("adapters/{a}")).display().to_string();
    for (name, policy, reference) in [
        ("dpo.fresh.sgd", "fresh", None),
        ("dpo.init.sgd", "init", Some("init")),
        ("dpo.ref.sgd", "fresh", Some("ref")),
        ("ipo.init.sgd", "init", Some("init")),
        ("simpo.init.sgd", "init", None),
        ("orpo.init.sgd", "init", None),
    ] {
        let method = name.split('.').next().unwrap();
        let mut args: Vec<String> = [
            "eval",
            "--objective",
            method,
            "--checkpoint",
            fixture("gqa_llama3").to_str().unwrap(),
            "--data",
            ids().to_str().unwrap(),
            "--batch",
            "4",
            "--seq",
            "16",
            "--json",
        ]
        .map(String::from)
        .to_vec();
        args.extend(["--adapter".into(), adapter(policy)]);
        if let Some(r) = reference {
            args.extend(["--ref-adapter".into(), adapter(r)]);
        }
        let out = ok(&hlo_train(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        ));
        let got: Value = serde_json::from_str(&out).unwrap();
        let want = &expected()[name];
        assert_eq!(got["pairs"], 4, "{name}: {got}");
        close(
            &format!("{name}: eval_loss"),
            got["eval_loss"].as_f64().unwrap(),
            want["loss"].as_f64().unwrap(),
            1e-5,
        );
        for key in compared(method) {
            let ours = got[format!("eval_{key}")]
                .as_f64()
                .unwrap_or_else(|| panic!("{name}: eval_{key} in {got}"));
            close(
                &format!("{name}: {key}"),
                ours,
                want["metrics"][key].as_f64().unwrap(),
                1e-5,
            );
        }
    }
}
