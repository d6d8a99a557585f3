//! `hlo-train eval`: the masked mean loss and perplexity of a model (and a
//! PEFT adapter, unmerged) over JSONL data, computed by the same compiled
//! eval step `train` uses for its held-out loss.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use hlo_engine::data::eval_batches;
use hlo_engine::models::adapter::Adapter;
use hlo_engine::partitioner::Mesh;
use hlo_engine::{Backend, Dataset, Evaluator, Model};
use serde_json::json;

use crate::args::{ChatArgs, DtypeArgs, ModelArgs, PluginArgs, TokenizerArgs};
use crate::saved_run::{AdapterRuns, AttentionArgs};

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub quantize: crate::args::QuantizeArgs,

    #[command(flatten)]
    pub dtype: DtypeArgs,

    #[command(flatten)]
    pub tokenizer: TokenizerArgs,

    #[command(flatten)]
    pub chat: ChatArgs,

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
    #[arg(long, value_parser = crate::args::hub_adapter)]
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

    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &EvalArgs) -> Result<()> {
    // Whatever the flags leave open is as the adapter's run computed it
    // (a QLoRA run's adapter is scored on its NF4 base, as its own
    // held-out loss was).
    let runs = AdapterRuns::read(args.adapter.as_deref())?;
    let model = Model::open(&args.model.source_for(&runs)?)?
        .with_tokenizer_file(args.tokenizer.tokenizer_for(&runs)?)
        .quantized(args.quantize.nf4_for(&runs)?)?;
    let dtype = args.dtype.dtype_for(args.plugin.is_cpu(), &runs)?;
    let attention = args.attention.kind_for(args.seq, &runs)?;
    runs.announce("eval");
    let adapter = match &args.adapter {
        Some(dir) => Some(Adapter::load(dir, &model.config)?),
        None => None,
    };
    let seq = args.seq as usize;
    let spec = args.chat.spec(Some(args.data.clone()), args.seq);
    let data = Dataset::read(&model, &spec, 0)?;
    let backend = Backend::open(&args.plugin.backend(args.mesh.as_ref()))?;
    let evaluator = Evaluator::new(
        backend,
        &model,
        dtype,
        (args.batch, args.seq),
        attention,
        adapter.as_ref(),
    )?;
    let batches = eval_batches(&data.examples, seq, args.batch as usize);
    let r = evaluator.evaluate(&batches)?;
    if args.json {
        println!(
            "{}",
            json!({
                "eval_loss": r.loss,
                "eval_perplexity": r.perplexity(),
                "eval_tokens": r.tokens,
                "samples": data.stats.samples,
            })
        );
    } else {
        println!(
            "eval_loss {:.6} perplexity {:.4} ({} tokens in {} samples)",
            r.loss,
            r.perplexity(),
            r.tokens,
            data.stats.samples
        );
    }
    Ok(())
}
