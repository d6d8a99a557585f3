//! PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`
//! with PEFT's key names and layouts, in and out.
//!
//! Every setting of `adapter_config.json` that changes what the adapter
//! computes is honoured as PEFT honours it — rank, alpha, rsLoRA, target
//! modules, `rank_pattern`, `alpha_pattern`, `modules_to_save` (`lm_head`,
//! `embed_tokens`, a mixture of experts' router) — or refused with one line naming it (`lora_bias`,
//! `trainable_token_indices`, `layer_replication`, `layers_to_transform`,
//! DoRA, ...). Settings that only describe how PEFT initialised or trained
//! the adapter are read and ignored; `lora_dropout` is refused only when
//! training from the adapter, since hlo-train trains without dropout.

use std::collections::HashMap;
use std::path::Path;

use hlo_ir::{DType, Literal, TensorType};
use serde_json::{json, Map, Value};

use crate::decoder::{lora_parameter_types, LoraConfig, ModelConfig, EXPERT_PARAMETERS};
use crate::io::{write_atomic, write_safetensors};
use crate::safetensors_file::StoredTensor;
use crate::ModelError;

/// A LoRA adapter in hlo-train's layout: `<module>.lora_a` `[in, r]` and
/// `<module>.lora_b` `[r, out]` (f32), plus the whole weights of its
/// modules to save under their base names (`lm_head.weight`).
#[derive(Clone, Debug, PartialEq)]
pub struct Adapter {
    pub lora: LoraConfig,
    pub tensors: Vec<(String, Literal)>,
}

/// PEFT's key of one of our adapter tensors, and whether it is a LoRA A
/// (stored transposed, as is B); a module to save's weight is stored as
/// it is, under `base_model.model.<name>`.
pub(crate) fn peft_key(name: &str) -> (String, Option<bool>) {
    if let Some(m) = name.strip_suffix(".lora_a") {
        (format!("base_model.model.{m}.lora_A.weight"), Some(true))
    } else if let Some(m) = name.strip_suffix(".lora_b") {
        (format!("base_model.model.{m}.lora_B.weight"), Some(false))
    } else {
        (format!("base_model.model.{name}"), None)
    }
}

fn transpose(l: &Literal) -> Literal {
    let (r, c) = (l.ty.dims[0] as usize, l.ty.dims[1] as usize);
    let v = l.to_f64s();
    let t: Vec<f64> = (0..c)
        .flat_map(|j| (0..r).map(move |i| (i, j)))
        .map(|(i, j)| v[i * c + j])
        .collect();
    Literal::from_f64s(TensorType::new(l.ty.dtype, [c as i64, r as i64]), &t)
}

