//! `hlo-train plan`: what the train step holds in each device's memory,
//! from a laptop, as the engine plans it (abstract parameters, compiled on
//! the CPU plugin with as many virtual devices as the mesh has), and what
//! it sends between devices at the target's link rates.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use hlo_engine::analysis::comm::{Span, StepCommunication};
use hlo_engine::analysis::hardware::{Device, Kind};
use hlo_engine::analysis::plan::{
    compute_estimate, layout_groups, nearest_fits, Change, CompiledBy, ComputeEstimate, Found,
    LayoutGroup, MemoryPlan, Rechosen, RolloutShape, StepToPlan, Throughput, Tried,
};
use hlo_engine::device::backend::BackendOptions;
use hlo_engine::inputs::model::BaseSpec;
use hlo_engine::inputs::model::Model;
use hlo_engine::ir::DType;
use hlo_engine::models::attention::AttentionKind;
use hlo_engine::models::preference::Reference;
use hlo_engine::models::train::TrainConfig;
use hlo_engine::objectives::Objective;
use hlo_engine::partitioner::{draw_sharding, Mesh};
use hlo_engine::step::{OptimSpec, StepSpec};
use serde::Serialize;

use crate::args::gb;

/// The `--target` values: kinds of the engine's hardware table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    Mi300x,
    Mi325x,
    Mi250,
    /// One GCD of an MI250X (XLA's device: half the card).
    Mi250x,
    H100,
    H200,
    B200,
    A100,
    // A 24 GB consumer card (GeForce RTX 4090).
    Rtx4090,
    Cpu,
}

impl Target {
    /// The target's entry of the hardware table.
    pub fn device(self) -> &'static Device {
        match self {
            Target::Mi300x => Kind::Mi300x,
            Target::Mi325x => Kind::Mi325x,
            Target::Mi250 => Kind::Mi250Gcd,
            Target::Mi250x => Kind::Mi250xGcd,
            Target::H100 => Kind::H100,
            Target::H200 => Kind::H200,
            Target::B200 => Kind::B200,
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
    pub base: BaseSpec,

    /// The step's loss, as `train --objective`: --batch counts the rows,
    /// pairs (whose two sides a step holds), unpaired examples (each with
    /// its KL row) or completions the objective reads; a reference model,
    /// where the objective has one, adds its forward (the base with the
    /// adapter off), and over completions the rollouts that generate them
    /// are planned too, with a --teacher where the objective has one. A
    /// reward model's step is a classifier's.
    #[arg(long, value_parser = crate::args::named::<Objective>(), default_value = "sft")]
    pub objective: Objective,

    /// With an objective taught by a teacher: the teacher, a preset's
    /// name, an HF checkpoint folder or a config.json (its weights are planned beside the
    /// student's).
    #[arg(long)]
    pub teacher: Option<String>,

    /// With an objective over rollouts that rewards them: completions per
    /// prompt (--batch must be a multiple; the objective's default).
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..))]
    pub num_generations: Option<u32>,

    /// With an objective over rollouts: tokens a completion has at most
    /// (default 512, or half of --seq when that leaves no room); the rest
    /// of --seq is the prompt the rollouts prefill.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_completion_length: Option<u32>,

    /// With an objective against a reference model: the reference's
    /// log-probabilities computed before training (`train
    /// --precompute-ref`): no reference forward in the step.
    #[arg(long)]
    pub precompute_ref: bool,

    #[command(flatten)]
    pub step: StepSpec,

    #[command(flatten)]
    pub optim: OptimSpec,

    /// Device mesh (default: dp=1,fsdp=N,mp=1 over --devices; one device
    /// of the target without either).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// Devices of the target: must equal the mesh's size when both are
    /// given.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub devices: Option<u32>,

    /// The device the step is for.
    #[arg(long, value_enum, default_value = "mi300x")]
    pub target: Target,

    /// Plan for devices of this many GB (10^9 bytes) instead of the
    /// target's own memory: a card of another size, or room left for
    /// something else.
    #[arg(long, value_name = "GB", value_parser = device_memory)]
    pub device_memory: Option<f64>,

    /// When the step does not fit, skip the search for the nearest
    /// settings that do (each is compiled: seconds to minutes); it still
    /// exits 1.
    #[arg(long)]
    pub no_suggestions: bool,

    #[command(flatten)]
    pub compiler: hlo_engine::device::backend::CompilerSpec,

    /// How long plan may take in all, its search for settings that fit
    /// included (a compile started in time may end after it); a setting
    /// whose compile would end later is listed unplanned.
    #[arg(long, value_name = "S", default_value_t = 60.0, value_parser = search_seconds)]
    pub search_seconds: f64,

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

    /// The model FLOPs utilisation the throughput projection assumes (0
    /// to 1): the step's tokens/s at it, and the time to a compute-optimal
    /// budget of 20 tokens a parameter (Chinchilla). An assumption, not a
    /// measurement: `bench` measures MFU on the device.
    #[arg(long, default_value_t = 0.4, value_parser = crate::args::positive)]
    pub mfu: f64,
}

/// GB of one device's memory: a finite number above 0, at most a million.
fn device_memory(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(gb) if gb > 0.0 && gb <= 1e6 => Ok(gb),
        _ => Err("expected GB of memory, more than 0 and at most 1000000".into()),
    }
}

