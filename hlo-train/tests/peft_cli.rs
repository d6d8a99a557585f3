//! PEFT adapter settings that change the computation are honoured as PEFT
//! honours them — `rank_pattern`, `alpha_pattern`, `modules_to_save` of
//! `lm_head` and `embed_tokens` — in logits, merges and a training step
//! started from the adapter (fixtures from
//! `scripts/make_peft_variant_fixtures.py`, PEFT 0.21); the ones hlo-train
//! does not compute are refused with one line.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use hlo_engine::ir::Literal;
use hlo_engine::models::io::{read_safetensors, write_safetensors};

fn variant(name: &str) -> PathBuf {
    fixture("gqa_llama3").join(name)
}

fn variant_expected(name: &str, key: &str) -> Literal {
    expected(&format!("gqa_llama3/{name}"), key)
}

/// The fixture's two rows of input ids, comma-separated.
fn rows() -> Vec<String> {
    fixture_ids()
        .iter()
        .map(|r| r.iter().map(i128::to_string).collect::<Vec<_>>().join(","))
        .collect()
}

/// Our prompt logits of both fixture rows (`[2, 9, vocab]` flattened).
fn logits(model: &Path, adapter: Option<&Path>, dir: &Path) -> Vec<f64> {
    rows()
        .iter()
        .enumerate()
        .flat_map(|(k, prompt)| {
            dump_logits(
                model,
                adapter,
                prompt,
                &dir.join(format!("logits{k}.safetensors")),
                &[],
            )
        })
        .collect()
}

