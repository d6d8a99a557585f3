//! `hlo-train plan`: what the train step holds in each device's memory,
//! from a laptop, as the engine plans it (abstract parameters, compiled on
//! the CPU plugin with as many virtual devices as the mesh has), and what
//! it sends between devices at the target's link rates.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use hlo_engine::comm::{Span, StepCommunication};
use hlo_engine::hardware::{Device, Kind};
use hlo_engine::ir::DType;
use hlo_engine::models::train::TrainConfig;
use hlo_engine::partitioner::{draw_sharding, Mesh};
use hlo_engine::plan::{
    compute_estimate, layout_groups, plan, plan_mesh, ComputeEstimate, LayoutGroup, MemoryPlan,
};
use hlo_engine::{BackendOptions, Model};
use serde_json::{json, Value};

use crate::args::{gb, DtypeArgs, ModelArgs, OptimArgs, StepArgs};

/// The `--target` values: kinds of the engine's hardware table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    Mi300x,
    Mi250,
    H100,
    H200,
    A100,
    // A 24 GB consumer card (GeForce RTX 4090).
    Rtx4090,
    Cpu,
}

impl Target {
    /// The target's entry of the hardware table.
    fn device(self) -> &'static Device {
        match self {
            Target::Mi300x => Kind::Mi300x,
            Target::Mi250 => Kind::Mi250Gcd,
            Target::H100 => Kind::H100,
            Target::H200 => Kind::H200,
            Target::A100 => Kind::A100,
            Target::Rtx4090 => Kind::Rtx4090,
            Target::Cpu => Kind::Host,
        }
        .device()
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.device().label)
    }
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
    let mesh = plan_mesh(&options, args.step.batch)?;
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
    let (step, memory) = plan(config, &tc, &mesh)?;
    let device = args.target.device();
    let Some(capacity) = device.memory_bytes() else {
        bail!("cannot read the host's memory size from /proc/meminfo");
    };
    let report = Report {
        model: &model,
        comm: StepCommunication::new(config, &tc, &mesh, nodes, device.links()),
        compute: compute_estimate(config, &tc, &mesh, device),
        layouts: if args.show_sharding {
            layout_groups(&step)
        } else {
            Vec::new()
        },
        tc,
        mesh,
        dtype,
        memory,
        capacity,
        target: args.target,
    };
    if args.json {
        print_json(&report, args.show_sharding)
    } else {
        print_text(&report);
        Ok(())
    }
}

/// What `plan` prints, as the engine planned it.
struct Report<'a> {
    model: &'a Model,
    tc: TrainConfig,
    mesh: Mesh,
    dtype: DType,
    memory: MemoryPlan,
    /// Memory of one device of the target.
    capacity: u64,
    target: Target,
    comm: StepCommunication,
    /// The step's compute at the target's peak (None: no figure).
    compute: Option<ComputeEstimate>,
    /// With `--show-sharding`: each distinct layout of the state.
    layouts: Vec<LayoutGroup>,
}

impl Report<'_> {
    fn fits(&self) -> bool {
        self.memory.total_bytes <= self.capacity
    }

    /// XLA's figures (argument, output, aliased, temporary bytes).
    fn xla(&self) -> (u64, u64, u64, u64) {
        let x = &self.memory.xla;
        (
            x.argument_size_in_bytes.max(0) as u64,
            x.output_size_in_bytes.max(0) as u64,
            x.alias_size_in_bytes.max(0) as u64,
            x.temp_size_in_bytes.max(0) as u64,
        )
    }
}

/// The report as one JSON object (`layouts` only with `--show-sharding`).
fn print_json(r: &Report, show_sharding: bool) -> Result<()> {
    let (config, tc, p, comm) = (&r.model.config, &r.tc, &r.memory, &r.comm);
    let (arg, out, alias, temp) = r.xla();
    let mut v = json!({
        "model": r.model.name,
        "mesh": r.mesh.to_string(),
        "dtype": r.dtype.to_string(),
        "seq": tc.seq,
        "attention": crate::args::attention_json(tc),
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
        "device_memory_bytes": r.capacity,
        "fits": r.fits(),
        "compile_s": p.compile_s,
        "nodes": comm.nodes,
        "devices_per_node": comm.devices_per_node,
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
            "compute_ms": r.compute.map(|c| c.ms),
            "peak_tflops": r.compute.map(|c| c.peak_tflops),
        },
    });
    if show_sharding {
        v["layouts"] = r.layouts.iter().map(layout_json).collect();
    }
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