/// Plans the step and prints it; Ok(false) when it does not fit (the
/// nearest settings that do printed too), which exits 1.
pub fn run(args: &PlanArgs) -> Result<bool> {
    let started = std::time::Instant::now();
    let model = args
        .base
        .quantize
        .apply(Model::open(&args.base.model.source())?)?;
    // A reward model's step is a classifier's.
    let model = args.objective.model(model)?;
    let config = &model.config;
    let (mesh, nodes) = planned_mesh(args)?;
    let rollout = rollout_shape(args)?;
    let device = args.target.device();
    let (capacity, target) = capacity_and_target(args)?;
    let to_plan = step_to_plan(args, &model, &mesh, rollout, target)?;
    let (to_plan, step, memory, rechosen) = to_plan.plan_chosen()?;
    let tc = to_plan.train_config()?;
    let choices = to_plan.policy()?;
    let rechosen = rechosen.map(|r| rechosen_line_and_why(r, capacity));
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
        dtype: to_plan.dtype,
        memory,
        capacity,
        target: args.target,
        choices: rechosen
            .as_ref()
            .map_or_else(|| choices.line(), |(line, _)| line.clone()),
        estimate_bytes: choices.memory.map(|m| m.total()),
        stand_in_estimate_bytes: to_plan.stand_in_estimate()?,
        rechosen: rechosen.map(|(_, why)| why),
        args,
    };
    print_report(&report, &to_plan, started)
}

/// The mesh planned over (virtual CPU devices standing in for the
/// target's) and the node count, which must divide the mesh's devices
/// evenly.
fn planned_mesh(args: &PlanArgs) -> Result<(Mesh, i64)> {
    let options = BackendOptions {
        devices: args.devices,
        mesh: args.mesh.clone(),
        ..BackendOptions::cpu()
    };
    let mesh = options.mesh_or(None)?;
    let nodes = i64::from(args.nodes);
    if mesh.size() % nodes != 0 {
        bail!(
            "--nodes {nodes} does not divide the mesh {mesh}'s {} devices: each node must hold as many",
            mesh.size()
        );
    }
    Ok((mesh, nodes))
}

/// The step as the flags describe it, for the engine to plan (the
/// reference is read before the teacher, as their errors are reported).
fn step_to_plan(
    args: &PlanArgs,
    model: &Model,
    mesh: &Mesh,
    rollout: Option<RolloutShape>,
    target: hlo_engine::step::policy::Target,
) -> Result<StepToPlan> {
    let device = args.target.device();
    Ok(StepToPlan {
        config: model.config.clone(),
        name: model.name.clone(),
        spec: args.step.clone(),
        optim: args.optim.clone(),
        dtype: args.base.dtype.dtype(args.target == Target::Cpu),
        mesh: mesh.clone(),
        steps: 1000,
        objective: args.objective,
        // A fresh adapter's reference; a reference adapter adds only its
        // LoRA tensors.
        reference: crate::objective_args::planned_reference(args.objective, args.precompute_ref)?,
        rollout,
        teacher: match &args.teacher {
            Some(t) => Some(crate::objective_args::teacher_model(t)?.config),
            None => None,
        },
        target,
        compile_for: device.gpu_target_config().map(|_| device),
        xla_options: args.compiler.xla_options.clone(),
    })
}

/// The choices line of the form taken instead of the policy's first, and
/// why: the target's compiler found the first over the device's memory.
fn rechosen_line_and_why(r: Rechosen, capacity: u64) -> (String, String) {
    let why = format!(
        "XLA's figure for the policy's first form ({}) was {}, over {}: the policy's later forms were compiled in its order and the first that fits taken",
        r.first_form, gb(r.first_bytes), gb(capacity)
    );
    (r.line, why)
}

/// Prints the plan (JSON or text), searching nearby settings that fit when
/// it does not; returns whether it fits.
fn print_report(
    report: &Report,
    to_plan: &StepToPlan,
    started: std::time::Instant,
) -> Result<bool> {
    let fits = report.fits();
    let mut summary = Summary::of(report);
    if !report.args.json {
        print_text(&summary, report);
    }
    // The search's progress goes to stderr after the text's report.
    let found = match fits {
        true => None,
        false => Some(search(report, to_plan, started)?),
    };
    if let Some(found) = &found {
        summary.suggestions = suggestions(report, found);
    }
    match (report.args.json, &found) {
        (true, _) => println!("{}", serde_json::to_string_pretty(&summary)?),
        (false, Some(found)) => print_suggestions(&summary, report, found),
        (false, None) => {}
    }
    Ok(fits)
}

/// The memory of one device planned for (`--device-memory`, else the
/// target's), and the target the step's `auto` choices are decided for,
/// at that memory.
fn capacity_and_target(args: &PlanArgs) -> Result<(u64, hlo_engine::step::policy::Target)> {
    let device = args.target.device();
    let capacity = match args.device_memory {
        Some(gb) => (gb * 1e9) as u64,
        None => match device.memory_bytes() {
            Some(bytes) => bytes,
            None => bail!("cannot read the host's memory size from /proc/meminfo"),
        },
    };
    let mut target = hlo_engine::step::policy::Target::of_device(device);
    if args.device_memory.is_some() {
        target.memory_bytes = Some(capacity);
    }
    Ok((capacity, target))
}

