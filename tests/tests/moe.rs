//! Qwen3-MoE, Mixtral, gpt-oss and Qwen2-MoE against HF transformers 5: f32 logits
//! of the fixture models (made by `scripts/make_moe_fixtures.py`: top-k
//! routing with and without renormalisation, a dense layer among sparse
//! ones, experts stored per expert as transformers writes them and fused
//! as it holds them; gpt-oss's biased router, transposed interleaved
//! experts with biases and clamped SwiGLU, attention sinks, alternating
//! sliding layers and yarn rotary; Qwen2-MoE's gated shared expert and
//! q/k/v biases) with and without a PEFT adapter; both
//! formulations of the experts (sorted blocks, dense) give HF's logits.

use std::path::PathBuf;

use hlo_e2e::{
    assert_f32_logits, expected_in, expected_tensor, fixture_dir, fixture_logits_of, max_abs_diff,
    sparse_layer,
};
use hlo_ir::{DType, Literal, Op};
use hlo_models::checkpoint::Checkpoint;
use hlo_models::decoder::{
    block_count, block_size, Family, LayerType, ModelConfig, MoeKind, RopeScaling, Routing,
    SharedExpert,
};

const MODELS: [&str; 6] = [
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "qwen2_moe",
    "glm4_moe",
    "deepseek_v3",
];

fn fixture(name: &str) -> PathBuf {
    fixture_dir(&format!("families/{name}"))
}

#[test]
fn the_fixtures_exercise_each_familys_routing() {
    let c = |name: &str| ModelConfig::from_file(&fixture(name).join("config.json")).unwrap();
    let (qwen, mixtral, gpt_oss) = (c("qwen3_moe"), c("mixtral"), c("gpt_oss"));
    assert_eq!(qwen.family, Family::Qwen3Moe);
    let m = qwen.moe.as_ref().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.moe_intermediate_size),
        (8, 3, 20)
    );
    assert!(m.norm_topk_prob && m.output_router_logits);
    assert_eq!(m.sparse_layers, [true, false, true]);
    assert!(qwen.qk_norm);
    assert_eq!(mixtral.family, Family::Mixtral);
    let m = mixtral.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.top_k), (4, 2));
    assert!(m.f32_routing_weights);
    assert_eq!(gpt_oss.family, Family::GptOss);
    let m = gpt_oss.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.top_k), (4, 2));
    assert!(m.transposed() && gpt_oss.attention_sinks && gpt_oss.o_bias);
    assert_eq!(
        gpt_oss.layer_types,
        [LayerType::Sliding, LayerType::Full],
        "the window of 4 is shorter than the fixture's 11 tokens"
    );
    assert_eq!(gpt_oss.sliding_window, Some(4));
    let qwen2 = c("qwen2_moe");
    assert_eq!(qwen2.family, Family::Qwen2Moe);
    let m = qwen2.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.top_k), (6, 2));
    assert!(!m.norm_topk_prob && qwen2.qkv_bias && !qwen2.qk_norm);
    assert_eq!(m.sparse_layers, [true, false, true]);
    assert_eq!(
        m.shared_expert,
        Some(SharedExpert {
            intermediate_size: 24,
            gated: true
        })
    );
    assert_eq!(
        qwen2.layer_types,
        [LayerType::Sliding, LayerType::Full, LayerType::Full],
        "Qwen2MoeConfig: the even layers below max_window_layers (2) slide"
    );
    let glm = c("glm4_moe");
    assert_eq!(glm.family, Family::Glm4Moe);
    let m = glm.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.top_k), (8, 3));
    assert_eq!(
        m.sparse_layers,
        [false, true, true],
        "first_k_dense_replace 1"
    );
    assert_eq!(
        m.shared_expert.unwrap().intermediate_size,
        32,
        "2 shared experts of 16"
    );
    assert!(
        !m.output_router_logits,
        "HF's Glm4MoeForCausalLM adds no aux loss"
    );
    assert_eq!(
        m.routing,
        Routing::Sigmoid {
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5
        }
    );
    assert!(glm.qk_norm && glm.qkv_bias && !glm.o_bias);
    assert_eq!(
        (glm.head_dim, glm.rotary_dim()),
        (16, 8),
        "partial rotary 0.5"
    );
    let ds = c("deepseek_v3");
    assert_eq!(ds.family, Family::DeepseekV3);
    let mla = ds.mla.unwrap();
    assert_eq!(
        (mla.q_lora_rank, mla.kv_lora_rank, mla.v_head_dim),
        (Some(24), 16, 6)
    );
    assert_eq!(
        (ds.head_dim, ds.rotary_dim()),
        (12, 4),
        "8 unrotated + 4 rotary"
    );
    assert!(mla.rope_interleave);
    let Some(RopeScaling::Yarn(y)) = &ds.rope.scaling else {
        panic!("yarn")
    };
    // transformers: attention_factor = mscale(4, 1) / mscale(4, 0.707);
    // the scores' extra factor mscale(4, 0.707)².
    let ms = |m: f64| 0.1 * m * 4f64.ln() + 1.0;
    assert!((y.attention_factor - ms(1.0) / ms(0.707)).abs() < 1e-12);
    assert_eq!(y.mscale_all_dim, 0.707);
    // Round trips through config.json as transformers reads it.
    for config in [&qwen2, &glm, &ds] {
        assert_eq!(&ModelConfig::from_json(&config.to_json()).unwrap(), config);
    }
}

