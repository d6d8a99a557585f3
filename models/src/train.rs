//! The finetuning step as one traced function: forward, masked mean
//! cross-entropy, gradients of the trainable parameters, global-norm
//! clipping, learning-rate schedule and optimizer update.

use hlo_ir::{call, full, scan, scope, trace, value_and_grad, DType, Outputs, Tensor, TensorType};

use crate::attention::AttentionKind;
use crate::decoder::{
    base_parameter_types, is_stacked, lora_parameter_types, stack_types, Decoder, LoraConfig,
    ModelConfig, Params,
};
use crate::distill::step::Distill;
pub use crate::grpo::step::{grpo_loss, grpo_train_step, token_logps_step};
use crate::grpo::GrpoLoss;
use crate::kto::step::Kto;
use crate::loss::{
    chunked_cross_entropy_sum, chunked_token_stats, default_loss_chunk, masked_cross_entropy_sum,
    mean, token_stats, TokenStats,
};
pub use crate::preference::step::{
    preference_loss, preference_train_step, reference_logps_step, Preference,
};
use crate::preference::{reference_of, Reference};
use crate::reward::RewardLoss;
use crate::rloo::RlooLoss;
use crate::roles::{BatchField, Moment, Role, Step, StepInput};
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

impl Schedule {
    /// Linear warmup over `warmup` steps, then cosine decay to zero at
    /// step `total`.
    pub fn cosine(warmup: i64, total: i64) -> Schedule {
        Schedule::Cosine { warmup, total }
    }
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
    /// Rematerialize each layer in the backward pass (see [`Decoder`]).
    pub remat_layers: bool,
    /// Rematerialize each layer's MLP only (see [`Decoder`]).
    pub remat_mlp: bool,
    /// Micro-batches per step (`batch` rows each): the step scans over
    /// them, summing losses and gradients, and normalises by the tokens of
    /// all of them, so K micro-batches of B rows update as one batch of
    /// K·B. The batch inputs are then `[K, batch, seq]`.
    pub grad_accum: i64,
    /// Rows hold several samples (`positions` and `segment_ids` inputs,
    /// see [`Decoder::forward_packed`]).
    pub packing: bool,
    /// How attention is computed ([`AttentionKind::auto`] by default).
    pub attention: AttentionKind,
    /// Positions of each row whose logits the loss computes at a time
    /// (dividing `seq`); `None`: [`default_loss_chunk`] of the shapes on
    /// one device (a caller that splits the batch passes its rows per
    /// device to it instead).
    pub loss_chunk: Option<i64>,
    /// What the step minimises.
    pub loss: Loss,
}

/// What a step minimises: one variant per objective's loss, each
/// implementing [`StepLoss`] in its own module. [`Loss::step_loss`] is the one
/// match over them, so a new loss is one variant and one arm there.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Loss {
    /// The masked next-token cross-entropy (SFT, pretraining).
    #[default]
    CausalLm,
    /// A preference loss over pairs (`batch` then counts rows: twice the
    /// pairs, see [`preference_loss`]).
    Preference(Preference),
    /// GRPO's loss over rollouts (see [`grpo_loss`]): the batch carries
    /// each completion's advantage, and the old and reference
    /// log-probabilities where the loss reads them.
    Grpo(GrpoLoss),
    /// KTO's loss over unpaired examples (see
    /// [`crate::kto::step::kto_loss`]).
    Kto(Kto),
    /// RLOO's loss over rollouts (see [`crate::rloo::step::rloo_loss`]):
    /// the batch carries each completion's advantage, and the old
    /// log-probabilities where the loss reads them.
    Rloo(RlooLoss),
    /// A reward model's Bradley–Terry loss over preference pairs (see
    /// [`crate::reward::step::reward_loss`]).
    Reward(RewardLoss),
    /// On-policy distillation's divergence from a teacher (see
    /// [`crate::distill::step::distill_loss`]).
    Distill(Distill),
}

impl Loss {
    /// The loss's part in the step (its batch fields, train and eval
    /// steps, reference), behind [`StepLoss`].
    pub fn step_loss(&self) -> &dyn StepLoss {
        match self {
            Loss::CausalLm => &CausalLm,
            Loss::Preference(p) => p,
            Loss::Grpo(g) => g,
            Loss::Kto(k) => k,
            Loss::Rloo(r) => r,
            Loss::Reward(r) => r,
            Loss::Distill(d) => d,
        }
    }

