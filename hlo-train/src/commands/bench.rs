//! `hlo-train bench`: times the compiled train step on synthetic data
//! (weights made on the devices, so presets of any size need no host
//! memory; `--checkpoint` reads real weights instead) and prints the
//! engine's figures.

use anyhow::Result;
use clap::Args;
use hlo_engine::analysis::{bench, flops};
use hlo_engine::device::backend::Backend;
use hlo_engine::inputs::model::BaseSpec;
use hlo_engine::inputs::model::Model;
use hlo_engine::objectives::{Objective, ObjectiveSpecs};
use hlo_engine::partitioner::Mesh;
use hlo_engine::step::policy::Target;
use hlo_engine::step::{OptimSpec, StepSpec};
use hlo_engine::train::session::{Session, SessionOptions, Weights};
use serde::Serialize;

use crate::args::{gb, PluginArgs};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub recipe: crate::args::RecipeArgs,

    #[command(flatten)]
    pub base: BaseSpec,

    /// The step's loss, as `train --objective`: --batch counts the rows,
    /// pairs, unpaired examples or completions the objective reads; a
    /// reference model, where the objective has one, is the base with
    /// the adapter off. Only the step is timed (no rollouts).
    #[arg(long, value_parser = crate::args::named::<Objective>(), default_value = "sft")]
    pub objective: Objective,

    /// With an objective against a reference model: the reference's
    /// log-probabilities computed before training (`train
    /// --precompute-ref`): no reference forward in the step.
    #[arg(long)]
    pub precompute_ref: bool,

    #[command(flatten)]
    pub step: StepSpec,

    #[command(flatten)]
    pub optim: OptimSpec,

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
    #[arg(long, value_parser = crate::args::positive, allow_negative_numbers = true)]
    pub peak_tflops: Option<f64>,

    /// With an objective taught by a teacher: the teacher, a preset's
    /// name, an HF checkpoint folder or a config.json (random weights),
    /// run in the step.
    #[arg(long)]
    pub teacher: Option<String>,

    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let model = args
        .base
        .quantize
        .apply(Model::open(&args.base.model.source())?)?;
    // A reward model's step is a classifier's.
    let model = args.objective.model(model)?;
    let backend = Backend::open(&args.plugin.backend(args.mesh.as_ref()))?;
    let dtype = args.base.dtype.dtype(args.plugin.is_cpu());
    // A preference objective's step: `--batch` pairs, the reference the
    // base with the adapter off (a fresh adapter's).
    let objective = args.objective;
    let step = objective
        .def()
        .step_spec(&args.step, &ObjectiveSpecs::default())?;
    let target = Target::of_backend(&backend)?;
    let choices = step.policy(&model.config, dtype, backend.mesh(), &target)?;
    let mut tc = step.train_config(
        &args.optim,
        &model.config,
        dtype,
        backend.mesh(),
        args.warmup_steps + args.steps,
        &choices,
    )?;
    if !args.json {
        println!("{}", choices.line());
    }
    let reference = crate::objective_args::planned_reference(objective, args.precompute_ref)?;
    let teacher = match &args.teacher {
        Some(t) => Some(crate::objective_args::teacher_model(t)?),
        None => None,
    };
    let mut specs = ObjectiveSpecs::default().resolved(objective);
    specs.distill.teacher_config = teacher.as_ref().map(|t| Box::new(t.config.clone()));
    tc.loss = objective.def().loss(&specs, reference);
    let name = model.name.clone();
    let vocab = model.config.vocab_size;
    let mut session = Session::new(
        backend,
        model,
        tc.clone(),
        SessionOptions {
            weights: Weights::Synthetic,
            teacher,
            ..SessionOptions::default()
        },
    )?;
    let peak = flops::peak_flops(session.backend(), dtype, args.peak_tflops)?;
    let r = bench::bench(&mut session, args.warmup_steps, args.steps, peak)?;
    let backend = session.backend();
    let report = BenchReport {
        model: name,
        mesh: backend.mesh().to_string(),
        dtype: dtype.to_string(),
        mode: if tc.lora.is_some() { "lora" } else { "full" },
        objective: match args.precompute_ref {
            true => format!("{} (reference precomputed)", objective.name()),
            false => objective.name().to_string(),
        },
        batch: tc.batch,
        seq: tc.seq,
        scan_layers: tc.scan_layers,
        remat_layers: tc.remat_layers,
        attention: crate::args::AttentionSummary::of(&tc),
        choices: choices.line(),
        loss_chunk: tc.loss_chunk_for(vocab),
        long_context: tc.long_context_summary(vocab),
        tokens_per_s: r.tokens_per_s,
        step_time_s: r.step_time_s,
        steps: r.step_times.len(),
        mfu: r.mfu,
        peak_tflops: peak / 1e12,
        compile_s: session.compile_s(),
        peak_bytes: r.peak_bytes,
        platform: backend.platform()?,
        device: backend.devices()[0].kind()?,
    };
    match args.json {
        true => println!("{}", serde_json::to_string(&report)?),
        false => report.print(),
    }
    Ok(())
}

/// What `bench` measured, decided once: `--json` serializes it and the
/// text prints it.
#[derive(Serialize)]
struct BenchReport {
    model: String,
    mesh: String,
    dtype: String,
    /// What the step trains: `lora` or `full`.
    mode: &'static str,
    /// The objective, with `(reference precomputed)` where it is.
    objective: String,
    batch: i64,
    seq: i64,
    scan_layers: bool,
    remat_layers: bool,
    attention: crate::args::AttentionSummary,
    /// The step's `auto` choices and why.
    choices: String,
    loss_chunk: i64,
    /// The attention and loss in words.
    #[serde(skip)]
    long_context: String,
    tokens_per_s: f64,
    /// The median step's seconds.
    step_time_s: f64,
    /// Steps timed.
    #[serde(skip)]
    steps: usize,
    mfu: f64,
    peak_tflops: f64,
    compile_s: f64,
    peak_bytes: u64,
    platform: String,
    device: String,
}

impl BenchReport {
    fn print(&self) {
        println!(
            "{} {} {} on {} ({}): batch {} × seq {}, {}: median step {:.2} ms over {} steps, {:.0} tokens/s, MFU {:.1}%, compile {:.1}s, peak memory {} per device",
            self.model,
            self.mode,
            self.objective,
            self.mesh,
            self.device,
            self.batch,
            self.seq,
            self.long_context,
            self.step_time_s * 1e3,
            self.steps,
            self.tokens_per_s,
            self.mfu * 100.0,
            self.compile_s,
            gb(self.peak_bytes)
        );
    }
}
