//! Whole-program snapshots of what the lowering emits for a two-layer MLP,
//! kept in the top-level `snapshots/` folder. A change to the printers shows
//! up here as a diff to review like code.

use hlo_e2e::RandomLiteral;
use hlo_ir::DType;
use hlo_models::mlp::{two_layer_mlp, two_layer_mlp_sgd_step};

fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path("../../snapshots");
    s.set_prepend_module_to_snapshot(false);
    s
}

#[test]
fn mlp_stablehlo() {
    let f = two_layer_mlp(8, 16, 32, 4, DType::F32).unwrap();
    settings().bind(|| insta::assert_snapshot!("mlp.stablehlo", hlo_lowering::to_stablehlo(&f)));
}

#[test]
fn mlp_hlo() {
    let f = two_layer_mlp(8, 16, 32, 4, DType::F32).unwrap();
    settings().bind(|| insta::assert_snapshot!("mlp.hlo", hlo_lowering::to_hlo_text(&f)));
}

#[test]
fn printing_is_deterministic() {
    // Two traces of the same program print byte-identical text.
    let a = two_layer_mlp(2, 3, 5, 7, DType::BF16).unwrap();
    let b = two_layer_mlp(2, 3, 5, 7, DType::BF16).unwrap();
    assert_eq!(
        hlo_lowering::to_stablehlo(&a),
        hlo_lowering::to_stablehlo(&b)
    );
    assert_eq!(hlo_lowering::to_hlo_text(&a), hlo_lowering::to_hlo_text(&b));
}

#[test]
fn mlp_runs_and_matches_reference() {
    let f = two_layer_mlp(8, 16, 32, 4, DType::F32).unwrap();
    let mut rng = hlo_e2e::Rng::from_state(21);
    let inputs: Vec<_> = f
        .input_types()
        .into_iter()
        .map(|t| rng.literal(t, -1.0, 1.0))
        .collect();
    hlo_e2e::check_against_reference(&f, &inputs, 2.0);
}

#[test]
fn mlp_train_step_stablehlo() {
    // A small backward graph: gradients of an MSE loss and an SGD update.
    // As compiled: simplified.
    let f = hlo_ir::simplify(&two_layer_mlp_sgd_step(2, 3, 4, 2, DType::F32).unwrap());
    settings()
        .bind(|| insta::assert_snapshot!("mlp_sgd_step.stablehlo", hlo_lowering::to_stablehlo(&f)));
}

#[test]
fn mlp_train_step_runs_and_learns() {
    let f = two_layer_mlp_sgd_step(8, 16, 32, 4, DType::F32).unwrap();
    let mut rng = hlo_e2e::Rng::from_state(8);
    let mut inputs: Vec<hlo_ir::Literal> = f
        .input_types()
        .into_iter()
        .map(|t| rng.literal(t, -0.5, 0.5))
        .collect();
    let lr = inputs.len() - 1;
    inputs[lr] = hlo_ir::Literal::scalar(DType::F32, 0.1);
    // One step on the plugin equals the reference.
    hlo_e2e::check_against_reference(&f, &inputs, 10.0);
    // Ten steps lower the loss.
    let exe = hlo_runtime::CompiledFunction::new(hlo_e2e::client(), &f).unwrap();
    let mut losses = Vec::new();
    for _ in 0..10 {
        let host: Vec<_> = inputs
            .iter()
            .cloned()
            .map(hlo_runtime::HostArray::from)
            .collect();
        let out = exe.run(&host).unwrap();
        losses.push(out[0].to_vec::<f32>().unwrap()[0]);
        for (k, o) in out.into_iter().enumerate().skip(1) {
            inputs[k] = o.into(); // parameters are inputs 1..=4 and outputs 1..=4
        }
    }
    assert!(losses[9] < losses[0] * 0.9, "{losses:?}");
}

/// The layout report and every line of the sharded program that carries a
/// sharding, for the MLP train step under two meshes.
fn sharding_annotations(mesh: &str) -> String {
    let f = hlo_ir::simplify(&two_layer_mlp_sgd_step(16, 16, 32, 8, DType::F32).unwrap());
    let mesh: hlo_partitioner::Mesh = mesh.parse().unwrap();
    let s = hlo_partitioner::FunctionShardings::from_rules(&f, &mesh, &hlo_models::mlp::rules())
        .unwrap();
    let mut out = s.report(&f);
    for line in hlo_lowering::to_stablehlo_sharded(&f, &s)
        .lines()
        .filter(|l| l.contains("sdy"))
    {
        out += line.trim();
        out.push('\n');
    }
    for line in hlo_lowering::to_hlo_text_sharded(&f, &s)
        .lines()
        .filter(|l| l.contains("sharding="))
    {
        out += line.trim();
        out.push('\n');
    }
    out
}

