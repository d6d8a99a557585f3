//! Llama configuration: HF `config.json` (transformers 4 and 5 spellings),
//! presets with the exact HF configs, and the derived sizes.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::{ConfigError, ModelError};

/// `rope_scaling` of type `llama3` (Llama 3.1+).
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// A Llama model's shape, as HF's `LlamaConfig` gives it, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3Scaling>,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    /// Standard deviation of random initial weights (HF's `initializer_range`).
    pub initializer_range: f64,
}

/// The fields of `config.json` we read; anything else is ignored unless
/// it asks for something we do not implement (checked in `resolve`).
#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: i64,
    hidden_size: i64,
    intermediate_size: i64,
    num_hidden_layers: i64,
    num_attention_heads: i64,
    num_key_value_heads: Option<i64>,
    head_dim: Option<i64>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    #[serde(default = "default_max_positions")]
    max_position_embeddings: i64,
    #[serde(default)]
    tie_word_embeddings: bool,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    pretraining_tp: Option<i64>,
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

impl LlamaConfig {
    /// Parses HF `config.json` text.
    pub fn from_json(text: &str) -> Result<LlamaConfig, ConfigError> {
        let raw: RawConfig = serde_json::from_str(text).map_err(ConfigError::NotJson)?;
        let unsupported = |what: String| Err(ConfigError::Unsupported(what));
        if let Some(t) = &raw.model_type {
            if t != "llama" {
                return unsupported(format!("model_type `{t}` (only `llama`)"));
            }
        }
        if !raw.architectures.is_empty()
            && !raw.architectures.iter().any(|a| a == "LlamaForCausalLM")
        {
            return unsupported(format!(
                "architectures {:?} (only LlamaForCausalLM)",
                raw.architectures
            ));
        }
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return unsupported(format!("hidden_act `{act}` (only `silu`)"));
            }
        }
        if raw.attention_bias == Some(true) {
            return unsupported("attention_bias = true".into());
        }
        if raw.mlp_bias == Some(true) {
            return unsupported("mlp_bias = true".into());
        }
        if raw.pretraining_tp.is_some_and(|t| t != 1) {
            return unsupported(format!(
                "pretraining_tp = {}",
                raw.pretraining_tp.unwrap_or(1)
            ));
        }
        // As transformers 5 reads them: a legacy `rope_scaling` (when not
        // null) replaces `rope_parameters` whole; the theta is the chosen
        // one's own, else the top-level `rope_theta`, else 10000 (checked
        // against transformers 5.17 by scripts/make_peft_variant_fixtures.py
        // --probe-config).
        let rope = raw.rope_scaling.as_ref().or(raw.rope_parameters.as_ref());
        let theta = rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(raw.rope_theta)
            .unwrap_or(10000.0);
        let rope_type = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let rope_scaling = match rope_type {
            "default" => None,
            "llama3" => {
                let r = rope.expect("rope_type came from it");
                let get = |k: &str| {
                    r.get(k)
                        .and_then(Value::as_f64)
                        .ok_or_else(|| ConfigError::MissingRopeField(k.to_string()))
                };
                Some(Llama3Scaling {
                    factor: get("factor")?,
                    low_freq_factor: get("low_freq_factor")?,
                    high_freq_factor: get("high_freq_factor")?,
                    original_max_position_embeddings: get("original_max_position_embeddings")?,
                })
            }
            other => return unsupported(format!("rope type `{other}` (only default and llama3)")),
        };
        let heads = raw.num_attention_heads;
        let kv = raw.num_key_value_heads.unwrap_or(heads);
        let c = LlamaConfig {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: raw.head_dim.unwrap_or(if heads > 0 {
                raw.hidden_size / heads
            } else {
                0
            }),
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta: theta,
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings,
            bos_token_id: ids(&raw.bos_token_id).first().copied(),
            eos_token_ids: ids(&raw.eos_token_id),
            initializer_range: raw.initializer_range,
        };
        c.validate()?;
        Ok(c)
    }

    /// Reads `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<LlamaConfig, ModelError> {
        let text = std::fs::read_to_string(path).map_err(ModelError::io("read", path))?;
        LlamaConfig::from_json(&text).map_err(|problem| ModelError::Config {
            path: Some(path.to_path_buf()),
            problem,
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
        Ok(())
    }

    /// A preset by name: `tiny` or the exact HF configs of Llama 3.2
    /// 1B/3B and 3.1 8B/70B/405B.
    pub fn preset(name: &str) -> Result<LlamaConfig, ConfigError> {
        let llama3 = |factor: f64| {
            Some(Llama3Scaling {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            })
        };
        let base = |vocab, hidden, inter, layers, heads, kv, head_dim, tied, scaling| LlamaConfig {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: scaling,
            max_position_embeddings: 131072,
            tie_word_embeddings: tied,
            bos_token_id: Some(128000),
            eos_token_ids: vec![128001, 128008, 128009],
            initializer_range: 0.02,
        };
        Ok(match name {
            // The vocabulary of hlo-data's byte-level tokenizer: 256 bytes,
            // BOS 256, EOS 257, padded to 264 (hlo-engine tests that they
            // agree).
            "tiny" => LlamaConfig {
                vocab_size: 264,
                hidden_size: 64,
                intermediate_size: 128,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                num_key_value_heads: 2,
                head_dim: 16,
                rms_norm_eps: 1e-5,
                rope_theta: 10000.0,
                rope_scaling: None,
                max_position_embeddings: 512,
                tie_word_embeddings: false,
                bos_token_id: Some(256),
                eos_token_ids: vec![257],
                // 1/sqrt(hidden): a random tiny model whose frozen head can
                // still express confident predictions, so LoRA can learn.
                initializer_range: 0.125,
            },
            "llama3.2-1b" => base(128256, 2048, 8192, 16, 32, 8, 64, true, llama3(32.0)),
            "llama3.2-3b" => base(128256, 3072, 8192, 28, 24, 8, 128, true, llama3(32.0)),
            "llama3.1-8b" => base(128256, 4096, 14336, 32, 32, 8, 128, false, llama3(8.0)),
            "llama3.1-70b" => base(128256, 8192, 28672, 80, 64, 8, 128, false, llama3(8.0)),
            "llama3.1-405b" => base(128256, 16384, 53248, 126, 128, 8, 128, false, llama3(8.0)),
            other => return Err(ConfigError::UnknownPreset(other.to_string())),
        })
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
            out.push((format!("{p}.input_layernorm.weight"), vec![h]));
            out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
            out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
            out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
            out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
            out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        if !self.tie_word_embeddings {
            out.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
        }
        out
    }

    /// The config as HF `config.json` (transformers 4 spelling, which 5 reads too).
    pub fn to_json(&self) -> String {
        let rope_scaling = self.rope_scaling.as_ref().map(|s| {
            serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            })
        });
        let v = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "initializer_range": self.initializer_range,
        });
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

    /// The rotary inverse frequencies, with llama3 scaling, as HF computes
    /// them (then rounded to f32 as HF holds them).
    pub fn inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let base: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| (1.0 / self.rope_theta.powf((2 * i) as f64 / d)) as f32 as f64)
            .collect();
        let Some(s) = &self.rope_scaling else {
            return base;
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
