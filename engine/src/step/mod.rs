//! The settings that shape a train step, typed, and how each `auto` among
//! them is decided: the axes that split the batch, the loss chunk,
//! packing, and (through [`crate::step::policy`], from the device and memory)
//! layers scanned or not, remat and the attention. Every command that
//! builds a train step (`train`, `bench`, `plan`, `dump-hlo`) resolves it
//! here, so the same flags give the same step everywhere.

pub mod policy;

use std::fmt;
use std::str::FromStr;

use clap::Args;
use serde::{Deserialize, Serialize};

use hlo_ir::DType;
use hlo_models::attention::{default_block, AttentionKind};
use hlo_models::decoder::{LoraConfig, ModelConfig};
use hlo_models::loss::default_loss_chunk;
use hlo_models::train::{Optimizer, Schedule, TrainConfig};
use hlo_partitioner::Mesh;

use self::policy::{Fixed, Layers, Remat, StepPolicy, StepShape, Target};
use crate::error::{EngineError, Result};
use crate::named::Named;
use crate::settings;

/// On, off, or decided by the run (`auto`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Toggle {
    On,
    Off,
    #[default]
    Auto,
}

impl Toggle {
    /// `auto` decided as `auto`.
    pub fn or(self, auto: bool) -> bool {
        match self {
            Toggle::On => true,
            Toggle::Off => false,
            Toggle::Auto => auto,
        }
    }
}

impl fmt::Display for Toggle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Toggle {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Toggle, String> {
        Toggle::from_name(s).ok_or_else(|| format!("`{s}` is not on, off or auto"))
    }
}

/// How attention is computed (`auto`: [`AttentionKind::auto`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionChoice {
    #[default]
    Auto,
    Naive,
    Blockwise,
    /// cuDNN's fused (flash) attention: CUDA only, bf16/f16.
    Cudnn,
}

/// What the backward pass recomputes instead of keeping (`--remat`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RematChoice {
    /// [`crate::step::policy`] decides.
    #[default]
    Auto,
    /// Nothing: every activation kept (layers unrolled unless scanned).
    None,
    /// Each layer's MLP, from its input.
    Mlp,
    /// Each layer, from its input.
    Layers,
}

impl RematChoice {
    /// The name `--remat` and a saved run give it.
    pub fn name(self) -> &'static str {
        match self {
            RematChoice::Auto => "auto",
            RematChoice::None => "none",
            RematChoice::Mlp => "mlp",
            RematChoice::Layers => "layers",
        }
    }
}

/// The optimizer's kind; its numbers are [`OptimSpec`]'s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OptimizerKind {
    #[default]
    AdamW,
    Sgd,
}

/// The learning-rate schedule after warmup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScheduleKind {
    #[default]
    Constant,
    /// Cosine decay to zero at the run's last step.
    Cosine,
}

/// The targets `--lora-targets` takes by default: every projection
/// (hlo_models' `DEFAULT_TARGETS`, as the flag writes them).
const DEFAULT_TARGETS_FLAG: &str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";

/// LoRA's settings as given (checked when the step is resolved).
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraSpec {
    /// LoRA rank r.
    #[arg(long = "lora-rank", id = "lora_rank", value_name = "LORA_RANK", default_value_t = 8,
          value_parser = clap::value_parser!(i64).range(1..=65_536))]
    #[serde(rename = "lora-rank")]
    pub rank: i64,

    /// LoRA alpha: the update is scaled by alpha/r.
    #[arg(long = "lora-alpha", id = "lora_alpha", value_name = "LORA_ALPHA", default_value_t = 16.0, value_parser = settings::positive)]
    #[serde(rename = "lora-alpha")]
    pub alpha: f64,

    /// Comma-separated module names that get adapters; on a mixture of
    /// experts also its fused experts (mlp.experts.gate_up_proj,
    /// mlp.experts.down_proj: PEFT's target_parameters).
    #[arg(long = "lora-targets", id = "lora_targets", value_name = "LORA_TARGETS", default_value = DEFAULT_TARGETS_FLAG,
          value_parser = settings::comma_list)]
    #[serde(rename = "lora-targets", with = "settings::as_comma_list")]
    pub targets: ::std::vec::Vec<String>,

    /// PEFT's rank-stabilised LoRA scale alpha/sqrt(r).
    #[arg(long)]
    #[serde(rename = "use-rslora")]
    pub use_rslora: bool,

    /// Comma-separated modules trained whole beside the adapters and saved
    /// in the adapter, as PEFT's modules_to_save: lm_head, embed_tokens,
    /// or a mixture of experts' router (gate; gpt-oss: router).
    #[arg(long, default_value = "", value_parser = settings::comma_list)]
    #[serde(rename = "modules-to-save", with = "settings::as_comma_list")]
    pub modules_to_save: ::std::vec::Vec<String>,
}

