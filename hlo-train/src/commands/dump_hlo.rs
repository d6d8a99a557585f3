//! `hlo-train dump-hlo`: the program hlo-train would compile (the train step
//! or the forward pass of any preset or config, on any mesh), as StableHLO
//! and/or HLO text, from abstract shapes: no weights are read or made.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use hlo_engine::device::backend::Backend;
use hlo_engine::device::pipeline::ShardedStep;
use hlo_engine::inputs::model::Model;
use hlo_engine::inputs::model::{DtypeSpec, ModelSpec};
use hlo_engine::models::decoder::{forward_step, partition_rules};
use hlo_engine::models::io::write_atomic;
use hlo_engine::models::train::train_step;
use hlo_engine::partitioner::Mesh;
use hlo_engine::runtime::Mode;
use hlo_engine::step::{OptimSpec, StepSpec};

use crate::args::PluginArgs;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Stablehlo,
    Hlo,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum What {
    /// Forward, gradients, clipping and the optimizer update, as one program.
    TrainStep,
    /// The forward pass to logits.
    Forward,
}

#[derive(Args, Debug)]
pub struct DumpHloArgs {
    #[command(flatten)]
    pub model: ModelSpec,

    #[command(flatten)]
    pub dtype: DtypeSpec,

    #[command(flatten)]
    pub step: StepSpec,

    #[command(flatten)]
    pub optim: OptimSpec,

    #[command(flatten)]
    pub plugin: PluginArgs,

    /// Partition over this mesh (e.g. dp=2,fsdp=4,mp=1): the text then
    /// carries Shardy / GSPMD shardings from the partition rules (also
    /// dp=1,fsdp=N,mp=1 over --devices).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// Which program.
    #[arg(long, value_enum, default_value = "train-step")]
    pub what: What,

    /// Which text to write.
    #[arg(long, value_enum, default_value = "both")]
    pub format: Format,

    /// Folder for NAME.stablehlo.mlir and NAME.hlo.txt (created if needed);
    /// without it the text goes to stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// Also compile the program on the CPU plugin and keep XLA's own dumps
    /// (after-optimization HLO among them) in this folder.
    #[arg(long)]
    pub xla_dump: Option<PathBuf>,

    /// Decide the step's `auto` choices (layers, remat, attention) for
    /// this device kind, as `plan --target` names them (default: the CPU's
    /// choices).
    #[arg(long, value_enum)]
    pub target: Option<crate::commands::plan::Target>,

    /// Compile the program with --target's own XLA compiler (no GPU
    /// needed: `make setup-targets` installs it) and write the HLO it
    /// optimized (after fusion, remat and collectives), with a summary:
    /// fusions by kind, library calls, collectives and their bytes, the
    /// matmuls' output types, what XLA recomputed, memory per device.
    #[arg(long, requires = "target")]
    pub optimized: bool,
}

pub fn run(args: &DumpHloArgs) -> Result<()> {
    let model = Model::open(&args.model.source())?;
    let config = &model.config;
    let options = args.plugin.backend(args.mesh.as_ref());
    // Without --mesh or --devices the program is printed for one device,
    // without shardings.
    let laid_out = args.mesh.is_some() || args.plugin.devices.is_some();
    let mesh = options.mesh_or(None)?;
    let dtype = args.dtype.dtype(true);
    // Printed for the CPU's choices unless --target names a device.
    let target = match args.target {
        Some(t) => hlo_engine::step::policy::Target::of_device(t.device()),
        None => hlo_engine::step::policy::Target::cpu(),
    };
    let choices = args.step.policy(config, dtype, &mesh, &target)?;
    let mut tc = args
        .step
        .train_config(&args.optim, config, dtype, &mesh, 1000, &choices)?;
    if args.optimized && hlo_engine::analysis::plan::stand_in_for_cudnn(&mut tc) {
        eprintln!(
            "cuDNN's attention compiled as {}: cuDNN cannot be compiled without a GPU",
            hlo_engine::step::policy::attention_name(tc.attention)
        );
    }
    let step = match args.what {
        What::TrainStep => train_step(config, &tc)?,
        What::Forward => forward_step(
            config,
            dtype,
            tc.batch,
            tc.seq,
            tc.lora.as_ref(),
            tc.scan_layers,
        )?,
    };
    let sharded = if laid_out || args.optimized {
        ShardedStep::new(&step, &mesh, &partition_rules(config))?
    } else {
        ShardedStep::unsharded(&step)
    };
    let name = match args.what {
        What::TrainStep => "train_step",
        What::Forward => "forward",
    };
    if let Some(target) = args.target.filter(|_| args.optimized) {
        optimized(args, target, name, &sharded)?;
        eprintln!("{}", choices.line());
        return Ok(());
    }
    match &args.out {
        None => {
            for (_, text) in texts(name, &sharded, args.format) {
                print!("{text}");
            }
        }
        Some(dir) => {
            for path in write_texts(dir, name, &sharded, args.format)? {
                eprintln!("wrote {}", path.display());
            }
        }
    }
    if let Some(dir) = &args.xla_dump {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        // XLA reads its flags when the plugin first compiles.
        let flags = format!(
            "{} --xla_dump_to={} --xla_dump_hlo_as_text",
            std::env::var("XLA_FLAGS").unwrap_or_default(),
            dir.display()
        );
        std::env::set_var("XLA_FLAGS", flags.trim());
        let backend =
            Backend::open_for(&args.plugin.plugin, mesh)?.with_xla_options(&options.xla_options);
        sharded.compile(&backend, Mode::Jit)?;
        eprintln!("XLA's dumps are in {}", dir.display());
    }
    // Last, so that a failure stays one line.
    eprintln!("{}", choices.line());
    Ok(())
}

