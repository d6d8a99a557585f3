//! The step's `auto` choices, decided in one place: whether layers are
//! scanned or unrolled, whether their forward is recomputed in the
//! backward pass, which attention form runs. They depend on the device
//! (what is fast there) and on memory (what fits), so every command that
//! builds a step (`train`, `bench`, `plan`, `dump-hlo`, `eval`) decides
//! them here from a [`Target`] and prints [`StepPolicy::line`]. A flag a
//! user sets always wins over the policy; the line says so.
//!
//! On the CPU the choices are those measured there (issue 22): layers
//! scanned from 24 layers or on NF4 bases, blockwise attention from 256
//! tokens, no remat. On a GPU the forward is recomputed only when the
//! step would not fit without it (a LoRA step then does half again the
//! FLOPs), and then the least of it that fits (each MLP before each
//! layer), attention is cuDNN's fused form on CUDA where its call takes
//! the step, else the naive form where its scores fit (1.6× faster than
//! blockwise on an H200), and blockwise only where memory needs it.
//!
//! Memory is estimated from the shapes ([`StepMemory`]), with
//! coefficients measured on an H200 (`--attention naive --scan-layers
//! off`, Llama 3.1 8B bf16 LoRA: 52.4 GiB at 4 × 1024, 100.6 GiB at
//! 1 × 4096); `hlo-train plan` compiles the step for XLA's own figures.
//!
//! Not here: packing (the data decides it) and the mesh (the user's).

use std::fmt;

use hlo_ir::DType;
use hlo_models::attention::{cudnn_supports, default_block, AttentionKind, CudnnCase};
use hlo_models::decoder::ModelConfig;

use crate::analysis::hardware::{Device, Figures, Kind};

/// The platform a step is compiled for, by what is fast there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Platform {
    Cpu,
    Cuda,
    Rocm,
}

impl Platform {
    /// From a PJRT plugin's platform name (`cpu`, `cuda`, `rocm`; also
    /// `gpu`, which older CUDA plugins report). Others are treated as the
    /// CPU, whose choices make no assumption about fused kernels.
    pub(crate) fn from_pjrt(name: &str) -> Platform {
        match name.to_ascii_lowercase().as_str() {
            "cuda" | "gpu" => Platform::Cuda,
            "rocm" => Platform::Rocm,
            _ => Platform::Cpu,
        }
    }

    /// The platform of a device kind of the hardware table.
    pub(crate) fn of_kind(kind: Kind) -> Platform {
        match kind {
            Kind::Mi300x | Kind::Mi325x | Kind::Mi250Gcd | Kind::Mi250xGcd => Platform::Rocm,
            Kind::H100 | Kind::H200 | Kind::B200 | Kind::A100 | Kind::Rtx4090 => Platform::Cuda,
            Kind::Host => Platform::Cpu,
        }
    }

    fn is_gpu(self) -> bool {
        self != Platform::Cpu
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Platform::Cpu => "CPU",
            Platform::Cuda => "CUDA",
            Platform::Rocm => "ROCm",
        })
    }
}

/// The device a step is decided for.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    pub platform: Platform,
    /// One device's memory in bytes (None: unknown; the GPU policy then
    /// assumes everything fits, as the CPU's does).
    pub memory_bytes: Option<u64>,
    /// The device in words, for the policy's line (`H100`, `CPU`).
    pub name: String,
}

impl Target {
    /// The host's CPU: today's measured choices, whatever the memory.
    pub fn cpu() -> Target {
        Target {
            platform: Platform::Cpu,
            memory_bytes: None,
            name: "CPU".into(),
        }
    }

    /// A device of the hardware table (`plan --target`).
    pub fn of_device(device: &Device) -> Target {
        let memory_bytes = match device.figures {
            Figures::Datasheet(d) => Some(d.memory_bytes),
            Figures::Host => None,
        };
        Target {
            platform: Platform::of_kind(device.kind),
            memory_bytes,
            name: device.name.to_string(),
        }
    }

    /// The devices `backend` opened ([`Target::of_plugin`]).
    pub fn of_backend(backend: &crate::device::backend::Backend) -> crate::error::Result<Target> {
        let kind = match backend.devices().first() {
            Some(d) => d.kind()?,
            None => String::new(),
        };
        Ok(Target::of_plugin(&backend.platform()?, &kind))
    }

    /// What a plugin reports: its platform name and its first device's
    /// kind, looked up in the hardware table for its memory.
    pub fn of_plugin(platform: &str, device_kind: &str) -> Target {
        let platform = Platform::from_pjrt(platform);
        match crate::analysis::hardware::lookup(device_kind) {
            Some(d) if platform.is_gpu() => Target {
                platform,
                ..Target::of_device(d)
            },
            _ if platform.is_gpu() => Target {
                platform,
                memory_bytes: None,
                name: device_kind.to_string(),
            },
            _ => Target::cpu(),
        }
    }
}

