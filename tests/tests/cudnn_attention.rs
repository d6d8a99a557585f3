//! cuDNN's fused attention as emitted: whole-program snapshots of a small
//! causal grouped-query attention's forward and backward (one device, and
//! in its manual-sharding region on two), the backend config of the
//! reference shapes field by field against what JAX 0.11.2 emits for them
//! on an H200, and the CPU plugin's verdict on the text (it parses and
//! partitions it, then refuses the cuDNN targets, which exist only on
//! CUDA).

use hlo_ir::ops::{cudnn_attention, CudnnFmha, BACKWARD_TARGET, FORWARD_TARGET};
use hlo_ir::{trace, value_and_grad, DType, Function, TensorType};
use hlo_partitioner::{FunctionShardings, Mesh, PartitionSpec};
use serde_json::{json, Value};

fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path("../../snapshots");
    s.set_prepend_module_to_snapshot(false);
    s
}

/// `mean(o²)` of causal attention `o = attention(q, k, v)` (all `[B, T,
/// N, H]`) by cuDNN, and its gradients in q, k, v: the program of the
/// reference, simplified as it is compiled.
fn loss_and_grads(q: &[i64], kv: &[i64], axes: (&[&str], &[&str])) -> Function {
    let bf16 = |d: &[i64]| TensorType::new(DType::BF16, d.to_vec());
    let owned = |a: &[&str]| a.iter().map(|s| s.to_string()).collect();
    let config = CudnnFmha {
        // As JAX computes it: `1 / sqrt(h)`.
        scale: 1.0 / (q[3] as f64).sqrt(),
        window: None,
        batch_axes: owned(axes.0),
        head_axes: owned(axes.1),
    };
    let f = trace(
        "loss",
        &[("q", bf16(q)), ("k", bf16(kv)), ("v", bf16(kv))],
        |i| {
            let (o, _) = cudnn_attention(i["q"], i["k"], i["v"], config);
            let o = o.transpose(&[0, 2, 1, 3]).cast(DType::F32);
            vec![("loss", (o * o).mean(&[0, 1, 2, 3]))]
        },
    )
    .unwrap();
    hlo_ir::simplify(&value_and_grad(&f, "loss", &["q", "k", "v"]).unwrap())
}

/// The small case: Q `[1, 128, 4, 64]`, K/V `[1, 128, 2, 64]`.
fn small(axes: (&[&str], &[&str])) -> Function {
    loss_and_grads(&[1, 128, 4, 64], &[1, 128, 2, 64], axes)
}

/// Two devices splitting the heads (`mp`); the batch of one stays whole.
fn two_devices(f: &Function) -> FunctionShardings {
    let mesh: Mesh = "dp=1,fsdp=1,mp=2".parse().unwrap();
    let heads = PartitionSpec::new(&[&[], &[], &["mp"], &[]]);
    FunctionShardings {
        mesh,
        inputs: vec![heads.clone(); 3],
        outputs: f
            .outputs
            .iter()
            .map(|b| match b.name.as_str() {
                "loss" => PartitionSpec::replicated(),
                _ => heads.clone(),
            })
            .collect(),
    }
}

const AXES: (&[&str], &[&str]) = (&["dp", "fsdp"], &["mp"]);

#[test]
fn cudnn_attention_stablehlo_one_device() {
    let text = hlo_lowering::to_stablehlo(&small(AXES));
    assert!(!text.contains("sdy."), "one device has no region:\n{text}");
    settings().bind(|| insta::assert_snapshot!("cudnn_attention.stablehlo", text));
}

