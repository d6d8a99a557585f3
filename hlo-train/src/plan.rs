//! `hlo-train plan`: what the train step holds in each device's memory,
//! from a laptop, as the engine plans it (abstract parameters, compiled on
//! the CPU plugin with as many virtual devices as the mesh has).

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use hlo_engine::comm::{axis_span, interconnect, place, step_traffic, PlacedTransfer, Span};
use hlo_engine::flops::datasheet_tflops;
use hlo_engine::models::train::step_flops;
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
    // A 24 GB consumer card (GeForce RTX 4090).
    Rtx4090,
    Cpu,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Target::Mi300x => "MI300X",
            Target::Mi250 => "MI250 (one GCD)",
            Target::H100 => "H100",
            Target::H200 => "H200",
            Target::Rtx4090 => "RTX 4090",
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
            Target::Rtx4090 => 24_000_000_000,
            Target::Cpu => host_memory(),
        }
    }

    /// The device kind, as the FLOP and link tables name it.
    fn kind(self) -> &'static str {
        match self {
            Target::Mi300x => "MI300X",
            Target::Mi250 => "MI250",
            Target::H100 => "H100",
            Target::H200 => "H200",
            Target::Rtx4090 => "RTX 4090",
            Target::Cpu => "cpu",
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
    pub quantize: crate::args::QuantizeArgs,

    #[command(flatten)]
    pub dtype: DtypeArgs,

    #[command(flatten)]
    pub step: StepArgs,

    /// Device mesh (default dp=1,fsdp=8,mp=1, on fewer devices when the
    /// batch's rows do not split over 8; dp=1,fsdp=N,mp=1 over --devices).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// Devices of the target: must equal the mesh's size when both are
    /// given.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub devices: Option<u32>,

    /// The device the step is for.
    #[arg(long, value_enum, default_value = "mi300x")]
    pub target: Target,

    /// Nodes the mesh's devices are spread over, as many on each (process
    /// p holding devices p·L to p·L+L-1, the mesh laid over them in
    /// row-major order): the communication table then says which axes
    /// cross nodes. Counting processes as nodes, one per GPU makes every
    /// axis cross. The memory plan is per device and does not change.
    #[arg(long, visible_alias = "num-processes", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub nodes: u32,

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
    let model = args.quantize.apply(Model::open(&args.model.source())?)?;
    let config = &model.config;
    let options = BackendOptions {
        devices: args.devices,
        mesh: args.mesh.clone(),
        ..BackendOptions::cpu()
    };
    // The recipe's node of 8 devices over fsdp, or fewer when the batch
    // has fewer rows than that to split (batch 1: one device).
    let default_fsdp = gcd(args.step.batch.max(1), 8);
    let mesh = options.mesh_or(Some(&Mesh::new(&[
        ("dp", 1),
        ("fsdp", default_fsdp),
        ("mp", 1),
    ])?))?;
    let nodes = i64::from(args.nodes);
    if mesh.size() % nodes != 0 {
        bail!(
            "--nodes {nodes} does not divide the mesh {mesh}'s {} devices: each node must hold as many",
            mesh.size()
        );
    }
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
    let comm = Communication::new(config, &tc, &mesh, nodes, args.target);
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
                "nf4_weights_bytes": p.nf4_bytes,
                "dequantized_bytes": p.dequantized_bytes,
                "lora_bytes": p.lora_bytes,
                "optimizer_bytes": p.optimizer_bytes,
                "xla": {"argument_bytes": arg, "output_bytes": out, "alias_bytes": alias, "temp_bytes": temp},
                "total_bytes": p.total_bytes,
            },
            "device_memory_bytes": capacity,
            "fits": fits,
            "compile_s": p.compile_s,
            "nodes": nodes,
            "devices_per_node": comm.per_node,
            "axes": comm.axes.iter().map(|(axis, size, span)| {
                let (crossing, groups) = match *span {
                    Span::Partly { crossing, groups } => (Some(crossing), Some(groups)),
                    _ => (None, None),
                };
                json!({
                    "axis": axis,
                    "size": size,
                    "nodes": span.key(),
                    "groups_across": crossing,
                    "groups": groups,
                })
            }).collect::<Vec<_>>(),
            "communication": comm.rows.iter().map(|r| {
                let t = &r.transfer;
                json!({
                    "axis": t.axis,
                    "size": t.axis_size,
                    "collective": t.collective.to_string(),
                    "what": t.what,
                    "count": t.count,
                    "bytes_per_device": t.bytes_per_device.round() as u64,
                    "nodes": r.span.key(),
                    "link_gb_per_s": r.link_gbs,
                    "estimated_ms": r.ms,
                })
            }).collect::<Vec<_>>(),
            "communication_total": {
                "bytes_per_device": comm.total_bytes().round() as u64,
                "estimated_ms": comm.total_ms(),
                "compute_ms": comm.compute_ms,
                "peak_tflops": comm.peak_tflops,
            },
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
        "plan: {} ({} parameters, {dtype}{}), {} step, batch {} × seq {}, mesh {mesh}{}, {}",
        model.name,
        config.parameter_count(),
        match config.quantization {
            Some(q) if q.double_quant => ", projections in NF4 with double quantization",
            Some(_) => ", projections in NF4",
            None => "",
        },
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
    if p.nf4_bytes > 0 {
        println!(
            "    of which NF4     {:>12}  (codes and block scales; the largest projection dequantized before its matmul: {} in {dtype}, within the temporaries)",
            gb(p.nf4_bytes),
            gb(p.dequantized_bytes)
        );
    }
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
    comm.print();
    for g in &layouts {
        print_layout(&mesh, g);
    }
    Ok(())
}

