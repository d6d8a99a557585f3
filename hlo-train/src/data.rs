//! `hlo-train data`: training data as the model will see it — the first
//! samples with their learned tokens marked ⟦like this⟧ — and what the
//! data holds for a row length: samples, tokens, learned tokens, samples
//! cut, samples with nothing to learn, epochs per run.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use hlo_engine::Dataset;

use crate::args::{open_model, ChatArgs, ModelArgs, TokenizerArgs};

#[derive(Args, Debug)]
pub struct DataArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub tokenizer: TokenizerArgs,

    #[command(flatten)]
    pub chat: ChatArgs,

    /// Data: a JSONL or Parquet file, or a folder of their shards
    /// (default: the bundled demo task).
    #[arg(long)]
    pub data: Option<PathBuf>,

    /// Tokens per row, as for `train`.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(i64).range(2..=10_000_000))]
    pub seq: i64,

    /// Rows per step, as for `train` (for the epoch count).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch: i64,

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

pub fn run(args: &DataArgs) -> Result<()> {
    let model = open_model(&args.model, &args.tokenizer)?;
    let seq = args.seq as usize;
    let spec = args.chat.spec(args.data.clone(), args.seq);
    let data = Dataset::read(&model, &spec, args.seed)?;
    let tokenizer = model
        .tokenizer(None)?
        .context("showing samples needs a tokenizer: pass --checkpoint or --tokenizer")?;
    for (k, e) in data.examples.iter().take(args.samples).enumerate() {
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
        // Runs of learned and unlearned tokens, decoded together so
        // multi-byte characters stay whole.
        let mut line = String::new();
        let mut start = 0;
        while start < kept {
            let learn = start > 0 && e.target[start];
            let mut end = start + 1;
            while end < kept && (end > 0 && e.target[end]) == learn {
                end += 1;
            }
            let text = tokenizer.decode_with_special(&e.ids[start..end])?;
            let text = text.escape_debug().to_string();
            if learn {
                line += &format!("⟦{text}⟧");
            } else {
                line += &text;
            }
            start = end;
        }
        println!("  {line}");
    }
    let s = data.stats;
    let useful = s.samples - s.no_signal;
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
    println!(
        "{} steps of {} rows take {:.2} epochs of the {useful} samples that teach something (unpacked)",
        args.steps,
        args.batch,
        (args.steps * args.batch) as f64 / useful.max(1) as f64
    );
    Ok(())
}
