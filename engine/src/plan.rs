//! What the train step holds in each device's memory, before renting the
//! devices: the step is traced from abstract shapes (no weights), laid out
//! over the mesh, compiled on the CPU plugin with as many virtual devices,
//! and XLA's compiled memory figures are read beside the per-device shares
//! of weights, adapters and optimizer state counted from the layouts.

use std::time::Instant;

use hlo_models::llama::{partition_rules, LlamaConfig};
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
    config: &LlamaConfig,
    tc: &TrainConfig,
    mesh: &Mesh,
) -> Result<(ShardedStep, MemoryPlan)> {
    let step = ShardedStep::new(&train_step(config, tc)?, mesh, &partition_rules())?;
    let (mut weights, mut lora, mut optimizer) = (0u64, 0u64, 0u64);
    for (k, input) in step.step.inputs.iter().enumerate() {
        let bytes = step.input_bytes_per_device(k);
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
            lora_bytes: lora,
            optimizer_bytes: optimizer,
            xla,
            total_bytes,
            compile_s,
        },
    ))
}

/// One parameter kind's layout: its name (layer 0 or the stack), its
/// dimensions and spec without the unsplit leading axis.
#[derive(Clone, Debug, PartialEq)]
pub struct Layout {
    pub name: String,
    pub dims: Vec<i64>,
    pub spec: PartitionSpec,
}

/// The layouts of a step's parameters, one per kind (layers are alike).
pub fn parameter_layouts(step: &ShardedStep) -> Vec<Layout> {
    let f = step.function();
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for (k, b) in f.inputs.iter().enumerate() {
        let input = &step.step.inputs[k];
        if !matches!(input.role, Role::Weight | Role::Trainable) {
            continue;
        }
        let ty = f.ty(b.value);
        let kind = b
            .name
            .split('.')
            .filter(|p| p.parse::<u64>().is_err())
            .collect::<Vec<_>>()
            .join(".");
        if ty.rank() == 0 || !seen.insert(kind) {
            continue;
        }
        let spec = step.input_spec(k);
        let (dims, spec) = if input.leading_axis && ty.rank() > 1 {
            (
                ty.dims[1..].to_vec(),
                PartitionSpec(spec.0.iter().skip(1).cloned().collect()),
            )
        } else {
            (ty.dims.clone(), spec.clone())
        };
        out.push(Layout {
            name: b.name.clone(),
            dims,
            spec,
        });
    }
    out
}