/// A step's collectives placed on the nodes, and its compute time at the
/// target's peak to weigh them against.
struct Communication {
    nodes: i64,
    per_node: i64,
    /// Each mesh axis: name, size, where its groups lie.
    axes: Vec<(String, i64, Span)>,
    rows: Vec<PlacedTransfer>,
    /// Whether the target has link figures.
    links: bool,
    kind: &'static str,
    dtype: String,
    /// Datasheet peak of one device for the step's dtype, and the step's
    /// FLOPs over the mesh at it (None: no figure for the target).
    peak_tflops: Option<f64>,
    compute_ms: Option<f64>,
}

impl Communication {
    fn new(
        config: &hlo_engine::models::decoder::ModelConfig,
        tc: &hlo_engine::models::train::TrainConfig,
        mesh: &Mesh,
        nodes: i64,
        target: Target,
    ) -> Communication {
        let per_node = mesh.size() / nodes;
        let axes = mesh
            .axes()
            .iter()
            .enumerate()
            .map(|(i, (name, size))| (name.clone(), *size, axis_span(mesh, i, per_node)))
            .collect();
        let net = interconnect(target.kind());
        let rows = place(&step_traffic(config, tc, mesh), mesh, nodes, net);
        let peak_tflops = datasheet_tflops(target.kind(), tc.dtype);
        let compute_ms =
            peak_tflops.map(|p| step_flops(config, tc) / mesh.size() as f64 / (p * 1e12) * 1e3);
        Communication {
            nodes,
            per_node,
            axes,
            rows,
            links: net.is_some(),
            kind: target.kind(),
            dtype: tc.dtype.to_string(),
            peak_tflops,
            compute_ms,
        }
    }

    fn total_bytes(&self) -> f64 {
        self.rows.iter().map(|r| r.transfer.bytes_per_device).sum()
    }

    /// The rows' times added (None without link figures).
    fn total_ms(&self) -> Option<f64> {
        if !self.links {
            return None;
        }
        self.rows.iter().map(|r| r.ms).sum()
    }

    fn print(&self) {
        // Axes of one device have no groups to place.
        let axes: Vec<String> = self
            .axes
            .iter()
            .filter(|(_, size, _)| *size > 1)
            .map(|(a, size, span)| format!("{a}={size} {span}"))
            .collect();
        println!(
            "communication per step, per device ({} node{} × {} device{}{}{}):",
            self.nodes,
            if self.nodes == 1 { "" } else { "s" },
            self.per_node,
            if self.per_node == 1 { "" } else { "s" },
            if axes.is_empty() { "" } else { "; " },
            axes.join(", ")
        );
        if self.rows.is_empty() {
            println!("  none: no mesh axis of more than one device moves anything");
            return;
        }
        // Three significant figures or so, whatever the scale.
        let ms = |v: Option<f64>| match v {
            None => "n/a".to_string(),
            Some(m) if m >= 100.0 => format!("{m:.0}"),
            Some(m) if m >= 1.0 => format!("{m:.2}"),
            Some(m) => format!("{m:.4}"),
        };
        println!(
            "  {:<5} {:>4}  {:<14} {:>12}  {:<16} {:>9} {:>10}  what",
            "axis", "size", "collective", "bytes", "nodes", "link GB/s", "est. ms"
        );
        for r in &self.rows {
            let t = &r.transfer;
            println!(
                "  {:<5} {:>4}  {:<14} {:>12}  {:<16} {:>9} {:>10}  {} ({}×)",
                t.axis,
                t.axis_size,
                t.collective.to_string(),
                gb(t.bytes_per_device.round() as u64),
                r.span.to_string(),
                r.link_gbs.map_or("n/a".to_string(), |g| format!("{g:.1}")),
                ms(r.ms),
                t.what,
                t.count
            );
        }
        let against = match (self.compute_ms, self.peak_tflops) {
            (Some(c), Some(p)) => format!(
                ", against {} ms of compute (the step's FLOPs at the {}'s {} peak, {p:.0} TFLOP/s)",
                ms(Some(c)),
                self.kind,
                self.dtype
            ),
            _ => String::new(),
        };
        println!(
            "  total {} per device: {} ms at the links' peak{against}",
            gb(self.total_bytes().round() as u64),
            ms(self.total_ms())
        );
    }
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

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
