//! The continuous batcher against the one-request generator (itself checked
//! against HF and PEFT): greedy tokens of requests on different adapters
//! (ranks and targets differ), sharing a batch or alone, are the
//! generator's; sampled tokens do not depend on the batch; adapters are
//! evicted and reloaded without changing answers; prompts prefilled in
//! chunks or from another slot's prefix give the same tokens. And no
//! request can touch another's answer or stop the batcher silently (the
//! tests after `an_overflowing_adapter...`).

use std::path::{Path, PathBuf};

use hlo_engine::device::backend::{Backend, BackendOptions};
use hlo_engine::infer::batcher::{
    Batcher, BatcherHandle, BatcherOptions, Event, FinishReason, GenerationRequest, SubmitError,
};
use hlo_engine::infer::generator::{Generator, Sampling};
use hlo_engine::inputs::model::{Model, ModelSource};
use hlo_engine::ir::rng::Rng;
use hlo_engine::ir::{DType, Literal, TensorType};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::decoder::{LoraConfig, LoraSelect, DEFAULT_TARGETS};
use hlo_engine::runtime::Mode;

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
        max_num_batched_tokens: 64,
        // Every program before the first request: the tests see the steps
        // that mix decode rows and a chunk, not their fallback.
        background_compile: false,
        prefix_caching: true,
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
    generator_tokens_of(&model(), adapter, prompts, sampling)
}

