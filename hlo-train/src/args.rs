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
use hlo_engine::inputs::dataset::DataSpec;
use hlo_engine::inputs::model::{Model, ModelSource};
use hlo_engine::ir::DType;
use hlo_engine::models::attention::AttentionKind;
use hlo_engine::models::decoder::ModelConfig;
use hlo_engine::models::nf4::Nf4Config;
use hlo_engine::models::train::TrainConfig;
use hlo_engine::named::Named;
use hlo_engine::objectives::Objective;
use hlo_engine::partitioner::Mesh;
use hlo_engine::runtime::{parse_xla_option, PluginKind, PluginSpec, XlaOption};
use hlo_engine::step::policy::StepPolicy;
use hlo_engine::step::{
    AttentionChoice, LoraSpec, OptimSpec, OptimizerKind, RematChoice, ScheduleKind, StepSpec,
    Toggle,
};

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

pub use hlo_engine::objectives::settings::{named, non_negative, positive};

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

/// `--chat-template` and `--train-on-inputs`: how `{"messages"}` data is
/// read (`train`, `data`, `eval`).
#[derive(Args, Clone, Debug)]
pub struct ChatArgs {
    /// The folder whose tokenizer_config.json holds the chat template for
    /// `{"messages"}` data (default: the checkpoint's).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,

    /// With `{"messages"}` data, count system and user turns in the loss
    /// too (by default only the assistant's replies are learned).
    #[arg(long)]
    pub train_on_inputs: bool,
}

impl ChatArgs {
    /// The engine's description of `data` (None: the demo task) read with
    /// these settings for rows of `seq` tokens.
    pub fn spec(&self, data: Option<PathBuf>, seq: i64) -> DataSpec {
        DataSpec {
            path: data,
            chat_template: self.chat_template.clone(),
            train_on_inputs: self.train_on_inputs,
            seq: seq as usize,
            pairs: false,
            unpaired: false,
            whole_pairs: false,
        }
    }
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

/// Flags that shape the traced step (what it holds and computes), shared
/// by `train`, `bench`, `dump-hlo` and `plan`.
#[derive(Args, Clone, Debug)]
pub struct StepArgs {
    /// Run the decoder layers as one scan over stacked parameters, so the
    /// program and its compile time do not grow with depth; its backward
    /// recomputes each layer. auto: on the CPU for models of 24 layers or
    /// more, and NF4 bases (whose layers then dequantize their weights
    /// again in the backward pass instead of keeping them); on a GPU only
    /// when the unrolled step would not fit the device.
    #[arg(long, value_parser = named::<Toggle>(), default_value = "auto")]
    pub scan_layers: Toggle,

    /// What the backward pass recomputes instead of keeping: `layers`
    /// keeps only each decoder layer's input (less memory, about one more
    /// forward of compute); `mlp` recomputes each layer's MLP and keeps
    /// the rest (the MLP's activations are most of a layer's); `none`
    /// keeps everything (layers unrolled unless --scan-layers on: a scan
    /// over layers always recomputes). auto: none on the CPU; on a GPU
    /// the least recompute that fits the device (none, then mlp, then
    /// layers).
    #[arg(long, value_parser = named::<RematChoice>(), default_value = "auto")]
    pub remat: RematChoice,

    /// How attention is computed: `naive` holds every head's [seq, seq]
    /// scores; `blockwise` (FlashAttention's algorithm) one block of them
    /// at a time, memory linear in --seq; `cudnn` cuDNN's fused flash
    /// attention (CUDA, bf16/f16). auto: on the CPU blockwise from 256
    /// tokens, where it is also the faster; on CUDA cudnn where it takes
    /// the model; otherwise naive where its scores fit the device, else
    /// blockwise.
    #[arg(long, value_parser = named::<AttentionChoice>(), default_value = "auto")]
    pub attention: AttentionChoice,

    /// Queries and keys per block of blockwise attention, dividing --seq
    /// (default: seq/8 within 64..=256, or the largest divisor of --seq
    /// below that); implies blockwise under --attention auto.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub attention_block: Option<i64>,

    /// Positions of each row whose logits the loss computes at a time
    /// (dividing --seq), so [tokens, vocab] logits are never all held
    /// (default: whole rows while one device's rows x seq x vocab f32
    /// logits stay under 256 MiB, else the largest divisor of --seq that
    /// keeps a chunk under it).
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub loss_chunk: Option<i64>,

    /// Micro-batches of --batch rows per optimizer step; the update is that
    /// of one batch of K·batch rows (the loss normalised by all of their
    /// tokens), at the memory of one micro-batch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i64).range(1..=4096))]
    pub grad_accum: i64,

    /// Pack several samples into each row (attention kept within each
    /// sample, positions restarting); auto: when samples average at most
    /// half of --seq.
    #[arg(long, value_parser = named::<Toggle>(), default_value = "auto")]
    pub packing: Toggle,

    /// Train every base weight instead of LoRA adapters.
    #[arg(long)]
    pub full: bool,

