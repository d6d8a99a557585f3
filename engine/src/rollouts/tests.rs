//! The rewards and logged rollouts, read and weighed.

use super::*;
use serde_json::json;
use std::path::Path;

#[test]
fn the_final_answer_is_the_last_boxed_else_number_else_word() {
    let cases = [
        ("so x = \\boxed{\\frac{1}{2}} and \\boxed{42}", Some("42")),
        ("\\boxed{a {b} c}", Some("a {b} c")),
        ("between 3 and 1,024.5 apples", Some("1024.5")),
        ("it is -7", Some("-7")),
        ("The word is (CAT).", Some("CAT")),
        ("\u{fffd}CAT", Some("\u{fffd}CAT")),
        ("", None),
        ("?!", None),
    ];
    for (text, want) in cases {
        assert_eq!(final_answer(text).as_deref(), want, "{text}");
    }
    assert!(same_answer("42.0", "42") && same_answer(" CAT ", "CAT"));
    assert!(!same_answer("CAT", "cat") && !same_answer("41", "42"));
}

#[test]
fn rewards_read_their_settings_and_weigh() {
    let spec = |rewards: &str| RolloutSpec {
        reward: rewards.split(',').map(|r| r.parse().unwrap()).collect(),
        format_regex: Some("^[A-Z]+$".into()),
        max_completion_length: 4,
        ..RolloutSpec::default()
    };
    let row = json!({"answer": "CAT"});
    let item = |completion: &'static str, ids: &'static [u32]| Scored {
        prompt: "cat=",
        completion,
        prompt_ids: &[1, 2],
        completion_ids: ids,
        row: &row,
    };
    let mut r = Rewards::new(&spec("accuracy,format:0.5,length:2")).unwrap();
    let got = r
        .score(&[item("CAT", &[3, 4, 5]), item("cat!", &[3, 4, 5, 6])])
        .unwrap();
    assert_eq!(got, vec![vec![1.0, 1.0, -0.75], vec![0.0, 0.0, -1.0]]);
    assert_eq!(r.total(&got[0]), 1.0 + 0.5 - 1.5);
    // A regex the format reward cannot use, and settings no reward reads.
    let bad = RolloutSpec {
        format_regex: Some("(".into()),
        ..spec("format")
    };
    assert!(Rewards::new(&bad).is_err());
    assert!(
        Rewards::new(&spec("accuracy")).is_err(),
        "--format-regex unread"
    );
    let no_row = json!({});
    let mut r = Rewards::new(&RolloutSpec {
        format_regex: None,
        ..spec("accuracy")
    })
    .unwrap();
    let e = r
        .score(&[Scored {
            row: &no_row,
            ..item("CAT", &[3])
        }])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no `answer` column"), "{e}");
}

#[test]
fn logged_rollouts_name_their_rewards_and_weigh_them_by_name() {
    let dir = std::env::temp_dir().join(format!("hlo-grpo-logged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let row = |r: &str| format!("{{\"prompt_ids\":[1,5],\"completion_ids\":[7],{r}}}\n");
    let named = file(
        "named.jsonl",
        &(row("\"rewards\":{\"b\":2,\"a\":1}") + &row("\"rewards\":{\"a\":-1,\"b\":0.5}")),
    );
    let w = |s: &str| -> Vec<RewardWeight> { s.split(',').map(|x| x.parse().unwrap()).collect() };
    let l = read_rollouts(&named, 2, &w("b:0.5,a:2")).unwrap();
    assert_eq!(l.names, ["a", "b"]);
    assert_eq!(l.rollouts[0].rewards, [1.0, 2.0]);
    assert_eq!(l.rollouts[0].reward, 2.0 * 1.0 + 0.5 * 2.0);
    assert_eq!(l.rollouts[1].reward, -2.0 + 0.5 * 0.5);
    // No weights: each 1.
    assert_eq!(
        read_rollouts(&named, 2, &[]).unwrap().rollouts[1].reward,
        -0.5
    );
    let err = |path: &Path, weights: &[RewardWeight]| {
        read_rollouts(path, 2, weights).unwrap_err().to_string()
    };
    for (weights, says) in [
        ("a:1", "no weight for `b`"),
        ("a:1,b:1,c:1", "names `c`"),
        ("a:1,a:2,b:1", "gives `a` twice"),
    ] {
        let e = err(&named, &w(weights));
        assert!(e.contains(says), "{weights}: {e}");
    }
    for (rows, says) in [
        (
            row("\"rewards\":{\"a\":1}") + &row("\"rewards\":{\"b\":1}"),
            "line 2: its rewards are b, and the first line's a",
        ),
        (row("\"rewards\":{\"a\":\"x\"}"), "finite number"),
        (row("\"rewards\":{}"), "object of names and numbers"),
        (row("\"reward\":1,\"rewards\":{\"a\":1}"), "not both"),
    ] {
        let e = err(&file("bad.jsonl", &rows), &[]);
        assert!(e.contains(says), "{rows}: {e}");
    }
    assert_eq!(" b: 0.5".parse::<RewardWeight>().unwrap(), w("b:0.5")[0]);
    assert!("a".parse::<RewardWeight>().is_err());
    assert!("a:inf".parse::<RewardWeight>().is_err());
    std::fs::remove_dir_all(dir).unwrap();
}
