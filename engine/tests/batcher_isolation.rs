//! No request can touch another's answer, and none can stop the batcher
//! silently: an adapter whose activations overflow (its own rows turn to
//! inf and NaN, in its logits and in its slot's cache) fails its own
//! requests and changes no token of any other request, in any slot,
//! concurrently and after it leaves; adapters that cannot be right (NaN,
//! integer tensors, another architecture's base) are refused when loaded;
//! request fields are checked in exact arithmetic; a dying scheduling
//! thread fails what it holds and reports it. References: the one-request
//! generator (itself checked against HF and PEFT).

use std::path::{Path, PathBuf};

use hlo_engine::ir::rng::Rng;
use hlo_engine::ir::{DType, Literal, TensorType};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::decoder::{LoraConfig, LoraSelect, DEFAULT_TARGETS};
use hlo_engine::{
    Backend, BackendOptions, Batcher, BatcherHandle, BatcherOptions, Event, FinishReason,
    GenerationRequest, Generator, Mode, Model, ModelSource, Sampling, SubmitError,
};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/llama/gqa_llama3")
}

fn model() -> Model {
    Model::open(&ModelSource::Checkpoint(fixture())).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hlo-isolation-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A rank-4 adapter on every projection whose tensors are `value(k)` for
/// the k-th element of each, saved as PEFT does.
fn adapter_with(name: &str, value: impl Fn(&mut Rng) -> f64) -> PathBuf {
    let m = model();
    let lora = LoraConfig::new(4, 8.0, &DEFAULT_TARGETS, false).unwrap();
    let mut a = Adapter::init(&m.config, &lora, 5);
    let mut rng = Rng::new(7);
    for (_, t) in &mut a.tensors {
        let v: Vec<f64> = (0..t.ty.element_count()).map(|_| value(&mut rng)).collect();
        *t = Literal::from_f64s(TensorType::new(DType::F32, t.ty.dims.clone()), &v);
    }
    let dir = scratch(name);
    a.save(&dir, None).unwrap();
    dir
}

fn good_adapter() -> PathBuf {
    adapter_with("good", |r| 0.2 * r.normal())
}

/// Finite weights (±3e38; f32's largest is 3.4e38) whose products
/// overflow: `x·A` is inf for any row, so its own rows compute inf, then
/// NaN, and the one-hot contraction, which computes every resident
/// entry's `x·A` for every row, meets inf in all of them.
fn overflowing_adapter() -> PathBuf {
    adapter_with("overflow", |r| if r.normal() > 0.0 { 3e38 } else { -3e38 })
}

fn options(slots: usize, loras: usize, select: Option<LoraSelect>) -> BatcherOptions {
    BatcherOptions {
        max_batch_size: slots,
        max_loras: loras,
        max_cpu_loras: 4,
        max_lora_rank: 8,
        max_model_len: 64,
        max_queue: 256,
        select,
        dtype: DType::F32,
        max_num_batched_tokens: 256,
        prefix_caching: true,
        fail_on_token: None,
    }
}

fn request(prompt: &[u32], adapter: Option<&str>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        adapter: adapter.map(str::to_string),
        max_tokens,
        sampling: Sampling::default(),
        stop_ids: Vec::new(),
    }
}

/// How a request ended: its tokens, or the failure's message.
fn outcomes(b: &BatcherHandle, requests: &[GenerationRequest]) -> Vec<Result<Vec<u32>, String>> {
    let mut rxs: Vec<_> = requests
        .iter()
        .map(|r| b.submit(r.clone()).unwrap())
        .collect();
    rxs.iter_mut()
        .map(|rx| {
            let mut out = Vec::new();
            loop {
                match rx.blocking_recv() {
                    Some(Event::Token { id, .. }) => out.push(id),
                    Some(Event::Finished(FinishReason::Length)) => return Ok(out),
                    Some(Event::Failed(m)) => return Err(m),
                    other => panic!("unexpected {other:?}"),
                }
            }
        })
        .collect()
}

/// The generator's greedy tokens (the independent reference).
fn generator_tokens(adapter: Option<&Path>, prompt: &[u32], n: usize) -> Vec<u32> {
    let m = model();
    let backend = Backend::open(&BackendOptions::cpu()).unwrap();
    let adapter = adapter.map(|d| Adapter::load(d, &m.config).unwrap());
    let g = Generator::new(
        &backend,
        &m.config,
        DType::F32,
        adapter.as_ref(),
        Mode::Jit,
        |name| m.weight(name, DType::F32, 0),
    )
    .unwrap();
    g.complete(prompt, n, &Sampling::default(), &[]).unwrap()
}