impl Default for LoraSpec {
    /// r=8, alpha=16 on every projection (the recipe's).
    fn default() -> LoraSpec {
        settings::defaults()
    }
}

impl LoraSpec {
    /// The checked configuration.
    pub fn config(&self) -> Result<LoraConfig> {
        let targets: Vec<&str> = self.targets.iter().map(|t| t.trim()).collect();
        Ok(
            LoraConfig::new(self.rank, self.alpha, &targets, self.use_rslora)?
                .with_modules_to_save(self.modules_to_save.clone())?,
        )
    }

    /// The settings of `lora` as a run records them.
    fn of(lora: &LoraConfig) -> LoraSpec {
        LoraSpec {
            rank: lora.rank,
            alpha: lora.alpha,
            targets: lora.target_modules.clone(),
            use_rslora: lora.use_rslora,
            modules_to_save: lora.modules_to_save.clone(),
        }
    }
}

/// What the traced step holds and computes: the flags shared by `train`,
/// `bench`, `dump-hlo` and `plan`, each declared once here (its flag,
/// default, check and help) and recorded by a run under the flag's name.
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct StepSpec {
    /// Rows per micro-batch.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch: i64,

    /// Tokens per row: longer samples are cut, shorter ones padded (or
    /// packed).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(i64).range(2..=10_000_000))]
    pub seq: i64,

    /// Micro-batches of --batch rows per optimizer step; the update is that
    /// of one batch of K·batch rows (the loss normalised by all of their
    /// tokens), at the memory of one micro-batch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i64).range(1..=4096))]
    pub grad_accum: i64,

    /// Pack several samples into each row (attention kept within each
    /// sample, positions restarting); auto: when samples average at most
    /// half of --seq.
    #[arg(long, value_parser = settings::named::<Toggle>(), default_value = "auto")]
    #[serde(with = "settings::by_name")]
    pub packing: Toggle,

    /// Run the decoder layers as one scan over stacked parameters, so the
    /// program and its compile time do not grow with depth; its backward
    /// recomputes each layer. auto: on the CPU for models of 24 layers or
    /// more, and NF4 bases (whose layers then dequantize their weights
    /// again in the backward pass instead of keeping them); on a GPU only
    /// when the unrolled step would not fit the device.
    #[arg(long, value_parser = settings::named::<Toggle>(), default_value = "auto")]
    #[serde(with = "settings::by_name")]
    pub scan_layers: Toggle,

    /// What the backward pass recomputes instead of keeping: `layers`
    /// keeps only each decoder layer's input (less memory, about one more
    /// forward of compute); `mlp` recomputes each layer's MLP and keeps
    /// the rest (the MLP's activations are most of a layer's); `none`
    /// keeps everything (layers unrolled unless --scan-layers on: a scan
    /// over layers always recomputes). auto: none on the CPU; on a GPU
    /// the least recompute that fits the device (none, then mlp, then
    /// layers).
    #[arg(long, value_parser = settings::named::<RematChoice>(), default_value = "auto")]
    #[serde(with = "settings::by_name")]
    pub remat: RematChoice,

    /// How attention is computed: `naive` holds every head's [seq, seq]
    /// scores; `blockwise` (FlashAttention's algorithm) one block of them
    /// at a time, memory linear in --seq; `cudnn` cuDNN's fused flash
    /// attention (CUDA, bf16/f16). auto: on the CPU blockwise from 256
    /// tokens, where it is also the faster; on CUDA cudnn where it takes
    /// the model; otherwise naive where its scores fit the device, else
    /// blockwise.
    #[arg(long, value_parser = settings::named::<AttentionChoice>(), default_value = "auto")]
    #[serde(with = "settings::by_name")]
    pub attention: AttentionChoice,

    /// Queries and keys per block of blockwise attention, dividing --seq
    /// (default: seq/8 within 64..=256, or the largest divisor of --seq
    /// below that); implies blockwise under --attention auto.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub attention_block: Option<i64>,

    /// Positions of each row whose logits the loss computes at a time
    /// (dividing --seq), so [tokens, vocab] logits are never all held
    /// (default: whole rows while one device's rows x seq x vocab f32
    /// logits stay under 256 MiB, else the largest divisor of --seq that
    /// keeps a chunk under it).
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub loss_chunk: Option<i64>,

    /// Train every base weight instead of LoRA adapters.
    #[arg(long)]
    pub full: bool,

    /// The adapters' settings (read unless `full`: [`StepSpec::adapter`]).
    #[command(flatten)]
    #[serde(flatten)]
    pub lora: LoraSpec,
}

