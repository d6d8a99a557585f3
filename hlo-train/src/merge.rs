//! `hlo-train merge`: fold a LoRA adapter into the base weights (on the
//! host, in f64, one tensor at a time) and write an HF model folder.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::checkpoint::Checkpoint;
use hlo_engine::models::io::{copy_side_files, write_atomic, write_safetensors};

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// HF model folder (or hub id) of the base model.
    #[arg(long, value_parser = crate::args::hub_model)]
    pub checkpoint: PathBuf,
    /// PEFT adapter folder or hub id.
    #[arg(long, value_parser = crate::args::hub_adapter)]
    pub adapter: PathBuf,
    /// Output folder (config.json, model.safetensors, tokenizer files).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: &MergeArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&args.checkpoint)?;
    let adapter = Adapter::load(&args.adapter, &ckpt.config)?;
    if args.out.exists() && args.out.canonicalize()? == args.checkpoint.canonicalize()? {
        bail!("--out must differ from --checkpoint");
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    // What a merge killed before it finished left behind.
    hlo_engine::checkpoint::remove_stale_temporaries(&args.out);
    let scale = adapter.lora.scale();
    let mut tensors = Vec::new();
    for (name, _) in ckpt.config.parameter_shapes() {
        let dtype = ckpt.dtype(&name).context("checked on open")?;
        let w = ckpt.read(&name, dtype)?;
        let merged = adapter.merge(&name, &w);
        tensors.push((name, merged));
    }
    write_safetensors(&args.out.join("model.safetensors"), &tensors)?;
    let config = args.checkpoint.join("config.json");
    let bytes =
        std::fs::read(&config).with_context(|| format!("cannot read {}", config.display()))?;
    write_atomic(&args.out.join("config.json"), &bytes)?;
    copy_side_files(&args.checkpoint, &args.out)?;
    eprintln!(
        "wrote {} ({} tensors, adapter folded in with scale {scale})",
        args.out.display(),
        tensors.len()
    );
    Ok(())
}
