//! `hlo-train score`: a reward model's scores of preference pairs (each
//! side whole, as `train --objective reward` reads them), one JSON line a
//! pair, and the share of pairs it ranks as the data does.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_engine::device::backend::Backend;
use hlo_engine::infer::reward_scorer::RewardScorer;
use hlo_engine::inputs::dataset::{ChatSpec, DataSpec, Dataset};
use hlo_engine::inputs::model::Model;
use hlo_engine::inputs::model::{DtypeSpec, ModelSpec, TokenizerSpec};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::partitioner::Mesh;
use serde_json::json;

use crate::args::PluginArgs;
use crate::saved_run::AdapterRuns;

#[derive(Args, Debug)]
pub struct ScoreArgs {
    #[command(flatten)]
    pub model: ModelSpec,

    #[command(flatten)]
    pub dtype: DtypeSpec,

    #[command(flatten)]
    pub tokenizer: TokenizerSpec,

    #[command(flatten)]
    pub plugin: PluginArgs,

    /// Device mesh for the weights (default dp=1,fsdp=N,mp=1 over
    /// --devices).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// A reward model's PEFT adapter (a `train --objective reward` run, or
    /// a SEQ_CLS adapter with its score head), applied unmerged. Without
    /// it the checkpoint must be a sequence classifier.
    #[arg(long, value_parser = hlo_engine::settings::hub_adapter)]
    pub adapter: Option<PathBuf>,

    /// Pairs to score, as `train --objective reward` reads them:
    /// {"chosen", "rejected"} strings or message lists (with an optional
    /// "prompt"), or {"chosen_ids", "rejected_ids"}.
    #[arg(long)]
    pub data: PathBuf,

    /// Tokens a sequence may hold: longer pairs are left out (TRL's
    /// max_length filter), and counted. At most the model's positions
    /// (default: 1024, or the model's positions where fewer).
    #[arg(long, value_parser = clap::value_parser!(i64).range(2..=10_000_000))]
    pub seq: Option<i64>,

    /// Sequences scored together.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch: i64,

    /// Write the scores here (JSONL) rather than to stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: &ScoreArgs) -> Result<()> {
    let runs = AdapterRuns::read(args.adapter.as_deref())?;
    let model = Model::open(&runs.model_for(&args.model)?)?
        .with_tokenizer_file(runs.tokenizer_for(&args.tokenizer)?)
        .as_reward_model()?;
    let dtype = runs.dtype_for(&args.dtype, args.plugin.is_cpu())?;
    runs.announce("score");
    let adapter = match &args.adapter {
        Some(dir) => Some(Adapter::load(dir, &model.config)?),
        None => None,
    };
    let positions = model.config.max_position_embeddings;
    let seq = match args.seq {
        Some(s) => {
            model.config.check_positions("--seq", s)?;
            s as usize
        }
        None => DEFAULT_SEQ.min(positions) as usize,
    };
    let pairs = read_pairs(args, &model, seq)?;
    let total = pairs.len();
    let (kept, left_out): (Vec<_>, Vec<_>) = pairs
        .into_iter()
        .partition(|(c, r)| c.len() <= seq && r.len() <= seq);
    // Nothing to score is no score (train refuses such data too).
    let Some(longest) = kept.iter().map(|(c, r)| c.len().max(r.len())).max() else {
        let shortest = left_out.iter().map(|(c, r)| c.len().max(r.len())).min();
        bail!(
            "none of the {total} pairs fits within --seq {seq}: a pair is scored when both its sides do{}; give a longer --seq (at most the model's {positions} positions)",
            shortest.map_or(String::new(), |k| format!(" (the shortest pair's longer side holds {k} tokens)"))
        );
    };
    let backend = Backend::open(&args.plugin.backend(args.mesh.as_ref()))?;
    // Rows as long as the longest pair kept, not --seq: padding to --seq
    // would only add work (the scores read each sequence's last token).
    let rows_len = longest.max(2) as i64;
    let scorer = RewardScorer::new(
        backend,
        &model,
        dtype,
        (args.batch, rows_len),
        adapter.as_ref(),
    )?;
    let sequences: Vec<Vec<u32>> = kept
        .iter()
        .flat_map(|(c, r)| [c.clone(), r.clone()])
        .collect();
    let scores = scorer.score(&sequences)?;
    let mut out: Box<dyn Write> = match &args.out {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let mut won = 0;
    for pair in scores.chunks(2) {
        let (chosen, rejected) = (pair[0], pair[1]);
        won += usize::from(chosen > rejected);
        writeln!(out, "{}", json!({"chosen": chosen, "rejected": rejected}))?;
    }
    out.flush()?;
    eprintln!(
        "scored {} pairs: the chosen side higher in {won} ({:.4}){}",
        kept.len(),
        won as f64 / kept.len().max(1) as f64,
        match left_out.len() {
            0 => String::new(),
            n => format!("; {n} pairs longer than --seq {seq} left out"),
        }
    );
    Ok(())
}

/// `--seq` when not given, where the model has as many positions (TRL's
/// `max_length`).
const DEFAULT_SEQ: i64 = 1024;

/// The data's pairs, each side's ids, read as `train --objective reward`
/// reads them.
fn read_pairs(args: &ScoreArgs, model: &Model, seq: usize) -> Result<Vec<(Vec<u32>, Vec<u32>)>> {
    let spec = DataSpec {
        path: Some(args.data.clone()),
        chat: ChatSpec::default(),
        seq,
        pairs: true,
        unpaired: false,
        whole_pairs: true,
    };
    let data = Dataset::read(model, &spec, 0)?;
    Ok(data
        .pairs
        .into_iter()
        .map(|p| (p.chosen.ids, p.rejected.ids))
        .collect())
}