impl Default for StepSpec {
    /// `hlo-train train`'s defaults: batch 8 × seq 128, LoRA r=8.
    fn default() -> StepSpec {
        settings::defaults()
    }
}

/// The optimizer's and schedule's numbers (constants of the program),
/// shared by `train`, `bench`, `dump-hlo` and `plan`.
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct OptimSpec {
    /// The optimizer, with PyTorch's semantics and defaults.
    #[arg(long, value_parser = settings::named::<OptimizerKind>(), default_value = "adamw")]
    #[serde(with = "settings::by_name")]
    pub optimizer: OptimizerKind,

    /// AdamW's decoupled weight decay (PyTorch's default).
    #[arg(long, default_value_t = 0.01, value_parser = settings::non_negative)]
    pub weight_decay: f64,

    /// Peak learning rate (0 trains nothing but still reports the loss
    /// and gradient norm).
    #[arg(long, default_value_t = 2e-4, value_parser = settings::learning_rate, allow_negative_numbers = true)]
    pub lr: f64,

    /// Linear warmup steps.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    pub warmup: i64,

    /// Learning-rate schedule after warmup: constant, or cosine decay to
    /// zero at the last step.
    #[arg(long, value_parser = settings::named::<ScheduleKind>(), default_value = "constant")]
    #[serde(with = "settings::by_name")]
    pub schedule: ScheduleKind,

    /// Clip the global gradient norm to this; 0 turns clipping off.
    #[arg(long, default_value_t = 1.0, value_parser = settings::non_negative)]
    pub clip_norm: f64,
}

impl Default for OptimSpec {
    /// PyTorch's AdamW defaults, lr 2e-4, constant, clip 1.
    fn default() -> OptimSpec {
        settings::defaults()
    }
}

impl StepSpec {
    /// The adapters' settings; None when finetuning fully.
    pub fn adapter(&self) -> Option<&LoraSpec> {
        (!self.full).then_some(&self.lora)
    }

    /// The settings of the traced step `tc` as a run records them: every
    /// `auto` as the step decided it (packing, layers, remat, attention
    /// with its block, loss chunk), the adapter's as it trains.
    pub fn decided(tc: &TrainConfig) -> StepSpec {
        let on = |b: bool| if b { Toggle::On } else { Toggle::Off };
        let (attention, attention_block) = match tc.attention {
            AttentionKind::Naive => (AttentionChoice::Naive, None),
            AttentionKind::Blockwise { block } => (AttentionChoice::Blockwise, Some(block)),
            AttentionKind::Cudnn => (AttentionChoice::Cudnn, None),
        };
        StepSpec {
            batch: tc.batch,
            seq: tc.seq,
            grad_accum: tc.grad_accum,
            packing: on(tc.packing),
            scan_layers: on(tc.scan_layers),
            remat: match (tc.remat_layers, tc.remat_mlp) {
                (true, _) => RematChoice::Layers,
                (false, true) => RematChoice::Mlp,
                (false, false) => RematChoice::None,
            },
            attention,
            attention_block,
            loss_chunk: tc.loss_chunk,
            full: tc.lora.is_none(),
            lora: tc.lora.as_ref().map(LoraSpec::of).unwrap_or_default(),
        }
    }
}

