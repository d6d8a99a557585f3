//! cuDNN attention in the decoder: which cases it refuses (and why), and
//! that a train step dispatches every layer's attention to the calls, with
//! each layer type's window.

use hlo_ir::ops::CudnnAttention;
use hlo_ir::{DType, Function, Op};
use hlo_models::attention::{cudnn_supports, AttentionKind, CudnnCase};
use hlo_models::decoder::{Decoder, LayerType, ModelConfig, MoeKind};
use hlo_models::train::{train_step, TrainConfig};

const LLAMA_8B: CudnnCase = CudnnCase {
    dtype: DType::BF16,
    head_dim: 128,
    heads: 32,
    kv_heads: 8,
    window: None,
    packed: false,
    sinks: false,
};

#[test]
fn cudnn_takes_bf16_and_f16_grouped_heads_with_a_window() {
    for case in [
        LLAMA_8B,
        CudnnCase {
            dtype: DType::F16,
            ..LLAMA_8B
        },
        CudnnCase {
            head_dim: 256,
            window: Some(512),
            ..LLAMA_8B
        },
    ] {
        assert_eq!(cudnn_supports(&case), Ok(()), "{case:?}");
    }
}

#[test]
fn cudnn_refuses_what_its_calls_cannot_compute_with_the_reason() {
    let refused = [
        (
            CudnnCase {
                dtype: DType::F32,
                ..LLAMA_8B
            },
            "bf16 or f16, not f32",
        ),
        (
            CudnnCase {
                head_dim: 100,
                ..LLAMA_8B
            },
            "multiples of 8 up to 256",
        ),
        (
            CudnnCase {
                head_dim: 512,
                ..LLAMA_8B
            },
            "not 512",
        ),
        (
            CudnnCase {
                kv_heads: 5,
                ..LLAMA_8B
            },
            "do not group",
        ),
        (
            CudnnCase {
                packed: true,
                ..LLAMA_8B
            },
            "packed rows",
        ),
        (
            CudnnCase {
                sinks: true,
                ..LLAMA_8B
            },
            "sinks",
        ),
        (
            CudnnCase {
                window: Some(0),
                ..LLAMA_8B
            },
            "window of 0",
        ),
    ];
    for (case, why) in refused {
        let err = cudnn_supports(&case).unwrap_err();
        assert!(err.contains(why), "{case:?}: {err}");
    }
}

fn decoder(config: &ModelConfig, scan_layers: bool) -> Decoder<'_> {
    Decoder {
        config,
        lora: None,
        batch_axes: vec![],
        scan_layers,
        remat_layers: false,
        remat_mlp: false,
        attention: AttentionKind::Cudnn,
        moe: MoeKind::default(),
        router: Default::default(),
    }
}

#[test]
fn a_scan_over_mixed_layer_types_is_refused_unrolled_is_not() {
    let gemma = ModelConfig::preset("gemma3-1b").unwrap();
    let err = decoder(&gemma, true)
        .cudnn_supports(DType::BF16, false)
        .unwrap_err();
    assert!(err.contains("--scan-layers off"), "{err}");
    assert_eq!(
        decoder(&gemma, false).cudnn_supports(DType::BF16, false),
        Ok(())
    );
    let sinks = ModelConfig::preset("gpt-oss-20b").unwrap();
    assert!(decoder(&sinks, false)
        .cudnn_supports(DType::BF16, false)
        .is_err());
}

/// The cuDNN forward calls of `f`, also inside loop and scan bodies: each
/// one's window.
fn cudnn_windows(f: &Function, out: &mut Vec<Option<i64>>) {
    for node in &f.nodes {
        match &node.op {
            Op::CudnnAttention(CudnnAttention(c)) => out.push(c.window),
            Op::Scan(s) => cudnn_windows(&s.body, out),
            Op::While(w) => cudnn_windows(&w.body, out),
            _ => {}
        }
    }
}

/// `tiny` with one sliding layer (window 8) and one full layer.
fn tiny_with_a_window() -> ModelConfig {
    let mut config = ModelConfig::preset("tiny").unwrap();
    config.sliding_window = Some(8);
    config.layer_types = vec![LayerType::Sliding, LayerType::Full];
    config
}

#[test]
fn a_train_step_runs_each_layer_on_cudnn_with_its_window() {
    let config = tiny_with_a_window();
    let mut tc = TrainConfig::new(DType::BF16, 2, 32);
    tc.attention = AttentionKind::Cudnn;
    let step = train_step(&config, &tc).unwrap();
    let mut windows = Vec::new();
    cudnn_windows(&step.function, &mut windows);
    assert_eq!(windows, vec![Some(8), None]);
    let backward = step
        .function
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::CudnnAttentionBackward(_)))
        .count();
    assert_eq!(backward, 2);
    // Scanned (one layer type): the calls sit in the scan bodies (the
    // backward's recomputes the forward).
    let config = ModelConfig::preset("tiny").unwrap();
    tc.scan_layers = true;
    let step = train_step(&config, &tc).unwrap();
    let mut windows = Vec::new();
    cudnn_windows(&step.function, &mut windows);
    assert!(!windows.is_empty() && windows.iter().all(Option::is_none));
    assert!(!step
        .function
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::CudnnAttention(_))));
}

#[test]
fn a_train_step_refuses_what_cudnn_cannot_compute() {
    let config = ModelConfig::preset("tiny").unwrap();
    let mut tc = TrainConfig::new(DType::F32, 2, 32);
    tc.attention = AttentionKind::Cudnn;
    let err = train_step(&config, &tc).err().unwrap().to_string();
    assert!(
        err.contains("cuDNN attention: cuDNN's flash attention takes bf16 or f16"),
        "{err}"
    );
    tc.dtype = DType::BF16;
    tc.packing = true;
    let err = train_step(&config, &tc).err().unwrap().to_string();
    assert!(err.contains("packed rows"), "{err}");
}
