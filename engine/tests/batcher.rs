//! The continuous batcher against the one-request generator (itself checked
//! against HF and PEFT): greedy tokens of requests on different adapters
//! (ranks and targets differ), sharing a batch or alone, are the
//! generator's; sampled tokens do not depend on the batch; adapters are
//! evicted and reloaded without changing answers.

use std::path::{Path, PathBuf};

use hlo_engine::ir::{DType, Literal, TensorType};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::decoder::{LoraConfig, LoraSelect};
use hlo_engine::{
    Backend, BackendOptions, Batcher, BatcherHandle, BatcherOptions, Event, FinishReason,
    GenerationRequest, Generator, Mode, Model, ModelSource, Sampling,
};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/llama/gqa_llama3")
}

fn model() -> Model {
    Model::open(&ModelSource::Checkpoint(fixture())).unwrap()
}

/// A random adapter of rank `rank` on `targets`, with non-zero B, saved
/// as PEFT does under a scratch folder.
fn random_adapter(name: &str, rank: i64, alpha: f64, targets: &[&str], seed: u64) -> PathBuf {
    let m = model();
    let lora = LoraConfig::new(rank, alpha, targets, false).unwrap();
    let mut a = Adapter::init(&m.config, &lora, seed);
    let mut rng = hlo_engine::ir::rng::Rng::new(seed + 1);
    for (n, t) in &mut a.tensors {
        if n.ends_with(".lora_b") {
            let v: Vec<f64> = (0..t.ty.element_count())
                .map(|_| 0.3 * rng.normal())
                .collect();
            *t = Literal::from_f64s(TensorType::new(DType::F32, t.ty.dims.clone()), &v);
        }
    }
    let dir = std::env::temp_dir().join(format!("hlo-batcher-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    a.save(&dir, None).unwrap();
    dir
}

fn options(slots: usize, loras: usize, select: LoraSelect) -> BatcherOptions {
    BatcherOptions {
        max_batch_size: slots,
        max_loras: loras,
        max_cpu_loras: 1,
        max_lora_rank: 8,
        max_model_len: 64,
        max_queue: 64,
        select: Some(select),
        dtype: DType::F32,
        max_num_batched_tokens: 256,
        prefix_caching: true,
        fail_on_token: None,
    }
}

fn request(
    prompt: &[u32],
    adapter: Option<&str>,
    max_tokens: usize,
    sampling: Sampling,
) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        adapter: adapter.map(str::to_string),
        max_tokens,
        sampling,
        stop_ids: Vec::new(),
    }
}

