//! `hlo-train bench`: times the compiled train step. Weights are made on
//! the devices (a cheap deterministic pattern; speed does not depend on the
//! values), so presets of any size need no host memory; `--checkpoint` reads
//! real weights instead.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use hlo_ir::{full, iota, trace, DType, Literal, Tensor, TensorType};
use hlo_models::train::{step_flops, train_step};
use hlo_partitioner::{llama_rules, FunctionShardings, Mesh, Sharding};
use hlo_runtime::{DeviceArray, HostArray, PluginKind, ShardedFunction};
use serde_json::json;

use crate::common::PluginArgs;
use crate::model_args::ModelArgs;
use crate::step_args::leading_axis;
use crate::step_args::StepArgs;
use crate::train::{measure_cpu_peak, peak_tflops};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub step: StepArgs,

    #[command(flatten)]
    pub plugin: PluginArgs,

    /// Device mesh (default dp=1,fsdp=N,mp=1 over --devices).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// Timed steps.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub steps: i64,

    /// Untimed steps first (the first run's allocations and autotuning).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(i64).range(0..=1000))]
    pub warmup_steps: i64,

    /// The devices' peak TFLOP/s for MFU (default: a table by device kind;
    /// measured for CPUs).
    #[arg(long)]
    pub peak_tflops: Option<f64>,

    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What a parameter starts as.
#[derive(Clone, Copy, PartialEq)]
enum Fill {
    Zeros,
    Ones,
    Pattern(f64),
}

