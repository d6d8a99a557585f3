//! The long-context forms against the plain ones, on the CPU plugin:
//! blockwise (FlashAttention) attention against the naive form (outputs and
//! the gradients of q, k and v within 1e-5 in f32 under causal,
//! sliding-window and packed-segment masks, with grouped K/V heads,
//! attention sinks (gpt-oss) and several block sizes; its hand-written
//! backward against central finite
//! differences in f64), the chunked LM head and loss against the whole one,
//! and a whole LoRA train step with both against the plain step.

use hlo_e2e::{arg, check_grads, client, max_abs_diff, RandomLiteral, Rng};
use hlo_ir::{constant, iota, trace, value_and_grad, DType, Literal, Tensor, TensorType};
use hlo_models::attention::{blockwise_attention, grouped_attention, AttentionKind, MaskSpec};
use hlo_models::loss::{chunked_cross_entropy_sum, masked_cross_entropy_sum};
use hlo_runtime::{CompiledFunction, HostArray};

const B: i64 = 2;
const HEADS: i64 = 4;
const KV_HEADS: i64 = 2;
const D: i64 = 8;
const SCALE: f64 = 0.35;

/// Segment ids of two packed rows of `s` tokens: samples of uneven
/// lengths, a boundary inside a block and one on a block edge.
fn segments(s: i64) -> Tensor {
    let row = |cuts: &[i64]| -> Vec<f64> {
        (0..s)
            .map(|t| cuts.iter().filter(|&&c| t >= c).count() as f64)
            .collect()
    };
    let mut v = row(&[3, 8, 13]);
    v.extend(row(&[4, 5]));
    constant(Literal::from_f64s(TensorType::new(DType::I32, [B, s]), &v))
}

#[derive(Clone, Copy, Debug)]
struct Mask {
    window: Option<i64>,
    packed: bool,
    /// Tell the blockwise form the window when tracing (skip blocks).
    skip: bool,
    /// A learned sink logit per head joins each softmax (gpt-oss).
    sinks: bool,
}

fn naive(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Mask) -> Tensor {
    let sinks = mask.sinks.then_some(sinks);
    let s = q.dims()[2];
    let sq = TensorType::new(DType::I32, [s, s]);
    let (rows, cols) = (iota(sq.clone(), 0), iota(sq, 1));
    let mut on = cols.le(rows);
    if let Some(w) = mask.window {
        on = on.and(cols.gt(rows - w as f64));
    }
    if mask.packed {
        let seg = segments(s);
        let shape = [B, s, s];
        let same = seg
            .broadcast_in_dim(&shape, &[0, 1])
            .eq(seg.broadcast_in_dim(&shape, &[0, 2]));
        let on = same.and(on.broadcast_in_dim(&shape, &[1, 2]));
        grouped_attention((q, k, v), (on, &[0, 3, 4]), SCALE, sinks)
    } else {
        grouped_attention((q, k, v), (on, &[3, 4]), SCALE, sinks)
    }
}

fn blockwise(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Mask, block: i64) -> Tensor {
    let s = q.dims()[2];
    let spec = MaskSpec {
        window: mask.window.map(|w| {
            constant(Literal::from_f64s(
                TensorType::scalar(DType::I32),
                &[w as f64],
            ))
        }),
        skip_outside: mask.window.filter(|_| mask.skip),
        segments: mask.packed.then(|| segments(s)),
    };
    blockwise_attention((q, k, v), spec, SCALE, block, mask.sinks.then_some(sinks))
}

