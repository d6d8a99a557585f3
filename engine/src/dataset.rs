//! A model's training data: JSONL or Parquet files (or folders of them) read with the model's tokenizer and chat
//! template (or the bundled demo task), its statistics for a row length,
//! and its identity for resuming.

use std::path::{Path, PathBuf};

use hlo_data::{data_files, demo_examples, stats, ChatData, DataStats, Example, Reader};

use crate::checkpoint::file_fingerprint;
use crate::error::{EngineError, Result};
use crate::model::Model;

/// Which data, read how.
#[derive(Clone, Debug)]
pub struct DataSpec {
    /// A JSONL or Parquet file, or a folder of them; None: the bundled
    /// demo task.
    pub path: Option<PathBuf>,
    /// The folder whose chat template renders `{"messages"}` lines
    /// (default: the checkpoint's).
    pub chat_template: Option<PathBuf>,
    /// Learn every token of a conversation, not only the replies.
    pub train_on_inputs: bool,
    /// The row length: text beyond what it can use is not tokenized.
    pub seq: usize,
}

/// The identity of a data file, or of a folder's data files (their
/// names and contents, in the order they are read).
fn data_fingerprint(path: &Path) -> Result<String> {
    if !path.is_dir() {
        return file_fingerprint(path);
    }
    let mut parts = Vec::new();
    for file in data_files(path)? {
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
        parts.push(format!(
            "{}={}",
            name.unwrap_or_default(),
            file_fingerprint(&file)?
        ));
    }
    Ok(parts.join(","))
}

/// Examples the demo task draws for training, and for holding out.
const DEMO_SAMPLES: usize = 2000;
const DEMO_HELD_OUT: usize = 256;

/// Tokenized examples and what they hold.
pub struct Dataset {
    pub examples: Vec<Example>,
    pub stats: DataStats,
    /// The file's FNV-1a fingerprint (`demo` for the demo task).
    pub fingerprint: String,
}

impl Dataset {
    /// Reads `spec`'s data for `model` (the demo task is drawn with
    /// `seed`).
    pub fn read(model: &Model, spec: &DataSpec, seed: u64) -> Result<Dataset> {
        Self::read_file(model, spec, spec.path.as_deref(), seed, DEMO_SAMPLES)
    }

    /// The held-out set: `path`, or for the demo task a fresh draw of it
    /// (None when training on a file with no held-out file).
    pub fn held_out(
        model: &Model,
        spec: &DataSpec,
        path: Option<&Path>,
        seed: u64,
    ) -> Result<Option<Dataset>> {
        match (path, &spec.path) {
            (Some(p), _) => Ok(Some(Self::read_file(model, spec, Some(p), 0, 0)?)),
            (None, None) => Ok(Some(Self::read_file(
                model,
                spec,
                None,
                seed.wrapping_add(1),
                DEMO_HELD_OUT,
            )?)),
            (None, Some(_)) => Ok(None),
        }
    }

    fn read_file(
        model: &Model,
        spec: &DataSpec,
        path: Option<&Path>,
        seed: u64,
        demo: usize,
    ) -> Result<Dataset> {
        let tokenizer = model.tokenizer(None)?;
        let eos = model.eos_ids().first().copied();
        let (examples, fingerprint) = match path {
            Some(path) => {
                let template = model.chat_template(spec.chat_template.as_deref())?;
                let chat = template.as_ref().map(|template| ChatData {
                    template,
                    stop: model.eos_ids(),
                    train_on_inputs: spec.train_on_inputs,
                });
                let reader = Reader {
                    tokenizer: tokenizer.as_ref(),
                    eos,
                    vocab: model.config.vocab_size,
                    chat: chat.as_ref(),
                    max_tokens: Some(spec.seq),
                };
                (reader.read_path(path)?, data_fingerprint(path)?)
            }
            None => {
                let t = tokenizer.as_ref().ok_or(EngineError::DemoNeedsTokenizer)?;
                (demo_examples(t, eos, demo, seed), "demo".to_string())
            }
        };
        let stats = stats(&examples, spec.seq);
        Ok(Dataset {
            examples,
            stats,
            fingerprint,
        })
    }

    /// The examples that teach something within a row (at least one
    /// learned token); an error when none does.
    pub fn learning(self, seq: usize) -> Result<Vec<Example>> {
        if self.stats.no_signal == self.stats.samples {
            let earliest = self
                .examples
                .iter()
                .filter_map(|e| e.target.iter().skip(1).position(|&t| t))
                .min()
                .map(|k| k + 1);
            return Err(EngineError::NothingToLearn {
                samples: self.stats.samples,
                seq,
                earliest,
            });
        }
        Ok(self
            .examples
            .into_iter()
            .filter(|e| e.learns_within(seq))
            .collect())
    }
}
