//! Errors of reading and preparing data.

use std::path::PathBuf;

/// What went wrong, with the file (and line) it concerns.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be read.
    #[error("cannot read {}: {cause}", path.display())]
    Read {
        path: PathBuf,
        cause: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("{}: not JSON: {cause}", path.display())]
    Json {
        path: PathBuf,
        cause: serde_json::Error,
    },
    /// One line of a data file is unusable.
    #[error("{}:{line}: {message}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// One row of a Parquet data file is unusable.
    #[error("{}: row {row}: {message}", path.display())]
    Row {
        path: PathBuf,
        row: usize,
        message: String,
    },
    /// A file that should be Parquet cannot be read as Parquet.
    #[error("{}: not a readable Parquet file: {message}", path.display())]
    Parquet { path: PathBuf, message: String },
    /// A data folder with no data files in it.
    #[error("{} holds no *.parquet or *.jsonl files", path.display())]
    NoDataFiles { path: PathBuf },
    /// A data file holds no examples.
    /// Rows that cannot go together (each readable alone).
    #[error("{}: {message}", path.display())]
    Rows { path: PathBuf, message: String },
    #[error("{} has no examples", path.display())]
    Empty { path: PathBuf },
    /// A tokenizer folder without a chat template.
    #[error("{} has no chat_template (the model is not a chat model)", path.display())]
    NotAChatModel { path: PathBuf },
    /// A tokenizer folder's settings are unusable (no chat template, say).
    #[error("{}: {message}", path.display())]
    TokenizerConfig { path: PathBuf, message: String },
    /// A chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// Text to encode, and no tokenizer.
    #[error("no tokenizer for this model: pass --tokenizer FILE or token ids")]
    NoTokenizer,
    /// A conversation to render, and no chat template.
    #[error("`messages` prompts need the model's chat template (--chat or --chat-template DIR)")]
    NoChatTemplate,
    /// A folder could not be made.
    #[error("cannot create {}: {cause}", path.display())]
    Create {
        path: PathBuf,
        cause: std::io::Error,
    },
    /// A file could not be written whole ([`hlo_fs::write_atomic`]).
    #[error("cannot write {}: {cause}", path.display())]
    Write {
        path: PathBuf,
        cause: hlo_fs::WriteError,
    },
    /// Another process writes the folder (see [`crate::lock`]).
    #[error("{} is held by {holder}: one writer a folder; wait for it to finish, or give another folder", path.display())]
    Locked { path: PathBuf, holder: String },
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}
