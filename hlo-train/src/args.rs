//! Flag groups several commands share, and what they turn into for the
//! engine: which plugin and devices, which model, which step.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::Args;
use hlo_engine::device::backend::refuse_cpu_across_processes;
use hlo_engine::device::backend::{BackendOptions, CompilerSpec};
use hlo_engine::device::processes::{Launch, LaunchFlags, RunToken};
use hlo_engine::inputs::model::{Model, ModelSpec, TokenizerSpec};
use hlo_engine::models::attention::AttentionKind;
use hlo_engine::models::train::TrainConfig;
use hlo_engine::named::Named;
use hlo_engine::objectives::Objective;
use hlo_engine::partitioner::Mesh;
use hlo_engine::runtime::{PluginKind, PluginSpec};

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

    #[command(flatten)]
    pub compiler: CompilerSpec,

    #[command(flatten)]
    pub processes: ProcessArgs,
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
            xla_options: self.compiler.xla_options.clone(),
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

/// The model of these flags, with `--tokenizer` when given.
pub fn open_model(model: &ModelSpec, tokenizer: &TokenizerSpec) -> Result<Model> {
    Ok(Model::open(&model.source())?.with_tokenizer_file(tokenizer.tokenizer.clone()))
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