/// Logits with the adapter, and of the merged model, equal PEFT's.
fn logits_and_merge_equal_peft(name: &str) {
    let dir = scratch("peft", name);
    let adapter = variant(name);
    let base = fixture("gqa_llama3");
    let got = logits(&base, Some(&adapter), &dir);
    let d = max_diff(&got, &variant_expected(name, "logits_adapter").to_f64s());
    assert!(d < 2e-5, "{name}: adapter logits differ from PEFT's by {d}");
    let merged = dir.join("merged");
    ok(&merge(&base, &adapter, &merged));
    let got = logits(&merged, None, &dir);
    let d = max_diff(&got, &variant_expected(name, "merged_logits").to_f64s());
    assert!(d < 2e-5, "{name}: merged logits differ from PEFT's by {d}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn rank_and_alpha_patterns_equal_peft() {
    logits_and_merge_equal_peft("variant_patterns");
}

#[test]
fn a_saved_lm_head_equals_peft() {
    logits_and_merge_equal_peft("variant_lm_head");
}

#[test]
fn a_saved_embedding_equals_peft() {
    logits_and_merge_equal_peft("variant_embed");
}

/// One SGD step from the adapter equals PEFT's: the loss and every tensor
/// the adapter saves (a whole module to save included).
fn one_sgd_step_equals_peft(name: &str, tensors: usize, scan: &str) {
    let dir = scratch("peft", &format!("sgd_{name}_{scan}"));
    let data = fixture_rows(&dir);
    let out = dir.join("out");
    let metrics = dir.join("m.jsonl");
    ok(&step_from_adapter(
        &variant(name),
        &data,
        &[
            "--optimizer",
            "sgd",
            "--lr",
            "0.05",
            "--clip-norm",
            "0",
            "--scan-layers",
            scan,
            "--out",
            out.to_str().unwrap(),
            "--metrics",
            metrics.to_str().unwrap(),
        ],
    ));
    let loss = variant_expected(name, "sgd.loss").to_f64s()[0];
    let first = losses(&metrics)[0];
    assert!(
        (first - loss).abs() < 1e-5,
        "{name}: {first} vs PEFT {loss}"
    );
    let ours = read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
    assert_eq!(ours.len(), tensors, "{name}");
    for (key, t) in ours {
        let theirs = variant_expected(name, &format!("sgd.{key}"));
        let d = max_diff(&t.to_f64s(), &theirs.to_f64s());
        assert!(d < 1e-4, "{name} {key}: differs from PEFT by {d}");
    }
    // The saved adapter keeps the settings.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    let theirs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(variant(name).join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    for key in ["rank_pattern", "alpha_pattern", "modules_to_save"] {
        assert_eq!(config[key], theirs[key], "{name} {key}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_step_from_an_adapter_with_patterns_equals_peft() {
    one_sgd_step_equals_peft("variant_patterns", 28, "off");
    // Patterns that name modules, not layers, scan too.
    one_sgd_step_equals_peft("variant_patterns", 28, "on");
}

#[test]
fn a_step_from_an_adapter_that_saves_lm_head_trains_it_as_peft_does() {
    one_sgd_step_equals_peft("variant_lm_head", 29, "off");
}

#[test]
fn settings_hlo_train_does_not_compute_are_refused() {
    let base = fixture("gqa_llama3");
    for (name, setting) in [
        ("lora_bias", "lora_bias = true"),
        ("trainable_token_indices", "trainable_token_indices = [3,5]"),
        ("layer_replication", "layer_replication = [[0,2],[1,2]]"),
        ("layers_to_transform", "layers_to_transform = [1]"),
    ] {
        let adapter = variant("variant_unsupported").join(name);
        let err = one_line_error(&hlo_train(&[
            "generate",
            "--checkpoint",
            base.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3",
        ]));
        assert!(
            err.contains(&format!("unsupported: {setting}")),
            "{name}: {err}"
        );
        let never = Path::new("/tmp/hlo-train-never-written");
        let err = one_line_error(&merge(&base, &adapter, never));
        assert!(err.contains("unsupported"), "{name}: {err}");
        assert!(!never.exists());
    }
    // Training from an adapter trained with dropout would differ from
    // PEFT (hlo-train trains without dropout): refused, saying what to do.
    let dir = scratch("peft", "dropout");
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let src = fixture("gqa_llama3").join("adapter");
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        adapter.join("adapter_model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(src.join("adapter_config.json"))
        .unwrap()
        .replace("\"lora_dropout\": 0.0", "\"lora_dropout\": 0.05");
    std::fs::write(adapter.join("adapter_config.json"), config).unwrap();
    let data = fixture_rows(&dir);
    let err = one_line_error(&step_from_adapter(&adapter, &data, &[]));
    assert!(
        err.contains("lora_dropout 0.05") && err.contains("set it to 0"),
        "{err}"
    );
    // For inference dropout is nothing: the adapter loads.
    ok(&hlo_train(&[
        "generate",
        "--checkpoint",
        base.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
    ]));
    std::fs::remove_dir_all(dir).unwrap();
}

/// transformers does not tie the head to the embeddings when the weights
/// hold a distinct `lm_head.weight` (it uses the file's head): neither do
/// we, so the logits are those of the untied model.
#[test]
fn a_tied_config_with_a_distinct_head_uses_the_files_head() {
    let dir = scratch("peft", "tied");
    let tied = dir.join("tied");
    std::fs::create_dir_all(&tied).unwrap();
    let src = fixture("mha_tied");
    std::fs::copy(src.join("config.json"), tied.join("config.json")).unwrap();
    let mut tensors = read_safetensors(&src.join("model.safetensors")).unwrap();
    let embed = tensors
        .iter()
        .find(|(n, _)| n == "model.embed_tokens.weight")
        .unwrap()
        .1
        .clone();
    let head: Vec<f64> = embed.to_f64s().iter().map(|v| 0.5 - v).collect();
    tensors.push((
        "lm_head.weight".into(),
        Literal::from_f64s(embed.ty.clone(), &head),
    ));
    write_safetensors(&tied.join("model.safetensors"), &tensors).unwrap();
    // The same weights under an untied config: the reference.
    let untied = dir.join("untied");
    std::fs::create_dir_all(&untied).unwrap();
    std::fs::copy(
        tied.join("model.safetensors"),
        untied.join("model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(src.join("config.json"))
        .unwrap()
        .replace(
            "\"tie_word_embeddings\": true",
            "\"tie_word_embeddings\": false",
        );
    assert!(config.contains("\"tie_word_embeddings\": false"));
    std::fs::write(untied.join("config.json"), config).unwrap();
    let dump = |model: &Path, name: &str| -> Vec<f64> {
        let out = dir.join(name);
        ok(&hlo_train(&[
            "generate",
            "--checkpoint",
            model.to_str().unwrap(),
            "--prompt-ids",
            "1,5,9,12",
            "--max-new-tokens",
            "1",
            "--dump-logits",
            out.to_str().unwrap(),
        ]));
        read_safetensors(&out).unwrap()[0].1.to_f64s()
    };
    assert_eq!(dump(&tied, "a.safetensors"), dump(&untied, "b.safetensors"));
    std::fs::remove_dir_all(dir).unwrap();
}
