//! A decoder's configuration: HF `config.json` of each family
//! (transformers 4 and 5 spellings, read as transformers 5.17 reads them),
//! and the derived sizes.
//!
//! Every family is Llama with a few named differences (HF's
//! `modeling_qwen2.py`, `modeling_qwen3.py`, `modeling_mistral.py`,
//! `modeling_gemma3.py`); each difference is a field of [`ModelConfig`],
//! set from the family and its config, so the decoder reads one field
//! where a family departs from Llama.

use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::{ConfigError, ModelError};

/// The model families hlo-train runs, by HF architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `LlamaForCausalLM` (Llama 3.x).
    Llama,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): biases on q/k/v.
    Qwen2,
    /// `Qwen3ForCausalLM` (dense Qwen3): per-head q/k RMSNorm.
    Qwen3,
    /// `MistralForCausalLM`: sliding-window attention.
    Mistral,
    /// `Gemma3ForCausalLM` (Gemma 3 text): local/global layers, (1 + w)
    /// norms, GELU-tanh, scaled embeddings, sandwich norms.
    Gemma3,
}

/// Every family, in the order errors list them.
pub const FAMILIES: [Family; 5] = [
    Family::Llama,
    Family::Qwen2,
    Family::Qwen3,
    Family::Mistral,
    Family::Gemma3,
];

impl Family {
    /// HF's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
            Family::Gemma3 => "gemma3_text",
        }
    }

    /// HF's architecture (the class in `architectures`).
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    fn from_model_type(t: &str) -> Option<Family> {
        FAMILIES.into_iter().find(|f| f.model_type() == t)
    }

    fn from_architecture(a: &str) -> Option<Family> {
        FAMILIES.into_iter().find(|f| f.architecture() == a)
    }
}

/// What hlo-train runs, for error messages.
fn supported() -> String {
    let names: Vec<&str> = FAMILIES.iter().map(|f| f.architecture()).collect();
    format!("hlo-train runs {}", names.join(", "))
}

/// `rope_type` `llama3` (Llama 3.1+).
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// How rotary frequencies are rescaled for longer contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `rope_type` `linear`: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// `rope_type` `llama3`.
    Llama3(Llama3Scaling),
}

/// A rotary embedding: its base and scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
}

impl Rope {
    pub fn new(theta: f64) -> Rope {
        Rope {
            theta,
            scaling: None,
        }
    }
}

/// Which keys a layer's queries see.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerType {
    /// Every earlier position (HF's `full_attention`).
    Full,
    /// The last `sliding_window` positions, itself included (HF's
    /// `sliding_attention`).
    Sliding,
}

impl LayerType {
    /// HF's spelling in `layer_types`.
    pub fn name(self) -> &'static str {
        match self {
            LayerType::Full => "full_attention",
            LayerType::Sliding => "sliding_attention",
        }
    }
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu` (SwiGLU).
    Silu,
    /// `gelu_pytorch_tanh` (GeGLU with the tanh approximation).
    GeluTanh,
}

/// How an RMSNorm applies its weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormStyle {
    /// `w · x̂`, normalised in f32 and multiplied in the input dtype
    /// (`LlamaRMSNorm`; weights start at 1).
    Llama,
    /// `(1 + w) · x̂`, all in f32, then cast (`Gemma3RMSNorm`; weights
    /// start at 0).
    Gemma,
}

/// A decoder's shape and its family's differences from Llama, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    /// The rotary embedding of full-attention layers (of every layer
    /// unless `sliding_rope` is set).
    pub rope: Rope,
    /// Gemma 3: the sliding layers' own rotary embedding
    /// (`rope_local_base_freq`).
    pub sliding_rope: Option<Rope>,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    /// Standard deviation of random initial weights (HF's `initializer_range`).
    pub initializer_range: f64,
    /// Qwen2: the q/k/v projections carry biases.
    pub qkv_bias: bool,
    /// Qwen3, Gemma 3: an RMSNorm over each head's queries and keys
    /// (`self_attn.q_norm`, `self_attn.k_norm`) before RoPE.
    pub qk_norm: bool,
    /// Each layer's attention (Gemma 3 alternates; Mistral's are all
    /// sliding when it has a window).
    pub layer_types: Vec<LayerType>,
    /// How many positions a sliding layer's query sees, itself included.
    pub sliding_window: Option<i64>,
    pub hidden_act: Activation,
    pub norm_style: NormStyle,
    /// Gemma 3: embeddings are multiplied by √hidden_size.
    pub scale_embeddings: bool,
    /// Gemma 3: the attention and MLP outputs are normalised too
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`) and the
    /// MLP's input by `pre_feedforward_layernorm`.
    pub sandwich_norms: bool,
    /// Gemma 3: scores are scaled by `query_pre_attn_scalar^-0.5`
    /// instead of `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f64>,
    /// Logits become `c·tanh(logits / c)`.
    pub final_logit_softcapping: Option<f64>,
}