/// Every request's tokens, submitting all before reading any.
fn run_all(b: &BatcherHandle, requests: Vec<GenerationRequest>) -> Vec<Vec<u32>> {
    let mut rxs: Vec<_> = requests.into_iter().map(|r| b.submit(r).unwrap()).collect();
    rxs.iter_mut()
        .map(|rx| {
            let mut out = Vec::new();
            loop {
                match rx.blocking_recv() {
                    Some(Event::Token { id, .. }) => out.push(id),
                    Some(Event::Finished(r)) => {
                        assert_eq!(r, FinishReason::Length);
                        return out;
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
        })
        .collect()
}

/// The generator's tokens for each (prompt, count) with `adapter`.
fn generator_tokens(
    adapter: Option<&Path>,
    prompts: &[(&[u32], usize)],
    sampling: &Sampling,
) -> Vec<Vec<u32>> {
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
    prompts
        .iter()
        .map(|(p, n)| g.complete(p, *n, sampling, &[]).unwrap())
        .collect()
}

#[test]
fn mixed_adapters_in_one_batch_give_the_generators_greedy_tokens() {
    let qv = random_adapter("qv", 2, 4.0, &["q_proj", "v_proj"], 11);
    let mlp = random_adapter("mlp", 6, 3.0, &["gate_proj", "up_proj", "down_proj"], 12);
    let peft = fixture().join("adapter");
    let patterns = fixture().join("variant_patterns");
    let adapters: Vec<(String, PathBuf)> = vec![
        ("qv".into(), qv.clone()),
        ("mlp".into(), mlp.clone()),
        ("peft".into(), peft.clone()),
        ("patterns".into(), patterns.clone()),
    ];
    let prompts: [&[u32]; 4] = [
        &[1, 5, 9, 12, 7],
        &[1, 40, 3],
        &[
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,
        ],
        &[1, 99],
    ];
    let greedy = Sampling::default();
    let mut requests = Vec::new();
    let mut expected = Vec::new();
    for (k, (name, dir)) in [(None, None)]
        .into_iter()
        .chain(
            adapters
                .iter()
                .map(|(n, d)| (Some(n.as_str()), Some(d.as_path()))),
        )
        .enumerate()
    {
        let work: Vec<(&[u32], usize)> = prompts
            .iter()
            .enumerate()
            .map(|(j, p)| (*p, 4 + (k + j) % 5))
            .collect();
        for (p, n) in &work {
            requests.push(request(p, name, *n, greedy.clone()));
        }
        expected.extend(generator_tokens(dir, &work, &greedy));
    }
    for select in [LoraSelect::Gather, LoraSelect::OneHot] {
        // Two table entries for four adapters: loads, evictions and host
        // cache misses along the way.
        let b = Batcher::spawn(
            BackendOptions::cpu(),
            model(),
            options(3, 2, select),
            &adapters,
            0,
        )
        .unwrap();
        // Interleaved: adapters alternate between consecutive requests.
        let order: Vec<usize> = (0..prompts.len())
            .flat_map(|j| (0..=adapters.len()).map(move |k| k * prompts.len() + j))
            .collect();
        let got = run_all(&b, order.iter().map(|&i| requests[i].clone()).collect());
        for (g, &i) in got.iter().zip(&order) {
            assert_eq!(g, &expected[i], "{select:?}: request {i}");
        }
        let s = b.stats();
        let loads = s.adapter_loads.load(std::sync::atomic::Ordering::Relaxed);
        assert!(loads >= 4, "{loads} loads");
        assert!(
            s.adapter_evictions
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 2
        );
        b.shutdown();
    }
}

#[test]
fn a_requests_sampled_tokens_do_not_depend_on_its_batch() {
    let peft = fixture().join("adapter");
    let b = Batcher::spawn(
        BackendOptions::cpu(),
        model(),
        options(4, 2, LoraSelect::Gather),
        &[("peft".into(), peft)],
        0,
    )
    .unwrap();
    let sampling = |seed| Sampling {
        temperature: Some(1.0),
        top_k: Some(50),
        top_p: Some(0.95),
        seed,
    };
    let alone = run_all(&b, vec![request(&[1, 5, 9], Some("peft"), 12, sampling(7))]);
    let crowd = run_all(
        &b,
        vec![
            request(&[1, 2], None, 5, sampling(1)),
            request(&[1, 5, 9], Some("peft"), 12, sampling(7)),
            request(&[3, 3, 3, 3], Some("peft"), 9, sampling(2)),
            request(&[1, 5, 9], Some("peft"), 12, sampling(8)),
        ],
    );
    assert_eq!(alone[0], crowd[1]);
    // Another seed draws otherwise (12 tokens from 128 alike by chance:
    // practically never).
    assert_ne!(crowd[1], crowd[3]);
    b.shutdown();
}

#[test]
fn on_a_mesh_the_batcher_answers_as_on_one_device() {
    let peft = fixture().join("adapter");
    let prompts: [&[u32]; 2] = [&[1, 5, 9, 12], &[1, 40, 3, 8, 8, 2]];
    let greedy = Sampling::default();
    let mut mesh = BackendOptions::cpu();
    // K/V heads split over mp, weights over fsdp and mp.
    mesh.mesh = Some("dp=1,fsdp=2,mp=2".parse().unwrap());
    let answers: Vec<Vec<Vec<u32>>> = [BackendOptions::cpu(), mesh]
        .into_iter()
        .map(|backend| {
            let b = Batcher::spawn(
                backend,
                model(),
                options(2, 1, LoraSelect::Gather),
                &[("peft".into(), peft.clone())],
                0,
            )
            .unwrap();
            let requests = prompts
                .iter()
                .flat_map(|p| {
                    [
                        request(p, None, 6, greedy.clone()),
                        request(p, Some("peft"), 6, greedy.clone()),
                    ]
                })
                .collect();
            let out = run_all(&b, requests);
            b.shutdown();
            out
        })
        .collect();
    assert_eq!(answers[0], answers[1]);
    let want: Vec<(&[u32], usize)> = prompts.iter().map(|p| (*p, 6)).collect();
    assert_eq!(
        answers[0][1],
        generator_tokens(Some(&peft), &want, &greedy)[0]
    );
}

/// Fixture `name` of `tests/fixtures/families`.
fn family(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/families")
        .join(name)
}

#[test]
fn each_family_serves_hfs_greedy_tokens_in_one_batch() {
    // Qwen2's biases, Qwen3's head norms, Mistral's window, Gemma's local
    // and global layers: the serving programs (a bucketed prefill per
    // request, one decode step for every slot) against HF's `generate`,
    // base and adapter requests sharing the batch.
    for name in ["qwen2", "qwen3", "mistral", "gemma3"] {
        let dir = family(name);
        let expected =
            hlo_engine::models::io::read_safetensors(&dir.join("expected.safetensors")).unwrap();
        let tokens = |key: &str| -> Vec<u32> {
            let t = &expected.iter().find(|(k, _)| k == key).unwrap().1;
            t.to_i128s().iter().map(|&x| x as u32).collect()
        };
        let (base, adapted) = (tokens("greedy"), tokens("greedy_adapter"));
        let m = Model::open(&ModelSource::Checkpoint(dir.clone())).unwrap();
        let b = Batcher::spawn(
            BackendOptions::cpu(),
            m,
            options(3, 1, LoraSelect::Gather),
            &[("peft".into(), dir.join("adapter"))],
            0,
        )
        .unwrap();
        let greedy = Sampling::default();
        let got = run_all(
            &b,
            vec![
                request(&adapted[..7], Some("peft"), 24, greedy.clone()),
                request(&[3, 1, 4, 1, 5], None, 6, greedy.clone()),
                request(&base[..7], None, 24, greedy.clone()),
            ],
        );
        assert_eq!(got[0], adapted[7..], "{name} + adapter");
        assert_eq!(got[2], base[7..], "{name}");
        b.shutdown();
    }
}

#[test]
fn chunked_and_prefix_reusing_prefills_give_the_generators_tokens() {
    // A 16-token budget prefills every longer prompt over several steps
    // (while others decode), and a 60-token cache makes the last chunk of
    // the longest prompt start early, computing again positions it holds.
    let peft = fixture().join("adapter");
    let common: Vec<u32> = (0..30).map(|t| (7 * t + 3) % 120 + 1).collect();
    let with = |tail: &[u32]| -> Vec<u32> { common.iter().chain(tail).copied().collect() };
    let long: Vec<u32> = (0..50).map(|t| (5 * t + 1) % 127 + 1).collect();
    let work: Vec<(Vec<u32>, Option<&str>, usize)> = vec![
        (with(&[9, 4]), None, 6),
        (long.clone(), None, 8),
        (with(&[11]), None, 7),
        (with(&[9, 4, 2, 2]), Some("peft"), 5),
        (vec![1, 5, 9], None, 9),
        (with(&[12, 13, 14]), Some("peft"), 6),
        (long[..40].to_vec(), None, 4),
    ];
    let greedy = Sampling::default();
    let expected: Vec<Vec<u32>> = work
        .iter()
        .map(|(p, a, n)| {
            let dir = a.map(|_| peft.as_path());
            generator_tokens(dir, &[(p.as_slice(), *n)], &greedy).remove(0)
        })
        .collect();
    for prefix_caching in [true, false] {
        let mut o = options(3, 1, LoraSelect::Gather);
        o.max_model_len = 60;
        o.max_num_batched_tokens = 16;
        o.prefix_caching = prefix_caching;
        let b = Batcher::spawn(
            BackendOptions::cpu(),
            model(),
            o,
            &[("peft".into(), peft.clone())],
            0,
        )
        .unwrap();
        let requests = |range: std::ops::Range<usize>| -> Vec<GenerationRequest> {
            work[range]
                .iter()
                .map(|(p, a, n)| request(p, *a, *n, greedy.clone()))
                .collect()
        };
        // All at once, then again one at a time, in an order where each
        // finds the prefix the one before left in its (free) slot.
        let together = run_all(&b, requests(0..work.len()));
        let order = [0, 2, 3, 5, 1, 6, 4];
        let alone: Vec<Vec<u32>> = order
            .iter()
            .flat_map(|&k| run_all(&b, requests(k..k + 1)))
            .collect();
        for (k, want) in expected.iter().enumerate() {
            assert_eq!(
                &together[k], want,
                "prefix caching {prefix_caching}: request {k}"
            );
        }
        for (got, &k) in alone.iter().zip(&order) {
            assert_eq!(
                got, &expected[k],
                "prefix caching {prefix_caching}: alone {k}"
            );
        }
        let s = b.stats();
        let reused = s
            .prompt_tokens_reused
            .load(std::sync::atomic::Ordering::Relaxed);
        let chunks = s.prefill_chunks.load(std::sync::atomic::Ordering::Relaxed);
        let prompts = s.prefills.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(prompts, 2 * work.len() as u64);
        assert!(chunks > prompts, "{chunks} chunks for {prompts} prompts");
        if prefix_caching {
            // Alone, at least: the 30 shared tokens for the second base
            // request and for the second adapter one (not from the base
            // request before it), and 39 of the long prompt's 40.
            assert!(reused >= 30 + 30 + 39, "{reused} tokens reused");
        } else {
            assert_eq!(reused, 0);
        }
        b.shutdown();
    }
}