/// Output and gradients (of `sum(out · probe)`) of one form, on the plugin.
fn run(
    dtype: DType,
    s: i64,
    inputs: &[Literal],
    form: impl Fn(Tensor, Tensor, Tensor, Tensor) -> Tensor,
) -> Vec<Vec<f64>> {
    let t = |h: i64| TensorType::new(dtype, [B, h, s, D]);
    let f = trace(
        "attention",
        &[
            ("q", t(HEADS)),
            ("k", t(KV_HEADS)),
            ("v", t(KV_HEADS)),
            ("probe", TensorType::new(dtype, [B, s, HEADS * D])),
            ("sinks", TensorType::new(dtype, [HEADS])),
        ],
        |i| {
            let out = form(i["q"], i["k"], i["v"], i["sinks"]);
            let loss = (out.cast(DType::F32) * i["probe"].cast(DType::F32)).sum(&[0, 1, 2]);
            vec![("loss", loss), ("out", out)]
        },
    )
    .unwrap();
    let g = value_and_grad(&f, "loss", &["q", "k", "v", "sinks"]).unwrap();
    let exe = CompiledFunction::new(client(), &g).unwrap_or_else(|e| panic!("{e}"));
    let host: Vec<HostArray> = inputs.iter().cloned().map(HostArray::from).collect();
    exe.run(&host)
        .unwrap()
        .into_iter()
        .skip(1)
        .map(|a| Literal::from(a).to_f64s())
        .collect()
}

fn random_inputs(dtype: DType, s: i64, seed: u64) -> Vec<Literal> {
    let mut rng = Rng::from_state(seed);
    let t = |h: i64| TensorType::new(dtype, [B, h, s, D]);
    vec![
        rng.literal(t(HEADS), -1.5, 1.5),
        rng.literal(t(KV_HEADS), -1.5, 1.5),
        rng.literal(t(KV_HEADS), -1.0, 1.0),
        rng.literal(TensorType::new(dtype, [B, s, HEADS * D]), -1.0, 1.0),
        rng.literal(TensorType::new(dtype, [HEADS]), -1.0, 2.0),
    ]
}

fn compare(dtype: DType, s: i64, mask: Mask, block: i64, tol: f64) -> f64 {
    let inputs = random_inputs(dtype, s, 7 + s as u64);
    let want = run(dtype, s, &inputs, |q, k, v, sk| naive(q, k, v, sk, mask));
    let got = run(dtype, s, &inputs, |q, k, v, sk| {
        blockwise(q, k, v, sk, mask, block)
    });
    let mut worst: f64 = 0.0;
    let names = ["out", "dq", "dk", "dv", "dsinks"];
    for (name, (a, b)) in names.iter().zip(got.iter().zip(&want)) {
        let diff = max_abs_diff(a, b);
        assert!(
            diff <= tol,
            "{mask:?}, block {block}, {dtype}: {name} differs by {diff:.2e} (> {tol:.0e})"
        );
        worst = worst.max(diff);
    }
    worst
}

#[test]
fn blockwise_equals_naive_in_f32_under_every_mask() {
    let masks = [
        Mask {
            window: None,
            packed: false,
            skip: false,
            sinks: false,
        },
        Mask {
            window: Some(5),
            packed: false,
            skip: true,
            sinks: false,
        },
        Mask {
            window: Some(5),
            packed: false,
            skip: false,
            sinks: false,
        },
        Mask {
            window: None,
            packed: true,
            skip: false,
            sinks: false,
        },
        Mask {
            window: Some(6),
            packed: true,
            skip: true,
            sinks: false,
        },
        Mask {
            window: None,
            packed: false,
            skip: false,
            sinks: true,
        },
        Mask {
            window: Some(5),
            packed: true,
            skip: true,
            sinks: true,
        },
    ];
    for mask in masks {
        // Blocks of 4 (several per row, some skipped), 8, the whole
        // sequence (one block) and 1 (every key alone).
        for block in [4, 8, 16, 1] {
            let worst = compare(DType::F32, 16, mask, block, 1e-5);
            eprintln!("{mask:?} block {block}: max abs diff {worst:.1e}");
        }
    }
}

#[test]
fn blockwise_in_bf16_stays_within_rounding_of_naive() {
    let mask = Mask {
        window: Some(9),
        packed: true,
        skip: true,
        sinks: true,
    };
    compare(DType::BF16, 32, mask, 8, 6e-2);
}

