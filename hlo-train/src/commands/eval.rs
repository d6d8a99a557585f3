//! `hlo-train eval`: the masked mean loss and perplexity of a model (and a
//! PEFT adapter, unmerged) over JSONL data, computed by the same compiled
//! eval step `train` uses for its held-out loss.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use hlo_engine::data::{eval_batches, eval_pair_batches};
use hlo_engine::device::backend::Backend;
use hlo_engine::inputs::dataset::Dataset;
use hlo_engine::inputs::model::Model;
use hlo_engine::inputs::model::{BaseSpec, TokenizerSpec};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::attention::AttentionKind;
use hlo_engine::models::preference::Reference;
use hlo_engine::models::train::{Loss, Preference};
use hlo_engine::objectives::Objective;
use hlo_engine::objectives::{Data, ObjectiveSpecs};
use hlo_engine::partitioner::Mesh;
use hlo_engine::run::spec::RunSpec;
use hlo_engine::step::policy::{forward_attention, Platform, Target};
use hlo_engine::train::session::{EvalResult, Evaluator};
use serde_json::json;

use crate::args::PluginArgs;
use crate::saved_run::{AdapterRuns, AttentionArgs};
use hlo_engine::inputs::dataset::ChatSpec;

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    pub base: BaseSpec,

    #[command(flatten)]
    pub tokenizer: TokenizerSpec,

    #[command(flatten)]
    pub chat: ChatSpec,

    #[command(flatten)]
    pub plugin: PluginArgs,

    #[command(flatten)]
    pub attention: AttentionArgs,

    /// Device mesh for the weights (default dp=1,fsdp=N,mp=1 over
    /// --devices).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// A PEFT adapter folder or hub id, applied unmerged. A run folder
    /// (with `train_state/`) also gives the base, tokenizer, NF4, dtype
    /// and attention its run used, where their flags are not given.
    #[arg(long, value_parser = hlo_engine::settings::hub_adapter)]
    pub adapter: Option<PathBuf>,

    /// Data (JSONL or Parquet files, or a folder of shards), in any
    /// format `train` reads.
    #[arg(long)]
    pub data: PathBuf,

    /// Tokens per row: longer samples are cut.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(i64).range(2..=10_000_000))]
    pub seq: i64,

    /// Rows evaluated together.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch: i64,

    /// What to score: sft (the masked mean loss of each learned token),
    /// or held-out preference pairs by a preference objective (the loss
    /// and TRL's metrics; --batch then counts pairs); an objective's
    /// reference, where it has one, is the base with the adapter off, or
    /// --ref-adapter. Objectives over unpaired examples or rollouts have
    /// no held-out loss here, and `hlo-train score` scores a reward
    /// model's pairs.
    #[arg(long, value_parser = crate::args::objectives_where(scored), default_value = "sft")]
    pub objective: Objective,

    #[command(flatten)]
    pub preference: hlo_engine::objectives::preference::PreferenceSpec,

    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &EvalArgs) -> Result<()> {
    // Whatever the flags leave open is as the adapter's run computed it
    // (a QLoRA run's adapter is scored on its NF4 base, as its own
    // held-out loss was).
    let runs = AdapterRuns::read(args.adapter.as_deref())?;
    let model = Model::open(&runs.model_for(&args.base.model)?)?
        .with_tokenizer_file(runs.tokenizer_for(&args.tokenizer)?)
        .quantized(runs.nf4_for(&args.base.quantize)?)?;
    let dtype = runs.dtype_for(&args.base.dtype, args.plugin.is_cpu())?;
    let attention = args.attention.kind_for(args.seq, &runs)?;
    runs.announce("eval");
    let adapter = match &args.adapter {
        Some(dir) => Some(Adapter::load(dir, &model.config)?),
        None => None,
    };
    let seq = args.seq as usize;
    let objective = args.objective;
    let preference = preference_of(args, objective)?;
    let mut spec = args.chat.data_spec(Some(args.data.clone()), args.seq);
    spec.pairs = preference.is_some();
    let data = Dataset::read(&model, &spec, 0)?;
    let backend = Backend::open(&args.plugin.backend(args.mesh.as_ref()))?;
    let target = Target::of_backend(&backend)?;
    let attention = match attention {
        Some(AttentionKind::Cudnn) if target.platform != Platform::Cuda => {
            bail!(
                "--attention cudnn: cuDNN's attention runs on CUDA devices, not {}",
                target.platform
            )
        }
        Some(a) => a,
        None => forward_attention(&target, &model.config, args.batch, args.seq),
    };
    let reference = match &args.preference.ref_adapter {
        Some(dir) => Some(Adapter::load(dir, &model.config)?),
        None => None,
    };
    let evaluator = Evaluator::new(
        backend,
        &model,
        dtype,
        (args.batch, args.seq),
        attention,
        adapter.as_ref(),
        preference.clone().map(|p| (p, reference.as_ref())),
    )?;
    let samples = data.stats.samples;
    // As train refuses it: data with nothing to score within --seq.
    let (batches, pairs) = match preference {
        Some(_) => {
            let pairs = data.learning_pairs(seq)?;
            let batches = eval_pair_batches(&pairs, seq, args.batch as usize, None);
            (batches, Some(pairs.len()))
        }
        None => (
            eval_batches(&data.learning(seq)?, seq, args.batch as usize),
            None,
        ),
    };
    let r = evaluator.evaluate(&batches)?;
    refuse_non_finite(args, &r)?;
    if let Some(pairs) = pairs {
        return print_pairs(args, objective, &r, pairs, samples);
    }
    if args.json {
        println!(
            "{}",
            json!({
                "eval_loss": r.loss,
                "eval_perplexity": r.perplexity(),
                "eval_tokens": r.tokens,
                "samples": samples,
            })
        );
    } else {
        println!(
            "eval_loss {:.6} perplexity {:.4} ({} tokens in {} samples)",
            r.loss,
            r.perplexity(),
            r.tokens,
            samples
        );
    }
    Ok(())
}