    /// The loss with a reference adapter of settings `reference` in the
    /// step beside a trained adapter of settings `trained`: a reference
    /// in the step runs in its own LoRA settings where they are not the
    /// trained adapter's. Losses without a reference adapter in the step
    /// are unchanged.
    pub fn with_reference_lora(self, trained: Option<&LoraConfig>, reference: &LoraConfig) -> Loss {
        match self {
            Loss::Preference(p) => {
                Loss::Preference(p.with_reference_lora(trained, Some(reference)))
            }
            Loss::Kto(k) => Loss::Kto(k.with_reference_lora(trained, Some(reference))),
            other => other,
        }
    }
}

/// What a loss makes of the step: the batch fields it reads, its train
/// and eval steps, and the reference model it runs. Each objective's
/// loss implements it beside its math (`crate::preference::step`,
/// `crate::grpo::step`); the causal-LM loss here.
pub trait StepLoss {
    /// Its name in a step's description (None: the causal-LM loss, the
    /// step's plain form).
    fn name(&self) -> Option<&'static str>;

    /// Adds the batch fields it reads to `fields` (ids and mask, and
    /// packed rows' positions and segment ids, are there already).
    fn batch_fields(&self, fields: &mut Vec<BatchField>);

    /// The train step under `tc` (see [`train_step`]).
    fn train_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError>;

    /// The eval step under `tc` (see [`eval_step`]).
    fn eval_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError>;

    /// The rows of the step each of its examples takes: 1, or 2 for a
    /// pair's two sides or an example with its KL row.
    fn rows_per_example(&self) -> i64 {
        1
    }

    /// How the step has its reference model's log-probabilities, where
    /// it compares with one in the step (None: no reference, or one
    /// scored outside the step, as GRPO's).
    fn reference(&self) -> Option<Reference> {
        None
    }
}

/// The causal-LM loss: the masked mean next-token cross-entropy, over
/// several micro-batches when `grad_accum` says so, with a mixture of
/// experts' load-balancing loss where the config asks for it.
struct CausalLm;

impl StepLoss for CausalLm {
    fn name(&self) -> Option<&'static str> {
        None
    }

    fn batch_fields(&self, _fields: &mut Vec<BatchField>) {}

    fn train_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        causal_lm_train_step(config, tc)
    }

    fn eval_step(&self, config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
        let (_, _, inputs) = loss_inputs(config, tc)?;
        let model = model(config, tc);
        let function = trace("llama_eval", &inputs, |i| {
            let (sum, count) = loss_sum_of(&model, i, tc);
            Outputs::new().add("loss_sum", sum).add("tokens", count)
        })?;
        // One micro-batch at a time: no accumulation axis.
        let single = TrainConfig {
            grad_accum: 1,
            ..tc.clone()
        };
        Ok(Step::new(function, role_of(&single)))
    }
}

impl TrainConfig {
    /// The settings of a forward that scores rows outside the step (a
    /// reference's or the old policy's log-probabilities): this step's
    /// shapes and forms with adapter `lora` (None: the base), the
    /// causal-LM loss, rows unpacked, one micro-batch.
    pub fn scoring(&self, lora: Option<&LoraConfig>) -> TrainConfig {
        TrainConfig {
            lora: lora.cloned(),
            loss: Loss::CausalLm,
            packing: false,
            grad_accum: 1,
            ..self.clone()
        }
    }

    /// Full finetuning of `batch` rows of `seq` tokens in `dtype` with
    /// PyTorch's AdamW defaults (weight decay 0.01), lr 2e-4 constant,
    /// gradient norm clipped to 1, layers unrolled, no accumulation or
    /// packing; the `with_*` methods change one setting each.
    pub fn new(dtype: DType, batch: i64, seq: i64) -> TrainConfig {
        TrainConfig {
            dtype,
            batch,
            seq,
            lr: 2e-4,
            optimizer: Optimizer::adamw(0.01),
            schedule: Schedule::Constant { warmup: 0 },
            clip_norm: Some(1.0),
            lora: None,
            batch_axes: Vec::new(),
            scan_layers: false,
            remat_layers: false,
            remat_mlp: false,
            grad_accum: 1,
            packing: false,
            attention: AttentionKind::auto(seq),
            loss_chunk: None,
            loss: Loss::CausalLm,
        }
    }

    /// Trains these LoRA adapters (None: every weight).
    pub fn with_lora(mut self, lora: Option<LoraConfig>) -> TrainConfig {
        self.lora = lora;
        self
    }

    pub fn with_lr(mut self, lr: f64, schedule: Schedule) -> TrainConfig {
        self.lr = lr;
        self.schedule = schedule;
        self
    }

