//! What the train step holds in each device's memory, before renting the
//! devices: the step is traced from abstract shapes (no weights), laid out
//! over the mesh, compiled on the CPU plugin with as many virtual devices,
//! and XLA's compiled memory figures are read beside the per-device shares
//! of weights, adapters and optimizer state counted from the layouts.

use std::time::Instant;

use hlo_ir::DType;
use hlo_models::decoder::{partition_rules, ModelConfig};
use hlo_models::nf4;
use hlo_models::roles::Role;
use hlo_models::train::{train_step, TrainConfig};
use hlo_partitioner::{Mesh, PartitionSpec};
use hlo_runtime::{CompiledMemoryStats, Mode, PluginSpec};

use crate::backend::Backend;
use crate::error::Result;
use crate::pipeline::ShardedStep;

/// Bytes per device.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    /// Frozen (or, finetuning fully, trained) base weights.
    pub weights_bytes: u64,
    /// The part of `weights_bytes` held in NF4 (codes and block scales).
    pub nf4_bytes: u64,
    /// The largest projection one device dequantizes (in the compute
    /// dtype) just before its matmul: a temporary within XLA's.
    pub dequantized_bytes: u64,
    /// LoRA parameters.
    pub lora_bytes: u64,
    /// Optimizer moments.
    pub optimizer_bytes: u64,
    /// XLA's figures for the compiled step.
    pub xla: CompiledMemoryStats,
    /// Arguments + outputs − aliased + temporaries.
    pub total_bytes: u64,
    /// Seconds XLA took to compile the step on the CPU.
    pub compile_s: f64,
}

/// Plans the train step of `config` under `tc` on `mesh`.
pub fn plan(
    config: &ModelConfig,
    tc: &TrainConfig,
    mesh: &Mesh,
) -> Result<(ShardedStep, MemoryPlan)> {
    let step = ShardedStep::new(&train_step(config, tc)?, mesh, &partition_rules())?;
    let (mut weights, mut lora, mut optimizer) = (0u64, 0u64, 0u64);
    let (mut nf4_bytes, mut dequantized) = (0u64, 0u64);
    let f = step.function();
    for (k, input) in step.step.inputs.iter().enumerate() {
        let bytes = step.input_bytes_per_device(k);
        let codes = f.ty(f.inputs[k].value).dtype == DType::U8;
        if codes || f.inputs[k].name.ends_with(nf4::ABSMAX_SUFFIX) {
            nf4_bytes += bytes;
        }
        if codes {
            // Two values a byte, one layer of a stack at a time.
            let layers = if input.leading_axis {
                config.num_hidden_layers as u64
            } else {
                1
            };
            let values = 2 * bytes / layers;
            dequantized = dequantized.max(values * tc.dtype.size_in_bytes() as u64);
        }
        match input.role {
            Role::OptimizerState { .. } => optimizer += bytes,
            Role::Trainable if tc.lora.is_some() => lora += bytes,
            Role::Trainable | Role::Weight => weights += bytes,
            _ => {}
        }
    }
    let backend = Backend::open_for(&PluginSpec::Cpu, mesh.clone())?;
    let t0 = Instant::now();
    let program = step.compile(&backend, Mode::Jit)?;
    let compile_s = t0.elapsed().as_secs_f64();
    let xla = program
        .compiled_memory_stats()?
        .expect("a JIT program has memory figures");
    let total_bytes = xla.total_device_bytes().max(0) as u64;
    Ok((
        step,
        MemoryPlan {
            weights_bytes: weights,
            nf4_bytes,
            dequantized_bytes: dequantized,
            lora_bytes: lora,
            optimizer_bytes: optimizer,
            xla,
            total_bytes,
            compile_s,
        },
    ))
}

/// One distinct layout of a step's state: every tensor of one shape and
/// dtype laid out by one spec.
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutGroup {
    /// The spec over the whole shape (an unsplit leading axis included).
    pub spec: PartitionSpec,
    /// The global shape, and the block one device holds.
    pub shape: Vec<i64>,
    pub block: Vec<i64>,
    pub dtype: String,
    /// Bytes one device holds of each tensor.
    pub bytes_per_device: u64,
    /// The tensors laid out so (weights, trainable parameters, optimizer
    /// state), by name.
    pub tensors: Vec<String>,
    /// Whether the first axis is a stack of layers (a scan's), never split.
    pub stacked: bool,
}

/// The step's state grouped by layout: each distinct (spec, shape, dtype)
/// once, with the tensors that share it, largest share per device first.
pub fn layout_groups(step: &ShardedStep) -> Vec<LayoutGroup> {
    let f = step.function();
    let mut groups: Vec<LayoutGroup> = Vec::new();
    for (k, b) in f.inputs.iter().enumerate() {
        let input = &step.step.inputs[k];
        let state = matches!(
            input.role,
            Role::Weight | Role::Trainable | Role::OptimizerState { .. }
        );
        if !state {
            continue;
        }
        let ty = f.ty(b.value);
        let spec = step.input_spec(k).clone();
        let key = (spec.clone(), ty.dims.clone(), ty.dtype.to_string());
        match groups
            .iter_mut()
            .find(|g| (g.spec.clone(), g.shape.clone(), g.dtype.clone()) == key)
        {
            Some(g) => g.tensors.push(b.name.clone()),
            None => groups.push(LayoutGroup {
                block: spec.shard_shape(step.mesh(), &ty.dims),
                spec,
                shape: ty.dims.clone(),
                dtype: ty.dtype.to_string(),
                bytes_per_device: step.input_bytes_per_device(k),
                tensors: vec![b.name.clone()],
                stacked: input.leading_axis,
            }),
        }
    }
    groups.sort_by(|a, b| {
        (b.bytes_per_device * b.tensors.len() as u64)
            .cmp(&(a.bytes_per_device * a.tensors.len() as u64))
    });
    groups
}