/// The objectives `eval` scores: a causal LM's loss over samples or
/// pairs (unpaired examples, rollouts and a reward model's pairs have no
/// held-out loss here).
fn scored(objective: Objective) -> bool {
    matches!(objective.data(), Data::Samples | Data::Pairs) && !objective.def().classifier()
}

/// The preference loss `--objective` names (None for sft), its settings
/// checked as `train` checks them.
fn preference_of(args: &EvalArgs, objective: Objective) -> Result<Option<Preference>> {
    // A setting the objective does not read is refused, as by `train`.
    if args.preference.precompute_ref {
        bail!("--precompute-ref: eval scores with the reference model itself; leave it out");
    }
    let objectives = ObjectiveSpecs {
        preference: args.preference.clone(),
        ..ObjectiveSpecs::default()
    };
    let spec = RunSpec {
        objective,
        objectives: objectives.resolved(objective),
        ..RunSpec::default()
    };
    spec.check_objective_settings()?;
    let reference = match args.preference.ref_adapter {
        Some(_) => Reference::Adapter,
        None => Reference::Base,
    };
    Ok(match objective.def().loss(&spec.objectives, reference) {
        Loss::Preference(p) => Some(p),
        _ => None,
    })
}

/// Refuses figures that are not finite (an adapter whose products
/// overflow): the loss, or a preference metric, named.
fn refuse_non_finite(args: &EvalArgs, r: &EvalResult) -> Result<()> {
    if let Some((name, v)) = std::iter::once(("loss", r.loss))
        .chain(r.metrics.iter().map(|(k, v)| (k.as_str(), *v)))
        .find(|(_, v)| !v.is_finite())
    {
        bail!(
            "the held-out {name} is {v}: the model{} overflows; no figure to report",
            args.adapter.as_ref().map_or(String::new(), |d| format!(
                " with the adapter {}",
                d.display()
            ))
        );
    }
    Ok(())
}

/// A preference evaluation's figures: the loss and TRL's metrics, means
/// over the pairs.
fn print_pairs(
    args: &EvalArgs,
    objective: Objective,
    r: &EvalResult,
    pairs: usize,
    samples: usize,
) -> Result<()> {
    if args.json {
        let mut v = json!({
            "objective": objective.name(),
            "eval_loss": r.loss,
            "pairs": pairs,
            "samples": samples,
        });
        for (k, m) in &r.metrics {
            v[format!("eval_{k}")] = json!(m);
        }
        println!("{v}");
        return Ok(());
    }
    let metrics: Vec<String> = r
        .metrics
        .iter()
        .map(|(k, v)| format!("{k} {v:.6}"))
        .collect();
    println!(
        "{} eval_loss {:.6} ({pairs} pairs of {samples}): {}",
        objective.name(),
        r.loss,
        metrics.join(", ")
    );
    Ok(())
}