#[test]
fn cudnn_attention_stablehlo_in_a_manual_region_on_two_devices() {
    let f = small(AXES);
    let text = hlo_lowering::to_stablehlo_sharded(&f, &two_devices(&f));
    // Each call sees its device's heads: 2 of 4 query heads, 1 of 2
    // key/value heads; the config is written for those.
    assert_eq!(text.matches("\"sdy.manual_computation\"").count(), 2);
    assert!(text.contains("manual_axes = #sdy<manual_axes{\"dp\", \"fsdp\", \"mp\"}>"));
    assert!(text.contains("-> (tensor<1x2x128x64xbf16>, tensor<1x2x128xf32>, tensor<0xui8>)"));
    assert!(text.contains("\\22dimensions\\22: [\\221\\22, \\222\\22, \\22128\\22, \\22128\\22]"));
    settings().bind(|| insta::assert_snapshot!("cudnn_attention.stablehlo.mp2", text));
}

#[test]
fn hlo_text_fixes_the_layouts_and_marks_the_region() {
    let f = small(AXES);
    let one = hlo_lowering::to_hlo_text(&f);
    assert!(one.contains(
        "(bf16[1,4,128,64]{3,1,2,0}, f32[1,4,128]{2,1,0}, u8[0]{0}) custom-call(\
         bf16[1,128,4,64]{3,2,1,0} %Arg_0.1, bf16[1,128,2,64]{3,2,1,0} %Arg_1.2, \
         bf16[1,128,2,64]{3,2,1,0} %Arg_2.3), custom_call_target=\"__cudnn$fmhaSoftmax\", \
         operand_layout_constraints={bf16[1,128,4,64]{3,2,1,0}, bf16[1,128,2,64]{3,2,1,0}, \
         bf16[1,128,2,64]{3,2,1,0}}, api_version=API_VERSION_STATUS_RETURNING, \
         backend_config=\"{\\\"operation_queue_id\\\""
    ));
    let two = hlo_lowering::to_hlo_text_sharded(&f, &two_devices(&f));
    assert_eq!(
        two.matches("custom_call_target=\"SPMDFullToShardShape\"")
            .count(),
        9
    );
    assert_eq!(
        two.matches("custom_call_target=\"SPMDShardToFullShape\"")
            .count(),
        7
    );
    assert!(two.contains("sharding={{manual}, {manual}, {manual}}"));
}

/// The `backend_config` strings of the program's custom calls, in order,
/// parsed.
fn backend_configs(text: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| l.contains("stablehlo.custom_call")) {
        let field = |name: &str| {
            let start = line.find(&format!("{name} = \"")).unwrap() + name.len() + 4;
            let end = start + line[start..].find('"').unwrap();
            line[start..end].replace("\\22", "\"").replace("\\5C", "\\")
        };
        let config = serde_json::from_str(&field("backend_config")).unwrap();
        out.push((field("call_target_name"), config));
    }
    out
}

/// XLA's dot dimension numbers as JAX writes them (int64s as strings).
fn dims(lc: &str, rc: &str, lb: [&str; 2], rb: [&str; 2]) -> Value {
    json!({
        "lhs_contracting_dimensions": [lc],
        "rhs_contracting_dimensions": [rc],
        "lhs_batch_dimensions": lb,
        "rhs_batch_dimensions": rb,
    })
}

/// What the reference program (JAX 0.11.2, an H200, Q [1,4096,32,128],
/// K/V [1,4096,8,128] bf16, causal) holds in both calls' configs.
fn check_shared_fields(c: &Value) {
    assert_eq!(c["operation_queue_id"], json!("0"));
    let f = &c["cudnn_fmha_backend_config"];
    assert_eq!(
        f["algorithm"],
        json!({"algo_id": "0", "math_type": "TENSOR_OP_MATH",
               "tuning_knobs": {"17": "1", "24": "0"},
               "is_cudnn_frontend": true, "workspace_size": "0"})
    );
    assert_eq!(f["fmha_scale"].as_f64(), Some(0.08838834764831843));
    let shape = &f["intermediate_tensor_shape"];
    assert_eq!(shape["element_type"], json!("BF16"));
    assert_eq!(shape["dimensions"], json!(["1", "32", "4096", "4096"]));
    assert_eq!(
        shape["layout"]["minor_to_major"],
        json!(["3", "2", "1", "0"])
    );
    assert_eq!(
        shape["is_dynamic_dimension"],
        json!([false, false, false, false])
    );
    assert_eq!(f["is_flash_attention"], json!(true));
    assert_eq!(f["mask_type"], json!("CAUSAL"));
    assert_eq!(f["dropout_rate"].as_f64(), Some(0.0));
    assert_eq!(f["seed"], json!(42));
    assert_eq!(f["sliding_window_length"], json!(0));
    assert_eq!(f["max_seg_per_batch"], json!(1));
    assert_eq!(f["is_paged_attention"], json!(false));
}