#[test]
fn blockwise_backward_matches_finite_differences() {
    let s = 8;
    for mask in [
        Mask {
            window: Some(3),
            packed: true,
            skip: true,
            sinks: false,
        },
        Mask {
            window: None,
            packed: false,
            skip: false,
            sinks: false,
        },
        Mask {
            window: Some(3),
            packed: false,
            skip: true,
            sinks: true,
        },
    ] {
        check_grads(
            &format!("blockwise {mask:?}"),
            &[
                arg("q", DType::F64, &[B, HEADS, s, D], -1.5, 1.5),
                arg("k", DType::F64, &[B, KV_HEADS, s, D], -1.5, 1.5),
                arg("v", DType::F64, &[B, KV_HEADS, s, D], -1.0, 1.0),
                arg("sinks", DType::F64, &[HEADS], -1.0, 2.0),
            ],
            &["q", "k", "v", "sinks"],
            1e-6,
            |i| vec![blockwise(i["q"], i["k"], i["v"], i["sinks"], mask, 2)],
        );
    }
}

const VOCAB: i64 = 40;
const HIDDEN: i64 = 16;

/// A soft-capped head (as Gemma's) of `h: [.., HIDDEN]` by `w: [VOCAB,
/// HIDDEN]`.
fn head(w: Tensor, h: Tensor) -> Tensor {
    let d = h.dims();
    let logits = h.dot_general(
        w,
        hlo_ir::ops::DotGeneral {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contracting: vec![d.len() as i64 - 1],
            rhs_contracting: vec![1],
            precision: None,
            preferred_element_type: None,
        },
    );
    (logits / 3.0).tanh() * 3.0
}

/// The summed loss and count of `h: [B, s, HIDDEN]` through [`head`],
/// whole or in chunks.
fn loss(i: &hlo_ir::Inputs, ids: Tensor, mask: Tensor, chunk: Option<i64>) -> Vec<Tensor> {
    let (total, count) = match chunk {
        None => masked_cross_entropy_sum(head(i["w"], i["h"]), ids, mask),
        Some(c) => chunked_cross_entropy_sum(
            i["h"],
            &[("w", i["w"])],
            |c, h| head(c["w"], h),
            ids,
            mask,
            c,
        ),
    };
    vec![total, count]
}

/// Token ids and a loss mask for `B` rows of `s`: some positions not
/// counted (prompts, padding), the last never.
fn labels(s: i64) -> (Tensor, Tensor) {
    let ty = TensorType::new(DType::I32, [B, s]);
    let ids: Vec<f64> = (0..B * s).map(|k| ((k * 17 + 3) % VOCAB) as f64).collect();
    let mask: Vec<f64> = (0..B * s)
        .map(|k| f64::from(k % s != s - 1 && k % 5 != 2))
        .collect();
    (
        constant(Literal::from_f64s(ty.clone(), &ids)),
        constant(Literal::from_f64s(ty, &mask)),
    )
}

#[test]
fn chunked_loss_equals_the_whole_in_f32() {
    let s = 12;
    let types = [
        ("h", TensorType::new(DType::F32, [B, s, HIDDEN])),
        ("w", TensorType::new(DType::F32, [VOCAB, HIDDEN])),
    ];
    let mut rng = Rng::from_state(11);
    let values: Vec<HostArray> = types
        .iter()
        .map(|(_, t)| HostArray::from(rng.literal(t.clone(), -1.0, 1.0)))
        .collect();
    let run = |chunk: Option<i64>| -> Vec<Vec<f64>> {
        let f = trace("loss", &types, |i| {
            let (ids, mask) = labels(s);
            let out = loss(i, ids, mask, chunk);
            vec![("loss", out[0]), ("count", out[1])]
        })
        .unwrap();
        let g = value_and_grad(&f, "loss", &["h", "w"]).unwrap();
        let exe = CompiledFunction::new(client(), &g).unwrap();
        exe.run(&values)
            .unwrap()
            .into_iter()
            .map(|a| Literal::from(a).to_f64s())
            .collect()
    };
    let want = run(None);
    for chunk in [1, 3, 4, 6, 12] {
        let got = run(Some(chunk));
        for (name, (a, b)) in ["loss", "count", "dh", "dw"]
            .iter()
            .zip(got.iter().zip(&want))
        {
            let diff = max_abs_diff(a, b);
            assert!(diff <= 1e-5, "chunk {chunk}: {name} differs by {diff:.2e}");
        }
    }
}

#[test]
fn chunked_loss_gradients_match_finite_differences() {
    let s = 6;
    check_grads(
        "chunked loss",
        &[
            arg("h", DType::F64, &[B, s, HIDDEN], -1.0, 1.0),
            arg("w", DType::F64, &[VOCAB, HIDDEN], -1.0, 1.0),
        ],
        &["h", "w"],
        1e-6,
        |i| {
            let (ids, mask) = labels(s);
            vec![loss(i, ids, mask, Some(2))[0]]
        },
    );
}

