//! Packed rows (several samples per sequence, with segment ids and
//! restarting positions) give each sample exactly the logits and the loss it
//! gets alone: for Llama, and with sliding windows (Mistral's, Qwen2's and
//! Gemma's local layers), where the window and the segment both apply.

use hlo_e2e::{client, RandomLiteral, Rng};
use hlo_ir::{trace, DType, Outputs, TensorType};
use hlo_models::attention::AttentionKind;
use hlo_models::decoder::{base_parameter_types, Decoder, ModelConfig, Params};
use hlo_runtime::{CompiledFunction, HostArray};

#[test]
fn a_packed_row_gives_each_sample_its_own_logits() {
    let family = |name: &str| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/families");
        ModelConfig::from_file(&dir.join(name).join("config.json")).unwrap()
    };
    for config in [
        ModelConfig::preset("tiny").unwrap(),
        family("mistral"),
        family("qwen2"),
        family("gemma3"),
    ] {
        packed_row_gives_each_sample_its_own_logits(&config, AttentionKind::Naive);
        // Blockwise, in blocks of 4 of the 16 positions: sample
        // boundaries inside blocks, blocks outside the window skipped.
        let blocks = AttentionKind::Blockwise { block: 4 };
        packed_row_gives_each_sample_its_own_logits(&config, blocks);
    }
}

fn packed_row_gives_each_sample_its_own_logits(config: &ModelConfig, attention: AttentionKind) {
    let config = config.clone();
    let model = |attention| Decoder {
        config: &config,
        lora: None,
        batch_axes: vec![],
        scan_layers: false,
        remat_layers: false,
        remat_mlp: false,
        attention,
        moe: hlo_models::decoder::MoeKind::default(),
        router: Default::default(),
    };
    // The packed row in `attention`, each sample alone (short) naive.
    let (packed_model, alone_model) = (model(attention), model(AttentionKind::Naive));
    let params = base_parameter_types(&config, DType::F32);
    let build = |seq: i64, packed: bool| {
        let mut inputs = params.clone();
        inputs.push(("input_ids".into(), TensorType::new(DType::I32, [1, seq])));
        if packed {
            inputs.push(("positions".into(), TensorType::new(DType::I32, [1, seq])));
            inputs.push(("segment_ids".into(), TensorType::new(DType::I32, [1, seq])));
        }
        let f = trace("f", &inputs, |i| {
            let logits = if packed {
                packed_model.forward_packed(
                    &Params(i),
                    i["input_ids"],
                    i["positions"],
                    i["segment_ids"],
                    DType::F32,
                )
            } else {
                alone_model.forward(&Params(i), i["input_ids"], DType::F32)
            };
            Outputs::new().add("logits", logits)
        })
        .unwrap();
        CompiledFunction::new(client(), &f).unwrap()
    };
    let mut rng = Rng::from_state(5);
    let weights: Vec<HostArray> = params
        .iter()
        .map(|(n, t)| {
            if n.ends_with("norm.weight") {
                HostArray::from(hlo_ir::Literal::splat(t.clone(), 1.0))
            } else {
                HostArray::from(rng.literal(t.clone(), -0.2, 0.2))
            }
        })
        .collect();
    // Longer than every window (4 or 5), in the vocabulary.
    let v = config.vocab_size as usize;
    let samples: Vec<Vec<i32>> = [
        vec![3, 17, 99, 4, 250],
        vec![1, 2, 3, 4, 5, 6, 7],
        vec![200, 13, 13],
    ]
    .into_iter()
    .map(|s| s.into_iter().map(|t| t % v as i32).collect())
    .collect();
    let seq = 16usize;
    // The packed row: samples back to back, then padding (segment 0).
    let (mut ids, mut pos, mut seg) = (vec![0i32; seq], vec![0i32; seq], vec![0i32; seq]);
    let mut at = 0;
    let mut offsets = Vec::new();
    for (k, s) in samples.iter().enumerate() {
        offsets.push(at);
        for (t, &tok) in s.iter().enumerate() {
            ids[at + t] = tok;
            pos[at + t] = t as i32;
            seg[at + t] = k as i32 + 1;
        }
        at += s.len();
    }
    let mut args = weights.clone();
    for x in [&ids, &pos, &seg] {
        args.push(HostArray::new(&[1, seq as i64], x).unwrap());
    }
    let packed = build(seq as i64, true).run(&args).unwrap()[0].to_f64_vec();
    for (s, &off) in samples.iter().zip(&offsets) {
        let mut args = weights.clone();
        args.push(HostArray::new(&[1, s.len() as i64], s).unwrap());
        let alone = build(s.len() as i64, false).run(&args).unwrap()[0].to_f64_vec();
        let got = &packed[off * v..(off + s.len()) * v];
        let d = got
            .iter()
            .zip(&alone)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            d < 1e-5,
            "{:?}: sample at {off}: logits differ by {d}",
            config.family
        );
        // The per-sample loss (mean next-token cross-entropy, in f64 on the
        // host) is the same packed and alone.
        let (lp, la) = (sample_loss(got, s, v), sample_loss(&alone, s, v));
        assert!((lp - la).abs() < 1e-5, "sample at {off}: loss {lp} vs {la}");
    }
    // Without segments (plain causal attention over the whole row) the
    // later samples would see the earlier ones: the test can tell.
    let mut args = weights.clone();
    args.push(HostArray::new(&[1, seq as i64], &ids).unwrap());
    let plain = build(seq as i64, false).run(&args).unwrap()[0].to_f64_vec();
    let off = offsets[1];
    let d = plain[off * v..(off + 1) * v]
        .iter()
        .zip(&packed[off * v..(off + 1) * v])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(d > 1e-3, "{d}");
}

/// Mean cross-entropy of predicting `s[t + 1]` from row `t` of `logits`.
fn sample_loss(logits: &[f64], s: &[i32], v: usize) -> f64 {
    let n = s.len() - 1;
    let total: f64 = (0..n)
        .map(|t| {
            let row = &logits[t * v..(t + 1) * v];
            let m = row.iter().copied().fold(f64::MIN, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            lse - row[s[t + 1] as usize]
        })
        .sum();
    total / n as f64
}
