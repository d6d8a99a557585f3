//! The finetuning step as one traced function: forward, masked mean
//! cross-entropy, gradients of the trainable parameters, global-norm
//! clipping, learning-rate schedule and optimizer update.

use hlo_ir::ops::Gather;
use hlo_ir::{
    call, full, iota, scan, scope, trace, value_and_grad, DType, Function, Outputs, Tensor,
    TensorType,
};

use crate::llama::{
    base_parameter_types, lora_parameter_types, stack_types, Llama, LlamaConfig, LoraConfig, Params,
};
use crate::ModelError;

/// The optimizer, with PyTorch's semantics and defaults.
#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    /// `torch.optim.AdamW`: decoupled weight decay, bias correction.
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    /// `torch.optim.SGD` without momentum.
    Sgd,
}

impl Optimizer {
    pub fn adamw(weight_decay: f64) -> Self {
        Optimizer::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        }
    }
}

/// The learning-rate schedule (HF's `get_*_schedule_with_warmup`), as a
/// function of the number of steps taken before this one.
#[derive(Clone, Debug, PartialEq)]
pub enum Schedule {
    /// Linear warmup over `warmup` steps, then constant.
    Constant { warmup: i64 },
    /// Linear warmup, then cosine decay to zero at `total` steps.
    Cosine { warmup: i64, total: i64 },
}

/// Everything that shapes the traced step.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub dtype: DType,
    pub batch: i64,
    pub seq: i64,
    pub lr: f64,
    pub optimizer: Optimizer,
    pub schedule: Schedule,
    /// Clip the global gradient norm to this (None: no clipping).
    pub clip_norm: Option<f64>,
    /// LoRA adapters to train; `None` trains every base weight.
    pub lora: Option<LoraConfig>,
    /// Mesh axes the batch is split over, for activation constraints
    /// (empty: none).
    pub batch_axes: Vec<String>,
    /// Run the layers as one scan over stacked parameters.
    pub scan_layers: bool,
    /// Rematerialize each layer in the backward pass (see [`Llama`]).
    pub remat_layers: bool,
    /// Micro-batches per step (`batch` rows each): the step scans over
    /// them, summing losses and gradients, and normalises by the tokens of
    /// all of them, so K micro-batches of B rows update as one batch of
    /// K·B. The batch inputs are then `[K, batch, seq]`.
    pub grad_accum: i64,
    /// Rows hold several samples (`positions` and `segment_ids` inputs,
    /// see [`Llama::forward_packed`]).
    pub packing: bool,
}

/// The traced step and what the runner needs to know about it.
pub struct TrainStep {
    pub function: Function,
    /// Names of the trained parameters (inputs and outputs).
    pub trainable: Vec<String>,
    /// Names of the optimizer state tensors (inputs and outputs).
    pub optimizer_state: Vec<String>,
    /// (input, output) pairs whose buffers the step updates in place.
    pub donated: Vec<(usize, usize)>,
}

