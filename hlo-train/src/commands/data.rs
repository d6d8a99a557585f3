//! `hlo-train data`: training data as the model will see it — the first
//! samples with their learned tokens marked ⟦like this⟧ — and what the
//! data holds for a row length: samples, tokens, learned tokens, samples
//! cut, samples with nothing to learn, and the epochs a run takes, packed
//! or not, as `train` with the same flags computes them. With a preference
//! `--objective`, the data's pairs: each pair's prompt, then its chosen
//! and its rejected completion marked.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use hlo_engine::data::Loader;
use hlo_engine::data::Tokenizer;
use hlo_engine::inputs::dataset::Dataset;
use hlo_engine::inputs::model::{ModelSpec, TokenizerSpec};
use hlo_engine::objectives::{Data, Objective};
use hlo_engine::step::Toggle;
use hlo_engine::step::{auto_packing, epochs};

use crate::args::{named, open_model};
use hlo_engine::inputs::dataset::ChatSpec;

#[derive(Args, Debug)]
pub struct DataArgs {
    #[command(subcommand)]
    pub command: Option<DataCommand>,

    #[command(flatten)]
    pub model: ModelSpec,

    #[command(flatten)]
    pub tokenizer: TokenizerSpec,

    #[command(flatten)]
    pub chat: ChatSpec,

    /// Data: a JSONL or Parquet file, or a folder of their shards
    /// (default: the bundled demo task).
    #[arg(long)]
    pub data: Option<PathBuf>,

    /// Read the data as `train --objective` does: sft rows, or a
    /// preference objective's pairs (a reward model's each side whole;
    /// --batch then counts pairs). Prompts and unpaired examples, the
    /// other objectives' data, are counted in `train`'s header.
    #[arg(long, value_parser = crate::args::objectives_where(shown), default_value = "sft")]
    pub objective: Objective,

    /// Tokens per row, as for `train`.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(i64).range(2..=10_000_000))]
    pub seq: i64,

    /// Rows per step, as for `train` (for the epoch count).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch: i64,

    /// Micro-batches of --batch rows per optimizer step, as `train`'s.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i64).range(1..=4096))]
    pub grad_accum: i64,

    /// Pack several samples into each row, as `train --packing` (auto:
    /// when samples average at most half of --seq).
    #[arg(long, value_parser = named::<Toggle>(), default_value = "auto")]
    pub packing: Toggle,

    /// Steps, as for `train` (for the epoch count).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
    pub steps: i64,

    /// How many samples to show.
    #[arg(long, default_value_t = 3)]
    pub samples: usize,

