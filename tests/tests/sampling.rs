//! The on-device sampler (`sample_tokens`) run on the CPU plugin, checked
//! for each mode's defining property against host computations: greedy is
//! the argmax, top-k and top-p never leave their sets, draws follow the
//! softmax, and a seed reproduces its draws.

use hlo_e2e::{client, Rng};
use hlo_ir::{trace, DType, Literal, TensorType};
use hlo_models::decoder::{hashed_uniform, sample_rows, sample_tokens};
use hlo_runtime::{CompiledFunction, HostArray};

struct Sampler {
    exe: CompiledFunction,
    batch: usize,
    vocab: usize,
}

impl Sampler {
    fn new(batch: usize, vocab: usize) -> Sampler {
        let f = trace(
            "sample",
            &[
                (
                    "logits",
                    TensorType::new(DType::F32, [batch as i64, vocab as i64]),
                ),
                ("temperature", TensorType::scalar(DType::F32)),
                ("top_k", TensorType::scalar(DType::I32)),
                ("top_p", TensorType::scalar(DType::F32)),
                ("rng", TensorType::new(DType::U64, [2])),
            ],
            |i| {
                let (next, rng) = sample_tokens(
                    i["logits"],
                    i["temperature"],
                    i["top_k"],
                    i["top_p"],
                    i["rng"],
                );
                vec![("next", next), ("rng", rng)]
            },
        )
        .unwrap();
        Sampler {
            exe: CompiledFunction::new(client(), &f).unwrap(),
            batch,
            vocab,
        }
    }

    /// One token per row of `logits` (row-major `[batch, vocab]`).
    fn draw(
        &self,
        logits: &[f32],
        temperature: f32,
        top_k: i32,
        top_p: f32,
        seed: u64,
    ) -> Vec<usize> {
        let rng = Literal::from_f64s(TensorType::new(DType::U64, [2]), &[seed as f64, 7.0]);
        let out = self
            .exe
            .run(&[
                HostArray::new(&[self.batch as i64, self.vocab as i64], logits).unwrap(),
                HostArray::scalar(temperature),
                HostArray::scalar(top_k),
                HostArray::scalar(top_p),
                HostArray::from(rng),
            ])
            .unwrap();
        let next: Vec<i32> = out[0].to_vec().unwrap();
        next.into_iter().map(|t| t as usize).collect()
    }
}

fn random_rows(batch: usize, vocab: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::from_state(seed);
    (0..batch * vocab)
        .map(|_| rng.uniform(-4.0, 4.0) as f32)
        .collect()
}

/// Indices of a row, most likely first.
fn ranked(row: &[f32]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    idx
}

