//! HF `config.json` in and out, for every family: read as transformers
//! 5.17 reads it (transformers 4 and 5 spellings; an absent field takes the
//! family's config class default), every setting that changes the
//! computation honoured or refused; written so transformers reads the same
//! model back.

use std::path::Path;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::config::{
    yarn_mscale, Activation, ExpertStyle, Family, Head, LayerType, Llama3Scaling, MlaConfig,
    ModelConfig, MoeConfig, NormStyle, Rope, RopeScaling, Routing, SharedExpert, YarnScaling,
    FAMILIES,
};
use crate::nf4::Nf4Config;
use crate::{ConfigError, ModelError};

/// What hlo-train runs, for error messages.
fn supported() -> String {
    let names: Vec<&str> = FAMILIES.iter().map(|f| f.architecture()).collect();
    format!("hlo-train runs {}", names.join(", "))
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
    rms_norm_eps: Option<f64>,
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

/// Families whose computation hlo-train does not implement, by
/// `model_type` and architecture, with the feature it lacks: refused
/// naming it rather than as an unknown family.
const REFUSED_FEATURES: [(&str, &str, &str); 4] = [
    (
        "deepseek_v32",
        "DeepseekV32ForCausalLM",
        "DeepSeek-V3.2's sparse attention (DSA: a lightning indexer keeps index_topk keys per query)",
    ),
    (
        "qwen3_next",
        "Qwen3NextForCausalLM",
        "Qwen3-Next's linear attention (Gated DeltaNet layers between the gated attention ones)",
    ),
    (
        "llama4",
        "Llama4ForConditionalGeneration",
        "Llama 4's chunked attention (attention_chunk_size, with NoPE layers)",
    ),
    (
        "llama4_text",
        "Llama4ForCausalLM",
        "Llama 4's chunked attention (attention_chunk_size, with NoPE layers)",
    ),
];

/// The feature a config's family lacks here, when it is one of
/// [`REFUSED_FEATURES`], as a refusal naming it.
fn refused_feature(model_type: Option<&str>, architectures: &[&str]) -> Result<(), ConfigError> {
    let named = |(t, a, _): &&(&str, &str, &str)| {
        model_type == Some(*t) || (model_type.is_none() && architectures.contains(a))
    };
    match REFUSED_FEATURES.iter().find(named) {
        Some((t, a, feature)) => unsupported(format!(
            "{feature} (model_type `{t}`, {a}) is not computed ({})",
            supported()
        )),
        None => Ok(()),
    }
}

/// The family a config describes, by `model_type`, else by
/// `architectures`, else Llama (configs written before `model_type`).
fn family_of(obj: &Map<String, Value>) -> Result<Family, ConfigError> {
    let architectures: Vec<&str> = match obj.get("architectures") {
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    refused_feature(
        obj.get("model_type").and_then(Value::as_str),
        &architectures,
    )?;
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
    let classifier = family.classifier_architecture();
    let known = |a: &&str| *a == family.architecture() || *a == classifier;
    if !architectures.is_empty() && !architectures.iter().any(known) {
        return unsupported(format!(
            "architectures {architectures:?} for model_type `{}` ({})",
            family.model_type(),
            supported()
        ));
    }
    Ok(family)
}

/// `raw` (a `config.json`'s bytes) as `config`'s: for a sequence
/// classifier, `architectures`, `id2label`, `label2id` and `pad_token_id`
/// set as transformers writes them (a causal LM's config made a reward
/// model's), every other field kept; a causal LM's as it is.
pub fn with_head(raw: &[u8], config: &ModelConfig) -> Result<Vec<u8>, ConfigError> {
    let Head::SequenceClassification { .. } = config.head else {
        return Ok(raw.to_vec());
    };
    let mut v: Value = serde_json::from_slice(raw)
        .map_err(|e| ConfigError::Unsupported(format!("config.json is not JSON: {e}")))?;
    let ours: Value = serde_json::from_str(&config.to_json()).expect("to_json writes JSON");
    if let (Some(o), Some(src)) = (v.as_object_mut(), ours.as_object()) {
        o.remove("num_labels");
        for key in ["architectures", "id2label", "label2id", "pad_token_id"] {
            o.insert(key.into(), src[key].clone());
        }
    }
    Ok(serde_json::to_string_pretty(&v)
        .expect("JSON values serialise")
        .into_bytes())
}

/// The head `architectures` names: a sequence classifier's `score` of
/// `num_labels` (else as many as `id2label` names, else transformers'
/// default 2), pooled by `pad_token_id`; else the LM head.
fn head_of(family: Family, obj: &Map<String, Value>) -> Result<Head, ConfigError> {
    let classifier = family.classifier_architecture();
    let named = matches!(obj.get("architectures"), Some(Value::Array(a))
        if a.iter().any(|v| v.as_str() == Some(classifier.as_str())));
    if !named {
        return Ok(Head::CausalLm);
    }
    let labels = match (obj.get("num_labels"), obj.get("id2label")) {
        (Some(n), _) => n.as_i64(),
        (None, Some(Value::Object(m))) => Some(m.len() as i64),
        (None, _) => Some(2),
    };
    let num_labels = labels.filter(|&n| n >= 1).ok_or_else(|| {
        ConfigError::Unsupported(format!(
            "{classifier} with num_labels {:?}",
            obj.get("num_labels")
        ))
    })?;
    Ok(Head::SequenceClassification {
        num_labels,
        pad_token_id: ids(&obj.get("pad_token_id").cloned()).first().copied(),
    })
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
        "yarn" => Some(RopeScaling::Yarn(yarn_from(r, &get)?)),
        other => {
            return unsupported(format!(
                "rope type `{other}` (only default, linear, llama3 and yarn)"
            ))
        }
    };
    let partial_rotary_factor = match r.and_then(|r| r.get("partial_rotary_factor")) {
        None | Some(Value::Null) => 1.0,
        Some(v) => v.as_f64().ok_or_else(|| {
            ConfigError::Unsupported(format!("partial_rotary_factor = {v} (not a number)"))
        })?,
    };
    Ok(Rope {
        theta,
        scaling,
        partial_rotary_factor,
    })
}

/// A yarn `rope_parameters` object `r` (`get` reads its required
/// numbers): its attention factor as transformers computes it, DeepSeek's
/// two mscales included.
fn yarn_from(
    r: Option<&Value>,
    get: &dyn Fn(&str) -> Result<f64, ConfigError>,
) -> Result<YarnScaling, ConfigError> {
    let opt = |k: &str| r.and_then(|r| r.get(k)).filter(|v| !v.is_null());
    let number = |k: &str| match opt(k) {
        None => Ok(0.0),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| ConfigError::Unsupported(format!("yarn {k} = {v} (not a number)"))),
    };
    let (mscale, mscale_all_dim) = (number("mscale")?, number("mscale_all_dim")?);
    let factor = get("factor")?;
    if !(factor.is_finite() && factor > 0.0) {
        return unsupported(format!("yarn rope factor = {factor}"));
    }
    let or = |k: &str, d: f64| {
        opt(k)
            .and_then(Value::as_f64)
            .filter(|v| *v != 0.0)
            .unwrap_or(d)
    };
    let attention_factor = match opt("attention_factor").map(Value::as_f64) {
        Some(Some(a)) => a,
        Some(None) => return unsupported("yarn attention_factor (not a number)".into()),
        // DeepSeek's: the ratio of the two mscales (both given).
        None if mscale != 0.0 && mscale_all_dim != 0.0 => {
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        }
        None => yarn_mscale(factor, 1.0),
    };
    Ok(YarnScaling {
        factor,
        beta_fast: or("beta_fast", 32.0),
        beta_slow: or("beta_slow", 1.0),
        original_max_position_embeddings: get("original_max_position_embeddings")?,
        truncate: opt("truncate").and_then(Value::as_bool).unwrap_or(true),
        attention_factor,
        mscale_all_dim,
    })
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

/// `quantization_config` as transformers writes it for a model quantized
/// by bitsandbytes: 4-bit NF4 of every layer projection is read (with or
/// without double quantization). gpt-oss's released MXFP4 experts are
/// dequantized as the checkpoint is read (as transformers does without
/// its kernels), so the model runs unquantized. Any other quantization is
/// refused.
fn quantization(
    family: Family,
    obj: &Map<String, Value>,
) -> Result<Option<Nf4Config>, ConfigError> {
    let Some(q) = field(obj, "quantization_config") else {
        return Ok(None);
    };
    let q = q
        .as_object()
        .ok_or_else(|| ConfigError::Unsupported(format!("quantization_config = {q}")))?;
    let text = |key: &str| field(q, key).and_then(Value::as_str);
    let method = text("quant_method").unwrap_or("(none)");
    if method == "mxfp4" && family == Family::GptOss {
        return Ok(None);
    }
    if method != "bitsandbytes" {
        return unsupported(format!(
            "quantization_config.quant_method `{method}` (only bitsandbytes 4-bit NF4, and gpt-oss's mxfp4 experts)"
        ));
    }
    if bool_field(q, "load_in_8bit")? == Some(true) || bool_field(q, "load_in_4bit")? != Some(true)
    {
        return unsupported("bitsandbytes quantization other than load_in_4bit".into());
    }
    match text("bnb_4bit_quant_type") {
        Some("nf4") => {}
        t => {
            return unsupported(format!(
                "bnb_4bit_quant_type {} (only nf4)",
                t.unwrap_or("(absent: fp4)")
            ))
        }
    }
    if let Some(storage) = text("bnb_4bit_quant_storage").filter(|s| *s != "uint8") {
        return unsupported(format!("bnb_4bit_quant_storage `{storage}` (only uint8)"));
    }
    // Modules left in full precision: the LM head is never quantized here.
    if let Some(skip) = field(q, "llm_int8_skip_modules") {
        let listed: Vec<&str> = skip
            .as_array()
            .map_or(Vec::new(), |a| a.iter().filter_map(Value::as_str).collect());
        if !skip.is_array() || listed.iter().any(|m| *m != "lm_head") {
            return unsupported(format!(
                "llm_int8_skip_modules = {skip} (only lm_head may be left unquantized)"
            ));
        }
    }
    Ok(Some(Nf4Config {
        double_quant: bool_field(q, "bnb_4bit_use_double_quant")?.unwrap_or(false),
    }))
}

fn int_field(obj: &Map<String, Value>, key: &str) -> Result<Option<i64>, ConfigError> {
    field(obj, key)
        .map(|v| {
            v.as_i64()
                .ok_or_else(|| ConfigError::Unsupported(format!("{key} = {v} (not an integer)")))
        })
        .transpose()
}

/// The number of experts: `num_local_experts`, or `num_experts` or
/// `n_routed_experts`, which transformers 5 maps to it (and writes as it).
fn expert_count(obj: &Map<String, Value>) -> Result<Option<i64>, ConfigError> {
    let (local, named) = (
        int_field(obj, "num_local_experts")?,
        int_field(obj, "num_experts")?.or(int_field(obj, "n_routed_experts")?),
    );
    match (local, named) {
        (Some(a), Some(b)) if a != b => unsupported(format!(
            "num_local_experts = {a} and num_experts = {b} disagree"
        )),
        _ => Ok(local.or(named)),
    }
}

/// `output_router_logits` and `router_aux_loss_coef`: whether training
/// adds the router's load-balancing loss, and its weight.
fn router_aux_loss(obj: &Map<String, Value>) -> Result<(bool, f64), ConfigError> {
    Ok((
        bool_field(obj, "output_router_logits")?.unwrap_or(false),
        f64_field(obj, "router_aux_loss_coef")?.unwrap_or(0.001),
    ))
}

/// The experts of a Qwen3-MoE, Mixtral or gpt-oss config (None for the
/// dense families, and for a Qwen3-MoE config with `num_experts` 0), with
/// each config class's defaults.
fn experts(
    family: Family,
    obj: &Map<String, Value>,
    layers: i64,
    intermediate: i64,
) -> Result<Option<MoeConfig>, ConfigError> {
    let aux = router_aux_loss(obj)?;
    let moe = match family {
        Family::Qwen3Moe | Family::Qwen2Moe => match qwen_moe_experts(family, obj, layers, aux)? {
            Some(moe) => moe,
            None => return Ok(None),
        },
        Family::Mixtral => mixtral_experts(obj, layers, intermediate, aux)?,
        Family::Glm4Moe | Family::DeepseekV3 => sigmoid_routed_experts(family, obj, layers)?,
        Family::GptOss => gpt_oss_experts(obj, layers, intermediate, aux)?,
        _ => return Ok(None),
    };
    check_experts(&moe)?;
    Ok(Some(moe))
}

/// `mlp_only_layers`: the layers Qwen3-MoE keeps dense.
fn mlp_only_layers(obj: &Map<String, Value>) -> Result<Vec<i64>, ConfigError> {
    match field(obj, "mlp_only_layers") {
        None => Ok(Vec::new()),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
            .ok_or_else(|| {
                ConfigError::Unsupported(format!("mlp_only_layers = {v} (not integers)"))
            }),
    }
}

/// Qwen3-MoE's and Qwen2-MoE's experts (`Qwen3MoeSparseMoeBlock`,
/// `Qwen2MoeSparseMoeBlock`, which adds a gated shared expert): every
/// `decoder_sparse_step`-th layer sparse but those of `mlp_only_layers`;
/// None when `num_experts` is 0 (every layer dense). Each config class's
/// defaults.
fn qwen_moe_experts(
    family: Family,
    obj: &Map<String, Value>,
    layers: i64,
    aux: (bool, f64),
) -> Result<Option<MoeConfig>, ConfigError> {
    let qwen2 = family == Family::Qwen2Moe;
    let (experts, top_k, width) = if qwen2 { (60, 4, 1408) } else { (128, 8, 768) };
    let experts = expert_count(obj)?.unwrap_or(experts);
    if experts == 0 {
        return Ok(None);
    }
    let step = int_field(obj, "decoder_sparse_step")?.unwrap_or(1);
    if step < 1 {
        return unsupported(format!("decoder_sparse_step = {step}"));
    }
    let dense = mlp_only_layers(obj)?;
    Ok(Some(MoeConfig {
        num_experts: experts,
        top_k: int_field(obj, "num_experts_per_tok")?.unwrap_or(top_k),
        moe_intermediate_size: int_field(obj, "moe_intermediate_size")?.unwrap_or(width),
        norm_topk_prob: bool_field(obj, "norm_topk_prob")?.unwrap_or(false),
        sparse_layers: (0..layers)
            .map(|l| !dense.contains(&l) && (l + 1) % step == 0)
            .collect(),
        output_router_logits: aux.0,
        router_aux_loss_coef: aux.1,
        f32_routing_weights: false,
        routing: Routing::Softmax,
        style: ExpertStyle::SwiGlu,
        shared_expert: match qwen2 {
            true => Some(SharedExpert {
                intermediate_size: int_field(obj, "shared_expert_intermediate_size")?
                    .unwrap_or(5632),
                gated: true,
            }),
            false => None,
        },
    }))
}

/// Mixtral's experts (`MixtralSparseMoeBlock`): every layer sparse, each
/// expert of `intermediate_size`, the top k weights renormalised, routing
/// weights in f32; `router_jitter_noise` refused.
fn mixtral_experts(
    obj: &Map<String, Value>,
    layers: i64,
    intermediate: i64,
    aux: (bool, f64),
) -> Result<MoeConfig, ConfigError> {
    if let Some(j) = f64_field(obj, "router_jitter_noise")?.filter(|j| *j != 0.0) {
        return unsupported(format!(
            "router_jitter_noise = {j} (random noise on the router's input in training; only 0)"
        ));
    }
    Ok(MoeConfig {
        num_experts: expert_count(obj)?.unwrap_or(8),
        top_k: int_field(obj, "num_experts_per_tok")?.unwrap_or(2),
        moe_intermediate_size: intermediate,
        norm_topk_prob: true,
        sparse_layers: vec![true; layers.max(0) as usize],
        output_router_logits: aux.0,
        router_aux_loss_coef: aux.1,
        f32_routing_weights: true,
        routing: Routing::Softmax,
        style: ExpertStyle::SwiGlu,
        shared_expert: None,
    })
}

/// gpt-oss's experts (`GptOssMLP`): every layer sparse, each expert of
/// `intermediate_size`, its clamped SwiGLU (`swiglu_alpha`,
/// `swiglu_limit`).
fn gpt_oss_experts(
    obj: &Map<String, Value>,
    layers: i64,
    intermediate: i64,
    aux: (bool, f64),
) -> Result<MoeConfig, ConfigError> {
    Ok(MoeConfig {
        num_experts: expert_count(obj)?.unwrap_or(128),
        top_k: int_field(obj, "num_experts_per_tok")?.unwrap_or(4),
        moe_intermediate_size: intermediate,
        // The softmax over the k chosen logits sums to 1 already.
        norm_topk_prob: false,
        sparse_layers: vec![true; layers.max(0) as usize],
        output_router_logits: aux.0,
        router_aux_loss_coef: aux.1,
        f32_routing_weights: false,
        routing: Routing::Softmax,
        style: ExpertStyle::GptOss {
            swiglu_alpha: f64_field(obj, "swiglu_alpha")?.unwrap_or(1.702),
            swiglu_limit: f64_field(obj, "swiglu_limit")?.unwrap_or(7.0),
        },
        shared_expert: None,
    })
}

/// DeepSeek-V3's and GLM-4.5's experts (`DeepseekV3MoE`, `Glm4MoeMoE`):
/// the layers from `first_k_dense_replace` on sparse, each with
/// `n_shared_experts` shared experts as one MLP, routed by sigmoid scores
/// ([`Routing::Sigmoid`]), the weights in f32. Their models compute no
/// load-balancing loss, whatever `output_router_logits` says; so neither
/// does hlo-train.
fn sigmoid_routed_experts(
    family: Family,
    obj: &Map<String, Value>,
    layers: i64,
) -> Result<MoeConfig, ConfigError> {
    // Each config class's defaults: (experts, top k, expert width, first
    // sparse layer, groups, groups kept, scaling).
    let (e, k, w, first, groups, kept, scaling) = match family {
        Family::Glm4Moe => (128, 8, 1408, 1, 1, 1, 1.0),
        _ => (256, 8, 2048, 3, 8, 4, 2.5),
    };
    let width = int_field(obj, "moe_intermediate_size")?.unwrap_or(w);
    let first = int_field(obj, "first_k_dense_replace")?.unwrap_or(first);
    let shared = int_field(obj, "n_shared_experts")?.unwrap_or(1);
    if shared < 0 {
        return unsupported(format!("n_shared_experts = {shared}"));
    }
    let n_group = int_field(obj, "n_group")?.unwrap_or(groups);
    Ok(MoeConfig {
        num_experts: expert_count(obj)?.unwrap_or(e),
        top_k: int_field(obj, "num_experts_per_tok")?.unwrap_or(k),
        moe_intermediate_size: width,
        norm_topk_prob: bool_field(obj, "norm_topk_prob")?.unwrap_or(true),
        sparse_layers: (0..layers).map(|l| l >= first).collect(),
        output_router_logits: false,
        router_aux_loss_coef: 0.0,
        f32_routing_weights: true,
        style: ExpertStyle::SwiGlu,
        shared_expert: (shared > 0).then_some(SharedExpert {
            intermediate_size: width * shared,
            gated: false,
        }),
        routing: Routing::Sigmoid {
            n_group,
            topk_group: int_field(obj, "topk_group")?.unwrap_or(kept),
            routed_scaling_factor: f64_field(obj, "routed_scaling_factor")?.unwrap_or(scaling),
        },
    })
}

/// DeepSeek-V3's multi-head latent attention (None for the other
/// families), with its config class's defaults; q/k/v biases
/// (`attention_bias`) and key-value heads other than the query heads (HF
/// expands the latent into every query head) refused.
fn latent_attention(
    family: Family,
    obj: &Map<String, Value>,
    heads: i64,
    kv_heads: i64,
) -> Result<Option<MlaConfig>, ConfigError> {
    if family != Family::DeepseekV3 {
        return Ok(None);
    }
    if bool_field(obj, "attention_bias")? == Some(true) {
        return unsupported(
            "attention_bias = true (biases on DeepSeek-V3's latent projections)".into(),
        );
    }
    if kv_heads != heads {
        return unsupported(format!(
            "num_key_value_heads = {kv_heads} with {heads} attention heads (multi-head latent attention expands the latent into every head)"
        ));
    }
    let q_lora_rank = match field(obj, "q_lora_rank") {
        None if obj.contains_key("q_lora_rank") => None,
        _ => Some(int_field(obj, "q_lora_rank")?.unwrap_or(1536)),
    };
    let mla = MlaConfig {
        q_lora_rank,
        kv_lora_rank: int_field(obj, "kv_lora_rank")?.unwrap_or(512),
        qk_nope_head_dim: int_field(obj, "qk_nope_head_dim")?.unwrap_or(128),
        qk_rope_head_dim: int_field(obj, "qk_rope_head_dim")?.unwrap_or(64),
        v_head_dim: int_field(obj, "v_head_dim")?.unwrap_or(128),
        rope_interleave: bool_field(obj, "rope_interleave")?.unwrap_or(true),
    };
    let dims = [
        ("q_lora_rank", mla.q_lora_rank.unwrap_or(1)),
        ("kv_lora_rank", mla.kv_lora_rank),
        ("qk_nope_head_dim", mla.qk_nope_head_dim),
        ("v_head_dim", mla.v_head_dim),
    ];
    if let Some((name, v)) = dims.into_iter().find(|(_, v)| *v < 1) {
        return unsupported(format!("{name} = {v}"));
    }
    let rope = mla.qk_rope_head_dim;
    if rope < 2 || rope % 2 != 0 {
        return unsupported(format!(
            "qk_rope_head_dim = {rope} (an even number of rotary dimensions)"
        ));
    }
    if mla.v_head_dim > mla.qk_nope_head_dim + rope {
        return unsupported(format!(
            "v_head_dim = {} wider than a key head ({})",
            mla.v_head_dim,
            mla.qk_nope_head_dim + rope
        ));
    }
    Ok(Some(mla))
}

/// Refuses experts hlo-train cannot route: gpt-oss's SwiGLU clamp not
/// finite and positive, a top k outside the experts, an expert width
/// below 1, a router aux loss weight not finite.
fn check_experts(moe: &MoeConfig) -> Result<(), ConfigError> {
    if let ExpertStyle::GptOss {
        swiglu_alpha,
        swiglu_limit,
    } = moe.style
    {
        if !(swiglu_alpha.is_finite() && swiglu_limit.is_finite() && swiglu_limit > 0.0) {
            return unsupported(format!(
                "swiglu_alpha = {swiglu_alpha}, swiglu_limit = {swiglu_limit}"
            ));
        }
    }
    if moe.num_experts < 1 || moe.top_k < 1 || moe.top_k > moe.num_experts {
        return unsupported(format!(
            "num_experts_per_tok = {} with {} experts",
            moe.top_k, moe.num_experts
        ));
    }
    if moe.moe_intermediate_size < 1 {
        return Err(ConfigError::NotPositive {
            field: "moe_intermediate_size",
            value: moe.moe_intermediate_size,
        });
    }
    if !(moe.router_aux_loss_coef.is_finite()) {
        return unsupported(format!(
            "router_aux_loss_coef = {}",
            moe.router_aux_loss_coef
        ));
    }
    check_groups(moe)
}

/// Refuses a sigmoid router's groups that HF's router cannot form: groups
/// not dividing the experts, fewer than two experts a group (its score is
/// the group's best two), more groups kept than there are, fewer experts
/// in the kept groups than a token picks; a scaling not finite.
fn check_groups(moe: &MoeConfig) -> Result<(), ConfigError> {
    let Routing::Sigmoid {
        n_group,
        topk_group,
        routed_scaling_factor,
    } = moe.routing
    else {
        return Ok(());
    };
    let e = moe.num_experts;
    let fits = n_group >= 1 && e % n_group == 0 && e / n_group >= 2;
    if !(fits
        && topk_group >= 1
        && topk_group <= n_group
        && topk_group * (e / n_group) >= moe.top_k)
    {
        return unsupported(format!(
            "n_group = {n_group}, topk_group = {topk_group} with {e} experts, {} a token",
            moe.top_k
        ));
    }
    if !routed_scaling_factor.is_finite() {
        return unsupported(format!("routed_scaling_factor = {routed_scaling_factor}"));
    }
    Ok(())
}

/// The MLP's activation: Gemma 3 reads `hidden_activation`, the others
/// `hidden_act`.
fn hidden_activation(family: Family, obj: &Map<String, Value>) -> Result<Activation, ConfigError> {
    if family == Family::Gemma3 {
        match field(obj, "hidden_activation").and_then(Value::as_str) {
            None | Some("gelu_pytorch_tanh") => Ok(Activation::GeluTanh),
            Some(a) => unsupported(format!("hidden_activation `{a}` (only gelu_pytorch_tanh)")),
        }
    } else {
        match field(obj, "hidden_act").and_then(Value::as_str) {
            None | Some("silu") => Ok(Activation::Silu),
            Some(a) => unsupported(format!("hidden_act `{a}` (only silu)")),
        }
    }
}

/// The attention projections' biases, as (q/k/v, o): Qwen2's q/k/v
/// always; gpt-oss's q/k/v/o unless `attention_bias` is false; Mistral
/// none. `attention_bias` (q/k/v/o) where the other families read it is
/// not implemented: refused.
fn attention_biases(family: Family, obj: &Map<String, Value>) -> Result<(bool, bool), ConfigError> {
    use Family::*;
    if matches!(family, Llama | Qwen3 | Gemma3 | Qwen3Moe)
        && bool_field(obj, "attention_bias")? == Some(true)
    {
        return unsupported("attention_bias = true".into());
    }
    // gpt-oss: q/k/v/o biases unless `attention_bias` is false.
    let all_biases = family == GptOss && bool_field(obj, "attention_bias")?.unwrap_or(true);
    // Qwen2-MoE: q/k/v biases unless `qkv_bias` is false; GLM-4.5's
    // `attention_bias` biases q/k/v (not o).
    let qkv = match family {
        Qwen2Moe => bool_field(obj, "qkv_bias")?.unwrap_or(true),
        Glm4Moe => bool_field(obj, "attention_bias")?.unwrap_or(false),
        _ => family == Qwen2 || all_biases,
    };
    Ok((qkv, all_biases))
}

/// Refuses what Llama's and Gemma 3's configs can set that is not
/// implemented: Llama's `mlp_bias` and `pretraining_tp` (other than 1),
/// Gemma 3's `use_bidirectional_attention`.
fn refuse_unimplemented(family: Family, obj: &Map<String, Value>) -> Result<(), ConfigError> {
    if family == Family::Llama {
        if bool_field(obj, "mlp_bias")? == Some(true) {
            return unsupported("mlp_bias = true".into());
        }
        if let Some(tp) = field(obj, "pretraining_tp").and_then(Value::as_i64) {
            if tp != 1 {
                return unsupported(format!("pretraining_tp = {tp}"));
            }
        }
    }
    if family == Family::Gemma3 && bool_field(obj, "use_bidirectional_attention")? == Some(true) {
        return unsupported("use_bidirectional_attention = true (only causal attention)".into());
    }
    Ok(())
}

/// The sliding window (`sliding_window`) and which layers use it
/// (`layer_types`), as each family's config class reads them.
fn sliding_windows(
    family: Family,
    obj: &Map<String, Value>,
    layers: i64,
) -> Result<(Option<i64>, Vec<LayerType>), ConfigError> {
    use Family::*;
    let (sliding_window, layer_types) = match family {
        Llama | Glm4Moe | DeepseekV3 => (None, vec![LayerType::Full; layers as usize]),
        Mistral => every_layer(window(obj)?, layers),
        // Every layer slides when there is a window: Mixtral's default
        // is none; Qwen3-MoE's only with `use_sliding_window`.
        Mixtral | Qwen3Moe => every_layer(moe_window(family, obj)?, layers),
        Qwen2 | Qwen3 => qwen2_windows(obj, layers)?,
        Qwen2Moe => qwen2_moe_windows(obj, layers)?,
        // Layers alternate, sliding first, unless written.
        GptOss => gpt_oss_windows(obj, layers)?,
        Gemma3 => gemma3_windows(obj, layers)?,
    };
    if sliding_window.is_none() && layer_types.contains(&LayerType::Sliding) {
        return unsupported("sliding_attention layers without a sliding_window".into());
    }
    // A window no layer uses (Qwen2's below max_window_layers) is none.
    let sliding_window = sliding_window.filter(|_| layer_types.contains(&LayerType::Sliding));
    Ok((sliding_window, layer_types))
}

/// Window `w` for every layer: all sliding when there is one, else all
/// full attention.
fn every_layer(w: Option<i64>, layers: i64) -> (Option<i64>, Vec<LayerType>) {
    let kind = if w.is_some() {
        LayerType::Sliding
    } else {
        LayerType::Full
    };
    (w, vec![kind; layers as usize])
}

/// Mixtral's window (none when `sliding_window` is absent) or
/// Qwen3-MoE's (only with `use_sliding_window`).
fn moe_window(family: Family, obj: &Map<String, Value>) -> Result<Option<i64>, ConfigError> {
    let on = family == Family::Mixtral || bool_field(obj, "use_sliding_window")?.unwrap_or(false);
    Ok(match obj.get("sliding_window") {
        None if family == Family::Mixtral => None,
        _ if on => window(obj)?,
        _ => None,
    })
}

/// Qwen2's and Qwen3's windows: with `use_sliding_window`, the layers
/// from `max_window_layers` on slide, unless `layer_types` is written.
fn qwen2_windows(
    obj: &Map<String, Value>,
    layers: i64,
) -> Result<(Option<i64>, Vec<LayerType>), ConfigError> {
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
    Ok((w, types))
}

/// Qwen2-MoE's windows: with `use_sliding_window`, every other layer
/// below `max_window_layers` slides (the first, the third, ...), unless
/// `layer_types` is written (`Qwen2MoeConfig.__post_init__`).
fn qwen2_moe_windows(
    obj: &Map<String, Value>,
    layers: i64,
) -> Result<(Option<i64>, Vec<LayerType>), ConfigError> {
    let on = bool_field(obj, "use_sliding_window")?.unwrap_or(false);
    let w = if on { window(obj)? } else { None };
    let below = int_field(obj, "max_window_layers")?.unwrap_or(28);
    let types = match written_layer_types(obj, layers)? {
        Some(t) => t,
        None => (0..layers)
            .map(|i| match w.is_some() && i % 2 == 0 && i < below {
                true => LayerType::Sliding,
                false => LayerType::Full,
            })
            .collect(),
    };
    Ok((w, types))
}

/// gpt-oss's windows: 128 when `sliding_window` is absent, the layers
/// alternating (sliding first) unless `layer_types` is written.
fn gpt_oss_windows(
    obj: &Map<String, Value>,
    layers: i64,
) -> Result<(Option<i64>, Vec<LayerType>), ConfigError> {
    let w = match obj.get("sliding_window") {
        None => Some(128),
        _ => window(obj)?,
    };
    let types = match written_layer_types(obj, layers)? {
        Some(t) => t,
        None => LayerType::pattern(layers, 2),
    };
    Ok((w, types))
}

/// Gemma 3's windows: every `sliding_window_pattern`-th layer full
/// attention, the others sliding, unless `layer_types` is written.
fn gemma3_windows(
    obj: &Map<String, Value>,
    layers: i64,
) -> Result<(Option<i64>, Vec<LayerType>), ConfigError> {
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
            LayerType::pattern(layers, pattern)
        }
    };
    Ok((w, types))
}

