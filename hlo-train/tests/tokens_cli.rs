//! `hlo-train data prepare` and training on prepared token shards: a run
//! on the shards in file order gives exactly the losses of a run on the
//! JSONL they came from (packed and not); a shuffled run on shards saved
//! and resumed equals the uninterrupted one; `data` shows the shards; an
//! interrupted preparation resumes; and shards prepared otherwise (another
//! tokenizer, another objective's data) are refused in one line.

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// A JSONL corpus for the tiny model: text rows and prompt/completion
/// rows of varied lengths.
fn corpus(dir: &Path) -> PathBuf {
    let mut text = String::new();
    for i in 0..60 {
        let word = ["cat", "horse", "elephant", "ox", "giraffe"][i % 5].repeat(1 + i % 3);
        if i % 4 == 0 {
            text += &format!("{{\"prompt\": \"{i} says \", \"completion\": \"{word}\"}}\n");
        } else {
            text += &format!("{{\"text\": \"the {word} number {i}\"}}\n");
        }
    }
    let path = dir.join("corpus.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

fn prepare(data: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "data",
        "prepare",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--rows-per-shard",
        "16",
    ];
    args.extend(extra);
    ok(&hlo_train(&args))
}

/// `steps` steps of the tiny model on `data`, LoRA, with `extra` flags;
/// the losses.
fn train(data: &Path, out: &Path, steps: &str, extra: &[&str]) -> Vec<f64> {
    let metrics = out.join("metrics.jsonl");
    let mut args = vec![
        "train",
        "--data",
        data.to_str().unwrap(),
        "--seq",
        "32",
        "--batch",
        "4",
        "--steps",
        steps,
        "--lr",
        "1e-2",
        "--log-every",
        "1",
        "--out",
        out.to_str().unwrap(),
        "--metrics",
        metrics.to_str().unwrap(),
    ];
    args.extend(extra);
    ok(&hlo_train(&args));
    losses(&metrics)
}

#[test]
fn a_run_on_shards_equals_a_run_on_the_jsonl() {
    let tmp = scratch("tokens", "same");
    let data = corpus(&tmp);
    let shards = tmp.join("shards");
    let said = prepare(&data, &shards, &["--threads", "2"]);
    assert!(
        said.contains("prepared 60 samples") && said.contains("in 4 shards"),
        "{said}"
    );
    for packing in ["off", "on"] {
        let flags = [
            "--train-sampling-strategy",
            "sequential",
            "--packing",
            packing,
        ];
        let a = train(&data, &tmp.join(format!("jsonl-{packing}")), "6", &flags);
        let b = train(&shards, &tmp.join(format!("shards-{packing}")), "6", &flags);
        assert_eq!(a.len(), 6);
        assert_eq!(a, b, "packing {packing}");
    }
    // `data` reads the shards as train does.
    let shown = ok(&hlo_train(&[
        "data",
        "--data",
        shards.to_str().unwrap(),
        "--seq",
        "32",
        "--samples",
        "1",
    ]));
    assert!(
        shown.contains("sample 1 of 60") && shown.contains("60 samples"),
        "{shown}"
    );
}

/// Continues the run saved in `part` to `steps`.
fn resume(part: &Path, steps: &str) {
    ok(&hlo_train(&[
        "train",
        "--resume",
        part.to_str().unwrap(),
        "--steps",
        steps,
    ]));
}

#[test]
fn a_shuffled_run_on_shards_resumes_exactly() {
    let tmp = scratch("tokens", "resume");
    let shards = tmp.join("shards");
    prepare(&corpus(&tmp), &shards, &[]);
    let whole = train(&shards, &tmp.join("whole"), "8", &["--packing", "on"]);
    let part = tmp.join("part");
    train(&shards, &part, "4", &["--packing", "on"]);
    let metrics = part.join("metrics.jsonl");
    resume(&part, "8");
    assert_eq!(losses(&metrics), whole);
}

#[test]
fn shards_prepared_otherwise_are_refused() {
    let tmp = scratch("tokens", "refused");
    let data = corpus(&tmp);
    let shards = tmp.join("shards");
    prepare(&data, &shards, &[]);
    // Complete already: nothing to do, the same line.
    let again = prepare(&data, &shards, &[]);
    assert!(again.contains("0 tokens tokenized"), "{again}");
    let e = one_line_error(&hlo_train(&[
        "train",
        "--objective",
        "dpo",
        "--data",
        shards.to_str().unwrap(),
    ]));
    assert!(e.contains("prepared token set"), "{e}");
    // Prepared with another tokenizer than the model's (a model of a
    // vocabulary that holds the fixture tokenizer's, and no tokenizer of
    // its own).
    let other = tmp.join("other");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let text = std::fs::read_to_string(root.join("scratch/config.json")).unwrap();
    let mut c: serde_json::Value = serde_json::from_str(&text).unwrap();
    c["vocab_size"] = 512.into();
    let config = tmp.join("config.json");
    std::fs::write(&config, c.to_string()).unwrap();
    let (config, tokenizer) = (
        config.to_str().unwrap(),
        root.join("tokenizer/tokenizer.json"),
    );
    prepare(
        &data,
        &other,
        &[
            "--config",
            config,
            "--tokenizer",
            tokenizer.to_str().unwrap(),
        ],
    );
    let e = one_line_error(&hlo_train(&[
        "train",
        "--config",
        config,
        "--data",
        other.to_str().unwrap(),
    ]));
    assert!(e.contains("another tokenizer"), "{e}");
    // Other data into a folder of shards.
    let more = tmp.join("more.jsonl");
    std::fs::write(&more, "{\"text\": \"other\"}\n").unwrap();
    let e = one_line_error(&hlo_train(&[
        "data",
        "prepare",
        "--data",
        more.to_str().unwrap(),
        "--out",
        shards.to_str().unwrap(),
    ]));
    assert!(e.contains("prepared otherwise"), "{e}");
}

/// A mixture of two prepared sets in proportions (LLM Foundry's
/// `streams`): each step's metrics give every set's tokens and share,
/// the shares follow the proportions, and a run saved and resumed equals
/// the uninterrupted one.
#[test]
fn a_mixture_of_sets_reports_each_and_resumes_exactly() {
    let tmp = scratch("tokens", "mixture");
    let data = corpus(&tmp);
    let text = std::fs::read_to_string(&data).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    for (name, part) in [("first", &lines[..30]), ("second", &lines[30..])] {
        let path = tmp.join(format!("{name}.jsonl"));
        std::fs::write(&path, part.join("\n") + "\n").unwrap();
        prepare(&path, &tmp.join(name), &[]);
    }
    let mix = tmp.join("mix.json");
    std::fs::write(
        &mix,
        r#"{"streams": {"first": {"local": "first", "proportion": 3}, "second": {"local": "second", "proportion": 1}}}"#,
    )
    .unwrap();
    let flags = ["--packing", "off"];
    let whole = train(&mix, &tmp.join("whole"), "8", &flags);
    let metrics = tmp.join("whole/metrics.jsonl");
    let first: f64 = metric(&metrics, "data/first/tokens")
        .iter()
        .map(|(_, v)| v)
        .sum();
    let second: f64 = metric(&metrics, "data/second/tokens")
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert_eq!(metric(&metrics, "data/first/share").len(), 8);
    // 3:1 by draws; by tokens, as long as the two sets' rows are alike.
    let share = first / (first + second);
    assert!((0.6..0.9).contains(&share), "{share}");
    let part = tmp.join("part");
    train(&mix, &part, "4", &flags);
    resume(&part, "8");
    assert_eq!(losses(&part.join("metrics.jsonl")), whole);
}