fn softmax(row: &[f32], temperature: f64) -> Vec<f64> {
    let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let e: Vec<f64> = row
        .iter()
        .map(|&v| ((v as f64 - m) / temperature).exp())
        .collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

#[test]
fn greedy_is_the_argmax() {
    let (b, v) = (64, 300);
    let s = Sampler::new(b, v);
    let logits = random_rows(b, v, 1);
    for seed in [0, 1] {
        let got = s.draw(&logits, 0.0, 0, 1.0, seed);
        for (r, &t) in got.iter().enumerate() {
            assert_eq!(t, ranked(&logits[r * v..(r + 1) * v])[0], "row {r}");
        }
    }
}

#[test]
fn top_k_never_leaves_the_k_best() {
    let (b, v) = (256, 100);
    let s = Sampler::new(b, v);
    let logits = random_rows(b, v, 2);
    for (k, seed) in [(1, 3), (5, 4), (20, 5)] {
        let got = s.draw(&logits, 1.5, k, 1.0, seed);
        let mut outside_best = 0;
        for (r, &t) in got.iter().enumerate() {
            let best = ranked(&logits[r * v..(r + 1) * v]);
            assert!(best[..k as usize].contains(&t), "k={k} row {r}: {t}");
            outside_best += usize::from(t != best[0]);
        }
        // Not just greedy: with k > 1 other tokens are drawn too.
        assert_eq!(outside_best == 0, k == 1, "k={k}");
    }
}

#[test]
fn top_p_never_leaves_the_nucleus() {
    let (b, v) = (256, 60);
    let s = Sampler::new(b, v);
    let logits = random_rows(b, v, 6);
    let (p, temperature) = (0.7, 0.8);
    let got = s.draw(&logits, temperature as f32, 0, p as f32, 9);
    let mut checked = 0;
    for (r, &t) in got.iter().enumerate() {
        let row = &logits[r * v..(r + 1) * v];
        let probs = softmax(row, temperature);
        let order = ranked(row);
        let mut mass = 0.0;
        let mut nucleus = Vec::new();
        let mut near_edge = false;
        for &i in &order {
            mass += probs[i];
            nucleus.push(i);
            near_edge |= (mass - p).abs() < 1e-4;
            if mass >= p {
                break;
            }
        }
        if near_edge {
            continue; // f32 sums may fall either side of the edge
        }
        checked += 1;
        assert!(nucleus.contains(&t), "row {r}: {t} not in {nucleus:?}");
    }
    assert!(checked > 200);
}

#[test]
fn draws_follow_the_softmax() {
    // One row of 8 logits, repeated: 16384 draws over 8 seeds.
    let (b, v) = (2048, 8);
    let s = Sampler::new(b, v);
    let row: Vec<f32> = vec![1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.25, 1.5];
    let logits: Vec<f32> = row.iter().copied().cycle().take(b * v).collect();
    let temperature = 0.7;
    let mut counts = [0usize; 8];
    for seed in 0..8 {
        for t in s.draw(&logits, temperature as f32, 0, 1.0, 100 + seed) {
            counts[t] += 1;
        }
    }
    let n = (8 * b) as f64;
    for (i, q) in softmax(&row, temperature).iter().enumerate() {
        let f = counts[i] as f64 / n;
        let sd = (q * (1.0 - q) / n).sqrt();
        assert!(
            (f - q).abs() < 5.0 * sd + 1e-3,
            "token {i}: {f} vs {q} ({counts:?})"
        );
    }
}

#[test]
fn a_seed_reproduces_its_draws() {
    let (b, v) = (512, 50);
    let s = Sampler::new(b, v);
    let logits = random_rows(b, v, 11);
    let a = s.draw(&logits, 1.0, 0, 1.0, 42);
    assert_eq!(a, s.draw(&logits, 1.0, 0, 1.0, 42));
    let other = s.draw(&logits, 1.0, 0, 1.0, 43);
    let differ = a.iter().zip(&other).filter(|(x, y)| x != y).count();
    assert!(differ > b / 4, "{differ} of {b} draws differ");
}

/// The serving sampler: per-row settings and noise hashed from each row's
/// (seed, counter).
struct RowSampler {
    exe: CompiledFunction,
    batch: usize,
    vocab: usize,
}

impl RowSampler {
    fn new(batch: usize, vocab: usize) -> RowSampler {
        let rows = |d| TensorType::new(d, [batch as i64]);
        let f = trace(
            "sample_rows",
            &[
                (
                    "logits",
                    TensorType::new(DType::F32, [batch as i64, vocab as i64]),
                ),
                ("temperature", rows(DType::F32)),
                ("top_k", rows(DType::I32)),
                ("top_p", rows(DType::F32)),
                ("seed", rows(DType::U32)),
                ("counter", rows(DType::I32)),
            ],
            |i| {
                let u = hashed_uniform(i["seed"], i["counter"], vocab as i64);
                let next = sample_rows(i["logits"], i["temperature"], i["top_k"], i["top_p"], u);
                vec![("next", next), ("uniform", u)]
            },
        )
        .unwrap();
        RowSampler {
            exe: CompiledFunction::new(client(), &f).unwrap(),
            batch,
            vocab,
        }
    }

    /// Tokens and the noise, with row r's settings `settings[r]` =
    /// (temperature, top_k, top_p, seed, counter).
    fn draw(
        &self,
        logits: &[f32],
        settings: &[(f32, i32, f32, u32, i32)],
    ) -> (Vec<usize>, Vec<f32>) {
        let b = [self.batch as i64];
        let col = |k: usize| {
            settings
                .iter()
                .map(move |s| [s.0 as f64, s.1 as f64, s.2 as f64, s.3 as f64, s.4 as f64][k])
        };
        let out = self
            .exe
            .run(&[
                HostArray::new(&[self.batch as i64, self.vocab as i64], logits).unwrap(),
                HostArray::new(&b, &col(0).map(|x| x as f32).collect::<Vec<_>>()).unwrap(),
                HostArray::new(&b, &col(1).map(|x| x as i32).collect::<Vec<_>>()).unwrap(),
                HostArray::new(&b, &col(2).map(|x| x as f32).collect::<Vec<_>>()).unwrap(),
                HostArray::new(&b, &col(3).map(|x| x as u32).collect::<Vec<_>>()).unwrap(),
                HostArray::new(&b, &col(4).map(|x| x as i32).collect::<Vec<_>>()).unwrap(),
            ])
            .unwrap();
        let next: Vec<i32> = out[0].to_vec().unwrap();
        (
            next.into_iter().map(|t| t as usize).collect(),
            out[1].to_vec().unwrap(),
        )
    }
}

#[test]
fn each_row_samples_with_its_own_settings_and_noise() {
    let (b, v) = (512, 40);
    let s = RowSampler::new(b, v);
    let logits = random_rows(b, v, 21);
    // Rows alternate greedy, top-k 3, and plain sampling; seeds by row.
    let settings: Vec<_> = (0..b)
        .map(|r| match r % 3 {
            0 => (0.0, 0, 1.0, r as u32, 5),
            1 => (1.0, 3, 1.0, r as u32, 5),
            _ => (1.2, 0, 1.0, r as u32, 5),
        })
        .collect();
    let (got, noise) = s.draw(&logits, &settings);
    let mut sampled_off_argmax = 0;
    for (r, &t) in got.iter().enumerate() {
        let best = ranked(&logits[r * v..(r + 1) * v]);
        match r % 3 {
            0 => assert_eq!(t, best[0], "row {r}"),
            1 => assert!(best[..3].contains(&t), "row {r}"),
            _ => sampled_off_argmax += usize::from(t != best[0]),
        }
    }
    assert!(sampled_off_argmax > b / 6, "{sampled_off_argmax}");
    // The noise is uniform in (0, 1): mean 1/2, variance 1/12.
    let n = noise.len() as f64;
    let mean = noise.iter().map(|&u| u as f64).sum::<f64>() / n;
    let var = noise
        .iter()
        .map(|&u| (u as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    assert!(noise.iter().all(|&u| u > 0.0 && u < 1.0));
    assert!((mean - 0.5).abs() < 5.0 * (1.0 / 12.0 / n).sqrt(), "{mean}");
    assert!((var - 1.0 / 12.0).abs() < 2e-3, "{var}");
    // A row's noise depends on its own seed and counter only: shuffling
    // the other rows changes nothing, and another counter changes it.
    let mut moved = settings.clone();
    moved.swap(1, 2);
    let (_, noise2) = s.draw(&logits, &moved);
    assert_eq!(noise[0..v], noise2[0..v]);
    assert_eq!(noise[v..2 * v], noise2[2 * v..3 * v]);
    let mut later = settings.clone();
    later[0].4 = 6;
    let (_, noise3) = s.draw(&logits, &later);
    assert_ne!(noise[0..v], noise3[0..v]);
    assert_eq!(noise[v..], noise3[v..]);
}
