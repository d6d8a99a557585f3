//! Errors of model building, checkpoints and adapters.

use std::path::PathBuf;

use hlo_ir::DType;

/// What went wrong, with the file, tensor or field it concerns.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file or folder could not be read, written or created.
    #[error("cannot {action} {}: {cause}", path.display())]
    Io {
        /// `read`, `write`, `open`, `map`, `create`.
        action: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
    /// A model configuration (`config.json` or a preset) is unusable.
    #[error("{}{problem}", path.as_ref().map(|p| format!("{}: ", p.display())).unwrap_or_default())]
    Config {
        /// The file it came from, when there is one.
        path: Option<PathBuf>,
        problem: ConfigError,
    },
    /// LoRA settings that make no adapter.
    #[error(transparent)]
    Lora(#[from] LoraError),
    /// A checkpoint folder that is not there.
    #[error("checkpoint folder {} does not exist", .0.display())]
    MissingFolder(PathBuf),
    /// A file a checkpoint's index names is not in its folder.
    #[error("{file} is missing from {}", dir.display())]
    MissingShard { file: String, dir: PathBuf },
    /// A path that names no file (it ends in `..` or `/`).
    #[error("{} is not a file path", .0.display())]
    NotAFile(PathBuf),
    /// A checkpoint's file is malformed or disagrees with its config.
    #[error("{file}: {message}")]
    Checkpoint { file: String, message: String },
    /// A PEFT adapter folder is malformed or disagrees with the model.
    #[error("adapter {dir}: {message}")]
    Adapter { dir: String, message: String },
    /// safetensors has no spelling for this element type.
    #[error("cannot write {0} tensors to safetensors")]
    UnwritableDType(DType),
    #[error("building the gradient: {0}")]
    Gradient(hlo_ir::AutodiffError),
    /// A block or chunk size that does not divide the sequence.
    #[error("the {what} ({size}) must divide the sequence ({seq})")]
    NotDividingSeq {
        what: &'static str,
        size: i64,
        seq: i64,
    },
    /// A length a command was given that the model's positions
    /// (`max_position_embeddings`) cannot hold.
    #[error("{what} {len} is above the model's {positions} positions")]
    BeyondPositions {
        what: String,
        len: i64,
        positions: i64,
    },
    /// A preference batch must hold whole pairs of unpacked rows.
    #[error("a preference batch holds chosen then rejected rows of whole pairs, unpacked; got {rows} rows{}", if *.packed { ", packed" } else { "" })]
    PreferenceBatch { rows: i64, packed: bool },
    #[error("GRPO: {why}")]
    GrpoBatch { why: String },
    /// A batch (or model) an objective's step cannot take.
    #[error("{objective}: {why}")]
    ObjectiveBatch {
        objective: &'static str,
        why: String,
    },
    /// The router's load-balancing loss (`output_router_logits`) with a
    /// setting it is not built for yet.
    #[error("the router's load-balancing loss (config.json's output_router_logits) is not supported {with} yet; set output_router_logits to false to train without it")]
    RouterAuxLoss { with: &'static str },
    #[error(transparent)]
    Trace(#[from] hlo_ir::TraceError),
    #[error(transparent)]
    Sharding(#[from] hlo_partitioner::ShardingError),
}

impl ModelError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> ModelError {
        let path = path.into();
        move |cause| ModelError::Io {
            action,
            path,
            cause,
        }
    }
}

/// Why a model configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("not a model config.json: {0}")]
    NotJson(serde_json::Error),
    #[error("not a model config.json: not a JSON object")]
    NotAnObject,
    /// A setting whose computation hlo-train does not implement.
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("{rope_type} rope scaling lacks `{field}`")]
    MissingRopeField { rope_type: String, field: String },
    #[error("{field} must be positive, got {value}")]
    NotPositive { field: &'static str, value: i64 },
    #[error("num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")]
    HeadsNotMultiple { heads: i64, kv_heads: i64 },
    #[error("head_dim {0} is odd (rotary embeddings rotate pairs)")]
    OddHeadDim(i64),
    // The presets come with the error (as LoRA targets do) so that this
    // module, below the decoder, does not read the decoder's table.
    #[error("unknown model preset `{name}` (one of {known})")]
    UnknownPreset { name: String, known: String },
}

impl From<ConfigError> for ModelError {
    fn from(problem: ConfigError) -> ModelError {
        ModelError::Config {
            path: None,
            problem,
        }
    }
}

impl From<hlo_ir::AutodiffError> for ModelError {
    fn from(e: hlo_ir::AutodiffError) -> ModelError {
        ModelError::Gradient(e)
    }
}

/// Why LoRA settings are refused.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("LoRA rank must be at least 1, got {0}")]
    Rank(i64),
    #[error("LoRA alpha must be positive, got {0}")]
    Alpha(f64),
    #[error("unknown LoRA target `{target}` (one of {known})")]
    UnknownTarget { target: String, known: String },
    #[error("LoRA needs at least one target module")]
    NoTargets,
    #[error("the pattern `{key}` is not a regex: {reason}")]
    Pattern { key: String, reason: String },
    #[error("modules_to_save `{0}` is not supported (only lm_head, embed_tokens, a sequence classifier's score, and a mixture of experts' router: gate, router)")]
    ModuleToSave(String),
    #[error("modules_to_save `{0}`: the model has no such module (lm_head tied to the embeddings, or a router on a model without experts)")]
    ModuleNotInModel(String),
    #[error("{0}")]
    NotUniform(String),
}
