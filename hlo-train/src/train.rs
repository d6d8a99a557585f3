//! `hlo-train train`: reads the flags and data, asks the engine for a
//! session and a trainer, and prints what they report (a header, a
//! progress bar with moving averages, log lines, the metrics file).

use std::fs::File;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_engine::checkpoint::{self, RunSettings};
use hlo_engine::data::{demo_examples, eval_batches, read_jsonl, ChatData, Loader, Tokenizer};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::io::write_atomic;
use hlo_engine::partitioner::Mesh;
use hlo_engine::{
    flops, Backend, Generator, Mode, Model, Sampling, Session, SessionOptions, StopFlag, Trainer,
    TrainerOptions,
};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{printable, ModelArgs, PluginArgs, StepArgs, Toggle};
use crate::console::{Console, SMOOTHING_WINDOW};

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub plugin: PluginArgs,

    #[command(flatten)]
    pub step: StepArgs,

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

    /// Start LoRA from this PEFT adapter folder.
    #[arg(long, conflicts_with = "full")]
    pub init_adapter: Option<PathBuf>,

    /// JSONL training data (default: the bundled demo task).
    #[arg(long)]
    pub data: Option<PathBuf>,

    /// The folder whose tokenizer_config.json holds the chat template for
    /// `{"messages"}` data (default: the checkpoint's).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,

    /// With `{"messages"}` data, count system and user turns in the loss
    /// too (by default only the assistant's replies are learned).
    #[arg(long)]
    pub train_on_inputs: bool,

    /// Optimizer steps to reach (a resumed run counts its saved steps).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
    pub steps: i64,

    /// Seed of data order, adapter init and random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Where the adapter (or HF weights with --full) and train_state/ go.
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// Also save every N steps (needs --out).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    pub save_every: i64,

    /// Continue the run saved in this folder (same flags as the first run).
    #[arg(long)]
    pub resume: Option<PathBuf>,

    /// One JSON object per step.
    #[arg(long)]
    pub metrics: Option<PathBuf>,

    /// Write the compiled step as StableHLO and HLO text here.
    #[arg(long)]
    pub dump_hlo: Option<PathBuf>,

    /// Held-out JSONL data (same formats as --data): its masked mean loss
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
    #[arg(long)]
    pub peak_tflops: Option<f64>,
}

/// The demo's prompts, completed before and after training.
const DEMO_PROMPTS: [&str; 3] = ["cat=", "hello=", "rust="];

/// Prints the demo prompts' greedy completions, one line each.
fn demo_show(
    label: &str,
    session: &Session,
    tokenizer: &Tokenizer,
    adapter: Option<&Adapter>,
    seed: u64,
) -> Result<()> {
    let model = session.model();
    // Generation of three short prompts: one device is plenty.
    let backend = session.backend().first_device();
    let dtype = session.config().dtype;
    let generator = Generator::new(&backend, &model.config, dtype, adapter, Mode::Jit, |n| {
        model.weight(n, dtype, seed)
    })?;
    let prompts: Vec<Vec<u32>> = DEMO_PROMPTS
        .iter()
        .map(|p| tokenizer.encode(p, true))
        .collect::<Result<_, _>>()?;
    let outs = generator.complete_batch(&prompts, 8, &Sampling::default(), &model.eos_ids())?;
    println!("{label}:");
    for (p, out) in DEMO_PROMPTS.iter().zip(&outs) {
        let text = tokenizer.decode(out)?;
        println!("  {p:<8} {}", printable(&text, out));
    }
    Ok(())
}