#[test]
fn backend_configs_match_the_reference_field_by_field() {
    let f = loss_and_grads(&[1, 4096, 32, 128], &[1, 4096, 8, 128], (&[], &[]));
    let text = hlo_lowering::to_stablehlo(&f);
    let configs = backend_configs(&text);
    assert_eq!(configs.len(), 2);
    let (fwd_target, fwd) = &configs[0];
    let (bwd_target, bwd) = &configs[1];
    assert_eq!(
        (fwd_target.as_str(), bwd_target.as_str()),
        (FORWARD_TARGET, BACKWARD_TARGET)
    );
    check_shared_fields(fwd);
    check_shared_fields(bwd);
    let (f, b) = (
        &fwd["cudnn_fmha_backend_config"],
        &bwd["cudnn_fmha_backend_config"],
    );
    assert_eq!(
        f["bmm1_dot_dimension_numbers"],
        dims("3", "3", ["0", "2"], ["0", "2"])
    );
    assert_eq!(
        f["bmm2_dot_dimension_numbers"],
        dims("3", "1", ["0", "1"], ["0", "2"])
    );
    let grads = [
        ("bmm1_grad_gemm1", dims("2", "1", ["0", "1"], ["0", "2"])),
        ("bmm1_grad_gemm2", dims("3", "1", ["0", "1"], ["0", "2"])),
        ("bmm2_grad_gemm1", dims("2", "1", ["0", "1"], ["0", "2"])),
        ("bmm2_grad_gemm2", dims("3", "3", ["0", "2"], ["0", "2"])),
    ];
    for (name, want) in grads {
        assert_eq!(b[format!("{name}_dot_dimension_numbers")], want, "{name}");
        assert!(f.get(format!("{name}_dot_dimension_numbers")).is_none());
    }
    assert!(b.get("bmm1_dot_dimension_numbers").is_none());
    // The calls' signatures and layouts, as in the reference.
    for want in [
        "operand_layouts = [dense<[3, 2, 1, 0]> : tensor<4xindex>, dense<[3, 2, 1, 0]> : \
         tensor<4xindex>, dense<[3, 2, 1, 0]> : tensor<4xindex>], result_layouts = \
         [dense<[3, 1, 2, 0]> : tensor<4xindex>, dense<[2, 1, 0]> : tensor<3xindex>, \
         dense<0> : tensor<1xindex>]} : (tensor<1x4096x32x128xbf16>, tensor<1x4096x8x128xbf16>, \
         tensor<1x4096x8x128xbf16>) -> (tensor<1x32x4096x128xbf16>, tensor<1x32x4096xf32>, \
         tensor<0xui8>)",
        "result_layouts = [dense<[3, 1, 2, 0]> : tensor<4xindex>, dense<[3, 1, 2, 0]> : \
         tensor<4xindex>, dense<[3, 1, 2, 0]> : tensor<4xindex>, dense<0> : tensor<1xindex>]} : \
         (tensor<1x4096x32x128xbf16>, tensor<1x4096x8x128xbf16>, tensor<1x4096x8x128xbf16>, \
         tensor<1x32x4096xf32>, tensor<1x4096x32x128xbf16>, tensor<1x4096x32x128xbf16>) -> \
         (tensor<1x32x4096x128xbf16>, tensor<1x8x4096x128xbf16>, tensor<1x8x4096x128xbf16>, \
         tensor<0xui8>)",
    ] {
        assert!(text.contains(want), "missing {want}\n{text}");
    }
    assert!(text.contains("api_version = 2 : i32"));
}

