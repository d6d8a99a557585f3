//! Data that teaches nothing is caught, data as `datasets` writes it is
//! read, `labels` are honoured, `hlo-train data` shows what the model will
//! see, `hlo-train eval` gives the train command's held-out loss, and a
//! full finetune leaves a complete HF folder.

mod common;

use std::path::Path;

use common::*;

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn data_that_teaches_nothing_is_refused_and_partly_useless_data_reported() {
    let dir = scratch("data", "signal");
    // Every prompt longer than the row: nothing to learn.
    let long = "x".repeat(40);
    let lines: String = (0..4)
        .map(|i| format!("{{\"prompt\": \"{long}{i}\", \"completion\": \"Y\"}}\n"))
        .collect();
    let data = write(&dir, "long.jsonl", &lines);
    let err = one_line_error(&hlo_train(&[
        "train", "--data", &data, "--seq", "16", "--batch", "2", "--steps", "2",
    ]));
    assert!(
        err.contains("none of the 4 samples has a learned token within a row of 16 tokens")
            && err.contains("use a longer --seq"),
        "{err}"
    );
    // `data` refuses it with the same line.
    let seen = one_line_error(&hlo_train(&["data", "--data", &data, "--seq", "16"]));
    assert_eq!(seen, err);
    // Half of them: trained, the rest counted and left out.
    let mixed = format!("{lines}{{\"prompt\": \"a=\", \"completion\": \"A\"}}\n{{\"prompt\": \"b=\", \"completion\": \"B\"}}\n");
    let data = write(&dir, "mixed.jsonl", &mixed);
    let out = ok(&hlo_train(&[
        "train", "--data", &data, "--seq", "16", "--batch", "2", "--steps", "2",
    ]));
    assert!(
        out.contains("data: 6 samples")
            && out.contains("4 samples cut to --seq")
            && out.contains("4 samples left out (no learned token within --seq)"),
        "{out}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn labels_bom_and_crlf_are_read_as_hf_reads_them() {
    let dir = scratch("data", "labels");
    // {"input_ids", "labels"}: only the labelled tokens are learned.
    let data = write(
        &dir,
        "rows.jsonl",
        "\u{feff}{\"input_ids\": [256, 65, 66, 67, 68, 69, 70, 71], \"labels\": [-100, -100, -100, -100, 68, 69, 70, 71]}\r\n\r\n{\"input_ids\": [256, 72, 73, 74], \"labels\": [-100, 73, 73, 74]}\r\n",
    );
    let err = one_line_error(&hlo_train(&[
        "train", "--data", &data, "--seq", "8", "--batch", "2", "--steps", "1",
    ]));
    assert!(
        err.contains("rows.jsonl:3: labels[1] is 73 but input_ids[1] is 72"),
        "{err}"
    );
    let data = write(
        &dir,
        "rows.jsonl",
        "\u{feff}{\"input_ids\": [256, 65, 66, 67, 68, 69, 70, 71], \"labels\": [-100, -100, -100, -100, 68, 69, 70, 71]}\r\n\r\n{\"input_ids\": [256, 72, 73, 74], \"labels\": [-100, -100, 73, 74]}\r\n",
    );
    let metrics = dir.join("m.jsonl");
    ok(&hlo_train(&[
        "train",
        "--data",
        &data,
        "--seq",
        "8",
        "--batch",
        "2",
        "--steps",
        "1",
        "--packing",
        "off",
        "--metrics",
        metrics.to_str().unwrap(),
    ]));
    // 4 + 2 labelled tokens are the step's targets.
    assert_eq!(metric(&metrics, "targets")[0].1, 6.0);
    // `data` shows them marked.
    let out = ok(&hlo_train(&[
        "data",
        "--data",
        &data,
        "--seq",
        "8",
        "--samples",
        "2",
    ]));
    assert!(out.contains("<|bos|>ABC⟦DEFG⟧"), "{out}");
    assert!(out.contains("<|bos|>H⟦IJ⟧"), "{out}");
    assert!(
        out.contains("2 samples, 12 tokens, 6 learned within --seq 8; 0 cut to --seq; 0 with no learned token"),
        "{out}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_enormous_line_is_cut_before_it_is_tokenized() {
    let dir = scratch("data", "huge");
    // Text: every token learned, so the cut sample still teaches (data
    // that teaches nothing is refused).
    let line = serde_json::json!({"text": "x".repeat(50_000_000)}).to_string();
    let data = write(&dir, "huge.jsonl", &format!("{line}\n"));
    let tokenizer =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer/tokenizer.json");
    // Tokenizing 50 MB of text takes gigabytes; cut to what a row of 32
    // tokens can use, it fits in 400 MB of address space.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 400000 && exec {} data --data {data} --seq 32 --samples 0 --tokenizer {}",
            env!("CARGO_BIN_EXE_hlo-train"),
            tokenizer.display()
        ))
        .output()
        .unwrap();
    let text = ok(&out);
    assert!(
        text.contains("1 samples") && text.contains("1 cut to --seq 32")
            || text.contains("1 cut to --seq"),
        "{text}"
    );
    // Far too little memory: one line, not an abort.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 100000 && exec {} data --data {data} --seq 32 --samples 0 --tokenizer {}",
            env!("CARGO_BIN_EXE_hlo-train"),
            tokenizer.display()
        ))
        .output()
        .unwrap();
    let err = one_line_error(&out);
    assert!(err.starts_with("error: out of memory"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn eval_gives_the_train_commands_held_out_loss() {
    let dir = scratch("data", "eval");
    let data = write(
        &dir,
        "held.jsonl",
        "{\"prompt\": \"cat=\", \"completion\": \"CAT\"}\n{\"prompt\": \"hello=\", \"completion\": \"HELLO\"}\n{\"text\": \"a longer line of text to predict\"}\n",
    );
    let metrics = dir.join("m.jsonl");
    let out = dir.join("run");
    ok(&hlo_train(&[
        "train",
        "--steps",
        "3",
        "--batch",
        "2",
        "--seq",
        "16",
        "--eval-data",
        &data,
        "--metrics",
        metrics.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]));
    let want = metric(&metrics, "eval_loss");
    let (before, after) = (want[0].1, want.last().unwrap().1);
    let eval = |adapter: Option<&str>| -> f64 {
        let mut a = vec![
            "eval", "--data", &data, "--seq", "16", "--batch", "2", "--json",
        ];
        if let Some(d) = adapter {
            a.extend(["--adapter", d]);
        }
        let v: serde_json::Value = serde_json::from_str(&ok(&hlo_train(&a))).unwrap();
        v["eval_loss"].as_f64().unwrap()
    };
    // The trained adapter's loss is the run's last eval_loss; the base
    // model alone is not (the run started from a fresh adapter, B = 0,
    // which changes nothing).
    let trained = eval(Some(out.to_str().unwrap()));
    assert!((trained - after).abs() < 1e-5, "{trained} vs {after}");
    let base = eval(None);
    assert!((base - before).abs() < 1e-5, "{base} vs {before}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_full_finetune_leaves_a_complete_hf_folder() {
    let dir = scratch("data", "full");
    let out = dir.join("full");
    let o = out.to_str().unwrap();
    ok(&hlo_train(&[
        "train", "--full", "--steps", "2", "--batch", "2", "--seq", "16", "--out", o,
    ]));
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    // It loads as a model: generation and merge's reader take it.
    let text = ok(&hlo_train(&[
        "generate",
        "--checkpoint",
        o,
        "--prompt",
        "cat=",
        "--max-new-tokens",
        "4",
    ]));
    assert!(!text.is_empty());
    // A checkpoint with a tokenizer hands it on.
    let data = dir.join("rows.jsonl");
    std::fs::write(&data, "{\"input_ids\": [1, 5, 9, 12, 30, 7]}\n").unwrap();
    let base = dir.join("base");
    std::fs::create_dir_all(&base).unwrap();
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(fixture("gqa_llama3").join(f), base.join(f)).unwrap();
    }
    let tokenizer =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer/tokenizer.json");
    std::fs::copy(&tokenizer, base.join("tokenizer.json")).unwrap();
    let out2 = dir.join("full2");
    ok(&hlo_train(&[
        "train",
        "--full",
        "--checkpoint",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "1",
        "--batch",
        "1",
        "--seq",
        "8",
        "--out",
        out2.to_str().unwrap(),
    ]));
    for f in ["tokenizer.json", "generation_config.json", "config.json"] {
        assert_eq!(
            std::fs::read(out2.join(f)).unwrap(),
            std::fs::read(base.join(f)).unwrap(),
            "{f}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The number before " epochs" in `text`.
fn epochs(text: &str) -> String {
    let at = text
        .find(" epochs")
        .unwrap_or_else(|| panic!("no epochs in {text}"));
    text[..at].rsplit(' ').next().unwrap().to_string()
}

#[test]
fn data_reports_the_epochs_train_takes_packed_or_not() {
    let dir = scratch("data", "epochs");
    let lines: String = (0..40)
        .map(|i| format!("{{\"prompt\": \"w{i}=\", \"completion\": \"W{i}\"}}\n"))
        .collect();
    let data = write(&dir, "short.jsonl", &lines);
    // Short samples: `auto` packs them; then forced off; and with grad-accum.
    for extra in [&[][..], &["--packing", "off"], &["--grad-accum", "2"]] {
        let mut flags = vec!["--data", data.as_str(), "--seq", "32", "--batch", "2"];
        flags.extend(["--steps", "3"]);
        flags.extend(extra);
        let train = ok(&hlo_train(&[&["train"][..], &flags].concat()));
        let shown = ok(&hlo_train(&[&["data"][..], &flags].concat()));
        let header = train.lines().find(|l| l.starts_with("data: ")).unwrap();
        let report = shown.lines().find(|l| l.contains("epochs")).unwrap();
        assert_eq!(
            epochs(header),
            epochs(report),
            "{extra:?}: {header} | {report}"
        );
        let packed = !extra.contains(&"off");
        assert_eq!(report.contains("packing on"), packed, "{report}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
