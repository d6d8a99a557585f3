//! No command exits 0 with a result that is not a number: an adapter
//! whose products overflow makes `eval`, `generate` and `merge` exit 2
//! with one line naming it (and `merge` writes nothing); data with
//! nothing to score is refused by `eval` as `train` refuses it; MXFP4
//! scales that decode to NaN are refused when the checkpoint is read.

mod common;

use common::*;

use std::path::{Path, PathBuf};

use hlo_engine::ir::{DType, Literal, TensorType};
use hlo_engine::models::io::{read_safetensors, write_safetensors};

/// The fixture model's PEFT adapter with every value set to 1e19: finite
/// (and accepted), but `x·A·B` overflows f32 in every row.
fn overflowing_adapter(root: &Path) -> PathBuf {
    let from = fixture("gqa_llama3").join("adapter");
    let to = root.join("overflowing");
    std::fs::create_dir_all(&to).unwrap();
    std::fs::copy(
        from.join("adapter_config.json"),
        to.join("adapter_config.json"),
    )
    .unwrap();
    let tensors: Vec<(String, Literal)> = read_safetensors(&from.join("adapter_model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(name, t)| {
            let values = vec![1e19; t.ty.element_count()];
            let ty = TensorType::new(DType::F32, t.ty.dims.clone());
            (name, Literal::from_f64s(ty, &values))
        })
        .collect();
    write_safetensors(&to.join("adapter_model.safetensors"), &tensors).unwrap();
    to
}

#[test]
fn an_adapter_whose_products_overflow_gets_no_exit_0() {
    let root = scratch("non-finite", "adapter");
    let bad = overflowing_adapter(&root);
    let (ckpt, bad_s) = (fixture("gqa_llama3"), bad.to_str().unwrap());
    let data = fixture_rows(&root);
    let e = one_line_error(&hlo_train(&[
        "eval",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--adapter",
        bad_s,
        "--data",
        data.to_str().unwrap(),
        "--seq",
        "9",
    ]));
    assert!(e.contains("overflows") && e.contains(bad_s), "{e}");
    let e = one_line_error(&hlo_train(&[
        "generate",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--adapter",
        bad_s,
        "--prompt-ids",
        "1,5,9",
        "--max-new-tokens",
        "3",
    ]));
    assert!(e.contains(bad_s) && e.contains("NaN or infinite"), "{e}");
    // Several prompts: each line says what became of it, then one line.
    let prompts = root.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"input_ids\": [1, 5]}\n{\"input_ids\": [1, 7, 9]}\n",
    )
    .unwrap();
    let out = hlo_train(&[
        "generate",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--adapter",
        bad_s,
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-new-tokens",
        "3",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert!(lines
        .iter()
        .all(|l| l["error"].is_string() && l.get("completion").is_none()));
    let merged = root.join("merged");
    let e = one_line_error(&merge(&ckpt, &bad, &merged));
    assert!(
        e.contains("NaN or infinite") && e.contains(bad_s) && e.contains("nothing was written"),
        "{e}"
    );
    assert!(
        !merged.exists(),
        "a refused merge left {}",
        merged.display()
    );
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn eval_refuses_data_with_nothing_to_score_as_train_does() {
    let root = scratch("non-finite", "nothing");
    // Prompts longer than a row: no completion token within --seq 4.
    let data = root.join("long.jsonl");
    std::fs::write(
        &data,
        "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7], \"labels\": [-100, -100, -100, -100, -100, -100, 7]}\n",
    )
    .unwrap();
    let run = |command: &str| {
        one_line_error(&hlo_train(&[
            command,
            "--checkpoint",
            fixture("gqa_llama3").to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--seq",
            "4",
        ]))
    };
    let (eval, train) = (run("eval"), run("train"));
    assert!(
        eval.contains("has a learned token within a row of 4 tokens"),
        "{eval}"
    );
    assert_eq!(eval, train);
    std::fs::remove_dir_all(root).unwrap();
}

/// `bytes` of tensor `name` in the safetensors file at `path`, changed by
/// `edit`.
fn edit_tensor_bytes(path: &Path, name: &str, edit: impl Fn(&mut [u8])) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let offsets = &header[name]["data_offsets"];
    let (start, end) = (
        8 + n + offsets[0].as_u64().unwrap() as usize,
        8 + n + offsets[1].as_u64().unwrap() as usize,
    );
    edit(&mut bytes[start..end]);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn mxfp4_scales_that_decode_to_nan_are_refused_naming_the_tensor() {
    let root = scratch("non-finite", "mxfp4");
    let dir = root.join("gpt_oss");
    std::fs::create_dir_all(&dir).unwrap();
    let from = family("gpt_oss").join("mxfp4");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(from.join(f), dir.join(f)).unwrap();
    }
    let name = "model.layers.1.mlp.experts.down_proj_scales";
    edit_tensor_bytes(&dir.join("model.safetensors"), name, |b| b[3] = 255);
    let e = one_line_error(&hlo_train(&[
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--max-new-tokens",
        "1",
    ]));
    assert!(
        e.contains(&format!("`{name}` has 1 scales of 255 (NaN in MXFP4)")),
        "{e}"
    );
    std::fs::remove_dir_all(root).unwrap();
}