/// Whether a setting's value is its "off" default (null, false, 0, empty).
fn is_off(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// Settings that change nothing hlo-train computes from a trained adapter:
/// metadata, and how PEFT initialised or trains it.
const DESCRIPTIVE: [&str; 21] = [
    "peft_type",
    "task_type",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "auto_mapping",
    "init_lora_weights",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "megatron_config",
    "megatron_core",
    "qalora_group_size",
    "lora_dropout",
    // Trained biases are refused where they are stored (`Adapter::load`);
    // a model without biases trains none.
    "bias",
    "r",
    "lora_alpha",
    "use_rslora",
    "target_modules",
];

/// Settings read and honoured.
const HONOURED: [&str; 4] = [
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "target_parameters",
];

/// PEFT's key of a fused expert tensor's LoRA factor (`…mlp.experts.
/// gate_up_proj.lora_a`), None for other names. PEFT wraps the experts
/// module once per targeted parameter, in declaration order, so each
/// earlier one's factors sit one `base_layer.` deeper.
fn expert_peft_key(name: &str, lora: &LoraConfig) -> Option<String> {
    let (param, factor) = name
        .strip_suffix(".lora_a")
        .map(|p| (p, "lora_A"))
        .or_else(|| name.strip_suffix(".lora_b").map(|p| (p, "lora_B")))?;
    let which = EXPERT_PARAMETERS.iter().find(|e| param.ends_with(*e))?;
    let module = param.strip_suffix(which.strip_prefix("mlp.experts").unwrap_or(which))?;
    let targeted: Vec<&String> = lora.target_parameters.iter().collect();
    let at = targeted.iter().position(|t| t == which)?;
    let depth = targeted.len() - 1 - at;
    Some(format!(
        "base_model.model.{module}.{}{factor}.weight",
        "base_layer.".repeat(depth)
    ))
}

/// Our expert factor (`lora_a` `[E, in, r]`, `lora_b` `[E, r, out]`) in
/// PEFT's layout (`lora_A` `[E·r, in]`, expert e's rows together;
/// `lora_B` `[out, r·E]`, column `j·E + e` its j-th), or back (`to_peft`
/// false, `experts` E).
fn expert_layout(l: &Literal, a: bool, to_peft: bool, experts: usize) -> Literal {
    let v = l.to_f64s();
    let d = &l.ty.dims;
    let (dims, value): (Vec<i64>, Vec<f64>) = match (a, to_peft) {
        (true, true) => {
            let (e, i, r) = (d[0] as usize, d[1] as usize, d[2] as usize);
            let out = (0..e * r)
                .flat_map(|row| (0..i).map(move |col| (row, col)))
                .map(|(row, col)| v[(row / r) * i * r + col * r + row % r])
                .collect();
            (vec![(e * r) as i64, i as i64], out)
        }
        (false, true) => {
            let (e, r, o) = (d[0] as usize, d[1] as usize, d[2] as usize);
            let out = (0..o)
                .flat_map(|row| (0..r * e).map(move |col| (row, col)))
                .map(|(row, col)| v[(col % e) * r * o + (col / e) * o + row])
                .collect();
            (vec![o as i64, (r * e) as i64], out)
        }
        (true, false) => {
            let (er, i) = (d[0] as usize, d[1] as usize);
            let r = er / experts;
            let out = (0..experts * i * r)
                .map(|x| {
                    let (e, rest) = (x / (i * r), x % (i * r));
                    let (col, j) = (rest / r, rest % r);
                    v[(e * r + j) * i + col]
                })
                .collect();
            (vec![experts as i64, i as i64, r as i64], out)
        }
        (false, false) => {
            let (o, re) = (d[0] as usize, d[1] as usize);
            let r = re / experts;
            let out = (0..experts * r * o)
                .map(|x| {
                    let (e, rest) = (x / (r * o), x % (r * o));
                    let (j, row) = (rest / o, rest % o);
                    v[row * re + j * experts + e]
                })
                .collect();
            (vec![experts as i64, r as i64, o as i64], out)
        }
    };
    Literal::from_f64s(TensorType::new(l.ty.dtype, dims), &value)
}

/// The tensors of an adapter's `adapter_model.safetensors`, by key.
type StoredTensors = HashMap<String, StoredTensor>;

/// The error about adapter folder `dir` with a message.
fn adapter_error(dir: &Path) -> impl Fn(String) -> ModelError + '_ {
    move |message| ModelError::Adapter {
        dir: dir.display().to_string(),
        message,
    }
}

/// `adapter_config.json` of `dir` as a JSON object.
fn config_object(dir: &Path) -> Result<Map<String, Value>, ModelError> {
    let bad = adapter_error(dir);
    let cfg_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .map_err(|e| bad(format!("cannot read adapter_config.json: {e}")))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| bad(format!("adapter_config.json is not JSON: {e}")))?;
    match v {
        Value::Object(obj) => Ok(obj),
        _ => Err(bad("adapter_config.json is not a JSON object".into())),
    }
}

/// Refuses an adapter config that is no LoRA (`peft_type`), or sets what
/// hlo-train does not compute: an `init_lora_weights` that changes the
/// base weights, or any setting neither descriptive nor honoured.
fn refuse_unsupported(
    obj: &Map<String, Value>,
    bad: &dyn Fn(String) -> ModelError,
) -> Result<(), ModelError> {
    if obj
        .get("peft_type")
        .and_then(Value::as_str)
        .is_some_and(|t| t != "LORA")
    {
        return Err(bad(format!("peft_type {} is not LORA", obj["peft_type"])));
    }
    // Initialisations that change the base weights (PiSSA, OLoRA,
    // CorDA, LoftQ) give adapters for another base.
    if let Some(Value::String(init)) = obj.get("init_lora_weights") {
        if init != "gaussian" {
            return Err(bad(format!(
                "unsupported: init_lora_weights = \"{init}\" (it changes the base weights the adapter needs)"
            )));
        }
    }
    // Anything else that is set changes the adapter in a way hlo-train
    // does not compute: refused, named.
    for (key, value) in obj {
        let known = DESCRIPTIVE.contains(&key.as_str()) || HONOURED.contains(&key.as_str());
        if !known && !is_off(value) {
            return Err(bad(format!(
                "unsupported: {key} = {value} (hlo-train does not compute it; it would give other results than PEFT)"
            )));
        }
    }
    Ok(())
}

