//! `hlo-train init`: an HF model folder of a configuration's weights made
//! as transformers initialises a new model (`AutoModelForCausalLM.
//! from_config`: normal with `initializer_range`, zero biases, unit norms),
//! seeded as `train --full --init random --seed N` makes them: the start
//! of a from-scratch run, saved, for another framework to take or to
//! check a first step against.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use hlo_engine::inputs::model::Model;
use hlo_engine::inputs::model::ModelSpec;
use hlo_engine::ir::DType;

#[derive(Args, Debug)]
pub struct InitArgs {
    #[command(flatten)]
    pub model: ModelSpec,

    /// Output folder (config.json, model.safetensors, and a checkpoint's
    /// tokenizer files); it must not hold a model already.
    #[arg(long)]
    pub out: PathBuf,

    /// The seed of the weights (train's --seed makes the same ones).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// The weights' dtype: f32 (what the CPU plugin trains in) or bf16.
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub dtype: String,
}

pub fn run(args: &InitArgs) -> Result<()> {
    let model = Model::open(&args.model.source())?.with_random_weights(true);
    if !model.config.is_causal_lm() {
        bail!(
            "{} is a sequence classifier; init makes causal LMs",
            model.name
        );
    }
    if args.out.join("model.safetensors").exists() || args.out.join("config.json").exists() {
        bail!(
            "--out {} holds a model already; give an empty or new folder",
            args.out.display()
        );
    }
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        _ => DType::F32,
    };
    // As a run seeded so makes each (`Model::weight`'s random weights).
    model.check_weights()?;
    let range = model.config.initializer_range;
    if !(range.is_finite() && range >= 0.0) {
        bail!(
            "{}: initializer_range {range:?} is no standard deviation: give a finite number, 0 or more (transformers' default is 0.02)",
            model.name
        );
    }
    let weights = hlo_engine::models::decoder::init_base(&model.config, dtype, args.seed);
    // A deviation the dtype cannot hold makes infinities: nothing written.
    if let Some((name, w)) = weights.iter().find(|(_, w)| w.non_finite_count() > 0) {
        bail!(
            "{}: initializer_range {range:?} makes {} of the {} values of {name} overflow {dtype}: give a smaller initializer_range (transformers' default is 0.02); nothing written",
            model.name,
            w.non_finite_count(),
            w.ty.element_count()
        );
    }
    std::fs::create_dir_all(&args.out)?;
    model.save_hf(&args.out, &weights)?;
    let parameters: usize = weights.iter().map(|(_, w)| w.ty.element_count()).sum();
    println!(
        "init: {} — {parameters} parameters, {} tensors in {} (seed {})",
        model.name,
        weights.len(),
        args.out.display(),
        args.seed
    );
    Ok(())
}
