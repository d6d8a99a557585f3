//! `hlo-train export RUN --out DIR`: a full-training run's saved state
//! (the blocks every process wrote) as an HF model folder, streamed one
//! tensor at a time into files of at most 5 GB with their index.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The run's output folder (`train --full --out`), holding
    /// `train_state/`.
    pub run: PathBuf,

    /// The HF folder to write: weights, `config.json`, tokenizer and
    /// generation settings.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: &ExportArgs) -> Result<()> {
    let started = std::time::Instant::now();
    let files = hlo_engine::train::checkpoint::export::export(&args.run, &args.out)?;
    let bytes: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(args.out.join(f)).ok())
        .map(|m| m.len())
        .sum();
    println!(
        "export: {} -> {}: {} weight file{} ({}) in {:.1} s",
        args.run.display(),
        args.out.display(),
        files.len(),
        if files.len() == 1 { "" } else { "s" },
        crate::args::gb(bytes),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