/// Mean cross-entropy of next-token prediction over masked positions:
/// `sum(mask · (logsumexp(logits) − logit[label])) / max(sum(mask), 1)`,
/// label `t` being token `t + 1`; no one-hot matrix is formed.
pub fn masked_cross_entropy(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> Tensor {
    let (total, count) = masked_cross_entropy_sum(logits, input_ids, loss_mask);
    total / count.maximum(count.scalar_like(1.0))
}

/// The summed cross-entropy over masked positions and their count (f32
/// scalars), from which means over several batches are exact.
pub fn masked_cross_entropy_sum(
    logits: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
) -> (Tensor, Tensor) {
    let d = logits.dims();
    let (b, s, v) = (d[0], d[1], d[2]);
    let n = b * s;
    let lf = logits.cast(DType::F32).reshape(&[n, v]);
    // The max keeps exp in range; its gradient cancels, so autodiff gets none.
    let m = lf.max(&[1]).stop_gradient();
    let lse = m
        + (lf - m.broadcast_in_dim(&[n, v], &[0]))
            .exp()
            .sum(&[1])
            .log();
    // Labels: ids shifted left; the last position has none (mask 0 there).
    let next = input_ids.slice(&[0, 1], &[b, s]);
    let labels =
        Tensor::concat(&[next, full(TensorType::new(DType::I32, [b, 1]), 0.0)], 1).reshape(&[n, 1]);
    let rows = iota(TensorType::new(DType::I32, [n, 1]), 0);
    let picked = lf.gather(
        Tensor::concat(&[rows, labels], 1),
        Gather {
            offset_dims: vec![],
            collapsed_slice_dims: vec![0, 1],
            start_index_map: vec![0, 1],
            index_vector_dim: 1,
            slice_sizes: vec![1, 1],
        },
    );
    let mask = loss_mask.cast(DType::F32).reshape(&[n]);
    (((lse - picked) * mask).sum(&[0]), mask.sum(&[0]))
}

fn lr_at(step: Tensor, lr: f64, schedule: &Schedule) -> Tensor {
    let s = step.cast(DType::F32);
    let one = s.scalar_like(1.0);
    let warm = |warmup: i64| {
        if warmup <= 0 {
            one
        } else {
            (s / warmup as f64).minimum(one)
        }
    };
    match schedule {
        Schedule::Constant { warmup } => warm(*warmup) * lr,
        Schedule::Cosine { warmup, total } => {
            let span = (*total - *warmup).max(1) as f64;
            let progress = ((s - *warmup as f64) / span)
                .maximum(s.scalar_like(0.0))
                .minimum(one);
            let cosine = (1.0 + (progress * std::f64::consts::PI).cos()) * 0.5;
            // During warmup the cosine factor is 1 (progress clamps to 0).
            warm(*warmup) * cosine * lr
        }
    }
}

/// The loss's inputs under `tc`: (base weights, LoRA tensors, all inputs
/// with the batch).
type LossInputs = (
    Vec<(String, TensorType)>,
    Vec<(String, TensorType)>,
    Vec<(String, TensorType)>,
);

fn loss_inputs(config: &LlamaConfig, tc: &TrainConfig) -> LossInputs {
    let stack = |t: Vec<(String, TensorType)>| {
        if tc.scan_layers {
            stack_types(t, config.num_hidden_layers)
        } else {
            t
        }
    };
    let base = stack(base_parameter_types(config, tc.dtype));
    let lora_params = stack(
        tc.lora
            .as_ref()
            .map(|l| lora_parameter_types(config, l))
            .unwrap_or_default(),
    );
    let mut loss_inputs = base.clone();
    loss_inputs.extend(lora_params.iter().cloned());
    loss_inputs.push((
        "input_ids".into(),
        TensorType::new(DType::I32, [tc.batch, tc.seq]),
    ));
    loss_inputs.push((
        "loss_mask".into(),
        TensorType::new(DType::F32, [tc.batch, tc.seq]),
    ));
    if tc.packing {
        for name in BATCH_PACKING {
            loss_inputs.push((name.into(), TensorType::new(DType::I32, [tc.batch, tc.seq])));
        }
    }
    (base, lora_params, loss_inputs)
}

/// The batch inputs packing adds.
pub const BATCH_PACKING: [&str; 2] = ["positions", "segment_ids"];

/// The batch's inputs (ids, mask, and the packing ones when packing).
pub fn is_batch_input(name: &str) -> bool {
    name == "input_ids" || name == "loss_mask" || BATCH_PACKING.contains(&name)
}

/// The logits of the batch in `i`, packed or not.
fn logits_of(model: &Llama, i: &hlo_ir::Inputs, tc: &TrainConfig) -> Tensor {
    if tc.packing {
        model.forward_packed(
            &Params(i),
            i["input_ids"],
            i["positions"],
            i["segment_ids"],
            tc.dtype,
        )
    } else {
        model.forward(&Params(i), i["input_ids"], tc.dtype)
    }
}

fn model<'a>(config: &'a LlamaConfig, tc: &'a TrainConfig) -> Llama<'a> {
    Llama {
        config,
        lora: tc.lora.as_ref(),
        batch_axes: tc.batch_axes.clone(),
        scan_layers: tc.scan_layers,
        remat_layers: tc.remat_layers,
    }
}

/// The eval step: the summed masked cross-entropy of a batch and its
/// number of counted tokens (`loss_sum`, `tokens`), no gradients. Its
/// inputs are the train step's weights, LoRA tensors and batch, by name.
pub fn eval_step(config: &LlamaConfig, tc: &TrainConfig) -> Result<Function, ModelError> {
    let (_, _, inputs) = loss_inputs(config, tc);
    let model = model(config, tc);
    Ok(trace("llama_eval", &inputs, |i| {
        let logits = logits_of(&model, i, tc);
        let (sum, count) = scope("loss", || {
            masked_cross_entropy_sum(logits, i["input_ids"], i["loss_mask"])
        });
        Outputs::new().add("loss_sum", sum).add("tokens", count)
    })?)
}

/// Builds the step for `config` under `tc`.
pub fn train_step(config: &LlamaConfig, tc: &TrainConfig) -> Result<TrainStep, ModelError> {
    let (base, lora_params, loss_inputs) = loss_inputs(config, tc);
    let trainable: Vec<(String, TensorType)> = if tc.lora.is_some() {
        lora_params.clone()
    } else {
        base.clone()
    };
    let model = model(config, tc);
    let loss_fn = trace("llama_loss", &loss_inputs, |i| {
        let logits = logits_of(&model, i, tc);
        Outputs::new().add(
            "loss",
            scope("loss", || {
                masked_cross_entropy(logits, i["input_ids"], i["loss_mask"])
            }),
        )
    })?;
    let names: Vec<&str> = trainable.iter().map(|(n, _)| n.as_str()).collect();
    let grads = value_and_grad(&loss_fn, "loss", &names)
        .map_err(|e| ModelError::Config(format!("building the gradient: {e}")))?;
    // With accumulation, a micro-step's summed loss, token count and the
    // gradients of the sum.
    let accum = tc.grad_accum.max(1);
    let micro = if accum > 1 {
        let sum_fn = trace("llama_loss_sum", &loss_inputs, |i| {
            let logits = logits_of(&model, i, tc);
            let (sum, count) = scope("loss", || {
                masked_cross_entropy_sum(logits, i["input_ids"], i["loss_mask"])
            });
            Outputs::new().add("loss_sum", sum).add("tokens", count)
        })?;
        Some(
            value_and_grad(&sum_fn, "loss_sum", &names)
                .map_err(|e| ModelError::Config(format!("building the gradient: {e}")))?,
        )
    } else {
        None
    };

    let adam = matches!(tc.optimizer, Optimizer::AdamW { .. });
    let mut step_inputs = loss_inputs.clone();
    if accum > 1 {
        for (name, ty) in step_inputs.iter_mut() {
            if is_batch_input(name) {
                let mut dims = vec![accum];
                dims.extend_from_slice(&ty.dims);
                *ty = TensorType::new(ty.dtype, dims);
            }
        }
    }
    let mut optimizer_state = Vec::new();
    if adam {
        for (n, t) in &trainable {
            for kind in ["m", "v"] {
                let name = format!("opt.{kind}.{n}");
                step_inputs.push((name.clone(), t.with_dtype(DType::F32)));
                optimizer_state.push(name);
            }
        }
    }
    step_inputs.push(("step".into(), TensorType::scalar(DType::I32)));
    let function = trace("train_step", &step_inputs, |i| {
        let (loss, g): (Tensor, Vec<Tensor>) = match &micro {
            None => {
                let args: Vec<Tensor> = grads.inputs.iter().map(|b| i[b.name.as_str()]).collect();
                let out = call(&grads, &args);
                (out[0], out[1..].to_vec())
            }
            Some(micro) => scope("grad_accum", || {
                // Scan over the micro-batches: sum the losses, the token
                // counts and the (f32) gradients; divide once at the end.
                let zero = |t: &TensorType| full(t.with_dtype(DType::F32), 0.0);
                let scalar = TensorType::scalar(DType::F32);
                let acc: Vec<(String, Tensor)> = [
                    ("acc.loss_sum".to_string(), zero(&scalar)),
                    ("acc.tokens".to_string(), zero(&scalar)),
                ]
                .into_iter()
                .chain(trainable.iter().map(|(n, t)| (format!("acc.{n}"), zero(t))))
                .collect();
                let carry: Vec<(&str, Tensor)> =
                    acc.iter().map(|(n, t)| (n.as_str(), *t)).collect();
                let xs: Vec<(&str, Tensor)> = micro
                    .inputs
                    .iter()
                    .filter(|b| is_batch_input(&b.name))
                    .map(|b| (b.name.as_str(), i[b.name.as_str()]))
                    .collect();
                let consts: Vec<(&str, Tensor)> = micro
                    .inputs
                    .iter()
                    .filter(|b| !is_batch_input(&b.name))
                    .map(|b| (b.name.as_str(), i[b.name.as_str()]))
                    .collect();
                let (out, _) = scan(&carry, &xs, &consts, |l| {
                    let args: Vec<Tensor> =
                        micro.inputs.iter().map(|b| l[b.name.as_str()]).collect();
                    let got = call(micro, &args);
                    // got: loss_sum, tokens, then the gradients in `names` order.
                    let new: Vec<Tensor> = acc
                        .iter()
                        .zip(&got)
                        .map(|((n, _), v)| l[n.as_str()] + v.cast(DType::F32))
                        .collect();
                    (new, vec![])
                });
                let tokens = out[1].maximum(out[1].scalar_like(1.0));
                let g: Vec<Tensor> = out[2..]
                    .iter()
                    .zip(&trainable)
                    .map(|(t, (_, ty))| (*t / tokens).cast(ty.dtype))
                    .collect();
                (out[0] / tokens, g)
            }),
        };
        let step = i["step"];
        let (new, norm, lr) = scope("optimizer", || {
            let g32: Vec<Tensor> = g.iter().map(|t| t.cast(DType::F32)).collect();
            let sq: Vec<Tensor> = g32
                .iter()
                .map(|t| (*t * *t).sum(&(0..t.rank() as i64).collect::<Vec<_>>()))
                .collect();
            let norm = sq.iter().skip(1).fold(sq[0], |a, b| a + *b).sqrt();
            let g32: Vec<Tensor> = match tc.clip_norm {
                Some(c) => {
                    let coef = (norm + 1e-6).scalar_like(c) / (norm + 1e-6);
                    let coef = coef.minimum(coef.scalar_like(1.0));
                    g32.iter().map(|t| *t * coef).collect()
                }
                None => g32,
            };
            let lr = lr_at(step, tc.lr, &tc.schedule);
            let t = (step + 1.0).cast(DType::F32);
            let mut new: Vec<(String, Tensor)> = Vec::new();
            for ((name, ty), g) in trainable.iter().zip(&g32) {
                let p = i[name.as_str()].cast(DType::F32);
                match &tc.optimizer {
                    Optimizer::Sgd => new.push((name.clone(), (p - lr * *g).cast(ty.dtype))),
                    Optimizer::AdamW {
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                    } => {
                        let (m0, v0) = (
                            i[format!("opt.m.{name}").as_str()],
                            i[format!("opt.v.{name}").as_str()],
                        );
                        let p = p - lr * *weight_decay * p;
                        let m = m0 * *beta1 + *g * (1.0 - beta1);
                        let v = v0 * *beta2 + *g * *g * (1.0 - beta2);
                        let bc1 = 1.0 - t.scalar_like(*beta1).pow(t);
                        let bc2 = 1.0 - t.scalar_like(*beta2).pow(t);
                        let denom = v.sqrt() / bc2.sqrt() + *eps;
                        let p = p - (lr / bc1) * m / denom;
                        new.push((name.clone(), p.cast(ty.dtype)));
                        new.push((format!("opt.m.{name}"), m));
                        new.push((format!("opt.v.{name}"), v));
                    }
                }
            }
            new.push(("step".into(), step + 1.0));
            (new, norm, lr)
        });
        let mut o = Outputs::new()
            .add("loss", loss)
            .add("grad_norm", norm)
            .add("lr", lr);
        for (n, t) in new {
            o = o.add(n, t);
        }
        o
    })?;
    let donated = function
        .inputs
        .iter()
        .enumerate()
        .filter_map(|(k, b)| {
            function
                .outputs
                .iter()
                .position(|o| o.name == b.name)
                .map(|j| (k, j))
        })
        .collect();
    Ok(TrainStep {
        function,
        trainable: trainable.into_iter().map(|(n, _)| n).collect(),
        optimizer_state,
        donated,
    })
}

/// FLOPs of one step, for MFU, as MaxText and LLM Foundry count them:
/// per token, matmuls cost 2 per weight forward, attention `4·L·s·(heads·head_dim)`
/// forward; a full finetuning step is 3× forward; a LoRA step skips the
/// frozen weights' gradients (2× forward for them) and adds 6 per LoRA weight.
pub fn step_flops(config: &LlamaConfig, tc: &TrainConfig) -> f64 {
    let tokens = (tc.batch * tc.grad_accum.max(1) * tc.seq) as f64;
    let c = config;
    let embed = (c.vocab_size * c.hidden_size) as f64;
    // Matmul weights: everything but the embedding lookup and the RMSNorm
    // scales (a tied head still multiplies).
    let norms = ((2 * c.num_hidden_layers + 1) * c.hidden_size) as f64;
    let mut matmul = c.parameter_count() as f64 - embed - norms;
    if c.tie_word_embeddings {
        matmul += embed;
    }
    let attention =
        4.0 * (c.num_hidden_layers * tc.seq * c.num_attention_heads * c.head_dim) as f64;
    let forward = 2.0 * matmul + attention;
    match &tc.lora {
        None => 3.0 * forward * tokens,
        Some(l) => {
            let lora: f64 = lora_parameter_types(c, l)
                .iter()
                .map(|(_, t)| t.element_count() as f64)
                .sum();
            (2.0 * forward + 6.0 * lora) * tokens
        }
    }
}
