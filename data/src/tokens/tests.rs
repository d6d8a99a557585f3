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
        assert_eq!(&shards.sample(i, usize::MAX).unwrap(), e, "sample {i}");
        assert_eq!(
            shards.sample(i, 5).unwrap().ids,
            e.ids[..5.min(e.ids.len())]
        );
    }
    let tokens: usize = direct.iter().map(|e| e.ids.len()).sum();
    assert_eq!(m.tokens as usize, tokens);
    // The unpacked fill from the offsets alone, each sample cut to the row.
    let kept: usize = direct.iter().map(|e| e.ids.len().min(12)).sum();
    let want = kept as f64 / (12 * direct.len()) as f64;
    assert!((shards.unpacked_fill(12) - want).abs() < 1e-12);
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
            assert_eq!(a.next_batch().unwrap(), b.next_batch().unwrap());
        }
        assert_eq!(a.cursor, b.cursor);
    }
    // The header's figures equal those of the rows read directly: shards
    // holding prompts scan their masks, shards of text alone are known
    // from the lengths (every shard of a text-only set).
    assert!(m.shards.iter().all(|s| !s.learned_everywhere));
    let text_only = dir.join("text.jsonl");
    let rows: String = std::fs::read_to_string(&data)
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"text\""))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&text_only, rows).unwrap();
    let t_out = dir.join("text-out");
    let tm = prepare(
        std::slice::from_ref(&text_only),
        &reader(&t),
        &options(&t_out, 16, "b"),
        &mut |_| {},
    )
    .unwrap();
    assert!(tm.shards.iter().all(|s| s.learned_everywhere));
    let text_rows = reader(&t).read_path(&text_only).unwrap();
    for seq in [4, 24, 1000] {
        let want = |e: &[crate::Example]| crate::reader::stats(e, seq);
        let got = |d: &Path| TokenShards::open(d).unwrap().stats(seq);
        let (a, b) = (got(&dir.join("out")), want(&direct));
        assert_eq!(
            (a.samples, a.tokens, a.learned, a.cut),
            (b.samples, b.tokens, b.learned, b.cut),
            "seq {seq}"
        );
        let (a, b) = (got(&t_out), want(&text_rows));
        assert_eq!(
            (a.samples, a.tokens, a.learned, a.cut),
            (b.samples, b.tokens, b.learned, b.cut),
            "seq {seq}"
        );
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
    let global: Vec<_> = (0..12).map(|_| one.next_batch().unwrap()).collect();
    for processes in [2, 4] {
        // Process p holds rows p·rows/P .. (p+1)·rows/P of each batch.
        let mut each: Vec<Loader> = (0..processes)
            .map(|p| loader(Some((0..rows).map(|r| r * processes / rows == p).collect())))
            .collect();
        for (step, want) in global.iter().enumerate() {
            let parts: Vec<_> = each.iter_mut().map(|l| l.next_batch().unwrap()).collect();
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
            // Each process counts the global batch's learned tokens and fill.
            for part in &parts {
                assert_eq!(part.targets, want.targets, "P {processes} step {step}");
                assert_eq!(part.fill(), want.fill(), "P {processes} step {step}");
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
            .unwrap()
    );
    let mut resumed = loader(None);
    resumed.cursor = {
        let mut l = loader(None);
        (0..5).for_each(|_| {
            l.next_batch().unwrap();
        });
        l.cursor
    };
    assert_eq!(resumed.next_batch().unwrap(), global[5]);
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

/// A prepared set of `n` text rows each opening with `mark`, in `dir`.
fn marked_set(dir: &Path, name: &str, mark: char, n: usize) -> PathBuf {
    let text: String = (0..n)
        .map(|i| format!("{{\"text\": \"{mark}{i:04}\"}}\n"))
        .collect();
    let data = dir.join(format!("{name}.jsonl"));
    std::fs::write(&data, text).unwrap();
    let out = dir.join(name);
    let t = Tokenizer::bytes();
    prepare(&[data], &reader(&t), &options(&out, 8, name), &mut |_| {}).unwrap();
    out
}

#[test]
fn a_mixture_draws_its_sets_in_proportion_each_in_its_own_order() {
    use super::mixture::{Mixture, BLOCK};
    let dir = scratch("mixture");
    marked_set(&dir, "a", 'A', 30);
    marked_set(&dir, "b", 'B', 50);
    let file = dir.join("mix.json");
    std::fs::write(
        &file,
        r#"{"streams": {"a": {"local": "a", "proportion": 0.7}, "b": {"local": "b", "proportion": 0.3}}}"#,
    )
    .unwrap();
    assert!(Mixture::is_mixture(&file));
    let mix = Arc::new(Mixture::read(&file).unwrap());
    assert_eq!(mix.proportions(), [717.0 / 1024.0, 307.0 / 1024.0]);
    // One sample a row: each row's first token says its set, the rest
    // which sample.
    let rows = 64;
    let mut loader = Loader::from_mixture(mix.clone(), 16, rows, 3);
    let mut draws: Vec<(u8, String)> = Vec::new();
    for _ in 0..3 * BLOCK / rows {
        let b = loader.next_batch().unwrap();
        let figures = loader.set_figures();
        let mut tokens = [0usize; 2];
        for r in 0..rows {
            // (After the byte tokenizer's BOS.)
            let ids = &b.ids[r * 16 + 1..r * 16 + 7];
            let set = ids[0] as u8;
            tokens[usize::from(set == b'B')] += b.segment_ids[r * 16..(r + 1) * 16]
                .iter()
                .filter(|&&s| s > 0)
                .count();
            draws.push((set, ids[1..5].iter().map(|&c| c as u8 as char).collect()));
        }
        assert_eq!(figures[0], ("data/a/tokens".to_string(), tokens[0] as f64));
        assert_eq!(figures[4], ("data/b/tokens".to_string(), tokens[1] as f64));
        // Each set's draws in the batch, and their share (what the
        // proportions fix).
        let of_a = draws[draws.len() - rows..]
            .iter()
            .filter(|d| d.0 == b'A')
            .count();
        assert_eq!(figures[2], ("data/a/samples".to_string(), of_a as f64));
        assert_eq!(
            figures[3],
            ("data/a/draws".to_string(), of_a as f64 / rows as f64)
        );
    }
    // Every block holds the proportions exactly.
    for block in draws.chunks(BLOCK) {
        assert_eq!(block.iter().filter(|d| d.0 == b'A').count(), 717);
    }
    // Each set is walked in its own order: every 30 draws of `a` (an
    // epoch of it) are its 30 samples once each.
    let of_a: Vec<&String> = draws.iter().filter(|d| d.0 == b'A').map(|d| &d.1).collect();
    for epoch in of_a.chunks_exact(30) {
        let mut seen: Vec<&String> = epoch.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 30);
    }
    // A loader resumed at a cursor, or of another process's rows, goes on
    // as this one.
    let mut resumed = Loader::from_mixture(mix.clone(), 16, rows, 3);
    resumed.cursor = 5 * rows as u64;
    let mut again = Loader::from_mixture(mix.clone(), 16, rows, 3);
    for _ in 0..5 {
        again.next_batch().unwrap();
    }
    assert_eq!(resumed.next_batch().unwrap(), again.next_batch().unwrap());
    // Streams that cannot be read are refused.
    std::fs::write(
        &file,
        r#"{"streams": {"a": {"local": "a", "proportion": 0}}}"#,
    )
    .unwrap();
    let e = Mixture::read(&file).err().unwrap().to_string();
    assert!(e.contains("proportion"), "{e}");
}

/// A fresh set of 30 rows in 3 shards, in its own folder.
fn fresh_set(name: &str) -> PathBuf {
    let dir = scratch(name);
    let data = corpus(&dir, 30);
    let t = Tokenizer::bytes();
    let out = dir.join("out");
    prepare(
        std::slice::from_ref(&data),
        &reader(&t),
        &options(&out, 10, "a"),
        &mut |_| {},
    )
    .unwrap();
    out
}

/// Rewrites shard `k`'s file `ext` through `edit`, and its checksum in
/// the manifest when `fix_checksum` (an edit a checksum alone cannot
/// catch).
fn edit_shard(set: &Path, k: usize, ext: &str, fix_checksum: bool, edit: impl Fn(&mut Vec<u8>)) {
    let mut m = Manifest::read(set).unwrap().unwrap();
    let path = set.join(format!("{}.{ext}", m.shards[k].name));
    let mut bytes = std::fs::read(&path).unwrap();
    edit(&mut bytes);
    std::fs::write(&path, &bytes).unwrap();
    if fix_checksum {
        let sums = &mut m.shards[k].fnv1a;
        *match ext {
            "ids" => &mut sums.ids,
            "mask" => &mut sums.mask,
            _ => &mut sums.offsets,
        } = checksum(&bytes);
        m.write(set).unwrap();
    }
}

/// The error of reading every sample of `set` (None: all read).
fn read_all(set: &Path) -> Option<String> {
    let s = match TokenShards::open(set) {
        Ok(s) => s,
        Err(e) => return Some(format!("open: {e}")),
    };
    (0..s.len())
        .try_for_each(|i| s.sample(i, usize::MAX).map(|_| ()))
        .err()
        .map(|e| format!("sample: {e}"))
}

#[test]
fn a_damaged_shard_is_refused_before_any_of_its_samples_is_read() {
    // An id far outside any vocabulary, the checksum left as it was.
    let set = fresh_set("bad-id");
    edit_shard(&set, 1, "ids", false, |b| {
        b[8..12].copy_from_slice(&4_000_000_000u32.to_le_bytes())
    });
    let shards = TokenShards::open(&set).unwrap();
    // The shard's samples are refused; another shard's still read.
    assert!(shards.sample(0, usize::MAX).is_ok());
    let e = shards.sample(10, usize::MAX).unwrap_err().to_string();
    assert!(
        e.contains("shard-00001.ids") && e.contains("does not match its checksum"),
        "{e}"
    );
    assert!(shards.learned_within(12, 4).is_err());
    assert!(shards.verify().is_err());

    // The same with its checksum made to match: the largest id is read.
    let set = fresh_set("bad-id-summed");
    edit_shard(&set, 1, "ids", true, |b| {
        b[8..12].copy_from_slice(&4_000_000_000u32.to_le_bytes())
    });
    let e = read_all(&set).unwrap();
    assert!(
        e.contains("holds token id 4000000000, the manifest says at most"),
        "{e}"
    );

    // A zeroed mask, summed again: its learned count is not the manifest's.
    let set = fresh_set("zero-mask");
    edit_shard(&set, 2, "mask", true, |b| b.fill(0));
    let e = read_all(&set).unwrap();
    assert!(
        e.contains("shard-00002.mask") && e.contains("tokens learned, the manifest says"),
        "{e}"
    );

    // A mask byte that is neither 0 nor 1.
    let set = fresh_set("mask-byte");
    edit_shard(&set, 0, "mask", true, |b| b[3] = 7);
    assert!(read_all(&set).unwrap().contains("other than 0 and 1"));
}

#[test]
fn a_manifest_that_disagrees_with_its_shards_is_refused_at_open() {
    type Damage = fn(&mut Manifest);
    let cases: [(&str, Damage, &str); 5] = [
        (
            "samples",
            |m| m.samples += 5,
            "gives samples 35, its shards 30",
        ),
        ("no-shards", |m| m.shards.clear(), "names no shards"),
        (
            "empty-shard",
            |m| m.shards[1].samples = 0,
            "shard-00001 holds no samples",
        ),
        ("tokens", |m| m.shards[0].tokens += 1, "gives tokens"),
        ("max-id", |m| m.max_id = 3, "gives max_id 3"),
    ];
    for (name, damage, want) in cases {
        let set = fresh_set(name);
        let mut m = Manifest::read(&set).unwrap().unwrap();
        damage(&mut m);
        m.write(&set).unwrap();
        let e = TokenShards::open(&set)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains(want) && e.contains("prepare it again"),
            "{name}: {e}"
        );
    }
    // Offsets past the end, and decreasing, each summed again.
    let set = fresh_set("offsets-past");
    edit_shard(&set, 0, "offsets", true, |b| {
        let n = b.len();
        b[n - 8..].copy_from_slice(&1_000_000u64.to_le_bytes());
    });
    let e = read_all(&set).unwrap();
    assert!(
        e.starts_with("open:") && e.contains("not from 0 to its"),
        "{e}"
    );
    let set = fresh_set("offsets-down");
    edit_shard(&set, 0, "offsets", true, |b| {
        b[16..24].copy_from_slice(&0u64.to_le_bytes())
    });
    let e = read_all(&set).unwrap();
    assert!(
        e.starts_with("open:") && e.contains("sample 1's offsets decrease"),
        "{e}"
    );
}

#[test]
fn a_mixture_file_is_read_strictly() {
    use super::mixture::Mixture;
    let dir = scratch("mixture-strict");
    let a = marked_set(&dir, "a", 'a', 20);
    let b = marked_set(&dir, "b", 'b', 20);
    let (a, b) = (a.display().to_string(), b.display().to_string());
    let mix = |body: String| {
        let path = dir.join("mix.json");
        std::fs::write(&path, body).unwrap();
        Mixture::read(&path)
            .map(|m| m.describe())
            .map_err(|e| e.to_string())
    };
    let two = |pa: &str, pb: &str, extra: &str| {
        format!(
            r#"{{"streams": {{"a": {{"local": "{a}", "proportion": {pa}{extra}}}, "b": {{"local": "{b}", "proportion": {pb}}}}}}}"#
        )
    };
    let e = mix(two("1e308", "1e308", "")).unwrap_err();
    assert!(e.contains("sum past the largest number"), "{e}");
    for p in ["-0.5", "0", "\"x\""] {
        let e = mix(two(p, "0.5", "")).unwrap_err();
        assert!(e.contains("finite number above 0"), "{p}: {e}");
    }
    let e = mix(two("0.5", "0.5", r#", "remote": "s3://x""#)).unwrap_err();
    assert!(e.contains("key `remote`"), "{e}");
    let top =
        format!(r#"{{"shuffle": true, "streams": {{"a": {{"local": "{a}", "proportion": 1}}}}}}"#);
    let e = mix(top).unwrap_err();
    assert!(e.contains("the mixture file has the key `shuffle`"), "{e}");
    // Relative weights are normalised, and the description says so.
    assert_eq!(mix(two("0.7", "0.3", "")).unwrap(), "a 0.700, b 0.300");
    assert_eq!(
        mix(two("7", "3", "")).unwrap(),
        "a 0.700, b 0.300 (the proportions given sum to 10; normalised)"
    );
}
