//! `hlo-train merge`: fold a LoRA adapter into the base weights (on the
//! host, in f64, one tensor at a time) and write an HF model folder. A
//! QLoRA adapter's base projections (NF4: a bitsandbytes checkpoint, or
//! `--quantize nf4`) are dequantized, the adapter added, and rounded to
//! bf16, as PEFT merges into a 4-bit base; every tensor is then written in
//! the base's own dtype (f32 or bf16, which hold those values exactly),
//! the one config.json names.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_engine::inputs::model::quantized_config;
use hlo_engine::inputs::model::{Model, ModelSource};
use hlo_engine::inputs::model::{QuantizeSpec, TokenizerSpec};
use hlo_engine::ir::{DType, Literal};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::checkpoint::Checkpoint;
use hlo_engine::models::decoder::SCORE;
use hlo_engine::models::io::{copy_side_files, write_atomic, write_hf_weights, MAX_SHARD_BYTES};
use hlo_engine::models::nf4::{self, Nf4Tensor};

use crate::saved_run::AdapterRuns;

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// HF model folder (or hub id) of the base model (default: the
    /// checkpoint the adapter's run trained on).
    #[arg(long, value_parser = hlo_engine::settings::hub_model)]
    pub checkpoint: Option<PathBuf>,
    /// PEFT adapter folder or hub id. A run folder (with `train_state/`)
    /// also gives its base and NF4 where their flags are not given.
    #[arg(long, value_parser = hlo_engine::settings::hub_adapter)]
    pub adapter: PathBuf,
    /// Output folder (config.json, model.safetensors, tokenizer files).
    #[arg(long)]
    pub out: PathBuf,

    #[command(flatten)]
    pub quantize: QuantizeSpec,
}

/// `--checkpoint`, else the checkpoint of the adapter's run.
fn base(args: &MergeArgs, runs: &AdapterRuns) -> Result<PathBuf> {
    if let Some(dir) = &args.checkpoint {
        return Ok(dir.clone());
    }
    match runs.model()? {
        None => bail!(
            "--checkpoint is needed: the base model's folder (or hub id) to merge {} into",
            args.adapter.display()
        ),
        Some(ModelSource::Checkpoint(dir)) => Ok(dir),
        Some(ModelSource::Preset(name)) => bail!(
            "--checkpoint is needed: the adapter's run trained on the {name} preset, whose random weights are not saved"
        ),
        Some(ModelSource::Config(path)) => bail!(
            "--checkpoint is needed: the adapter's run trained on random weights from {}",
            path.display()
        ),
    }
}

pub fn run(args: &MergeArgs) -> Result<()> {
    let runs = AdapterRuns::read([args.adapter.as_path()])?;
    let checkpoint = base(args, &runs)?;
    let mut ckpt = open_base(args, &checkpoint, &runs)?;
    runs.announce("merge");
    if reward_adapter(args)? {
        ckpt.config = reward_model_config(&checkpoint, &runs)?;
    }
    let adapter = Adapter::load(&args.adapter, &ckpt.config)?;
    if args.out.exists() && args.out.canonicalize()? == checkpoint.canonicalize()? {
        bail!("--out must differ from --checkpoint");
    }
    let scale = adapter.lora.scale();
    let out_dtype = out_dtype(&ckpt);
    let tensors = merge_all(&ckpt, &adapter, out_dtype, args)?;
    // Only now, with every tensor merged and checked: a refused merge
    // leaves nothing behind.
    let written = write_merged(args, &checkpoint, &ckpt, tensors, out_dtype)?;
    eprintln!(
        "wrote {} ({} tensors, adapter folded in with scale {scale})",
        args.out.display(),
        written
    );
    Ok(())
}