/// `--optimized`: the program compiled by `target`'s XLA compiler, its
/// optimized HLO written (to `--out`, else stdout) and summarized.
fn optimized(
    args: &DumpHloArgs,
    target: crate::commands::plan::Target,
    name: &str,
    step: &ShardedStep,
) -> Result<()> {
    let device = target.device();
    let devices = step.mesh().size() as usize;
    let compiler = hlo_engine::device::target::TargetCompiler::open(device, devices)?;
    let options = hlo_engine::runtime::CompileOptions {
        env_option_overrides: args.plugin.backend(args.mesh.as_ref()).xla_options,
        ..Default::default()
    };
    let (compiled, text) = compiler.compile_optimized(step, &options)?;
    let summary = hlo_engine::analysis::optimized::OptimizedSummary::of(&text);
    let x = &compiled.xla;
    let mut report = format!(
        "{} compiled by {} in {:.1}s (without a device: nothing autotuned)\n",
        name,
        compiler.describe(),
        compiled.compile_s
    );
    report.push_str(&summary.text());
    report.push_str(&format!(
        "memory per device: arguments {}, outputs {} ({} reuse donated arguments), temporaries {}, total {}{}\n",
        crate::args::gb(x.argument_size_in_bytes.max(0) as u64),
        crate::args::gb(x.output_size_in_bytes.max(0) as u64),
        crate::args::gb(x.alias_size_in_bytes.max(0) as u64),
        crate::args::gb(x.temp_size_in_bytes.max(0) as u64),
        crate::args::gb(x.total_device_bytes().max(0) as u64),
        match x.peak_memory_in_bytes {
            p if p > 0 => format!(", XLA's peak {}", crate::args::gb(p as u64)),
            _ => String::new(),
        }
    ));
    match &args.out {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            let file = format!("{name}.{}.optimized.hlo.txt", device.target);
            let path = dir.join(file);
            write_atomic(&path, text.as_bytes())?;
            eprintln!("wrote {}", path.display());
            print!("{report}");
        }
        None => {
            print!("{text}");
            eprint!("{report}");
        }
    }
    Ok(())
}

/// The program's text files, `(file name, text)`, in `format`.
fn texts(name: &str, step: &ShardedStep, format: Format) -> Vec<(String, String)> {
    let mut files = Vec::new();
    if matches!(format, Format::Stablehlo | Format::Both) {
        files.push((format!("{name}.stablehlo.mlir"), step.stablehlo()));
    }
    if matches!(format, Format::Hlo | Format::Both) {
        files.push((format!("{name}.hlo.txt"), step.hlo_text()));
    }
    files
}

/// Writes the program's text files into `dir` (created if needed); returns
/// their paths. `train --dump-hlo` writes its step this way too.
pub fn write_texts(
    dir: &Path,
    name: &str,
    step: &ShardedStep,
    format: Format,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    texts(name, step, format)
        .into_iter()
        .map(|(file, text)| {
            let path = dir.join(file);
            write_atomic(&path, text.as_bytes())?;
            Ok(path)
        })
        .collect()
}