    pub fn with_optimizer(mut self, optimizer: Optimizer) -> TrainConfig {
        self.optimizer = optimizer;
        self
    }

    /// Positions per chunk of the loss for a vocabulary of `vocab`.
    pub fn loss_chunk_for(&self, vocab: i64) -> i64 {
        self.loss_chunk
            .unwrap_or_else(|| default_loss_chunk(self.batch, self.seq, vocab))
    }

    /// How the step holds attention and the loss, for progress and plan
    /// lines: `naive attention, whole-row loss` or `blockwise attention
    /// (blocks of 512), loss in chunks of 1024 positions`.
    pub fn long_context_summary(&self, vocab: i64) -> String {
        let attention = match self.attention {
            AttentionKind::Naive => "naive attention".to_string(),
            AttentionKind::Blockwise { block } => {
                format!("blockwise attention (blocks of {block})")
            }
            AttentionKind::Cudnn => "cuDNN flash attention".to_string(),
        };
        match self.loss_chunk_for(vocab) {
            c if c >= self.seq => format!("{attention}, whole-row loss"),
            c => format!("{attention}, loss in chunks of {c} positions"),
        }
    }

    /// Rows of a step: micro-batches × batch.
    pub fn rows(&self) -> i64 {
        self.batch * self.grad_accum.max(1)
    }
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
pub(crate) type LossInputs = (
    Vec<(String, TensorType)>,
    Vec<(String, TensorType)>,
    Vec<(String, TensorType)>,
);

pub(crate) fn loss_inputs(
    config: &ModelConfig,
    tc: &TrainConfig,
) -> Result<LossInputs, ModelError> {
    if tc.scan_layers && config.mixed_mlps() {
        return Err(ModelError::Config {
            path: None,
            problem: crate::ConfigError::Unsupported(
                "the layers as one scan when some MLPs are dense and others experts (mlp_only_layers, decoder_sparse_step): use --scan-layers off".into(),
            ),
        });
    }
    if tc.attention == AttentionKind::Cudnn {
        model(config, tc)
            .cudnn_supports(tc.dtype, tc.packing)
            .map_err(|why| ModelError::Config {
                path: None,
                problem: crate::ConfigError::Unsupported(format!("cuDNN attention: {why}")),
            })?;
    }
    let blocks = match tc.attention {
        AttentionKind::Blockwise { block } => Some(("attention block", block)),
        AttentionKind::Naive | AttentionKind::Cudnn => None,
    };
    let chunk = ("loss chunk", tc.loss_chunk_for(config.vocab_size));
    for (what, size) in blocks.into_iter().chain([chunk]) {
        if size < 1 || tc.seq % size != 0 {
            return Err(ModelError::NotDividingSeq {
                what,
                size,
                seq: tc.seq,
            });
        }
    }
    let base = stacked(config, tc, base_parameter_types(config, tc.dtype));
    let lora_params = lora_types(config, tc, tc.lora.as_ref())?;
    let mut loss_inputs = base.clone();
    loss_inputs.extend(lora_params.iter().cloned());
    for field in batch_fields(tc) {
        let ty = match field {
            BatchField::LossMask => TensorType::new(DType::F32, [tc.batch, tc.seq]),
            BatchField::RefLogps
            | BatchField::Advantages
            | BatchField::Desirable
            | BatchField::Margin => TensorType::new(DType::F32, [tc.batch]),
            BatchField::OldLogps | BatchField::RefTokenLogps => {
                TensorType::new(DType::F32, [tc.batch, tc.seq])
            }
            _ => TensorType::new(DType::I32, [tc.batch, tc.seq]),
        };
        loss_inputs.push((field.name().into(), ty));
    }
    Ok((base, lora_params, loss_inputs))
}

/// `types` as the step holds them: one stacked array per layer weight
/// when `tc` scans the layers.
fn stacked(
    config: &ModelConfig,
    tc: &TrainConfig,
    types: Vec<(String, TensorType)>,
) -> Vec<(String, TensorType)> {
    if tc.scan_layers {
        stack_types(types, config.num_hidden_layers)
    } else {
        types
    }
}

/// The LoRA tensors of `lora` (none without) as a step under `tc` holds
/// them.
pub(crate) fn lora_types(
    config: &ModelConfig,
    tc: &TrainConfig,
    lora: Option<&LoraConfig>,
) -> Result<Vec<(String, TensorType)>, ModelError> {
    let Some(l) = lora else {
        return Ok(Vec::new());
    };
    if tc.scan_layers {
        l.check_uniform(config.num_hidden_layers)?;
    }
    Ok(stacked(config, tc, lora_parameter_types(config, l)))
}

/// The batch's fields under `tc`: ids and mask, positions and segment
/// ids when rows are packed, and what the loss reads.
pub fn batch_fields(tc: &TrainConfig) -> Vec<BatchField> {
    let mut fields = vec![BatchField::InputIds, BatchField::LossMask];
    if tc.packing {
        fields.extend([BatchField::Positions, BatchField::SegmentIds]);
    }
    tc.loss.step_loss().batch_fields(&mut fields);
    fields
}

/// The roles of a train or eval step's inputs under `tc`, by name (the
/// names are this module's own).
pub(crate) fn role_of(tc: &TrainConfig) -> impl Fn(&str) -> StepInput + '_ {
    move |name: &str| {
        // Any batch field by name: a preference batch carries segment ids
        // (its rows' real tokens) unpacked.
        let batch = [
            BatchField::InputIds,
            BatchField::LossMask,
            BatchField::Positions,
            BatchField::SegmentIds,
            BatchField::RefLogps,
            BatchField::Advantages,
            BatchField::OldLogps,
            BatchField::RefTokenLogps,
            BatchField::Desirable,
            BatchField::Margin,
        ]
        .into_iter()
        .find(|f| f.name() == name);
        let (role, leading_axis) = if let Some(field) = batch {
            (Role::Batch(field), tc.grad_accum > 1)
        } else if name == "step" {
            (Role::StepCounter, false)
        } else if let Some((moment, of)) = name
            .strip_prefix("opt.m.")
            .map(|of| (Moment::First, of))
            .or_else(|| name.strip_prefix("opt.v.").map(|of| (Moment::Second, of)))
        {
            let role = Role::OptimizerState {
                of: of.to_string(),
                moment,
            };
            (role, is_stacked(of))
        } else {
            // A preference loss's reference adapter is frozen.
            let lora = reference_of(name).is_none()
                && (name.ends_with(".lora_a") || name.ends_with(".lora_b"));
            let saved = tc.lora.as_ref().is_some_and(|l| l.saves_weight(name));
            // A distillation teacher's weights are frozen.
            let teacher = crate::distill::step::teacher_of(name).is_some();
            let trained = !teacher
                && !crate::decoder::is_buffer(name)
                && (lora || saved || tc.lora.is_none());
            let role = if trained {
                Role::Trainable
            } else {
                Role::Weight
            };
            (role, is_stacked(name))
        };
        StepInput { role, leading_axis }
    }
}