/// Opens the base checkpoint as the adapter was trained on it: NF4 when
/// stored so, asked for, or as the adapter's run held it.
fn open_base(
    args: &MergeArgs,
    checkpoint: &std::path::Path,
    runs: &AdapterRuns,
) -> Result<Checkpoint> {
    let mut ckpt = Checkpoint::open(checkpoint)?;
    let name = checkpoint.display().to_string();
    ckpt.config = quantized_config(&ckpt.config, &name, runs.nf4_for(&args.quantize)?)?;
    Ok(ckpt)
}

/// The dtype of what is not quantized (the embeddings'): every tensor is
/// written in it, so config.json's dtype describes them all. The merged
/// projections are rounded to bf16 as PEFT's are; f32 and bf16 hold those
/// values exactly. A base in another dtype is written in bf16.
fn out_dtype(ckpt: &Checkpoint) -> DType {
    let nf4 = ckpt.config.quantization;
    match nf4.and_then(|_| ckpt.dtype("model.embed_tokens.weight")) {
        Some(stored @ (DType::F32 | DType::BF16)) => stored,
        _ => DType::BF16,
    }
}

/// Every parameter of the model merged, in the config's order, each
/// checked before the next is read.
fn merge_all(
    ckpt: &Checkpoint,
    adapter: &Adapter,
    out_dtype: DType,
    args: &MergeArgs,
) -> Result<Vec<(String, Literal)>> {
    let mut tensors = Vec::new();
    for (name, _) in ckpt.config.parameter_shapes() {
        let merged = merged_tensor(ckpt, adapter, &name, out_dtype, args)?;
        tensors.push((name, merged));
    }
    Ok(tensors)
}

/// One parameter merged: an NF4 projection dequantized first, a score head
/// the base lacks taken from the adapter, anything else merged in its own
/// dtype (then written in `out_dtype` when the base is NF4).
fn merged_tensor(
    ckpt: &Checkpoint,
    adapter: &Adapter,
    name: &str,
    out_dtype: DType,
    args: &MergeArgs,
) -> Result<Literal> {
    let nf4 = ckpt.config.quantization;
    Ok(match nf4.filter(|_| nf4::is_quantized(name)) {
        // The NF4 base dequantized (in f32), the adapter added, bf16.
        Some(q) => merged_nf4(ckpt, adapter, name, (q, out_dtype), args)?,
        // A causal LM's checkpoint has no classifier head: the
        // adapter's is the merged model's.
        None if name == SCORE && ckpt.dtype(name).is_none() => adapter
            .get(name)
            .cloned()
            .context("the adapter saves no score head")?,
        None => {
            let dtype = ckpt.dtype(name).context("checked on open")?;
            let base = ckpt.read(name, dtype)?;
            let merged = adapter.merge(&ckpt.config, name, &base);
            check_finite(name, &base, &merged, args)?;
            match nf4 {
                Some(_) if merged.ty.dtype != out_dtype => {
                    Literal::from_f64s(merged.ty.with_dtype(out_dtype), &merged.to_f64s())
                }
                _ => merged,
            }
        }
    })
}

/// Writes the merged model's folder: weights, config.json and the base's
/// side files; returns how many tensors were written.
fn write_merged(
    args: &MergeArgs,
    checkpoint: &std::path::Path,
    ckpt: &Checkpoint,
    tensors: Vec<(String, Literal)>,
    out_dtype: DType,
) -> Result<usize> {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    // What a merge killed before it finished left behind.
    hlo_engine::train::checkpoint::remove_stale_temporaries(&args.out);
    // As transformers writes them (mixtures of experts per expert).
    let tensors = hlo_engine::models::checkpoint::hf_layout(&ckpt.config, tensors);
    write_hf_weights(&args.out, &tensors, MAX_SHARD_BYTES)?;
    let bytes = merged_config_json(checkpoint, ckpt, out_dtype)?;
    write_atomic(&args.out.join("config.json"), &bytes)?;
    copy_side_files(checkpoint, &args.out)?;
    Ok(tensors.len())
}