/// [`generator_tokens`] of model `m`.
fn generator_tokens_of(
    m: &Model,
    adapter: Option<&Path>,
    prompts: &[(&[u32], usize)],
    sampling: &Sampling,
) -> Vec<Vec<u32>> {
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
    // A 64-token budget (chunks of 16 or 32 tokens beside decode rows)
    // prefills the longer prompts over several steps while others decode,
    // and a 60-token cache makes the last chunk of the longest prompt start
    // early, computing again positions it holds.
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
    // Third: the programs of steps with decode rows and a chunk compiled
    // while requests run, which meanwhile take the two-program fallback,
    // and each program's warm-up run lands between their steps.
    for (prefix_caching, background_compile) in [(true, false), (false, false), (true, true)] {
        let mut o = options(3, 1, LoraSelect::Gather);
        o.max_model_len = 60;
        o.max_num_batched_tokens = 64;
        o.prefix_caching = prefix_caching;
        o.background_compile = background_compile;
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

// Isolation: no request can touch another's answer, and none can stop
// the batcher silently. An adapter whose activations overflow (its own
// rows turn to inf and NaN, in its logits and in its slot's cache) fails
// its own requests and changes no token of any other request, in any
// slot, concurrently and after it leaves; adapters that cannot be right
// (NaN, integer tensors, another architecture's base) are refused when
// loaded; request fields are checked in exact arithmetic; a dying
// scheduling thread fails what it holds and reports it.

/// A fresh folder for each call (tests run at once in this binary).
fn scratch(name: &str) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("hlo-isolation-{}-{n}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A rank-4 adapter on every projection whose tensors are `value(k)` for
/// the k-th element of each, saved as PEFT does.
fn adapter_with(name: &str, value: impl Fn(&mut Rng) -> f64) -> PathBuf {
    adapter_of(&fixture(), &DEFAULT_TARGETS, 7, name, value)
}

/// A rank-4 adapter on `targets` of the model in `dir` whose tensors are
/// `value(k)` for the k-th element of each (drawn from `seed`), saved as
/// PEFT does.
fn adapter_of(
    dir: &Path,
    targets: &[&str],
    seed: u64,
    name: &str,
    value: impl Fn(&mut Rng) -> f64,
) -> PathBuf {
    let m = Model::open(&ModelSource::Checkpoint(dir.to_path_buf())).unwrap();
    let lora = LoraConfig::new(4, 8.0, targets, false).unwrap();
    let mut a = Adapter::init(&m.config, &lora, 5);
    let mut rng = Rng::new(seed);
    for (_, t) in &mut a.tensors {
        let v: Vec<f64> = (0..t.ty.element_count()).map(|_| value(&mut rng)).collect();
        *t = Literal::from_f64s(TensorType::new(DType::F32, t.ty.dims.clone()), &v);
    }
    let out = scratch(name);
    a.save(&out, None).unwrap();
    out
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

fn isolation_options(slots: usize, loras: usize, select: Option<LoraSelect>) -> BatcherOptions {
    BatcherOptions {
        select,
        max_cpu_loras: 4,
        max_queue: 256,
        ..options(slots, loras, LoraSelect::Gather)
    }
}

fn greedy_request(prompt: &[u32], adapter: Option<&str>, max_tokens: usize) -> GenerationRequest {
    request(prompt, adapter, max_tokens, Sampling::default())
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

/// The generator's greedy tokens for one prompt (the independent
/// reference).
fn greedy(adapter: Option<&Path>, prompt: &[u32], n: usize) -> Vec<u32> {
    generator_tokens(adapter, &[(prompt, n)], &Sampling::default()).remove(0)
}

/// Each of `clean`'s tokens as `alone` gives them (`good`: the adapter
/// folder of the requests that name one).
fn alone_tokens(
    clean: &[GenerationRequest],
    good: &Path,
    alone: impl Fn(Option<&Path>, &[u32], usize) -> Vec<u32>,
) -> Vec<Vec<u32>> {
    clean
        .iter()
        .map(|r| alone(r.adapter.as_ref().map(|_| good), &r.prompt, r.max_tokens))
        .collect()
}

/// Base and `good`-adapter requests of each prompt, of several lengths
/// (`most` tokens at most), so that slots free and are taken again in
/// every order.
fn clean_requests(prompts: &[&[u32]], most: usize) -> Vec<GenerationRequest> {
    let mut clean = Vec::new();
    for (k, p) in prompts.iter().enumerate() {
        clean.push(greedy_request(p, None, 3 + k % 3));
        clean.push(greedy_request(p, Some("good"), most - k % 3));
    }
    clean
}

/// Submits `clean` with a request of adapter `bad(k)` before the k-th
/// (its prompt a tail of `long`, from `shift`), all at once: each bad one
/// fails as non-finite, each clean one gets `expected` tokens.
fn assert_isolated(
    b: &BatcherHandle,
    (clean, expected): (&[GenerationRequest], &[Vec<u32>]),
    bad: impl Fn(usize) -> &'static str,
    (long, shift): (&[u32], usize),
    what: &str,
) {
    let mut mixed = Vec::new();
    for (k, r) in clean.iter().enumerate() {
        let tokens = 2 + k % 4;
        mixed.push(greedy_request(
            &long[(k + shift) % 5..],
            Some(bad(k)),
            tokens,
        ));
        mixed.push(r.clone());
    }
    for (j, got) in outcomes(b, &mixed).iter().enumerate() {
        match (got, j % 2) {
            (Err(m), 0) => assert!(m.contains("NaN or infinite"), "{what}: {m}"),
            (Ok(t), 0) => panic!("{what}: the overflowing adapter gave tokens {t:?}"),
            (got, _) => assert_eq!(
                got.as_ref(),
                Ok(&expected[j / 2]),
                "{what}: request {}",
                j / 2
            ),
        }
    }
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
    let clean = clean_requests(&prompts, 6);
    let expected = alone_tokens(&clean, &good, greedy);
    // Four slots: decode runs 2 rows (gather) and 4 (one-hot contraction)
    // under auto, and each path alone.
    for select in [None, Some(LoraSelect::Gather), Some(LoraSelect::OneHot)] {
        let b = Batcher::spawn(
            BackendOptions::cpu(),
            model(),
            isolation_options(4, 2, select),
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
        assert_isolated(
            &b,
            (&clean, &expected),
            |_| "bad",
            (&long, 0),
            &format!("{select:?}"),
        );
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

/// The same in bf16, the dtype a GPU serves in (its projections write
/// bf16 and add the LoRA branch in f32, as PEFT does): the clean
/// requests' tokens are those the batcher gives them alone, the bad
/// adapter's requests between them change none.
#[test]
fn in_bf16_an_overflowing_adapter_changes_no_other_token() {
    let (good, bad) = (good_adapter(), overflowing_adapter());
    let prompts: [&[u32]; 3] = [&[1, 5, 9, 12, 7], &[1, 40, 3], &[1, 2, 3, 4, 5, 6, 7]];
    let clean = clean_requests(&prompts, 5);
    let b = Batcher::spawn(
        BackendOptions::cpu(),
        model(),
        BatcherOptions {
            dtype: DType::BF16,
            ..isolation_options(4, 2, None)
        },
        &[("good".into(), good), ("bad".into(), bad)],
        0,
    )
    .unwrap();
    let alone: Vec<Vec<u32>> = outcomes(&b, &clean)
        .into_iter()
        .map(|o| o.expect("a clean request completes"))
        .collect();
    let long: Vec<u32> = (1..=24).map(|t| 3 * t % 120 + 1).collect();
    assert_isolated(&b, (&clean, &alone), |_| "bad", (&long, 0), "bf16");
    b.shutdown();
}

#[test]
fn adapters_that_cannot_be_right_are_refused_when_loaded() {
    let b = Batcher::spawn(
        BackendOptions::cpu(),
        model(),
        isolation_options(2, 1, None),
        &[],
        0,
    )
    .unwrap();
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
    let b = Batcher::spawn(
        BackendOptions::cpu(),
        model(),
        isolation_options(2, 1, None),
        &[],
        0,
    )
    .unwrap();
    let invalid = |r: GenerationRequest, field: &str| match b.submit(r) {
        Err(SubmitError::Invalid(f, m)) => assert_eq!(f, field, "{m}"),
        Err(e) => panic!("{field}: {e}"),
        Ok(_) => panic!("{field}: accepted"),
    };
    // len + max_tokens would wrap in i64 arithmetic.
    invalid(greedy_request(&[1, 2, 3], None, usize::MAX), "max_tokens");
    invalid(greedy_request(&[1, 2, 3], None, 62), "max_tokens");
    invalid(greedy_request(&[1; 64], None, 1), "prompt");
    invalid(greedy_request(&[1; 200], None, 1), "prompt");
    invalid(greedy_request(&[], None, 1), "prompt");
    invalid(greedy_request(&[1, 2], None, 0), "max_tokens");
    // A top-k past the vocabulary is every token, as top_k = 0.
    let mut all = greedy_request(&[1, 5, 9], None, 6);
    all.sampling = Sampling {
        temperature: Some(0.7),
        top_k: Some(u32::MAX),
        top_p: None,
        seed: 3,
    };
    let mut zero = all.clone();
    zero.sampling.top_k = None;
    let got = outcomes(&b, &[all, zero, greedy_request(&[1, 2, 3], None, 61)]);
    assert_eq!(got[0], got[1]);
    assert_eq!(got[2].as_ref().map(Vec::len), Ok(61));
    b.shutdown();
}

/// Requests asking for the largest values their fields take (a top-k
/// past the vocabulary, f32's largest temperature and the smallest
/// positive one, whose logits / T are inf, a seed of all ones, every
/// position the cache has left) run beside greedy ones: each ends on its
/// own (its tokens, or its own failure), no greedy request's token
/// changes, and the batcher serves on.
#[test]
fn requests_at_their_fields_extremes_change_no_other_token() {
    let good = good_adapter();
    let prompts: [&[u32]; 3] = [&[1, 5, 9, 12, 7], &[1, 40, 3], &[1, 2, 3, 4, 5, 6, 7]];
    let clean = clean_requests(&prompts, 6);
    let expected = alone_tokens(&clean, &good, greedy);
    let b = Batcher::spawn(
        BackendOptions::cpu(),
        model(),
        isolation_options(4, 2, None),
        &[("good".into(), good.clone())],
        0,
    )
    .unwrap();
    let extreme = |k: usize| {
        let prompt = [1, 17 + k as u32, 4];
        let temperature = [f64::from(f32::MAX), f64::from(f32::MIN_POSITIVE), 1e-300][k % 3];
        let sampling = Sampling {
            temperature: Some(temperature),
            top_k: Some(u32::MAX),
            top_p: Some(1.0),
            seed: u64::MAX,
        };
        // 64 positions: all the cache has left after the prompt.
        request(
            &prompt,
            (k % 2 == 1).then_some("good"),
            64 - prompt.len(),
            sampling,
        )
    };
    let mut mixed = Vec::new();
    for (k, r) in clean.iter().enumerate() {
        mixed.push(extreme(k));
        mixed.push(r.clone());
    }
    let got = outcomes(&b, &mixed);
    let vocab = model().config.vocab_size;
    for (k, g) in got.iter().enumerate() {
        match k % 2 {
            1 => assert_eq!(g.as_ref(), Ok(&expected[k / 2]), "greedy request {}", k / 2),
            _ => match g {
                Ok(tokens) => {
                    assert_eq!(tokens.len(), 61, "extreme request {}", k / 2);
                    assert!(tokens.iter().all(|&t| i64::from(t) < vocab), "{tokens:?}");
                }
                Err(m) => assert!(m.contains("NaN or infinite"), "{m}"),
            },
        }
    }
    // Served on: the same greedy answers again.
    let again = outcomes(&b, &clean);
    for (k, g) in again.iter().enumerate() {
        assert_eq!(g.as_ref(), Ok(&expected[k]), "after, request {k}");
    }
    assert_eq!(b.failure(), None);
    b.shutdown();
}

#[test]
fn a_dying_batcher_fails_what_it_holds_and_says_so() {
    // The test hook of HLO_TRAIN_TEST_FAIL_ON_TOKEN, for this batcher
    // alone: the variable would reach every test's batcher.
    let o = isolation_options(2, 1, None);
    let b = Batcher::spawn_failing_on_token(BackendOptions::cpu(), model(), o, &[], 0, 77).unwrap();
    assert_eq!(b.failure(), None);
    let fine = outcomes(&b, &[greedy_request(&[1, 2, 3], None, 4)]);
    assert!(fine[0].is_ok());
    // A long request running, then the one that kills the thread.
    let mut running = b.submit(greedy_request(&[1, 2, 3], None, 60)).unwrap();
    assert!(matches!(running.blocking_recv(), Some(Event::Token { .. })));
    let killer = outcomes(&b, &[greedy_request(&[1, 77, 3], None, 4)]);
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
        b.submit(greedy_request(&[1, 2], None, 2)),
        Err(SubmitError::Failed(_))
    ));
    b.shutdown();
}

/// A rank-4 adapter on the attention projections of the model in `dir`
/// (a mixture of experts' sparse MLPs are not these modules), as
/// [`adapter_of`].
fn attention_adapter(dir: &Path, name: &str, value: impl Fn(&mut Rng) -> f64) -> PathBuf {
    // Latent attention's projections where the model has them (DeepSeek-V3).
    let latent = [
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    ];
    let plain = ["q_proj", "k_proj", "v_proj", "o_proj"];
    let mla = Model::open(&ModelSource::Checkpoint(dir.to_path_buf()))
        .unwrap()
        .config
        .mla
        .is_some();
    let targets: &[&str] = if mla { &latent } else { &plain };
    adapter_of(dir, targets, 9, name, value)
}

#[test]
fn on_mixture_of_experts_bases_a_non_finite_row_changes_no_other_token() {
    // A row whose hidden state is inf or NaN used to reach other rows
    // through the experts' dispatch (its routing matched no expert; the
    // index past the last one was clamped onto another token's slot in
    // the sorted blocks). Adapters of 1e19 (finite: accepted on load; x·A·B
    // overflows to inf) and of ±3e38 (NaN), in turn, sit between every two
    // requests of the base
    // and of a benign adapter, so that over the rounds they share every
    // step with every slot. The leak was not random: it happened at every
    // step a non-finite row shared with a row routed to the last expert
    // of a layer, so each of these rounds, with dozens of shared steps,
    // meets it many times over; three rounds of the same requests (each a
    // different interleaving in the slots, as they free at different
    // steps) settle that nothing else leaks.
    for name in [
        "qwen3_moe",
        "mixtral",
        "gpt_oss",
        "qwen2_moe",
        "glm4_moe",
        "deepseek_v3",
    ] {
        let dir = family(name);
        let good = attention_adapter(&dir, &format!("{name}-good"), |r| 0.05 * r.normal());
        let huge = attention_adapter(&dir, &format!("{name}-1e19"), |_| 1e19);
        // ±3e38: its rows' products are inf of both signs, then NaN.
        let nan = attention_adapter(&dir, &format!("{name}-nan"), |r| {
            if r.normal() > 0.0 {
                3e38
            } else {
                -3e38
            }
        });
        let model = || Model::open(&ModelSource::Checkpoint(dir.clone())).unwrap();
        let m = model();
        let reference = |adapter: Option<&Path>, prompt: &[u32], n: usize| {
            generator_tokens_of(&m, adapter, &[(prompt, n)], &Sampling::default()).remove(0)
        };
        let prompts: [&[u32]; 3] = [&[1, 5, 9, 12, 7], &[1, 40, 3], &[1, 2, 3, 4, 5, 6]];
        let clean = clean_requests(&prompts, 5);
        let expected = alone_tokens(&clean, &good, reference);
        let b = Batcher::spawn(
            BackendOptions::cpu(),
            model(),
            isolation_options(4, 3, None),
            &[
                ("good".into(), good.clone()),
                ("huge".into(), huge.clone()),
                ("nan".into(), nan.clone()),
            ],
            0,
        )
        .unwrap();
        let long: Vec<u32> = (1..=16).map(|t| 3 * t % 90 + 1).collect();
        for round in 0..3 {
            let bad = move |k: usize| {
                if (k + round).is_multiple_of(2) {
                    "huge"
                } else {
                    "nan"
                }
            };
            let what = format!("{name} round {round}");
            assert_isolated(&b, (&clean, &expected), bad, (&long, round), &what);
        }
        b.shutdown();
    }
}