#[test]
fn an_overflowing_adapter_fails_its_own_requests_and_changes_no_other_token() {
    let good = good_adapter();
    let bad = overflowing_adapter();
    let prompts: [&[u32]; 4] = [
        &[1, 5, 9, 12, 7],
        &[1, 40, 3],
        &[1, 2, 3, 4, 5, 6, 7],
        &[1, 99],
    ];
    // Base and good-adapter requests of several lengths, so that slots
    // free and are taken again in every order.
    let mut clean = Vec::new();
    for (k, p) in prompts.iter().enumerate() {
        clean.push(request(p, None, 3 + k % 3));
        clean.push(request(p, Some("good"), 6 - k % 3));
    }
    let expected: Vec<Vec<u32>> = clean
        .iter()
        .map(|r| {
            let dir = r.adapter.as_ref().map(|_| good.as_path());
            generator_tokens(dir, &r.prompt, r.max_tokens)
        })
        .collect();
    // Four slots: decode runs 2 rows (gather) and 4 (one-hot contraction)
    // under auto, and each path alone.
    for select in [None, Some(LoraSelect::Gather), Some(LoraSelect::OneHot)] {
        let b = Batcher::spawn(
            BackendOptions::cpu(),
            model(),
            options(4, 2, select),
            &[("good".into(), good.clone()), ("bad".into(), bad.clone())],
            0,
        )
        .unwrap();
        // The bad adapter between every two others, in every slot over
        // time: its prompts (longer than the others, so their NaN keys and
        // values reach past the next occupant's prompt) overflow in the
        // prefill, and its slot's cache row is NaN when the next request
        // takes the slot.
        let long: Vec<u32> = (1..=24).map(|t| 3 * t % 120 + 1).collect();
        let mut mixed = Vec::new();
        let mut which = Vec::new();
        for (k, r) in clean.iter().enumerate() {
            mixed.push(request(&long[k % 5..], Some("bad"), 2 + k % 4));
            which.push(None);
            mixed.push(r.clone());
            which.push(Some(k));
        }
        let got = outcomes(&b, &mixed);
        for (g, w) in got.iter().zip(&which) {
            match (g, w) {
                (Err(m), None) => assert!(m.contains("NaN or infinite"), "{m}"),
                (Ok(t), None) => panic!("{select:?}: the overflowing adapter gave tokens {t:?}"),
                (g, Some(k)) => {
                    assert_eq!(g.as_ref(), Ok(&expected[*k]), "{select:?}: request {k}")
                }
            }
        }
        // Gone from the registry, its entry and slots taken over: the same
        // answers again.
        assert!(b.unload_adapter("bad"));
        let again = outcomes(&b, &clean);
        for (k, g) in again.iter().enumerate() {
            assert_eq!(
                g.as_ref(),
                Ok(&expected[k]),
                "{select:?}: after, request {k}"
            );
        }
        b.shutdown();
    }
}