#[test]
fn gpt_oss_yarn_frequencies_equal_hf() {
    // transformers' `_compute_yarn_parameters` for the fixture (MOE.md).
    let c = ModelConfig::from_file(&fixture("gpt_oss").join("config.json")).unwrap();
    let want = [
        1.0,
        0.137188628,
        0.0137774786,
        0.000456483918,
        1.10693582e-05,
        1.51859081e-06,
    ];
    let got = c.inv_freq(LayerType::Full);
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-6 * w, "{got:?}");
    }
    let scaling = c.rope_attention_scaling(LayerType::Full);
    assert!((scaling - 1.34657359).abs() < 1e-8, "{scaling}");
}

#[test]
fn f32_logits_equal_hf() {
    for name in MODELS {
        // gpt-oss is saved fused: it has no second layout.
        let fused = Some(fixture(name).join("fused")).filter(|d| d.is_dir());
        for dir in std::iter::once(fixture(name)).chain(fused) {
            let got = fixture_logits_of(&dir, &fixture(name), DType::F32, None, false);
            let want = expected_tensor(&fixture(name), "logits").to_f64s();
            assert_f32_logits(&dir.display().to_string(), &fixture(name), &got, &want);
        }
    }
}

#[test]
fn f32_logits_with_a_peft_attention_adapter_equal_hf() {
    for name in MODELS {
        let dir = fixture(name);
        let got = fixture_logits_of(&dir, &dir, DType::F32, Some(&dir.join("adapter")), false);
        let want = expected_tensor(&fixture(name), "logits_adapter").to_f64s();
        assert_f32_logits(&format!("{name} + adapter"), &dir, &got, &want);
        let base = expected_tensor(&fixture(name), "logits").to_f64s();
        assert!(
            max_abs_diff(&base, &want) > 1e-2,
            "{name}: the adapter matters"
        );
    }
}

/// 2·m·n·k of every matmul in `f`.
fn matmul_flops(f: &hlo_ir::Function) -> f64 {
    f.nodes
        .iter()
        .filter_map(|node| match &node.op {
            Op::DotGeneral(d) => {
                let lhs = f.ty(node.operands[0]);
                let out = f.ty(node.results[0]);
                let k: i64 = d
                    .lhs_contracting
                    .iter()
                    .map(|&c| lhs.dims[c as usize])
                    .product();
                Some(2.0 * (out.element_count() as f64) * k as f64)
            }
            _ => None,
        })
        .sum()
}

