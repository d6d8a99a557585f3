//! Generation's randomness and stopping: each batch draws from its own
//! stream (reproducibly), and generation stops where transformers'
//! `generate` would (generation_config.json's EOS ids).

mod common;

use common::*;

/// Each batch of `--prompts` draws its own random numbers, reproducibly:
/// identical prompts in different batches get different samples.
#[test]
fn sampled_batches_draw_independently_and_reproducibly() {
    let dir = scratch("llama", "streams");
    let prompts = dir.join("p.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"abc\"}\n".repeat(4)).unwrap();
    let p = prompts.to_str().unwrap();
    let sample = || -> Vec<Vec<u64>> {
        ok(&hlo_train(&[
            "generate",
            "--prompts",
            p,
            "--batch-size",
            "2",
            "--temperature",
            "1.0",
            "--seed",
            "3",
            "--max-new-tokens",
            "12",
            "--ignore-eos",
        ]))
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["completion_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect()
        })
        .collect()
    };
    let a = sample();
    assert_eq!(a.len(), 4);
    assert_ne!(a[0], a[1], "rows of one batch");
    assert_ne!(a[0], a[2], "row 0 of batch 1 and row 0 of batch 2");
    assert_ne!(a[1], a[3], "row 1 of batch 1 and row 1 of batch 2");
    assert_eq!(a, sample(), "the same seed draws the same");
    std::fs::remove_dir_all(dir).unwrap();
}

/// Generation stops at `generation_config.json`'s EOS ids, as
/// transformers' `generate` does, not only at config.json's.
#[test]
fn generation_stops_at_the_generation_configs_eos() {
    let dir = scratch("llama", "gen_eos");
    copy_model("gqa_llama3", &dir);
    let want = ids(&expected("gqa_llama3", "greedy"));
    // The prompt is the first five ids; stop at the third new token.
    let stop: u64 = want[7].parse().unwrap();
    let config = serde_json::json!({"bos_token_id": 1, "eos_token_id": [2, stop]});
    std::fs::write(dir.join("generation_config.json"), config.to_string()).unwrap();
    let prompt = want[..5].join(",");
    let out = ok(&hlo_train(&[
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt-ids",
        &prompt,
        "--max-new-tokens",
        "20",
    ]));
    let got: Vec<&str> = out.trim().split(',').collect();
    let first = want[5..]
        .iter()
        .position(|t| t.parse::<u64>().unwrap() == stop)
        .unwrap();
    assert_eq!(
        got,
        want[5..5 + first + 1]
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
    );
    std::fs::remove_dir_all(dir).unwrap();
}
