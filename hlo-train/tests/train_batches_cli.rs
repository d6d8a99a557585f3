//! What a step's batch holds: gradient accumulation equals the larger
//! batch, masked chat turns count nothing, a packed step equals the
//! unpacked one.

mod common;

use common::*;

use std::path::{Path, PathBuf};

use hlo_engine::models::io::read_safetensors;

/// JSONL rows of random ids (`{"input_ids"}`) with these lengths.
fn random_rows(dir: &Path, lengths: impl Iterator<Item = u64>, seed: u64) -> PathBuf {
    let mut rng = seed;
    let lines: Vec<String> = lengths
        .map(|n| {
            let ids: Vec<u64> = (0..n)
                .map(|_| {
                    rng = rng
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (rng >> 33) % 128
                })
                .collect();
            serde_json::json!({ "input_ids": ids }).to_string()
        })
        .collect();
    let data = dir.join("rows.jsonl");
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    data
}

/// One SGD step (`train --steps 1 --optimizer sgd` with `args`): the
/// first loss, the updated adapter and stdout.
fn sgd_step(
    dir: &Path,
    name: &str,
    args: &[&str],
) -> (f64, Vec<(String, hlo_engine::ir::Literal)>, String) {
    let out = dir.join(name);
    let metrics = dir.join(format!("metrics_{name}.jsonl"));
    let mut a = vec![
        "train",
        "--steps",
        "1",
        "--optimizer",
        "sgd",
        "--out",
        out.to_str().unwrap(),
    ];
    a.extend(["--metrics", metrics.to_str().unwrap()]);
    a.extend_from_slice(args);
    let stdout = ok(&hlo_train(&a));
    (
        losses(&metrics)[0],
        read_safetensors(&out.join("adapter_model.safetensors")).unwrap(),
        stdout,
    )
}

/// [`sgd_step`] on the fixture model from its PEFT adapter.
fn one_sgd_step(
    dir: &Path,
    data: &Path,
    name: &str,
    extra: &[&str],
) -> (f64, Vec<(String, hlo_engine::ir::Literal)>, String) {
    let (model, adapter) = (fixture("gqa_llama3"), fixture("gqa_llama3").join("adapter"));
    let mut a = vec![
        "--checkpoint",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ];
    a.extend([
        "--init-adapter",
        adapter.to_str().unwrap(),
        "--lr",
        "0.05",
        "--clip-norm",
        "0",
    ]);
    a.extend_from_slice(extra);
    sgd_step(dir, name, &a)
}

/// The largest difference between two adapters' tensors.
fn adapter_diff(
    a: &[(String, hlo_engine::ir::Literal)],
    b: &[(String, hlo_engine::ir::Literal)],
) -> f64 {
    a.iter()
        .zip(b)
        .map(|((_, x), (_, y))| max_diff(&x.to_f64s(), &y.to_f64s()))
        .fold(0.0, f64::max)
}

#[test]
fn grad_accum_4_of_batch_2_equals_batch_8() {
    let dir = scratch("train", "accum");
    // Rows of different lengths, so the micro-batches count different
    // numbers of tokens: the loss must be normalised by all of them.
    let data = random_rows(&dir, (0..8).map(|r| 3 + r % 7), 7);
    let seq = ["--seq", "9"];
    let (_, whole, _) = one_sgd_step(
        &dir,
        &data,
        "whole",
        &[&seq[..], &["--batch", "8"]].concat(),
    );
    let start =
        read_safetensors(&fixture("gqa_llama3").join("adapter/adapter_model.safetensors")).unwrap();
    assert!(
        adapter_diff(&whole, &start) > 1e-3,
        "the step moved the adapter"
    );
    for (name, extra) in [
        ("accum", &["--batch", "2", "--grad-accum", "4"][..]),
        (
            "accum_mesh",
            &[
                "--batch",
                "2",
                "--grad-accum",
                "4",
                "--mesh",
                "dp=1,fsdp=2,mp=1",
            ][..],
        ),
    ] {
        let (_, accum, _) = one_sgd_step(&dir, &data, name, &[&seq[..], extra].concat());
        let d = adapter_diff(&whole, &accum);
        assert!(d < 1e-5, "{name}: {d}");
    }
}

#[test]
fn masked_user_turns_contribute_nothing() {
    let dir = scratch("train", "chat");
    let chat = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat/llama_style");
    // Two conversations that differ only in a user turn after the last
    // reply: masked, and after everything learned, it can change nothing.
    let data = |name: &str, last: &str| {
        let line = serde_json::json!({"messages": [
            {"role": "user", "content": "cat="},
            {"role": "assistant", "content": "CAT"},
            {"role": "user", "content": last},
        ]});
        let p = dir.join(name);
        std::fs::write(&p, format!("{line}\n")).unwrap();
        p
    };
    let (a, b) = (data("a.jsonl", "thanks!"), data("b.jsonl", "no way?"));
    let run = |data: &Path, name: &str, extra: &[&str]| {
        let mut args = vec![
            "--data",
            data.to_str().unwrap(),
            "--chat-template",
            chat.to_str().unwrap(),
        ];
        args.extend(["--batch", "1", "--seq", "320", "--lr", "0.5"]);
        args.extend_from_slice(extra);
        let (loss, adapter, _) = sgd_step(&dir, name, &args);
        (loss, adapter)
    };
    let ((la, wa), (lb, wb)) = (run(&a, "a", &[]), run(&b, "b", &[]));
    assert!(la > 0.0, "the reply is learned");
    assert_eq!(la, lb);
    for ((k, x), (_, y)) in wa.iter().zip(&wb) {
        assert_eq!(x.to_f64s(), y.to_f64s(), "{k}");
    }
    // Learning the inputs too, the trailing turn counts.
    let (la, _) = run(&a, "a_all", &["--train-on-inputs"]);
    let (lb, _) = run(&b, "b_all", &["--train-on-inputs"]);
    assert_ne!(la, lb);
}

#[test]
fn a_packed_step_equals_the_unpacked_one() {
    let dir = scratch("train", "packing");
    // Six samples of 3..8 tokens: 33 tokens, one packed row of 33 slots.
    let data = random_rows(&dir, 3..9, 11);
    let (lu, wu, _) = one_sgd_step(
        &dir,
        &data,
        "unpacked",
        &["--seq", "33", "--batch", "6", "--packing", "off"],
    );
    let (lp, wp, stdout) = one_sgd_step(
        &dir,
        &data,
        "packed",
        &["--seq", "33", "--batch", "1", "--packing", "on"],
    );
    assert!(
        stdout.contains("packing on: 100.0% of the slots hold real tokens"),
        "{stdout}"
    );
    assert!((lu - lp).abs() < 1e-5, "loss unpacked {lu}, packed {lp}");
    let d = adapter_diff(&wu, &wp);
    assert!(d < 1e-5, "adapters differ by {d}");
}