/// The rotary embeddings: every layer's (Gemma 3: its global layers'),
/// and Gemma 3's local layers' own; a `partial_rotary_factor` other than
/// 1 is refused.
fn rotary_embeddings(
    family: Family,
    obj: &Map<String, Value>,
) -> Result<(Rope, Option<Rope>), ConfigError> {
    let ropes = if family == Family::Gemma3 {
        let (global, local) = gemma3_ropes(obj)?;
        (global, Some(local))
    } else {
        (rope_of(family, obj)?, None)
    };
    let (mut rope, local) = ropes;
    // transformers 5 keeps it in `rope_parameters`; 4 at the top level;
    // GLM-4.5's class sets 0.5 where neither does.
    let written = r_field_or_top(obj, &rope)?;
    rope.partial_rotary_factor = match (written, family) {
        (Some(f), _) => f,
        (None, Family::Glm4Moe) => 0.5,
        (None, _) => 1.0,
    };
    let f = rope.partial_rotary_factor;
    if f != 1.0 && family != Family::Glm4Moe {
        return unsupported(format!("partial_rotary_factor = {f}"));
    }
    if !(f > 0.0 && f <= 1.0) {
        return unsupported(format!("partial_rotary_factor = {f} (not in (0, 1])"));
    }
    Ok((rope, local))
}