fn layout_json(g: &LayoutGroup) -> Value {
    json!({
        "spec": g.spec.to_string(),
        "shape": g.shape,
        "block": g.block,
        "dtype": g.dtype,
        "stacked_layers": g.stacked,
        "bytes_per_device_each": g.bytes_per_device,
        "tensors": g.tensors,
    })
}

/// The report as text: the step, its memory per device, its
/// communication, and with `--show-sharding` each layout.
fn print_text(r: &Report) {
    let (config, tc, p, dtype) = (&r.model.config, &r.tc, &r.memory, r.dtype);
    println!(
        "plan: {} ({} parameters, {dtype}{}), {} step, batch {} × seq {}, mesh {}{}, {}",
        r.model.name,
        config.parameter_count(),
        match config.quantization {
            Some(q) if q.double_quant => ", projections in NF4 with double quantization",
            Some(_) => ", projections in NF4",
            None => "",
        },
        if tc.lora.is_some() { "LoRA" } else { "full" },
        tc.batch,
        tc.seq,
        r.mesh,
        if tc.scan_layers {
            ", layers scanned (rematerialized per layer)"
        } else {
            ""
        },
        tc.long_context_summary(config.vocab_size)
    );
    let (arg, out, alias, temp) = r.xla();
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
        gb(r.capacity),
        r.target,
        if r.fits() { "fits" } else { "does NOT fit" }
    );
    println!(
        "compiled for {} in {:.1}s",
        match r.mesh.size() {
            1 => "1 CPU device".to_string(),
            n => format!("{n} virtual CPU devices"),
        },
        p.compile_s
    );
    print_communication(r);
    for g in &r.layouts {
        print_layout(&r.mesh, g);
    }
}

/// Three significant figures or so of milliseconds, whatever the scale.
fn ms(v: Option<f64>) -> String {
    match v {
        None => "n/a".to_string(),
        Some(m) if m >= 100.0 => format!("{m:.0}"),
        Some(m) if m >= 1.0 => format!("{m:.2}"),
        Some(m) => format!("{m:.4}"),
    }
}

/// The communication table: a row per kind of traffic, then the total
/// against the step's compute.
fn print_communication(r: &Report) {
    let comm = &r.comm;
    // Axes of one device have no groups to place.
    let axes: Vec<String> = comm
        .axes
        .iter()
        .filter(|(_, size, _)| *size > 1)
        .map(|(a, size, span)| format!("{a}={size} {span}"))
        .collect();
    let plural = |n: i64| if n == 1 { "" } else { "s" };
    println!(
        "communication per step, per device ({} node{} × {} device{}{}{}):",
        comm.nodes,
        plural(comm.nodes),
        comm.devices_per_node,
        plural(comm.devices_per_node),
        if axes.is_empty() { "" } else { "; " },
        axes.join(", ")
    );
    if comm.rows.is_empty() {
        println!("  none: no mesh axis of more than one device moves anything");
        return;
    }
    println!(
        "  {:<5} {:>4}  {:<14} {:>12}  {:<16} {:>9} {:>10}  what",
        "axis", "size", "collective", "bytes", "nodes", "link GB/s", "est. ms"
    );
    for row in &comm.rows {
        let t = &row.transfer;
        println!(
            "  {:<5} {:>4}  {:<14} {:>12}  {:<16} {:>9} {:>10}  {} ({}×)",
            t.axis,
            t.axis_size,
            t.collective.to_string(),
            gb(t.bytes_per_device.round() as u64),
            row.span.to_string(),
            row.link_gbs
                .map_or("n/a".to_string(), |g| format!("{g:.1}")),
            ms(row.ms),
            t.what,
            t.count
        );
    }
    let against = match r.compute {
        Some(c) => format!(
            ", against {} ms of compute (the step's FLOPs at the {}'s {} peak, {:.0} TFLOP/s)",
            ms(Some(c.ms)),
            r.target.device().name,
            r.tc.dtype,
            c.peak_tflops
        ),
        None => String::new(),
    };
    println!(
        "  total {} per device: {} ms at the links' peak{against}",
        gb(comm.total_bytes().round() as u64),
        ms(comm.total_ms())
    );
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