/// The summed masked cross-entropy of the batch in `i` (packed or not)
/// and its token count: the LM head and the loss a chunk of positions at a
/// time when the chunk is shorter than a row.
fn loss_sum_of(model: &Decoder, i: &hlo_ir::Inputs, tc: &TrainConfig) -> (Tensor, Tensor) {
    let packed = tc.packing.then(|| (i["positions"], i["segment_ids"]));
    model.router.borrow_mut().clear();
    let h = model.last_hidden(&Params(i), i["input_ids"], packed, tc.dtype);
    let chunk = tc.loss_chunk_for(model.config.vocab_size);
    let (ids, mask) = (i["input_ids"], i["loss_mask"]);
    if chunk >= tc.seq {
        let logits = model.lm_head(&Params(i), h);
        return scope("loss", || masked_cross_entropy_sum(logits, ids, mask));
    }
    let head = model.lm_head_name();
    scope("loss", || {
        chunked_cross_entropy_sum(
            h,
            &[(head, i[head])],
            |c, h| model.logits(c[head], h),
            ids,
            mask,
            chunk,
        )
    })
}

/// The weight of the router's load-balancing loss in the train loss, when
/// the config asks for it (HF's `output_router_logits`, whose loss adds
/// `router_aux_loss_coef` times it); refused where it is not built yet.
fn router_aux_coef(config: &ModelConfig, tc: &TrainConfig) -> Result<Option<f64>, ModelError> {
    let Some(m) = config.moe.as_ref().filter(|m| m.output_router_logits) else {
        return Ok(None);
    };
    let refuse = |with| Err(ModelError::RouterAuxLoss { with });
    if tc.packing {
        return refuse("with packed rows");
    }
    if tc.grad_accum > 1 {
        return refuse("with gradient accumulation");
    }
    if tc.scan_layers {
        return refuse("with the layers as one scan");
    }
    Ok(Some(m.router_aux_loss_coef))
}

