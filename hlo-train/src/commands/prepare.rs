//! `hlo-train data prepare`: a dataset tokenized once, on every core, into
//! a folder of memory-mapped token shards (`hlo_engine::data::tokens`)
//! that `train --data DIR` streams instead of reading and tokenizing the
//! data again; resumable, with a progress line.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use hlo_engine::data::lock::FolderLock;
use hlo_engine::inputs::dataset::{prepare_tokens, PrepareSpec};
use hlo_engine::inputs::model::{ModelSpec, TokenizerSpec};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::open_model;
use hlo_engine::inputs::dataset::ChatSpec;

#[derive(Args, Debug)]
pub struct PrepareArgs {
    #[command(flatten)]
    pub model: ModelSpec,

    #[command(flatten)]
    pub tokenizer: TokenizerSpec,

    #[command(flatten)]
    pub chat: ChatSpec,

    /// Data: a JSONL or Parquet file, or a folder of their shards, read as
    /// `train --data` reads it (samples whole: a run cuts to its --seq).
    #[arg(long)]
    pub data: PathBuf,

    /// The folder the token shards and manifest.json go to; an
    /// interrupted preparation there resumes after its last shard.
    #[arg(long)]
    pub out: PathBuf,

    /// Source rows a shard holds (held in memory while they are
    /// tokenized: lower it for long documents).
    #[arg(long, default_value_t = 65536, value_parser = clap::value_parser!(u64).range(1..))]
    pub rows_per_shard: u64,

    /// Threads tokenizing (default: every core).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub threads: Option<u64>,
}

pub fn run(args: &PrepareArgs) -> Result<()> {
    let model = open_model(&args.model, &args.tokenizer)?;
    let threads = args.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |t| t as usize,
    );
    // One preparation a folder: a second is refused naming the first.
    let lock = FolderLock::create(&args.out, "data prepare")?;
    if let Some(line) = lock.took_over_line() {
        println!("{line}");
    }
    // The row length is the run's; here samples are kept whole.
    let spec = args.chat.data_spec(Some(args.data.clone()), i64::MAX);
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} prepare: {msg}").expect("a valid template"),
    );
    let started = Instant::now();
    let mut first: Option<u64> = None;
    let manifest = prepare_tokens(
        &model,
        &spec,
        &PrepareSpec {
            out: args.out.clone(),
            rows_per_shard: args.rows_per_shard,
            threads,
        },
        &mut |m| {
            // Tokens/s of this run's own shards (not those resumed).
            let before = *first.get_or_insert(m.tokens - m.shards.last().map_or(0, |s| s.tokens));
            let rate = (m.tokens - before) as f64 / started.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!(
                "{} samples, {} tokens in {} shards; {rate:.0} tokens/s",
                m.samples,
                m.tokens,
                m.shards.len()
            ));
            bar.tick();
        },
    )?;
    bar.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let made = manifest.tokens - first.unwrap_or(manifest.tokens);
    println!(
        "prepared {} samples, {} tokens ({} learned) in {} shards to {}: {made} tokens tokenized in {seconds:.1} s on {threads} threads ({:.0} tokens/s)",
        manifest.samples,
        manifest.tokens,
        manifest.learned,
        manifest.shards.len(),
        args.out.display(),
        made as f64 / seconds.max(1e-9),
    );
    drop(lock);
    Ok(())
}