#[test]
fn the_sorted_blocks_compute_only_the_routed_experts() {
    // Qwen3-30B-A3B's routing (128 experts, 8 a token) on small matrices:
    // 256 tokens make 2048 assignments, blocks of 16 rows.
    let mut config = ModelConfig::from_file(&fixture("qwen3_moe").join("config.json")).unwrap();
    let m = config.moe.as_mut().unwrap();
    (m.num_experts, m.top_k) = (128, 8);
    let (rows, h, i) = (256, config.hidden_size, m.moe_intermediate_size);
    let flops = |kind| matmul_flops(&sparse_layer(&config, kind, rows, false));
    let expert_flops = |tokens: i64| 2.0 * tokens as f64 * 3.0 * (h * i) as f64;
    let router = 2.0 * (rows * h * 128) as f64;
    let dense = flops(MoeKind::Dense) - router;
    let blocks = flops(MoeKind::default()) - router;
    let block = block_size(rows * 8, 128);
    let padded_rows = block_count(rows * 8, 128, block) * block;
    println!(
        "dense {dense:e} (every expert on every token: {:e}), blocks {blocks:e} ({padded_rows} rows of {} assignments, blocks of {block}); the routed experts alone {:e}",
        expert_flops(rows * 128),
        rows * 8,
        expert_flops(rows * 8)
    );
    assert!(dense >= expert_flops(rows * 128));
    assert_eq!(blocks, expert_flops(padded_rows));
    // At most the routed experts' work plus one block of padding per expert.
    assert!(padded_rows <= rows * 8 + 128 * (block - 1));
    assert!(blocks < dense / 7.0, "blocks {blocks:e}, dense {dense:e}");
}

#[test]
fn the_dense_and_the_sorted_block_experts_agree() {
    // Blocks of 3 rows: groups of several blocks and padded ones, on the
    // reference interpreter.
    for name in MODELS {
        let dir = fixture(name);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let c = &ckpt.config;
        let f = sparse_layer(c, MoeKind::Dense, 11, false);
        let g = sparse_layer(c, MoeKind::Blocks { block: Some(3) }, 11, false);
        let mut rng = hlo_ir::rng::Rng::new(7);
        let inputs: Vec<Literal> = f
            .inputs
            .iter()
            .map(|b| match b.name.as_str() {
                "x" => {
                    let ty = f.ty(b.value).clone();
                    let v: Vec<f64> = (0..ty.element_count()).map(|_| rng.normal()).collect();
                    Literal::from_f64s(ty, &v)
                }
                n => ckpt.read(n, DType::F32).unwrap(),
            })
            .collect();
        let run = |f: &hlo_ir::Function| hlo_ir::interpret(f, &inputs).unwrap()[0].to_f64s();
        let d = max_abs_diff(&run(&f), &run(&g));
        println!("{name}: dense vs blocks of 3: {d:e}");
        assert!(d < 1e-5, "{name}: {d:e}");
    }
}

#[test]
fn f32_logits_with_peft_lora_on_the_experts_equal_hf() {
    // PEFT's `target_parameters` on both fused expert tensors, with the
    // attention projections.
    for name in MODELS {
        let dir = fixture(name);
        let adapter = dir.join("adapter_experts");
        let got = fixture_logits_of(&dir, &dir, DType::F32, Some(&adapter), false);
        let want = expected_in(
            &dir,
            "expected_experts.safetensors",
            "logits_adapter_experts",
        )
        .to_f64s();
        assert_f32_logits(&format!("{name} + expert adapter"), &dir, &got, &want);
        let attention_only = expected_tensor(&dir, "logits_adapter").to_f64s();
        assert!(
            max_abs_diff(&attention_only, &want) > 1e-2,
            "{name}: the experts' LoRA matters"
        );
    }
}