/// HF's load-balancing loss of the sparse layers `model` just traced, over
/// every position of the batch's rows (HF's without an attention mask).
fn router_aux_loss(model: &Decoder, tc: &TrainConfig) -> Tensor {
    let stats = std::mem::take(&mut *model.router.borrow_mut());
    let experts = model.config.moe.as_ref().map_or(1, |m| m.num_experts);
    let tokens = hlo_ir::full(TensorType::scalar(DType::F32), (tc.batch * tc.seq) as f64);
    crate::decoder::load_balancing_loss(&stats, tokens, experts)
}

pub(crate) fn model<'a>(config: &'a ModelConfig, tc: &'a TrainConfig) -> Decoder<'a> {
    Decoder {
        config,
        lora: tc.lora.as_ref(),
        batch_axes: tc.batch_axes.clone(),
        scan_layers: tc.scan_layers,
        remat_layers: tc.remat_layers,
        remat_mlp: tc.remat_mlp,
        attention: tc.attention,
        moe: crate::decoder::MoeKind::default(),
        router: Default::default(),
    }
}

/// The eval step: the summed masked cross-entropy of a batch and its
/// number of counted tokens (`loss_sum`, `tokens`), or a loss over pairs
/// with its metrics as the train step logs them; no gradients. Its
/// inputs are the train step's weights, LoRA tensors and batch, by name.
pub fn eval_step(config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
    tc.loss.step_loss().eval_step(config, tc)
}

/// The [`TokenStats`] of the batch in `i` under `m` (`input_ids`, rows
/// not packed), its logits divided by `temperature` (GRPO's; 1 for the
/// preference losses): from whole rows of logits, or a chunk of
/// positions at a time in a scan when `tc`'s loss chunk is shorter than
/// a row (long rows over a large vocabulary).
pub(crate) fn token_stats_of(
    m: &Decoder,
    i: &hlo_ir::Inputs,
    tc: &TrainConfig,
    temperature: f64,
) -> TokenStats {
    let ids = i["input_ids"];
    let h = m.last_hidden(&Params(i), ids, None, tc.dtype);
    let scaled = |logits: Tensor| {
        let logits = logits.cast(DType::F32);
        if temperature != 1.0 {
            logits / temperature
        } else {
            logits
        }
    };
    let chunk = tc.loss_chunk_for(m.config.vocab_size);
    if chunk >= tc.seq {
        return token_stats(scaled(m.lm_head(&Params(i), h)), ids);
    }
    let head = m.lm_head_name();
    scope("loss", || {
        chunked_token_stats(
            h,
            &[(head, i[head])],
            |c, h| scaled(m.logits(c[head], h)),
            ids,
            chunk,
        )
    })
}

/// Builds the step for `config` under `tc`: inputs are the weights, the
/// trainable parameters, the batch, the optimizer state and the step
/// counter; outputs `loss`, `grad_norm`, `lr`, then the updated trainable
/// parameters, optimizer state and counter under their input names
/// (donated).
pub fn train_step(config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
    tc.loss.step_loss().train_step(config, tc)
}

/// The causal-LM train step ([`train_step`] of [`Loss::CausalLm`]).
fn causal_lm_train_step(config: &ModelConfig, tc: &TrainConfig) -> Result<Step, ModelError> {
    let (base, lora_params, loss_inputs) = loss_inputs(config, tc)?;
    let trainable = trainable_of(tc, &base, &lora_params);
    let model = model(config, tc);
    let aux = router_aux_coef(config, tc)?;
    let loss_fn = trace("llama_loss", &loss_inputs, |i| {
        let loss = mean(loss_sum_of(&model, i, tc));
        let loss = match aux {
            Some(coef) => loss + scope("router_aux_loss", || router_aux_loss(&model, tc)) * coef,
            None => loss,
        };
        Outputs::new().add("loss", loss)
    })?;
    // With accumulation, a micro-step's summed loss, token count and the
    // gradients of the sum.
    let micro = if tc.grad_accum > 1 {
        let sum_fn = trace("llama_loss_sum", &loss_inputs, |i| {
            let (sum, count) = loss_sum_of(&model, i, tc);
            Outputs::new().add("loss_sum", sum).add("tokens", count)
        })?;
        let names: Vec<&str> = trainable.iter().map(|(n, _)| n.as_str()).collect();
        Some(value_and_grad(&sum_fn, "loss_sum", &names)?)
    } else {
        None
    };
    optimizer_step(tc, &loss_fn, micro.as_ref(), loss_inputs, &trainable)
}

