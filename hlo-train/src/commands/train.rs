//! `hlo-train train`: reads the flags and data, asks the engine for a
//! session and a trainer, and prints what they report (a header, a
//! progress bar with moving averages, log lines, the metrics file).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use hlo_engine::inputs::dataset::DataSource;
use hlo_engine::inputs::model::{BaseSpec, TokenizerSpec};
use hlo_engine::objectives::{Data, ObjectiveSpecs};
use hlo_engine::partitioner::Mesh;
use hlo_engine::run::spec::{Chosen, EvalSpec, OutputSpec, ReportSpec, RunSpec, TrainingSpec};
use hlo_engine::run::Run;
use hlo_engine::runtime::Mode;
use hlo_engine::step::{OptimSpec, StepSpec};
use hlo_engine::train::hooks::{HookList, TrainSummary};
use hlo_engine::train::trainer::StopFlag;
use hlo_report::{EventWriter, LossCurves};
use indicatif::ProgressBar;

use crate::args::PluginArgs;
use crate::commands::dump_hlo::{self, Format};
use crate::console::{demo_show, print_header, Progress, RewardCourse};
use crate::outputs::{LossChart, MetricsFile, RecipeFile, TensorBoard};

#[derive(Args, Clone, Debug)]
// An adapter to start from, or every weight trained: not both.
#[command(group(clap::ArgGroup::new("start").args(["init_adapter", "full"])))]
pub struct TrainArgs {
    #[command(flatten)]
    pub recipe: crate::args::RecipeArgs,

    #[command(flatten)]
    pub base: BaseSpec,

    #[command(flatten)]
    pub tokenizer: TokenizerSpec,

    #[command(flatten)]
    pub plugin: PluginArgs,

    #[command(flatten)]
    pub training: TrainingSpec,

    // Each objective's own settings, declared once in its spec.
    #[command(flatten)]
    pub objectives: ObjectiveSpecs,

    #[command(flatten)]
    pub step: StepSpec,

    #[command(flatten)]
    pub optim: OptimSpec,

    /// Device mesh, e.g. dp=2,fsdp=4,mp=1; its product is the device count
    /// (default dp=1,fsdp=N,mp=1 over --devices).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// Compile the whole step as one executable (the default).
    #[arg(long, conflicts_with = "eager")]
    pub jit: bool,

    /// Run the step op by op: each node a small cached executable, values
    /// freed after their last use (for debugging and inspection).
    #[arg(long)]
    pub eager: bool,

    /// With --eager: print shape, dtype, min/max/mean and non-finite count
    /// of every value made in scopes matching this regex (first step only).
    #[arg(long, requires = "eager")]
    pub trace_values: Option<String>,

    #[command(flatten)]
    pub data: DataSource,

    /// Where the adapter (or a complete HF model folder with --full) and
    /// train_state/ go (default with --resume: the resumed folder).
    /// train_state/ is sharded: each process writes what its devices hold,
    /// and --resume restores it onto any mesh or process count.
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// Replace the run an --out folder already holds.
    #[arg(long)]
    pub overwrite: bool,

    /// Load the train step `hlo-train compile` wrote (with the same step
    /// flags, for these devices) instead of compiling it; refused in one
    /// line unless it is this run's step, for these devices, by this
    /// plugin build.
    #[arg(long, value_name = "FILE")]
    pub executable: Option<PathBuf>,

    /// Continue the run saved in this folder with every setting it was
    /// saved with (a flag given again must agree; --steps may extend a
    /// constant schedule; --metrics, --tensorboard, --eval-data,
    /// --eval-every, --log-every and --save-every replace the saved ones).
    #[arg(long)]
    pub resume: Option<PathBuf>,

    /// Write the compiled step as StableHLO and HLO text here.
    #[arg(long)]
    pub dump_hlo: Option<PathBuf>,

    #[command(flatten)]
    pub eval: EvalSpec,

    #[command(flatten)]
    pub report: ReportSpec,

    /// The devices' peak TFLOP/s for MFU (default: a table by device kind;
    /// measured for CPUs).
    #[arg(long, value_parser = crate::args::positive, allow_negative_numbers = true)]
    pub peak_tflops: Option<f64>,
}

impl TrainArgs {
    /// Each objective's settings, as the run's objective takes them (β
    /// and the completions per prompt its defaults where not given).
    pub fn objective_specs(&self) -> ObjectiveSpecs {
        self.objectives.clone().resolved(self.training.objective)
    }
}

