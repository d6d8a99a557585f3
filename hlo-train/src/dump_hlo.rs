//! `hlo-train dump-hlo`: the program hlo-train would compile, as StableHLO
//! and/or HLO text. Until the Llama model lands, the program is a built-in
//! two-layer MLP: its forward pass (`mlp`) or one SGD step (`mlp_sgd_step`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use hlo_ir::DType;

use hlo_models::io::write_atomic;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Stablehlo,
    Hlo,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum What {
    /// The forward pass.
    Forward,
    /// Forward, gradients and the parameter update, as one program.
    TrainStep,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
}

#[derive(Args, Debug)]
pub struct DumpHloArgs {
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

    /// Batch size of the example program.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch: i64,

    /// Element type of the example program.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DTypeArg,

    /// Partition the program over this mesh (e.g. dp=2,fsdp=4,mp=1): the
    /// text then carries Shardy / GSPMD shardings from the partition rules.
    #[arg(long)]
    pub mesh: Option<hlo_partitioner::Mesh>,
}

pub fn run(args: &DumpHloArgs) -> Result<()> {
    let dtype = match args.dtype {
        DTypeArg::F32 => DType::F32,
        DTypeArg::Bf16 => DType::BF16,
    };
    let traced = match args.what {
        What::Forward => hlo_models::mlp::two_layer_mlp(args.batch, 16, 32, 4, dtype)
            .context("tracing the example MLP")?,
        What::TrainStep => hlo_models::mlp::two_layer_mlp_sgd_step(args.batch, 16, 32, 4, dtype)
            .map_err(|e| anyhow::anyhow!("tracing the example MLP train step: {e}"))?,
    };
    // What is compiled: folded, CSE'd, dead code removed.
    let f = hlo_ir::simplify(&traced);
    let shardings = match &args.mesh {
        Some(mesh) => Some(hlo_partitioner::FunctionShardings::from_rules(
            &f,
            mesh,
            &hlo_models::mlp::rules(),
        )?),
        None => None,
    };
    let mut files: Vec<(String, String)> = Vec::new();
    if matches!(args.format, Format::Stablehlo | Format::Both) {
        let text = match &shardings {
            Some(s) => hlo_lowering::to_stablehlo_sharded(&f, s),
            None => hlo_lowering::to_stablehlo(&f),
        };
        files.push((format!("{}.stablehlo.mlir", f.name), text));
    }
    if matches!(args.format, Format::Hlo | Format::Both) {
        let text = match &shardings {
            Some(s) => hlo_lowering::to_hlo_text_sharded(&f, s),
            None => hlo_lowering::to_hlo_text(&f),
        };
        files.push((format!("{}.hlo.txt", f.name), text));
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
            for (name, text) in &files {
                let path = dir.join(name);
                write_atomic(&path, text.as_bytes())?;
                eprintln!("wrote {}", path.display());
            }
        }
    }
    Ok(())
}
