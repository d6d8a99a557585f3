//! Errors of running programs: everything below (runtime, models, data,
//! sharding) plus what a run itself can hit.

use std::path::PathBuf;

/// What went wrong, in one line a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Runtime(#[from] hlo_runtime::Error),
    #[error(transparent)]
    Model(#[from] hlo_models::ModelError),
    #[error(transparent)]
    ModelConfig(#[from] hlo_models::ConfigError),
    #[error(transparent)]
    Lora(#[from] hlo_models::LoraError),
    #[error(transparent)]
    Data(#[from] hlo_data::DataError),
    #[error(transparent)]
    Sharding(#[from] hlo_partitioner::ShardingError),
    #[error(transparent)]
    Trace(#[from] hlo_ir::TraceError),
    #[error(transparent)]
    Hub(#[from] crate::hub::HubError),

    #[error(transparent)]
    Launch(#[from] hlo_rendezvous::LaunchError),
    /// Meeting the other processes failed: one never arrived, one left, or
    /// the coordinator could not be reached or served.
    #[error("{launch}: {cause}")]
    Rendezvous {
        launch: String,
        // Not `source`: the message already carries it, once.
        cause: hlo_rendezvous::KvError,
    },
    /// A program across processes on a plugin without collectives between
    /// them.
    #[error("{command} across {num_processes} processes needs collectives between processes, which the CPU plugin does not have; run one process (more devices: --devices N)")]
    CpuAcrossProcesses { command: String, num_processes: u32 },

    /// `devices` was asked for explicitly and the mesh spans another count.
    #[error("the mesh {mesh} spans {mesh_devices} devices but {devices} were asked for (--devices); give a mesh whose sizes multiply to {devices}, or leave one of them out")]
    MeshDevices {
        mesh: String,
        mesh_devices: i64,
        devices: u32,
    },
    /// A mesh axis no partition rule splits over.
    #[error("the mesh {mesh} has an axis `{axis}`, which no partition rule splits over; the axes are dp, fsdp and mp")]
    MeshAxis { mesh: String, axis: String },
    /// The plugin has fewer devices than the run needs.
    #[error("{what} needs {needs} devices but the {plugin} plugin has {has}")]
    TooFewDevices {
        what: String,
        needs: i64,
        has: usize,
        plugin: String,
    },
    /// A rollout setting or input that cannot be used, as the rollout
    /// machinery says it (the objectives over it give it as theirs:
    /// `objectives::rollouts::as_objective`).
    #[error("rollouts: {0}")]
    Rollout(String),
    /// A reward failed or gave a non-finite value.
    #[error("--reward {name}: {why}")]
    Reward { name: String, why: String },
    /// A wait cut short by SIGINT or SIGTERM: the trainer stops as the
    /// signal asks (finishing the step in flight and saving), not as on
    /// an error.
    #[error("stopped by a signal while {during}")]
    Interrupted { during: String },
    /// A setting or input an objective cannot take.
    #[error("--objective {objective}: {why}")]
    Objective {
        objective: &'static str,
        why: String,
    },
    /// The data's shape does not suit the objective (pairs for SFT, or
    /// SFT rows for a preference objective).
    #[error("{}: {why}", path.display())]
    DataForObjective { path: PathBuf, why: String },
    /// A file or folder could not be read, written or created.
    #[error("cannot {action} {}: {cause}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    /// A compiled step's file that cannot be read, or that is not this
    /// run's step.
    #[error("{0}")]
    Executable(String),
    /// A GPU target its compiler cannot compile for as asked.
    #[error("--target {target}: {why}")]
    Target { target: String, why: String },
    /// The peak FLOP/s given for MFU is not a positive number.
    #[error("the peak TFLOP/s must be a positive number, got {0}")]
    PeakTflops(f64),
    /// Serving limits out of range.
    #[error("{0}")]
    ServingLimits(&'static str),
    /// A thread of ours could not be started.
    #[error("cannot start {what}: {cause}")]
    Thread {
        what: &'static str,
        cause: std::io::Error,
    },
    /// The batcher's test hook set to something other than a token id.
    #[error(
        "HLO_TRAIN_TEST_FAIL_ON_TOKEN is {0:?}, not a token id (a test hook: unset it in service)"
    )]
    TestHookToken(String),
    /// The batcher's thread ended before it was ready.
    #[error("the batcher stopped while starting")]
    BatcherStopped,
    /// An adapter with `modules_to_save`, which a shared batch cannot serve.
    #[error("adapter {}: modules_to_save {modules:?} replace whole base weights, which requests sharing a batch cannot each have; merge it (hlo-train merge) and serve the merged model", dir.display())]
    AdapterModulesToSave { dir: PathBuf, modules: Vec<String> },
    /// An adapter with LoRA on a mixture of experts' fused experts, which
    /// the serving tables do not hold yet.
    #[error("adapter {}: LoRA on the experts (target_parameters {parameters:?}) is not served yet; merge it (hlo-train merge) and serve the merged model", dir.display())]
    AdapterOnExperts {
        dir: PathBuf,
        parameters: Vec<String>,
    },
    /// An adapter of a larger rank than the serving tables hold.
    #[error("adapter {} has rank {rank}, above --max-lora-rank {max}", dir.display())]
    AdapterRankAbove { dir: PathBuf, rank: i64, max: i64 },
    /// An adapter name that is taken.
    #[error("adapter `{name}` is already loaded; unload it first")]
    AdapterLoaded { name: String },
    /// An adapter trained for another base than the served one.
    #[error("adapter {}: it was trained for {declared}, {why}; it would compute something else on the served model", dir.display())]
    AdapterBase {
        dir: PathBuf,
        declared: String,
        why: String,
    },
    /// An adapter without a tensor the step needs.
    #[error("the adapter has no `{tensor}`")]
    AdapterLacks { tensor: String },
    /// Generation met NaN or infinite logits (the adapter, or the prompt,
    /// overflows).
    #[error("prompt {row} of {rows}: the logits of completion token {token} are NaN or infinite (the adapter or the prompt overflows); no token could be sampled")]
    NonFiniteLogits {
        row: usize,
        rows: usize,
        token: usize,
    },
    /// A benchmark whose loss is not finite.
    #[error(
        "the benchmark's loss is {loss}: the step is numerically broken for this configuration"
    )]
    BenchLoss { loss: f64 },
    /// The demo task with a model without a tokenizer.
    #[error("the demo data needs a tokenizer: pass --data or --tokenizer")]
    DemoNeedsTokenizer,
    /// Data of which no sample has a learned token within a row.
    #[error("none of the {samples} samples has a learned token within a row of {seq} tokens{}: their prompts fill the row; use a longer --seq", earliest.map_or(String::new(), |k| format!(" (the earliest learned token is at position {k})")))]
    NothingToLearn {
        samples: usize,
        seq: usize,
        earliest: Option<usize>,
    },
    /// A weight name the model does not have.
    #[error("the model has no weight `{name}`")]
    NoWeight { name: String },
    /// A JSON file that could not be read or written.
    #[error("{}: not JSON: {cause}", path.display())]
    Json {
        path: PathBuf,
        cause: serde_json::Error,
    },
    /// A `generation_config.json` whose `eos_token_id` is not ids.
    #[error("{}: eos_token_id is not an id or a list of ids", path.display())]
    EosIds { path: PathBuf },
    /// Evaluation asked of a session compiled without its eval step.
    #[error("held-out data needs a session built with an eval step")]
    NoEvalStep,
    /// Value tracing outside eager mode.
    #[error("tracing values needs eager mode")]
    TraceNeedsEager,
    /// A coordinator address process 0 cannot serve on.
    #[error("{0}")]
    Coordinator(String),
    /// A broken invariant of ours (a bug, not the input).
    #[error("internal error: {0}")]
    Internal(String),
    /// A block or chunk size that does not divide the row length.
    #[error("--{setting} {value} does not divide --seq {seq}")]
    NotDividing {
        setting: &'static str,
        value: i64,
        seq: i64,
    },
    #[error("--attention-block sets the blocks of --attention blockwise, not naive or cudnn")]
    BlockOfNaiveAttention,
    /// `--attention cudnn` where cuDNN's attention cannot run the step.
    #[error("--attention cudnn: {0}")]
    Cudnn(String),
    /// A bitsandbytes NF4 checkpoint asked to change its double
    /// quantization.
    #[error("{model} is stored in NF4 {} double quantization; {} cannot change that", if *.stored_double_quant { "with" } else { "without" }, if *.stored_double_quant { "--quantize nf4 without --double-quant" } else { "--double-quant" })]
    Nf4Stored {
        model: String,
        stored_double_quant: bool,
    },
    /// A base that cannot be quantized to NF4.
    #[error("--quantize nf4 for {model}: {cause}")]
    Quantize {
        model: String,
        cause: hlo_models::ConfigError,
    },
    /// Full finetuning asked of an NF4 base.
    #[error("--full trains every weight, and NF4 weights are frozen: finetune a LoRA adapter on the quantized base (QLoRA), or drop --quantize")]
    FullOfNf4,
    /// A random initialisation asked of a LoRA run.
    #[error("--init random trains a model from scratch, every weight of it: add --full (a LoRA adapter over random weights learns nothing a base can use)")]
    RandomInitLora,
    /// An output folder that holds another run.
    #[error("--out {} holds a run already: continue it with --resume {}, or pass --overwrite to replace it", out.display(), out.display())]
    OutHoldsRun { out: PathBuf },
    /// An output path that is a file.
    #[error("--out {} is a file, not a folder", out.display())]
    OutIsFile { out: PathBuf },
    /// Saving every N steps with nowhere to save.
    #[error("--save-every needs --out")]
    SaveEveryNeedsOut,
    /// A caller's hook failed (a report file could not be written, say).
    #[error(transparent)]
    Hook(Box<dyn std::error::Error + Send + Sync>),
    /// [`crate::run::Run::train`] called again on a run that has trained.
    #[error("this run has trained already: build a new Run (resuming its output folder) to train further")]
    RunFinished,
    /// An adapter to start from that trains with dropout.
    #[error("--init-adapter {}: its adapter_config.json sets lora_dropout {dropout}, and hlo-train trains without dropout (the result would differ from PEFT's); set it to 0 to start from this adapter", dir.display())]
    AdapterDropout { dir: PathBuf, dropout: f64 },
    /// Random weights for a model too large to make on the host.
    #[error("{model} has {parameters} parameters: random weights that large are not built on the host; pass --checkpoint")]
    TooLargeForRandomWeights { model: String, parameters: i64 },
    /// A step's loss or gradient norm is not finite.
    #[error("step {step}: the loss is {loss} and the gradient norm {grad_norm}; stopped{}", kept_note(*.kept))]
    NonFinite {
        step: i64,
        loss: f64,
        grad_norm: f64,
        kept: Option<i64>,
    },
    /// Eager value tracing found the first op that made a non-finite value.
    #[error("step {step}: the first non-finite value comes from `{op}` in scope `{scope}` ({bad} of {total} values); stopped{}", kept_note(*.kept))]
    NonFiniteValue {
        step: i64,
        op: String,
        scope: String,
        bad: usize,
        total: usize,
        kept: Option<i64>,
    },
    /// Parameters or optimizer state that are not finite, found before a
    /// save or on resume.
    #[error("{what}: `{tensor}` has {bad} non-finite values of {total}; nothing was saved from it (lower --lr, or resume an earlier checkpoint)")]
    NonFiniteState {
        what: String,
        tensor: String,
        bad: usize,
        total: usize,
    },
    /// A saved state holding values that are not finite, found when it is
    /// read (a resume, an export).
    #[error("{what}: `{tensor}` has {bad} non-finite values of {total}; this state cannot be resumed or exported (resume or export an earlier checkpoint)")]
    NonFiniteSaved {
        what: String,
        tensor: String,
        bad: usize,
        total: usize,
    },
    /// A sharded state that cannot be read as saved: a file missing,
    /// damaged, or not covering a tensor.
    #[error("{}: {message}", path.display())]
    ShardedState { path: PathBuf, message: String },
    /// A run folder `export` cannot make an HF folder of.
    #[error("export: {0}")]
    Export(String),
    /// A saved run that cannot be continued as asked.
    #[error("--resume: {0}")]
    Resume(String),
    #[error("{what} `{pattern}` is not a regex: {cause}")]
    Regex {
        what: &'static str,
        pattern: String,
        cause: regex::Error,
    },
}

/// What a run stopped by a non-finite value leaves: the step of the
/// checkpoint in `--out`, if one was saved (or resumed from).
fn kept_note(kept: Option<i64>) -> String {
    match kept {
        Some(step) => format!(" (the checkpoint of step {step} is kept)"),
        None => " (no checkpoint was saved)".into(),
    }
}

impl EngineError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> EngineError {
        let path = path.into();
        move |cause| EngineError::Io {
            action,
            path,
            cause,
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