#[test]
fn adapters_that_cannot_be_right_are_refused_when_loaded() {
    let b = Batcher::spawn(BackendOptions::cpu(), model(), options(2, 1, None), &[], 0).unwrap();
    let refused = |name: &str, dir: &Path, needle: &str| {
        let e = b.load_adapter(name, dir).unwrap_err().to_string();
        assert!(e.contains(needle), "{name}: {e}");
        assert!(!b.adapters().contains(&name.to_string()));
    };
    // NaN, and a finite f64 past f32's range.
    let nan = adapter_with("nan", |r| if r.normal() > 2.0 { f64::NAN } else { 0.1 });
    refused("nan", &nan, "NaN or infinite");
    let huge = adapter_with("huge", |_| 1e39);
    refused("huge", &huge, "NaN or infinite");

    // Integer tensors are not LoRA weights: the same file with each
    // tensor stored as I32.
    let good = good_adapter();
    let ints = scratch("ints");
    std::fs::create_dir_all(&ints).unwrap();
    std::fs::copy(
        good.join("adapter_config.json"),
        ints.join("adapter_config.json"),
    )
    .unwrap();
    let tensors = hlo_engine::models::io::read_safetensors(&good.join("adapter_model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let v: Vec<f64> = t.to_f64s().iter().map(|x| (x * 10.0).round()).collect();
            (
                k,
                Literal::from_f64s(TensorType::new(DType::I32, t.ty.dims.clone()), &v),
            )
        })
        .collect::<Vec<_>>();
    hlo_engine::models::io::write_safetensors(&ints.join("adapter_model.safetensors"), &tensors)
        .unwrap();
    refused("ints", &ints, "must be floating point");

    // An adapter declaring a base of another architecture with the same
    // shapes (a Gemma 3 config with this Llama's sizes) is refused; one
    // declaring this very folder, or a base that cannot be read here, is
    // served, and says what it declared.
    let gemma_base = scratch("gemma-base");
    std::fs::create_dir_all(&gemma_base).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    config["model_type"] = "gemma3_text".into();
    config["architectures"] = serde_json::json!(["Gemma3ForCausalLM"]);
    std::fs::write(gemma_base.join("config.json"), config.to_string()).unwrap();
    let declaring = |name: &str, base: &str| {
        let dir = adapter_with(name, |r| 0.1 * r.normal());
        let path = dir.join("adapter_config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        c["base_model_name_or_path"] = base.into();
        std::fs::write(&path, c.to_string()).unwrap();
        dir
    };
    let gemma = declaring("for-gemma", gemma_base.to_str().unwrap());
    refused("for-gemma", &gemma, "gemma3_text");
    // Same architecture, other shapes: refused too.
    let wide_base = scratch("wide-base");
    std::fs::create_dir_all(&wide_base).unwrap();
    config["model_type"] = "llama".into();
    config["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    config["intermediate_size"] = (config["intermediate_size"].as_i64().unwrap() * 2).into();
    std::fs::write(wide_base.join("config.json"), config.to_string()).unwrap();
    let wide = declaring("for-wide", wide_base.to_str().unwrap());
    refused("for-wide", &wide, "shapes");

    let mine = declaring("for-me", fixture().to_str().unwrap());
    assert_eq!(
        b.load_adapter("for-me", &mine).unwrap().as_deref(),
        fixture().to_str()
    );
    let elsewhere = declaring("elsewhere", "some-org/not-in-this-cache");
    assert_eq!(
        b.load_adapter("elsewhere", &elsewhere).unwrap().as_deref(),
        Some("some-org/not-in-this-cache")
    );
    let infos = b.adapter_infos();
    assert_eq!(infos.len(), 2);
    assert_eq!(
        infos[0].declared_base.as_deref(),
        Some("some-org/not-in-this-cache")
    );
    b.shutdown();
}

#[test]
fn request_fields_are_checked_in_exact_arithmetic() {
    let b = Batcher::spawn(BackendOptions::cpu(), model(), options(2, 1, None), &[], 0).unwrap();
    let invalid = |r: GenerationRequest, field: &str| match b.submit(r) {
        Err(SubmitError::Invalid(f, m)) => assert_eq!(f, field, "{m}"),
        Err(e) => panic!("{field}: {e}"),
        Ok(_) => panic!("{field}: accepted"),
    };
    // len + max_tokens would wrap in i64 arithmetic.
    invalid(request(&[1, 2, 3], None, usize::MAX), "max_tokens");
    invalid(request(&[1, 2, 3], None, 62), "max_tokens");
    invalid(request(&[1; 64], None, 1), "prompt");
    invalid(request(&[1; 200], None, 1), "prompt");
    invalid(request(&[], None, 1), "prompt");
    invalid(request(&[1, 2], None, 0), "max_tokens");
    // A top-k past the vocabulary is every token, as top_k = 0.
    let mut all = request(&[1, 5, 9], None, 6);
    all.sampling = Sampling {
        temperature: Some(0.7),
        top_k: Some(u32::MAX),
        top_p: None,
        seed: 3,
    };
    let mut zero = all.clone();
    zero.sampling.top_k = None;
    let got = outcomes(&b, &[all, zero, request(&[1, 2, 3], None, 61)]);
    assert_eq!(got[0], got[1]);
    assert_eq!(got[2].as_ref().map(Vec::len), Ok(61));
    b.shutdown();
}

#[test]
fn a_dying_batcher_fails_what_it_holds_and_says_so() {
    let mut o = options(2, 1, None);
    o.fail_on_token = Some(77);
    let b = Batcher::spawn(BackendOptions::cpu(), model(), o, &[], 0).unwrap();
    assert_eq!(b.failure(), None);
    let fine = outcomes(&b, &[request(&[1, 2, 3], None, 4)]);
    assert!(fine[0].is_ok());
    // A long request running, then the one that kills the thread.
    let mut running = b.submit(request(&[1, 2, 3], None, 60)).unwrap();
    assert!(matches!(running.blocking_recv(), Some(Event::Token { .. })));
    let killer = outcomes(&b, &[request(&[1, 77, 3], None, 4)]);
    assert!(
        killer[0]
            .as_ref()
            .is_err_and(|m| m.contains("batcher failed")),
        "{killer:?}"
    );
    let ended = loop {
        match running.blocking_recv() {
            Some(Event::Token { .. }) => continue,
            other => break other,
        }
    };
    assert!(
        matches!(&ended, Some(Event::Failed(m)) if m.contains("test hook")),
        "{ended:?}"
    );
    assert!(b.failure().is_some_and(|m| m.contains("panicked")));
    assert!(matches!(
        b.submit(request(&[1, 2], None, 2)),
        Err(SubmitError::Failed(_))
    ));
    b.shutdown();
}