/// The rollouts from the flags, checked: None for other objectives,
/// which take no such flag.
fn rollout_shape(args: &PlanArgs) -> Result<Option<RolloutShape>> {
    let grpo = args.objective.data() == hlo_engine::objectives::Data::Rollouts;
    let given = args.num_generations.is_some() || args.max_completion_length.is_some();
    if !grpo {
        if given {
            let mut over_rollouts: Vec<&str> = hlo_engine::objectives::OBJECTIVES
                .iter()
                .filter(|o| o.data() == hlo_engine::objectives::Data::Rollouts)
                .map(|o| o.name())
                .collect();
            let last = over_rollouts.pop().unwrap_or_default();
            bail!(
                "--num-generations and --max-completion-length are rollout settings; they need --objective {} or {last}",
                over_rollouts.join(", ")
            );
        }
        return Ok(None);
    }
    let g = num_generations(args) as i64;
    let c = match args.max_completion_length {
        Some(c) => i64::from(c),
        None => 512.min(args.step.seq / 2).max(1),
    };
    // What `train` refuses of these settings (whole groups a batch, ...).
    hlo_engine::run::spec::RunSpec {
        objective: args.objective,
        objectives: hlo_engine::objectives::ObjectiveSpecs {
            rollouts: hlo_engine::rollouts::RolloutSpec {
                num_generations: Some(g as usize),
                max_completion_length: c as usize,
                ..Default::default()
            },
            distill: hlo_engine::objectives::distill::DistillSpec {
                teacher: args.teacher.as_ref().map(std::path::PathBuf::from),
                teacher_config: None,
            },
            ..Default::default()
        },
        step: args.step.clone(),
        ..Default::default()
    }
    .check_objective_settings()?;
    // Distillation's rollouts: one completion a prompt.
    let g = match args
        .objective
        .def()
        .rollouts()
        .is_some_and(|r| r.rewarded())
    {
        true => g,
        false => 1,
    };
    if c >= args.step.seq {
        bail!(
            "--max-completion-length {c} leaves no room for a prompt in --seq {}",
            args.step.seq
        );
    }
    Ok(Some(RolloutShape {
        num_generations: g,
        max_completion_length: c,
    }))
}

/// `--search-seconds`: a positive, finite number of seconds.
fn search_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

/// The nearest settings that fit (none with `--no-suggestions`), each
/// plan's outcome on stderr as it ends; the search spends what is left of
/// `--search-seconds` since `started`.
fn search(r: &Report, to_plan: &StepToPlan, started: std::time::Instant) -> Result<Found> {
    if r.args.no_suggestions {
        return Ok(Found::default());
    }
    eprintln!("does not fit: planning nearby settings (each compiled)");
    let t0 = std::time::Instant::now();
    let mut plans = 0;
    let mut progress = |change: &Change, tried: Tried| {
        let outcome = match tried {
            Tried::Planned(Ok(p)) if p.total_bytes <= r.capacity => {
                format!("{}, fits", gb(p.total_bytes))
            }
            Tried::Planned(Ok(p)) => format!("{}, does not fit", gb(p.total_bytes)),
            Tried::Planned(Err(e)) => format!("cannot be planned: {e}"),
            Tried::OverBudget { expected_s } => format!(
                "not planned: its compile (about {expected_s:.0}s) would end past plan's {:.0}s (--search-seconds); plan it with these flags",
                r.args.search_seconds
            ),
        };
        if let Tried::Planned(_) = tried {
            plans += 1;
        }
        eprintln!(
            "  {}: {outcome} ({:.1}s)",
            flags(change, r.args),
            t0.elapsed().as_secs_f64()
        );
    };
    let budget = r.args.search_seconds - started.elapsed().as_secs_f64();
    let found = nearest_fits(to_plan, &r.memory, r.capacity, budget, &mut progress)?;
    eprintln!(
        "planned {plans} settings in {:.1}s; {} more ruled out uncompiled (even their least memory would not fit)",
        t0.elapsed().as_secs_f64(),
        found.ruled_out
    );
    Ok(found)
}

/// A change as the flags that make it, to paste over the command's own.
fn flags(change: &Change, args: &PlanArgs) -> String {
    match change {
        Change::Batch { batch, grad_accum } if *grad_accum == args.step.grad_accum => {
            format!("--batch {batch}")
        }
        Change::Batch { batch, grad_accum } => format!("--batch {batch} --grad-accum {grad_accum}"),
        Change::Seq(seq) => format!("--seq {seq}"),
        Change::RematLayers => "--remat layers".into(),
        Change::Nf4 => "--quantize nf4".into(),
        Change::Devices {
            mesh,
            batch,
            grad_accum,
        } => {
            // The flags that named the devices name them again.
            let mut f = Vec::new();
            if args.mesh.is_some() {
                f.push(format!("--mesh {mesh}"));
            }
            if args.mesh.is_none() || args.devices.is_some() {
                f.push(format!("--devices {}", mesh.size()));
            }
            if *batch != args.step.batch {
                f.push(format!("--batch {batch}"));
            }
            if *grad_accum != args.step.grad_accum {
                f.push(format!("--grad-accum {grad_accum}"));
            }
            f.join(" ")
        }
    }
}

/// Where the plan is for, in words: `one H100`, `each of 8 H100`.
fn where_planned(r: &Report) -> String {
    match r.mesh.size() {
        1 => format!("one {}", r.target),
        n => format!("each of {n} {}", r.target),
    }
}

