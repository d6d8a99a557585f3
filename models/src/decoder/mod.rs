//! The decoder-only models hlo-train runs, as HF transformers computes
//! them: Llama 3.x (`LlamaForCausalLM`) and the families that differ from
//! it in a few named places (Qwen2/2.5, Qwen3, Mistral, Gemma 3 text, and
//! the mixtures of experts Qwen3-MoE, Mixtral and gpt-oss; see [`Family`] and the
//! fields of [`ModelConfig`]), with PEFT LoRA.

mod config;
mod decode;
mod hf_config;
pub use hf_config::with_head;
mod lora;
mod mla;
mod model;
mod moe;
mod presets;
mod rules;
mod serving;

pub use config::{
    is_buffer, Activation, ExpertStyle, Family, Head, LayerType, Llama3Scaling, ModelConfig,
    MoeConfig, NormStyle, Projection, Rope, RopeScaling, Routing, SharedExpert, YarnScaling,
    E_SCORE_CORRECTION_BIAS, FAMILIES, SCORE,
};
pub use decode::{argmax, cache_types, decode_step, hashed_uniform, sample_rows, sample_tokens};
pub use lora::{
    module_to_save_of, LoraConfig, DEFAULT_TARGETS, EXPERT_PARAMETERS, MODULES_TO_SAVE,
};
pub use model::{is_stacked, rms_norm, Decoder, Params};
pub use moe::{block_count, block_size, load_balancing_loss, MoeKind, RouterStats};
pub use presets::PRESETS;
pub use rules::partition_rules;
pub use serving::{
    adapter_table_types, projections, slot_read_step, slot_step, slot_write_step, table_names,
    table_update_step, AdapterTables, LoraSelect,
};

use crate::nf4;
use crate::roles::{BatchField, Role, Step, StepInput};

use hlo_ir::{trace, DType, Function, Literal, Outputs, TensorType, TraceError};

/// Base parameters: (HF name, type in `dtype`). With NF4 quantization
/// each layer projection's weight is its codes (`u8`), followed by its
/// block scales (`<name>.absmax`, f32): see [`crate::nf4::stored_types`].
pub fn base_parameter_types(config: &ModelConfig, dtype: DType) -> Vec<(String, TensorType)> {
    let mut out = Vec::new();
    for (name, shape) in config.parameter_shapes() {
        let stored = config
            .quantization
            .filter(|_| nf4::is_quantized(&name))
            .and_then(|_| nf4::stored_types(&shape));
        match stored {
            Some((codes, absmax)) => {
                let scales = format!("{name}{}", nf4::ABSMAX_SUFFIX);
                out.push((name, codes));
                out.push((scales, absmax));
            }
            None if config.kept_in_f32(&name) => {
                out.push((name, TensorType::new(DType::F32, shape)))
            }
            None => out.push((name, TensorType::new(dtype, shape))),
        }
    }
    out
}

/// Layer parameters stacked per kind (`model.layers.<name>` `[layers, ...]`),
/// the others as they are: the parameters of a scan-over-layers model.
pub fn stack_types(types: Vec<(String, TensorType)>, layers: i64) -> Vec<(String, TensorType)> {
    let mut out: Vec<(String, TensorType)> = Vec::new();
    for (name, ty) in types {
        match name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
        {
            Some((l, rest)) if l.parse::<i64>().is_ok() => {
                if l == "0" {
                    let mut dims = vec![layers];
                    dims.extend(&ty.dims);
                    out.push((
                        format!("model.layers.{rest}"),
                        TensorType::new(ty.dtype, dims),
                    ));
                }
            }
            _ => out.push((name, ty)),
        }
    }
    out
}

/// The per-layer names a stacked parameter is made of, in layer order.
pub fn unstacked_names(name: &str, layers: i64) -> Vec<String> {
    let rest = name.strip_prefix("model.layers.").unwrap_or(name);
    (0..layers)
        .map(|l| format!("model.layers.{l}.{rest}"))
        .collect()
}