/// The step around a loss of one micro-batch (`loss`, then metrics): its
/// inputs are the loss's; the trainable ones get their gradients,
/// clipped, scheduled and applied by [`optimizer_step`].
pub(crate) fn step_around(
    config: &ModelConfig,
    tc: &TrainConfig,
    loss_fn: &hlo_ir::Function,
) -> Result<Step, ModelError> {
    if config.moe.as_ref().is_some_and(|m| m.output_router_logits) {
        return Err(ModelError::RouterAuxLoss {
            with: "with a preference or GRPO loss",
        });
    }
    let (base, lora_params, _) = loss_inputs(config, tc)?;
    let trainable = trainable_of(tc, &base, &lora_params);
    let inputs: Vec<(String, TensorType)> = loss_fn
        .inputs
        .iter()
        .map(|b| (b.name.clone(), loss_fn.ty(b.value).clone()))
        .collect();
    optimizer_step(tc, loss_fn, None, inputs, &trainable)
}

/// What a step trains: LoRA's adapters and the modules it saves whole, or
/// every base weight.
fn trainable_of(
    tc: &TrainConfig,
    base: &[(String, TensorType)],
    lora_params: &[(String, TensorType)],
) -> Vec<(String, TensorType)> {
    match &tc.lora {
        Some(l) => lora_params
            .iter()
            .cloned()
            .chain(base.iter().filter(|(n, _)| l.saves_weight(n)).cloned())
            .collect(),
        None => base.to_vec(),
    }
}

/// The step around `loss_fn` (outputs `loss`, then any metrics): its
/// gradients of `trainable` (summed over micro-batches by `micro`, the
/// gradients of a summed loss and its token count, when given), global-norm
/// clipping, the learning rate at the step and the optimizer's update.
fn optimizer_step(
    tc: &TrainConfig,
    loss_fn: &hlo_ir::Function,
    micro: Option<&hlo_ir::Function>,
    loss_inputs: Vec<(String, TensorType)>,
    trainable: &[(String, TensorType)],
) -> Result<Step, ModelError> {
    let names: Vec<&str> = trainable.iter().map(|(n, _)| n.as_str()).collect();
    let grads = value_and_grad(loss_fn, "loss", &names)?;
    // The loss's own outputs after `loss`: metrics, passed through.
    let metric_names: Vec<String> = loss_fn.outputs[1..]
        .iter()
        .map(|b| b.name.clone())
        .collect();
    let step_inputs = step_input_types(tc, loss_inputs, trainable);
    let function = trace("train_step", &step_inputs, |i| {
        let (loss, metrics, g): (Tensor, Vec<Tensor>, Vec<Tensor>) = match micro {
            None => {
                let args: Vec<Tensor> = grads.inputs.iter().map(|b| i[b.name.as_str()]).collect();
                let out = call(&grads, &args);
                let k = 1 + metric_names.len();
                (out[0], out[1..k].to_vec(), out[k..].to_vec())
            }
            Some(micro) => scope("grad_accum", || {
                let (loss, g) = accumulated_gradients(tc, micro, trainable, i);
                (loss, Vec::new(), g)
            }),
        };
        let (new, norm, lr) = scope("optimizer", || optimizer_update(tc, trainable, &g, i));
        let mut o = Outputs::new()
            .add("loss", loss)
            .add("grad_norm", norm)
            .add("lr", lr);
        for (n, t) in metric_names.iter().zip(metrics) {
            o = o.add(n.as_str(), t);
        }
        for (n, t) in new {
            o = o.add(n, t);
        }
        o
    })?;
    Ok(Step::new(function, role_of(tc)))
}

/// The train step's inputs: the loss's (its batch fields `[K, ...]` with
/// `grad_accum` K > 1), AdamW's moments of each trained tensor
/// (`opt.m.<name>`, `opt.v.<name>`, f32), then `step` (the steps taken).
fn step_input_types(
    tc: &TrainConfig,
    loss_inputs: Vec<(String, TensorType)>,
    trainable: &[(String, TensorType)],
) -> Vec<(String, TensorType)> {
    let accum = tc.grad_accum.max(1);
    let adam = matches!(tc.optimizer, Optimizer::AdamW { .. });
    let mut step_inputs = loss_inputs;
    if accum > 1 {
        let fields = batch_fields(tc);
        for (name, ty) in step_inputs.iter_mut() {
            if fields.iter().any(|f| f.name() == name) {
                let mut dims = vec![accum];
                dims.extend_from_slice(&ty.dims);
                *ty = TensorType::new(ty.dtype, dims);
            }
        }
    }
    if adam {
        for (n, t) in trainable {
            for kind in ["m", "v"] {
                step_inputs.push((format!("opt.{kind}.{n}"), t.with_dtype(DType::F32)));
            }
        }
    }
    step_inputs.push(("step".into(), TensorType::scalar(DType::I32)));
    step_inputs
}

