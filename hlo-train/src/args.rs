//! Flag groups several commands share, and what they turn into for the
//! engine: which plugin and devices, which model, which step.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, ValueEnum};
use hlo_engine::device::backend::refuse_cpu_across_processes;
use hlo_engine::device::backend::BackendOptions;
use hlo_engine::device::processes::{Launch, LaunchFlags, RunToken};
use hlo_engine::hub::{self, HubFiles};
use hlo_engine::inputs::model::{Model, ModelSource};
use hlo_engine::ir::DType;
use hlo_engine::models::attention::AttentionKind;
use hlo_engine::models::nf4::Nf4Config;
use hlo_engine::models::train::TrainConfig;
use hlo_engine::named::Named;
use hlo_engine::objectives::Objective;
use hlo_engine::partitioner::Mesh;
use hlo_engine::runtime::{parse_xla_option, PluginKind, PluginSpec, XlaOption};

/// `--plugin` and `--devices`.
#[derive(Args, Clone, Debug)]
pub struct PluginArgs {
    /// PJRT plugin: cpu, cuda, rocm, or a path to a plugin .so.
    #[arg(long, env = "HLO_TRAIN_PLUGIN", default_value = "cpu")]
    pub plugin: PluginSpec,

    /// Devices to use: the CPU plugin makes this many virtual devices, a
    /// GPU plugin's first ones are used. Must equal the mesh's size when
    /// both are given (default: the mesh's size, else 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub devices: Option<u32>,

    /// An XLA compiler flag for every program this command compiles,
    /// KEY=VALUE (repeatable): `xla_cpu_enable_fast_math=false`,
    /// `xla_gpu_enable_triton_gemm=false`. The value is a bool
    /// (true/false), an integer, a number with a point, else text, and
    /// must be of the flag's type. Per compile, on top of XLA's defaults
    /// (XLA_FLAGS applies to the whole process).
    #[arg(long = "xla-option", value_name = "KEY=VALUE", value_parser = xla_option)]
    pub xla_option: Vec<(String, XlaOption)>,

    #[command(flatten)]
    pub processes: ProcessArgs,
}

/// `--xla-option`'s value.
pub(crate) fn xla_option(s: &str) -> Result<(String, XlaOption), String> {
    parse_xla_option(s).map_err(|e| e.to_string())
}

/// `--num-processes`, `--process-id`, `--coordinator`, `--init-timeout`,
/// `--run-token`: one run over several processes (each flag over SLURM's or
/// torchrun's variables).
#[derive(Args, Clone, Debug, Default)]
pub struct ProcessArgs {
    /// Processes in the run (default: SLURM_NTASKS under srun, WORLD_SIZE
    /// under torchrun, else 1). `--devices` and the mesh then count the
    /// devices of all of them.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub num_processes: Option<u32>,

    /// This process's index, 0 to N-1 (default: SLURM_PROCID or RANK).
    #[arg(long)]
    pub process_id: Option<u32>,

    /// HOST:PORT where process 0 serves the rendezvous (default: the first
    /// host of SLURM_STEP_NODELIST on port 61440 + SLURM_JOB_ID mod 4096,
    /// or MASTER_ADDR:MASTER_PORT).
    #[arg(long)]
    pub coordinator: Option<String>,

    /// Seconds to wait for every process to arrive, and for any one reply
    /// of another process.
    #[arg(long, default_value_t = 300.0, value_parser = positive_seconds)]
    pub init_timeout: f64,

    /// Secret every process must prove it holds before it joins the run
    /// (never sent, never printed; default: HLO_TRAIN_RUN_TOKEN, the safer
    /// place, since a flag shows in the process list). Give every process
    /// the same one.
    #[arg(long, value_name = "TOKEN", value_parser = run_token)]
    pub run_token: Option<RunToken>,
}

/// `--run-token`'s value; the message never repeats it (it can only be
/// empty here anyway).
fn run_token(s: &str) -> Result<RunToken, String> {
    RunToken::new(s).map_err(|e| e.to_string())
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() && x <= 86_400.0 => Ok(x),
        _ => Err("expected seconds, more than 0 and at most 86400".into()),
    }
}

impl ProcessArgs {
    /// This process's launch, from these flags and the environment (None:
    /// a run of one).
    pub fn launch(&self) -> Result<Option<Launch>> {
        let flags = LaunchFlags {
            num_processes: self.num_processes,
            process_id: self.process_id,
            coordinator: self.coordinator.clone(),
            init_timeout: Some(Duration::from_secs_f64(self.init_timeout)),
            run_token: self.run_token.clone(),
        };
        Ok(Launch::resolve(&flags, |k| std::env::var(k).ok())?)
    }
}