/// The settings that fit, one a line, or that none does.
fn print_suggestions(s: &Summary, r: &Report, found: &Found) {
    let fits = &s.suggestions;
    println!(
        "does NOT fit on {} ({} of {}).",
        where_planned(r),
        gb(r.memory.total_bytes),
        gb(r.capacity)
    );
    if r.args.no_suggestions {
        return;
    }
    if fits.is_empty() && found.unplanned > 0 {
        println!(
            "None of the nearby settings planned fits; {} more were not planned for lack of time (their flags above: plan them one at a time).",
            found.unplanned
        );
        return;
    }
    if fits.is_empty() {
        println!("None of the nearby settings fits either (each planned or ruled out by its least memory, where it applies: smaller batches, shorter rows, --remat layers, --quantize nf4, up to {} devices).", hlo_engine::analysis::plan::MAX_SEARCH_DEVICES.max(8 * r.mesh.size()));
        return;
    }
    println!("Nearest settings that fit (each planned):");
    for f in fits {
        println!("  {:<40} {:>12}", f.flags, gb(f.total_bytes));
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
    /// The step's `auto` choices and why.
    choices: String,
    /// The policy's estimate of the step's bytes (None on the CPU).
    estimate_bytes: Option<u64>,
    /// The estimate of the blockwise stand-in compiled in place of
    /// cuDNN's attention (None where the step has none).
    stand_in_estimate_bytes: Option<u64>,
    /// Why the form planned is not the policy's first (the target's
    /// compiler found that one too large).
    rechosen: Option<String>,
    args: &'a PlanArgs,
}

impl Report<'_> {
    fn fits(&self) -> bool {
        self.memory.total_bytes <= self.capacity
    }
}

/// The settings that fit, as flags to paste over the command's own.
fn suggestions(r: &Report, found: &Found) -> Vec<Suggestion> {
    found
        .fits
        .iter()
        .map(|f| Suggestion {
            flags: flags(&f.change, r.args),
            total_bytes: f.total_bytes,
        })
        .collect()
}

/// A setting that fits when the step does not.
#[derive(Serialize)]
struct Suggestion {
    flags: String,
    total_bytes: u64,
}

/// A mesh axis and where its groups lie.
#[derive(Serialize)]
struct AxisSummary {
    axis: String,
    size: i64,
    /// `within`, `across` or `partly` a node.
    nodes: &'static str,
    /// Partly: the groups that cross nodes, of `groups`.
    groups_across: Option<i64>,
    groups: Option<i64>,
    /// Where the groups lie, in words.
    #[serde(skip)]
    placement: String,
}

/// A kind of traffic of the step, per device.
#[derive(Serialize)]
struct TransferSummary {
    axis: String,
    size: i64,
    collective: String,
    what: String,
    count: u64,
    bytes_per_device: u64,
    /// `within`, `across` or `partly` a node.
    nodes: &'static str,
    link_gb_per_s: Option<f64>,
    estimated_ms: Option<f64>,
    /// Where the axis's groups lie, in words.
    #[serde(skip)]
    placement: String,
}

/// The step's traffic in all, against its compute.
#[derive(Serialize)]
struct CommunicationTotal {
    bytes_per_device: u64,
    estimated_ms: Option<f64>,
    compute_ms: Option<f64>,
    peak_tflops: Option<f64>,
}

/// The step's throughput at the devices' peak and at the assumed MFU.
#[derive(Serialize)]
struct ThroughputSummary {
    tokens_per_step: i64,
    bound_tokens_per_s: f64,
    mfu_unoverlapped: Option<f64>,
    assumed_mfu: f64,
    tokens_per_s: f64,
    budget_tokens: f64,
    budget_hours: f64,
}

/// One layout of the step's state (`--show-sharding`).
#[derive(Serialize)]
struct LayoutSummary {
    spec: String,
    shape: Vec<i64>,
    block: Vec<i64>,
    dtype: String,
    stacked_layers: bool,
    bytes_per_device_each: u64,
    tensors: Vec<String>,
    /// The spec, for the drawing.
    #[serde(skip)]
    partition: hlo_engine::partitioner::PartitionSpec,
}

impl AxisSummary {
    fn of((axis, size, span): &(String, i64, Span)) -> AxisSummary {
        let (groups_across, groups) = match *span {
            Span::Partly { crossing, groups } => (Some(crossing), Some(groups)),
            _ => (None, None),
        };
        AxisSummary {
            axis: axis.clone(),
            size: *size,
            nodes: span.key(),
            groups_across,
            groups,
            placement: span.to_string(),
        }
    }
}

impl TransferSummary {
    fn of(row: &hlo_engine::analysis::comm::PlacedTransfer) -> TransferSummary {
        let t = &row.transfer;
        TransferSummary {
            axis: t.axis.clone(),
            size: t.axis_size,
            collective: t.collective.to_string(),
            what: t.what.clone(),
            count: t.count,
            bytes_per_device: t.bytes_per_device.round() as u64,
            nodes: row.span.key(),
            link_gb_per_s: row.link_gbs,
            estimated_ms: row.ms,
            placement: row.span.to_string(),
        }
    }
}

