//! `hlo-train train`: reads the flags and data, asks the engine for a
//! session and a trainer, and prints what they report (a header, a
//! progress bar with moving averages, log lines, the metrics file).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_engine::checkpoint::{self, RunSettings, Saved};
use hlo_engine::data::{eval_batches, Loader};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::partitioner::Mesh;
use hlo_engine::{
    flops, Backend, Dataset, Mode, Quiet, Session, SessionOptions, StopFlag, Trainer,
    TrainerOptions,
};
use hlo_report::{EventWriter, LossCurves};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{
    open_model, ChatArgs, DtypeArgs, ModelArgs, OptimArgs, PluginArgs, StepArgs, Toggle,
    TokenizerArgs,
};
use crate::console::{demo_show, print_header, Console, SMOOTHING_WINDOW};
use crate::dump_hlo::{self, Format};
use crate::{recipe, resume};

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
    /// constant schedule).
    #[arg(long)]
    pub resume: Option<PathBuf>,

    /// Write one JSON object per step (and evaluation) to this file;
    /// a resumed run appends.
    #[arg(long)]
    pub metrics: Option<PathBuf>,

    /// Write TensorBoard event files here: train/loss, train/lr,
    /// train/grad_norm, train/tokens_per_s, train/mfu, eval/loss and
    /// eval/perplexity by step (`tensorboard --logdir DIR`).
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

/// Opens `path` for the metrics: appended to when `append`.
fn metrics_file(path: &Path, append: bool) -> Result<File> {
    if let Some(parent) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))
}

