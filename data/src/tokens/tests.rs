//! Prepared shards against the rows read directly, the loader over them,
//! the processes' shares of a batch, and an interrupted preparation.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::tokenizer::{BYTE_EOS, BYTE_VOCAB};
use crate::{Loader, Reader, Tokenizer};

/// A scratch folder of its own.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hlo-data-tokens-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A JSONL file of `n` text rows of varied lengths (some prompt and
/// completion rows, whose prompts are not learned).
fn corpus(dir: &Path, n: usize) -> PathBuf {
    let mut text = String::new();
    for i in 0..n {
        let word = "abcdefghij".repeat(1 + (i * 7) % 5);
        if i % 3 == 0 {
            text += &format!(
                "{{\"prompt\": \"q{i}=\", \"completion\": \"{}\"}}\n",
                &word[..3 + i % 4]
            );
        } else {
            text += &format!("{{\"text\": \"row {i}: {word}\"}}\n");
        }
    }
    let path = dir.join("corpus.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

fn options(out: &Path, rows_per_shard: u64, fingerprint: &str) -> PrepareOptions {
    PrepareOptions {
        out: out.to_path_buf(),
        source: Source {
            path: "corpus.jsonl".into(),
            fingerprint: fingerprint.into(),
            chat_template: None,
            train_on_inputs: false,
            eos: Some(BYTE_EOS),
        },
        tokenizer: Tokenizer::bytes().fingerprint(),
        rows_per_shard,
        threads: 3,
    }
}

fn reader(t: &Tokenizer) -> Reader<'_> {
    Reader {
        tokenizer: Some(t),
        eos: Some(BYTE_EOS),
        vocab: BYTE_VOCAB,
        chat: None,
        max_tokens: None,
    }
}

#[test]
fn shards_hold_the_rows_as_train_reads_them() {
    let dir = scratch("same");
    let data = corpus(&dir, 50);
    let t = Tokenizer::bytes();
    let m = prepare(
        std::slice::from_ref(&data),
        &reader(&t),
        &options(&dir.join("out"), 16, "a"),
        &mut |_| {},
    )
    .unwrap();
    assert!(m.complete);
    assert_eq!((m.samples, m.shards.len()), (50, 4));
    let shards = TokenShards::open(&dir.join("out")).unwrap();
    shards.verify().unwrap();
    let direct = reader(&t).read_path(&data).unwrap();
    for (i, e) in direct.iter().enumerate() {
        assert_eq!(&shards.sample(i, usize::MAX), e, "sample {i}");
        assert_eq!(shards.sample(i, 5).ids, e.ids[..5.min(e.ids.len())]);
    }
    let tokens: usize = direct.iter().map(|e| e.ids.len()).sum();
    assert_eq!(m.tokens as usize, tokens);
    // In file order, a loader over the shards gives the same batches as
    // one over the rows read directly, packed or not.
    for packing in [false, true] {
        let mut a = Loader::new(direct.clone(), 24, 4, 0)
            .packed(packing)
            .in_file_order(true);
        let mut b = Loader::from_shards(
            Arc::new(TokenShards::open(&dir.join("out")).unwrap()),
            24,
            4,
            0,
        )
        .packed(packing)
        .in_file_order(true);
        for _ in 0..20 {
            assert_eq!(a.next_batch(), b.next_batch());
        }
        assert_eq!(a.cursor, b.cursor);
    }
}

#[test]
fn every_process_count_walks_the_same_global_batches() {
    let dir = scratch("processes");
    let data = corpus(&dir, 40);
    let t = Tokenizer::bytes();
    prepare(
        &[data],
        &reader(&t),
        &options(&dir.join("out"), 8, "a"),
        &mut |_| {},
    )
    .unwrap();
    let shards = Arc::new(TokenShards::open(&dir.join("out")).unwrap());
    let (seq, rows) = (32, 8);
    let loader = |owned: Option<Vec<bool>>| {
        let l = Loader::from_shards(shards.clone(), seq, rows, 5).packed(true);
        match owned {
            Some(o) => l.with_owned_rows(o),
            None => l,
        }
    };
    let mut one = loader(None);
    let global: Vec<_> = (0..12).map(|_| one.next_batch()).collect();
    for processes in [2, 4] {
        // Process p holds rows p·rows/P .. (p+1)·rows/P of each batch.
        let mut each: Vec<Loader> = (0..processes)
            .map(|p| loader(Some((0..rows).map(|r| r * processes / rows == p).collect())))
            .collect();
        for (step, want) in global.iter().enumerate() {
            let parts: Vec<_> = each.iter_mut().map(|l| l.next_batch()).collect();
            for r in 0..rows {
                let got = &parts[r * processes / rows];
                let span = r * seq..(r + 1) * seq;
                assert_eq!(
                    got.ids[span.clone()],
                    want.ids[span.clone()],
                    "P {processes} step {step} row {r}"
                );
                assert_eq!(got.loss_mask[span.clone()], want.loss_mask[span.clone()]);
                assert_eq!(got.segment_ids[span.clone()], want.segment_ids[span]);
            }
        }
        assert!(each.iter().all(|l| l.cursor == one.cursor));
    }
    // The order is a shuffle, and a loader resumed at a cursor goes on
    // as the uninterrupted one.
    assert_ne!(
        global[0],
        Loader::from_shards(shards.clone(), seq, rows, 5)
            .packed(true)
            .in_file_order(true)
            .next_batch()
    );
    let mut resumed = loader(None);
    resumed.cursor = {
        let mut l = loader(None);
        (0..5).for_each(|_| {
            l.next_batch();
        });
        l.cursor
    };
    assert_eq!(resumed.next_batch(), global[5]);
}

#[test]
fn an_interrupted_preparation_resumes_and_another_is_refused() {
    let dir = scratch("resume");
    let data = corpus(&dir, 30);
    let t = Tokenizer::bytes();
    let (whole, cut) = (dir.join("whole"), dir.join("cut"));
    let want = prepare(
        std::slice::from_ref(&data),
        &reader(&t),
        &options(&whole, 7, "a"),
        &mut |_| {},
    )
    .unwrap();
    // Interrupted after two shards, the third half written.
    let mut reports = 0;
    prepare(
        std::slice::from_ref(&data),
        &reader(&t),
        &options(&cut, 7, "a"),
        &mut |_| reports += 1,
    )
    .unwrap();
    assert_eq!(reports, 5);
    let mut m = Manifest::read(&cut).unwrap().unwrap();
    m.complete = false;
    m.shards.truncate(3);
    m.write(&cut).unwrap();
    std::fs::write(cut.join("shard-00002.ids"), b"12").unwrap();
    for k in 3..5 {
        for ext in ["ids", "mask", "offsets"] {
            std::fs::remove_file(cut.join(format!("shard-{k:05}.{ext}"))).unwrap();
        }
    }
    assert!(
        TokenShards::open(&cut).is_err(),
        "an incomplete set is refused"
    );
    let mut made = 0;
    let got = prepare(
        std::slice::from_ref(&data),
        &reader(&t),
        &options(&cut, 7, "a"),
        &mut |_| made += 1,
    )
    .unwrap();
    assert_eq!(made, 3, "the damaged shard and the two after it");
    assert_eq!(got, want);
    for s in &want.shards {
        for ext in ["ids", "mask", "offsets"] {
            let f = format!("{}.{ext}", s.name);
            assert_eq!(
                std::fs::read(whole.join(&f)).unwrap(),
                std::fs::read(cut.join(&f)).unwrap(),
                "{f}"
            );
        }
    }
    // Complete: nothing to do. Other data into the same folder: refused.
    let mut again = 0;
    prepare(
        std::slice::from_ref(&data),
        &reader(&t),
        &options(&cut, 7, "a"),
        &mut |_| again += 1,
    )
    .unwrap();
    assert_eq!(again, 0);
    let e = prepare(&[data], &reader(&t), &options(&cut, 7, "b"), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("prepared otherwise"), "{e}");
    // A bad row names its file and row.
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"nope\": 1}\n").unwrap();
    let e = prepare(
        &[bad],
        &reader(&t),
        &options(&dir.join("bad"), 7, "c"),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("bad.jsonl: row 2"), "{e}");
}