/// Gradient accumulation: the loss and the gradients of `trainable` over
/// the step's micro-batches, as a scan of `micro` (the summed loss, its
/// token count, then the gradients) over the batch inputs of `i`.
fn accumulated_gradients(
    tc: &TrainConfig,
    micro: &hlo_ir::Function,
    trainable: &[(String, TensorType)],
    i: &hlo_ir::Inputs,
) -> (Tensor, Vec<Tensor>) {
    let fields = batch_fields(tc);
    let is_batch = |name: &str| fields.iter().any(|f| f.name() == name);
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
    let carry: Vec<(&str, Tensor)> = acc.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    let xs: Vec<(&str, Tensor)> = micro
        .inputs
        .iter()
        .filter(|b| is_batch(&b.name))
        .map(|b| (b.name.as_str(), i[b.name.as_str()]))
        .collect();
    let consts: Vec<(&str, Tensor)> = micro
        .inputs
        .iter()
        .filter(|b| !is_batch(&b.name))
        .map(|b| (b.name.as_str(), i[b.name.as_str()]))
        .collect();
    let (out, _) = scan(&carry, &xs, &consts, |l| {
        let args: Vec<Tensor> = micro.inputs.iter().map(|b| l[b.name.as_str()]).collect();
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
        .zip(trainable)
        .map(|(t, (_, ty))| (*t / tokens).cast(ty.dtype))
        .collect();
    (out[0] / tokens, g)
}

/// The optimizer's update of `trainable` (read from `i`, with its state
/// and `step`) by gradients `g`: clipped to `clip_norm` by their global
/// norm, the schedule's learning rate, then SGD's or AdamW's step. Returns
/// the new parameters, optimizer state and `step`; the gradients' norm
/// before clipping; the learning rate.
fn optimizer_update(
    tc: &TrainConfig,
    trainable: &[(String, TensorType)],
    g: &[Tensor],
    i: &hlo_ir::Inputs,
) -> (Vec<(String, Tensor)>, Tensor, Tensor) {
    let step = i["step"];
    let (g32, norm) = clip_by_global_norm(g, tc.clip_norm);
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
                let moments = (
                    i[format!("opt.m.{name}").as_str()],
                    i[format!("opt.v.{name}").as_str()],
                );
                let decay = if decays(name) { *weight_decay } else { 0.0 };
                let hyper = (*beta1, *beta2, *eps, decay);
                let (p, m, v) = adamw(p, *g, moments, (lr, t), hyper);
                new.push((name.clone(), p.cast(ty.dtype)));
                new.push((format!("opt.m.{name}"), m));
                new.push((format!("opt.v.{name}"), v));
            }
        }
    }
    new.push(("step".into(), step + 1.0));
    (new, norm, lr)
}

/// The gradients in f32, scaled down together so that their global L2
/// norm is at most `clip_norm` (as `torch.nn.utils.clip_grad_norm_`), and
/// that norm before clipping.
fn clip_by_global_norm(g: &[Tensor], clip_norm: Option<f64>) -> (Vec<Tensor>, Tensor) {
    let g32: Vec<Tensor> = g.iter().map(|t| t.cast(DType::F32)).collect();
    let sq: Vec<Tensor> = g32
        .iter()
        .map(|t| (*t * *t).sum(&(0..t.rank() as i64).collect::<Vec<_>>()))
        .collect();
    let norm = sq.iter().skip(1).fold(sq[0], |a, b| a + *b).sqrt();
    let g32: Vec<Tensor> = match clip_norm {
        Some(c) => {
            let coef = (norm + 1e-6).scalar_like(c) / (norm + 1e-6);
            let coef = coef.minimum(coef.scalar_like(1.0));
            g32.iter().map(|t| *t * coef).collect()
        }
        None => g32,
    };
    (g32, norm)
}

