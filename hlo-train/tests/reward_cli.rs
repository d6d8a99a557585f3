//! `hlo-train train --objective reward`, `score` and `merge` of a reward
//! model against TRL 1.16's own `RewardTrainer` (fixtures made by
//! `scripts/make_reward_fixtures.py`; formulas in
//! `tests/fixtures/reward/FORMULAS.md`): on the tiny f32 Llama made a
//! sequence classifier (`LlamaForSequenceClassification`, its score head
//! as transformers initialised it), two steps of four pairs in file order
//! — every logged metric of each step to 1e-5 and the adapter (with its
//! score head, PEFT's SEQ_CLS `modules_to_save`) or, fully finetuned,
//! every weight after the last step to 1e-6 — for SGD and AdamW, a margin
//! column, `center_rewards_coefficient` and string pairs, on one device
//! and on a `dp=1,fsdp=2,mp=2` mesh; the trained model's scores of every
//! pair, and its merged folder, equal to what transformers'
//! `AutoModelForSequenceClassification` gives.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use hlo_engine::models::io::read_safetensors;
use serde_json::Value;

fn reward(name: &str) -> PathBuf {
    fixture_file("reward", name)
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(reward("expected.json")).unwrap()).unwrap()
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
    let mut f: Vec<String> = [
        "train",
        "--objective",
        "reward",
        "--checkpoint",
        reward("seqcls").to_str().unwrap(),
        "--tokenizer",
        &tokenizer(),
        "--data",
        reward(s("data").as_str().unwrap()).to_str().unwrap(),
        "--seq",
        "16",
        "--clip-norm",
        "0",
        "--weight-decay",
        "0",
        "--log-every",
        "1",
        "--train-sampling-strategy",
        "sequential",
    ]
    .map(String::from)
    .to_vec();
    for (flag, key) in [
        ("--batch", "per_device_train_batch_size"),
        ("--steps", "max_steps"),
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
    if let Some(c) = s("center_rewards_coefficient").as_f64() {
        f.extend(["--center-rewards-coefficient".into(), c.to_string()]);
    }
    match s("adapter").as_str() {
        Some(_) => f.extend([
            "--init-adapter".into(),
            reward("adapter_fresh").display().to_string(),
        ]),
        None => f.push("--full".into()),
    }
    f
}

/// What TRL logs that is not a figure of the step: the schedule's
/// position, and `num_tokens` (a running count).
const NOT_COMPARED: [&str; 3] = ["epoch", "learning_rate", "num_tokens"];