/// A deterministic, value-spread tensor made on the devices: `scale ·
/// sin(Σ_d i_d · c_d)`, each device computing its own block.
fn pattern(ty: &TensorType, scale: f64) -> Tensor {
    let f32t = ty.with_dtype(DType::F32);
    let consts = [12.9898, 78.233, 37.719, 4.581];
    let mut h = full(f32t.clone(), 0.25);
    for d in 0..ty.rank() {
        h = h + iota(f32t.clone(), d as i64) * consts[d % consts.len()];
    }
    (h.sin() * scale).cast(ty.dtype)
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let model = args.model.open()?;
    let config = &model.config;
    let mesh = match &args.mesh {
        Some(m) => m.clone(),
        None => format!("dp=1,fsdp={},mp=1", args.plugin.devices.unwrap_or(1)).parse()?,
    };
    let cpu = args.plugin.plugin.kind() == PluginKind::Cpu;
    let (client, devices) = args.plugin.client_for(&mesh)?;
    let dtype = args.model.dtype(cpu);
    let tc = args
        .step
        .train_config(config, dtype, &mesh, args.warmup_steps + args.steps, None)?;
    let step = train_step(config, &tc)?;
    let f = hlo_ir::simplify(&step.function);
    let shardings =
        FunctionShardings::from_rules_stacked(&f, &mesh, &llama_rules(), &leading_axis(&tc))?;
    let t0 = Instant::now();
    let exe = ShardedFunction::with_donation(&client, &f, shardings.clone(), &step.donated)?;
    let compile_s = t0.elapsed().as_secs_f64();

    // State, made on the devices (or read from the checkpoint).
    let mut state: Vec<DeviceArray> = Vec::with_capacity(f.inputs.len());
    for (k, b) in f.inputs.iter().enumerate() {
        let ty = f.ty(b.value).clone();
        let spec = shardings.inputs[k].clone();
        let sharding = Sharding::new(mesh.clone(), spec.clone());
        if b.name == "input_ids" {
            let ids: Vec<i32> = (0..ty.element_count())
                .map(|i| ((i as u64 * 2654435761) % config.vocab_size as u64) as i32)
                .collect();
            state.push(DeviceArray::shard(
                &client,
                &HostArray::new(&ty.dims, &ids)?,
                &sharding,
                &devices,
            )?);
            continue;
        }
        if b.name == "step" {
            state.push(DeviceArray::shard(
                &client,
                &HostArray::from(Literal::scalar(DType::I32, 0.0)),
                &sharding,
                &devices,
            )?);
            continue;
        }
        let is_weight =
            !(b.name.contains("lora_") || b.name.starts_with("opt.") || b.name == "loss_mask");
        if model.checkpoint.is_some() && is_weight {
            let lit = crate::model_args::Model::weight(&model, &b.name, dtype, 0)?;
            state.push(DeviceArray::shard(
                &client,
                &HostArray::from(lit),
                &sharding,
                &devices,
            )?);
            continue;
        }
        let fill = if b.name == "loss_mask" || b.name.ends_with("norm.weight") {
            Fill::Ones
        } else if b.name.starts_with("opt.") || b.name.ends_with("lora_b") {
            Fill::Zeros
        } else if b.name.ends_with("lora_a") {
            Fill::Pattern(1.0 / (ty.dims[ty.rank() - 2] as f64).sqrt())
        } else {
            Fill::Pattern(config.initializer_range)
        };
        let made = trace("init", &[] as &[(&str, TensorType)], |_| {
            vec![(
                "x",
                match fill {
                    Fill::Zeros => full(ty.clone(), 0.0),
                    Fill::Ones => full(ty.clone(), 1.0),
                    Fill::Pattern(s) => pattern(&ty, s),
                },
            )]
        })?;
        let init = ShardedFunction::new(
            &client,
            &made,
            FunctionShardings {
                mesh: mesh.clone(),
                inputs: vec![],
                outputs: vec![spec],
            },
        )?;
        state.push(init.run(&[])?.remove(0));
    }
    let loss_at = f
        .outputs
        .iter()
        .position(|b| b.name == "loss")
        .expect("the step has a loss");
    let mut times = Vec::new();
    let mut loss = f64::NAN;
    for i in 0..args.warmup_steps + args.steps {
        let t = Instant::now();
        let inputs: Vec<&DeviceArray> = state.iter().collect();
        let outputs = exe.run(&inputs)?;
        for b in outputs[loss_at].buffers() {
            b.block_until_ready()?;
        }
        let dt = t.elapsed().as_secs_f64();
        if i >= args.warmup_steps {
            times.push(dt);
        }
        loss = outputs[loss_at].gather()?.to_f64_vec()[0];
        let mut outputs: Vec<Option<DeviceArray>> = outputs.into_iter().map(Some).collect();
        for &(input, output) in &step.donated {
            if let Some(o) = outputs[output].take() {
                state[input] = o;
            }
        }
    }
    if !loss.is_finite() {
        bail!(
            "the benchmark's loss is {loss}: the step is numerically broken for this configuration"
        );
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let step_time = times[times.len() / 2];
    let tokens = (tc.batch * tc.seq) as f64;
    let peak = match args.peak_tflops {
        Some(p) => p,
        None => match peak_tflops(&devices[0].kind()?, dtype) {
            Some(p) => p,
            None => measure_cpu_peak(&client)?,
        },
    } * 1e12
        * mesh.size() as f64;
    let mfu = step_flops(config, &tc) / step_time / peak;
    let m = exe.executable().compiled_memory_stats()?;
    let compiled_total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        + m.temp_size_in_bytes)
        .max(0) as u64;
    let peak_bytes = devices[0]
        .memory_stats()
        .and_then(|s| s.peak_bytes_in_use)
        .map_or(compiled_total, |p| p as u64);
    let v = json!({
        "model": model.name,
        "mesh": mesh.to_string(),
        "dtype": dtype.to_string(),
        "mode": if tc.lora.is_some() { "lora" } else { "full" },
        "batch": tc.batch,
        "seq": tc.seq,
        "scan_layers": tc.scan_layers,
        "tokens_per_s": tokens / step_time,
        "step_time_s": step_time,
        "mfu": mfu,
        "peak_tflops": peak / 1e12,
        "compile_s": compile_s,
        "peak_bytes": peak_bytes,
        "platform": client.platform_name()?,
        "device": devices[0].kind()?,
    });
    if args.json {
        println!("{v}");
    } else {
        println!(
            "{} {} on {} ({}): batch {} × seq {}: median step {:.2} ms over {} steps, {:.0} tokens/s, MFU {:.1}%, compile {compile_s:.1}s, peak memory {} per device",
            model.name,
            v["mode"].as_str().unwrap_or(""),
            mesh,
            v["device"].as_str().unwrap_or(""),
            tc.batch,
            tc.seq,
            step_time * 1e3,
            times.len(),
            tokens / step_time,
            mfu * 100.0,
            crate::plan::gb(peak_bytes)
        );
    }
    Ok(())
}