impl PluginArgs {
    /// The engine's options for these flags and `mesh`. The launch was
    /// checked up front (`check_launch`), so it is read again here.
    pub fn backend(&self, mesh: Option<&Mesh>) -> BackendOptions {
        BackendOptions {
            plugin: self.plugin.clone(),
            devices: self.devices,
            mesh: mesh.cloned(),
            launch: self.processes.launch().ok().flatten(),
            xla_options: self.xla_option.clone(),
        }
    }

    /// Refuses, before anything loads or waits, a `command` across
    /// processes where it cannot run: on the CPU plugin (no collectives
    /// between processes), and for now anything but `devices` and `train`.
    pub fn check_launch(&self, command: &str) -> Result<()> {
        let Some(launch) = self.processes.launch()? else {
            return Ok(());
        };
        if command == "devices" {
            return Ok(());
        }
        refuse_cpu_across_processes(&self.plugin, &launch, command)?;
        if command == "train" {
            return Ok(());
        }
        bail!(
            "{command} across {} processes is not in this build: `train` (JIT) and `devices` run across processes, {command} not yet",
            launch.num_processes
        )
    }

    pub fn is_cpu(&self) -> bool {
        self.plugin.kind() == PluginKind::Cpu
    }
}

pub use hlo_engine::settings::{named, positive};

/// The value parser of `--objective` for a command that takes only the
/// objectives `takes` keeps (`eval`, `data`): those alone listed in
/// `--help`, any other refused by clap naming them.
pub fn objectives_where(takes: fn(Objective) -> bool) -> impl TypedValueParser<Value = Objective> {
    let names: Vec<&'static str> = <Objective as Named>::ALL
        .iter()
        .copied()
        .filter(|o| takes(*o))
        .map(Objective::name)
        .collect();
    PossibleValuesParser::new(names).try_map(|s| s.parse::<Objective>())
}

/// A path flag that also takes a Hugging Face hub id
/// `ORG/NAME[@REVISION]`: a path that exists is itself; an id is its
/// snapshot in the HF cache, downloaded there when missing (never with
/// `HF_HUB_OFFLINE=1`).
fn hub_path(s: &str, files: HubFiles) -> Result<PathBuf, String> {
    hub::resolve(Path::new(s), files).map_err(|e| e.to_string())
}

/// `--checkpoint`: an HF model folder or hub id.
pub fn hub_model(s: &str) -> Result<PathBuf, String> {
    hub_path(s, HubFiles::Model)
}

/// `--adapter`, `--init-adapter`: a PEFT adapter folder or hub id.
pub fn hub_adapter(s: &str) -> Result<PathBuf, String> {
    hub_path(s, HubFiles::Adapter)
}

/// `--tokenizer`: a tokenizer.json, or a hub id (its tokenizer.json).
pub fn hub_tokenizer(s: &str) -> Result<PathBuf, String> {
    hub_path(s, HubFiles::Tokenizer)
}

/// `--chat-template`: a folder with tokenizer_config.json, or a hub id.
pub fn hub_chat_template(s: &str) -> Result<PathBuf, String> {
    hub_path(s, HubFiles::ChatTemplate)
}

/// `--recipe`: the command's flags from a YAML file (expanded into flags
/// before parsing, by `recipe::expand`).
#[derive(Args, Clone, Debug)]
pub struct RecipeArgs {
    /// A YAML file of settings, one key per flag (`lora_rank: 8` or
    /// `lora-rank: 8`); flags on the command line win over its keys.
    /// `train --out DIR` writes the run's own as DIR/recipe.yaml, which
    /// `--recipe DIR` reads.
    #[arg(long)]
    pub recipe: Option<PathBuf>,
}

/// The base model as the commands that run it take it: which model,
/// its weights in NF4 or not, and the dtype it computes in.
#[derive(Args, Clone, Debug)]
pub struct BaseArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub quantize: QuantizeArgs,

    #[command(flatten)]
    pub dtype: DtypeArgs,
}

/// `--model`, `--checkpoint`, `--config`: which model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model preset (random weights; the exact HF config): tiny,
    /// llama3.2-1b, llama3.2-3b, llama3.1-8b, llama3.1-70b, llama3.1-405b,
    /// qwen2.5-0.5b, qwen2.5-7b, qwen3-0.6b, qwen3-8b, mistral-7b,
    /// gemma3-270m, gemma3-1b, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b,
    /// gpt-oss-20b, gpt-oss-120b; mpt-scale-1b, mpt-scale-3b, mpt-scale-7b
    /// (MPT's sizes as Llama configs, for pretraining plans) (default:
    /// tiny).
    #[arg(long)]
    pub model: Option<String>,

    /// HF model folder: config.json + *.safetensors (+ index); or a hub
    /// id ORG/NAME[@REVISION], read from the HF cache (downloaded there
    /// when missing).
    #[arg(long, conflicts_with = "config", value_parser = hub_model)]
    pub checkpoint: Option<PathBuf>,

    /// Random weights from an HF config.json of a supported family (Llama,
    /// Qwen2/2.5, Qwen3, Mistral, Gemma 3 text, Qwen3-MoE, Mixtral,
    /// gpt-oss).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