#[test]
fn a_lora_step_with_blockwise_attention_and_a_chunked_loss_equals_the_plain_step() {
    use hlo_models::decoder::{LoraConfig, ModelConfig, DEFAULT_TARGETS};
    use hlo_models::train::{train_step, Optimizer, Schedule, TrainConfig};
    // Gemma 3's fixture: local and global layers, a soft-capped head, tied
    // embeddings; packed rows, so segments, windows and the diagonal all
    // cut blocks.
    let dir = hlo_e2e::fixture_dir("families/gemma3");
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let seq = 16;
    let run = |attention: AttentionKind, loss_chunk: Option<i64>, scan_layers: bool| {
        let mut tc = TrainConfig::new(DType::F32, 2, seq)
            .with_lora(Some(
                LoraConfig::new(4, 8.0, &DEFAULT_TARGETS, false).unwrap(),
            ))
            .with_lr(1.0, Schedule::Constant { warmup: 0 })
            .with_optimizer(Optimizer::Sgd);
        tc.clip_norm = None;
        tc.packing = true;
        tc.scan_layers = scan_layers;
        tc.attention = attention;
        tc.loss_chunk = loss_chunk;
        let step = train_step(&config, &tc).unwrap();
        let f = hlo_ir::simplify(&step.function);
        let mut rng = Rng::from_state(3);
        let inputs: Vec<HostArray> = f
            .inputs
            .iter()
            .map(|b| {
                let ty = f.ty(b.value).clone();
                let n = ty.element_count() as usize;
                let by_position = |g: fn(usize) -> usize| {
                    let v: Vec<f64> = (0..n).map(|k| g(k % 16) as f64).collect();
                    Literal::from_f64s(ty.clone(), &v)
                };
                HostArray::from(match b.name.as_str() {
                    "input_ids" => rng.literal(ty, 0.0, config.vocab_size as f64),
                    "loss_mask" => Literal::splat(ty, 1.0),
                    // Samples of 7, 7 and 2 tokens.
                    "positions" => by_position(|t| t % 7),
                    "segment_ids" => by_position(|t| t / 7),
                    "step" => Literal::scalar(DType::I32, 0.0),
                    n if n.ends_with("norm.weight") => Literal::splat(ty, 0.1),
                    _ => rng.literal(ty, -0.2, 0.2),
                })
            })
            .collect();
        let exe = CompiledFunction::new(client(), &f).unwrap();
        exe.run(&inputs)
            .unwrap()
            .into_iter()
            .map(|a| Literal::from(a).to_f64s())
            .collect::<Vec<_>>()
    };
    for scan in [false, true] {
        let want = run(AttentionKind::Naive, None, scan);
        let got = run(AttentionKind::Blockwise { block: 4 }, Some(4), scan);
        assert_eq!(got.len(), want.len());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| max_abs_diff(a, b))
            .fold(0.0, f64::max);
        // Loss, gradient norm and every updated adapter (lr 1: the update
        // is the gradient).
        assert!(
            worst <= 1e-5,
            "scan {scan}: the steps differ by {worst:.2e}"
        );
        eprintln!("scan {scan}: max abs diff {worst:.1e}");
    }
}

#[test]
fn blocks_and_chunks_that_do_not_divide_the_sequence_are_refused() {
    use hlo_models::decoder::ModelConfig;
    use hlo_models::train::{train_step, TrainConfig};
    let config = ModelConfig::preset("tiny").unwrap();
    let mut tc = TrainConfig::new(DType::F32, 2, 16);
    tc.attention = AttentionKind::Blockwise { block: 5 };
    let e = train_step(&config, &tc).err().unwrap().to_string();
    assert_eq!(e, "the attention block (5) must divide the sequence (16)");
    tc.attention = AttentionKind::Naive;
    tc.loss_chunk = Some(6);
    let e = train_step(&config, &tc).err().unwrap().to_string();
    assert_eq!(e, "the loss chunk (6) must divide the sequence (16)");
}
