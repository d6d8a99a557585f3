//! `hlo-train train`: reads the flags and data, asks the engine for a
//! session and a trainer, and prints what they report (a header, a
//! progress bar with moving averages, log lines, the metrics file).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use hlo_engine::models::grpo::{GrpoLossType, ScaleRewards};
use hlo_engine::partitioner::Mesh;
use hlo_engine::{
    Chosen, DataSource, EvalSpec, GrpoSpec, HookList, Mode, Objective, OutputSpec, PreferenceSpec,
    ReportSpec, Run, RunSpec, StopFlag, TrainSummary,
};
use hlo_report::{EventWriter, LossCurves};
use indicatif::ProgressBar;

use crate::args::{
    named, ChatArgs, DtypeArgs, ModelArgs, OptimArgs, PluginArgs, StepArgs, TokenizerArgs,
};
use crate::console::{demo_show, print_header, Progress, RewardCourse};
use crate::dump_hlo::{self, Format};
use crate::outputs::{LossChart, MetricsFile, RecipeFile, TensorBoard};

#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub recipe: crate::args::RecipeArgs,

    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub quantize: crate::args::QuantizeArgs,

    #[command(flatten)]
    pub dtype: DtypeArgs,

    #[command(flatten)]
    pub tokenizer: TokenizerArgs,

    #[command(flatten)]
    pub chat: ChatArgs,

    #[command(flatten)]
    pub plugin: PluginArgs,

    /// What the run's loss is: sft, the causal-LM loss on the data's
    /// learned tokens (supervised finetuning); or a preference method over
    /// pairs of chosen and rejected completions, as TRL 1.16 computes it:
    /// dpo (DPOTrainer's sigmoid loss), ipo, simpo (CPOTrainer's) or orpo
    /// (ORPOTrainer's). With pairs, --batch counts pairs. Or grpo
    /// (GRPOTrainer's): online RL over prompts, the policy generating its
    /// own completions, scored by --reward; --batch counts completions.
    #[arg(long, value_parser = named::<Objective>(), default_value = "sft")]
    pub objective: Objective,

    #[command(flatten)]
    pub preference: crate::args::PreferenceArgs,

    /// DPO and IPO: compute the reference's log-probabilities of every
    /// pair once before training, so the step runs no reference forward
    /// and the reference holds no device memory while training (and full
    /// finetuning has a reference: the base as it starts).
    #[arg(long)]
    pub precompute_ref: bool,

    /// GRPO: completions per prompt, one group (TRL's num_generations).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(2..))]
    pub num_generations: u32,

    /// GRPO: the importance ratio is clipped to [1 − ε, 1 + ε_high].
    #[arg(long, default_value_t = 0.2, value_parser = crate::args::non_negative)]
    pub epsilon: f64,

    /// GRPO: the upper clip ε_high (default: --epsilon; DAPO uses 0.28).
    #[arg(long, value_parser = crate::args::non_negative)]
    pub epsilon_high: Option<f64>,

    /// GRPO: steps trained on each batch of rollouts (μ), against the
    /// policy's log-probabilities from when they were made.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub num_iterations: u32,

    /// GRPO: how rewards become advantages: less the group's mean, over
    /// the group's standard deviation (group), the batch's (batch), or
    /// not scaled (none).
    #[arg(long, value_parser = named::<ScaleRewards>(), default_value = "group")]
    pub scale_rewards: ScaleRewards,

    /// GRPO: how the per-token losses are pooled, as TRL's loss_type.
    #[arg(long, value_parser = named::<GrpoLossType>(), default_value = "dapo")]
    pub loss_type: GrpoLossType,

    /// GRPO: tokens a completion has at most.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_completion_length: u32,

    /// GRPO: the sampling temperature (the loss divides the logits by it
    /// too, as TRL does).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::positive)]
    pub temperature: f64,

    /// GRPO: sample from the smallest set of tokens with this much
    /// probability (1: all).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::positive)]
    pub top_p: f64,

    /// GRPO: sample from the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,

    /// GRPO: a reward, NAME or NAME:WEIGHT, repeatable (summed with their
    /// weights): accuracy (the completion's final answer, its last
    /// \boxed{} or number or word, equals the row's --answer-column),
    /// format (matches --format-regex), length (−tokens/max), command
    /// (--reward-command's answer), http (--reward-url's).
    #[arg(long)]
    pub reward: Vec<hlo_engine::grpo::RewardSpec>,

    /// GRPO: train on logged rollouts, one JSON object a line
    /// {"prompt_ids", "completion_ids", "reward"} (consecutive lines of a
    /// prompt form its group), instead of generating.
    #[arg(long, conflicts_with = "data")]
    pub rollouts: Option<PathBuf>,

    /// GRPO: the weights of the named rewards logged rollouts give as
    /// {"rewards": {NAME: value, ...}}: NAME:WEIGHT for each, comma
    /// separated (TRL's reward_weights; default: each 1). The advantage is
    /// of their weighted sum.
    #[arg(long, value_delimiter = ',')]
    pub reward_weights: Vec<hlo_engine::grpo::RewardWeight>,

    /// GRPO: the prompts' column --reward accuracy compares with.
    #[arg(long, default_value = "answer")]
    pub answer_column: String,

    /// GRPO: the regular expression --reward format looks for.
    #[arg(long)]
    pub format_regex: Option<String>,

    /// GRPO: the command --reward command starts once (by `sh -c`); it
    /// reads one JSON object per line (prompt, completion, their ids, the
    /// prompt's row) and answers one number per line.
    #[arg(long)]
    pub reward_command: Option<String>,

    /// GRPO: the endpoint --reward http posts each batch of completions
    /// to, as a JSON array of objects (as --reward-command's lines); it
    /// answers a JSON array of as many numbers.
    #[arg(long)]
    pub reward_url: Option<String>,

    /// GRPO: the longest wait, in seconds, for one answer of
    /// --reward-command (a line) or --reward-url (a response); past it the
    /// run stops, naming the reward.
    #[arg(long, default_value_t = hlo_engine::grpo::DEFAULT_REWARD_TIMEOUT)]
    pub reward_timeout: f64,

    /// GRPO: show this many completions with their rewards every
    /// --log-every steps (in the log and the metrics file).
    #[arg(long, default_value_t = 0)]
    pub log_completions: u32,

    #[command(flatten)]
    pub step: StepArgs,

    #[command(flatten)]
    pub optim: OptimArgs,

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

    /// Start LoRA from this PEFT adapter folder (or hub id).
    #[arg(long, conflicts_with = "full", value_parser = crate::args::hub_adapter)]
    pub init_adapter: Option<PathBuf>,

    /// Training data: a JSONL or Parquet file, or a folder of their shards;
    /// rows of text, prompt/completion, messages, input_ids, alpaca or
    /// sharegpt (default: the bundled demo task).
    #[arg(long)]
    pub data: Option<PathBuf>,

    /// Optimizer steps to reach (a resumed run counts its saved steps).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
    pub steps: i64,

    /// Seed of data order, adapter init and random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Where the adapter (or a complete HF model folder with --full) and
    /// train_state/ go (default with --resume: the resumed folder).
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// Replace the run an --out folder already holds.
    #[arg(long)]
    pub overwrite: bool,

    /// Also save every N steps (needs --out).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    pub save_every: i64,

    /// Continue the run saved in this folder with every setting it was
    /// saved with (a flag given again must agree; --steps may extend a
    /// constant schedule; --metrics, --tensorboard, --eval-data,
    /// --eval-every, --log-every and --save-every replace the saved ones).
    #[arg(long)]
    pub resume: Option<PathBuf>,

    /// Write one JSON object per step (and evaluation) to this file;
    /// a resumed run appends.
    #[arg(long)]
    pub metrics: Option<PathBuf>,

    /// Write TensorBoard event files under this folder, in a folder of the
    /// run's own (named as --out is, else by its start time): train/loss,
    /// train/lr, train/grad_norm, train/tokens_per_s, train/mfu, eval/loss
    /// and eval/perplexity by step (`tensorboard --logdir DIR`).
    #[arg(long)]
    pub tensorboard: Option<PathBuf>,

    /// Write the compiled step as StableHLO and HLO text here.
    #[arg(long)]
    pub dump_hlo: Option<PathBuf>,

    /// Held-out data (same formats as --data): its masked mean loss
    /// and perplexity are computed every --eval-every steps (the demo task
    /// holds out a fresh draw of itself).
    #[arg(long)]
    pub eval_data: Option<PathBuf>,

    /// Steps between evaluations; 0 evaluates every --log-every steps.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    pub eval_every: i64,

    /// Print a log line every N steps.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i64).range(1..))]
    pub log_every: i64,

    /// The devices' peak TFLOP/s for MFU (default: a table by device kind;
    /// measured for CPUs).
    #[arg(long, value_parser = crate::args::positive, allow_negative_numbers = true)]
    pub peak_tflops: Option<f64>,
}