/// The engine's run of these flags; `given` (clap ids) are the settings
/// the command line chose, which a resumed run must agree with.
pub(crate) fn spec(args: &TrainArgs, given: &BTreeSet<String>) -> RunSpec {
    let mut spec = RunSpec {
        model: args.base.model.source(),
        tokenizer: args.tokenizer.tokenizer.clone(),
        quantize: args.base.quantize.nf4(),
        dtype: args.base.dtype.dtype,
        data: args.data.clone(),
        objectives: args.objective_specs(),
        step: args.step.clone(),
        optim: args.optim.clone(),
        backend: args.plugin.backend(args.mesh.as_ref()),
        mode: if args.eager { Mode::Eager } else { Mode::Jit },
        eval: args.eval.clone(),
        output: OutputSpec {
            out: args.out.clone(),
            overwrite: args.overwrite,
            resume: args.resume.clone(),
        },
        report: args.report.clone(),
        trace_values: args.trace_values.clone(),
        peak_tflops: args.peak_tflops,
        chosen: Chosen::Only(given.iter().map(|id| id.replace('_', "-")).collect()),
        executable: args.executable.clone(),
        compile_for: None,
        ..RunSpec::default()
    };
    spec.set_training(args.training.clone());
    spec
}

/// The run's name for TensorBoard: its `--out` folder's name, else when it
/// started (and which process ran it).
fn run_name(out: Option<&std::path::Path>) -> String {
    match out.and_then(|o| o.file_name()) {
        Some(name) => name.to_string_lossy().into_owned(),
        None => {
            let seconds = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            format!("run-{seconds}-{}", std::process::id())
        }
    }
}

/// What the run shows and writes, on process 0: progress, the metrics
/// file, TensorBoard, the loss chart and the recipe (a resumed run's as it
/// was saved, unless given anew).
/// Also returns the progress bar, to abandon when the run fails.
fn hooks(run: &Run, argv: &[OsString]) -> Result<(HookList, ProgressBar, RewardCourse)> {
    let report = &run.spec().report;
    let log_every = report.log_every;
    let mut hooks = HookList::default();
    let progress = Progress::new(run.spec().steps, run.session().steps_done(), log_every);
    let bar = progress.bar.clone();
    hooks.add("progress", progress);
    let course = RewardCourse::default();
    let rewarded =
        |o: hlo_engine::objectives::Objective| o.def().rollouts().is_some_and(|r| r.rewarded());
    if rewarded(run.spec().objective) {
        hooks.add("reward-course", course.clone());
    }
    if let Some(path) = &report.metrics {
        hooks.add("metrics", MetricsFile::open(path, run.resumed())?);
    }
    if let Some(dir) = &report.tensorboard {
        // Each run its own folder, as TensorBoard lists runs (a resumed
        // run continues its own).
        let dir = dir.join(run_name(run.out()));
        let writer = EventWriter::create(&dir)?;
        println!("tensorboard: this run writes {}", dir.display());
        hooks.add("tensorboard", TensorBoard { writer, log_every });
    }
    if let Some(out) = run.out() {
        hooks.add(
            "loss-chart",
            LossChart {
                out: out.to_path_buf(),
                metrics: report.metrics.clone(),
                title: format!("{}: loss", run.session().model().name),
                curves: LossCurves::default(),
                rewards: rewarded(run.spec().objective),
            },
        );
        let command = TrainArgs::augment_args(clap::Command::new("train"));
        hooks.add("recipe", RecipeFile::new(command, argv)?);
    }
    Ok((hooks, bar, course))
}

