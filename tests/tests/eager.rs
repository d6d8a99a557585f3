//! The eager executor on the tiny Llama LoRA train step: the same numbers
//! as the compiled step, no compiles after the first step, values freed.

use hlo_e2e::{new_client, RandomLiteral, Rng};
use hlo_ir::{DType, Literal};
use hlo_models::attention::AttentionKind;
use hlo_models::decoder::partition_rules;
use hlo_models::decoder::{LoraConfig, ModelConfig, DEFAULT_TARGETS};
use hlo_models::train::{train_step, Optimizer, Schedule, TrainConfig};
use hlo_partitioner::{FunctionShardings, Mesh, Sharding};
use hlo_runtime::{DeviceArray, Eager, HostArray, ShardedFunction};

fn step_inputs(f: &hlo_ir::Function, config: &ModelConfig) -> Vec<Literal> {
    let mut rng = Rng::from_state(7);
    f.inputs
        .iter()
        .map(|b| {
            let ty = f.ty(b.value).clone();
            match b.name.as_str() {
                "input_ids" => rng.literal(ty, 0.0, config.vocab_size as f64),
                "loss_mask" => Literal::splat(ty, 1.0),
                "step" => Literal::scalar(DType::I32, 0.0),
                n if n.starts_with("opt.") => Literal::splat(ty, 0.0),
                n if n.ends_with("norm.weight") => Literal::splat(ty, 1.0),
                _ => rng.literal(ty, -0.1, 0.1),
            }
        })
        .collect()
}

fn run_both(mesh: &str) {
    run_both_with(mesh, AttentionKind::Naive, None);
}

fn run_both_with(mesh: &str, attention: AttentionKind, loss_chunk: Option<i64>) {
    let client = new_client(4);
    let config = ModelConfig::preset("tiny").unwrap();
    let mesh: Mesh = mesh.parse().unwrap();
    let tc = TrainConfig {
        dtype: DType::F32,
        batch: 4,
        seq: 8,
        lr: 1e-2,
        optimizer: Optimizer::adamw(0.01),
        schedule: Schedule::Constant { warmup: 0 },
        clip_norm: Some(1.0),
        lora: Some(LoraConfig::new(4, 8.0, &DEFAULT_TARGETS, false).unwrap()),
        batch_axes: if mesh.size() > 1 {
            vec!["dp".into(), "fsdp".into()]
        } else {
            vec![]
        },
        scan_layers: false,
        remat_layers: false,
        remat_mlp: false,
        grad_accum: 1,
        packing: false,
        attention,
        loss_chunk,
        loss: hlo_models::train::Loss::CausalLm,
    };
    let step = train_step(&config, &tc).unwrap();
    let f = hlo_ir::simplify(&step.function);
    let shardings = FunctionShardings::from_rules(&f, &mesh, &partition_rules(&config)).unwrap();
    let devices = client.addressable_devices().unwrap()[..mesh.size() as usize].to_vec();
    let inputs = step_inputs(&f, &config);
    let place = |k: usize, l: &Literal| {
        DeviceArray::shard(
            &client,
            &HostArray::from(l.clone()),
            &Sharding::new(mesh.clone(), shardings.inputs[k].clone()),
            &devices,
        )
        .unwrap()
    };
    let loss_at = f.outputs.iter().position(|b| b.name == "loss").unwrap();
    // Three steps each way, feeding each step's state into the next.
    let jit = ShardedFunction::new(&client, &f, shardings.clone()).unwrap();
    let eager = Eager::new(&client, mesh.clone(), devices.clone()).unwrap();
    let mut state_j: Vec<DeviceArray> = inputs
        .iter()
        .enumerate()
        .map(|(k, l)| place(k, l))
        .collect();
    let mut state_e: Vec<DeviceArray> = inputs
        .iter()
        .enumerate()
        .map(|(k, l)| place(k, l))
        .collect();
    let mut misses_after_first = 0;
    for s in 0..3 {
        let out_j = jit.run(&state_j.iter().collect::<Vec<_>>()).unwrap();
        let out_e = eager
            .run(
                &f,
                &state_e.iter().collect::<Vec<_>>(),
                &shardings.outputs,
                None,
            )
            .unwrap();
        let (lj, le) = (
            out_j[loss_at].gather().unwrap().to_f64_vec()[0],
            out_e[loss_at].gather().unwrap().to_f64_vec()[0],
        );
        assert!(
            ((lj - le) / lj).abs() < 1e-4,
            "{mesh} step {s}: jit {lj}, eager {le}"
        );
        if s == 0 {
            misses_after_first = eager.stats().misses;
            assert!(misses_after_first > 50, "the first step compiles the ops");
            // Elementwise ops write over the operands that die at them.
            assert!(eager.stats().donated > 0, "{:?}", eager.stats());
            assert!(
                eager.stats().peak_live_bytes < eager.stats().intermediate_bytes / 2,
                "{:?}",
                eager.stats()
            );
        } else {
            assert_eq!(
                eager.stats().misses,
                misses_after_first,
                "step {s} compiled something"
            );
        }
        // Outputs named like inputs carry the state over.
        let next = |outs: Vec<DeviceArray>, old: Vec<DeviceArray>| -> Vec<DeviceArray> {
            let mut outs: Vec<Option<DeviceArray>> = outs.into_iter().map(Some).collect();
            old.into_iter()
                .zip(&f.inputs)
                .map(
                    |(a, b)| match f.outputs.iter().position(|o| o.name == b.name) {
                        Some(j) => outs[j].take().unwrap(),
                        None => a,
                    },
                )
                .collect()
        };
        state_j = next(out_j, state_j);
        state_e = next(out_e, state_e);
    }
}

#[test]
fn eager_equals_jit_on_one_device() {
    run_both("dp=1,fsdp=1,mp=1");
}

#[test]
fn eager_equals_jit_on_a_1_4_1_mesh() {
    run_both("dp=1,fsdp=4,mp=1");
}

#[test]
fn eager_equals_jit_with_blockwise_attention_and_a_chunked_loss() {
    // Both run their loops (custom-VJP attention, the loss's scan) as one
    // op each in eager mode.
    run_both_with(
        "dp=1,fsdp=2,mp=2",
        AttentionKind::Blockwise { block: 4 },
        Some(4),
    );
}