impl ThroughputSummary {
    fn of(t: &Throughput, mfu: f64) -> ThroughputSummary {
        ThroughputSummary {
            tokens_per_step: t.tokens_per_step,
            bound_tokens_per_s: t.bound_tokens_per_s(),
            mfu_unoverlapped: t.mfu_unoverlapped(),
            assumed_mfu: mfu,
            tokens_per_s: t.tokens_per_s(mfu),
            budget_tokens: t.budget_tokens,
            budget_hours: t.budget_hours(mfu),
        }
    }
}

impl LayoutSummary {
    fn of(g: &LayoutGroup) -> LayoutSummary {
        LayoutSummary {
            spec: g.spec.to_string(),
            shape: g.shape.clone(),
            block: g.block.clone(),
            dtype: g.dtype.clone(),
            stacked_layers: g.stacked,
            bytes_per_device_each: g.bytes_per_device,
            tensors: g.tensors.clone(),
            partition: g.spec.clone(),
        }
    }
}

/// What `plan` says of the step, its memory, communication and
/// throughput, decided once: the text prints it and `--json` serializes
/// it, so the two cannot disagree.
#[derive(Serialize)]
struct Summary {
    model: String,
    parameters: i64,
    mesh: String,
    dtype: String,
    /// `nf4`, `nf4 double quantized`, or None (no quantized projections).
    quantization: Option<&'static str>,
    seq: i64,
    /// The step's rows (a preference step's: its pairs' two sides).
    rows: i64,
    /// `--batch` in the objective's units (`4 pairs (8 rows)`).
    batch: String,
    objective: &'static str,
    /// What the step trains: `lora` or `full`.
    training: &'static str,
    /// The step's loss, where it is not the causal-LM loss.
    loss: Option<&'static str>,
    /// How the step has its reference model, where it has one in the
    /// step (GRPO's and RLOO's are scored outside it).
    reference: Option<ReferenceUse>,
    scan_layers: bool,
    attention: crate::args::AttentionSummary,
    remat_layers: bool,
    loss_chunk: i64,
    /// The attention and loss in words, as the text's `plan:` line ends.
    long_context: String,
    /// The step's `auto` choices and why.
    choices: String,
    per_device: PerDevice,
    /// GRPO, RLOO, distillation: what generating the rollouts holds.
    rollout: Option<RolloutSummary>,
    device_memory_bytes: u64,
    /// `--device-memory` gave the device's memory.
    device_memory_given: bool,
    fits: bool,
    compile_s: f64,
    /// Whose figures decided the fit: XLA's compiler for the target GPU,
    /// or the CPU plugin's compile standing in for it.
    compiled_by: CompiledBySummary,
    /// The step policy's estimate of the step's bytes a device (GPU
    /// targets), beside XLA's.
    policy_estimate_bytes: Option<u64>,
    /// The policy's estimate of what was compiled in place of cuDNN's
    /// attention (its blockwise stand-in), which XLA's figure is compared
    /// with; `policy_estimate_bytes` stays cuDNN's own.
    stand_in_estimate_bytes: Option<u64>,
    /// Why the form planned is not the policy's first choice.
    rechosen: Option<String>,
    /// The nearest settings that fit, when the step does not.
    suggestions: Vec<Suggestion>,
    nodes: i64,
    devices_per_node: i64,
    axes: Vec<AxisSummary>,
    communication: Vec<TransferSummary>,
    communication_total: CommunicationTotal,
    /// None: no compute figure for the target.
    #[serde(skip_serializing_if = "Option::is_none")]
    throughput: Option<ThroughputSummary>,
    /// With `--show-sharding`: each distinct layout of the state.
    #[serde(skip_serializing_if = "Option::is_none")]
    layouts: Option<Vec<LayoutSummary>>,
}

/// Which compiler's figures a plan trusts.
#[derive(Serialize)]
struct CompiledBySummary {
    /// `XLA's CUDA compiler for one H100`, or `the CPU plugin`.
    compiler: String,
    /// True: the target's own compiler, without a device (so nothing was
    /// autotuned).
    target_compiler: bool,
    /// Why the target's compiler did not compile it (not installed).
    fallback: Option<String>,
}

impl CompiledBySummary {
    fn of(by: &CompiledBy) -> CompiledBySummary {
        match by {
            CompiledBy::Target { compiler } => CompiledBySummary {
                compiler: compiler.clone(),
                target_compiler: true,
                fallback: None,
            },
            CompiledBy::Cpu { why } => CompiledBySummary {
                compiler: "the CPU plugin".into(),
                target_compiler: false,
                fallback: why.clone(),
            },
        }
    }
}

/// How a step has its reference model's log-probabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum ReferenceUse {
    /// The base with the adapter off, run in the step.
    Base,
    /// A frozen adapter, run in the step.
    Adapter,
    /// Computed before training: no reference forward in the step.
    Precomputed,
}

impl From<Reference> for ReferenceUse {
    fn from(r: Reference) -> ReferenceUse {
        match r {
            Reference::Base => ReferenceUse::Base,
            Reference::Adapter => ReferenceUse::Adapter,
            Reference::Precomputed => ReferenceUse::Precomputed,
        }
    }
}

/// Memory per device, as XLA and the plan count it.
#[derive(Serialize)]
struct PerDevice {
    weights_bytes: u64,
    nf4_weights_bytes: u64,
    dequantized_bytes: u64,
    lora_bytes: u64,
    optimizer_bytes: u64,
    xla: XlaBytes,
    total_bytes: u64,
}

