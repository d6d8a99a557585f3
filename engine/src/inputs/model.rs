//! Which model a run uses and where its weights come from: a preset or a
//! `config.json` (random weights, or abstract shapes for planning), or an
//! HF checkpoint folder; with its tokenizer and chat template.

use std::path::{Path, PathBuf};

use hlo_data::{ChatTemplate, Tokenizer};
use hlo_ir::{DType, Literal, TensorType};
use hlo_models::checkpoint::Checkpoint;
use hlo_models::decoder::{
    init_tensor, is_stacked, stack_literals, unstacked_names, Head, ModelConfig, SCORE,
};
use hlo_models::nf4::{self, Nf4Tensor};

use clap::Args;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::settings;

/// How a run makes its weights instead of reading them (`--init`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// As transformers' `_init_weights` makes a new model's.
    Random,
}

impl crate::named::Named for Init {
    const ALL: &'static [Init] = &[Init::Random];
    fn name(self) -> &'static str {
        match self {
            Init::Random => "random",
        }
    }
}

/// Where a model comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    /// A named preset (`tiny`, `llama3.2-1b`, ...), random weights.
    Preset(String),
    /// An HF `config.json` of a supported family, random weights.
    Config(PathBuf),
    /// An HF model folder: `config.json` and safetensors.
    Checkpoint(PathBuf),
}

impl ModelSource {
    /// The flags that name this source, as a run records it.
    pub fn spec(&self) -> ModelSpec {
        let mut spec = ModelSpec::default();
        match self {
            ModelSource::Preset(name) => spec.model = Some(name.clone()),
            ModelSource::Config(p) => spec.config = Some(p.clone()),
            ModelSource::Checkpoint(p) => spec.checkpoint = Some(p.clone()),
        }
        spec
    }
}

/// The base model as the commands that run it take it: which model, its
/// weights in NF4 or not, and the dtype it computes in. Each flag is
/// declared once here and recorded by a run under its name.
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BaseSpec {
    #[command(flatten)]
    #[serde(flatten)]
    pub model: ModelSpec,

    #[command(flatten)]
    #[serde(flatten)]
    pub quantize: QuantizeSpec,

    #[command(flatten)]
    #[serde(flatten)]
    pub dtype: DtypeSpec,
}

/// `--model`, `--checkpoint`, `--config`: which model (one chosen
/// replaces the others).
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ModelSpec {
    /// Model preset (random weights; the exact HF config): tiny,
    /// llama3.2-1b, llama3.2-3b, llama3.1-8b, llama3.1-70b, llama3.1-405b,
    /// qwen2.5-0.5b, qwen2.5-7b, qwen3-0.6b, qwen3-8b, mistral-7b,
    /// gemma3-270m, gemma3-1b, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b,
    /// gpt-oss-20b, gpt-oss-120b, qwen1.5-moe-a2.7b, glm-4.5, deepseek-v3,
    /// kimi-k2; mpt-scale-1b, mpt-scale-3b, mpt-scale-7b
    /// (MPT's sizes as Llama configs, for pretraining plans) (default:
    /// tiny).
    #[arg(long)]
    pub model: Option<String>,

    /// HF model folder: config.json + *.safetensors (+ index); or a hub
    /// id ORG/NAME[@REVISION], read from the HF cache (downloaded there
    /// when missing).
    #[arg(long, conflicts_with = "config", value_parser = settings::hub_model)]
    #[serde(serialize_with = "settings::absolute_path")]
    pub checkpoint: Option<PathBuf>,

    /// Random weights from an HF config.json of a supported family (Llama,
    /// Qwen2/2.5, Qwen3, Mistral, Gemma 3 text, Qwen3-MoE, Mixtral,
    /// gpt-oss).
    #[arg(long)]
    #[serde(serialize_with = "settings::absolute_path")]
    pub config: Option<PathBuf>,
}