/// The engine's run of these flags; `given` (clap ids) are the settings
/// the command line chose, which a resumed run must agree with.
fn spec(args: &TrainArgs, given: &BTreeSet<String>) -> RunSpec {
    let quantize = args.quantize.nf4();
    RunSpec {
        model: args.model.source(),
        tokenizer: args.tokenizer.tokenizer.clone(),
        quantize,
        dtype: args.dtype.dtype,
        data: DataSource {
            path: args.data.clone(),
            chat_template: args.chat.chat_template.clone(),
            train_on_inputs: args.chat.train_on_inputs,
        },
        objective: args.objective,
        grpo: GrpoSpec {
            num_generations: args.num_generations as usize,
            beta: args.preference.beta.unwrap_or(0.0),
            epsilon: args.epsilon,
            epsilon_high: args.epsilon_high,
            num_iterations: args.num_iterations as usize,
            scale_rewards: args.scale_rewards,
            loss_type: args.loss_type,
            max_completion_length: args.max_completion_length as usize,
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            rewards: args.reward.clone(),
            rollouts: args.rollouts.clone(),
            reward_weights: args.reward_weights.clone(),
            answer_column: args.answer_column.clone(),
            format_regex: args.format_regex.clone(),
            reward_command: args.reward_command.clone(),
            reward_url: args.reward_url.clone(),
            reward_timeout: args.reward_timeout,
            log_completions: args.log_completions as usize,
        },
        preference: PreferenceSpec {
            precompute_ref: args.precompute_ref,
            ..args.preference.spec()
        },
        step: args.step.spec(),
        init_adapter: args.init_adapter.clone(),
        optim: args.optim.spec(args.step.optimizer),
        steps: args.steps,
        seed: args.seed,
        backend: args.plugin.backend(args.mesh.as_ref()),
        mode: if args.eager { Mode::Eager } else { Mode::Jit },
        eval: EvalSpec {
            data: args.eval_data.clone(),
            // 0: with every log line.
            every: if args.eval_every > 0 {
                args.eval_every
            } else {
                args.log_every
            },
        },
        output: OutputSpec {
            out: args.out.clone(),
            overwrite: args.overwrite,
            save_every: args.save_every,
            resume: args.resume.clone(),
        },
        report: ReportSpec {
            metrics: args.metrics.clone(),
            tensorboard: args.tensorboard.clone(),
            log_every: args.log_every,
        },
        trace_values: args.trace_values.clone(),
        peak_tflops: args.peak_tflops,
        chosen: Chosen::Only(given.iter().map(|id| id.replace('_', "-")).collect()),
    }
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
    if run.spec().objective == Objective::Grpo {
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
                rewards: run.spec().objective == Objective::Grpo,
            },
        );
        let command = TrainArgs::augment_args(clap::Command::new("train"));
        hooks.add("recipe", RecipeFile::new(command, argv)?);
    }
    Ok((hooks, bar, course))
}