/// The partial rotary factor a config writes: in its rope object (read
/// into `rope`, 1 when absent there) or at the top level.
fn r_field_or_top(obj: &Map<String, Value>, rope: &Rope) -> Result<Option<f64>, ConfigError> {
    if rope.partial_rotary_factor != 1.0 {
        return Ok(Some(rope.partial_rotary_factor));
    }
    f64_field(obj, "partial_rotary_factor")
}

/// Gemma 3's rotary embeddings, one per layer type, as (global, local):
/// global layers `rope_theta` (with a legacy `rope_scaling` merged in),
/// local ones `rope_local_base_freq`; v5 writes them as `rope_parameters`
/// keyed by layer type.
fn gemma3_ropes(obj: &Map<String, Value>) -> Result<(Rope, Rope), ConfigError> {
    let params = field(obj, "rope_parameters");
    let keyed = |t: LayerType| {
        params
            .and_then(|p| p.get(t.name()))
            .filter(|v| !v.is_null())
    };
    if params.is_some_and(|p| keyed(LayerType::Full).is_none() && p.get("rope_type").is_some()) {
        return unsupported("rope_parameters not keyed by layer type for gemma3_text".into());
    }
    let mut global = keyed(LayerType::Full)
        .cloned()
        .unwrap_or_else(|| serde_json::json!({}));
    if let (Some(Value::Object(s)), Some(g)) = (field(obj, "rope_scaling"), global.as_object_mut())
    {
        for (k, v) in s {
            g.insert(k.clone(), v.clone());
        }
    }
    let theta = f64_field(obj, "rope_theta")?.unwrap_or(1e6);
    let local_theta = f64_field(obj, "rope_local_base_freq")?.unwrap_or(1e4);
    Ok((
        rope_from(Some(&global), theta)?,
        rope_from(keyed(LayerType::Sliding), local_theta)?,
    ))
}