impl ModelSpec {
    /// The model these flags name (a checkpoint over a config over a
    /// preset; the tiny preset when none is given).
    pub fn source(&self) -> ModelSource {
        match (&self.checkpoint, &self.config) {
            (Some(dir), _) => ModelSource::Checkpoint(dir.clone()),
            (None, Some(path)) => ModelSource::Config(path.clone()),
            (None, None) => {
                ModelSource::Preset(self.model.clone().unwrap_or_else(|| "tiny".into()))
            }
        }
    }

    /// Whether any of the flags is given.
    pub fn given(&self) -> bool {
        self.model.is_some() || self.checkpoint.is_some() || self.config.is_some()
    }
}

/// How `--quantize` stores the base's projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Quantize {
    Nf4,
}

/// `--quantize` and `--double-quant`: the base projections in NF4 (QLoRA).
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct QuantizeSpec {
    /// Store every q/k/v/o/gate/up/down projection in 4-bit NormalFloat
    /// (bitsandbytes' NF4, blocks of 64), quantized on load and
    /// dequantized inside the step; embeddings, norms and the LM head
    /// stay in --dtype. A checkpoint saved in bitsandbytes 4-bit NF4 is
    /// read as it is, with or without this flag.
    #[arg(long, value_enum)]
    pub quantize: Option<Quantize>,

    /// With --quantize nf4: quantize the block scales again in 8 bits, as
    /// bitsandbytes' bnb_4bit_use_double_quant (held dequantized on the
    /// devices).
    #[arg(long, requires = "quantize")]
    pub double_quant: bool,
}

impl QuantizeSpec {
    /// The NF4 settings these flags ask for.
    pub fn nf4(&self) -> Option<nf4::Nf4Config> {
        self.quantize.map(|Quantize::Nf4| nf4::Nf4Config {
            double_quant: self.double_quant,
        })
    }

    /// The flags that ask for `nf4`, as a run records the base it holds.
    pub fn of(nf4: Option<nf4::Nf4Config>) -> QuantizeSpec {
        QuantizeSpec {
            quantize: nf4.map(|_| Quantize::Nf4),
            double_quant: nf4.is_some_and(|q| q.double_quant),
        }
    }

    /// `model` with its projections in NF4 when asked (refused where a
    /// projection's rows are not whole blocks).
    pub fn apply(&self, model: Model) -> Result<Model> {
        model.quantized(self.nf4())
    }
}

/// `--dtype`.
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DtypeSpec {
    /// Parameter and compute dtype of the base model (default: f32 on the
    /// CPU plugin, bf16 elsewhere).
    #[arg(long, value_parser = settings::named::<DType>())]
    #[serde(with = "settings::opt_by_name", default)]
    pub dtype: Option<DType>,
}