    /// LoRA rank r.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=65_536))]
    pub lora_rank: i64,

    /// LoRA alpha: the update is scaled by alpha/r.
    #[arg(long, default_value_t = 16.0, value_parser = positive)]
    pub lora_alpha: f64,

    /// Comma-separated module names that get adapters; on a mixture of
    /// experts also its fused experts (mlp.experts.gate_up_proj,
    /// mlp.experts.down_proj: PEFT's target_parameters).
    #[arg(
        long,
        default_value = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )]
    pub lora_targets: String,

    /// PEFT's rank-stabilised LoRA scale alpha/sqrt(r).
    #[arg(long)]
    pub use_rslora: bool,

    /// Comma-separated modules trained whole beside the adapters and saved
    /// in the adapter, as PEFT's modules_to_save: lm_head, embed_tokens,
    /// or a mixture of experts' router (gate; gpt-oss: router).
    #[arg(long, default_value = "")]
    pub modules_to_save: String,

    /// Rows per micro-batch.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch: i64,

    /// Tokens per row: longer samples are cut, shorter ones padded (or
    /// packed).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(i64).range(2..=10_000_000))]
    pub seq: i64,

    /// The optimizer, with PyTorch's semantics and defaults.
    #[arg(long, value_parser = named::<OptimizerKind>(), default_value = "adamw")]
    pub optimizer: OptimizerKind,
}

/// The optimizer's and schedule's numbers, shared by `train`, `bench`
/// and `dump-hlo` (they are constants of the program).
#[derive(Args, Clone, Debug)]
pub struct OptimArgs {
    /// AdamW's decoupled weight decay (PyTorch's default).
    #[arg(long, default_value_t = 0.01, value_parser = non_negative)]
    pub weight_decay: f64,

    /// Peak learning rate (0 trains nothing but still reports the loss
    /// and gradient norm).
    #[arg(long, default_value_t = 2e-4, value_parser = learning_rate, allow_negative_numbers = true)]
    pub lr: f64,

    /// Linear warmup steps.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    pub warmup: i64,

    /// Learning-rate schedule after warmup: constant, or cosine decay to
    /// zero at the last step.
    #[arg(long, value_parser = named::<ScheduleKind>(), default_value = "constant")]
    pub schedule: ScheduleKind,

    /// Clip the global gradient norm to this; 0 turns clipping off.
    #[arg(long, default_value_t = 1.0, value_parser = non_negative)]
    pub clip_norm: f64,
}

/// A learning rate: >= 0 and small enough that the schedule, computed in
/// f32 on the device, stays finite.
pub fn learning_rate(s: &str) -> Result<f64, String> {
    match non_negative(s) {
        Ok(v) if v <= 1e30 => Ok(v),
        Ok(_) => Err("must be at most 1e30 (the schedule is computed in f32)".into()),
        Err(e) => Err(e),
    }
}

impl Default for OptimArgs {
    fn default() -> Self {
        OptimArgs {
            weight_decay: 0.01,
            lr: 2e-4,
            warmup: 0,
            schedule: ScheduleKind::Constant,
            clip_norm: 1.0,
        }
    }
}

impl StepArgs {
    /// The engine's step settings of these flags (LoRA's from the flags,
    /// none with `--full`).
    pub fn spec(&self) -> StepSpec {
        StepSpec {
            batch: self.batch,
            seq: self.seq,
            grad_accum: self.grad_accum,
            packing: self.packing,
            scan_layers: self.scan_layers,
            remat: self.remat,
            attention: self.attention,
            attention_block: self.attention_block,
            loss_chunk: self.loss_chunk,
            lora: (!self.full).then(|| LoraSpec {
                rank: self.lora_rank,
                alpha: self.lora_alpha,
                targets: self
                    .lora_targets
                    .split(',')
                    .map(|t| t.trim().to_string())
                    .collect(),
                use_rslora: self.use_rslora,
                modules_to_save: LoraSpec::modules_from(&self.modules_to_save),
            }),
        }
    }

    /// The traced step's configuration for `config` over `mesh` with the
    /// choices of `policy` ([`StepSpec::train_config`]). `steps` is the
    /// run's length, where the cosine schedule ends.
    pub fn train_config(
        &self,
        optim: &OptimArgs,
        config: &ModelConfig,
        dtype: DType,
        (mesh, policy): (&Mesh, &StepPolicy),
        steps: i64,
    ) -> Result<TrainConfig> {
        Ok(self.spec().train_config(
            &optim.spec(self.optimizer),
            config,
            dtype,
            mesh,
            steps,
            policy,
        )?)
    }
}

impl OptimArgs {
    /// The engine's optimizer settings of these flags and `--optimizer`.
    pub fn spec(&self, optimizer: OptimizerKind) -> OptimSpec {
        OptimSpec {
            optimizer,
            weight_decay: self.weight_decay,
            lr: self.lr,
            warmup: self.warmup,
            schedule: self.schedule,
            clip_norm: self.clip_norm,
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
