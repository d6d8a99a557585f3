//! `--model`, `--checkpoint`, `--config`, `--dtype`: which Llama, with which
//! weights, and its tokenizer.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use hlo_ir::{DType, Literal};
use hlo_models::checkpoint::Checkpoint;
use hlo_models::llama::{init_tensor, is_stacked, stack_literals, unstacked_names, LlamaConfig};
use hlo_models::tokenizer::Tokenizer;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
}

impl DTypeArg {
    pub fn dtype(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model preset (random weights): tiny, llama3.2-1b, llama3.2-3b,
    /// llama3.1-8b, llama3.1-70b, llama3.1-405b.
    #[arg(long, default_value = "tiny")]
    pub model: String,

    /// HF model folder: config.json + *.safetensors (+ index).
    #[arg(long, conflicts_with = "config")]
    pub checkpoint: Option<PathBuf>,

    /// Random weights from any HF Llama config.json.
    #[arg(long)]
    pub config: Option<PathBuf>,

    /// Parameter and compute dtype of the base model (default: f32 on the
    /// CPU plugin, bf16 elsewhere).
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeArg>,

    /// HF tokenizer.json (default: the checkpoint's; byte-level for tiny).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// A model's config and where its weights come from.
pub struct Model {
    pub config: LlamaConfig,
    pub checkpoint: Option<Checkpoint>,
    pub name: String,
}

impl ModelArgs {
    pub fn open(&self) -> Result<Model> {
        if let Some(dir) = &self.checkpoint {
            let ckpt = Checkpoint::open(dir)?;
            return Ok(Model {
                config: ckpt.config.clone(),
                name: dir.display().to_string(),
                checkpoint: Some(ckpt),
            });
        }
        if let Some(path) = &self.config {
            return Ok(Model {
                config: LlamaConfig::from_file(path)?,
                checkpoint: None,
                name: path.display().to_string(),
            });
        }
        Ok(Model {
            config: LlamaConfig::preset(&self.model)?,
            checkpoint: None,
            name: self.model.clone(),
        })
    }

    pub fn dtype(&self, cpu: bool) -> DType {
        self.dtype
            .map_or(if cpu { DType::F32 } else { DType::BF16 }, DTypeArg::dtype)
    }

    /// The tokenizer: `--tokenizer`, the checkpoint's `tokenizer.json`, or
    /// byte-level when the vocabulary fits it.
    pub fn tokenizer(&self, model: &Model) -> Result<Option<Tokenizer>> {
        if let Some(path) = &self.tokenizer {
            return Ok(Some(Tokenizer::from_file(path)?));
        }
        if let Some(c) = &model.checkpoint {
            let path = c.dir.join("tokenizer.json");
            if path.is_file() {
                return Ok(Some(Tokenizer::from_file(&path)?));
            }
        }
        if model.config.vocab_size == hlo_models::tokenizer::BYTE_VOCAB {
            return Ok(Some(Tokenizer::bytes()));
        }
        Ok(None)
    }
}

impl Model {
    /// Refuses random weights for models too large to make on the host.
    pub fn check_weights(&self) -> Result<()> {
        let params = self.config.parameter_count();
        if self.checkpoint.is_none() && params > 2_000_000_000 {
            bail!(
                "{} has {params} parameters: random weights that large are not built on the host; pass --checkpoint",
                self.name
            );
        }
        Ok(())
    }

    /// One base weight in `dtype`: read from the checkpoint, or random
    /// (seeded) for presets and configs. Weights are read one at a time so
    /// the host never holds the whole model.
    pub fn weight(&self, name: &str, dtype: DType, seed: u64) -> Result<Literal> {
        if is_stacked(name) {
            // A scan-over-layers parameter: every layer's tensor, stacked.
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
                    .with_context(|| format!("the model has no weight `{name}`"))?;
                Ok(init_tensor(
                    name,
                    hlo_ir::TensorType::new(dtype, shape),
                    self.config.initializer_range,
                    seed,
                ))
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
                .with_context(|| format!("`{t}` in --prompt-ids is not a token id"))
        })
        .collect()
}