/// Writes the run's effective recipe to `out/recipe.yaml`: the flags of
/// `argv` with the run's resolved settings and mesh.
fn write_recipe(out: &Path, argv: &[OsString], settings: &RunSettings, mesh: &Mesh) -> Result<()> {
    let mut resolved: Vec<(String, serde_json::Value)> = settings
        .0
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    resolved.push(("mesh".into(), mesh.to_string().into()));
    resolved.push(("devices".into(), mesh.size().into()));
    let text = recipe::effective(argv, &resolved)?;
    let path = out.join("recipe.yaml");
    let tmp = out.join(".recipe.yaml.tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .with_context(|| format!("cannot write {}", path.display()))
}

pub fn run(args: TrainArgs, given: &BTreeSet<String>, argv: &[OsString]) -> Result<()> {
    // A resumed run takes every setting it was saved with.
    let (args, saved, argv): (TrainArgs, Option<Saved>, Vec<OsString>) = match &args.resume {
        Some(dir) => {
            let saved = checkpoint::load(dir)?;
            let argv = resume::effective_argv(argv, given, &saved.state.settings);
            (resume::parse(&argv)?, Some(saved), argv)
        }
        None => (args, None, argv.to_vec()),
    };
    let out = args.out.clone().or_else(|| args.resume.clone());
    // Across processes, process 0 prints and writes; the others compute
    // alongside it (every gather is a program they all run).
    let launch = args.plugin.processes.launch()?;
    let main = launch.as_ref().is_none_or(|l| l.process_id == 0);
    if let Some(out) = out.as_ref().filter(|_| main) {
        let canonical = |p: &Path| std::fs::canonicalize(p).ok();
        let continuing = args
            .resume
            .as_deref()
            .is_some_and(|r| canonical(r).is_some() && canonical(r) == canonical(out));
        if checkpoint::holds_run(out) && !continuing && !args.overwrite {
            bail!(
                "--out {} holds a run already: continue it with --resume {}, or pass --overwrite to replace it",
                out.display(),
                out.display()
            );
        }
        checkpoint::prepare_out(out)?;
    }
    if args.save_every > 0 && out.is_none() {
        bail!("--save-every needs --out");
    }
    let trace_values = match &args.trace_values {
        Some(r) => Some(
            regex::Regex::new(r).with_context(|| format!("--trace-values `{r}` is not a regex"))?,
        ),
        None => None,
    };
    let model = args
        .quantize
        .apply(open_model(&args.model, &args.tokenizer)?)?;
    if args.step.full && model.config.quantization.is_some() {
        bail!("--full trains every weight, and NF4 weights are frozen: finetune a LoRA adapter on the quantized base (QLoRA), or drop --quantize");
    }
    model.check_weights()?;
    let config = model.config.clone();
    let tokenizer = model.tokenizer(None)?;
    let seq = args.step.seq as usize;
    let spec = args.chat.spec(args.data.clone(), args.step.seq);
    let data = Dataset::read(&model, &spec, args.seed)?;
    let held_out = Dataset::held_out(&model, &spec, args.eval_data.as_deref(), args.seed)?;
    let demo = args.data.is_none();

    let backend = Backend::open(&args.plugin.backend(args.mesh.as_ref()))?;
    let dtype = args.dtype.dtype(args.plugin.is_cpu());
    // LoRA settings: a resumed run's own adapter, else --init-adapter's,
    // else the flags.
    let init_adapter = match &args.init_adapter {
        Some(dir) if saved.is_none() => {
            let dropout = Adapter::dropout(dir);
            if dropout > 0.0 {
                bail!(
                    "--init-adapter {}: its adapter_config.json sets lora_dropout {dropout}, and hlo-train trains without dropout (the result would differ from PEFT's); set it to 0 to start from this adapter",
                    dir.display()
                );
            }
            Some(Adapter::load(dir, &config)?)
        }
        _ => None,
    };
    let lora_flags = ["lora_rank", "lora_alpha", "lora_targets", "use_rslora"];
    let lora_given = lora_flags.iter().any(|f| given.contains(*f));
    let adapter_lora = match (&saved, &args.resume, &init_adapter) {
        (Some(_), Some(dir), _) if !args.step.full && !lora_given => {
            Some(Adapter::read_config(dir)?)
        }
        (_, _, Some(a)) => Some(a.lora.clone()),
        _ => None,
    };
    let mut tc = args.step.train_config(
        &args.optim,
        &config,
        dtype,
        backend.mesh(),
        args.steps,
        adapter_lora,
    )?;
    let stats = data.stats;
    let fingerprint_data = resume::cli_settings(&args, &model, &data)?;
    // Samples with nothing to learn within a row are left out.
    let examples = data.learning(seq)?;
    // A step takes --grad-accum micro-batches of --batch rows.
    let mut loader = Loader::new(examples, seq, tc.rows() as usize, args.seed);
    // Packing: on request, or (auto) when samples fill at most half a row.
    let unpacked_fill = loader.mean_len().min(seq as f64) / seq as f64;
    if args.step.packing == Toggle::Auto {
        tc.packing = unpacked_fill <= 0.5;
    }
    loader = loader.packed(tc.packing);
    let mut settings = RunSettings::of_config(&tc, args.seed);
    settings.extend(&fingerprint_data);
    if let (Some(saved), Some(dir)) = (&saved, &args.resume) {
        resume::refuse(&resume::differences(
            &saved.state.settings,
            &settings,
            given,
            saved.state.step,
            dir,
        ))?;
    }
    if let Some(out) = out.as_ref().filter(|_| main) {
        write_recipe(out, &argv, &settings, backend.mesh())?;
    }
    let mode = if args.eager { Mode::Eager } else { Mode::Jit };
    let mut session = Session::new(
        backend,
        model,
        tc.clone(),
        SessionOptions {
            mode,
            seed: args.seed,
            init_adapter,
            eval: held_out.is_some(),
            ..SessionOptions::default()
        },
    )?;
    if let Some(saved) = &saved {
        session.restore(&saved.tensors)?;
        loader.cursor = saved.state.data_cursor;
    }
    if let Some(dir) = args.dump_hlo.as_ref().filter(|_| main) {
        dump_hlo::write_texts(dir, "train_step", session.sharded_step(), Format::Both)?;
    }
    // The demo shows the adapter's completions before and after training,
    // in one process (generation is not built across processes).
    let demo_tokenizer = tokenizer
        .as_ref()
        .filter(|_| demo && !args.step.full && launch.is_none());
    if let Some(t) = demo_tokenizer {
        demo_show(
            "before",
            &session,
            t,
            session.adapter()?.as_ref(),
            args.seed,
        )?;
    }

    let peak = flops::peak_flops(session.backend(), dtype, args.peak_tflops)?;
    let metrics = match args.metrics.as_ref().filter(|_| main) {
        Some(p) => Some(metrics_file(p, saved.is_some())?),
        None => None,
    };
    if main {
        print_header(&args, &session, &stats, loader.len(), unpacked_fill)?;
    }
    let bar = if main {
        ProgressBar::new(args.steps as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_position(session.steps_done() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let tensorboard = match args.tensorboard.as_ref().filter(|_| main) {
        Some(dir) => Some(EventWriter::create(dir)?),
        None => None,
    };
    let mut console = Console {
        bar,
        metrics,
        tensorboard,
        log_every: args.log_every,
        curves: LossCurves::default(),
    };
    let eval = held_out
        .map(|e| eval_batches(&e.examples, seq, args.step.batch as usize))
        .unwrap_or_default();
    let summary = {
        let mut trainer = Trainer::new(
            &mut session,
            loader,
            eval,
            TrainerOptions {
                steps: args.steps,
                eval_every: if args.eval_every > 0 {
                    args.eval_every
                } else {
                    args.log_every
                },
                save_every: args.save_every,
                out: out.clone(),
                settings: fingerprint_data,
                trace_values,
                peak_flops: Some(peak),
                smoothing_window: SMOOTHING_WINDOW,
            },
            StopFlag::on_signals(),
        )?;
        let result = if main {
            trainer.run(&mut console)
        } else {
            trainer.run(&mut Quiet)
        };
        if result.is_err() {
            console.bar.abandon();
        }
        result?
    };
    console.bar.finish_and_clear();
    if let Some(tb) = console.tensorboard.as_mut() {
        tb.flush()?;
    }
    // Process 0 serves the rendezvous until every process is done.
    if let Some(group) = session.backend().group() {
        group.finish()?;
    }
    if !main {
        return Ok(());
    }
    if let Some(out) = &out {
        // The whole run's curves: the metrics file holds the steps before
        // a resume too.
        let curves = match &args.metrics {
            Some(m) => LossCurves::read_metrics(m)?,
            None => std::mem::take(&mut console.curves),
        };
        if !curves.is_empty() {
            let title = format!("{}: loss", session.model().name);
            curves.write_svg(&out.join("loss.svg"), &title)?;
        }
    }
    if summary.interrupted {
        match &out {
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
        return Ok(());
    }
    if let Some(out) = &out {
        println!(
            "saved {} and train_state/ (step {}) to {}",
            if args.step.full {
                "an HF model folder"
            } else {
                "the PEFT adapter"
            },
            summary.step,
            out.display()
        );
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
    if let Some(fill) = summary.fill {
        println!(
            "packing {}: {:.1}% of the slots hold real tokens ({:.1}% unpacked)",
            if tc.packing { "on" } else { "off" },
            100.0 * fill,
            100.0 * unpacked_fill
        );
    }
    if let Some(m) = session.compiled_memory_stats()? {
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
    if let Some(t) = demo_tokenizer {
        demo_show("after", &session, t, session.adapter()?.as_ref(), args.seed)?;
    }
    Ok(())
}