/// Whether weight decay applies to parameter `name`: every one but the
/// biases and the norms' scales, as transformers' `Trainer` groups them
/// (`get_decay_parameter_names`: no name containing `bias`, `layernorm`,
/// `rmsnorm`, a `norm` component or a `_norm` suffix of a component), so
/// AdamW decays the matrices (and embeddings) only, as pretraining
/// recipes do.
///
/// ```
/// use hlo_models::train::decays;
/// assert!(decays("model.layers.0.mlp.up_proj.weight") && decays("model.embed_tokens.weight"));
/// assert!(decays("model.layers.0.self_attn.q_proj.lora_a"));
/// assert!(!decays("model.norm.weight") && !decays("model.layers.0.input_layernorm.weight"));
/// assert!(!decays("model.layers.0.self_attn.q_norm.weight") && !decays("model.layers.0.self_attn.q_proj.bias"));
/// ```
pub fn decays(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    let forbidden = lower.contains("bias")
        || lower.contains("layernorm")
        || lower.contains("rmsnorm")
        || lower
            .split('.')
            .any(|part| part == "norm" || part.ends_with("_norm"));
    !forbidden
}

/// One `torch.optim.AdamW` step of parameter `p` (f32) by gradient `g`
/// from moments `(m0, v0)`, at learning rate `lr` and step count `t`
/// (from 1), with `(beta1, beta2, eps, weight_decay)`: decoupled weight
/// decay, then the bias-corrected update. Returns the new `(p, m, v)`.
fn adamw(
    p: Tensor,
    g: Tensor,
    (m0, v0): (Tensor, Tensor),
    (lr, t): (Tensor, Tensor),
    (beta1, beta2, eps, weight_decay): (f64, f64, f64, f64),
) -> (Tensor, Tensor, Tensor) {
    let p = p - lr * weight_decay * p;
    let m = m0 * beta1 + g * (1.0 - beta1);
    let v = v0 * beta2 + g * g * (1.0 - beta2);
    let bc1 = 1.0 - t.scalar_like(beta1).pow(t);
    let bc2 = 1.0 - t.scalar_like(beta2).pow(t);
    let denom = v.sqrt() / bc2.sqrt() + eps;
    let p = p - (lr / bc1) * m / denom;
    (p, m, v)
}

/// FLOPs of one step, for MFU, as MaxText and LLM Foundry count them:
/// per token, matmuls cost 2 per weight forward, attention `4·s·(heads·head_dim)`
/// forward per layer (`s` the keys a query sees: the sequence, or the
/// window in sliding layers); a full finetuning step is 3× forward; a LoRA
/// step skips the frozen weights' gradients (2× forward for them) and adds
/// 6 per LoRA weight; a preference loss with a reference model adds its
/// forward. A mixture of experts counts the weights a token uses: its k
/// experts of each sparse layer (and their LoRA), as MaxText counts them.
pub fn step_flops(config: &ModelConfig, tc: &TrainConfig) -> f64 {
    let tokens = (tc.batch * tc.grad_accum.max(1) * tc.seq) as f64;
    let c = config;
    let embed = (c.vocab_size * c.hidden_size) as f64;
    // Matmul weights: everything but the embedding lookup, the norms'
    // scales and the biases (a tied head still multiplies).
    let elementwise: i64 = c
        .parameter_shapes()
        .iter()
        .filter(|(n, s)| s.len() == 1 && (n.ends_with("norm.weight") || n.ends_with(".bias")))
        .map(|(_, s)| s[0])
        .sum();
    // A mixture of experts: only the parameters a token uses (its k experts).
    let mut matmul = (c.active_parameter_count() - elementwise) as f64 - embed;
    if c.tie_word_embeddings {
        matmul += embed;
    }
    let keys: i64 = c
        .layer_types
        .iter()
        .map(|&kind| c.window_of(kind).map_or(tc.seq, |w| w.min(tc.seq)))
        .sum();
    let attention = 4.0 * (keys * c.num_attention_heads * c.head_dim) as f64;
    let forward = 2.0 * matmul + attention;
    let train = match &tc.lora {
        None => 3.0 * forward * tokens,
        Some(l) => {
            let routed = c
                .moe
                .as_ref()
                .map_or(1.0, |m| m.top_k as f64 / m.num_experts as f64);
            let lora: f64 = lora_parameter_types(c, l)
                .iter()
                .map(|(n, t)| {
                    let share = if n.contains("mlp.experts.") {
                        routed
                    } else {
                        1.0
                    };
                    t.element_count() as f64 * share
                })
                .sum();
            (2.0 * forward + 6.0 * lora) * tokens
        }
    };
    // DPO's and IPO's reference model: one more forward (unless computed
    // before training). GRPO's reference and old log-probabilities are
    // scored outside the step.
    let reference = tc
        .loss
        .step_loss()
        .reference()
        .is_some_and(|r| r != Reference::Precomputed);
    train + if reference { forward * tokens } else { 0.0 }
}