/// How the layers' activations reach the backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layers {
    /// Unrolled, every activation kept: the fewest FLOPs.
    Unrolled,
    /// Unrolled, each layer's MLP recomputed from its input, the rest
    /// kept: for Llama 3.1 8B a quarter of the layer's activations for
    /// the MLP's forward again (80% of a layer's matmul FLOPs).
    UnrolledMlpRemat,
    /// Unrolled, each layer's forward recomputed from its input.
    UnrolledRemat,
    /// One scan over stacked layers (a smaller program; the scan's
    /// backward recomputes each layer from its input).
    Scanned,
}

impl Layers {
    /// Whether the backward recomputes each layer's whole forward.
    pub fn recomputes(self) -> bool {
        matches!(self, Layers::UnrolledRemat | Layers::Scanned)
    }
}

/// What `--remat` asks the backward pass to recompute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Remat {
    None,
    Mlp,
    Layers,
}

/// What the user's flags fix; `None` leaves the choice to the policy.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Fixed {
    pub scan_layers: Option<bool>,
    pub remat: Option<Remat>,
    pub attention: Option<AttentionKind>,
}

/// The shapes a step's memory depends on, per device.
#[derive(Clone, Copy, Debug)]
pub struct StepShape<'a> {
    pub config: &'a ModelConfig,
    pub dtype: DType,
    /// Rows one device holds (the batch over the batch axes).
    pub rows: i64,
    pub seq: i64,
    /// Devices that split the weights (`fsdp` × `mp`).
    pub weight_shards: i64,
    /// Devices that split heads and the MLP's width (`mp`).
    pub model_shards: i64,
    /// LoRA rank, or None for full finetuning.
    pub lora_rank: Option<i64>,
    /// Positions the loss computes logits for at a time.
    pub loss_chunk: i64,
    /// Rows pack several samples (cuDNN's call takes no segment ids).
    pub packed: bool,
}

/// A step's estimated bytes on one device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepMemory {
    /// Weights, adapters, gradients and optimizer moments.
    pub state: u64,
    /// What the backward pass keeps of the layers, or with remat each
    /// layer's input plus one layer's activations.
    pub activations: u64,
    /// The loss's logits chunk and its gradient.
    pub logits: u64,
}

impl StepMemory {
    /// The sum (saturating: absurd sizes make absurd estimates, and the
    /// step they describe is refused later, when traced).
    pub fn total(&self) -> u64 {
        self.state
            .saturating_add(self.activations)
            .saturating_add(self.logits)
    }
}

/// Bytes the backward keeps a token, a layer, besides attention's
/// scores: seven hidden-wide and four MLP-wide values in the compute
/// dtype (measured on an H200: 172 KB for Llama 3.1 8B in bf16), or for
/// mixture-of-experts layers four per routed expert's width.
fn kept_per_token_layer(c: &ModelConfig, dtype: DType, model_shards: i64) -> f64 {
    let hidden_wide = 7.0 * c.hidden_size as f64 + 4.0 * c.num_attention_heads as f64;
    dtype.size_in_bytes() as f64 * hidden_wide + mlp_per_token(c, dtype, model_shards)
}

/// The MLP's part of [`kept_per_token_layer`]: four values of its width
/// (per routed expert's width for mixture-of-experts layers).
fn mlp_per_token(c: &ModelConfig, dtype: DType, model_shards: i64) -> f64 {
    let width = match &c.moe {
        Some(m) => m.moe_intermediate_size as f64 * m.top_k as f64,
        None => c.intermediate_size as f64,
    };
    dtype.size_in_bytes() as f64 * 4.0 * width / model_shards.max(1) as f64
}

