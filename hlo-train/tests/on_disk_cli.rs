//! What is on disk is checked when it is read, and one writer holds a
//! folder: `eval` reads prepared sets and mixtures as `train` does; a
//! damaged shard or a manifest that disagrees with its shards is refused
//! in one line; a strict mixture file; one `data prepare` and one run a
//! folder, a dead holder's lock taken over.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use hlo_engine::data::lock::{FolderLock, LOCK_FILE};
use hlo_engine::data::tokens::Manifest;

/// A JSONL corpus for the tiny model: text rows and prompt/completion
/// rows.
fn corpus(dir: &Path) -> PathBuf {
    let mut text = String::new();
    for i in 0..24 {
        let word = ["cat", "horse", "elephant", "ox"][i % 4].repeat(1 + i % 3);
        if i % 3 == 0 {
            text += &format!("{{\"prompt\": \"{i} says \", \"completion\": \"{word}\"}}\n");
        } else {
            text += &format!("{{\"text\": \"the {word} number {i}\"}}\n");
        }
    }
    let path = dir.join("corpus.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

fn prepare_args<'a>(data: &'a Path, out: &'a Path) -> Vec<&'a str> {
    vec![
        "data",
        "prepare",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--rows-per-shard",
        "8",
    ]
}

fn prepare(data: &Path, out: &Path) -> String {
    ok(&hlo_train(&prepare_args(data, out)))
}

/// `eval --json`'s loss and token count on `data`.
fn eval(data: &Path) -> (f64, u64) {
    let out = ok(&hlo_train(&[
        "eval",
        "--data",
        data.to_str().unwrap(),
        "--seq",
        "24",
        "--batch",
        "4",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    (
        v["eval_loss"].as_f64().unwrap(),
        v["eval_tokens"].as_f64().unwrap() as u64,
    )
}

/// A short run on `data`: its one-line error.
fn train_error(data: &Path) -> String {
    one_line_error(&hlo_train(&[
        "train",
        "--data",
        data.to_str().unwrap(),
        "--seq",
        "24",
        "--batch",
        "4",
        "--steps",
        "2",
    ]))
}

#[test]
fn eval_reads_a_prepared_set_and_a_mixture_as_the_jsonl() {
    let dir = scratch("on-disk", "eval");
    let data = corpus(&dir);
    let set = dir.join("set");
    prepare(&data, &set);
    let (want, tokens) = eval(&data);
    assert!(want > 0.5 && tokens > 100, "{want} {tokens}");
    let (got, got_tokens) = eval(&set);
    assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    assert_eq!(got_tokens, tokens);
    // A mixture of one stream is the set.
    let mix = dir.join("mix.json");
    std::fs::write(
        &mix,
        r#"{"streams": {"only": {"local": "set", "proportion": 1}}}"#,
    )
    .unwrap();
    let (mixed, _) = eval(&mix);
    assert!((mixed - want).abs() < 1e-6, "{mixed} vs {want}");
}

/// Rewrites shard 1's ids with one id far outside the vocabulary, its
/// checksum made to match (what only reading the ids can catch).
fn plant_large_id(set: &Path) {
    let mut m = Manifest::read(set).unwrap().unwrap();
    let path = set.join(format!("{}.ids", m.shards[1].name));
    let mut ids = std::fs::read(&path).unwrap();
    ids[4..8].copy_from_slice(&4_000_000_000u32.to_le_bytes());
    std::fs::write(&path, &ids).unwrap();
    m.shards[1].fnv1a.ids = format!("{:016x}", hlo_engine::ir::rng::fnv1a(&ids));
    m.write(set).unwrap();
}

#[test]
fn damaged_sets_and_manifests_are_refused_in_one_line() {
    let dir = scratch("on-disk", "damaged");
    let data = corpus(&dir);
    // An id of 4,000,000,000 in a vocabulary of 264.
    let set = dir.join("large-id");
    prepare(&data, &set);
    plant_large_id(&set);
    let e = train_error(&set);
    assert!(
        e.contains("holds token id 4000000000") && e.contains("prepare it again"),
        "{e}"
    );
    // A zeroed mask (checksum left): the checksum.
    let set = dir.join("zero-mask");
    prepare(&data, &set);
    let m = Manifest::read(&set).unwrap().unwrap();
    let mask = set.join(format!("{}.mask", m.shards[0].name));
    let len = std::fs::metadata(&mask).unwrap().len() as usize;
    std::fs::write(&mask, vec![0u8; len]).unwrap();
    let e = train_error(&set);
    assert!(e.contains("does not match its checksum"), "{e}");
    // A manifest whose samples count disagrees with its shards, and one
    // naming no shards: refused at open by train, eval and data.
    for (name, damage) in [
        (
            "samples",
            (|m: &mut Manifest| m.samples += 3) as fn(&mut Manifest),
        ),
        ("no-shards", |m: &mut Manifest| m.shards.clear()),
    ] {
        let set = dir.join(name);
        prepare(&data, &set);
        let mut m = Manifest::read(&set).unwrap().unwrap();
        damage(&mut m);
        m.write(&set).unwrap();
        let e = train_error(&set);
        assert!(e.contains("the set is damaged"), "{name}: {e}");
        let shown = one_line_error(&hlo_train(&["data", "--data", set.to_str().unwrap()]));
        assert!(shown.contains("the set is damaged"), "{name}: {shown}");
    }
    // Proportions whose sum overflows, and a key we do not read.
    let good = dir.join("good");
    prepare(&data, &good);
    let mix = dir.join("mix.json");
    let stream = |p: &str| format!(r#"{{"local": "good", "proportion": {p}}}"#);
    std::fs::write(
        &mix,
        format!(
            r#"{{"streams": {{"a": {}, "b": {}}}}}"#,
            stream("1e308"),
            stream("1e308")
        ),
    )
    .unwrap();
    assert!(train_error(&mix).contains("sum past the largest number"));
    std::fs::write(
        &mix,
        format!(
            r#"{{"streams": {{"a": {}}}, "shuffle": true}}"#,
            stream("1")
        ),
    )
    .unwrap();
    assert!(train_error(&mix).contains("key `shuffle`"));
}

#[test]
fn one_writer_a_folder_and_a_dead_holders_lock_is_taken_over() {
    let dir = scratch("on-disk", "lock");
    let data = corpus(&dir);
    let me = format!("pid {} on host", std::process::id());
    // A preparation under way (this test holding its folder's lock).
    let set = dir.join("set");
    let held = FolderLock::create(&set, "data prepare").unwrap();
    let e = one_line_error(&hlo_train(&prepare_args(&data, &set)));
    assert!(e.contains(&me) && e.contains("(data prepare)"), "{e}");
    assert!(
        !set.join("manifest.json").exists(),
        "the second wrote nothing"
    );
    drop(held);
    // A lock file left by a process that died: taken over, and said so.
    std::fs::write(
        set.join(LOCK_FILE),
        "pid 4194304 on host gone (data prepare)\n",
    )
    .unwrap();
    let said = prepare(&data, &set);
    assert!(
        said.contains("took over") && said.contains("pid 4194304"),
        "{said}"
    );
    assert!(!set.join(LOCK_FILE).exists(), "released at the end");
    // A run folder another run writes: refused at start, naming it.
    let out = dir.join("run");
    let held = FolderLock::create(&out, "train").unwrap();
    let e = one_line_error(&hlo_train(&[
        "train",
        "--data",
        set.to_str().unwrap(),
        "--seq",
        "24",
        "--batch",
        "4",
        "--steps",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]));
    assert!(e.contains(&me) && e.contains("(train)"), "{e}");
    drop(held);
}

#[test]
fn a_mixture_is_named_in_the_header_and_reported_by_draws() {
    let dir = scratch("on-disk", "mixture");
    let data = corpus(&dir);
    prepare(&data, &dir.join("a"));
    prepare(&data, &dir.join("b"));
    let mix = dir.join("mix.json");
    std::fs::write(
        &mix,
        r#"{"streams": {"a": {"local": "a", "proportion": 3}, "b": {"local": "b", "proportion": 1}}}"#,
    )
    .unwrap();
    let metrics = dir.join("m.jsonl");
    let said = ok(&hlo_train(&[
        "train",
        "--data",
        mix.to_str().unwrap(),
        "--seq",
        "24",
        "--batch",
        "8",
        "--steps",
        "2",
        "--packing",
        "off",
        "--log-every",
        "1",
        "--metrics",
        metrics.to_str().unwrap(),
    ]));
    assert!(
        said.contains("data: a mixture drawn as a 0.750, b 0.250 (the proportions given sum to 4; normalised)"),
        "{said}"
    );
    // Unpacked, a row a draw: each step's draws of a set are its samples.
    let (a, b) = (
        metric(&metrics, "data/a/samples"),
        metric(&metrics, "data/b/samples"),
    );
    let draws = metric(&metrics, "data/a/draws");
    assert_eq!(a.len(), 2);
    for k in 0..2 {
        assert_eq!(a[k].1 + b[k].1, 8.0);
        assert!((draws[k].1 - a[k].1 / 8.0).abs() < 1e-12);
    }
}

#[test]
fn a_saved_cursor_the_data_cannot_have_reached_is_refused() {
    let dir = scratch("on-disk", "cursor");
    let out = dir.join("run");
    ok(&hlo_train(&[
        "train",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "8",
        "--out",
        out.to_str().unwrap(),
    ]));
    let path = out.join("train_state/state.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut state: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(state["data_cursor"].as_u64().unwrap() <= 2 * 2 * 8);
    state["data_cursor"] = u64::MAX.into();
    std::fs::write(&path, state.to_string()).unwrap();
    let e = one_line_error(&hlo_train(&[
        "train",
        "--resume",
        out.to_str().unwrap(),
        "--steps",
        "3",
    ]));
    assert!(
        e.contains("data_cursor 18446744073709551615 is past"),
        "{e}"
    );
}