impl OptimSpec {
    /// The optimizer's settings of the traced step `tc` (an SGD step's
    /// weight decay, which it does not read, the default's).
    pub fn decided(tc: &TrainConfig) -> OptimSpec {
        let (optimizer, weight_decay) = match tc.optimizer {
            Optimizer::AdamW { weight_decay, .. } => (OptimizerKind::AdamW, weight_decay),
            Optimizer::Sgd => (OptimizerKind::Sgd, OptimSpec::default().weight_decay),
        };
        let (schedule, warmup) = match tc.schedule {
            Schedule::Constant { warmup } => (ScheduleKind::Constant, warmup),
            Schedule::Cosine { warmup, .. } => (ScheduleKind::Cosine, warmup),
        };
        OptimSpec {
            optimizer,
            weight_decay,
            lr: tc.lr,
            warmup,
            schedule,
            clip_norm: tc.clip_norm.unwrap_or(0.0),
        }
    }
}

impl StepSpec {
    /// The attention the flags fix for rows of `seq` tokens (None:
    /// `auto`, which [`crate::step::policy`] decides).
    pub fn attention_fixed(&self) -> Result<Option<AttentionKind>> {
        let seq = self.seq;
        let block = match self.attention_block {
            Some(b) if seq % b != 0 => {
                return Err(EngineError::NotDividing {
                    setting: "attention-block",
                    value: b,
                    seq,
                })
            }
            Some(b) => b,
            None => default_block(seq),
        };
        Ok(match (self.attention, self.attention_block) {
            (AttentionChoice::Naive | AttentionChoice::Cudnn, Some(_)) => {
                return Err(EngineError::BlockOfNaiveAttention)
            }
            (AttentionChoice::Cudnn, None) => Some(AttentionKind::Cudnn),
            (AttentionChoice::Naive, None) => Some(AttentionKind::Naive),
            (AttentionChoice::Blockwise, _) | (AttentionChoice::Auto, Some(_)) => {
                Some(AttentionKind::Blockwise { block })
            }
            (AttentionChoice::Auto, None) => None,
        })
    }

    /// What the flags fix of the step's `auto` choices.
    fn fixed(&self) -> Result<Fixed> {
        let toggle = |t: Toggle| (t != Toggle::Auto).then(|| t.or(false));
        Ok(Fixed {
            scan_layers: toggle(self.scan_layers),
            remat: match self.remat {
                RematChoice::Auto => None,
                RematChoice::None => Some(Remat::None),
                RematChoice::Mlp => Some(Remat::Mlp),
                RematChoice::Layers => Some(Remat::Layers),
            },
            attention: self.attention_fixed()?,
        })
    }

    /// The step's `auto` choices for `config` in `dtype` over `mesh` on
    /// `target` ([`crate::step::policy::decide`]); commands print its line.
    pub fn policy(
        &self,
        config: &ModelConfig,
        dtype: DType,
        mesh: &Mesh,
        target: &Target,
    ) -> Result<StepPolicy> {
        let shape = self.shape(config, dtype, mesh)?;
        let fixed = self.fixed()?;
        if fixed.attention == Some(AttentionKind::Cudnn) {
            policy::cudnn_for(&shape, target, fixed.scan_layers == Some(true))
                .map_err(EngineError::Cudnn)?;
        }
        Ok(policy::decide(&shape, target, fixed))
    }

    /// The forms the policy tries for this step, in its order
    /// ([`policy::candidates`]).
    pub fn candidates(
        &self,
        config: &ModelConfig,
        dtype: DType,
        mesh: &Mesh,
        target: &Target,
    ) -> Result<Vec<(Layers, AttentionKind)>> {
        let shape = self.shape(config, dtype, mesh)?;
        Ok(policy::candidates(&shape, target, self.fixed()?))
    }