/// The strings of list `key` (empty when it is absent or no list).
fn string_list(obj: &Map<String, Value>, key: &str) -> Vec<String> {
    match obj.get(key) {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    }
}

/// `target_modules`: a list of module names, or PEFT's `all-linear`; a
/// regex is refused.
fn target_modules(
    obj: &Map<String, Value>,
    bad: &dyn Fn(String) -> ModelError,
) -> Result<Vec<String>, ModelError> {
    match obj.get("target_modules") {
        Some(Value::Array(_)) => Ok(string_list(obj, "target_modules")),
        // PEFT's shorthand for every linear layer but the head.
        Some(Value::String(s)) if s == "all-linear" => Ok(crate::decoder::DEFAULT_TARGETS
            .iter()
            .chain(&crate::projections::LATENT_PROJECTIONS)
            .map(|t| t.to_string())
            .collect()),
        Some(Value::String(s)) => Err(bad(format!(
            "target_modules as a regex (`{s}`) is not supported: list the module names"
        ))),
        _ => Ok(Vec::new()),
    }
}

/// `rank_pattern` or `alpha_pattern`: a module pattern's own rank or alpha.
fn pattern(obj: &Map<String, Value>, key: &str) -> Vec<(String, f64)> {
    obj.get(key)
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
                .collect()
        })
        .unwrap_or_default()
}

/// Refuses biases PEFT trained: its `bias = "all"` or `"lora_only"` saves
/// the biases it trained (Qwen2's q/k/v), which would replace the base's.
/// (A saved module's own bias, gpt-oss's router's, is no LoRA bias.)
fn refuse_trained_biases(
    stored: &StoredTensors,
    lora: &LoraConfig,
    bad: &dyn Fn(String) -> ModelError,
) -> Result<(), ModelError> {
    let saved_module = |k: &str| {
        k.strip_prefix("base_model.model.")
            .is_some_and(|n| lora.saves_weight(n))
    };
    if let Some(key) = stored
        .keys()
        .filter(|k| k.ends_with(".bias") && !saved_module(k))
        .min()
    {
        return Err(bad(format!(
            "unsupported: the adapter holds trained biases (`{key}`, PEFT's bias = \"all\" or \"lora_only\"); hlo-train trains and loads LoRA with bias = \"none\""
        )));
    }
    Ok(())
}

/// The shape PEFT stores our LoRA factor of type `ty` as: the transpose;
/// a fused expert factor's in PEFT's layout (see [`expert_layout`]).
fn peft_shape(ty: &TensorType, expert: bool, a: bool) -> Vec<i64> {
    match (expert, a) {
        (true, true) => vec![ty.dims[0] * ty.dims[2], ty.dims[1]],
        (true, false) => vec![ty.dims[2], ty.dims[0] * ty.dims[1]],
        // PEFT stores the transpose.
        (false, _) => ty.dims.iter().rev().copied().collect(),
    }
}