/// The rotary embedding of the families with one, as transformers 5 reads
/// it: a legacy `rope_scaling` (when not null) replaces `rope_parameters`
/// whole; the theta is the chosen one's own, else the top-level
/// `rope_theta`, else 10000 (checked against transformers 5.17 by
/// scripts/make_peft_variant_fixtures.py --probe-config). gpt-oss's class
/// default is yarn over a theta of 150000.
fn rope_of(family: Family, obj: &Map<String, Value>) -> Result<Rope, ConfigError> {
    let gpt_oss_default = serde_json::json!({
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": false, "original_max_position_embeddings": 4096,
    });
    let r = field(obj, "rope_scaling")
        .or_else(|| field(obj, "rope_parameters"))
        .or((family == Family::GptOss).then_some(&gpt_oss_default));
    let default_theta = if family == Family::GptOss {
        150000.0
    } else {
        10000.0
    };
    let theta = f64_field(obj, "rope_theta")?.unwrap_or(default_theta);
    rope_from(r, theta)
}

/// `num_key_value_heads` when absent: each family's config class default.
fn default_kv_heads(family: Family, heads: i64) -> i64 {
    use Family::*;
    match family {
        Llama => heads,
        Qwen2 | Qwen3 => 32,
        Mistral | Mixtral | GptOss => 8,
        Gemma3 | Qwen3Moe => 4,
        Qwen2Moe => 16,
        Glm4Moe => 8,
        DeepseekV3 => heads,
    }
}