    /// This step with `layers` and `attention` as if given by flags.
    pub(crate) fn fixed_to(&self, layers: Layers, attention: AttentionKind) -> StepSpec {
        let mut s = self.clone();
        (s.scan_layers, s.remat) = match layers {
            Layers::Unrolled => (Toggle::Off, RematChoice::None),
            Layers::UnrolledMlpRemat => (Toggle::Off, RematChoice::Mlp),
            Layers::UnrolledRemat => (Toggle::Off, RematChoice::Layers),
            Layers::Scanned => (Toggle::On, self.remat),
        };
        (s.attention, s.attention_block) = match attention {
            AttentionKind::Naive => (AttentionChoice::Naive, None),
            AttentionKind::Cudnn => (AttentionChoice::Cudnn, None),
            AttentionKind::Blockwise { block } => (AttentionChoice::Blockwise, Some(block)),
        };
        s
    }

    /// The shapes the policy's memory depends on, per device.
    fn shape<'a>(
        &self,
        config: &'a ModelConfig,
        dtype: DType,
        mesh: &Mesh,
    ) -> Result<StepShape<'a>> {
        let size = |axes: &[&str]| -> i64 {
            axes.iter()
                .filter_map(|a| mesh.axis_size(a))
                .product::<i64>()
                .max(1)
        };
        let rows = (self.batch / size(&["dp", "fsdp"])).max(1);
        Ok(StepShape {
            config,
            dtype,
            rows,
            seq: self.seq,
            weight_shards: size(&["fsdp", "mp"]),
            model_shards: size(&["mp"]),
            lora_rank: self.adapter().map(|l| l.rank),
            loss_chunk: self.loss_chunk(config, mesh)?,
            packed: self.packing == Toggle::On,
        })
    }

    /// Positions the loss computes logits for at a time: `--loss-chunk`,
    /// or from the rows one device holds ([`default_loss_chunk`]).
    fn loss_chunk(&self, config: &ModelConfig, mesh: &Mesh) -> Result<i64> {
        Ok(match self.loss_chunk {
            Some(c) if self.seq % c != 0 => {
                return Err(EngineError::NotDividing {
                    setting: "loss-chunk",
                    value: c,
                    seq: self.seq,
                })
            }
            Some(c) => c,
            None => {
                let shards: i64 = StepSpec::batch_axes(mesh)
                    .iter()
                    .filter_map(|a| mesh.axis_size(a))
                    .product();
                default_loss_chunk(
                    (self.batch / shards.max(1)).max(1),
                    self.seq,
                    config.vocab_size,
                )
            }
        })
    }

    /// The mesh axes that split the batch (for the LoRA branch's layout).
    pub fn batch_axes(mesh: &Mesh) -> Vec<String> {
        if mesh.size() == 1 {
            return Vec::new();
        }
        ["dp", "fsdp"]
            .iter()
            .filter(|a| mesh.axis_index(a).is_some())
            .map(|a| a.to_string())
            .collect()
    }

    /// The traced step of these settings for `config` in `dtype` over
    /// `mesh`, every `auto` decided (layers, remat and attention by
    /// `policy`, [`StepSpec::policy`]'s for the same arguments) but packing
    /// (which the data decides: off here unless `On`). `steps` is where a
    /// cosine schedule ends.
    ///
    /// ```
    /// use hlo_engine::step::policy::Target;
    /// use hlo_engine::step::{OptimSpec, StepSpec};
    /// use hlo_engine::models::decoder::ModelConfig;
    /// let config = ModelConfig::preset("tiny").unwrap();
    /// let mesh = "dp=1,fsdp=2,mp=1".parse().unwrap();
    /// let (step, f32) = (StepSpec::default(), hlo_engine::ir::DType::F32);
    /// let policy = step.policy(&config, f32, &mesh, &Target::cpu()).unwrap();
    /// let tc = step
    ///     .train_config(&OptimSpec::default(), &config, f32, &mesh, 100, &policy)
    ///     .unwrap();
    /// assert_eq!(tc.batch_axes, ["dp", "fsdp"]);
    /// assert!(!tc.scan_layers); // 2 layers: unrolled
    /// ```
    pub fn train_config(
        &self,
        optim: &OptimSpec,
        config: &ModelConfig,
        dtype: DType,
        mesh: &Mesh,
        steps: i64,
        policy: &StepPolicy,
    ) -> Result<TrainConfig> {
        let lora = match self.adapter().map(LoraSpec::config).transpose()? {
            Some(l) => Some(l.for_model(config)?),
            None => None,
        };
        if let Some(l) = &lora {
            l.check_modules_to_save(config)?;
        }
        let batch_axes = StepSpec::batch_axes(mesh);
        let loss_chunk = self.loss_chunk(config, mesh)?;
        Ok(TrainConfig {
            dtype,
            batch: self.batch,
            seq: self.seq,
            lr: optim.lr,
            optimizer: match optim.optimizer {
                OptimizerKind::AdamW => Optimizer::adamw(optim.weight_decay),
                OptimizerKind::Sgd => Optimizer::Sgd,
            },
            schedule: match optim.schedule {
                ScheduleKind::Constant => Schedule::Constant {
                    warmup: optim.warmup,
                },
                ScheduleKind::Cosine => Schedule::Cosine {
                    warmup: optim.warmup,
                    total: steps,
                },
            },
            clip_norm: (optim.clip_norm > 0.0).then_some(optim.clip_norm),
            lora,
            batch_axes,
            scan_layers: policy.scan_layers(),
            remat_layers: policy.remat_layers(),
            remat_mlp: policy.remat_mlp(),
            grad_accum: self.grad_accum,
            packing: self.packing == Toggle::On,
            attention: policy.attention,
            loss_chunk: Some(loss_chunk),
            loss: hlo_models::train::Loss::CausalLm,
        })
    }
}