impl StepShape<'_> {
    /// Weights in the compute dtype (NF4: half a byte a weight), and for
    /// LoRA the adapters with their gradients and two f32 moments; for
    /// full finetuning the weights' gradients and f32 moments.
    fn state_bytes(&self) -> f64 {
        let c = self.config;
        let params = c.parameter_count() as f64;
        let width = self.dtype.size_in_bytes() as f64;
        let weights = match (&c.quantization, self.lora_rank) {
            // The projections in NF4 (half a byte and an f32 scale per 64
            // weights), the rest (a mixture's experts among them) as they
            // are.
            (Some(_), _) => c
                .parameter_shapes()
                .iter()
                .map(|(name, shape)| {
                    let n = shape.iter().product::<i64>() as f64;
                    match hlo_models::nf4::is_quantized(name) {
                        true => n * (0.5 + 4.0 / 64.0),
                        false => n * width,
                    }
                })
                .sum(),
            (None, Some(_)) => params * width,
            (None, None) => params * (2.0 * width + 8.0),
        };
        let adapters = self.lora_rank.map_or(0.0, |r| {
            let per_layer: f64 = hlo_models::decoder::DEFAULT_TARGETS
                .iter()
                .filter_map(|m| c.projection_dims(m))
                .map(|(i, o)| r as f64 * (i as f64 + o as f64))
                .sum();
            per_layer * c.num_hidden_layers as f64 * 16.0
        });
        (weights + adapters) / self.weight_shards.max(1) as f64
    }

    /// The attention heads one device computes (split over `mp`).
    fn heads_per_shard(&self) -> i64 {
        (self.config.num_attention_heads / self.model_shards.max(1)).max(1)
    }

    /// Attention's f32 scores one layer keeps for the backward (naive
    /// form; the others keep one f32 statistic a query and head).
    fn scores_bytes(&self, attention: AttentionKind) -> f64 {
        let heads = self.heads_per_shard();
        match attention {
            AttentionKind::Naive => {
                4.0 * self.rows as f64 * heads as f64 * (self.seq as f64).powi(2)
            }
            _ => 0.0,
        }
    }

    /// What blockwise attention keeps a layer beyond the other forms: its
    /// backward walks the layer's queries in the accumulator's dtype, and
    /// XLA keeps that copy for it (the 8B bf16 step compiled for an H100:
    /// an f32 `[b, kv_heads, groups, s, d]` buffer a layer, 2.1 GB in all
    /// at 4 × 1,024). Nothing where the dtype is its own accumulator.
    fn blockwise_queries_bytes(&self, attention: AttentionKind) -> f64 {
        let acc = self.dtype.accumulator();
        if !matches!(attention, AttentionKind::Blockwise { .. }) || acc == self.dtype {
            return 0.0;
        }
        let tokens = self.rows as f64 * self.seq as f64;
        tokens * (self.heads_per_shard() * self.config.head_dim) as f64 * acc.size_in_bytes() as f64
    }

    /// The step's estimated memory with `layers` and `attention`. The
    /// backward of a naive layer holds its scores' gradient beside the
    /// kept scores; a recomputed layer holds both anew.
    pub fn memory(&self, layers: Layers, attention: AttentionKind) -> StepMemory {
        let c = self.config;
        let tokens = self.rows as f64 * self.seq as f64;
        let kept = tokens * kept_per_token_layer(c, self.dtype, self.model_shards)
            + self.blockwise_queries_bytes(attention);
        let mlp = tokens * mlp_per_token(c, self.dtype, self.model_shards);
        let scores = self.scores_bytes(attention);
        let n = c.num_hidden_layers as f64;
        let mut activations = match layers {
            Layers::Unrolled => n * (kept + scores) + scores,
            // One layer's MLP activations exist at a time in the backward.
            Layers::UnrolledMlpRemat => n * (kept - mlp + scores) + scores + mlp,
            Layers::UnrolledRemat | Layers::Scanned => {
                let input = tokens * c.hidden_size as f64 * self.dtype.size_in_bytes() as f64;
                n * input + kept + 2.0 * scores
            }
        };
        // Unrolled, XLA keeps each dequantized NF4 weight for the backward.
        if c.quantization.is_some() && layers == Layers::Unrolled {
            activations += c.parameter_count() as f64 * self.dtype.size_in_bytes() as f64
                / self.weight_shards.max(1) as f64;
        }
        let logits = 3.0 * 4.0 * self.rows as f64 * self.loss_chunk as f64 * c.vocab_size as f64;
        StepMemory {
            state: self.state_bytes() as u64,
            activations: activations as u64,
            logits: logits as u64,
        }
    }
}

/// Share of a device's memory a step may plan to use: the rest is for
/// XLA's temporaries, the runtime's workspace and fragmentation.
pub(crate) const USABLE_SHARE: f64 = 0.9;

/// The step's decided choices and why.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPolicy {
    pub layers: Layers,
    pub attention: AttentionKind,
    /// The estimate of the chosen step (None on the CPU, which decides
    /// by speed alone).
    pub memory: Option<StepMemory>,
    /// Why, in words, for [`StepPolicy::line`].
    pub why: String,
}

impl StepPolicy {
    pub fn scan_layers(&self) -> bool {
        self.layers == Layers::Scanned
    }

    pub fn remat_layers(&self) -> bool {
        self.layers == Layers::UnrolledRemat
    }

    pub fn remat_mlp(&self) -> bool {
        self.layers == Layers::UnrolledMlpRemat
    }

    /// One line for the commands: what was decided and why.
    pub fn line(&self) -> String {
        let layers = match self.layers {
            Layers::Unrolled => "layers unrolled, no remat",
            Layers::UnrolledMlpRemat => "layers unrolled, each MLP recomputed in the backward",
            Layers::UnrolledRemat => "layers unrolled, each recomputed in the backward",
            Layers::Scanned => "layers scanned (each recomputed in the backward)",
        };
        format!(
            "step: {layers}; attention {}; {}",
            attention_name(self.attention),
            self.why
        )
    }
}

