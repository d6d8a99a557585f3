//! `hlo-train merge`: fold a LoRA adapter into the base weights and write an
//! HF model folder.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_ir::{Literal, TensorType};
use hlo_models::adapter::Adapter;
use hlo_models::checkpoint::Checkpoint;
use hlo_models::io::{write_atomic, write_safetensors};

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// HF model folder of the base model.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// PEFT adapter folder.
    #[arg(long)]
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
    let scale = adapter.lora.scale();
    let mut tensors = Vec::new();
    for (name, shape) in ckpt.config.parameter_shapes() {
        let dtype = ckpt.dtype(&name).context("checked on open")?;
        let w = ckpt.read(&name, dtype)?;
        let module = name.strip_suffix(".weight").unwrap_or(&name);
        let merged = match (
            adapter.get(&format!("{module}.lora_a")),
            adapter.get(&format!("{module}.lora_b")),
        ) {
            (Some(a), Some(b)) => {
                // W [out, in] += scale · (A·B)ᵀ, A [in, r], B [r, out]; in f64.
                let (din, r, dout) = (
                    a.ty.dims[0] as usize,
                    a.ty.dims[1] as usize,
                    b.ty.dims[1] as usize,
                );
                let (av, bv, mut wv) = (a.to_f64s(), b.to_f64s(), w.to_f64s());
                for o in 0..dout {
                    for i in 0..din {
                        let d: f64 = (0..r).map(|k| av[i * r + k] * bv[k * dout + o]).sum();
                        wv[o * din + i] += scale * d;
                    }
                }
                Literal::from_f64s(TensorType::new(dtype, shape), &wv)
            }
            _ => w,
        };
        tensors.push((name, merged));
    }
    write_safetensors(&args.out.join("model.safetensors"), &tensors)?;
    for extra in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        let src = args.checkpoint.join(extra);
        if src.is_file() {
            let bytes =
                std::fs::read(&src).with_context(|| format!("cannot read {}", src.display()))?;
            write_atomic(&args.out.join(extra), &bytes)?;
        }
    }
    eprintln!(
        "wrote {} ({} tensors, adapter folded in with scale {scale})",
        args.out.display(),
        tensors.len()
    );
    Ok(())
}