/// Our LoRA factor `name` (of type `ty`) read from the adapter file `map`:
/// a floating tensor of the shape the model implies, finite in f32, in
/// hlo-train's layout.
fn lora_tensor(
    name: &str,
    ty: &TensorType,
    lora: &LoraConfig,
    (stored, map): (&StoredTensors, &[u8]),
    bad: &dyn Fn(String) -> ModelError,
) -> Result<Literal, ModelError> {
    let expert = expert_peft_key(name, lora);
    let key = expert.clone().unwrap_or_else(|| peft_key(name).0);
    let t = stored
        .get(&key)
        .ok_or_else(|| bad(format!("tensor `{key}` is missing")))?;
    // PEFT keeps LoRA weights in a floating dtype; integers would
    // be a quantized or foreign file, not weights to widen.
    if !t.dtype.is_float() {
        return Err(bad(format!(
            "tensor `{key}` is {:?}; LoRA weights must be floating point (F32, BF16, F16 or F64)",
            t.dtype
        )));
    }
    if let Some(module) = name.strip_suffix(".lora_a") {
        let scale = lora.scale_of(module);
        if !(scale as f32).is_finite() {
            return Err(bad(format!(
                "the scale of `{module}` (lora_alpha / r) is {scale}, not a finite f32"
            )));
        }
    }
    let a = name.ends_with(".lora_a");
    let want = peft_shape(ty, expert.is_some(), a);
    if t.shape != want {
        return Err(bad(format!(
            "tensor `{key}` has shape {:?}, the model implies {want:?}",
            t.shape
        )));
    }
    let lit = Literal::from_f64s(
        TensorType::new(DType::F32, t.shape.clone()),
        &t.literal(map).to_f64s(),
    );
    // Checked as f32 (what is computed with): an F64 value past
    // f32's range is as unusable as a NaN.
    let bad_values = lit.non_finite_count();
    if bad_values > 0 {
        return Err(bad(format!(
            "tensor `{key}` holds {bad_values} values that are NaN or infinite (in f32)"
        )));
    }
    Ok(if expert.is_some() {
        expert_layout(&lit, a, false, ty.dims[0] as usize)
    } else {
        transpose(&lit)
    })
}

/// The whole weights of the modules the adapter saves
/// (`modules_to_save`), under their base names: each of the base's shape,
/// floating point, finite.
fn saved_module_weights(
    config: &ModelConfig,
    lora: &LoraConfig,
    (stored, map): (&StoredTensors, &[u8]),
    bad: &dyn Fn(String) -> ModelError,
) -> Result<Vec<(String, Literal)>, ModelError> {
    let saved = config
        .parameter_shapes()
        .into_iter()
        .filter(|(name, _)| lora.saves_weight(name));
    let mut tensors = Vec::new();
    for (weight, shape) in saved {
        let (key, _) = peft_key(&weight);
        let t = stored
            .get(&key)
            .ok_or_else(|| bad(format!("tensor `{key}` (modules_to_save) is missing")))?;
        if t.shape != shape {
            return Err(bad(format!(
                "tensor `{key}` has shape {:?}, the model implies {shape:?}",
                t.shape
            )));
        }
        let lit = t.literal(map);
        if !t.dtype.is_float() || lit.non_finite_count() > 0 {
            return Err(bad(format!(
                "tensor `{key}` (modules_to_save) must be floating point with finite values"
            )));
        }
        tensors.push((weight, lit));
    }
    Ok(tensors)
}

impl Adapter {
    /// A fresh adapter initialised as PEFT does: A uniform in ±1/sqrt(in)
    /// (kaiming-uniform with a = sqrt(5)), B zero. (Modules to save start
    /// from the base weights; `Adapter::init` makes LoRA tensors only.)
    pub fn init(config: &ModelConfig, lora: &LoraConfig, seed: u64) -> Adapter {
        let mut rng = hlo_ir::rng::Rng::new(seed);
        let tensors = lora_parameter_types(config, lora)
            .into_iter()
            .map(|(name, ty)| {
                let lit = if name.ends_with(".lora_a") {
                    // [in, r], or [experts, in, r].
                    let bound = 1.0 / (ty.dims[ty.rank() - 2] as f64).sqrt();
                    let v: Vec<f64> = (0..ty.element_count())
                        .map(|_| rng.uniform(-bound, bound))
                        .collect();
                    Literal::from_f64s(ty, &v)
                } else {
                    Literal::splat(ty, 0.0)
                };
                (name, lit)
            })
            .collect();
        Adapter {
            lora: lora.clone(),
            tensors,
        }
    }

