//! `hlo-train serve`: opens the model, starts the engine's [`Batcher`]
//! with the adapters given, and runs the OpenAI-compatible server of
//! `hlo-serve` until SIGTERM.

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use hlo_engine::infer::batcher::{Batcher, BatcherHandle, BatcherOptions};
use hlo_engine::inputs::model::Model;
use hlo_engine::inputs::model::{BaseSpec, TokenizerSpec};
use hlo_engine::ir::DType;
use hlo_engine::models::decoder::{LoraSelect, ModelConfig};
use hlo_engine::partitioner::Mesh;
use hlo_serve::ServerConfig;

use crate::args::PluginArgs;
use crate::saved_run::AdapterRuns;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LoraSelectArg {
    Auto,
    Gather,
    OneHot,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub recipe: crate::args::RecipeArgs,

    #[command(flatten)]
    pub base: BaseSpec,

    #[command(flatten)]
    pub tokenizer: TokenizerSpec,

    #[command(flatten)]
    pub plugin: PluginArgs,

    /// Device mesh for the weights (`dp=1,fsdp=2,mp=2`; default one device,
    /// or dp=1,fsdp=N,mp=1 over --devices).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// The name clients give as `model` for the base model (default: the
    /// checkpoint folder's name, or the preset's).
    #[arg(long)]
    pub served_model_name: Option<String>,

    /// An adapter to serve, `NAME=DIR` (a PEFT folder or hub id); repeat
    /// for more. Run folders (with `train_state/`) also give the base,
    /// tokenizer, NF4 and dtype their runs used, where their flags are not
    /// given.
    #[arg(long, value_parser = adapter_arg)]
    pub adapter: Vec<(String, PathBuf)>,

    /// The chat template's folder (holding tokenizer_config.json), instead
    /// of the checkpoint's; or a hub id.
    #[arg(long, value_parser = hlo_engine::settings::hub_chat_template)]
    pub chat_template: Option<PathBuf>,

    /// The address to listen on (0.0.0.0: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,

    /// The port to listen on; 0 picks a free one (printed when listening).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// Requests generating at once (decode slots).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_batch_size: u32,

    /// Adapters resident in device memory at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_loras: u32,

    /// Parsed adapters kept in host memory (more are read from disk again).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_cpu_loras: u32,

    /// The largest adapter rank served.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_lora_rank: u32,

    /// Prompt plus completion, in tokens (default: the model's positions,
    /// at most 2048).
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..))]
    pub max_model_len: Option<u32>,

    /// Requests waiting for a slot before more are answered 429.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_queue: u32,

    /// Require `Authorization: Bearer KEY` on /v1/ requests.
    #[arg(long, env = "HLO_TRAIN_API_KEY")]
    pub api_key: Option<String>,

    /// How each request's adapter is read from the tables: a gather by
    /// index, a one-hot contraction over the entries, or auto (a gather for
    /// one or two running requests, the contraction above: the faster at
    /// each size, BENCHMARKS.md).
    #[arg(long, value_enum, default_value = "auto")]
    pub lora_select: LoraSelectArg,

    /// The token budget of an engine step (vLLM's
    /// --max-num-batched-tokens): each step runs the running requests'
    /// decode tokens and a chunk of a joining prompt of up to half the budget
    /// (the whole budget when nothing runs), in one program, so arrivals
    /// never stall running streams for more than one chunk's work. At
    /// least 16. Smaller: shorter stalls of running streams, longer waits
    /// for the first token of a burst (BENCHMARKS.md).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(16..))]
    pub max_num_batched_tokens: u32,

    /// Compute every prompt whole, even where another request already
    /// holds the keys and values of its prefix (same tokens, same adapter).
    #[arg(long)]
    pub no_prefix_caching: bool,

    /// Seconds a stream may send nothing (a wait for a slot, a long
    /// prefill) before a keep-alive comment goes out, so that proxies and
    /// clients with idle timeouts keep it open.
    #[arg(long, default_value_t = hlo_serve::DEFAULT_SSE_KEEP_ALIVE.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub sse_keep_alive: u64,

    /// Seed for random weights (presets and --config).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn adapter_arg(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, dir)) if !name.is_empty() && !dir.is_empty() => {
            Ok((name.to_string(), hlo_engine::settings::hub_adapter(dir)?))
        }
        _ => Err(format!("expected NAME=DIR, got `{s}`")),
    }
}

