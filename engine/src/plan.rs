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
use hlo_models::train::{step_flops, train_step, TrainConfig};
use hlo_partitioner::{Mesh, PartitionSpec};
use hlo_runtime::{CompiledMemoryStats, Mode, PluginSpec};

use crate::backend::{Backend, BackendOptions};
use crate::error::Result;
use crate::hardware::Device;
use crate::pipeline::ShardedStep;

/// Devices of the node a plan is for when no mesh is given: the recipes'
/// node of 8 GPUs.
pub const NODE_DEVICES: i64 = 8;

/// The mesh a plan lays the step over: `options`' mesh or device count
/// ([`BackendOptions::mesh_or`]), else one node of [`NODE_DEVICES`]
/// devices over fsdp, or fewer when the batch has fewer rows than that to
/// split (`gcd(batch, 8)`; batch 1: one device).
///
/// ```
/// use hlo_engine::{plan::plan_mesh, BackendOptions};
/// let o = BackendOptions::cpu();
/// assert_eq!(plan_mesh(&o, 16).unwrap().to_string(), "dp=1,fsdp=8,mp=1");
/// assert_eq!(plan_mesh(&o, 12).unwrap().to_string(), "dp=1,fsdp=4,mp=1");
/// ```
pub fn plan_mesh(options: &BackendOptions, batch: i64) -> Result<Mesh> {
    let fsdp = gcd(batch.max(1), NODE_DEVICES);
    let default = Mesh::new(&[("dp", 1), ("fsdp", fsdp), ("mp", 1)])?;
    options.mesh_or(Some(&default))
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A train step's compute time at a device's data sheet peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeEstimate {
    /// Dense peak of one device for the step's dtype.
    pub peak_tflops: f64,
    /// The step's FLOPs ([`step_flops`]), shared evenly over the mesh's
    /// devices, at that peak.
    pub ms: f64,
}

/// The compute time of the step of `config` under `tc` on `mesh` of
/// `device`s, None when the table has no peak for it (the host's is
/// measured, not planned).
pub fn compute_estimate(
    config: &ModelConfig,
    tc: &TrainConfig,
    mesh: &Mesh,
    device: &Device,
) -> Option<ComputeEstimate> {
    let peak_tflops = device.peak_tflops(tc.dtype)?;
    let ms = step_flops(config, tc) / mesh.size() as f64 / (peak_tflops * 1e12) * 1e3;
    Some(ComputeEstimate { peak_tflops, ms })
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::Kind;

    #[test]
    fn the_default_mesh_is_a_node_over_fsdp_or_what_the_batch_splits_over() {
        let o = BackendOptions::cpu();
        let fsdp = |batch: i64| plan_mesh(&o, batch).unwrap().to_string();
        assert_eq!(fsdp(8), "dp=1,fsdp=8,mp=1");
        assert_eq!(fsdp(24), "dp=1,fsdp=8,mp=1");
        assert_eq!(fsdp(6), "dp=1,fsdp=2,mp=1");
        assert_eq!(fsdp(3), "dp=1,fsdp=1,mp=1");
        assert_eq!(fsdp(0), "dp=1,fsdp=1,mp=1");
        // A device count or a mesh wins over the default.
        let mut o = BackendOptions::cpu();
        o.devices = Some(4);
        assert_eq!(plan_mesh(&o, 8).unwrap().to_string(), "dp=1,fsdp=4,mp=1");
        o.mesh = Some("dp=2,fsdp=2,mp=1".parse().unwrap());
        assert_eq!(plan_mesh(&o, 8).unwrap().to_string(), "dp=2,fsdp=2,mp=1");
        o.devices = Some(8);
        assert!(plan_mesh(&o, 8).is_err());
    }

    #[test]
    fn compute_time_is_the_step_flops_per_device_at_the_peak() {
        let config = ModelConfig::preset("tiny").unwrap();
        let tc = TrainConfig::new(DType::BF16, 8, 16);
        let mesh: Mesh = "dp=1,fsdp=4,mp=1".parse().unwrap();
        let e = compute_estimate(&config, &tc, &mesh, Kind::H100.device()).unwrap();
        assert_eq!(e.peak_tflops, 989.0);
        let ms = step_flops(&config, &tc) / 4.0 / 989e12 * 1e3;
        assert!((e.ms - ms).abs() <= 1e-12 * ms, "{} vs {ms}", e.ms);
        assert_eq!(
            compute_estimate(&config, &tc, &mesh, Kind::Host.device()),
            None
        );
    }
}