/// XLA's figures for a compiled program.
#[derive(Serialize)]
struct XlaBytes {
    argument_bytes: u64,
    output_bytes: u64,
    alias_bytes: u64,
    temp_bytes: u64,
}

impl XlaBytes {
    fn of(x: &hlo_engine::runtime::CompiledMemoryStats) -> XlaBytes {
        XlaBytes {
            argument_bytes: x.argument_size_in_bytes.max(0) as u64,
            output_bytes: x.output_size_in_bytes.max(0) as u64,
            alias_bytes: x.alias_size_in_bytes.max(0) as u64,
            temp_bytes: x.temp_size_in_bytes.max(0) as u64,
        }
    }
}

/// The rollouts' memory: completions of up to `max_completion_length`
/// tokens after a prefill of `prompt_tokens` into a cache of
/// `cache_tokens`.
#[derive(Serialize)]
struct RolloutSummary {
    num_generations: usize,
    max_completion_length: i64,
    prompt_tokens: i64,
    cache_tokens: i64,
    cache_bytes: u64,
    xla: XlaBytes,
    total_bytes: u64,
    compile_s: f64,
}

impl Summary {
    fn of(r: &Report) -> Summary {
        let (config, tc, p) = (&r.model.config, &r.tc, &r.memory);
        let loss = tc.loss.step_loss();
        Summary {
            model: r.model.name.clone(),
            parameters: config.parameter_count(),
            mesh: r.mesh.to_string(),
            dtype: r.dtype.to_string(),
            quantization: config.quantization.map(|q| match q.double_quant {
                true => "nf4 double quantized",
                false => "nf4",
            }),
            seq: tc.seq,
            rows: tc.rows(),
            batch: batch_text(r),
            objective: r.args.objective.name(),
            training: if tc.lora.is_some() { "lora" } else { "full" },
            loss: loss.name(),
            reference: loss.reference().map(ReferenceUse::from),
            scan_layers: tc.scan_layers,
            attention: crate::args::AttentionSummary::of(tc),
            remat_layers: tc.remat_layers,
            loss_chunk: tc.loss_chunk_for(config.vocab_size),
            long_context: tc.long_context_summary(config.vocab_size),
            choices: r.choices.clone(),
            per_device: PerDevice {
                weights_bytes: p.weights_bytes,
                nf4_weights_bytes: p.nf4_bytes,
                dequantized_bytes: p.dequantized_bytes,
                lora_bytes: p.lora_bytes,
                optimizer_bytes: p.optimizer_bytes,
                xla: XlaBytes::of(&p.xla),
                total_bytes: p.total_bytes,
            },
            rollout: p.rollout.as_ref().map(|m| RolloutSummary {
                num_generations: num_generations(r.args),
                max_completion_length: m.completion_tokens,
                prompt_tokens: m.prompt_tokens,
                cache_tokens: m.cache_tokens,
                cache_bytes: m.cache_bytes,
                xla: XlaBytes::of(&m.xla),
                total_bytes: m.total_bytes,
                compile_s: m.compile_s,
            }),
            device_memory_bytes: r.capacity,
            device_memory_given: r.args.device_memory.is_some(),
            fits: r.fits(),
            compile_s: p.compile_s,
            compiled_by: CompiledBySummary::of(&p.compiled_by),
            policy_estimate_bytes: r.estimate_bytes,
            stand_in_estimate_bytes: r.stand_in_estimate_bytes,
            rechosen: r.rechosen.clone(),
            suggestions: Vec::new(),
            nodes: r.comm.nodes,
            devices_per_node: r.comm.devices_per_node,
            axes: r.comm.axes.iter().map(AxisSummary::of).collect(),
            communication: r.comm.rows.iter().map(TransferSummary::of).collect(),
            communication_total: CommunicationTotal {
                bytes_per_device: r.comm.total_bytes().round() as u64,
                estimated_ms: r.comm.total_ms(),
                compute_ms: r.compute.map(|c| c.ms),
                peak_tflops: r.compute.map(|c| c.peak_tflops),
            },
            throughput: throughput(r).map(|t| ThroughputSummary::of(&t, r.args.mfu)),
            layouts: r
                .args
                .show_sharding
                .then(|| r.layouts.iter().map(LayoutSummary::of).collect()),
        }
    }

    /// What the step trains and minimises: `LoRA` or `full`, then the
    /// loss's name with how it has its reference (nothing for the
    /// causal-LM loss).
    fn step_kind(&self) -> String {
        let reference = match self.reference {
            Some(ReferenceUse::Precomputed) => " (reference precomputed)",
            Some(ReferenceUse::Base | ReferenceUse::Adapter) => " (with the reference's forward)",
            None => "",
        };
        format!(
            "{}{}",
            match self.training {
                "lora" => "LoRA",
                other => other,
            },
            self.loss
                .map_or(String::new(), |n| format!(" {n}{reference}"))
        )
    }
}