pub fn run(args: TrainArgs, given: &BTreeSet<String>, argv: &[OsString]) -> Result<()> {
    // What the seconds before the header are (shown on a terminal only).
    let starting = ProgressBar::new_spinner();
    starting.set_message("reading the model and the data, tracing and compiling the step");
    starting.enable_steady_tick(std::time::Duration::from_millis(200));
    let run = Run::new(spec(&args, given));
    starting.finish_and_clear();
    let mut run = run?.with_stop(StopFlag::on_signals());
    let main = run.is_main();
    if let Some(dir) = args.dump_hlo.as_ref().filter(|_| main) {
        dump_hlo::write_texts(
            dir,
            "train_step",
            run.session().sharded_step(),
            Format::Both,
        )?;
    }
    // The demo shows the adapter's completions before and after training,
    // in one process (generation is not built across processes).
    let spec = run.spec();
    // (A preference objective's demo shows its held-out figures instead.)
    let demo = main
        && spec.data.path.is_none()
        && spec.objectives.rollouts.rollouts.is_none()
        && !spec.objective.is_preference()
        && !spec.step.full
        && spec.backend.launch.is_none();
    let show = |label: &str, run: &Run| -> Result<()> {
        match run.tokenizer().filter(|_| demo) {
            Some(t) => {
                let session = run.session();
                demo_show(
                    label,
                    session,
                    t,
                    session.adapter()?.as_ref(),
                    run.spec().seed,
                )
            }
            None => Ok(()),
        }
    };
    show("before", &run)?;
    if !main {
        run.train(&mut hlo_engine::train::hooks::Quiet)?;
        return Ok(());
    }
    if let Some(line) = run.lock_note() {
        println!("{line}");
    }
    print_header(&run)?;
    println!("{}", run.choices());
    if let Some(restored) = run.restored() {
        println!("{}", crate::console::resumed_line(restored));
    }
    let (mut hooks, bar, course) = hooks(&run, argv)?;
    let summary = run.train(&mut hooks).inspect_err(|_| bar.abandon())?;
    print_summary(&run, &summary, &course);
    if let Some(out) = run
        .out()
        .filter(|_| summary.interrupted && summary.saved_step.is_none())
    {
        // Exit 0 only where a --resume has a state to continue.
        bail!(
            "stopped by a signal before any step was saved: {} holds no state to --resume; run again from the start",
            out.display()
        );
    }
    show("after", &run)
}

/// The lines after a run: where it was saved (or that nothing was), how
/// the loss went (and GRPO's reward), packing, memory.
fn print_summary(run: &Run, summary: &TrainSummary, course: &RewardCourse) {
    let session = run.session();
    if summary.interrupted {
        match (run.out(), summary.saved_step) {
            (Some(out), Some(kept)) => println!(
                "stopped by a signal after step {}; saved to {} (step {kept}; continue with --resume {})",
                summary.step,
                out.display(),
                out.display()
            ),
            (Some(_), None) => {}
            (None, _) => println!(
                "stopped by a signal after step {} (nothing saved: no --out)",
                summary.step
            ),
        }
        return;
    }
    if let Some(out) = run.out() {
        println!(
            "saved {} and train_state/ (step {}) to {}",
            if run.spec().step.full {
                "an HF model folder"
            } else {
                "the PEFT adapter"
            },
            summary.step,
            out.display()
        );
    } else {
        println!(
            "nothing saved (no --out): what was trained ends with this process; give --out DIR to keep it"
        );
    }
    if let Some(line) = course.line(summary.step) {
        println!("{line}");
    }
    if let (Some(first), Some(last)) = (summary.first_loss, summary.last_loss) {
        let from = summary.step - summary.steps_run;
        println!(
            "loss {first:.4} -> {last:.4} over steps {}..{} ({} steps)",
            from + 1,
            summary.step,
            summary.steps_run
        );
    }
    // GRPO's rows are its rollouts, never packed.
    if let Some(fill) = summary
        .fill
        .filter(|_| run.spec().objective.data() != Data::Rollouts)
    {
        println!(
            "packing {}: {:.1}% of the slots hold real tokens ({:.1}% unpacked)",
            if session.config().packing {
                "on"
            } else {
                "off"
            },
            100.0 * fill,
            100.0 * run.unpacked_fill()
        );
    }
    print_step_stats(run);
}

/// The compiled step's memory, or the eager op cache's figures.
fn print_step_stats(run: &Run) {
    let session = run.session();
    if let Ok(Some(m)) = session.compiled_memory_stats() {
        println!(
            "jit: compiled memory per device: arguments {:.1} MB, outputs {:.1} MB (aliased {:.1} MB), temporaries {:.1} MB",
            m.argument_size_in_bytes as f64 / 1e6,
            m.output_size_in_bytes as f64 / 1e6,
            m.alias_size_in_bytes as f64 / 1e6,
            m.temp_size_in_bytes as f64 / 1e6
        );
    }
    if let Some(s) = session.eager_stats() {
        println!(
            "eager: {} one-op programs, op cache hit rate {:.1}% ({} hits, {} compiles), peak live intermediates {:.1} MB of {:.1} MB made per step",
            s.programs,
            s.hit_rate() * 100.0,
            s.hits,
            s.misses,
            s.peak_live_bytes as f64 / 1e6,
            s.intermediate_bytes as f64 / 1e6
        );
    }
}