/// `head_dim` when absent: each family's config class default (Llama's
/// and the others' `hidden_size / num_attention_heads`).
fn default_head_dim(family: Family, hidden: i64, heads: i64) -> i64 {
    match family {
        Family::Qwen3 => 128,
        Family::Gemma3 => 256,
        Family::GptOss => 64,
        _ if heads > 0 => hidden / heads,
        _ => 0,
    }
}

/// `rms_norm_eps` when absent: each family's config class default.
fn default_rms_norm_eps(family: Family) -> f64 {
    match family {
        Family::Mixtral | Family::GptOss | Family::Glm4Moe => 1e-5,
        _ => 1e-6,
    }
}

/// Gemma 3's attention and logit scaling, as (`query_pre_attn_scalar`,
/// `final_logit_softcapping`); neither for the other families.
/// `attn_logit_softcapping` is read by transformers' Gemma 3 config but
/// never applied (Gemma 3 replaced Gemma 2's score capping with the q/k
/// norms), so it changes nothing here either.
fn gemma3_scaling(
    family: Family,
    obj: &Map<String, Value>,
) -> Result<(Option<f64>, Option<f64>), ConfigError> {
    if family != Family::Gemma3 {
        return Ok((None, None));
    }
    Ok((
        Some(f64_field(obj, "query_pre_attn_scalar")?.unwrap_or(256.0)),
        f64_field(obj, "final_logit_softcapping")?,
    ))
}