    /// Reads a PEFT adapter folder's `adapter_config.json`: the LoRA
    /// settings, every setting that changes the computation honoured or
    /// refused.
    pub fn read_config(dir: &Path) -> Result<LoraConfig, ModelError> {
        let bad = adapter_error(dir);
        let obj = config_object(dir)?;
        refuse_unsupported(&obj, &bad)?;
        let r = obj
            .get("r")
            .and_then(Value::as_i64)
            .ok_or_else(|| bad("adapter_config.json has no `r`".into()))?;
        let alpha = obj.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
        let targets = target_modules(&obj, &bad)?;
        let parameters = string_list(&obj, "target_parameters");
        if targets.is_empty() && parameters.is_empty() {
            return Err(bad(
                "adapter_config.json has no target_modules (nor target_parameters)".into(),
            ));
        }
        let ranks: Vec<(String, i64)> = pattern(&obj, "rank_pattern")
            .into_iter()
            .map(|(k, r)| (k, r as i64))
            .collect();
        let mut modules = string_list(&obj, "modules_to_save");
        // PEFT's SEQ_CLS task adds both names a classifier head goes by;
        // the decoders here call theirs `score`.
        if obj.get("task_type").and_then(Value::as_str) == Some("SEQ_CLS") {
            modules.retain(|m| m != "classifier");
        }
        let modules_only: Vec<&str> = targets.iter().map(String::as_str).collect();
        let rslora = obj
            .get("use_rslora")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        // The parameters apart: PEFT's bare `down_proj` there is the
        // experts' tensor, not the module.
        LoraConfig::of_peft(r, alpha, &modules_only, &parameters, rslora)
            .and_then(|l| l.with_patterns(ranks, pattern(&obj, "alpha_pattern")))
            .and_then(|l| l.with_modules_to_save(modules))
            .map_err(|e| bad(e.to_string()))
    }