/// Stacks per-layer literals (all of one type) along a new leading axis.
pub fn stack_literals(parts: &[Literal]) -> Literal {
    let first = &parts[0].ty;
    let mut dims = vec![parts.len() as i64];
    dims.extend(&first.dims);
    Literal {
        ty: TensorType::new(first.dtype, dims),
        bytes: parts.iter().flat_map(|p| p.bytes.iter().copied()).collect(),
    }
}

/// The per-layer slices of a stacked literal.
pub fn unstack_literal(stacked: &Literal) -> Vec<Literal> {
    let n = stacked.ty.dims[0] as usize;
    let row = stacked.bytes.len() / n.max(1);
    let ty = TensorType::new(stacked.ty.dtype, stacked.ty.dims[1..].to_vec());
    (0..n)
        .map(|i| Literal {
            ty: ty.clone(),
            bytes: stacked.bytes[i * row..(i + 1) * row].to_vec(),
        })
        .collect()
}

/// LoRA parameters (f32): `<module>.lora_a` `[in, r]`, `<module>.lora_b`
/// `[r, out]`; on a sparse layer's fused experts (`target_parameters`),
/// one pair per expert: `mlp.experts.gate_up_proj.lora_a` `[experts, in,
/// r]`, `.lora_b` `[experts, r, out]`.
pub fn lora_parameter_types(config: &ModelConfig, lora: &LoraConfig) -> Vec<(String, TensorType)> {
    let mut out = Vec::new();
    for l in 0..config.num_hidden_layers {
        for parameter in EXPERT_PARAMETERS {
            if !(config.is_sparse(l) && lora.targets_parameter(parameter)) {
                continue;
            }
            let name = format!("model.layers.{l}.{parameter}");
            let shape = config
                .parameter_shape(&name)
                .expect("a sparse layer's experts");
            let moe = config.moe.as_ref().expect("a sparse layer's experts");
            let (e, din, dout) = moe.expert_dims(&shape);
            // PEFT matches patterns against the parameter's path.
            let r = lora.rank_of(&name);
            out.push((
                format!("{name}.lora_a"),
                TensorType::new(DType::F32, [e, din, r]),
            ));
            out.push((
                format!("{name}.lora_b"),
                TensorType::new(DType::F32, [e, r, dout]),
            ));
        }
        for Projection {
            module,
            short,
            dims: (din, dout),
        } in config.layer_projections(l)
        {
            if !lora.targets(short) {
                continue;
            }
            let r = lora.rank_of(&module);
            out.push((
                format!("{module}.lora_a"),
                TensorType::new(DType::F32, [din, r]),
            ));
            out.push((
                format!("{module}.lora_b"),
                TensorType::new(DType::F32, [r, dout]),
            ));
        }
    }
    out
}

/// The forward pass as a function: inputs are the base parameters, the LoRA
/// parameters (if any) and `input_ids` `[batch, seq]` (i32); the output is
/// `logits` `[batch, seq, vocab]` in `dtype`.
///
/// ```
/// use hlo_models::decoder::{forward_function, ModelConfig};
/// let c = ModelConfig::preset("tiny").unwrap();
/// let f = forward_function(&c, hlo_ir::DType::F32, 2, 8, None).unwrap();
/// assert_eq!(f.output_types()[0].dims, vec![2, 8, c.vocab_size]);
/// ```
pub fn forward_function(
    config: &ModelConfig,
    dtype: DType,
    batch: i64,
    seq: i64,
    lora: Option<&LoraConfig>,
) -> Result<Function, TraceError> {
    Ok(forward_step(config, dtype, batch, seq, lora, false)?.function)
}