/// Runs case `name` with `extra` flags into `out`; checks every step's
/// logged figures against TRL's.
fn run_case(name: &str, out: &Path, extra: &[&str]) {
    let want = &expected()[name];
    let metrics = out.with_extension("jsonl");
    let mut args = flags(&want["settings"]);
    for (flag, path) in [("--out", out), ("--metrics", &metrics)] {
        args.extend([flag.into(), path.display().to_string()]);
    }
    let args = with_flags(args, extra);
    let said = ok(&hlo_train(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    let lines: Vec<Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The last step's log line shows the reward model's accuracy and
    // margin.
    let last = lines
        .iter()
        .rev()
        .find(|l| l.get("loss").is_some())
        .unwrap();
    let line = said.lines().rev().find(|l| l.starts_with("step ")).unwrap();
    for key in ["accuracy", "margin"] {
        let shown = format!(" {key} {:.4}", last[key].as_f64().unwrap());
        assert!(line.contains(&shown), "{line}: no{shown}");
    }
    for trl in want["steps"].as_array().unwrap() {
        let step = trl["step"].as_u64().unwrap();
        let ours = lines
            .iter()
            .find(|l| l["step"] == step && l.get("loss").is_some())
            .unwrap_or_else(|| panic!("{name}: step {step}"));
        for (key, v) in trl["logged"].as_object().unwrap() {
            if NOT_COMPARED.contains(&key.as_str()) {
                continue;
            }
            let what = format!("{name} {extra:?}: step {step} {key}");
            let got = ours[key.as_str()]
                .as_f64()
                .unwrap_or_else(|| panic!("{what} is not written"));
            close(&what, got, v.as_f64().unwrap(), 1e-5);
        }
    }
}

/// A LoRA case: its figures, and the adapter (LoRA tensors and the score
/// head) after its last step.
fn check(name: &str, extra: &[&str]) {
    let tmp = scratch("reward", &format!("{name}{}", extra.len()));
    let out = tmp.join("run");
    run_case(name, &out, extra);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["task_type"], "SEQ_CLS", "{config}");
    assert_eq!(config["modules_to_save"], serde_json::json!(["score"]));
    // The run's recipe holds the reward model's settings, no other
    // objective's.
    let recipe = std::fs::read_to_string(out.join("recipe.yaml")).unwrap();
    let centred = expected()[name]["settings"]["center_rewards_coefficient"].is_number();
    assert!(
        recipe.contains("objective: reward")
            && recipe.contains("\nbatch: 4\n")
            && recipe.contains("center_rewards_coefficient: null") != centred
            && !recipe.contains("beta"),
        "{recipe}"
    );
    let theirs = [reward("expected.safetensors")];
    assert_adapter_as_fixture(&out, &theirs, &format!("{name}.step2"), 1e-6);
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn lora_with_sgd_adamw_a_margin_centring_and_string_pairs_equals_trl() {
    for name in [
        "lora.sgd",
        "lora.adamw",
        "lora.margin",
        "lora.center",
        "lora.text",
    ] {
        check(name, &[]);
    }
}

#[test]
fn a_mesh_equals_trl() {
    let mesh = ["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"];
    for name in ["lora.sgd", "lora.margin"] {
        check(name, &mesh);
    }
}

/// Every weight of the classifier (its score head too) after two full
/// finetuning steps, written as an HF sequence-classification folder.
#[test]
fn full_finetuning_equals_trl() {
    let tmp = scratch("reward", "full");
    let out = tmp.join("run");
    run_case("full.sgd", &out, &[]);
    let ours = read_safetensors(&out.join("model.safetensors")).unwrap();
    let theirs = read_safetensors(&reward("expected.safetensors")).unwrap();
    let mut seen = 0;
    for (key, t) in theirs
        .iter()
        .filter_map(|(k, t)| Some((k.strip_prefix("full.sgd.step2.")?, t)))
    {
        let mine = &ours
            .iter()
            .find(|(k, _)| k == key)
            .unwrap_or_else(|| panic!("{key} is not written"))
            .1;
        let d = max_diff(&mine.to_f64s(), &t.to_f64s());
        assert!(d < 1e-6, "{key}: differs by {d:e}");
        seen += 1;
    }
    assert_eq!(seen, ours.len(), "every weight compared");
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(
        config.contains("LlamaForSequenceClassification"),
        "{config}"
    );
    std::fs::remove_dir_all(tmp).unwrap();
}

/// A run saved after its first step and resumed takes the second batch
/// of pairs (file order) and ends as TRL's two steps.
#[test]
fn a_run_resumed_after_its_first_step_ends_as_trl() {
    let tmp = scratch("reward", "resume");
    let out = tmp.join("run");
    let want = &expected()["lora.sgd"];
    let metrics = tmp.join("metrics.jsonl");
    let mut args = flags(&want["settings"]);
    for (flag, path) in [("--out", &out), ("--metrics", &metrics)] {
        args.extend([flag.into(), path.display().to_string()]);
    }
    let args = with_flags(args, &["--steps", "1"]);
    ok(&hlo_train(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    ok(&hlo_train(&[
        "train",
        "--resume",
        out.to_str().unwrap(),
        "--steps",
        "2",
    ]));
    let step2: Value = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .find(|l: &Value| l["step"] == 2 && l.get("loss").is_some())
        .unwrap();
    let trl = &want["steps"][1]["logged"];
    for key in ["loss", "accuracy", "margin", "mean_reward"] {
        close(
            &format!("resumed step 2 {key}"),
            step2[key].as_f64().unwrap(),
            trl[key].as_f64().unwrap(),
            1e-5,
        );
    }
    let theirs = [reward("expected.safetensors")];
    assert_adapter_as_fixture(&out, &theirs, "lora.sgd.step2", 1e-6);
    std::fs::remove_dir_all(tmp).unwrap();
}

/// `score` refuses in one line what it cannot score: data none of whose
/// pairs fits within `--seq` (no "0 pairs" with exit 0), and a `--seq`
/// beyond the model's positions (which padded every batch to it). Without
/// `--seq` it takes the model's 64 positions; a pair's scores do not
/// depend on how long the rows are.
#[test]
fn score_refuses_nothing_to_score_and_a_seq_beyond_the_positions() {
    let data = reward("pairs_ids.jsonl");
    let seqcls = reward("seqcls");
    let tok = tokenizer();
    let base = [
        "score",
        "--checkpoint",
        seqcls.to_str().unwrap(),
        "--tokenizer",
        tok.as_str(),
        "--data",
        data.to_str().unwrap(),
    ];
    let with = |extra: &[&'static str]| {
        let mut args = base.to_vec();
        args.extend(extra);
        args
    };
    let e = one_line_error(&hlo_train(&with(&["--seq", "4"])));
    assert!(
        e.contains("none of the 8 pairs fits within --seq 4")
            && e.contains("the shortest pair's longer side holds 5 tokens"),
        "{e}"
    );
    let e = one_line_error(&hlo_train(&with(&["--seq", "100000"])));
    assert!(
        e.contains("--seq 100000 is above the model's 64 positions"),
        "{e}"
    );
    let all = scores(&base);
    assert_eq!(all, scores(&with(&["--seq", "64"])));
    // --seq 8 leaves out the second pair (a side of 9 tokens).
    let short = scores(&with(&["--seq", "8"]));
    assert_eq!(short.len(), 7);
    for (k, (got, want)) in short
        .iter()
        .zip(all.iter().take(1).chain(all.iter().skip(2)))
        .enumerate()
    {
        close(&format!("pair {k} chosen"), got.0, want.0, 1e-6);
        close(&format!("pair {k} rejected"), got.1, want.1, 1e-6);
    }
}

/// `score`'s lines: each pair's (chosen, rejected).
fn scores(args: &[&str]) -> Vec<(f64, f64)> {
    let out = hlo_train(args);
    ok(&out);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["chosen"].as_f64().unwrap(),
                v["rejected"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The trained model's scores of every pair, with its adapter unmerged
/// and merged, are those transformers computes; the merged folder is
/// transformers' own, weight for weight.
#[test]
fn score_and_merge_give_the_scores_transformers_gives() {
    let tmp = scratch("reward", "score");
    let run = tmp.join("run");
    run_case("lora.sgd", &run, &[]);
    let want = &expected()["scores"];
    let data = reward("pairs_ids.jsonl");
    let seqcls = reward("seqcls");
    let tok = tokenizer();
    let base = [
        "score",
        "--checkpoint",
        seqcls.to_str().unwrap(),
        "--tokenizer",
        tok.as_str(),
        "--data",
        data.to_str().unwrap(),
    ];
    let mut with_adapter = base.to_vec();
    with_adapter.extend(["--adapter", run.to_str().unwrap(), "--batch", "3"]);
    let merged = tmp.join("merged");
    ok(&hlo_train(&[
        "merge",
        "--checkpoint",
        seqcls.to_str().unwrap(),
        "--adapter",
        run.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]));
    let mut of_merged = base.to_vec();
    of_merged[2] = merged.to_str().unwrap();
    for (what, got) in [
        ("unmerged", scores(&with_adapter)),
        ("merged", scores(&of_merged)),
    ] {
        assert_eq!(got.len(), 8, "{what}");
        for (k, (c, r)) in got.iter().enumerate() {
            close(
                &format!("{what} {k} chosen"),
                *c,
                want["chosen"][k].as_f64().unwrap(),
                1e-5,
            );
            close(
                &format!("{what} {k} rejected"),
                *r,
                want["rejected"][k].as_f64().unwrap(),
                1e-5,
            );
        }
    }
    let ours = read_safetensors(&merged.join("model.safetensors")).unwrap();
    let hf = read_safetensors(&reward("merged/model.safetensors")).unwrap();
    assert_eq!(ours.len(), hf.len());
    for (key, t) in &hf {
        let mine = &ours.iter().find(|(k, _)| k == key).unwrap().1;
        let d = max_diff(&mine.to_f64s(), &t.to_f64s());
        assert!(d < 1e-6, "merged {key}: differs by {d:e}");
    }
    let config = |dir: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
    };
    let (ours, hf) = (config(&merged), config(&reward("merged")));
    for key in [
        "architectures",
        "id2label",
        "label2id",
        "pad_token_id",
        "hidden_size",
    ] {
        assert_eq!(ours[key], hf[key], "config.json {key}");
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

/// From a causal LM's checkpoint: a new score head, trained with the
/// adapter, saved in it, and merged into a sequence classifier whose
/// scores are the unmerged model's; the classifier is not a causal LM.
#[test]
fn a_causal_checkpoint_gets_a_score_head_that_merges_into_a_classifier() {
    let tmp = scratch("reward", "causal");
    let (run, merged) = (tmp.join("run"), tmp.join("merged"));
    let checkpoint = fixture("gqa_llama3");
    let data = reward("pairs_ids.jsonl");
    let tok = tokenizer();
    ok(&hlo_train(&[
        "train",
        "--objective",
        "reward",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--tokenizer",
        tok.as_str(),
        "--data",
        data.to_str().unwrap(),
        "--batch",
        "4",
        "--seq",
        "16",
        "--steps",
        "2",
        "--lr",
        "0.05",
        "--out",
        run.to_str().unwrap(),
    ]));
    ok(&hlo_train(&[
        "merge",
        "--adapter",
        run.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]));
    let config = std::fs::read_to_string(merged.join("config.json")).unwrap();
    assert!(
        config.contains("LlamaForSequenceClassification"),
        "{config}"
    );
    let score = |checkpoint: &Path, adapter: Option<&Path>| {
        let mut args = vec![
            "score",
            "--checkpoint",
            checkpoint.to_str().unwrap(),
            "--tokenizer",
            tok.as_str(),
            "--data",
            data.to_str().unwrap(),
        ];
        if let Some(a) = adapter {
            args.extend(["--adapter", a.to_str().unwrap()]);
        }
        scores(&args)
    };
    let (unmerged, of_merged) = (score(&checkpoint, Some(&run)), score(&merged, None));
    for (k, (a, b)) in unmerged.iter().zip(&of_merged).enumerate() {
        close(&format!("pair {k} chosen"), b.0, a.0, 1e-5);
        close(&format!("pair {k} rejected"), b.1, a.1, 1e-5);
    }
    // A causal LM without a trained head has nothing to score with, and
    // a classifier is no causal LM.
    let e = one_line_error(&hlo_train(&[
        "score",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--tokenizer",
        tok.as_str(),
        "--data",
        data.to_str().unwrap(),
    ]));
    assert!(e.contains("has no trained score head"), "{e}");
    let e = one_line_error(&hlo_train(&[
        "train",
        "--checkpoint",
        merged.to_str().unwrap(),
        "--steps",
        "1",
    ]));
    assert!(e.contains("is a sequence classifier"), "{e}");
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn reward_data_and_settings_it_cannot_take_are_refused_in_one_line() {
    let tmp = scratch("reward", "refused");
    let half = tmp.join("half-margins.jsonl");
    std::fs::write(
        &half,
        "{\"chosen_ids\":[0,3],\"rejected_ids\":[0,4],\"margin\":1}\n{\"chosen_ids\":[0,5],\"rejected_ids\":[0,6]}\n",
    )
    .unwrap();
    let with_prompt = tmp.join("prompt-ids.jsonl");
    std::fs::write(
        &with_prompt,
        "{\"prompt_ids\":[0],\"chosen_ids\":[3],\"rejected_ids\":[4]}\n",
    )
    .unwrap();
    let base = flags(&expected()["lora.sgd"]["settings"]);
    for (extra, says) in [
        (
            vec!["--data", half.to_str().unwrap()],
            "1 of 2 pairs give a `margin`",
        ),
        (
            vec!["--data", with_prompt.to_str().unwrap()],
            "holds `prompt_ids` beside `chosen_ids`",
        ),
        (
            vec!["--eval-data", half.to_str().unwrap()],
            "held-out scoring of a reward model is not built yet",
        ),
        (
            vec!["--beta", "0.5"],
            "reward has no such setting; leave out --beta",
        ),
        (
            vec!["--center-rewards-coefficient", "inf"],
            "must be a finite number",
        ),
    ] {
        let args = with_flags(base.clone(), &extra);
        let e = one_line_error(&hlo_train(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        ));
        assert!(e.contains(says), "{extra:?}: {e}");
    }
    let e = one_line_error(&hlo_train(&[
        "eval",
        "--objective",
        "reward",
        "--checkpoint",
        reward("seqcls").to_str().unwrap(),
        "--tokenizer",
        &tokenizer(),
        "--data",
        reward("pairs_ids.jsonl").to_str().unwrap(),
    ]));
    assert!(
        e.contains("held-out scoring of a reward model is not built into eval")
            && e.contains("hlo-train score"),
        "{e}"
    );
    std::fs::remove_dir_all(tmp).unwrap();
}

/// `--reward model`: a trained reward model scores each GRPO and RLOO
/// completion in the run's process, as `score` scores the prompt and
/// completion joined (TRL's texts, tokenized without special tokens). The
/// byte-level model of the `tiny` preset on both sides, so any completion's
/// text tokenizes within the reward model's vocabulary.
#[test]
fn a_reward_model_scores_grpo_and_rloo_rollouts_as_score_does() {
    let tmp = scratch("reward", "model-reward");
    let rm = tmp.join("rm");
    ok(&hlo_train(&[
        "train",
        "--objective",
        "reward",
        "--full",
        "--steps",
        "2",
        "--batch",
        "4",
        "--seq",
        "16",
        "--out",
        rm.to_str().unwrap(),
    ]));
    let prompts = tmp.join("prompts.jsonl");
    std::fs::write(&prompts, "{\"prompt\":\"cat=\"}\n{\"prompt\":\"rust=\"}\n").unwrap();
    let bytes = hlo_engine::data::Tokenizer::bytes();
    for objective in ["grpo", "rloo"] {
        let metrics = tmp.join(format!("{objective}.jsonl"));
        ok(&hlo_train(&[
            "train",
            "--objective",
            objective,
            "--data",
            prompts.to_str().unwrap(),
            "--reward",
            "model",
            "--reward-model",
            rm.to_str().unwrap(),
            "--num-generations",
            "2",
            "--batch",
            "4",
            "--max-completion-length",
            "6",
            "--seq",
            "16",
            "--steps",
            "1",
            "--log-every",
            "1",
            "--log-completions",
            "4",
            "--metrics",
            metrics.to_str().unwrap(),
            "--out",
            tmp.join(objective).to_str().unwrap(),
        ]));
        let line: Value = std::fs::read_to_string(&metrics)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .find(|l: &Value| l.get("completions").is_some())
            .unwrap();
        let completions = line["completions"].as_array().unwrap();
        assert_eq!(completions.len(), 4);
        let pairs = tmp.join(format!("{objective}-texts.jsonl"));
        let rows: String = completions
            .iter()
            .map(|c| {
                let text = format!(
                    "{}{}",
                    c["prompt"].as_str().unwrap(),
                    c["completion"].as_str().unwrap()
                );
                let ids = bytes.encode(&text, false).unwrap();
                format!("{{\"chosen_ids\":{ids:?},\"rejected_ids\":{ids:?}}}\n")
            })
            .collect();
        std::fs::write(&pairs, rows).unwrap();
        let scored = scores(&[
            "score",
            "--checkpoint",
            rm.to_str().unwrap(),
            "--data",
            pairs.to_str().unwrap(),
        ]);
        for (c, (want, _)) in completions.iter().zip(&scored) {
            let got = c["rewards/model"].as_f64().unwrap();
            close(&format!("{objective}: {c}"), got, *want, 1e-5);
        }
    }
    // A LoRA reward run, not merged, is pointed to `merge`.
    let lora = tmp.join("rm-lora");
    ok(&hlo_train(&[
        "train",
        "--objective",
        "reward",
        "--steps",
        "1",
        "--batch",
        "4",
        "--seq",
        "16",
        "--out",
        lora.to_str().unwrap(),
    ]));
    let e = one_line_error(&hlo_train(&[
        "train",
        "--objective",
        "grpo",
        "--data",
        prompts.to_str().unwrap(),
        "--reward",
        "model",
        "--reward-model",
        lora.to_str().unwrap(),
        "--num-generations",
        "2",
        "--batch",
        "4",
        "--max-completion-length",
        "6",
        "--seq",
        "16",
        "--steps",
        "1",
    ]));
    assert!(
        e.contains("LoRA adapter") && e.contains("hlo-train merge"),
        "{e}"
    );
    std::fs::remove_dir_all(tmp).unwrap();
}