    /// The base model an adapter folder names (`base_model_name_or_path`
    /// of its `adapter_config.json`), when it names one.
    pub fn declared_base(dir: &Path) -> Option<String> {
        std::fs::read_to_string(dir.join("adapter_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| {
                v.get("base_model_name_or_path")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .filter(|s| !s.is_empty())
    }

    /// The `lora_dropout` an adapter was trained with (0 when unset).
    pub fn dropout(dir: &Path) -> f64 {
        std::fs::read_to_string(dir.join("adapter_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| v.get("lora_dropout").and_then(Value::as_f64))
            .unwrap_or(0.0)
    }

    /// Reads a PEFT adapter folder for a model of `config`.
    pub fn load(dir: &Path, config: &ModelConfig) -> Result<Adapter, ModelError> {
        let bad = adapter_error(dir);
        let lora = Self::read_config(dir)?
            .for_model(config)
            .map_err(|e| bad(e.to_string()))?;
        let tied = lora
            .modules_to_save
            .iter()
            .any(|m| m == "lm_head" || m == "embed_tokens");
        if tied && config.tie_word_embeddings {
            return Err(bad(format!(
                "modules_to_save {:?} on a model with tied embeddings is not supported",
                lora.modules_to_save
            )));
        }
        let path = dir.join("adapter_model.safetensors");
        let map = crate::safetensors_file::mmap(&path)?;
        let stored: StoredTensors = crate::safetensors_file::index_file(&path, &map)?
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        refuse_trained_biases(&stored, &lora, &bad)?;
        let mut tensors = Vec::new();
        for (name, ty) in lora_parameter_types(config, &lora) {
            let lit = lora_tensor(&name, &ty, &lora, (&stored, &map), &bad)?;
            tensors.push((name, lit));
        }
        lora.check_modules_to_save(config)
            .map_err(|e| bad(e.to_string()))?;
        tensors.extend(saved_module_weights(config, &lora, (&stored, &map), &bad)?);
        Ok(Adapter { lora, tensors })
    }

    /// Writes the adapter as PEFT does (`PeftModel.from_pretrained` loads
    /// it); `base_model` is how the adapter names its base model.
    pub fn save(&self, dir: &Path, base_model: Option<&str>) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(ModelError::io("create", dir))?;
        // A whole number as PEFT (Python) writes it: without a fraction.
        let number = |x: f64| -> Value {
            if x.fract() == 0.0 && x.abs() < 1e15 {
                json!(x as i64)
            } else {
                json!(x)
            }
        };
        let pattern = |p: &[(String, f64)]| -> Map<String, Value> {
            p.iter().map(|(k, v)| (k.clone(), number(*v))).collect()
        };
        let ranks: Vec<(String, f64)> = self
            .lora
            .rank_pattern
            .iter()
            .map(|(k, r)| (k.clone(), *r as f64))
            .collect();
        let modules = (!self.lora.modules_to_save.is_empty()).then_some(&self.lora.modules_to_save);
        let config = json!({
            "peft_type": "LORA",
            // PEFT's task: a sequence classifier's adapter saves its head.
            "task_type": if self.lora.modules_to_save.iter().any(|m| m == "score") {
                "SEQ_CLS"
            } else {
                "CAUSAL_LM"
            },
            "base_model_name_or_path": base_model,
            "r": self.lora.rank,
            "lora_alpha": number(self.lora.alpha),
            "target_modules": self.lora.target_modules,
            "target_parameters": (!self.lora.target_parameters.is_empty())
                .then_some(&self.lora.target_parameters),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": self.lora.use_rslora,
            "use_dora": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": modules,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": Value::Object(
                ranks.iter().map(|(k, v)| (k.clone(), json!(*v as i64))).collect()
            ),
            "alpha_pattern": Value::Object(pattern(&self.lora.alpha_pattern)),
            "revision": null,
        });
        let peft: Vec<(String, Literal)> = self
            .tensors
            .iter()
            .map(
                |(n, l)| match (expert_peft_key(n, &self.lora), peft_key(n)) {
                    (Some(key), _) => (key, expert_layout(l, n.ends_with(".lora_a"), true, 0)),
                    (None, (key, Some(_))) => (key, transpose(l)),
                    (None, (key, None)) => (key, l.clone()),
                },
            )
            .collect();
        write_safetensors(&dir.join("adapter_model.safetensors"), &peft)?;
        let text = serde_json::to_string_pretty(&config).expect("JSON values serialise");
        write_atomic(&dir.join("adapter_config.json"), text.as_bytes())
    }

    /// The base weight `name` (`[out, in]`, as HF stores it) with this
    /// adapter folded in: a module to save's weight replaces it; a LoRA
    /// target gets `W + scale · (A·B)ᵀ`, computed in f64 and rounded once
    /// to `weight`'s dtype; other weights come back as they are.
    pub fn merge(&self, config: &ModelConfig, name: &str, weight: &Literal) -> Literal {
        if let Some(saved) = self.get(name) {
            return Literal::from_f64s(weight.ty.clone(), &saved.to_f64s());
        }
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let (Some(a), Some(b)) = (
            self.get(&format!("{module}.lora_a")),
            self.get(&format!("{module}.lora_b")),
        ) else {
            return weight.clone();
        };
        if a.ty.rank() == 3 {
            let transposed = config.moe.as_ref().is_some_and(|m| m.transposed());
            let scale = self.lora.scale_of(module);
            return merge_experts(weight, (a, b), scale, transposed);
        }
        // A [in, r], B [r, out].
        let (din, r, dout) = (
            a.ty.dims[0] as usize,
            a.ty.dims[1] as usize,
            b.ty.dims[1] as usize,
        );
        let scale = self.lora.scale_of(module);
        let (av, bv, mut wv) = (a.to_f64s(), b.to_f64s(), weight.to_f64s());
        for o in 0..dout {
            for i in 0..din {
                let d: f64 = (0..r).map(|k| av[i * r + k] * bv[k * dout + o]).sum();
                wv[o * din + i] += scale * d;
            }
        }
        Literal::from_f64s(weight.ty.clone(), &wv)
    }

    /// One tensor by our name.
    pub fn get(&self, name: &str) -> Option<&Literal> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, l)| l)
    }
}

/// `W[e] + scale · (A[e]·B[e])ᵀ` for fused experts `weight` `[E, out, in]`
/// (`W[e] + scale · A[e]·B[e]` for `[E, in, out]`, `transposed`) and
/// factors `a` `[E, in, r]`, `b` `[E, r, out]`, in f64, rounded once.
fn merge_experts(
    weight: &Literal,
    (a, b): (&Literal, &Literal),
    scale: f64,
    transposed: bool,
) -> Literal {
    let (e, din, r) = (
        a.ty.dims[0] as usize,
        a.ty.dims[1] as usize,
        a.ty.dims[2] as usize,
    );
    let dout = b.ty.dims[2] as usize;
    let (av, bv, mut wv) = (a.to_f64s(), b.to_f64s(), weight.to_f64s());
    for x in 0..e {
        for o in 0..dout {
            for i in 0..din {
                let d: f64 = (0..r)
                    .map(|k| av[(x * din + i) * r + k] * bv[(x * r + k) * dout + o])
                    .sum();
                let at = if transposed {
                    (x * din + i) * dout + o
                } else {
                    (x * dout + o) * din + i
                };
                wv[at] += scale * d;
            }
        }
    }
    Literal::from_f64s(weight.ty.clone(), &wv)
}