/// Packing under `auto`: on when the samples fill at most half a row
/// unpacked (`unpacked_fill`, their mean share of a row).
pub fn auto_packing(unpacked_fill: f64) -> bool {
    unpacked_fill <= 0.5
}

/// The epochs `steps` steps of `rows` rows of `seq` tokens take of
/// `learning` samples: a step takes its rows' worth, or packed, about as
/// many samples as fill 90% of its tokens (`unpacked_fill`: their mean
/// share of a row). What `train` prints and `data` reports.
pub fn epochs(
    steps: i64,
    rows: i64,
    seq: i64,
    packing: bool,
    unpacked_fill: f64,
    learning: usize,
) -> f64 {
    let per_step = if packing {
        rows as f64 * seq as f64 * 0.9 / (unpacked_fill * seq as f64).max(1.0)
    } else {
        rows as f64
    };
    steps.max(0) as f64 * per_step / learning.max(1) as f64
}

impl Named for Toggle {
    const ALL: &'static [Toggle] = &[Toggle::On, Toggle::Off, Toggle::Auto];
    fn name(self) -> &'static str {
        match self {
            Toggle::On => "on",
            Toggle::Off => "off",
            Toggle::Auto => "auto",
        }
    }
}

impl Named for AttentionChoice {
    const ALL: &'static [AttentionChoice] = &[
        AttentionChoice::Auto,
        AttentionChoice::Naive,
        AttentionChoice::Blockwise,
        AttentionChoice::Cudnn,
    ];
    fn name(self) -> &'static str {
        match self {
            AttentionChoice::Auto => "auto",
            AttentionChoice::Naive => "naive",
            AttentionChoice::Blockwise => "blockwise",
            AttentionChoice::Cudnn => "cudnn",
        }
    }
}

impl Named for RematChoice {
    const ALL: &'static [RematChoice] = &[
        RematChoice::Auto,
        RematChoice::None,
        RematChoice::Mlp,
        RematChoice::Layers,
    ];
    fn name(self) -> &'static str {
        match self {
            RematChoice::Auto => "auto",
            RematChoice::None => "none",
            RematChoice::Mlp => "mlp",
            RematChoice::Layers => "layers",
        }
    }
}