pub fn run(args: &ServeArgs) -> Result<()> {
    // What the flags leave open is as the adapters' run computed it.
    let runs = AdapterRuns::read(args.adapter.iter().map(|(_, dir)| dir.as_path()))?;
    let tokenizer_file = runs.tokenizer_for(&args.tokenizer)?;
    let model = Model::open(&runs.model_for(&args.base.model)?)?
        .with_tokenizer_file(tokenizer_file.clone())
        .quantized(runs.nf4_for(&args.base.quantize)?)?;
    let dtype = runs.dtype_for(&args.base.dtype, args.plugin.is_cpu())?;
    runs.announce("serve");
    let tokenizer = model.tokenizer(tokenizer_file.as_deref())?;
    // A checkpoint without a template serves completions only.
    let chat_template = model.chat_template(args.chat_template.as_deref())?;
    let model_name = served_model_name(args, &model);
    check_adapter_names(args, &model_name)?;
    let max_model_len = max_model_len(args, &model.config)?;
    let eos_ids = model.generation_eos_ids()?;
    let options = batcher_options(args, max_model_len, dtype);
    let batcher = start_batcher(args, model, options, &model_name)?;
    let server = ServerConfig {
        model_name: model_name.clone(),
        api_key: args.api_key.clone(),
        eos_ids,
        tokenizer,
        chat_template,
        sse_keep_alive: std::time::Duration::from_secs(args.sse_keep_alive),
    };
    let adapters = batcher.adapters();
    hlo_serve::run(
        batcher,
        server,
        SocketAddr::new(args.host, args.port),
        |addr| print_serving(&model_name, &adapters, addr),
    )?;
    eprintln!("stopped: every request finished");
    Ok(())
}

/// The name clients give for the base model: --served-model-name, else the
/// checkpoint folder's name (resolved through links), else the model's.
fn served_model_name(args: &ServeArgs, model: &Model) -> String {
    match &args.served_model_name {
        Some(n) => n.clone(),
        None => match &model.checkpoint {
            Some(c) => std::fs::canonicalize(&c.dir)
                .unwrap_or_else(|_| c.dir.clone())
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| model.name.clone()),
            None => model.name.clone(),
        },
    }
}

/// Refuses an adapter named as the base model, which clients could not tell
/// apart from it.
fn check_adapter_names(args: &ServeArgs, model_name: &str) -> Result<()> {
    for (name, _) in &args.adapter {
        if *name == model_name {
            bail!("--adapter {name}: the name is the base model's (--served-model-name)");
        }
    }
    Ok(())
}

/// --max-model-len checked against the model's positions, or by default
/// the model's positions capped at 2048.
fn max_model_len(args: &ServeArgs, config: &ModelConfig) -> Result<i64> {
    Ok(match args.max_model_len {
        Some(n) => {
            config.check_positions("--max-model-len", i64::from(n))?;
            i64::from(n)
        }
        None => config.max_position_embeddings.min(2048),
    })
}

/// The batcher's options from the serving flags.
fn batcher_options(args: &ServeArgs, max_model_len: i64, dtype: DType) -> BatcherOptions {
    BatcherOptions {
        max_batch_size: args.max_batch_size as usize,
        max_loras: args.max_loras as usize,
        max_cpu_loras: args.max_cpu_loras as usize,
        max_lora_rank: i64::from(args.max_lora_rank),
        max_model_len,
        max_queue: args.max_queue as usize,
        select: match args.lora_select {
            LoraSelectArg::Auto => None,
            LoraSelectArg::Gather => Some(LoraSelect::Gather),
            LoraSelectArg::OneHot => Some(LoraSelect::OneHot),
        },
        dtype,
        max_num_batched_tokens: args.max_num_batched_tokens as usize,
        background_compile: true,
        prefix_caching: !args.no_prefix_caching,
    }
}

/// Spawns the batcher, saying first what it is doing: placing the weights
/// and compiling take seconds to minutes before the port opens.
fn start_batcher(
    args: &ServeArgs,
    model: Model,
    options: BatcherOptions,
    model_name: &str,
) -> Result<BatcherHandle> {
    let backend = args.plugin.backend(args.mesh.as_ref());
    let starting = format!(
        "starting: placing {model_name}'s weights and compiling its serving programs ({} step shapes), then listening on {}",
        hlo_engine::infer::batcher::step_shapes(&options).len(),
        SocketAddr::new(args.host, args.port)
    );
    let announce = Box::new(move || eprintln!("{starting}"));
    Batcher::spawn_announced(backend, model, options, &args.adapter, args.seed, announce)
        .context("cannot start serving")
}

/// Prints the line that says the server listens (at `addr`, which may be a
/// port picked for --port 0), flushed so that a watching parent sees it.
fn print_serving(model_name: &str, adapters: &[String], addr: SocketAddr) {
    println!(
        "serving {model_name} (adapters: {}) on http://{addr}",
        if adapters.is_empty() {
            "none".to_string()
        } else {
            adapters.join(", ")
        }
    );
    let _ = std::io::stdout().flush();
}
