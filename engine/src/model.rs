//! Which model a run uses and where its weights come from: a preset or a
//! `config.json` (random weights, or abstract shapes for planning), or an
//! HF checkpoint folder; with its tokenizer and chat template.

use std::path::{Path, PathBuf};

use hlo_data::{ChatTemplate, Tokenizer};
use hlo_ir::{DType, Literal, TensorType};
use hlo_models::checkpoint::Checkpoint;
use hlo_models::llama::{init_tensor, is_stacked, stack_literals, unstacked_names, LlamaConfig};

use crate::error::{EngineError, Result};

/// Where a model comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    /// A named preset (`tiny`, `llama3.2-1b`, ...), random weights.
    Preset(String),
    /// Any HF Llama `config.json`, random weights.
    Config(PathBuf),
    /// An HF model folder: `config.json` and safetensors.
    Checkpoint(PathBuf),
}

/// Random weights are made on the host only below this size.
const MAX_RANDOM_PARAMETERS: i64 = 2_000_000_000;

/// A model's configuration and the source of its weights.
pub struct Model {
    pub config: LlamaConfig,
    pub checkpoint: Option<Checkpoint>,
    /// How the user named it (preset, file or folder).
    pub name: String,
}

impl Model {
    /// Opens `source` (a checkpoint is checked tensor by tensor against its
    /// config, nothing is read yet).
    pub fn open(source: &ModelSource) -> Result<Model> {
        Ok(match source {
            ModelSource::Checkpoint(dir) => {
                let ckpt = Checkpoint::open(dir)?;
                Model {
                    config: ckpt.config.clone(),
                    name: dir.display().to_string(),
                    checkpoint: Some(ckpt),
                }
            }
            ModelSource::Config(path) => Model {
                config: LlamaConfig::from_file(path)?,
                checkpoint: None,
                name: path.display().to_string(),
            },
            ModelSource::Preset(name) => Model {
                config: LlamaConfig::preset(name)?,
                checkpoint: None,
                name: name.clone(),
            },
        })
    }

    /// Refuses random weights for models too large to make on the host.
    pub fn check_weights(&self) -> Result<()> {
        let parameters = self.config.parameter_count();
        if self.checkpoint.is_none() && parameters > MAX_RANDOM_PARAMETERS {
            return Err(EngineError::TooLargeForRandomWeights {
                model: self.name.clone(),
                parameters,
            });
        }
        Ok(())
    }

    /// One base weight in `dtype`: read from the checkpoint, or random
    /// (seeded by `seed` and the name) for presets and configs. A stacked
    /// name (scan over layers) gives every layer's tensor, stacked. Weights
    /// are made one at a time so the host never holds the whole model.
    pub fn weight(&self, name: &str, dtype: DType, seed: u64) -> Result<Literal> {
        if is_stacked(name) {
            let parts = unstacked_names(name, self.config.num_hidden_layers)
                .iter()
                .map(|n| self.weight(n, dtype, seed))
                .collect::<Result<Vec<_>>>()?;
            return Ok(stack_literals(&parts));
        }
        match &self.checkpoint {
            Some(c) => Ok(c.read(name, dtype)?),
            None => {
                let shape = self
                    .config
                    .parameter_shapes()
                    .into_iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, s)| s)
                    .ok_or_else(|| {
                        EngineError::Setting(format!("the model has no weight `{name}`"))
                    })?;
                Ok(init_tensor(
                    &self.config,
                    name,
                    TensorType::new(dtype, shape),
                    seed,
                ))
            }
        }
    }

    /// The tokenizer: `path`, else the checkpoint's `tokenizer.json`, else
    /// the byte-level one when the vocabulary is the byte vocabulary (the
    /// `tiny` preset); None when there is none.
    pub fn tokenizer(&self, path: Option<&Path>) -> Result<Option<Tokenizer>> {
        if let Some(path) = path {
            return Ok(Some(Tokenizer::from_file(path)?));
        }
        if let Some(c) = &self.checkpoint {
            let path = c.dir.join("tokenizer.json");
            if path.is_file() {
                return Ok(Some(Tokenizer::from_file(&path)?));
            }
        }
        if self.config.vocab_size == hlo_data::tokenizer::BYTE_VOCAB {
            return Ok(Some(Tokenizer::bytes()));
        }
        Ok(None)
    }

    /// The chat template of `dir`, else of the checkpoint's folder (None
    /// when the checkpoint has none, or there is no checkpoint).
    pub fn chat_template(&self, dir: Option<&Path>) -> Result<Option<ChatTemplate>> {
        Ok(match (dir, &self.checkpoint) {
            (Some(dir), _) => Some(ChatTemplate::from_dir(dir)?),
            (None, Some(c)) => ChatTemplate::from_dir(&c.dir).ok(),
            (None, None) => None,
        })
    }

    /// The end-of-sequence ids of the config.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.config
            .eos_token_ids
            .iter()
            .map(|&e| e as u32)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tiny_preset_speaks_the_byte_tokenizer() {
        let m = Model::open(&ModelSource::Preset("tiny".into())).unwrap();
        assert_eq!(m.config.vocab_size, hlo_data::tokenizer::BYTE_VOCAB);
        assert_eq!(
            m.config.bos_token_id,
            Some(hlo_data::tokenizer::BYTE_BOS as i64)
        );
        assert_eq!(m.eos_ids(), vec![hlo_data::tokenizer::BYTE_EOS]);
        assert!(m.tokenizer(None).unwrap().is_some());
    }
}