/// The model of these flags, with `--tokenizer` when given.
pub fn open_model(model: &ModelArgs, tokenizer: &TokenizerArgs) -> Result<Model> {
    Ok(Model::open(&model.source())?.with_tokenizer_file(tokenizer.tokenizer.clone()))
}

/// `--quantize` and `--double-quant`: the base projections in NF4 (QLoRA).
#[derive(Args, Clone, Debug, Default)]
pub struct QuantizeArgs {
    /// Store every q/k/v/o/gate/up/down projection in 4-bit NormalFloat
    /// (bitsandbytes' NF4, blocks of 64), quantized on load and
    /// dequantized inside the step; embeddings, norms and the LM head
    /// stay in --dtype. A checkpoint saved in bitsandbytes 4-bit NF4 is
    /// read as it is, with or without this flag.
    #[arg(long, value_enum)]
    pub quantize: Option<QuantizeArg>,

    /// With --quantize nf4: quantize the block scales again in 8 bits, as
    /// bitsandbytes' bnb_4bit_use_double_quant (held dequantized on the
    /// devices).
    #[arg(long, requires = "quantize")]
    pub double_quant: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QuantizeArg {
    Nf4,
}

impl QuantizeArgs {
    /// `model` with its projections in NF4 when asked (refused where a
    /// projection's rows are not whole blocks).
    pub fn apply(&self, model: Model) -> Result<Model> {
        Ok(model.quantized(self.nf4())?)
    }

    /// The NF4 settings these flags ask for.
    pub fn nf4(&self) -> Option<Nf4Config> {
        self.quantize.map(|QuantizeArg::Nf4| Nf4Config {
            double_quant: self.double_quant,
        })
    }
}

/// `--dtype`.
#[derive(Args, Clone, Debug)]
pub struct DtypeArgs {
    /// Parameter and compute dtype of the base model (default: f32 on the
    /// CPU plugin, bf16 elsewhere).
    #[arg(long, value_parser = named::<DType>())]
    pub dtype: Option<DType>,
}

impl DtypeArgs {
    /// `--dtype`, or f32 on the CPU and bf16 elsewhere.
    pub fn dtype(&self, cpu: bool) -> DType {
        match self.dtype {
            Some(d) => d,
            None if cpu => DType::F32,
            None => DType::BF16,
        }
    }
}

/// `--tokenizer`.
#[derive(Args, Clone, Debug, Default)]
pub struct TokenizerArgs {
    /// HF tokenizer.json (default: the checkpoint's; byte-level for
    /// tiny); or a hub id (its tokenizer.json).
    #[arg(long, value_parser = hub_tokenizer)]
    pub tokenizer: Option<PathBuf>,
}

impl ModelArgs {
    pub fn source(&self) -> ModelSource {
        match (&self.checkpoint, &self.config) {
            (Some(dir), _) => ModelSource::Checkpoint(dir.clone()),
            (None, Some(path)) => ModelSource::Config(path.clone()),
            (None, None) => {
                ModelSource::Preset(self.model.clone().unwrap_or_else(|| "tiny".into()))
            }
        }
    }
}

/// Parses `1,2,3`.
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    text.split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .map_err(|_| anyhow::anyhow!("`{t}` in --prompt-ids is not a token id"))
        })
        .collect()
}

/// Bytes in GB, MB or KB, whichever reads best.
pub fn gb(b: u64) -> String {
    match b {
        1_000_000_000.. => format!("{:.2} GB", b as f64 / 1e9),
        1_000_000.. => format!("{:.2} MB", b as f64 / 1e6),
        1_000.. => format!("{:.1} KB", b as f64 / 1e3),
        _ => format!("{b} bytes"),
    }
}

/// A generated text as one printable line: quoted with escapes, or its
/// token ids when it is not valid text (a random model's bytes).
pub fn printable(text: &str, ids: &[u32]) -> String {
    if text.contains('\u{fffd}') {
        let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
        format!("token ids [{}] (not valid text)", ids.join(", "))
    } else {
        format!("\"{}\"", text.escape_debug())
    }
}

/// The attention of a step as `--json` gives it: `{"kind": "naive"}` or
/// `{"kind": "blockwise", "block": 512}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum AttentionSummary {
    Naive,
    Blockwise { block: i64 },
    Cudnn,
}

impl AttentionSummary {
    pub fn of(tc: &TrainConfig) -> AttentionSummary {
        match tc.attention {
            AttentionKind::Naive => AttentionSummary::Naive,
            AttentionKind::Blockwise { block } => AttentionSummary::Blockwise { block },
            AttentionKind::Cudnn => AttentionSummary::Cudnn,
        }
    }
}

/// A usage error (bad flag, bad value) as one line.
pub fn usage_error(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let message: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty() && !l.starts_with("Usage:"))
        .map(str::trim)
        .collect();
    format!("{} (see --help)", message.join(" "))
}