pub fn run(args: &TrainArgs) -> Result<()> {
    if args.save_every > 0 && args.out.is_none() {
        bail!("--save-every needs --out");
    }
    let trace_values = match &args.trace_values {
        Some(r) => Some(
            regex::Regex::new(r).with_context(|| format!("--trace-values `{r}` is not a regex"))?,
        ),
        None => None,
    };
    let model = Model::open(&args.model.source())?;
    model.check_weights()?;
    let config = model.config.clone();
    let tokenizer = model.tokenizer(args.model.tokenizer.as_deref())?;
    let eos = config.eos_token_ids.first().map(|&e| e as u32);
    let demo = args.data.is_none();
    let template = model.chat_template(args.chat_template.as_deref())?;
    let chat = template.as_ref().map(|template| ChatData {
        template,
        stop: model.eos_ids(),
        train_on_inputs: args.train_on_inputs,
    });
    let examples = match &args.data {
        Some(path) => read_jsonl(
            path,
            tokenizer.as_ref(),
            eos,
            config.vocab_size,
            chat.as_ref(),
        )?,
        None => {
            let t = tokenizer
                .as_ref()
                .context("the demo data needs a tokenizer: pass --data or --tokenizer")?;
            demo_examples(t, eos, 2000, args.seed)
        }
    };
    // The held-out set: `--eval-data`, or for the demo task a fresh draw.
    let eval_examples = match (&args.eval_data, demo) {
        (Some(path), _) => Some(read_jsonl(
            path,
            tokenizer.as_ref(),
            eos,
            config.vocab_size,
            chat.as_ref(),
        )?),
        (None, true) => tokenizer
            .as_ref()
            .map(|t| demo_examples(t, eos, 256, args.seed.wrapping_add(1))),
        (None, false) => None,
    };

    let backend = Backend::open(&args.plugin.backend(args.mesh.as_ref()))?;
    let dtype = args.model.dtype(args.plugin.is_cpu());
    let init_adapter = match &args.init_adapter {
        Some(dir) => Some(Adapter::load(dir, &config)?),
        None => None,
    };
    let mut tc = args.step.train_config(
        &config,
        dtype,
        backend.mesh(),
        args.steps,
        init_adapter.as_ref().map(|a| a.lora.clone()),
    )?;
    // A step takes --grad-accum micro-batches of --batch rows.
    let mut loader = Loader::new(
        examples,
        args.step.seq as usize,
        tc.rows() as usize,
        args.seed,
    );
    // Packing: on request, or (auto) when samples fill at most half a row.
    let unpacked_fill = loader.mean_len().min(args.step.seq as f64) / args.step.seq as f64;
    if args.step.packing == Toggle::Auto {
        tc.packing = unpacked_fill <= 0.5;
    }
    loader = loader.packed(tc.packing);
    let settings = RunSettings::new(&tc, args.seed);
    let saved = match &args.resume {
        Some(dir) => {
            let saved = checkpoint::load(dir)?;
            let differences = saved.state.settings.differences(&settings);
            if !differences.is_empty() {
                bail!("--resume: {}", differences.join("; "));
            }
            Some(saved)
        }
        None => None,
    };
    let mode = if args.eager { Mode::Eager } else { Mode::Jit };
    let mut session = Session::new(
        backend,
        model,
        tc.clone(),
        SessionOptions {
            mode,
            seed: args.seed,
            init_adapter,
            eval: eval_examples.is_some(),
            ..SessionOptions::default()
        },
    )?;
    if let Some(saved) = &saved {
        session.restore(&saved.tensors)?;
        loader.cursor = saved.state.data_cursor;
    }
    if let Some(dir) = &args.dump_hlo {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let step = session.sharded_step();
        write_atomic(
            &dir.join("train_step.stablehlo.mlir"),
            step.stablehlo().as_bytes(),
        )?;
        write_atomic(&dir.join("train_step.hlo.txt"), step.hlo_text().as_bytes())?;
    }
    let show_demo = demo && !args.step.full && tokenizer.is_some();
    if show_demo {
        let initial = session.adapter()?;
        demo_show(
            "before",
            &session,
            tokenizer.as_ref().expect("checked"),
            initial.as_ref(),
            args.seed,
        )?;
    }

    let peak = flops::peak_flops(session.backend(), dtype, args.peak_tflops)?;
    let metrics = match &args.metrics {
        Some(p) => {
            if let Some(parent) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("cannot create {}", parent.display()))?;
            }
            Some(File::create(p).with_context(|| format!("cannot create {}", p.display()))?)
        }
        None => None,
    };
    println!(
        "training {} ({} parameters, {dtype}) on {} ({}): {} step, batch {} × seq {}, {} trainable tensors; {}",
        session.model().name,
        config.parameter_count(),
        session.backend().mesh(),
        session.backend().describe()?,
        if args.step.full { "full" } else { "LoRA" },
        args.step.batch,
        args.step.seq,
        session.trainable_names().len(),
        match mode {
            Mode::Jit => format!("compiled in {:.2}s", session.compile_s()),
            Mode::Eager => "eager: ops compile as they first run".to_string(),
        }
    );
    let bar = ProgressBar::new(args.steps as u64);
    bar.set_position(session.steps_done() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut console = Console {
        bar,
        metrics,
        log_every: args.log_every,
    };
    let eval = eval_examples
        .map(|e| eval_batches(&e, args.step.seq as usize, args.step.batch as usize))
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
                out: args.out.clone(),
                trace_values,
                peak_flops: Some(peak),
                smoothing_window: SMOOTHING_WINDOW,
            },
            StopFlag::on_signals(),
        )?;
        let result = trainer.run(&mut console);
        if result.is_err() {
            console.bar.abandon();
        }
        result?
    };
    console.bar.finish_and_clear();
    if summary.interrupted {
        match &args.out {
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
    if let Some(out) = &args.out {
        println!(
            "saved {} and train_state/ to {}",
            if args.step.full {
                "model.safetensors"
            } else {
                "the PEFT adapter"
            },
            out.display()
        );
    }
    if let (Some(first), Some(last)) = (summary.first_loss, summary.last_loss) {
        println!(
            "loss {first:.4} -> {last:.4} in {} steps",
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
    if show_demo {
        let trained = session.adapter()?;
        demo_show(
            "after",
            &session,
            tokenizer.as_ref().expect("checked"),
            trained.as_ref(),
            args.seed,
        )?;
    }
    Ok(())
}
