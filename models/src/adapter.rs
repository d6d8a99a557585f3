//! PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`
//! with PEFT's key names and layouts, in and out.

use std::collections::HashMap;
use std::path::Path;

use hlo_ir::{DType, Literal, TensorType};
use serde_json::{json, Value};

use crate::io::{write_atomic, write_safetensors};
use crate::llama::{lora_parameter_types, LlamaConfig, LoraConfig};
use crate::ModelError;

/// A LoRA adapter in hlo-train's layout: `<module>.lora_a` `[in, r]` and
/// `<module>.lora_b` `[r, out]`, f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Adapter {
    pub lora: LoraConfig,
    pub tensors: Vec<(String, Literal)>,
}

/// PEFT's key of one of our LoRA tensors, and whether it is A.
pub(crate) fn peft_key(name: &str) -> Option<(String, bool)> {
    if let Some(m) = name.strip_suffix(".lora_a") {
        Some((format!("base_model.model.{m}.lora_A.weight"), true))
    } else {
        name.strip_suffix(".lora_b")
            .map(|m| (format!("base_model.model.{m}.lora_B.weight"), false))
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

impl Adapter {
    /// A fresh adapter initialised as PEFT does: A uniform in ±1/sqrt(in)
    /// (kaiming-uniform with a = sqrt(5)), B zero.
    pub fn init(config: &LlamaConfig, lora: &LoraConfig, seed: u64) -> Adapter {
        let mut rng = hlo_ir::rng::Rng::new(seed);
        let tensors = lora_parameter_types(config, lora)
            .into_iter()
            .map(|(name, ty)| {
                let lit = if name.ends_with(".lora_a") {
                    let bound = 1.0 / (ty.dims[0] as f64).sqrt();
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
    /// settings.
    pub fn read_config(dir: &Path) -> Result<LoraConfig, ModelError> {
        let bad = |message: String| ModelError::Adapter {
            dir: dir.display().to_string(),
            message,
        };
        let cfg_path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .map_err(|e| bad(format!("cannot read adapter_config.json: {e}")))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| bad(format!("adapter_config.json is not JSON: {e}")))?;
        if v.get("peft_type")
            .and_then(Value::as_str)
            .is_some_and(|t| t != "LORA")
        {
            return Err(bad(format!("peft_type {} is not LORA", v["peft_type"])));
        }
        let r = v
            .get("r")
            .and_then(Value::as_i64)
            .ok_or_else(|| bad("adapter_config.json has no `r`".into()))?;
        let alpha = v.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
        let targets: Vec<String> = match v.get("target_modules") {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect(),
            Some(Value::String(s)) => vec![s.clone()],
            _ => return Err(bad("adapter_config.json has no target_modules".into())),
        };
        for (field, ok) in [("use_dora", false), ("fan_in_fan_out", false)] {
            if v.get(field).and_then(Value::as_bool).unwrap_or(ok) != ok {
                return Err(bad(format!("unsupported: {field} = true")));
            }
        }
        let refs: Vec<&str> = targets.iter().map(String::as_str).collect();
        LoraConfig::new(
            r,
            alpha,
            &refs,
            v.get("use_rslora")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        )
        .map_err(|e| bad(e.to_string()))
    }

    /// Reads a PEFT adapter folder for a model of `config`.
    pub fn load(dir: &Path, config: &LlamaConfig) -> Result<Adapter, ModelError> {
        let bad = |message: String| ModelError::Adapter {
            dir: dir.display().to_string(),
            message,
        };
        let lora = Self::read_config(dir)?;
        let path = dir.join("adapter_model.safetensors");
        let map = crate::io::mmap(&path)?;
        let stored: HashMap<String, crate::checkpoint::StoredTensor> =
            crate::checkpoint::index_file(&path, &map)?
                .into_iter()
                .map(|t| (t.name.clone(), t))
                .collect();
        let mut tensors = Vec::new();
        for (name, ty) in lora_parameter_types(config, &lora) {
            let (key, _) = peft_key(&name).expect("LoRA names end in lora_a/lora_b");
            let t = stored
                .get(&key)
                .ok_or_else(|| bad(format!("tensor `{key}` is missing")))?;
            let want: Vec<i64> = ty.dims.iter().rev().copied().collect(); // PEFT stores the transpose
            if t.shape != want {
                return Err(bad(format!(
                    "tensor `{key}` has shape {:?}, the model implies {want:?}",
                    t.shape
                )));
            }
            let lit = Literal::from_f64s(
                TensorType::new(DType::F32, t.shape.clone()),
                &t.literal(&map).to_f64s(),
            );
            tensors.push((name, transpose(&lit)));
        }
        Ok(Adapter { lora, tensors })
    }

    /// Writes the adapter as PEFT does (`PeftModel.from_pretrained` loads it).
    pub fn save(&self, dir: &Path, base_model: Option<&str>) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(ModelError::io("create", dir))?;
        let config = json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.lora.rank,
            "lora_alpha": self.lora.alpha,
            "target_modules": self.lora.target_modules,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": self.lora.use_rslora,
            "use_dora": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
        });
        let peft: Vec<(String, Literal)> = self
            .tensors
            .iter()
            .map(|(n, l)| (peft_key(n).expect("LoRA names").0, transpose(l)))
            .collect();
        write_safetensors(&dir.join("adapter_model.safetensors"), &peft)?;
        let text = serde_json::to_string_pretty(&config).expect("JSON values serialise");
        write_atomic(&dir.join("adapter_config.json"), text.as_bytes())
    }

    /// The base weight `name` (`[out, in]`, as HF stores it) with this
    /// adapter folded in, `W + scale · (A·B)ᵀ`, computed in f64 and
    /// rounded once to `weight`'s dtype; other weights come back as they
    /// are.
    pub fn merge(&self, name: &str, weight: &Literal) -> Literal {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let (Some(a), Some(b)) = (
            self.get(&format!("{module}.lora_a")),
            self.get(&format!("{module}.lora_b")),
        ) else {
            return weight.clone();
        };
        // A [in, r], B [r, out].
        let (din, r, dout) = (
            a.ty.dims[0] as usize,
            a.ty.dims[1] as usize,
            b.ty.dims[1] as usize,
        );
        let scale = self.lora.scale();
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