/// The step's `auto` choices, and what the plan compiled in place of
/// cuDNN's attention, which the CPU plugin does not have.
fn print_choices(r: &Report) {
    println!("{}", r.choices);
    if r.tc.attention == AttentionKind::Cudnn {
        let why = match r.memory.compiled_by {
            CompiledBy::Target { .. } => "cuDNN's engines cannot be compiled without a GPU",
            CompiledBy::Cpu { .. } => "the CPU plugin that compiles the plan has no cuDNN",
        };
        println!(
            "  (cuDNN's attention planned as {}, which keeps a little more, each layer's queries in f32: {why})",
            hlo_engine::step::policy::attention_name(hlo_engine::analysis::plan::cudnn_stand_in(r.tc.seq))
        );
    }
}

/// The report as text: the step, its memory per device, its
/// communication, and with `--show-sharding` each layout.
fn print_text(summary: &Summary, r: &Report) {
    print_step(summary);
    print_choices(r);
    if r.args.mesh.is_none() && r.args.devices.is_none() {
        println!(
            "planned for one {} (no --mesh or --devices given); --devices N plans N",
            r.target
        );
    }
    print_memory(summary, r.target);
    print_compiled_by(summary, r);
    print_communication(summary, r);
    print_throughput(summary, r);
    for g in summary.layouts.iter().flatten() {
        print_layout(&r.mesh, g);
    }
}

/// Which compiler's figures the fit was decided by, the policy's estimate
/// beside them, and what to install for the target's own.
fn print_compiled_by(s: &Summary, r: &Report) {
    let by = &s.compiled_by;
    if by.target_compiler {
        println!(
            "compiled by {} in {:.1}s, without a device (nothing autotuned): the fit is decided by XLA's own figure for the {}",
            by.compiler, s.compile_s, r.target
        );
    } else {
        println!(
            "compiled for {} in {:.1}s",
            match r.mesh.size() {
                1 => "1 CPU device".to_string(),
                n => format!("{n} virtual CPU devices"),
            },
            s.compile_s
        );
        if let Some(why) = &by.fallback {
            println!(
                "  the fit is decided by the CPU compile standing in for the {} ({why}); its own compiler gives its own figure",
                r.target
            );
        }
    }
    let xla = s.per_device.total_bytes as f64;
    let off = |e: u64| (e as f64 - xla) / xla.max(1.0) * 100.0;
    match (s.policy_estimate_bytes, s.stand_in_estimate_bytes) {
        (Some(e), Some(compiled)) => println!(
            "  the step policy estimated {} for cuDNN's attention, and {} for the blockwise stand-in compiled ({:+.0}% from XLA's {})",
            gb(e),
            gb(compiled),
            off(compiled),
            gb(s.per_device.total_bytes)
        ),
        (Some(e), None) => println!(
            "  the step policy estimated {} ({:+.0}% from XLA's {})",
            gb(e),
            off(e),
            gb(s.per_device.total_bytes)
        ),
        _ => {}
    }
    if let Some(why) = &s.rechosen {
        println!("  {why}");
    }
}

/// The step's batch in the objective's units: rows, preference pairs, or
/// GRPO completions of `num_generations` a prompt.
fn batch_text(r: &Report) -> String {
    let mut specs = hlo_engine::objectives::ObjectiveSpecs::default();
    specs.rollouts.num_generations = Some(num_generations(r.args));
    r.args.objective.def().batch_words(&specs, r.tc.batch)
}

/// Completions per prompt: given, or the objective's default.
fn num_generations(args: &PlanArgs) -> usize {
    let default = args.objective.def().rollout_defaults().num_generations;
    args.num_generations.map_or(default, |n| n as usize)
}

/// The `plan:` line: the model, the step and its batch, the mesh, the
/// layers' scan and the long-context settings.
fn print_step(s: &Summary) {
    println!(
        "plan: {} ({} parameters, {}{}), {} step, batch {} × seq {}, mesh {}{}, {}",
        s.model,
        s.parameters,
        s.dtype,
        match s.quantization {
            Some("nf4") => ", projections in NF4",
            Some(_) => ", projections in NF4 with double quantization",
            None => "",
        },
        s.step_kind(),
        s.batch,
        s.seq,
        s.mesh,
        if s.scan_layers {
            ", layers scanned (rematerialized per layer)"
        } else {
            ""
        },
        s.long_context
    );
}

