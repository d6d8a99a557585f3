//! `hlo-train plan`: what the train step holds in each device's memory, from
//! a laptop: the step is compiled for the mesh on the CPU plugin (that many
//! virtual devices, abstract parameters: no weights), XLA's compiled memory
//! figures are read, and the per-device shares of weights, adapters and
//! optimizer state are counted from the partition rules.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use hlo_models::llama::is_stacked;
use hlo_models::train::train_step;
use hlo_partitioner::{draw_sharding, llama_rules, FunctionShardings, Mesh, PartitionSpec};
use hlo_runtime::{ClientOptions, Plugin, PluginSpec, ShardedFunction};
use serde_json::json;

use crate::model_args::ModelArgs;
use crate::step_args::leading_axis;
use crate::step_args::StepArgs;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    Mi300x,
    Mi250,
    H100,
    H200,
    Cpu,
}

impl Target {
    /// Memory of one device in bytes (the host's for `cpu`).
    fn memory(self) -> u64 {
        match self {
            Target::Mi300x => 192_000_000_000,
            Target::Mi250 => 64_000_000_000, // per GCD
            Target::H100 => 80_000_000_000,
            Target::H200 => 141_000_000_000,
            Target::Cpu => host_memory(),
        }
    }
}

fn host_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub step: StepArgs,

    /// Device mesh (default dp=1,fsdp=8,mp=1).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// The device the step is for.
    #[arg(long, value_enum, default_value = "mi300x")]
    pub target: Target,

    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,

    /// Draw each parameter kind's layout over the mesh.
    #[arg(long)]
    pub show_sharding: bool,
}

/// Bytes in GB, or MB below a gigabyte.
pub(crate) fn gb(b: u64) -> String {
    if b >= 1_000_000_000 {
        format!("{:.2} GB", b as f64 / 1e9)
    } else {
        format!("{:.2} MB", b as f64 / 1e6)
    }
}

pub fn run(args: &PlanArgs) -> Result<()> {
    let model = args.model.open()?;
    let config = &model.config;
    let mesh = args
        .mesh
        .clone()
        .unwrap_or_else(|| "dp=1,fsdp=8,mp=1".parse().expect("valid"));
    let dtype = args.model.dtype(args.target == Target::Cpu);
    let tc = args.step.train_config(config, dtype, &mesh, 1000, None)?;
    let step = train_step(config, &tc)?;
    let f = hlo_ir::simplify(&step.function);
    let shardings =
        FunctionShardings::from_rules_stacked(&f, &mesh, &llama_rules(), &leading_axis(&tc))?;
    // Per-device bytes of each input, by kind.
    let (mut weights, mut lora, mut optimizer) = (0u64, 0u64, 0u64);
    for (b, spec) in f.inputs.iter().zip(&shardings.inputs) {
        let ty = f.ty(b.value);
        let block: i64 = spec.shard_shape(&mesh, &ty.dims).iter().product();
        let bytes = block as u64 * ty.dtype.size_in_bytes() as u64;
        if b.name.starts_with("opt.") {
            optimizer += bytes;
        } else if b.name.contains("lora_") {
            lora += bytes;
        } else if b.name.contains("weight") {
            weights += bytes;
        }
    }
    // XLA's own figures: compile for the mesh on the CPU plugin.
    let plugin = Plugin::load(PluginSpec::Cpu.resolve()?)?;
    let client = hlo_runtime::Client::new(&plugin, &ClientOptions::cpu(mesh.size()))?;
    let t0 = std::time::Instant::now();
    let exe = ShardedFunction::with_donation(&client, &f, shardings.clone(), &step.donated)?;
    let compile_s = t0.elapsed().as_secs_f64();
    let m = exe.executable().compiled_memory_stats()?;
    let (arg, out, alias, temp) = (
        m.argument_size_in_bytes.max(0) as u64,
        m.output_size_in_bytes.max(0) as u64,
        m.alias_size_in_bytes.max(0) as u64,
        m.temp_size_in_bytes.max(0) as u64,
    );
    let total = arg + out - alias.min(out) + temp;
    let capacity = args.target.memory();
    if capacity == 0 {
        bail!("cannot read the host's memory size from /proc/meminfo");
    }
    let fits = total <= capacity;
    if args.json {
        let v = json!({
            "model": model.name,
            "mesh": mesh.to_string(),
            "dtype": dtype.to_string(),
            "per_device": {
                "weights_bytes": weights,
                "lora_bytes": lora,
                "optimizer_bytes": optimizer,
                "xla": {"argument_bytes": arg, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp},
                "total_bytes": total,
            },
            "device_memory_bytes": capacity,
            "fits": fits,
            "compile_s": compile_s,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "plan: {} ({} parameters, {dtype}), {} step, batch {} × seq {}, mesh {mesh}{}",
        model.name,
        config.parameter_count(),
        if tc.lora.is_some() { "LoRA" } else { "full" },
        tc.batch,
        tc.seq,
        if tc.scan_layers {
            ", layers scanned (rematerialized per layer)"
        } else {
            ""
        }
    );
    println!("per device:");
    println!("  weights            {:>12}", gb(weights));
    println!("  LoRA parameters    {:>12}", gb(lora));
    println!("  optimizer state    {:>12}", gb(optimizer));
    println!("  XLA arguments      {:>12}", gb(arg));
    println!(
        "  XLA outputs        {:>12}  ({} reuse donated arguments)",
        gb(out),
        gb(alias)
    );
    println!("  XLA temporaries    {:>12}", gb(temp));
    println!(
        "  total              {:>12}  of {} on {:?}: {}",
        gb(total),
        gb(capacity),
        args.target,
        if fits { "fits" } else { "does NOT fit" }
    );
    println!(
        "compiled for {} virtual CPU devices in {compile_s:.1}s",
        mesh.size()
    );
    if args.show_sharding {
        let mut seen = std::collections::BTreeSet::new();
        for (b, spec) in f.inputs.iter().zip(&shardings.inputs) {
            let ty = f.ty(b.value);
            // One drawing per kind of parameter (layer 0, or the stack).
            let kind = b
                .name
                .split('.')
                .filter(|p| p.parse::<u64>().is_err())
                .collect::<Vec<_>>()
                .join(".");
            if ty.rank() == 0 || !seen.insert(kind) {
                continue;
            }
            let (dims, spec) = if is_stacked(&b.name) && ty.rank() > 1 {
                (
                    ty.dims[1..].to_vec(),
                    PartitionSpec(spec.0.iter().skip(1).cloned().collect()),
                )
            } else {
                (ty.dims.clone(), spec.clone())
            };
            println!("\n{}", b.name);
            print!("{}", draw_sharding(&mesh, &spec, &dims));
        }
    }
    Ok(())
}