impl DtypeSpec {
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
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenizerSpec {
    /// HF tokenizer.json (default: the checkpoint's; byte-level for
    /// tiny); or a hub id (its tokenizer.json).
    #[arg(long, value_parser = settings::hub_tokenizer)]
    #[serde(serialize_with = "settings::absolute_path")]
    pub tokenizer: Option<PathBuf>,
}

/// `config` (of the model called `name`) with its projections in NF4 when
/// `nf4` asks (QLoRA): a full-precision base is quantized on load, a
/// bitsandbytes NF4 checkpoint is read as it is stored (and `nf4` must
/// then agree with its double quantization). Refused where a projection's
/// rows are not whole blocks.
pub fn quantized_config(
    config: &ModelConfig,
    name: &str,
    nf4: Option<nf4::Nf4Config>,
) -> Result<ModelConfig> {
    match (config.quantization, nf4) {
        (Some(stored), Some(asked)) if stored.double_quant != asked.double_quant => {
            Err(EngineError::Nf4Stored {
                model: name.to_string(),
                stored_double_quant: stored.double_quant,
            })
        }
        (None, Some(asked)) => {
            config
                .clone()
                .with_nf4(asked)
                .map_err(|cause| EngineError::Quantize {
                    model: name.to_string(),
                    cause,
                })
        }
        _ => Ok(config.clone()),
    }
}

/// Random weights are made on the host only below this size.
const MAX_RANDOM_PARAMETERS: i64 = 2_000_000_000;

/// A model's configuration and the source of its weights.
pub struct Model {
    pub config: ModelConfig,
    pub checkpoint: Option<Checkpoint>,
    /// How the user named it (preset, file or folder).
    pub name: String,
    /// A `tokenizer.json` that overrides the checkpoint's.
    pub tokenizer_file: Option<PathBuf>,
    source: ModelSource,
    /// Its weights made as HF initialises a new model of its config
    /// (`--init random`), whatever its source stores.
    random_init: bool,
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
                    tokenizer_file: None,
                    source: source.clone(),
                    random_init: false,
                }
            }
            ModelSource::Config(path) => Model {
                config: ModelConfig::from_file(path)?,
                checkpoint: None,
                name: path.display().to_string(),
                tokenizer_file: None,
                source: source.clone(),
                random_init: false,
            },
            ModelSource::Preset(name) => Model {
                config: ModelConfig::preset(name)?,
                checkpoint: None,
                name: name.clone(),
                tokenizer_file: None,
                source: source.clone(),
                random_init: false,
            },
        })
    }

    /// The same model with its weights made at random as HF's
    /// `_init_weights` makes them for its config (`random`: training from
    /// scratch); its checkpoint, if any, still gives the tokenizer, chat
    /// template and generation settings.
    pub fn with_random_weights(mut self, random: bool) -> Model {
        self.random_init = random;
        self
    }

    /// Whether its weights are made at random (a preset, a config, or
    /// `--init random`).
    pub(crate) fn is_random(&self) -> bool {
        self.stored().is_none()
    }

    /// The checkpoint its weights are read from (None: random weights).
    fn stored(&self) -> Option<&Checkpoint> {
        self.checkpoint.as_ref().filter(|_| !self.random_init)
    }

    /// The same model with `tokenizer.json` from `path` (None: the
    /// checkpoint's, or byte-level for the byte vocabulary).
    pub fn with_tokenizer_file(mut self, path: Option<PathBuf>) -> Model {
        self.tokenizer_file = path;
        self
    }

    /// The model as a reward model, a sequence classifier of one label
    /// pooled at the last token that is not the tokenizer's pad token
    /// (its EOS when it has none; without a tokenizer config, a
    /// classifier's own), as TRL's `RewardTrainer` sets it up: a
    /// causal LM gets a `score` head (random, normal with
    /// `initializer_range`, seeded, as transformers initialises a new
    /// head; its LM head is left unread), a classifier keeps its own.
    pub fn as_reward_model(mut self) -> Result<Model> {
        if !self.config.family.has_classifier() {
            return Err(EngineError::Objective {
                objective: "reward",
                why: format!(
                    "transformers has no sequence classifier of {} (a reward model of it could not be loaded)",
                    self.config.family.architecture()
                ),
            });
        }
        // A classifier's own pad token where no tokenizer says otherwise.
        let pad = match (self.tokenizer_dir(), self.config.head) {
            (
                None,
                Head::SequenceClassification {
                    pad_token_id: Some(p),
                    ..
                },
            ) => Some(p),
            _ => self.pad_token_id()?,
        };
        self.config = match self.config.head {
            Head::SequenceClassification { num_labels: 1, .. } | Head::CausalLm => {
                self.config.clone().with_score_head(1, pad)
            }
            Head::SequenceClassification { num_labels, .. } => {
                return Err(EngineError::Objective {
                    objective: "reward",
                    why: format!(
                        "{} classifies into {num_labels} labels; a reward model has one",
                        self.name
                    ),
                })
            }
        };
        Ok(self)
    }

    /// The tokenizer's pad token id (its `tokenizer_config.json`'s
    /// `pad_token`), else its EOS token's, else the config's first EOS
    /// id: what TRL pads with.
    pub fn pad_token_id(&self) -> Result<Option<i64>> {
        if let (Some(dir), Some(t)) = (self.tokenizer_dir(), self.tokenizer(None)?) {
            for key in ["pad_token", "eos_token"] {
                if let Some(text) = hlo_data::special_token_text(&dir, key)? {
                    if let [id] = t.encode(&text, false)?[..] {
                        return Ok(Some(i64::from(id)));
                    }
                }
            }
        }
        Ok(self.eos_ids().first().map(|&id| i64::from(id)))
    }

    /// The folder of the tokenizer's `tokenizer_config.json`: the given
    /// tokenizer file's, else the checkpoint's (None: neither has one).
    fn tokenizer_dir(&self) -> Option<PathBuf> {
        let dir = match (&self.tokenizer_file, &self.checkpoint) {
            (Some(file), _) => file.parent().map(Path::to_path_buf),
            (None, Some(c)) => Some(c.dir.clone()),
            (None, None) => None,
        };
        dir.filter(|d| d.join("tokenizer_config.json").is_file())
    }

    /// The same model with its projections in NF4 when `nf4` asks (QLoRA;
    /// see [`quantized_config`]).
    pub fn quantized(mut self, nf4: Option<nf4::Nf4Config>) -> Result<Model> {
        self.config = quantized_config(&self.config, &self.name, nf4)?;
        Ok(self)
    }

    pub fn source(&self) -> &ModelSource {
        &self.source
    }

    /// How an adapter names its base model: a checkpoint folder's absolute
    /// path (so PEFT finds it from any directory), else the preset or
    /// config name.
    pub(crate) fn base_name(&self) -> String {
        match &self.checkpoint {
            Some(c) => std::fs::canonicalize(&c.dir)
                .unwrap_or_else(|_| c.dir.clone())
                .display()
                .to_string(),
            None => self.name.clone(),
        }
    }

    /// A fingerprint of the model's identity: for a checkpoint, its
    /// `config.json` and each weight file's size and safetensors header
    /// (the tensors' names, types and places; reading every byte of a
    /// large model would take minutes); for a config file, its bytes; for
    /// a preset, its name.
    pub fn fingerprint(&self) -> Result<String> {
        let mut parts: Vec<Vec<u8>> = Vec::new();
        match (&self.source, &self.checkpoint) {
            (_, Some(c)) => {
                let config = c.dir.join("config.json");
                parts.push(std::fs::read(&config).map_err(EngineError::io("read", &config))?);
                for file in c.weight_files() {
                    parts.push(safetensors_identity(&file)?);
                }
            }
            (ModelSource::Config(path), None) => {
                parts.push(std::fs::read(path).map_err(EngineError::io("read", path))?)
            }
            (_, None) => parts.push(format!("preset:{}", self.name).into_bytes()),
        }
        if self.random_init {
            parts.push(b"random-init".to_vec());
        }
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        Ok(format!("{:016x}", hlo_ir::rng::fingerprint(&refs)))
    }

    /// Writes a complete HF model folder to `out`: `model.safetensors`
    /// from `weights` (every parameter; past 5 GB, files of at most 5 GB
    /// and their index, as transformers writes them) and
    /// [`Model::save_hf_side_files`].
    pub fn save_hf(&self, out: &Path, weights: &[(String, Literal)]) -> Result<()> {
        use hlo_models::io::{write_hf_weights, MAX_SHARD_BYTES};
        // As transformers writes them (mixtures of experts per expert; in
        // files of at most 5 GB with an index past that).
        let weights = hlo_models::checkpoint::hf_layout(&self.config, weights.to_vec());
        write_hf_weights(out, &weights, MAX_SHARD_BYTES)?;
        self.save_hf_side_files(out)
    }

    /// The files of an HF model folder besides its weights: the
    /// `config.json` the model came from (a preset's written out), and
    /// the checkpoint's tokenizer, chat template and generation settings
    /// (a `generation_config.json` made from the config when there is
    /// none).
    pub fn save_hf_side_files(&self, out: &Path) -> Result<()> {
        use hlo_models::io::{copy_side_files, write_atomic};
        // The config as the user gave it (every field transformers reads
        // kept); a preset's written out.
        let config = match &self.source {
            ModelSource::Checkpoint(dir) => Some(dir.join("config.json")),
            ModelSource::Config(path) => Some(path.clone()),
            ModelSource::Preset(_) => None,
        };
        let config = match config {
            // A causal LM's config made a reward model's names its head.
            Some(p) => hlo_models::decoder::with_head(
                &std::fs::read(&p).map_err(EngineError::io("read", &p))?,
                &self.config,
            )?,
            None => self.config.to_json().into_bytes(),
        };
        write_atomic(&out.join("config.json"), &config)?;
        let mut copied = match &self.checkpoint {
            Some(c) => copy_side_files(&c.dir, out)?,
            None => Vec::new(),
        };
        if let Some(t) = &self.tokenizer_file {
            let bytes = std::fs::read(t).map_err(EngineError::io("read", t))?;
            write_atomic(&out.join("tokenizer.json"), &bytes)?;
            copied.push("tokenizer.json");
        }
        if !copied.contains(&"generation_config.json") {
            let c = &self.config;
            let generation = serde_json::json!({
                "bos_token_id": c.bos_token_id,
                "eos_token_id": c.eos_token_ids,
            });
            write_atomic(
                &out.join("generation_config.json"),
                generation.to_string().as_bytes(),
            )?;
        }
        Ok(())
    }

    /// Refuses random weights for models too large to make on the host.
    pub fn check_weights(&self) -> Result<()> {
        let parameters = self.config.parameter_count();
        if self.is_random() && parameters > MAX_RANDOM_PARAMETERS {
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
    ///
    /// With NF4 quantization a layer projection's weight is its codes and
    /// `<weight>.absmax` its block scales (whatever `dtype`), quantized
    /// here from the full-precision tensor, one tensor at a time.
    pub fn weight(&self, name: &str, dtype: DType, seed: u64) -> Result<Literal> {
        if is_stacked(name) {
            let parts = unstacked_names(name, self.config.num_hidden_layers)
                .iter()
                .map(|n| self.weight(n, dtype, seed))
                .collect::<Result<Vec<_>>>()?;
            return Ok(stack_literals(&parts));
        }
        if let Some(q) = self.config.quantization {
            let scales = name.strip_suffix(nf4::ABSMAX_SUFFIX);
            let weight = scales.unwrap_or(name);
            if nf4::is_quantized(weight) {
                let stored = self.stored().is_some_and(|c| c.is_prequantized(weight));
                return Ok(match (scales, stored) {
                    (Some(_), true) => self.nf4_weight(weight, seed)?.absmax_literal(),
                    // The scales alone need no codes.
                    (Some(_), false) => {
                        nf4::absmax_of(&self.full_weight(weight, seed)?, q.double_quant)
                    }
                    (None, _) => self.nf4_weight(weight, seed)?.codes_literal(),
                });
            }
        }
        // A sigmoid router in f32, as transformers keeps it.
        let dtype = match self.config.kept_in_f32(name) {
            true => DType::F32,
            false => dtype,
        };
        match self.stored() {
            // A causal LM's checkpoint made a reward model: its new head.
            Some(c) if name == SCORE && c.dtype(SCORE).is_none() => self.random(name, dtype, seed),
            Some(c) => Ok(c.read(name, dtype)?),
            None => self.random(name, dtype, seed),
        }
    }

    /// Base weight `name` made as HF initialises it, seeded by `seed`.
    fn random(&self, name: &str, dtype: DType, seed: u64) -> Result<Literal> {
        let shape = self
            .config
            .parameter_shape(name)
            .ok_or_else(|| EngineError::NoWeight {
                name: name.to_string(),
            })?;
        Ok(init_tensor(
            &self.config,
            name,
            TensorType::new(dtype, shape),
            seed,
        ))
    }

    /// A layer projection in NF4: as a bitsandbytes checkpoint stores it,
    /// else quantized from its f32 values.
    fn nf4_weight(&self, name: &str, seed: u64) -> Result<Nf4Tensor> {
        if let Some(c) = self.stored().filter(|c| c.is_prequantized(name)) {
            return Ok(c.read_nf4(name)?);
        }
        let double = self.config.quantization.is_some_and(|q| q.double_quant);
        Ok(Nf4Tensor::from_literal(
            &self.full_weight(name, seed)?,
            double,
        ))
    }

    /// A weight before quantization, as stored (no f64 copy of it) or
    /// made in f32.
    fn full_weight(&self, name: &str, seed: u64) -> Result<Literal> {
        match self.stored() {
            Some(c) => {
                let dtype = c.dtype(name).unwrap_or(DType::F32);
                Ok(c.read(name, dtype)?)
            }
            None => self.random(name, DType::F32, seed),
        }
    }

    /// The tokenizer: `path`, else the checkpoint's `tokenizer.json`, else
    /// the byte-level one when the vocabulary is the byte vocabulary (the
    /// `tiny` preset); None when there is none.
    pub fn tokenizer(&self, path: Option<&Path>) -> Result<Option<Tokenizer>> {
        if let Some(path) = path.or(self.tokenizer_file.as_deref()) {
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

    /// The tokenizer's `eos_token` text, from the `tokenizer_config.json`
    /// beside its `tokenizer.json` (the given file's, else the
    /// checkpoint's): what TRL appends to string completions. None when
    /// there is no such file or it names none.
    pub fn eos_token_text(&self) -> Result<Option<String>> {
        match self.tokenizer_dir() {
            Some(dir) => Ok(hlo_data::eos_token_text(&dir)?),
            None => Ok(None),
        }
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

    /// Where generation stops, as transformers' `generate` decides:
    /// `generation_config.json`'s `eos_token_id` (one id or a list) when
    /// the checkpoint has one, else the config's EOS ids.
    pub fn generation_eos_ids(&self) -> Result<Vec<u32>> {
        let Some(c) = &self.checkpoint else {
            return Ok(self.eos_ids());
        };
        let path = c.dir.join("generation_config.json");
        if !path.is_file() {
            return Ok(self.eos_ids());
        }
        let text = std::fs::read_to_string(&path).map_err(EngineError::io("read", &path))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|cause| EngineError::Json {
                path: path.clone(),
                cause,
            })?;
        let ids = |x: &serde_json::Value| -> Option<Vec<u32>> {
            match x {
                serde_json::Value::Number(n) => n.as_u64().map(|i| vec![i as u32]),
                serde_json::Value::Array(a) => {
                    a.iter().map(|i| i.as_u64().map(|i| i as u32)).collect()
                }
                _ => None,
            }
        };
        Ok(match v.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => self.eos_ids(),
            Some(x) => ids(x).ok_or_else(|| EngineError::EosIds { path: path.clone() })?,
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

/// A safetensors file's identity without reading its tensors: its size
/// and header.
fn safetensors_identity(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(EngineError::io("open", path))?;
    let size = f.metadata().map_err(EngineError::io("read", path))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(EngineError::io("read", path))?;
    let n = u64::from_le_bytes(len).min(size);
    let mut header = Vec::new();
    f.take(n)
        .read_to_end(&mut header)
        .map_err(EngineError::io("read", path))?;
    let mut out = size.to_le_bytes().to_vec();
    out.extend(header);
    Ok(out)
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
