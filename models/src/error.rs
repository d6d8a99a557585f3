//! Errors of model building, checkpoints, adapters and tokenizers.

/// What went wrong, with the file, tensor or field it concerns.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Io(String),
    #[error("{file}: {message}")]
    Checkpoint { file: String, message: String },
    #[error("adapter {dir}: {message}")]
    Adapter { dir: String, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("{0}")]
    Trace(#[from] hlo_ir::TraceError),
    #[error("{0}")]
    Sharding(#[from] hlo_partitioner::ShardingError),
    #[error("{0}")]
    Runtime(#[from] hlo_runtime::Error),
}