    /// Seed of the demo task's draw.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `data`'s own commands.
#[derive(clap::Subcommand, Debug)]
pub enum DataCommand {
    /// Tokenize a dataset once, on every core, into a folder of
    /// memory-mapped token shards that `train --data DIR` streams
    /// (resumable).
    Prepare(Box<crate::commands::prepare::PrepareArgs>),
}

/// The objectives whose data `data` shows: samples and pairs (not
/// prompts or unpaired examples).
fn shown(objective: Objective) -> bool {
    matches!(objective.data(), Data::Samples | Data::Pairs)
}

pub fn run(args: &DataArgs) -> Result<()> {
    if let Some(DataCommand::Prepare(p)) = &args.command {
        return crate::commands::prepare::run(p);
    }
    let model = open_model(&args.model, &args.tokenizer)?;
    let seq = args.seq as usize;
    let mut spec = args.chat.data_spec(args.data.clone(), args.seq);
    spec.pairs = args.objective.is_preference();
    // A reward model's pairs: each side whole, every token scored.
    spec.whole_pairs = args.objective.def().classifier();
    let data = Dataset::read(&model, &spec, args.seed)?;
    if spec.pairs {
        return show_pairs(args, &model, data);
    }
    let shown = data.first_examples(args.samples, usize::MAX)?;
    // Data that teaches nothing: the line `train` refuses it with.
    if data.stats.no_signal == data.stats.samples {
        return Ok(data.learning(seq).map(|_| ())?);
    }
    let tokenizer = model
        .tokenizer(None)?
        .context("showing samples needs a tokenizer: pass --checkpoint or --tokenizer")?;
    for (k, e) in shown.iter().enumerate() {
        let kept = e.ids.len().min(seq);
        let learned = e.target[..kept].iter().skip(1).filter(|&&t| t).count();
        println!(
            "sample {} of {}: {} tokens{}, {learned} learned",
            k + 1,
            data.stats.samples,
            e.ids.len(),
            if e.ids.len() > seq {
                format!(" (cut to {seq})")
            } else {
                String::new()
            }
        );
        println!(
            "  {}",
            marked(&tokenizer, &e.ids[..kept], &e.target[..kept])?
        );
    }
    let s = data.stats;
    println!(
        "{} samples, {} tokens, {} learned within --seq {}; {} cut to --seq; {} with no learned token within --seq{}",
        s.samples,
        s.tokens,
        s.learned,
        seq,
        s.cut,
        s.no_signal,
        if s.no_signal > 0 {
            " (train leaves them out; a longer --seq keeps them)"
        } else {
            ""
        }
    );
    // What `train` with these flags does: the samples that teach, packed
    // or not as it decides.
    let rows = args.batch * args.grad_accum;
    let loader = match data.shards.clone() {
        Some(sets) => Loader::from_mixture(sets, seq, rows as usize, args.seed),
        None => Loader::new(data.learning(seq)?, seq, rows as usize, args.seed),
    };
    let useful = loader.len();
    let fill = loader.unpacked_fill();
    let packing = match args.packing {
        Toggle::On => true,
        Toggle::Off => false,
        Toggle::Auto => auto_packing(fill),
    };
    println!(
        "{} steps of {rows} rows take {}{:.2} epochs of the {useful} samples that teach something (packing {}: samples fill {:.1}% of a row unpacked)",
        args.steps,
        if packing { "about " } else { "" },
        epochs(args.steps, rows, args.seq, packing, fill, useful),
        if packing { "on" } else { "off" },
        100.0 * fill
    );
    Ok(())
}

/// Tokens as text, runs of learned ones ⟦marked⟧ (the first token is
/// never learned); runs decode together so multi-byte characters stay
/// whole.
fn marked(tokenizer: &Tokenizer, ids: &[u32], target: &[bool]) -> Result<String> {
    let mut line = String::new();
    let mut start = 0;
    while start < ids.len() {
        let learn = start > 0 && target[start];
        let mut end = start + 1;
        while end < ids.len() && target[end] == learn {
            end += 1;
        }
        let text = tokenizer.decode_with_special(&ids[start..end])?;
        let text = text.escape_debug().to_string();
        if learn {
            line += &format!("⟦{text}⟧");
        } else {
            line += &text;
        }
        start = end;
    }
    Ok(line)
}

/// The first pairs, each side cut to `--seq` with its completion marked,
/// and what `train` with these flags takes of them.
fn show_pairs(
    args: &DataArgs,
    model: &hlo_engine::inputs::model::Model,
    data: Dataset,
) -> Result<()> {
    let seq = args.seq as usize;
    let tokenizer = model
        .tokenizer(None)?
        .context("showing pairs needs a tokenizer: pass --checkpoint or --tokenizer")?;
    let total = data.pairs.len();
    for (k, p) in data.pairs.iter().take(args.samples).enumerate() {
        let prompt = p.prompt_len();
        println!(
            "pair {} of {total}: prompt {prompt} tokens, chosen {} and rejected {} after it{}",
            k + 1,
            p.chosen.ids.len() - prompt,
            p.rejected.ids.len() - prompt,
            if p.chosen.ids.len().max(p.rejected.ids.len()) > seq {
                format!(" (cut to {seq})")
            } else {
                String::new()
            }
        );
        for (side, e) in [("chosen", &p.chosen), ("rejected", &p.rejected)] {
            let kept = e.ids.len().min(seq);
            let text = marked(&tokenizer, &e.ids[..kept], &e.target[..kept])?;
            println!("  {side:<9}{text}");
        }
    }
    let s = data.stats;
    let pairs = data.learning_pairs(seq)?;
    let useful = pairs.len();
    println!(
        "{total} pairs, {} tokens, {} learned within --seq {seq}; {} sides cut to --seq; {} pairs whose prompt fills the row{}",
        s.tokens,
        s.learned,
        s.cut,
        total - useful,
        if total > useful {
            " (train leaves them out; a longer --seq keeps them)"
        } else {
            ""
        }
    );
    println!(
        "{} steps of {} pairs take {:.2} epochs of the {useful} pairs that teach something",
        args.steps,
        args.batch,
        (args.steps * args.batch) as f64 / useful as f64
    );
    Ok(())
}