/// The attention of a forward pass alone (`eval`) over `rows` rows of
/// `seq` tokens: the CPU's measured choice there; on a GPU the naive
/// form while one layer's scores and probabilities (all a forward holds
/// of them at once) take at most a quarter of the device, else
/// blockwise.
pub fn forward_attention(
    target: &Target,
    config: &ModelConfig,
    rows: i64,
    seq: i64,
) -> AttentionKind {
    let block = default_block(seq);
    if !target.platform.is_gpu() || block < 32 {
        return AttentionKind::auto(seq);
    }
    let scores = 8.0 * rows as f64 * config.num_attention_heads as f64 * (seq as f64).powi(2);
    match target.memory_bytes {
        Some(m) if scores > m as f64 / 4.0 => AttentionKind::Blockwise { block },
        _ => AttentionKind::Naive,
    }
}

/// The attention form as flags and lines name it.
pub fn attention_name(kind: AttentionKind) -> String {
    match kind {
        AttentionKind::Naive => "naive".into(),
        AttentionKind::Blockwise { block } => format!("blockwise (block {block})"),
        AttentionKind::Cudnn => "cudnn".into(),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// The step's choices for `shape` on `target`, `fixed` by flags where set.
pub fn decide(shape: &StepShape, target: &Target, fixed: Fixed) -> StepPolicy {
    if !target.platform.is_gpu() {
        return decide_cpu(shape, fixed);
    }
    let usable = target
        .memory_bytes
        .map(|m| (m as f64 * USABLE_SHARE) as u64);
    // Candidates run from the fewest FLOPs to the least memory, so when
    // nothing fits the last one tried is the most frugal: said plainly
    // (`plan` finds settings that fit).
    let mut last = None;
    for layers in layer_candidates(shape.config, fixed) {
        for attention in attention_candidates(shape, target, fixed, layers) {
            let memory = shape.memory(layers, attention);
            if usable.is_none_or(|u| memory.total() <= u) {
                let policy = gpu_policy(target, fixed, (layers, attention, memory), usable, true);
                return with_cudnn_note(policy, shape, target, fixed);
            }
            last = Some((layers, attention, memory));
        }
    }
    let chosen = last.expect("every list of candidates has one");
    let policy = gpu_policy(target, fixed, chosen, usable, false);
    with_cudnn_note(policy, shape, target, fixed)
}

/// A form in words: `layers unrolled, MLP recomputed, naive attention`.
pub(crate) fn form_name(layers: Layers, attention: AttentionKind) -> String {
    let layers = match layers {
        Layers::Unrolled => "layers unrolled",
        Layers::UnrolledMlpRemat => "layers unrolled, each MLP recomputed",
        Layers::UnrolledRemat => "layers unrolled, each recomputed",
        Layers::Scanned => "layers scanned (each recomputed)",
    };
    format!("{layers}, {} attention", attention_name(attention))
}

/// The (layers, attention) forms [`decide`] tries on a GPU, in its order
/// (fewest FLOPs first, least memory last); on the CPU, its one choice.
/// A compiler's own figure can then pick the first that fits where the
/// estimate picked wrong.
pub fn candidates(
    shape: &StepShape,
    target: &Target,
    fixed: Fixed,
) -> Vec<(Layers, AttentionKind)> {
    if !target.platform.is_gpu() {
        let p = decide_cpu(shape, fixed);
        return vec![(p.layers, p.attention)];
    }
    layer_candidates(shape.config, fixed)
        .into_iter()
        .flat_map(|layers| {
            attention_candidates(shape, target, fixed, layers)
                .into_iter()
                .map(move |a| (layers, a))
        })
        .collect()
}

/// On CUDA, why cuDNN's attention was not taken when the user left it
/// to the policy (so a fallback is said, not silent).
fn with_cudnn_note(
    mut policy: StepPolicy,
    shape: &StepShape,
    target: &Target,
    fixed: Fixed,
) -> StepPolicy {
    let offered = target.platform == Platform::Cuda && fixed.attention.is_none();
    if offered && policy.attention != AttentionKind::Cudnn {
        if let Err(why) = cudnn_for(shape, target, policy.layers == Layers::Scanned) {
            policy
                .why
                .push_str(&format!("; not cuDNN attention: {why}"));
        }
    }
    policy
}

/// The CPU's measured choices (issue 22), unchanged.
fn decide_cpu(shape: &StepShape, fixed: Fixed) -> StepPolicy {
    let c = shape.config;
    // `--remat mlp` asks for unrolled layers (a scan recomputes all).
    // Dense and sparse layers mixed (DeepSeek-V3's first ones) cannot
    // scan: one body for all.
    let scan = fixed.scan_layers.unwrap_or(
        (c.num_hidden_layers >= 24 || c.quantization.is_some())
            && fixed.remat != Some(Remat::Mlp)
            && !c.mixed_mlps(),
    );
    let layers = match (scan, fixed.remat) {
        (true, _) => Layers::Scanned,
        (false, Some(Remat::Layers)) => Layers::UnrolledRemat,
        (false, Some(Remat::Mlp)) => Layers::UnrolledMlpRemat,
        (false, _) => Layers::Unrolled,
    };
    let attention = fixed
        .attention
        .unwrap_or_else(|| AttentionKind::auto(shape.seq));
    StepPolicy {
        layers,
        attention,
        memory: None,
        why: "the CPU's measured choices".into(),
    }
}

/// Layers beyond which a GPU step is scanned whatever the memory: an
/// unrolled program grows with depth, and so does its compile (Llama 3.1
/// 8B's 32 layers: ~40 s on an H200, 10.5 s on the CPU for `plan`; 405B's
/// 126 layers over 8 devices did not compile for `plan` in 10 minutes).
pub const MAX_UNROLLED_LAYERS: i64 = 48;

/// The same for mixture-of-experts layers, whose unrolled program holds
/// every layer's routing, dispatch and experts: Qwen3-30B-A3B's 48 layers
/// unrolled for 8 × H100 had not compiled after 25 minutes on 2 cores
/// (scanned: 43 s); Mixtral's 32 stay unrolled.
pub const MAX_UNROLLED_MOE_LAYERS: i64 = 32;

/// The layer forms to try, fewest FLOPs first: unrolled without remat,
/// then with each MLP recomputed, then each layer recomputed (scanned
/// from 24 layers, where unrolling costs compile time and the recompute
/// is the same); past [`MAX_UNROLLED_LAYERS`] (mixtures of experts:
/// [`MAX_UNROLLED_MOE_LAYERS`]), and for NF4 bases (whose
/// unrolled layers would keep every weight dequantized for the backward,
/// undoing what NF4 saves), only the scan. `--remat none` means no
/// recompute at all, so layers unrolled unless `--scan-layers on`.
fn layer_candidates(c: &ModelConfig, fixed: Fixed) -> Vec<Layers> {
    // Dense and sparse layers mixed (DeepSeek-V3's first ones) cannot
    // scan: one body for all.
    let scannable = !c.mixed_mlps();
    let remat = if c.num_hidden_layers >= 24 && scannable {
        Layers::Scanned
    } else {
        Layers::UnrolledRemat
    };
    let most = if c.moe.is_some() {
        MAX_UNROLLED_MOE_LAYERS
    } else {
        MAX_UNROLLED_LAYERS
    };
    let scan_only = scannable && (c.num_hidden_layers > most || c.quantization.is_some());
    match (fixed.scan_layers, fixed.remat) {
        (None, None | Some(Remat::Layers)) if scan_only => vec![Layers::Scanned],
        (Some(true), _) => vec![Layers::Scanned],
        (Some(false), Some(Remat::Layers)) => vec![Layers::UnrolledRemat],
        (_, Some(Remat::Mlp)) => vec![Layers::UnrolledMlpRemat],
        (_, Some(Remat::None)) => vec![Layers::Unrolled],
        (Some(false), None) => vec![
            Layers::Unrolled,
            Layers::UnrolledMlpRemat,
            Layers::UnrolledRemat,
        ],
        (None, Some(Remat::Layers)) => vec![remat],
        (None, None) => vec![Layers::Unrolled, Layers::UnrolledMlpRemat, remat],
    }
}

/// Whether cuDNN's fused attention can run `shape`'s step on `target`
/// (`scanned`: layers as one scan); the reason when not.
pub(crate) fn cudnn_for(shape: &StepShape, target: &Target, scanned: bool) -> Result<(), String> {
    let c = shape.config;
    if target.platform != Platform::Cuda {
        return Err(format!(
            "cuDNN's attention runs on CUDA devices, not {}",
            target.platform
        ));
    }
    if scanned && c.mixed_layer_types() && c.sliding_window.is_some() {
        return Err("a scan over layers of mixed types runs one call for all, and cuDNN's window is fixed per call".into());
    }
    cudnn_supports(&CudnnCase {
        dtype: shape.dtype,
        head_dim: c.head_dim,
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        window: c.sliding_window,
        packed: shape.packed,
        sinks: c.attention_sinks,
    })
}

/// The attention forms to try on a GPU, fastest first: cuDNN's fused
/// form where it takes the step (5.3× XLA's own attention at 4k on an
/// H200, nothing quadratic kept), naive while its scores fit, then
/// blockwise.
fn attention_candidates(
    shape: &StepShape,
    target: &Target,
    fixed: Fixed,
    layers: Layers,
) -> Vec<AttentionKind> {
    if let Some(a) = fixed.attention {
        return vec![a];
    }
    let block = default_block(shape.seq);
    let mut all = Vec::new();
    if cudnn_for(shape, target, layers == Layers::Scanned).is_ok() {
        all.push(AttentionKind::Cudnn);
    }
    all.push(AttentionKind::Naive);
    if block >= 32 {
        all.push(AttentionKind::Blockwise { block });
    }
    all
}

fn gpu_policy(
    target: &Target,
    fixed: Fixed,
    (layers, attention, memory): (Layers, AttentionKind, StepMemory),
    usable: Option<u64>,
    fits: bool,
) -> StepPolicy {
    let estimate = format!(
        "~{} state + {} activations",
        gib(memory.state),
        gib(memory.activations.saturating_add(memory.logits))
    );
    let mut why = match usable {
        None => format!("{} {estimate} (its memory unknown)", target.name),
        Some(u) if fits => format!("{estimate} fit {} of the {}'s", gib(u), target.name),
        Some(u) => format!(
            "{estimate} exceed {} of the {}'s even so: see `hlo-train plan`",
            gib(u),
            target.name
        ),
    };
    let set: Vec<&str> = [
        fixed.scan_layers.map(|_| "--scan-layers"),
        fixed.remat.map(|_| "--remat"),
        fixed.attention.map(|_| "--attention"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !set.is_empty() {
        why.push_str(&format!(" ({} as given)", set.join(", ")));
    }
    StepPolicy {
        layers,
        attention,
        memory: Some(memory),
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama8b() -> ModelConfig {
        ModelConfig::preset("llama3.1-8b").unwrap()
    }

    fn shape(c: &ModelConfig, rows: i64, seq: i64) -> StepShape<'_> {
        StepShape {
            config: c,
            dtype: DType::BF16,
            rows,
            seq,
            weight_shards: 1,
            model_shards: 1,
            lora_rank: Some(16),
            loss_chunk: hlo_models::loss::default_loss_chunk(rows, seq, c.vocab_size),
            packed: false,
        }
    }

    fn gpu(kind: Kind) -> Target {
        Target::of_device(kind.device())
    }

    /// The forms a compiler's figure may pick from are decide's, in its
    /// order: its choice is the first whose estimate fits, on a GPU of
    /// each vendor, short and long rows.
    #[test]
    fn candidates_are_the_forms_decide_tries_in_its_order() {
        let c = llama8b();
        for kind in [Kind::H100, Kind::Mi300x] {
            let target = gpu(kind);
            let usable = (target.memory_bytes.unwrap() as f64 * USABLE_SHARE) as u64;
            for (rows, seq) in [(4, 1024), (1, 16384), (1, 65536)] {
                let s = shape(&c, rows, seq);
                let forms = candidates(&s, &target, Fixed::default());
                let chosen = decide(&s, &target, Fixed::default());
                let first = forms
                    .iter()
                    .find(|(l, a)| s.memory(*l, *a).total() <= usable)
                    .or(forms.last())
                    .copied();
                assert_eq!(
                    first,
                    Some((chosen.layers, chosen.attention)),
                    "{kind:?} {rows}×{seq}"
                );
                for (i, f) in forms.iter().enumerate() {
                    assert!(!forms[..i].contains(f), "{f:?} twice");
                }
            }
        }
    }

    /// The estimate against what an H200 measured (peak memory, naive
    /// attention, layers unrolled, no remat): 52.4 GiB at 4 × 1024 and
    /// 100.6 GiB at 1 × 4096.
    #[test]
    fn estimate_matches_the_measured_peaks() {
        let c = llama8b();
        for (rows, seq, measured_gib) in [(4, 1024, 52.4), (1, 4096, 100.6)] {
            let m = shape(&c, rows, seq).memory(Layers::Unrolled, AttentionKind::Naive);
            let gib = m.total() as f64 / f64::from(1u32 << 30);
            assert!(
                (gib / measured_gib - 1.0).abs() < 0.05,
                "{rows}x{seq}: {gib} GiB"
            );
        }
    }

    #[test]
    fn blockwise_attention_keeps_each_layers_queries_in_f32() {
        let c = llama8b();
        let s = shape(&c, 4, 1024);
        for layers in [Layers::Unrolled, Layers::Scanned] {
            let cudnn = s.memory(layers, AttentionKind::Cudnn).total();
            let blockwise = s
                .memory(layers, AttentionKind::Blockwise { block: 128 })
                .total();
            // f32 [4 × 1,024 tokens, 32 heads × 128] a layer kept.
            let kept = if layers == Layers::Unrolled { 32 } else { 1 };
            let queries = kept * 4 * 1024 * 32 * 128 * 4;
            assert!(blockwise.abs_diff(cudnn + queries) <= 2, "{layers:?}");
        }
        let f32_step = StepShape {
            dtype: DType::F32,
            ..shape(&c, 4, 1024)
        };
        assert_eq!(
            f32_step.memory(Layers::Unrolled, AttentionKind::Cudnn),
            f32_step.memory(Layers::Unrolled, AttentionKind::Blockwise { block: 128 })
        );
    }

    #[test]
    fn cpu_keeps_its_measured_choices() {
        let c = llama8b();
        let p = decide(&shape(&c, 4, 1024), &Target::cpu(), Fixed::default());
        assert_eq!(p.layers, Layers::Scanned);
        assert_eq!(p.attention, AttentionKind::Blockwise { block: 128 });
        let tiny = ModelConfig::preset("tiny").unwrap();
        let p = decide(&shape(&tiny, 8, 128), &Target::cpu(), Fixed::default());
        assert_eq!(
            (p.layers, p.attention),
            (Layers::Unrolled, AttentionKind::Naive)
        );
    }

    /// A ROCm device of `gb` GB (no fused attention: the memory
    /// decides between naive and blockwise).
    fn rocm(gb: u64) -> Target {
        Target {
            platform: Platform::Rocm,
            memory_bytes: Some(gb * 1_000_000_000),
            name: format!("{gb} GB"),
        }
    }

    /// On CUDA in bf16, cuDNN's attention, and layers unrolled while the
    /// step fits: 8B at 4 × 1024 and 1 × 4096 on an H100.
    #[test]
    fn cuda_takes_cudnn_attention_unrolled() {
        let c = llama8b();
        for (rows, seq) in [(4, 1024), (1, 4096)] {
            for kind in [Kind::H100, Kind::H200] {
                let p = decide(&shape(&c, rows, seq), &gpu(kind), Fixed::default());
                assert_eq!(
                    (p.layers, p.attention),
                    (Layers::Unrolled, AttentionKind::Cudnn)
                );
                assert!(
                    p.line().contains("no remat; attention cudnn"),
                    "{}",
                    p.line()
                );
            }
        }
    }

    /// Where cuDNN's call cannot run the step the policy says why and
    /// takes the next form: f32, packed rows, a ROCm device.
    #[test]
    fn cudnn_refusals_fall_back_and_are_said() {
        let c = llama8b();
        let f32_step = StepShape {
            dtype: DType::F32,
            ..shape(&c, 4, 1024)
        };
        let p = decide(&f32_step, &gpu(Kind::H100), Fixed::default());
        assert_ne!(p.attention, AttentionKind::Cudnn);
        assert!(
            p.why
                .contains("not cuDNN attention: cuDNN's flash attention takes bf16"),
            "{}",
            p.why
        );
        let packed = StepShape {
            packed: true,
            ..shape(&c, 4, 1024)
        };
        let p = decide(&packed, &gpu(Kind::H100), Fixed::default());
        assert_eq!(p.attention, AttentionKind::Naive);
        assert!(p.why.contains("packed rows"), "{}", p.why);
        let p = decide(&shape(&c, 4, 1024), &gpu(Kind::Mi300x), Fixed::default());
        assert_eq!(
            (p.layers, p.attention),
            (Layers::Unrolled, AttentionKind::Naive)
        );
        assert!(!p.why.contains("cuDNN"), "{}", p.why);
        let cpu = cudnn_for(&shape(&c, 4, 1024), &Target::cpu(), false);
        assert_eq!(
            cpu.unwrap_err(),
            "cuDNN's attention runs on CUDA devices, not CPU"
        );
    }

    /// Without a fused form the memory decides: 8B at 4 × 1024 keeps its
    /// naive scores on 80 GB (~54 GiB of 67); at 1 × 4096 they (64 GiB)
    /// do not fit 80 GB beside the rest, blockwise does without remat;
    /// 141 GB holds them.
    #[test]
    fn memory_decides_naive_or_blockwise() {
        let c = llama8b();
        let p = decide(&shape(&c, 4, 1024), &rocm(80), Fixed::default());
        assert_eq!(
            (p.layers, p.attention),
            (Layers::Unrolled, AttentionKind::Naive)
        );
        let s = shape(&c, 1, 4096);
        let p = decide(&s, &rocm(80), Fixed::default());
        assert_eq!(p.layers, Layers::Unrolled);
        assert_eq!(p.attention, AttentionKind::Blockwise { block: 256 });
        let p = decide(&s, &rocm(141), Fixed::default());
        assert_eq!(
            (p.layers, p.attention),
            (Layers::Unrolled, AttentionKind::Naive)
        );
    }

    /// 1 × 16384: unrolled activations (~84 GiB) fit neither an H100 nor
    /// 80 GB of ROCm: each MLP is recomputed, the rest kept (~30 GiB;
    /// with cuDNN on the H100, with blockwise on ROCm, whose naive scores
    /// would take 32 GiB a layer); an MI300X holds it all unrolled. A 24 GB
    /// RTX 4090 holds not even the scan, and the line says so; on it
    /// the scan is what is left at 1 × 4096.
    #[test]
    fn gpu_recomputes_only_when_needed() {
        let c = llama8b();
        let s = shape(&c, 1, 16384);
        let h100 = decide(&s, &gpu(Kind::H100), Fixed::default());
        assert_eq!(
            (h100.layers, h100.attention),
            (Layers::UnrolledMlpRemat, AttentionKind::Cudnn)
        );
        assert!(
            h100.line().contains("each MLP recomputed"),
            "{}",
            h100.line()
        );
        let rocm80 = decide(&s, &rocm(80), Fixed::default());
        assert_eq!(rocm80.layers, Layers::UnrolledMlpRemat);
        assert_eq!(rocm80.attention, AttentionKind::Blockwise { block: 256 });
        let mi300x = decide(&s, &gpu(Kind::Mi300x), Fixed::default());
        assert_eq!(mi300x.layers, Layers::Unrolled);
        let small = decide(&s, &gpu(Kind::Rtx4090), Fixed::default());
        assert!(small.why.contains("exceed"), "{}", small.why);
        let rtx = decide(&shape(&c, 1, 4096), &gpu(Kind::Rtx4090), Fixed::default());
        assert_eq!(
            (rtx.layers, rtx.attention),
            (Layers::Scanned, AttentionKind::Cudnn)
        );
    }

    /// Past 48 layers (70B's 80, 405B's 126) the step is scanned even
    /// where it would fit unrolled: the unrolled program's compile grows
    /// with depth. So is an NF4 base's, whose unrolled layers would keep
    /// every weight dequantized.
    #[test]
    fn deep_models_and_nf4_bases_are_scanned() {
        for name in ["llama3.1-70b", "llama3.1-405b"] {
            let c = ModelConfig::preset(name).unwrap();
            let s = StepShape {
                weight_shards: 8,
                ..shape(&c, 1, 64)
            };
            let p = decide(&s, &gpu(Kind::Mi300x), Fixed::default());
            assert_eq!(p.layers, Layers::Scanned, "{name}");
        }
        // Mixtures of experts from fewer layers; Mixtral's 32 unrolled.
        for (name, scanned) in [("qwen3-30b-a3b", true), ("mixtral-8x7b", false)] {
            let c = ModelConfig::preset(name).unwrap();
            assert_eq!(c.num_hidden_layers > 32, scanned, "{name}");
            let s = StepShape {
                weight_shards: 8,
                ..shape(&c, 1, 64)
            };
            let p = decide(&s, &gpu(Kind::H100), Fixed::default());
            assert_eq!(p.layers == Layers::Scanned, scanned, "{name}");
        }
        let mut nf4 = ModelConfig::preset("llama3.2-1b").unwrap();
        nf4.quantization = Some(hlo_models::nf4::Nf4Config {
            double_quant: false,
        });
        let p = decide(&shape(&nf4, 1, 1024), &gpu(Kind::H100), Fixed::default());
        assert_eq!(p.layers, Layers::Scanned);
    }

    #[test]
    fn flags_win_and_are_named() {
        let c = llama8b();
        let fixed = Fixed {
            scan_layers: Some(true),
            attention: Some(AttentionKind::Naive),
            ..Fixed::default()
        };
        let p = decide(&shape(&c, 4, 1024), &gpu(Kind::H100), fixed);
        assert_eq!(
            (p.layers, p.attention),
            (Layers::Scanned, AttentionKind::Naive)
        );
        assert!(
            p.why.contains("--scan-layers, --attention as given"),
            "{}",
            p.why
        );
        let remat = Fixed {
            remat: Some(Remat::Layers),
            ..Fixed::default()
        };
        let p = decide(&shape(&c, 4, 1024), &gpu(Kind::H100), remat);
        assert!(p.layers.recomputes());
    }

    #[test]
    fn forward_alone_keeps_naive_scores_longer() {
        let c = llama8b();
        let h100 = gpu(Kind::H100);
        assert_eq!(forward_attention(&h100, &c, 1, 4096), AttentionKind::Naive);
        assert_eq!(
            forward_attention(&h100, &c, 8, 16384),
            AttentionKind::Blockwise { block: 256 }
        );
        assert_eq!(
            forward_attention(&Target::cpu(), &c, 1, 4096),
            AttentionKind::auto(4096)
        );
    }

    #[test]
    fn platforms_from_plugins_and_kinds() {
        assert_eq!(Platform::from_pjrt("cuda"), Platform::Cuda);
        assert_eq!(Platform::from_pjrt("ROCm"), Platform::Rocm);
        assert_eq!(Platform::from_pjrt("cpu"), Platform::Cpu);
        let t = Target::of_plugin("cuda", "NVIDIA H100 80GB HBM3");
        assert_eq!(t.memory_bytes, Some(80_000_000_000));
        assert_eq!(
            Target::of_plugin("rocm", "AMD Instinct MI300X").platform,
            Platform::Rocm
        );
        let unknown = Target::of_plugin("cuda", "NVIDIA B300");
        assert_eq!(
            (unknown.platform, unknown.memory_bytes),
            (Platform::Cuda, None)
        );
        assert_eq!(Target::of_plugin("cpu", "cpu"), Target::cpu());
    }
}