/// The fields of `config.json` that every family shares; the rest are
/// read per family from the JSON object (`resolve`).
#[derive(Deserialize)]
struct RawConfig {
    vocab_size: i64,
    hidden_size: i64,
    intermediate_size: i64,
    num_hidden_layers: i64,
    num_attention_heads: i64,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    #[serde(default = "default_max_positions")]
    max_position_embeddings: i64,
    tie_word_embeddings: Option<bool>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
    #[serde(default = "default_init")]
    initializer_range: f64,
}

fn default_init() -> f64 {
    0.02
}

fn default_eps() -> f64 {
    1e-6
}

fn default_max_positions() -> i64 {
    2048
}

fn ids(v: &Option<Value>) -> Vec<i64> {
    match v {
        Some(Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_i64).collect(),
        _ => Vec::new(),
    }
}

fn unsupported<T>(what: String) -> Result<T, ConfigError> {
    Err(ConfigError::Unsupported(what))
}

/// The family a config describes, by `model_type`, else by
/// `architectures`, else Llama (configs written before `model_type`).
fn family_of(obj: &Map<String, Value>) -> Result<Family, ConfigError> {
    let architectures: Vec<&str> = match obj.get("architectures") {
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let family = match obj.get("model_type").and_then(Value::as_str) {
        Some(t) => Family::from_model_type(t).ok_or_else(|| {
            ConfigError::Unsupported(format!("model_type `{t}` ({})", supported()))
        })?,
        None => match architectures.first() {
            Some(a) => Family::from_architecture(a).ok_or_else(|| {
                ConfigError::Unsupported(format!(
                    "architectures {architectures:?} ({})",
                    supported()
                ))
            })?,
            None => Family::Llama,
        },
    };
    if !architectures.is_empty() && !architectures.contains(&family.architecture()) {
        return unsupported(format!(
            "architectures {architectures:?} for model_type `{}` ({})",
            family.model_type(),
            supported()
        ));
    }
    Ok(family)
}

/// A `rope_parameters`/`rope_scaling` object as a [`Rope`], its theta
/// defaulting to `theta`.
fn rope_from(r: Option<&Value>, theta: f64) -> Result<Rope, ConfigError> {
    let theta = r
        .and_then(|r| r.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(theta);
    let rope_type = r
        .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let get = |k: &str| {
        r.and_then(|r| r.get(k))
            .and_then(Value::as_f64)
            .ok_or_else(|| ConfigError::MissingRopeField {
                rope_type: rope_type.to_string(),
                field: k.to_string(),
            })
    };
    if let Some(f) = r
        .and_then(|r| r.get("partial_rotary_factor"))
        .and_then(Value::as_f64)
    {
        if f != 1.0 {
            return unsupported(format!("partial_rotary_factor = {f}"));
        }
    }
    let scaling = match rope_type {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: get("factor")?,
        }),
        "llama3" => Some(RopeScaling::Llama3(Llama3Scaling {
            factor: get("factor")?,
            low_freq_factor: get("low_freq_factor")?,
            high_freq_factor: get("high_freq_factor")?,
            original_max_position_embeddings: get("original_max_position_embeddings")?,
        })),
        other => {
            return unsupported(format!(
                "rope type `{other}` (only default, linear and llama3)"
            ))
        }
    };
    Ok(Rope { theta, scaling })
}