/// The base's config.json with the merged model's head; for an NF4 base,
/// without its quantization_config (the merged weights are plain: HF must
/// not load them as 4-bit) and with the dtype they are written in.
fn merged_config_json(
    checkpoint: &std::path::Path,
    ckpt: &Checkpoint,
    out_dtype: DType,
) -> Result<Vec<u8>> {
    let config = checkpoint.join("config.json");
    let bytes =
        std::fs::read(&config).with_context(|| format!("cannot read {}", config.display()))?;
    let bytes = hlo_engine::models::decoder::with_head(&bytes, &ckpt.config)?;
    if ckpt.config.quantization.is_none() {
        return Ok(bytes);
    }
    let mut json: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not JSON", config.display()))?;
    if let Some(o) = json.as_object_mut() {
        o.remove("quantization_config");
        // transformers 4 reads `torch_dtype`, 5 writes `dtype`.
        let name = if out_dtype == DType::F32 {
            "float32"
        } else {
            "bfloat16"
        };
        for key in ["torch_dtype", "dtype"] {
            if o.contains_key(key) || key == "dtype" {
                o.insert(key.to_string(), name.into());
            }
        }
    }
    Ok(serde_json::to_string_pretty(&json)?.into_bytes())
}

/// An NF4 base weight dequantized (in f32), the adapter added, rounded to
/// bf16 as PEFT rounds, written in `out_dtype`.
fn merged_nf4(
    ckpt: &Checkpoint,
    adapter: &Adapter,
    name: &str,
    (q, out_dtype): (nf4::Nf4Config, DType),
    args: &MergeArgs,
) -> Result<Literal> {
    let base = if ckpt.is_prequantized(name) {
        ckpt.read_nf4(name)?
    } else {
        let dtype = ckpt.dtype(name).context("checked on open")?;
        Nf4Tensor::from_literal(&ckpt.read(name, dtype)?, q.double_quant)
    };
    let base = base.dequantized_literal(DType::F32);
    let merged = adapter.merge(&ckpt.config, name, &base);
    let bf16 = Literal::from_f64s(merged.ty.with_dtype(DType::BF16), &merged.to_f64s());
    let merged = Literal::from_f64s(merged.ty.with_dtype(out_dtype), &bf16.to_f64s());
    check_finite(name, &base, &merged, args)?;
    Ok(merged)
}

/// Whether the adapter is a reward model's (its score head saved whole:
/// the merged model is a sequence classifier, as TRL trained it).
fn reward_adapter(args: &MergeArgs) -> Result<bool> {
    Ok(Adapter::read_config(&args.adapter)?
        .modules_to_save
        .iter()
        .any(|m| m == "score"))
}

/// The config of `checkpoint` made a reward model's, pooled by the pad
/// token the run padded with (its tokenizer's).
fn reward_model_config(
    checkpoint: &std::path::Path,
    runs: &AdapterRuns,
) -> Result<hlo_engine::models::decoder::ModelConfig> {
    let source = ModelSource::Checkpoint(checkpoint.to_path_buf());
    let tokenizer = runs.tokenizer_for(&TokenizerSpec::default())?;
    let model = Model::open(&source)?.with_tokenizer_file(tokenizer);
    Ok(model.as_reward_model()?.config)
}

/// Refuses a merged tensor with NaN or infinite values, saying whether
/// the base had them already or the adapter's product overflowed the
/// tensor's dtype.
fn check_finite(name: &str, base: &Literal, merged: &Literal, args: &MergeArgs) -> Result<()> {
    let bad = |l: &Literal| l.to_f64s().iter().filter(|v| !v.is_finite()).count();
    let n = bad(merged);
    if n == 0 {
        return Ok(());
    }
    let cause = match bad(base) {
        0 => format!(
            "the adapter {} adds values past {}'s range",
            args.adapter.display(),
            merged.ty.dtype
        ),
        b => format!("the base tensor has {b} already"),
    };
    bail!(
        "`{name}` merged has {n} NaN or infinite values of {} ({cause}); nothing was written",
        merged.ty.element_count()
    )
}