/// A rope's scaling as `rope_scaling` writes it (null without one), yarn's
/// with its theta (transformers 5 reads it as `rope_parameters`).
fn rope_json(r: &Rope) -> Value {
    match &r.scaling {
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
        Some(RopeScaling::Yarn(y)) => serde_json::json!({
            "rope_type": "yarn",
            "rope_theta": r.theta,
            "factor": y.factor,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "truncate": y.truncate,
            "attention_factor": y.attention_factor,
            "mscale_all_dim": y.mscale_all_dim,
        }),
    }
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
        let hidden_act = hidden_activation(family, obj)?;
        let (qkv_bias, o_bias) = attention_biases(family, obj)?;
        refuse_unimplemented(family, obj)?;
        let (sliding_window, layer_types) = sliding_windows(family, obj, layers)?;
        let (rope, sliding_rope) = rotary_embeddings(family, obj)?;
        let (query_pre_attn_scalar, final_logit_softcapping) = gemma3_scaling(family, obj)?;
        let gemma = family == Gemma3;
        let kv_heads = raw
            .num_key_value_heads
            .unwrap_or(default_kv_heads(family, heads));
        let mla = latent_attention(family, obj, heads, kv_heads)?;
        // A latent attention head's query and key width (HF's own
        // `head_dim` is the rotary part's).
        let head_dim = match mla {
            Some(m) => m.qk_nope_head_dim + m.qk_rope_head_dim,
            None => raw
                .head_dim
                .unwrap_or(default_head_dim(family, raw.hidden_size, heads)),
        };
        Ok(ModelConfig {
            family,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(default_rms_norm_eps(family)),
            rope,
            sliding_rope,
            max_position_embeddings: raw.max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(gemma),
            head: head_of(family, obj)?,
            bos_token_id: ids(&raw.bos_token_id).first().copied(),
            eos_token_ids: ids(&raw.eos_token_id),
            initializer_range: raw.initializer_range,
            qkv_bias,
            o_bias,
            attention_sinks: family == GptOss,
            qk_norm: matches!(family, Qwen3 | Gemma3 | Qwen3Moe)
                || (family == Glm4Moe && bool_field(obj, "use_qk_norm")?.unwrap_or(false)),
            layer_types,
            sliding_window,
            hidden_act,
            norm_style: match family {
                Gemma3 => NormStyle::Gemma,
                GptOss => NormStyle::F32,
                _ => NormStyle::Llama,
            },
            scale_embeddings: gemma,
            sandwich_norms: gemma,
            query_pre_attn_scalar,
            final_logit_softcapping,
            quantization: quantization(family, obj)?,
            moe: experts(family, obj, layers, raw.intermediate_size)?,
            mla,
        })
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.check_quantization()?;
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

    /// The config as HF `config.json` for its family (transformers 4
    /// spellings, which 5 reads too).
    pub fn to_json(&self) -> String {
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
        if let Head::SequenceClassification {
            num_labels,
            pad_token_id,
        } = self.head
        {
            let labels = 0..num_labels;
            o.insert("architectures".into(), json!([f.classifier_architecture()]));
            o.insert(
                "id2label".into(),
                labels
                    .clone()
                    .map(|k| (k.to_string(), json!(format!("LABEL_{k}"))))
                    .collect(),
            );
            o.insert(
                "label2id".into(),
                labels.map(|k| (format!("LABEL_{k}"), json!(k))).collect(),
            );
            o.insert("pad_token_id".into(), json!(pad_token_id));
        }
        self.family_json(o);
        if let Some(m) = &self.moe {
            self.experts_json(m, o);
        }
        serde_json::to_string_pretty(&v).expect("JSON values serialise")
    }

    /// The fields each family's config class spells its own way: the
    /// activation, the biases, the sliding window and `layer_types`, and
    /// gpt-oss's and Gemma 3's rotary embeddings and scaling.
    fn family_json(&self, o: &mut Map<String, Value>) {
        let f = self.family;
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
            Family::Mistral | Family::Mixtral => {
                set("hidden_act", "silu".into());
                set("sliding_window", self.sliding_window.into());
            }
            Family::Qwen3Moe => {
                set("hidden_act", "silu".into());
                set("use_sliding_window", self.sliding_window.is_some().into());
                set("sliding_window", self.sliding_window.into());
                set("attention_bias", false.into());
            }
            Family::DeepseekV3 => {
                set("hidden_act", "silu".into());
                self.latent_json(o);
            }
            Family::Glm4Moe => {
                set("hidden_act", "silu".into());
                set("attention_bias", self.qkv_bias.into());
                set("use_qk_norm", self.qk_norm.into());
                set(
                    "partial_rotary_factor",
                    self.rope.partial_rotary_factor.into(),
                );
            }
            Family::Qwen2Moe => {
                set("hidden_act", "silu".into());
                set("use_sliding_window", self.sliding_window.is_some().into());
                set("sliding_window", self.sliding_window.into());
                set("layer_types", types.into());
                set("qkv_bias", self.qkv_bias.into());
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
            Family::GptOss => {
                set("hidden_act", "silu".into());
                set("attention_bias", self.o_bias.into());
                set("sliding_window", self.sliding_window.into());
                set("layer_types", types.into());
                // transformers 5 reads the yarn settings from here.
                set("rope_parameters", rope_json(&self.rope));
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
    }

    /// DeepSeek-V3's latent attention and rotary settings as its config
    /// class spells them.
    fn latent_json(&self, o: &mut Map<String, Value>) {
        let m = self.mla.expect("DeepSeek-V3's latent attention");
        let mut set = |k: &str, x: Value| {
            o.insert(k.to_string(), x);
        };
        set("attention_bias", false.into());
        set("q_lora_rank", m.q_lora_rank.into());
        set("kv_lora_rank", m.kv_lora_rank.into());
        set("qk_nope_head_dim", m.qk_nope_head_dim.into());
        set("qk_rope_head_dim", m.qk_rope_head_dim.into());
        set("v_head_dim", m.v_head_dim.into());
        set("rope_interleave", m.rope_interleave.into());
        // transformers 5 reads yarn's settings from here.
        set("rope_parameters", rope_json(&self.rope));
    }

    /// The experts `m` as the family's config class spells them:
    /// `num_local_experts` (Mixtral, gpt-oss and its SwiGLU clamp) or
    /// Qwen3-MoE's `num_experts` and sparse layers.
    fn experts_json(&self, m: &MoeConfig, o: &mut Map<String, Value>) {
        let mut set = |k: &str, x: Value| {
            o.insert(k.to_string(), x);
        };
        set("num_experts_per_tok", m.top_k.into());
        set("output_router_logits", m.output_router_logits.into());
        set("router_aux_loss_coef", m.router_aux_loss_coef.into());
        if let ExpertStyle::GptOss {
            swiglu_alpha,
            swiglu_limit,
        } = m.style
        {
            set("num_local_experts", m.num_experts.into());
            set("swiglu_alpha", swiglu_alpha.into());
            set("swiglu_limit", swiglu_limit.into());
        } else if self.family == Family::Mixtral {
            set("num_local_experts", m.num_experts.into());
        } else if let Routing::Sigmoid {
            n_group,
            topk_group,
            routed_scaling_factor,
        } = m.routing
        {
            let first = m.sparse_layers.iter().take_while(|s| !**s).count();
            let width = m.moe_intermediate_size;
            let shared = m.shared_expert.map_or(0, |s| s.intermediate_size / width);
            set("n_routed_experts", m.num_experts.into());
            set("moe_intermediate_size", width.into());
            set("norm_topk_prob", m.norm_topk_prob.into());
            set("first_k_dense_replace", first.into());
            set("n_shared_experts", shared.into());
            set("n_group", n_group.into());
            set("topk_group", topk_group.into());
            set("routed_scaling_factor", routed_scaling_factor.into());
        } else {
            let dense: Vec<i64> = (0..self.num_hidden_layers)
                .filter(|l| !self.is_sparse(*l))
                .collect();
            set("num_experts", m.num_experts.into());
            set("moe_intermediate_size", m.moe_intermediate_size.into());
            set("norm_topk_prob", m.norm_topk_prob.into());
            set("decoder_sparse_step", 1.into());
            set("mlp_only_layers", dense.into());
            if let Some(s) = m.shared_expert {
                set(
                    "shared_expert_intermediate_size",
                    s.intermediate_size.into(),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::SCORE;

    /// transformers 5.24's sequence-classification class of each family
    /// (read from its modeling files).
    #[test]
    fn each_family_names_its_classifier_as_transformers_does() {
        let classes = [
            (Family::Llama, "LlamaForSequenceClassification"),
            (Family::Qwen2, "Qwen2ForSequenceClassification"),
            (Family::Qwen3, "Qwen3ForSequenceClassification"),
            (Family::Mistral, "MistralForSequenceClassification"),
            (Family::Gemma3, "Gemma3TextForSequenceClassification"),
            (Family::Qwen3Moe, "Qwen3MoeForSequenceClassification"),
            (Family::Mixtral, "MixtralForSequenceClassification"),
            (Family::GptOss, "GptOssForSequenceClassification"),
            (Family::Qwen2Moe, "Qwen2MoeForSequenceClassification"),
            (Family::DeepseekV3, "DeepseekV3ForSequenceClassification"),
        ];
        // GLM-4.5 has none.
        assert_eq!(classes.len() + 1, FAMILIES.len());
        assert!(!Family::Glm4Moe.has_classifier());
        for (family, class) in classes {
            assert_eq!(family.classifier_architecture(), class);
        }
    }

    #[test]
    fn a_classifier_config_reads_its_labels_and_pad_and_writes_them_back() {
        let causal = ModelConfig::preset("tiny").unwrap();
        let mut json: Value = serde_json::from_str(&causal.to_json()).unwrap();
        json["architectures"] = json!(["LlamaForSequenceClassification"]);
        json["id2label"] = json!({"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"});
        json["pad_token_id"] = json!(257);
        let c = ModelConfig::from_json(&json.to_string()).unwrap();
        let head = Head::SequenceClassification {
            num_labels: 3,
            pad_token_id: Some(257),
        };
        assert_eq!(c.head, head);
        assert!(c
            .parameter_shapes()
            .contains(&(SCORE.to_string(), vec![3, 64])));
        assert!(!c
            .parameter_shapes()
            .iter()
            .any(|(n, _)| n == "lm_head.weight"));
        // Written back, and a causal LM's config made one keeps its fields.
        assert_eq!(ModelConfig::from_json(&c.to_json()).unwrap().head, head);
        let made = with_head(causal.to_json().as_bytes(), &c).unwrap();
        let made: Value = serde_json::from_slice(&made).unwrap();
        assert_eq!(
            made["architectures"],
            json!(["LlamaForSequenceClassification"])
        );
        assert_eq!(made["label2id"]["LABEL_2"], json!(2));
        assert_eq!(made["vocab_size"], json!(264));
        // No labels named: transformers' default of 2.
        json.as_object_mut().unwrap().remove("id2label");
        let c = ModelConfig::from_json(&json.to_string()).unwrap();
        assert!(matches!(
            c.head,
            Head::SequenceClassification { num_labels: 2, .. }
        ));
    }
}
