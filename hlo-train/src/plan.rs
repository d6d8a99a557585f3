//! `hlo-train plan`: what the train step holds in each device's memory,
//! from a laptop, as the engine plans it (abstract parameters, compiled on
//! the CPU plugin with as many virtual devices as the mesh has).

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use hlo_engine::partitioner::{draw_sharding, Mesh};
use hlo_engine::plan::{layout_groups, plan, LayoutGroup};
use hlo_engine::{BackendOptions, Model};
use serde_json::json;

use crate::args::{gb, DtypeArgs, ModelArgs, OptimArgs, StepArgs};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    Mi300x,
    Mi250,
    H100,
    H200,
    Cpu,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Target::Mi300x => "MI300X",
            Target::Mi250 => "MI250 (one GCD)",
            Target::H100 => "H100",
            Target::H200 => "H200",
            Target::Cpu => "this host",
        })
    }
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
    pub recipe: crate::args::RecipeArgs,

    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub dtype: DtypeArgs,

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

    /// List each distinct layout of the state once: its spec, global and
    /// per-device shapes, bytes per device and the tensors that share it,
    /// with a drawing over the mesh (in --json too).
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
    let dtype = args.dtype.dtype(args.target == Target::Cpu);
    // The optimizer's numbers do not change what a step holds.
    let tc = args
        .step
        .train_config(&OptimArgs::default(), config, dtype, &mesh, 1000, None)?;
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
    let layouts = if args.show_sharding {
        layout_groups(&step)
    } else {
        Vec::new()
    };
    if args.json {
        let mut v = json!({
            "model": model.name,
            "mesh": mesh.to_string(),
            "dtype": dtype.to_string(),
            "seq": tc.seq,
            "attention": crate::args::attention_json(&tc),
            "loss_chunk": tc.loss_chunk_for(config.vocab_size),
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
        if args.show_sharding {
            v["layouts"] = layouts
                .iter()
                .map(|g| {
                    json!({
                        "spec": g.spec.to_string(),
                        "shape": g.shape,
                        "block": g.block,
                        "dtype": g.dtype,
                        "stacked_layers": g.stacked,
                        "bytes_per_device_each": g.bytes_per_device,
                        "tensors": g.tensors,
                    })
                })
                .collect();
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "plan: {} ({} parameters, {dtype}), {} step, batch {} × seq {}, mesh {mesh}{}, {}",
        model.name,
        config.parameter_count(),
        if tc.lora.is_some() { "LoRA" } else { "full" },
        tc.batch,
        tc.seq,
        if tc.scan_layers {
            ", layers scanned (rematerialized per layer)"
        } else {
            ""
        },
        tc.long_context_summary(config.vocab_size)
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
        "  total              {:>12}  of {} on {}: {}",
        gb(p.total_bytes),
        gb(capacity),
        args.target,
        if fits { "fits" } else { "does NOT fit" }
    );
    println!(
        "compiled for {} in {:.1}s",
        match mesh.size() {
            1 => "1 CPU device".to_string(),
            n => format!("{n} virtual CPU devices"),
        },
        p.compile_s
    );
    for g in &layouts {
        print_layout(&mesh, g);
    }
    Ok(())
}

/// Shows a layout: spec, shapes, bytes, the tensors sharing it, and a
/// drawing of one layer's blocks over the mesh.
fn print_layout(mesh: &Mesh, g: &LayoutGroup) {
    let dims = |d: &[i64]| d.iter().map(i64::to_string).collect::<Vec<_>>().join(" × ");
    let n = g.tensors.len();
    println!(
        "\n{} {} [{}]{} → per device [{}], {} each, {} for {n} tensor{}",
        g.spec,
        g.dtype,
        dims(&g.shape),
        if g.stacked { " (layers stacked)" } else { "" },
        dims(&g.block),
        gb(g.bytes_per_device),
        gb(g.bytes_per_device * n as u64),
        if n == 1 { "" } else { "s" }
    );
    const SHOWN: usize = 6;
    for t in g.tensors.iter().take(SHOWN) {
        println!("  {t}");
    }
    if n > SHOWN {
        println!("  … and {} more", n - SHOWN);
    }
    // The drawing is of one layer: the stacked axis is never split.
    let skip = usize::from(g.stacked);
    let spec =
        hlo_engine::partitioner::PartitionSpec(g.spec.0.iter().skip(skip).cloned().collect());
    if g.shape.len() > skip {
        print!("{}", draw_sharding(mesh, &spec, &g.shape[skip..]));
    }
}