/// `key` of `obj` when present and not null.
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn f64_field(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ConfigError> {
    field(obj, key)
        .map(|v| {
            v.as_f64()
                .ok_or_else(|| ConfigError::Unsupported(format!("{key} = {v} (not a number)")))
        })
        .transpose()
}

fn bool_field(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ConfigError> {
    field(obj, key)
        .map(|v| {
            v.as_bool()
                .ok_or_else(|| ConfigError::Unsupported(format!("{key} = {v} (not true or false)")))
        })
        .transpose()
}

/// `sliding_window`: absent means HF's class default (4096), null none.
fn window(obj: &Map<String, Value>) -> Result<Option<i64>, ConfigError> {
    match obj.get("sliding_window") {
        None => Ok(Some(4096)),
        Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .filter(|w| *w > 0)
            .map(Some)
            .ok_or_else(|| ConfigError::Unsupported(format!("sliding_window = {v}"))),
    }
}

/// `layer_types` as written, checked against the depth.
fn written_layer_types(
    obj: &Map<String, Value>,
    layers: i64,
) -> Result<Option<Vec<LayerType>>, ConfigError> {
    let Some(v) = field(obj, "layer_types") else {
        return Ok(None);
    };
    let list = v
        .as_array()
        .ok_or_else(|| ConfigError::Unsupported(format!("layer_types = {v}")))?;
    if list.len() as i64 != layers {
        return unsupported(format!(
            "layer_types has {} entries for num_hidden_layers = {layers}",
            list.len()
        ));
    }
    list.iter()
        .map(|t| match t.as_str() {
            Some("full_attention") => Ok(LayerType::Full),
            Some("sliding_attention") => Ok(LayerType::Sliding),
            _ => unsupported(format!(
                "layer type {t} (only full_attention and sliding_attention)"
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

impl ModelConfig {
    /// Parses HF `config.json` text of any supported family.
    pub fn from_json(text: &str) -> Result<ModelConfig, ConfigError> {
        let value: Value = serde_json::from_str(text).map_err(ConfigError::NotJson)?;
        let obj = value.as_object().ok_or(ConfigError::NotAnObject)?;
        let family = family_of(obj)?;
        let raw: RawConfig = serde_json::from_value(value.clone()).map_err(ConfigError::NotJson)?;
        let c = Self::resolve(family, obj, raw)?;
        c.validate()?;
        Ok(c)
    }

    /// Reads `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<ModelConfig, ModelError> {
        let text = std::fs::read_to_string(path).map_err(ModelError::io("read", path))?;
        ModelConfig::from_json(&text).map_err(|problem| ModelError::Config {
            path: Some(path.to_path_buf()),
            problem,
        })
    }

    /// The family's reading of `obj`: its defaults (HF's config class
    /// defaults where a field is absent) and every setting that changes
    /// the computation honoured or refused.
    fn resolve(
        family: Family,
        obj: &Map<String, Value>,
        raw: RawConfig,
    ) -> Result<ModelConfig, ConfigError> {
        use Family::*;
        let heads = raw.num_attention_heads;
        let layers = raw.num_hidden_layers;
        // Activation: Gemma 3 reads `hidden_activation`, the others `hidden_act`.
        let hidden_act = if family == Gemma3 {
            match field(obj, "hidden_activation").and_then(Value::as_str) {
                None | Some("gelu_pytorch_tanh") => Activation::GeluTanh,
                Some(a) => {
                    return unsupported(format!("hidden_activation `{a}` (only gelu_pytorch_tanh)"))
                }
            }
        } else {
            match field(obj, "hidden_act").and_then(Value::as_str) {
                None | Some("silu") => Activation::Silu,
                Some(a) => return unsupported(format!("hidden_act `{a}` (only silu)")),
            }
        };
        // Biases: Qwen2's q/k/v always; Mistral none; `attention_bias`
        // (q/k/v/o) where the family reads it is not implemented.
        if matches!(family, Llama | Qwen3 | Gemma3)
            && bool_field(obj, "attention_bias")? == Some(true)
        {
            return unsupported("attention_bias = true".into());
        }
        if family == Llama {
            if bool_field(obj, "mlp_bias")? == Some(true) {
                return unsupported("mlp_bias = true".into());
            }
            if let Some(tp) = field(obj, "pretraining_tp").and_then(Value::as_i64) {
                if tp != 1 {
                    return unsupported(format!("pretraining_tp = {tp}"));
                }
            }
        }
        if family == Gemma3 && bool_field(obj, "use_bidirectional_attention")? == Some(true) {
            return unsupported(
                "use_bidirectional_attention = true (only causal attention)".into(),
            );
        }
        // Sliding windows and which layers use them.
        let (sliding_window, layer_types) = match family {
            Llama => (None, vec![LayerType::Full; layers as usize]),
            Mistral => {
                let w = window(obj)?;
                let kind = if w.is_some() {
                    LayerType::Sliding
                } else {
                    LayerType::Full
                };
                (w, vec![kind; layers as usize])
            }
            Qwen2 | Qwen3 => {
                let on = bool_field(obj, "use_sliding_window")?.unwrap_or(false);
                let w = if on { window(obj)? } else { None };
                let from = field(obj, "max_window_layers")
                    .and_then(Value::as_i64)
                    .unwrap_or(28);
                let types = match written_layer_types(obj, layers)? {
                    Some(t) => t,
                    None => (0..layers)
                        .map(|i| {
                            if w.is_some() && i >= from {
                                LayerType::Sliding
                            } else {
                                LayerType::Full
                            }
                        })
                        .collect(),
                };
                (w, types)
            }
            Gemma3 => {
                let w = window(obj)?;
                let types = match written_layer_types(obj, layers)? {
                    Some(t) => t,
                    None => {
                        let pattern = field(obj, "sliding_window_pattern")
                            .and_then(Value::as_i64)
                            .unwrap_or(6);
                        if pattern < 1 {
                            return unsupported(format!("sliding_window_pattern = {pattern}"));
                        }
                        (0..layers)
                            .map(|i| {
                                if (i + 1) % pattern != 0 {
                                    LayerType::Sliding
                                } else {
                                    LayerType::Full
                                }
                            })
                            .collect()
                    }
                };
                (w, types)
            }
        };
        if sliding_window.is_none() && layer_types.contains(&LayerType::Sliding) {
            return unsupported("sliding_attention layers without a sliding_window".into());
        }
        // A window no layer uses (Qwen2's below max_window_layers) is none.
        let sliding_window = sliding_window.filter(|_| layer_types.contains(&LayerType::Sliding));
        // Rotary embeddings. Gemma 3 keeps one per layer type: global
        // layers `rope_theta` (with a legacy `rope_scaling` merged in),
        // local ones `rope_local_base_freq`; v5 writes them as
        // `rope_parameters` keyed by layer type.
        let (rope, sliding_rope) = if family == Gemma3 {
            let params = field(obj, "rope_parameters");
            let keyed = |t: LayerType| {
                params
                    .and_then(|p| p.get(t.name()))
                    .filter(|v| !v.is_null())
            };
            if params
                .is_some_and(|p| keyed(LayerType::Full).is_none() && p.get("rope_type").is_some())
            {
                return unsupported(
                    "rope_parameters not keyed by layer type for gemma3_text".into(),
                );
            }
            let mut global = keyed(LayerType::Full)
                .cloned()
                .unwrap_or_else(|| serde_json::json!({}));
            if let (Some(Value::Object(s)), Some(g)) =
                (field(obj, "rope_scaling"), global.as_object_mut())
            {
                for (k, v) in s {
                    g.insert(k.clone(), v.clone());
                }
            }
            let theta = f64_field(obj, "rope_theta")?.unwrap_or(1e6);
            let local_theta = f64_field(obj, "rope_local_base_freq")?.unwrap_or(1e4);
            (
                rope_from(Some(&global), theta)?,
                Some(rope_from(keyed(LayerType::Sliding), local_theta)?),
            )
        } else {
            // As transformers 5 reads them: a legacy `rope_scaling` (when
            // not null) replaces `rope_parameters` whole; the theta is the
            // chosen one's own, else the top-level `rope_theta`, else
            // 10000 (checked against transformers 5.17 by
            // scripts/make_peft_variant_fixtures.py --probe-config).
            let r = field(obj, "rope_scaling").or_else(|| field(obj, "rope_parameters"));
            let theta = f64_field(obj, "rope_theta")?.unwrap_or(10000.0);
            (rope_from(r, theta)?, None)
        };
        if let Some(f) = f64_field(obj, "partial_rotary_factor")? {
            if f != 1.0 {
                return unsupported(format!("partial_rotary_factor = {f}"));
            }
        }
        let gemma = family == Gemma3;
        Ok(ModelConfig {
            family,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            // Absent, each family's config class default.
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(match family {
                Llama => heads,
                Qwen2 | Qwen3 => 32,
                Mistral => 8,
                Gemma3 => 4,
            }),
            head_dim: raw.head_dim.unwrap_or(match family {
                Qwen3 => 128,
                Gemma3 => 256,
                _ if heads > 0 => raw.hidden_size / heads,
                _ => 0,
            }),
            rms_norm_eps: raw.rms_norm_eps,
            rope,
            sliding_rope,
            max_position_embeddings: raw.max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(gemma),
            bos_token_id: ids(&raw.bos_token_id).first().copied(),
            eos_token_ids: ids(&raw.eos_token_id),
            initializer_range: raw.initializer_range,
            qkv_bias: family == Qwen2,
            qk_norm: matches!(family, Qwen3 | Gemma3),
            layer_types,
            sliding_window,
            hidden_act,
            norm_style: if gemma {
                NormStyle::Gemma
            } else {
                NormStyle::Llama
            },
            scale_embeddings: gemma,
            sandwich_norms: gemma,
            query_pre_attn_scalar: if gemma {
                Some(f64_field(obj, "query_pre_attn_scalar")?.unwrap_or(256.0))
            } else {
                None
            },
            // `attn_logit_softcapping` is read by transformers' Gemma 3
            // config but never applied (Gemma 3 replaced Gemma 2's score
            // capping with the q/k norms), so it changes nothing here either.
            final_logit_softcapping: if gemma {
                f64_field(obj, "final_logit_softcapping")?
            } else {
                None
            },
        })
    }

    fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ] {
            if v < 1 {
                return Err(ConfigError::NotPositive {
                    field: name,
                    value: v,
                });
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(ConfigError::HeadsNotMultiple {
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
            });
        }
        if self.head_dim % 2 != 0 {
            return Err(ConfigError::OddHeadDim(self.head_dim));
        }
        for (name, v) in [
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ] {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                return Err(ConfigError::Unsupported(format!("{name} = {v}")));
            }
        }
        Ok(())
    }

    /// Whether any layer attends through a sliding window.
    pub fn has_sliding_layers(&self) -> bool {
        self.layer_types.contains(&LayerType::Sliding)
    }

    /// Whether layers differ in their attention (Gemma 3's local and
    /// global layers), so a scan over layers must be told which is which.
    pub fn mixed_layer_types(&self) -> bool {
        self.layer_types.windows(2).any(|w| w[0] != w[1])
    }

    /// The window a layer of `kind` attends through (None: all earlier positions).
    pub fn window_of(&self, kind: LayerType) -> Option<i64> {
        match kind {
            LayerType::Full => None,
            LayerType::Sliding => self.sliding_window,
        }
    }

    /// The scale of attention scores: `query_pre_attn_scalar^-0.5` (Gemma
    /// 3), else `head_dim^-0.5`.
    pub fn attention_scale(&self) -> f64 {
        self.query_pre_attn_scalar
            .unwrap_or(self.head_dim as f64)
            .powf(-0.5)
    }

    /// Every base parameter: (HF name, shape), in checkpoint order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<i64>)> {
        let (h, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (q, kv) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, h],
        )];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mut push = |name: &str, shape: Vec<i64>| out.push((format!("{p}.{name}"), shape));
            push("input_layernorm.weight", vec![h]);
            push("self_attn.q_proj.weight", vec![q, h]);
            push("self_attn.k_proj.weight", vec![kv, h]);
            push("self_attn.v_proj.weight", vec![kv, h]);
            if self.qkv_bias {
                push("self_attn.q_proj.bias", vec![q]);
                push("self_attn.k_proj.bias", vec![kv]);
                push("self_attn.v_proj.bias", vec![kv]);
            }
            if self.qk_norm {
                push("self_attn.q_norm.weight", vec![hd]);
                push("self_attn.k_norm.weight", vec![hd]);
            }
            push("self_attn.o_proj.weight", vec![h, q]);
            push("post_attention_layernorm.weight", vec![h]);
            if self.sandwich_norms {
                push("pre_feedforward_layernorm.weight", vec![h]);
                push("post_feedforward_layernorm.weight", vec![h]);
            }
            push("mlp.gate_proj.weight", vec![i, h]);
            push("mlp.up_proj.weight", vec![i, h]);
            push("mlp.down_proj.weight", vec![h, i]);
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        }
        out
    }

    /// The config as HF `config.json` for its family (transformers 4
    /// spellings, which 5 reads too).
    pub fn to_json(&self) -> String {
        let rope_json = |r: &Rope| match &r.scaling {
            None => Value::Null,
            Some(RopeScaling::Linear { factor }) => serde_json::json!({
                "rope_type": "linear",
                "factor": factor,
            }),
            Some(RopeScaling::Llama3(s)) => serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }),
        };
        let f = self.family;
        let mut v = serde_json::json!({
            "architectures": [f.architecture()],
            "model_type": f.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_json(&self.rope),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "initializer_range": self.initializer_range,
        });
        let o = v.as_object_mut().expect("an object");
        let mut set = |k: &str, x: Value| {
            o.insert(k.to_string(), x);
        };
        let types: Vec<&str> = self.layer_types.iter().map(|t| t.name()).collect();
        match f {
            Family::Llama => {
                set("hidden_act", "silu".into());
                set("attention_bias", false.into());
                set("mlp_bias", false.into());
            }
            Family::Mistral => {
                set("hidden_act", "silu".into());
                set("sliding_window", self.sliding_window.into());
            }
            Family::Qwen2 | Family::Qwen3 => {
                set("hidden_act", "silu".into());
                set("use_sliding_window", self.sliding_window.is_some().into());
                set("sliding_window", self.sliding_window.into());
                set("layer_types", types.into());
                if f == Family::Qwen3 {
                    set("attention_bias", false.into());
                }
            }
            Family::Gemma3 => {
                set("hidden_activation", "gelu_pytorch_tanh".into());
                set("attention_bias", false.into());
                set("sliding_window", self.sliding_window.into());
                set("layer_types", types.into());
                let local = self.sliding_rope.as_ref().map_or(10000.0, |r| r.theta);
                set("rope_local_base_freq", local.into());
                set("query_pre_attn_scalar", self.query_pre_attn_scalar.into());
                set(
                    "final_logit_softcapping",
                    self.final_logit_softcapping.into(),
                );
            }
        }
        serde_json::to_string_pretty(&v).expect("JSON values serialise")
    }

    /// Number of base parameters (HF's count).
    pub fn parameter_count(&self) -> i64 {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<i64>())
            .sum()
    }

    /// `(in, out)` features of a projection by module name (`q_proj`, ...).
    pub fn projection_dims(&self, module: &str) -> Option<(i64, i64)> {
        let (h, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (q, kv) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
        Some(match module {
            "q_proj" => (h, q),
            "k_proj" | "v_proj" => (h, kv),
            "o_proj" => (q, h),
            "gate_proj" | "up_proj" => (h, i),
            "down_proj" => (i, h),
            _ => return None,
        })
    }

    /// The rotary embedding of layers of `kind`.
    pub fn rope_of(&self, kind: LayerType) -> &Rope {
        match (kind, &self.sliding_rope) {
            (LayerType::Sliding, Some(r)) => r,
            _ => &self.rope,
        }
    }

    /// The rotary inverse frequencies of layers of `kind`, scaled as HF
    /// computes them (then rounded to f32 as HF holds them).
    pub fn inv_freq(&self, kind: LayerType) -> Vec<f64> {
        let rope = self.rope_of(kind);
        let d = self.head_dim as f64;
        let base: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| (1.0 / rope.theta.powf((2 * i) as f64 / d)) as f32 as f64)
            .collect();
        let s = match &rope.scaling {
            None => return base,
            Some(RopeScaling::Linear { factor }) => {
                return base.iter().map(|f| (f / factor) as f32 as f64).collect()
            }
            Some(RopeScaling::Llama3(s)) => s,
        };
        let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
        let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
        base.into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let scaled = if wavelen > low_wavelen {
                    f / s.factor
                } else {
                    f
                };
                if wavelen < high_wavelen || wavelen > low_wavelen {
                    return scaled as f32 as f64;
                }
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                ((1.0 - smooth) * scaled / s.factor + smooth * scaled) as f32 as f64
            })
            .collect()
    }
}