/// Memory per device: the weights (NF4's share), LoRA, optimizer state,
/// XLA's arguments, outputs and temporaries, the rollouts', and the total
/// against the device's memory.
fn print_memory(s: &Summary, target: Target) {
    let (p, x) = (&s.per_device, &s.per_device.xla);
    println!("per device:");
    println!("  weights            {:>12}", gb(p.weights_bytes));
    if p.nf4_weights_bytes > 0 {
        println!(
            "    of which NF4     {:>12}  (codes and block scales; the largest projection dequantized before its matmul: {} in {}, within the temporaries)",
            gb(p.nf4_weights_bytes),
            gb(p.dequantized_bytes),
            s.dtype
        );
    }
    println!("  LoRA parameters    {:>12}", gb(p.lora_bytes));
    println!("  optimizer state    {:>12}", gb(p.optimizer_bytes));
    println!("  XLA arguments      {:>12}", gb(x.argument_bytes));
    println!(
        "  XLA outputs        {:>12}  ({} reuse donated arguments)",
        gb(x.output_bytes),
        gb(x.alias_bytes)
    );
    println!("  XLA temporaries    {:>12}", gb(x.temp_bytes));
    if let Some(m) = &s.rollout {
        println!(
            "  rollouts           {:>12}  (completions of up to {} tokens: a prefill of {} prompt tokens a row into a cache of {}: cache {}, temporaries {}; with the weights, adapter and idle optimizer state)",
            gb(m.total_bytes),
            m.max_completion_length,
            m.prompt_tokens,
            m.cache_tokens,
            gb(m.cache_bytes),
            gb(m.xla.temp_bytes)
        );
    }
    println!(
        "  total              {:>12}  {}of {}{} on {}: {}",
        gb(p.total_bytes),
        if s.rollout.is_some() {
            "(the step's or the rollouts', the larger) "
        } else {
            ""
        },
        gb(s.device_memory_bytes),
        if s.device_memory_given {
            " (--device-memory)"
        } else {
            ""
        },
        target,
        if s.fits { "fits" } else { "does NOT fit" }
    );
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
fn print_communication(s: &Summary, r: &Report) {
    // Axes of one device have no groups to place.
    let axes: Vec<String> = s
        .axes
        .iter()
        .filter(|a| a.size > 1)
        .map(|a| format!("{}={} {}", a.axis, a.size, a.placement))
        .collect();
    let plural = |n: i64| if n == 1 { "" } else { "s" };
    println!(
        "communication per step, per device ({} node{} × {} device{}{}{}):",
        s.nodes,
        plural(s.nodes),
        s.devices_per_node,
        plural(s.devices_per_node),
        if axes.is_empty() { "" } else { "; " },
        axes.join(", ")
    );
    if s.communication.is_empty() {
        println!("  none: no mesh axis of more than one device moves anything");
        return;
    }
    println!(
        "  {:<5} {:>4}  {:<14} {:>12}  {:<16} {:>9} {:>10}  what",
        "axis", "size", "collective", "bytes", "nodes", "link GB/s", "est. ms"
    );
    for t in &s.communication {
        println!(
            "  {:<5} {:>4}  {:<14} {:>12}  {:<16} {:>9} {:>10}  {} ({}×)",
            t.axis,
            t.size,
            t.collective,
            gb(t.bytes_per_device),
            t.placement,
            t.link_gb_per_s
                .map_or("n/a".to_string(), |g| format!("{g:.1}")),
            ms(t.estimated_ms),
            t.what,
            t.count
        );
    }
    let total = &s.communication_total;
    let against = match (total.compute_ms, total.peak_tflops) {
        (Some(c), Some(peak)) => format!(
            ", against {} ms of compute (the step's FLOPs at the {}'s {} peak, {peak:.0} TFLOP/s)",
            ms(Some(c)),
            r.target.device().name,
            s.dtype,
        ),
        _ => String::new(),
    };
    println!(
        "  total {} per device: {} ms at the links' peak{against}",
        gb(total.bytes_per_device),
        ms(total.estimated_ms)
    );
}

/// The step's throughput: the bound at the devices' peak, and at the
/// assumed MFU with the time to a compute-optimal budget.
fn throughput(r: &Report) -> Option<Throughput> {
    let c = r.compute?;
    let tokens = r.tc.batch * r.tc.grad_accum * r.tc.seq;
    Some(Throughput::of(
        r.model.config.parameter_count(),
        tokens,
        c,
        r.comm.total_ms(),
    ))
}

fn print_throughput(s: &Summary, r: &Report) {
    let Some(t) = &s.throughput else {
        return;
    };
    let devices = format!("{} × {}", r.mesh.size(), r.target.device().name);
    let unoverlapped = match t.mfu_unoverlapped {
        Some(u) => format!(
            "; {:.0}% MFU left if communication is not overlapped",
            100.0 * u
        ),
        None => String::new(),
    };
    println!(
        "throughput ({} tokens a step): at most {:.0} tokens/s ({devices} at their peak){unoverlapped}",
        t.tokens_per_step, t.bound_tokens_per_s,
    );
    println!(
        "  at {:.0}% MFU (--mfu, assumed): {:.0} tokens/s; 20 tokens a parameter ({:.1}B tokens) in {}",
        100.0 * t.assumed_mfu,
        t.tokens_per_s,
        t.budget_tokens / 1e9,
        duration(t.budget_hours)
    );
}

/// Hours as hours or days.
fn duration(hours: f64) -> String {
    if hours < 48.0 {
        format!("{hours:.1} h")
    } else {
        format!("{:.1} days", hours / 24.0)
    }
}

/// Shows a layout: spec, shapes, bytes, the tensors sharing it, and a
/// drawing of one layer's blocks over the mesh.
fn print_layout(mesh: &Mesh, g: &LayoutSummary) {
    let dims = |d: &[i64]| d.iter().map(i64::to_string).collect::<Vec<_>>().join(" × ");
    let n = g.tensors.len();
    println!(
        "\n{} {} [{}]{} → per device [{}], {} each, {} for {n} tensor{}",
        g.spec,
        g.dtype,
        dims(&g.shape),
        if g.stacked_layers {
            " (layers stacked)"
        } else {
            ""
        },
        dims(&g.block),
        gb(g.bytes_per_device_each),
        gb(g.bytes_per_device_each * n as u64),
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
    let skip = usize::from(g.stacked_layers);
    let spec =
        hlo_engine::partitioner::PartitionSpec(g.partition.0.iter().skip(skip).cloned().collect());
    if g.shape.len() > skip {
        print!("{}", draw_sharding(mesh, &spec, &g.shape[skip..]));
    }
}