impl Named for OptimizerKind {
    const ALL: &'static [OptimizerKind] = &[OptimizerKind::AdamW, OptimizerKind::Sgd];
    fn name(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Sgd => "sgd",
        }
    }
}

impl Named for ScheduleKind {
    const ALL: &'static [ScheduleKind] = &[ScheduleKind::Constant, ScheduleKind::Cosine];
    fn name(self) -> &'static str {
        match self {
            ScheduleKind::Constant => "constant",
            ScheduleKind::Cosine => "cosine",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::hardware::Kind;

    /// A form fixed as flags would fix it is the form the policy then
    /// returns, for every form it would try (what `plan` compiles when
    /// XLA's figure overrules the estimate).
    #[test]
    fn a_form_fixed_is_the_form_decided() {
        let config = ModelConfig::preset("llama3.1-8b").unwrap();
        let mesh: Mesh = "dp=1,fsdp=1,mp=1".parse().unwrap();
        for kind in [Kind::H100, Kind::Mi300x] {
            let target = Target::of_device(kind.device());
            let spec = StepSpec {
                batch: 1,
                seq: 16384,
                ..StepSpec::default()
            };
            let forms = spec
                .candidates(&config, DType::BF16, &mesh, &target)
                .unwrap();
            assert!(forms.len() > 2, "{forms:?}");
            for (layers, attention) in forms {
                let p = spec
                    .fixed_to(layers, attention)
                    .policy(&config, DType::BF16, &mesh, &target)
                    .unwrap();
                assert_eq!((p.layers, p.attention), (layers, attention), "{kind:?}");
            }
        }
    }

    #[test]
    fn the_default_targets_are_every_projection() {
        let targets = &LoraSpec::default().targets;
        assert_eq!(*targets, hlo_models::decoder::DEFAULT_TARGETS);
    }

    /// What a run records of its step is the flags' vocabulary, and
    /// restoring it gives back the step it decided, every `auto` fixed.
    #[test]
    fn a_decided_step_records_and_restores_itself() {
        let config = ModelConfig::preset("tiny").unwrap();
        let mesh: Mesh = "dp=1,fsdp=1,mp=1".parse().unwrap();
        let spec = StepSpec {
            batch: 2,
            seq: 64,
            grad_accum: 2,
            attention_block: Some(16),
            lora: LoraSpec {
                rank: 4,
                alpha: 8.0,
                targets: vec!["q_proj".into(), "v_proj".into()],
                use_rslora: true,
                modules_to_save: vec!["lm_head".into()],
            },
            ..StepSpec::default()
        };
        let optim = OptimSpec {
            optimizer: OptimizerKind::AdamW,
            weight_decay: 0.5,
            lr: 0.25,
            warmup: 3,
            schedule: ScheduleKind::Cosine,
            clip_norm: 0.0,
        };
        let policy = spec
            .policy(&config, DType::F32, &mesh, &Target::cpu())
            .unwrap();
        let tc = spec
            .train_config(&optim, &config, DType::F32, &mesh, 10, &policy)
            .unwrap();
        let decided = StepSpec::decided(&tc);
        assert_eq!(decided.attention, AttentionChoice::Blockwise);
        assert_ne!(decided.scan_layers, Toggle::Auto);
        assert_eq!(decided.lora, spec.lora);
        let record = settings::record(&decided);
        assert_eq!(record["lora-targets"], "q_proj,v_proj");
        assert_eq!(record["packing"], "off");
        assert_eq!(record["attention-block"], 16);
        let mut flags = settings::names::<StepSpec>();
        flags.sort_unstable();
        for key in record.keys() {
            assert!(flags.binary_search(key).is_ok(), "{key} is no flag");
        }
        let back = settings::restore(&StepSpec::default(), &record, |_| true).unwrap();
        assert_eq!(back, decided);
        let optim_back = OptimSpec::decided(&tc);
        assert_eq!(optim_back, optim);
        let record = settings::record(&optim_back);
        let back = settings::restore(&OptimSpec::default(), &record, |_| true).unwrap();
        assert_eq!(back, optim);
    }
}
