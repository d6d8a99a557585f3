//! `generate` and `merge` on the HF fixture models, against HF transformers
//! (greedy tokens, prompt logits), and every bad-checkpoint error path.

mod common;

use common::*;

use std::path::Path;

use hlo_engine::ir::Literal;
use hlo_engine::models::io::{read_safetensors, write_safetensors};

const MODELS: [&str; 3] = ["gqa_llama3", "mha_tied", "head_dim"];

#[test]
fn greedy_tokens_equal_hf_generate() {
    for name in MODELS {
        assert_greedy_equals_hf(&fixture(name), 5, 32, &[]);
    }
}

#[test]
fn dumped_prompt_logits_and_merged_weights_equal_hf() {
    let tmp = scratch("llama", "merge");
    for name in MODELS {
        assert_merge_gives_adapter_logits(&fixture(name), &tmp, 1e-4);
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn bad_checkpoints_give_one_clear_line() {
    let run = |dir: &Path| {
        one_line_error(&hlo_train(&[
            "generate",
            "--checkpoint",
            dir.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
        ]))
    };
    // Truncated body.
    let d = scratch("llama", "truncated");
    copy_model("gqa_llama3", &d);
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() - 100]).unwrap();
    let err = run(&d);
    assert!(
        err.contains("model.safetensors: not a valid safetensors file"),
        "{err}"
    );
    // A header length larger than the file.
    std::fs::write(
        d.join("model.safetensors"),
        [255u8, 255, 0, 0, 0, 0, 0, 0, b'{', b'}'],
    )
    .unwrap();
    assert!(run(&d).contains("not a valid safetensors file"));
    // A tensor of the wrong shape (config says more heads than the weights).
    let d = scratch("llama", "shape");
    copy_model("gqa_llama3", &d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 64", "\"intermediate_size\": 72");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let err = run(&d);
    assert!(err.contains("tensor `model.layers.0.mlp.gate_proj.weight` has shape [64, 32], config.json implies [72, 32]"), "{err}");
    // A missing tensor.
    let d = scratch("llama", "missing");
    copy_model("gqa_llama3", &d);
    let tensors: Vec<(String, Literal)> = read_safetensors(&d.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .filter(|(n, _)| n != "model.norm.weight")
        .collect();
    write_safetensors(&d.join("model.safetensors"), &tensors).unwrap();
    assert!(run(&d).contains("tensor `model.norm.weight` is missing (config.json needs it)"));
    // Weights with more layers than the config.
    let d = scratch("llama", "layers");
    copy_model("gqa_llama3", &d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let err = run(&d);
    assert!(
        err.contains("the weights have layer 1") && err.contains("num_hidden_layers = 1"),
        "{err}"
    );
    // An unsupported config.
    let cfg = std::fs::read_to_string(fixture("gqa_llama3").join("config.json"))
        .unwrap()
        .replace("\"silu\"", "\"gelu\"");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    assert!(run(&d).contains("unsupported: hidden_act `gelu`"));
    // No folder at all.
    assert!(run(Path::new("/nonexistent/model")).contains("does not exist"));
    for dir in ["truncated", "shape", "missing", "layers"] {
        let _ = std::fs::remove_dir_all(scratch("llama", dir));
    }
}

#[test]
fn bad_prompts_and_adapters_give_one_clear_line() {
    let dir = fixture("mha_tied");
    let err = one_line_error(&hlo_train(&[
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1,96",
    ]));
    assert_eq!(
        err,
        "error: token id 96 is outside the vocabulary (size 96)"
    );
    let err = one_line_error(&hlo_train(&[
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1,x",
    ]));
    assert!(
        err.contains("`x` in --prompt-ids is not a token id"),
        "{err}"
    );
    let err = one_line_error(&hlo_train(&[
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt",
        "hi",
    ]));
    assert!(err.contains("no tokenizer for this model"), "{err}");
    let err = one_line_error(&hlo_train(&[
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1",
        "--adapter",
        "/nonexistent",
    ]));
    assert!(
        err.contains("adapter /nonexistent: cannot read adapter_config.json"),
        "{err}"
    );
    // An adapter made for another model.
    let other = fixture("gqa_llama3").join("adapter");
    let err = one_line_error(&hlo_train(&[
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1",
        "--adapter",
        other.to_str().unwrap(),
    ]));
    assert!(err.contains("has shape"), "{err}");
    let err = one_line_error(&hlo_train(&[
        "generate", "--prompt", "hi", "--top-p", "1.5",
    ]));
    assert!(err.contains("--top-p must be in (0, 1]"), "{err}");
    let err = one_line_error(&hlo_train(&[
        "generate",
        "--model",
        "llama3.1-8b",
        "--prompt-ids",
        "1",
    ]));
    assert!(
        err.contains("random weights that large are not built on the host"),
        "{err}"
    );
}

#[test]
fn tiny_generates_text_with_the_byte_tokenizer() {
    let out = ok(&hlo_train(&[
        "generate",
        "--prompt",
        "abc",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    ]));
    let again = ok(&hlo_train(&[
        "generate",
        "--prompt",
        "abc",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    ]));
    assert_eq!(out, again, "seeded sampling is reproducible");
}

#[test]
fn batched_prompts_complete_as_each_prompt_alone() {
    let dir = scratch("llama", "batch");
    let name = "gqa_llama3";
    let want = ids(&expected(name, "greedy_adapter"));
    let model = fixture(name);
    let adapter = model.join("adapter");
    let prompts: [Vec<u32>; 3] = [
        want[..5].iter().map(|s| s.parse().unwrap()).collect(),
        vec![3, 1, 4],
        (0..21).map(|i| (i * 7 + 2) % 128).collect(),
    ];
    let file = dir.join("prompts.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::json!({ "input_ids": p }).to_string())
        .collect();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let common = [
        "generate",
        "--checkpoint",
        model.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--max-new-tokens",
        "32",
        "--ignore-eos",
    ];
    let mut args = common.to_vec();
    args.extend(["--prompts", file.to_str().unwrap()]);
    let out = ok(&hlo_train(&args));
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    let completion = |v: &serde_json::Value| -> Vec<String> {
        v["completion_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.to_string())
            .collect()
    };
    // Row 0 is HF's greedy generation; every row is what it gives alone.
    assert_eq!(completion(&rows[0]), want[5..].to_vec());
    for (p, row) in prompts.iter().zip(&rows) {
        assert_eq!(row["input_ids"], serde_json::json!(p));
        let ids: Vec<String> = p.iter().map(u32::to_string).collect();
        let joined = ids.join(",");
        let mut alone = common.to_vec();
        alone.extend(["--prompt-ids", &joined]);
        let got = ok(&hlo_train(&alone));
        assert_eq!(got.trim(), completion(row).join(","));
    }
}

#[test]
fn sampling_flags_on_the_command_line() {
    let model = fixture("mha_tied");
    let run = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "--checkpoint",
            model.to_str().unwrap(),
            "--prompt-ids",
            "5,6,7",
            "--max-new-tokens",
            "16",
            "--ignore-eos",
        ];
        a.extend_from_slice(extra);
        ok(&hlo_train(&a)).trim().to_string()
    };
    let greedy = run(&["--greedy"]);
    assert_eq!(run(&["--top-k", "1", "--temperature", "2"]), greedy);
    let a = run(&["--temperature", "1.5", "--seed", "3"]);
    assert_eq!(run(&["--temperature", "1.5", "--seed", "3"]), a);
    assert_ne!(run(&["--temperature", "1.5", "--seed", "4"]), a);
    assert_ne!(a, greedy);
}

#[test]
fn chat_prompts_use_the_template() {
    let chat = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chat.join("expected.json")).unwrap())
            .unwrap();
    // The first case: one user message, with the generation prompt.
    let case = &expected[0];
    assert_eq!(case["add_generation_prompt"], true);
    let text = case["messages"][0]["content"].as_str().unwrap();
    let out = hlo_train(&[
        "generate",
        "--prompt",
        text,
        "--chat-template",
        chat.join("llama_style").to_str().unwrap(),
        "--max-new-tokens",
        "2",
        "--stats",
    ]);
    ok(&out);
    // The byte-level tokenizer of the tiny model: one token per byte.
    let stats: serde_json::Value = String::from_utf8_lossy(&out.stderr)
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap();
    assert_eq!(
        stats["prefill_tokens"].as_u64().unwrap() as usize,
        case["text"].as_str().unwrap().len()
    );
    let err = one_line_error(&hlo_train(&["generate", "--prompt", "x", "--chat"]));
    assert!(err.contains("--chat needs"), "{err}");
}