#[test]
fn f32_logits_with_the_router_saved_whole_equal_hf() {
    // PEFT's `modules_to_save` of the router (`gate`, gpt-oss's `router`).
    for name in ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe"] {
        let dir = fixture(name);
        let adapter = dir.join("adapter_router");
        let lora = hlo_models::adapter::Adapter::load(
            &adapter,
            &ModelConfig::from_file(&dir.join("config.json")).unwrap(),
        )
        .unwrap();
        let router = if name == "gpt_oss" { "router" } else { "gate" };
        assert_eq!(lora.lora.modules_to_save, [router]);
        let got = fixture_logits_of(&dir, &dir, DType::F32, Some(&adapter), false);
        let want =
            expected_in(&dir, "expected_router.safetensors", "logits_adapter_router").to_f64s();
        assert_f32_logits(&format!("{name} + router saved whole"), &dir, &got, &want);
    }
}

#[test]
fn expert_adapters_round_trip_through_peft_layout() {
    let dir = fixture("qwen3_moe");
    let c = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let adapter = hlo_models::adapter::Adapter::load(&dir.join("adapter_experts"), &c).unwrap();
    assert_eq!(
        adapter.lora.target_parameters,
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    );
    let tmp = std::env::temp_dir().join(format!("hlo-moe-adapter-{}", std::process::id()));
    adapter.save(&tmp, None).unwrap();
    // PEFT's tensors, byte for byte in value.
    let theirs =
        hlo_models::io::read_safetensors(&dir.join("adapter_experts/adapter_model.safetensors"))
            .unwrap();
    let ours = hlo_models::io::read_safetensors(&tmp.join("adapter_model.safetensors")).unwrap();
    assert_eq!(ours.len(), theirs.len());
    for (key, t) in theirs {
        let o = &ours
            .iter()
            .find(|(k, _)| *k == key)
            .unwrap_or_else(|| panic!("{key}"))
            .1;
        assert_eq!(o.ty.dims, t.ty.dims, "{key}");
        assert_eq!(o.to_f64s(), t.to_f64s(), "{key}");
    }
    let again = hlo_models::adapter::Adapter::load(&tmp, &c).unwrap();
    assert_eq!(again, adapter);
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn preset_parameter_counts_equal_hf() {
    // transformers' own count of the Hub configs (meta device).
    let text = std::fs::read_to_string(fixture_dir("families/moe_param_counts.json")).unwrap();
    let counts: serde_json::Value = serde_json::from_str(&text).unwrap();
    for name in [
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
        "mixtral-8x7b",
        "gpt-oss-20b",
        "gpt-oss-120b",
        "qwen1.5-moe-a2.7b",
        "glm-4.5",
        "deepseek-v3",
        "kimi-k2",
    ] {
        let c = ModelConfig::preset(name).unwrap();
        assert_eq!(
            c.parameter_count(),
            counts[name].as_i64().unwrap(),
            "{name}"
        );
        assert_eq!(
            c.active_parameter_count(),
            counts["active"][name].as_i64().unwrap(),
            "{name} active"
        );
        // Round trip through config.json.
        assert_eq!(ModelConfig::from_json(&c.to_json()).unwrap(), c, "{name}");
    }
}

#[test]
fn mixtral_and_gpt_oss_layers_as_one_scan_give_hfs_logits() {
    // Every layer is sparse, so the layers scan (stacked experts);
    // gpt-oss's alternate sliding and full attention.
    for name in ["mixtral", "gpt_oss"] {
        let dir = fixture(name);
        let got = fixture_logits_of(&dir, &dir, DType::F32, Some(&dir.join("adapter")), true);
        let want = expected_tensor(&dir, "logits_adapter").to_f64s();
        assert_f32_logits(&format!("{name} scanned"), &dir, &got, &want);
    }
}

#[test]
fn gpt_oss_mxfp4_experts_are_dequantized_as_transformers_does() {
    // The released gpt-oss checkpoints' expert format (blocks of 32 FP4
    // codes and a power of two each), made by
    // scripts/make_mxfp4_fixture.py: the dequantized experts equal
    // transformers' `convert_moe_packed_tensors` exactly, and the model's
    // logits equal those of HF's model with them.
    let dir = fixture("gpt_oss").join("mxfp4");
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert!(ckpt.config.quantization.is_none());
    for (name, key) in [
        (
            "model.layers.0.mlp.experts.gate_up_proj",
            "layers.0.gate_up_proj",
        ),
        ("model.layers.0.mlp.experts.down_proj", "layers.0.down_proj"),
    ] {
        assert_eq!(ckpt.dtype(name), Some(DType::BF16), "{name}");
        let want = expected_tensor(&dir, key);
        let got = ckpt.read(name, DType::F32).unwrap();
        assert_eq!(got.ty.dims, want.ty.dims, "{name}");
        assert_eq!(got.to_f64s(), want.to_f64s(), "{name}");
    }
    let got = fixture_logits_of(&dir, &dir, DType::F32, None, false);
    let want = expected_tensor(&dir, "logits").to_f64s();
    assert_f32_logits("gpt-oss from MXFP4", &dir, &got, &want);
}

#[test]
fn a_non_finite_token_changes_no_other_tokens_experts() {
    // One token's hidden state made NaN, inf or huge (what an adapter
    // whose products overflow gives its own rows): every other token's
    // output of the sparse layer is what it is without it, bit for bit,
    // both formulations, compiled by XLA (whose gathers clamp an index
    // out of range onto another token's row), the odd token in every
    // position in turn.
    use hlo_runtime::{CompiledFunction, HostArray};
    let rows = 11;
    for name in MODELS {
        let dir = fixture(name);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let c = &ckpt.config;
        for kind in [
            MoeKind::default(),
            MoeKind::Blocks { block: Some(3) },
            MoeKind::Dense,
        ] {
            let f = sparse_layer(c, kind, rows, false);
            let program = CompiledFunction::new(hlo_e2e::client(), &f).unwrap();
            let mut rng = hlo_ir::rng::Rng::new(3);
            let x: Vec<f64> = (0..rows * c.hidden_size).map(|_| rng.normal()).collect();
            let run = |x: &[f64]| -> Vec<f64> {
                let inputs: Vec<HostArray> = f
                    .inputs
                    .iter()
                    .map(|b| {
                        HostArray::from(match b.name.as_str() {
                            "x" => Literal::from_f64s(f.ty(b.value).clone(), x),
                            n => ckpt.read(n, DType::F32).unwrap(),
                        })
                    })
                    .collect();
                program.run(&inputs).unwrap()[0].to_f64_vec()
            };
            let clean = run(&x);
            let h = c.hidden_size as usize;
            for odd in 0..rows as usize {
                for value in [f64::NAN, f64::INFINITY, -1e30] {
                    let mut bad = x.clone();
                    bad[odd * h..(odd + 1) * h]
                        .iter_mut()
                        .for_each(|v| *v = value);
                    let got = run(&bad);
                    for t in (0..rows as usize).filter(|&t| t != odd) {
                        let (g, w) = (&got[t * h..(t + 1) * h], &clean[t * h..(t + 1) * h]);
                        assert!(
                            g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{name} {kind:?}: token {odd} at {value} changed token {t}"
                        );
                    }
                }
            }
        }
    }
}

/// Layer `l`'s router of `c` (the checkpoint's) on its recorded input:
/// each token's experts, sorted, with their weights in that order.
fn routed(c: &ModelConfig, ckpt: &Checkpoint, l: i64, hidden: &Literal) -> Vec<Vec<(i64, f64)>> {
    use hlo_models::decoder::{base_parameter_types, Params};
    let prefix = format!("model.layers.{l}.mlp");
    let mut inputs: Vec<(String, hlo_ir::TensorType)> = base_parameter_types(c, DType::F32)
        .into_iter()
        .filter(|(n, _)| n.starts_with(&format!("{prefix}.gate.")))
        .collect();
    inputs.push(("x".into(), hidden.ty.clone()));
    let model = hlo_e2e::plain_decoder(c, MoeKind::default());
    let f = hlo_ir::trace("router", &inputs, |i| {
        let (w, e, _) = model.route(&Params(i), &prefix, i["x"]);
        hlo_ir::Outputs::new().add("w", w).add("e", e)
    })
    .unwrap();
    let args: Vec<Literal> = f
        .inputs
        .iter()
        .map(|b| match b.name.as_str() {
            "x" => hidden.clone(),
            n => ckpt.read(n, DType::F32).unwrap(),
        })
        .collect();
    let out = hlo_ir::interpret(&f, &args).unwrap();
    let (w, e) = (out[0].to_f64s(), out[1].to_i128s());
    let k = out[1].ty.dims[1] as usize;
    (0..w.len() / k)
        .map(|t| {
            let mut pairs: Vec<(i64, f64)> = (0..k)
                .map(|j| (e[t * k + j] as i64, w[t * k + j]))
                .collect();
            pairs.sort_by_key(|p| p.0);
            pairs
        })
        .collect()
}

#[test]
fn sigmoid_routers_choose_and_weigh_as_hf() {
    // DeepSeek-V3's and GLM-4.5's router on each sparse layer's recorded
    // input (scripts/make_moe_fixtures.py): the same experts as HF and
    // their weights to 1e-6; the groups and the selection bias change the
    // choice of some of these tokens (computed here without each).
    use hlo_models::decoder::Routing;
    for name in ["glm4_moe", "deepseek_v3"] {
        let dir = fixture(name);
        let ckpt = Checkpoint::open(&dir).unwrap();
        let c = ckpt.config.clone();
        let m = c.moe.clone().unwrap();
        let Routing::Sigmoid { n_group, .. } = m.routing else {
            panic!("{name}: a sigmoid router")
        };
        let mut ungrouped = c.clone();
        if let Some(Routing::Sigmoid { topk_group, .. }) =
            ungrouped.moe.as_mut().map(|m| &mut m.routing)
        {
            *topk_group = n_group;
        }
        let (mut by_groups, mut tokens) = (0, 0);
        for l in (0..c.num_hidden_layers).filter(|l| m.sparse_layers[*l as usize]) {
            let hidden = expected_in(&dir, "router.safetensors", &format!("layers.{l}.hidden"));
            let want_e =
                expected_in(&dir, "router.safetensors", &format!("layers.{l}.indices")).to_i128s();
            let want_w =
                expected_in(&dir, "router.safetensors", &format!("layers.{l}.weights")).to_f64s();
            let got = routed(&c, &ckpt, l, &hidden);
            for (t, pairs) in got.iter().enumerate() {
                let k = pairs.len();
                for (j, (e, w)) in pairs.iter().enumerate() {
                    assert_eq!(*e as i128, want_e[t * k + j], "{name} layer {l} token {t}");
                    assert!(
                        (w - want_w[t * k + j]).abs() < 1e-6,
                        "{name} layer {l} token {t}"
                    );
                }
            }
            let free = routed(&ungrouped, &ckpt, l, &hidden);
            let changed =
                |a: &[(i64, f64)], b: &[(i64, f64)]| a.iter().zip(b).any(|(x, y)| x.0 != y.0);
            by_groups += got.iter().zip(&free).filter(|(a, b)| changed(a, b)).count();
            tokens += got.len();
        }
        println!("{name}: the groups change the choice of {by_groups} of {tokens} tokens");
        assert!(by_groups > 0, "{name}: the fixture exercises the groups");
    }
}