#[test]
fn a_sliding_window_is_written_as_cudnn_takes_it() {
    let bf16 = |d: &[i64]| TensorType::new(DType::BF16, d.to_vec());
    let f = trace(
        "attn",
        &[("q", bf16(&[1, 16, 2, 64])), ("kv", bf16(&[1, 16, 1, 64]))],
        |i| {
            let config = CudnnFmha {
                scale: 0.125,
                window: Some(4),
                batch_axes: vec![],
                head_axes: vec![],
            };
            cudnn_attention(i["q"], i["kv"], i["kv"], config).0
        },
    )
    .unwrap();
    let (_, c) = &backend_configs(&hlo_lowering::to_stablehlo(&f))[0];
    let c = &c["cudnn_fmha_backend_config"];
    assert_eq!(c["sliding_window_length"], json!(4));
    assert_eq!(c["mask_type"], json!("CAUSAL"));
    assert_eq!(c["fmha_scale"].as_f64(), Some(0.125));
}

/// Compiling on the CPU gets past parsing (and, on a mesh, Shardy's
/// partitioning of the region) and fails on the cuDNN target only.
fn refused_for_the_target(text: &str, options: &hlo_runtime::CompileOptions) {
    let err = match hlo_e2e::client().compile(text, options) {
        Ok(_) => panic!("the CPU plugin compiled a cuDNN call"),
        Err(e) => e.to_string(),
    };
    // XLA's words when a custom call has no host implementation: the
    // lookup comes after parsing and partitioning.
    let refused =
        format!("No registered implementation for untyped custom call to {FORWARD_TARGET}");
    assert!(err.contains(&refused), "{err}");
}

#[test]
fn the_cpu_plugin_parses_the_program_and_refuses_only_the_cudnn_target() {
    let f = small(AXES);
    refused_for_the_target(
        &hlo_lowering::to_stablehlo(&f),
        &hlo_runtime::CompileOptions::default(),
    );
    refused_for_the_target(
        &hlo_lowering::to_stablehlo_sharded(&f, &two_devices(&f)),
        &hlo_runtime::CompileOptions::spmd(2),
    );
}

#[test]
fn a_tiny_llama_train_step_on_cudnn_partitions_on_four_devices() {
    use hlo_models::attention::AttentionKind;
    use hlo_models::decoder::{partition_rules, ModelConfig};
    use hlo_models::train::{train_step, TrainConfig};
    let config = ModelConfig::preset("tiny").unwrap();
    let mesh: Mesh = "dp=1,fsdp=2,mp=2".parse().unwrap();
    for scan_layers in [false, true] {
        let mut tc = TrainConfig::new(DType::BF16, 2, 32);
        tc.attention = AttentionKind::Cudnn;
        tc.batch_axes = vec!["dp".into(), "fsdp".into()];
        tc.scan_layers = scan_layers;
        let step = train_step(&config, &tc).unwrap();
        let f = hlo_ir::simplify(&step.function);
        let s = FunctionShardings::from_rules_stacked(
            &f,
            &mesh,
            &partition_rules(&config),
            &hlo_models::decoder::is_stacked,
        )
        .unwrap();
        let text = hlo_lowering::to_stablehlo_with(&f, Some(&s), &step.donated);
        // Each device: one row, 2 of 4 query heads, 1 of 2 key/value heads.
        assert!(
            text.contains("-> (tensor<1x2x32x16xbf16>, tensor<1x2x32xf32>, tensor<0xui8>)"),
            "{text}"
        );
        refused_for_the_target(&text, &hlo_runtime::CompileOptions::spmd(4));
    }
}
