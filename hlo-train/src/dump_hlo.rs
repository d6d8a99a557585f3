//! `hlo-train dump-hlo`: the program hlo-train would compile (the train step
//! or the forward pass of any preset or config, on any mesh), as StableHLO
//! and/or HLO text, from abstract shapes: no weights are read or made.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use hlo_models::io::write_atomic;
use hlo_models::llama::forward_function_with;
use hlo_models::train::train_step;
use hlo_partitioner::{llama_rules, FunctionShardings, Mesh};
use hlo_runtime::{PluginKind, ShardedFunction};

use crate::common::PluginArgs;
use crate::model_args::ModelArgs;
use crate::step_args::StepArgs;

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
    pub model: ModelArgs,

    #[command(flatten)]
    pub step: StepArgs,

    #[command(flatten)]
    pub plugin: PluginArgs,

    /// Partition over this mesh (e.g. dp=2,fsdp=4,mp=1): the text then
    /// carries Shardy / GSPMD shardings from the partition rules.
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
}

pub fn run(args: &DumpHloArgs) -> Result<()> {
    let model = args.model.open()?;
    let config = &model.config;
    let mesh = args.mesh.clone().unwrap_or_else(Mesh::single);
    let dtype = args.model.dtype(true);
    let tc = args.step.train_config(config, dtype, &mesh, 1000, None)?;
    let traced = match args.what {
        What::TrainStep => train_step(config, &tc)?.function,
        What::Forward => forward_function_with(
            config,
            dtype,
            tc.batch,
            tc.seq,
            tc.lora.as_ref(),
            tc.scan_layers,
        )?,
    };
    // What is compiled: folded, CSE'd, dead code removed.
    let f = hlo_ir::simplify(&traced);
    let shardings = match &args.mesh {
        Some(mesh) => Some(FunctionShardings::from_rules_stacked(
            &f,
            mesh,
            &llama_rules(),
            &crate::step_args::leading_axis(&tc),
        )?),
        None => None,
    };
    let name = match args.what {
        What::TrainStep => "train_step",
        What::Forward => "forward",
    };
    let mut files: Vec<(String, String)> = Vec::new();
    if matches!(args.format, Format::Stablehlo | Format::Both) {
        files.push((
            format!("{name}.stablehlo.mlir"),
            hlo_lowering::to_stablehlo_with(&f, shardings.as_ref(), &[]),
        ));
    }
    if matches!(args.format, Format::Hlo | Format::Both) {
        let text = match &shardings {
            Some(s) => hlo_lowering::to_hlo_text_sharded(&f, s),
            None => hlo_lowering::to_hlo_text(&f),
        };
        files.push((format!("{name}.hlo.txt"), text));
    }
    match &args.out {
        None => {
            for (_, text) in &files {
                print!("{text}");
            }
        }
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            for (file, text) in &files {
                let path = dir.join(file);
                write_atomic(&path, text.as_bytes())?;
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
        let mut plugin = args.plugin.clone();
        if plugin.plugin.kind() == PluginKind::Cpu {
            plugin.devices = Some(mesh.size() as u32);
        }
        let client = plugin.client()?;
        let shardings = shardings.unwrap_or_else(|| FunctionShardings::replicated(&f, &mesh));
        ShardedFunction::new(&client, &f, shardings)?;
        eprintln!("XLA's dumps are in {}", dir.display());
    }
    Ok(())
}