#[test]
fn bad_prompt_files_name_the_line() {
    let dir = scratch("llama", "prompts");
    let file = dir.join("p.jsonl");
    for (content, want) in [
        ("{\"prompt\": \"a\"}\nnot json\n", "p.jsonl:2: not JSON"),
        (
            "\u{feff}{\"prompt\": \"a\"}\r\n\r\n{\"prompt\": 5}\n",
            "p.jsonl:3: expected",
        ),
        ("{\"text\": \"a\"}\n", "p.jsonl:1: expected"),
        ("{\"input_ids\": [1, -2]}\n", "p.jsonl:1: input_ids"),
        (
            "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}\n",
            "p.jsonl:1",
        ),
    ] {
        std::fs::write(&file, content).unwrap();
        let err = one_line_error(&hlo_train(&[
            "generate",
            "--prompts",
            file.to_str().unwrap(),
        ]));
        assert!(err.contains(want), "{err} (wanted {want})");
    }
}

#[test]
fn sharded_generation_equals_hf() {
    let name = "gqa_llama3";
    let want = ids(&expected(name, "greedy_adapter"));
    let model = fixture(name);
    let adapter = model.join("adapter");
    let prompt = want[..5].join(",");
    // Weights by the training rules; the cache split over heads where mp > 1.
    for mesh in ["dp=1,fsdp=2,mp=2", "dp=2,fsdp=1,mp=2", "dp=1,fsdp=4,mp=1"] {
        let got = ok(&hlo_train(&[
            "generate",
            "--checkpoint",
            model.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--prompt-ids",
            &prompt,
            "--max-new-tokens",
            "32",
            "--ignore-eos",
            "--mesh",
            mesh,
        ]));
        assert_eq!(got.trim(), want[5..].join(","), "{mesh}");
    }
    let err = one_line_error(&hlo_train(&[
        "generate",
        "--checkpoint",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--mesh",
        "dp=1,fsdp=3,mp=1",
    ]));
    assert!(err.contains("fsdp"), "{err}");
}