/// [`forward_function`] as a [`Step`], optionally with the layers as one
/// scan over stacked parameters (see [`stack_types`]): every parameter a
/// weight, `input_ids` the batch.
pub fn forward_step(
    config: &ModelConfig,
    dtype: DType,
    batch: i64,
    seq: i64,
    lora: Option<&LoraConfig>,
    scan_layers: bool,
) -> Result<Step, TraceError> {
    let mut inputs = base_parameter_types(config, dtype);
    if let Some(l) = lora {
        inputs.extend(lora_parameter_types(config, l));
    }
    if scan_layers {
        inputs = stack_types(inputs, config.num_hidden_layers);
    }
    let ids = BatchField::InputIds.name();
    inputs.push((ids.into(), TensorType::new(DType::I32, [batch, seq])));
    let model = Decoder {
        config,
        lora,
        batch_axes: Vec::new(),
        scan_layers,
        remat_layers: false,
        remat_mlp: false,
        attention: crate::attention::AttentionKind::Naive,
        moe: MoeKind::default(),
        router: Default::default(),
    };
    let f = trace("llama_forward", &inputs, |i| {
        let logits = model.forward(&Params(i), i[ids], dtype);
        Outputs::new().add("logits", logits)
    })?;
    Ok(Step::new(f, |name| StepInput {
        role: if name == ids {
            Role::Batch(BatchField::InputIds)
        } else {
            Role::Weight
        },
        leading_axis: is_stacked(name),
    }))
}

/// How HF (and PEFT, for adapters) initialise a parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    /// Normal with mean 0.
    Normal {
        std: f64,
    },
    /// Uniform in `[-bound, bound)`.
    Uniform {
        bound: f64,
    },
}

/// How parameter `name` of type `ty` starts: RMSNorm scales 1 (Gemma's
/// `1 + w` norms 0), biases 0, kernels and embeddings normal(0,
/// `initializer_range`), `lora_a` uniform in ±1/sqrt(in) (PEFT's
/// kaiming-uniform with a = sqrt(5)), `lora_b` zero.
///
/// ```
/// use hlo_models::decoder::{initializer, Init, ModelConfig};
/// use hlo_ir::{DType, TensorType};
/// let c = ModelConfig::preset("tiny").unwrap();
/// let t = TensorType::new(DType::F32, [64, 8]);
/// assert_eq!(initializer(&c, "model.layers.0.mlp.up_proj.lora_a", &t), Init::Uniform { bound: 0.125 });
/// ```
pub fn initializer(config: &ModelConfig, name: &str, ty: &TensorType) -> Init {
    if name.ends_with("norm.weight") {
        match config.norm_style {
            NormStyle::Llama | NormStyle::F32 => Init::Ones,
            NormStyle::Gemma => Init::Zeros,
        }
    } else if name.ends_with(".bias") || name.ends_with("_bias") {
        Init::Zeros
    } else if name.ends_with(".lora_a") {
        // [in, r], or [layers, in, r] stacked.
        let fan_in = ty.dims[ty.rank().saturating_sub(2)] as f64;
        Init::Uniform {
            bound: 1.0 / fan_in.sqrt(),
        }
    } else if name.ends_with(".lora_b") {
        Init::Zeros
    } else {
        Init::Normal {
            std: config.initializer_range,
        }
    }
}

/// One random parameter as HF initialises it (see [`initializer`]),
/// seeded by `seed` and the tensor's name so any tensor can be made on its
/// own.
pub fn init_tensor(config: &ModelConfig, name: &str, ty: TensorType, seed: u64) -> Literal {
    let mut rng = hlo_ir::rng::Rng::new(seed ^ hlo_ir::rng::fnv1a(name.as_bytes()));
    let n = ty.element_count();
    let values: Vec<f64> = match initializer(config, name, &ty) {
        Init::Zeros => return Literal::splat(ty, 0.0),
        Init::Ones => return Literal::splat(ty, 1.0),
        Init::Normal { std } => (0..n).map(|_| std * rng.normal()).collect(),
        Init::Uniform { bound } => (0..n).map(|_| rng.uniform(-bound, bound)).collect(),
    };
    Literal::from_f64s(ty, &values)
}

/// Every random base weight of a (small) model: see [`init_tensor`].
pub fn init_base(config: &ModelConfig, dtype: DType, seed: u64) -> Vec<(String, Literal)> {
    base_parameter_types(config, dtype)
        .into_iter()
        .map(|(name, ty)| {
            let lit = init_tensor(config, &name, ty, seed);
            (name, lit)
        })
        .collect()
}
