//! `hlo-train plan`: what the train step holds in each device's memory,
//! from a laptop, as the engine plans it (abstract parameters, compiled on
//! the CPU plugin with as many virtual devices as the mesh has).

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use hlo_engine::partitioner::{draw_sharding, Mesh};
use hlo_engine::plan::{parameter_layouts, plan};
use hlo_engine::{BackendOptions, Model};
use serde_json::json;

use crate::args::{gb, ModelArgs, StepArgs};

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

    /// Device mesh (default dp=1,fsdp=8,mp=1, or dp=1,fsdp=N,mp=1 over
    /// --devices).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// Devices of the target: must equal the mesh's size when both are
    /// given.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub devices: Option<u32>,

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

pub fn run(args: &PlanArgs) -> Result<()> {
    let model = Model::open(&args.model.source())?;
    let config = &model.config;
    let options = BackendOptions {
        devices: args.devices,
        mesh: args.mesh.clone(),
        ..BackendOptions::cpu()
    };
    let mesh = options.mesh_or(Some(&Mesh::new(&[("dp", 1), ("fsdp", 8), ("mp", 1)])?))?;
    let dtype = args.model.dtype(args.target == Target::Cpu);
    let tc = args.step.train_config(config, dtype, &mesh, 1000, None)?;
    let (step, p) = plan(config, &tc, &mesh)?;
    let x = &p.xla;
    let (arg, out, alias, temp) = (
        x.argument_size_in_bytes.max(0) as u64,
        x.output_size_in_bytes.max(0) as u64,
        x.alias_size_in_bytes.max(0) as u64,
        x.temp_size_in_bytes.max(0) as u64,
    );
    let capacity = args.target.memory();
    if capacity == 0 {
        bail!("cannot read the host's memory size from /proc/meminfo");
    }
    let fits = p.total_bytes <= capacity;
    if args.json {
        let v = json!({
            "model": model.name,
            "mesh": mesh.to_string(),
            "dtype": dtype.to_string(),
            "per_device": {
                "weights_bytes": p.weights_bytes,
                "lora_bytes": p.lora_bytes,
                "optimizer_bytes": p.optimizer_bytes,
                "xla": {"argument_bytes": arg, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp},
                "total_bytes": p.total_bytes,
            },
            "device_memory_bytes": capacity,
            "fits": fits,
            "compile_s": p.compile_s,
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
    println!("  weights            {:>12}", gb(p.weights_bytes));
    println!("  LoRA parameters    {:>12}", gb(p.lora_bytes));
    println!("  optimizer state    {:>12}", gb(p.optimizer_bytes));
    println!("  XLA arguments      {:>12}", gb(arg));
    println!(
        "  XLA outputs        {:>12}  ({} reuse donated arguments)",
        gb(out),
        gb(alias)
    );
    println!("  XLA temporaries    {:>12}", gb(temp));
    println!(
        "  total              {:>12}  of {} on {:?}: {}",
        gb(p.total_bytes),
        gb(capacity),
        args.target,
        if fits { "fits" } else { "does NOT fit" }
    );
    println!(
        "compiled for {} virtual CPU devices in {:.1}s",
        mesh.size(),
        p.compile_s
    );
    if args.show_sharding {
        for layout in parameter_layouts(&step) {
            println!("\n{}", layout.name);
            print!("{}", draw_sharding(&mesh, &layout.spec, &layout.dims));
        }
    }
    Ok(())
}
