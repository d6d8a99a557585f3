//! Llama against HF transformers: logits of the fixture models (made by
//! `scripts/make_llama_fixtures.py` with transformers 5.17 and PEFT 0.21)
//! with and without a PEFT adapter, on the CPU plugin.

use std::path::{Path, PathBuf};

use hlo_e2e::client;
use hlo_ir::{DType, Literal};
use hlo_models::adapter::Adapter;
use hlo_models::checkpoint::Checkpoint;
use hlo_models::decoder::{forward_function, LoraConfig};
use hlo_models::io::read_safetensors;
use hlo_runtime::{CompiledFunction, HostArray};

const MODELS: [&str; 3] = ["gqa_llama3", "mha_tied", "head_dim"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/llama")
        .join(name)
}

fn expected(name: &str, key: &str) -> Literal {
    read_safetensors(&fixture(name).join("expected.safetensors"))
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("{key} in {name}'s fixture"))
        .1
}

/// Runs the fixture model `name` in `dtype` (with its adapter if `adapter`)
/// on the fixture's input ids; returns the logits as f64.
fn our_logits(name: &str, dtype: DType, adapter: bool) -> Vec<f64> {
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
    let ids = expected(name, "input_ids");
    let (b, s) = (ids.ty.dims[0], ids.ty.dims[1]);
    let adapter =
        adapter.then(|| Adapter::load(&fixture(name).join("adapter"), &ckpt.config).unwrap());
    let lora: Option<&LoraConfig> = adapter.as_ref().map(|a| &a.lora);
    let f = forward_function(&ckpt.config, dtype, b, s, lora).unwrap();
    let mut inputs = Vec::new();
    for binding in &f.inputs {
        let lit = if binding.name == "input_ids" {
            ids.clone()
        } else if let Some(a) = adapter.as_ref().and_then(|a| a.get(&binding.name)) {
            a.clone()
        } else {
            ckpt.read(&binding.name, dtype).unwrap()
        };
        inputs.push(HostArray::from(lit));
    }
    let out = CompiledFunction::new(client(), &f)
        .unwrap()
        .run(&inputs)
        .unwrap();
    out[0].to_f64_vec()
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn f32_logits_equal_hf() {
    for name in MODELS {
        let got = our_logits(name, DType::F32, false);
        let want = expected(name, "logits").to_f64s();
        let d = max_abs_diff(&got, &want);
        assert!(d < 1e-4, "{name}: max abs diff {d:e}");
        println!("{name}: f32 max abs diff {d:e}");
    }
}

#[test]
fn f32_logits_with_a_peft_adapter_equal_hf() {
    for name in MODELS {
        let got = our_logits(name, DType::F32, true);
        let want = expected(name, "logits_adapter").to_f64s();
        let d = max_abs_diff(&got, &want);
        assert!(d < 1e-4, "{name} + adapter: max abs diff {d:e}");
        println!("{name} + adapter: f32 max abs diff {d:e}");
        // And the adapter matters (B is not zero in the fixture).
        assert!(max_abs_diff(&want, &expected(name, "logits").to_f64s()) > 0.1);
    }
}

#[test]
fn bf16_logits_are_close_to_hf_f32() {
    // bf16 keeps 8 mantissa bits: a logit of magnitude ~5 after a few
    // layers is good to a few hundredths. Stated tolerance: 0.15 absolute.
    for name in MODELS {
        let got = our_logits(name, DType::BF16, true);
        let want = expected(name, "logits_adapter").to_f64s();
        let d = max_abs_diff(&got, &want);
        assert!(d < 0.15, "{name} bf16: max abs diff {d}");
        println!("{name}: bf16 max abs diff {d:.4}");
    }
}