pub fn run(args: TrainArgs, given: &BTreeSet<String>, argv: &[OsString]) -> Result<()> {
    let mut run = Run::new(spec(&args, given))?.with_stop(StopFlag::on_signals());
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
        && !spec.objective.is_preference()
        && spec.step.lora.is_some()
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
        run.train(&mut hlo_engine::Quiet)?;
        return Ok(());
    }
    print_header(&run)?;
    println!("{}", run.choices());
    let (mut hooks, bar, course) = hooks(&run, argv)?;
    let summary = run.train(&mut hooks).inspect_err(|_| bar.abandon())?;
    print_summary(&run, &summary, &course);
    show("after", &run)
}

/// The lines after a run: where it was saved (or that nothing was), how
/// the loss went (and GRPO's reward), packing, memory.
fn print_summary(run: &Run, summary: &TrainSummary, course: &RewardCourse) {
    let session = run.session();
    if summary.interrupted {
        match run.out() {
            Some(out) => println!(
                "stopped by a signal after step {}; saved to {} (continue with --resume {})",
                summary.step,
                out.display(),
                out.display()
            ),
            None => println!(
                "stopped by a signal after step {} (nothing saved: no --out)",
                summary.step
            ),
        }
        return;
    }
    if let Some(out) = run.out() {
        println!(
            "saved {} and train_state/ (step {}) to {}",
            if run.spec().step.lora.is_none() {
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
        .filter(|_| run.spec().objective != Objective::Grpo)
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