#[test]
fn mlp_train_step_shardings_1_8_1() {
    settings().bind(|| {
        insta::assert_snapshot!(
            "mlp_sgd_step.shardings.1_8_1",
            sharding_annotations("dp=1,fsdp=8,mp=1")
        )
    });
}

#[test]
fn mlp_train_step_shardings_2_2_2() {
    settings().bind(|| {
        insta::assert_snapshot!(
            "mlp_sgd_step.shardings.2_2_2",
            sharding_annotations("dp=2,fsdp=2,mp=2")
        )
    });
}

/// Every sharding annotation of the tiny Llama LoRA train step under a mesh:
/// the layout report of its inputs and outputs, and the lines of the
/// StableHLO (Shardy) and HLO (GSPMD) text that carry a sharding.
fn llama_step_annotations(mesh: &str) -> String {
    use hlo_models::decoder::{LoraConfig, ModelConfig, DEFAULT_TARGETS};
    use hlo_models::train::{train_step, Optimizer, Schedule, TrainConfig};
    let config = ModelConfig::preset("tiny").unwrap();
    let mesh: hlo_partitioner::Mesh = mesh.parse().unwrap();
    let tc = TrainConfig {
        dtype: DType::F32,
        batch: 8,
        seq: 16,
        lr: 1e-3,
        optimizer: Optimizer::adamw(0.01),
        schedule: Schedule::Constant { warmup: 0 },
        clip_norm: Some(1.0),
        lora: Some(LoraConfig::new(8, 16.0, &DEFAULT_TARGETS, false).unwrap()),
        batch_axes: vec!["dp".into(), "fsdp".into()],
        scan_layers: false,
        remat_layers: false,
        remat_mlp: false,
        grad_accum: 1,
        packing: false,
        attention: hlo_models::attention::AttentionKind::Naive,
        loss_chunk: None,
        loss: hlo_models::train::Loss::CausalLm,
    };
    let step = train_step(&config, &tc).unwrap();
    let f = hlo_ir::simplify(&step.function);
    let s = hlo_partitioner::FunctionShardings::from_rules(
        &f,
        &mesh,
        &hlo_models::decoder::partition_rules(&config),
    )
    .unwrap();
    let mut out = s.report(&f);
    for line in hlo_lowering::to_stablehlo_with(&f, Some(&s), &step.donated)
        .lines()
        .filter(|l| l.contains("sdy.") && !l.contains("func.func"))
    {
        out += line.trim();
        out.push('\n');
    }
    for line in hlo_lowering::to_hlo_text_sharded(&f, &s)
        .lines()
        .filter(|l| l.contains("sharding=") && l.contains("parameter("))
    {
        // The sharding of each parameter, without the instruction's name.
        let (_, rest) = line.split_once(" = ").unwrap();
        out += rest.trim();
        out.push('\n');
    }
    out
}

#[test]
fn tiny_llama_train_step_shardings_1_8_1() {
    settings().bind(|| {
        insta::assert_snapshot!(
            "tiny_llama_train_step.shardings.1_8_1",
            llama_step_annotations("dp=1,fsdp=8,mp=1")
        )
    });
}

#[test]
fn tiny_llama_train_step_shardings_2_2_2() {
    settings().bind(|| {
        insta::assert_snapshot!(
            "tiny_llama_train_step.shardings.2_2_2",
            llama_step_annotations("dp=2,fsdp=2,mp=2")
        )
    });
}

/// `hlo-train dump-hlo --what forward --batch 2 --seq 8` for the tiny preset,
/// as compiled (simplified), in both formats.
fn tiny_forward() -> hlo_ir::Function {
    let config = hlo_models::decoder::ModelConfig::preset("tiny").unwrap();
    hlo_ir::simplify(
        &hlo_models::decoder::forward_function(&config, DType::F32, 2, 8, None).unwrap(),
    )
}

#[test]
fn tiny_llama_forward_stablehlo() {
    settings().bind(|| {
        insta::assert_snapshot!(
            "tiny_llama_forward.stablehlo",
            hlo_lowering::to_stablehlo(&tiny_forward())
        )
    });
}

#[test]
fn tiny_llama_forward_hlo() {
    settings().bind(|| {
        insta::assert_snapshot!(
            "tiny_llama_forward.hlo",
            hlo_lowering::to_hlo_text(&tiny_forward())
        )
    });
}
