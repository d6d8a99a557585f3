//! The settings that shape a train step, typed, and how each `auto` among
//! them is decided: the axes that split the batch, the loss chunk,
//! packing, and (through [`crate::step::policy`], from the device and memory)
//! layers scanned or not, remat and the attention. Every command that
//! builds a train step (`train`, `bench`, `plan`, `dump-hlo`) resolves it
//! here, so the same flags give the same step everywhere.

pub mod policy;

use std::fmt;
use std::str::FromStr;

use hlo_ir::DType;
use hlo_models::attention::{default_block, AttentionKind};
use hlo_models::decoder::{LoraConfig, ModelConfig, DEFAULT_TARGETS};
use hlo_models::loss::default_loss_chunk;
use hlo_models::train::{Optimizer, Schedule, TrainConfig};
use hlo_partitioner::Mesh;

use self::policy::{Fixed, Layers, Remat, StepPolicy, StepShape, Target};
use crate::error::{EngineError, Result};
use crate::named::Named;

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

/// LoRA's settings as given (checked when the step is resolved).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    pub rank: i64,
    pub alpha: f64,
    pub targets: Vec<String>,
    pub use_rslora: bool,
    /// PEFT's `modules_to_save`: modules trained whole beside the adapters.
    pub modules_to_save: Vec<String>,
}

impl Default for LoraSpec {
    /// r=8, alpha=16 on every projection (the recipe's).
    fn default() -> LoraSpec {
        LoraSpec {
            rank: 8,
            alpha: 16.0,
            targets: DEFAULT_TARGETS.iter().map(|t| t.to_string()).collect(),
            use_rslora: false,
            modules_to_save: Vec::new(),
        }
    }
}

impl LoraSpec {
    /// Modules to save from their comma-separated list, as the flag and
    /// the recorded setting write it (empty: none).
    pub fn modules_from(text: &str) -> Vec<String> {
        text.split(',')
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect()
    }

    /// The checked configuration.
    pub fn config(&self) -> Result<LoraConfig> {
        let targets: Vec<&str> = self.targets.iter().map(|t| t.trim()).collect();
        Ok(
            LoraConfig::new(self.rank, self.alpha, &targets, self.use_rslora)?
                .with_modules_to_save(self.modules_to_save.clone())?,
        )
    }
}

/// What the traced step holds and computes.
#[derive(Clone, Debug, PartialEq)]
pub struct StepSpec {
    /// Rows per micro-batch.
    pub batch: i64,
    /// Tokens per row.
    pub seq: i64,
    /// Micro-batches per optimizer step.
    pub grad_accum: i64,
    /// Several samples per row (`auto`: when samples average at most half
    /// a row, decided from the data).
    pub packing: Toggle,
    /// The layers as one scan (`auto`: [`crate::step::policy`] decides).
    pub scan_layers: Toggle,
    /// What the backward pass recomputes (`auto`: [`crate::step::policy`]
    /// decides: on a GPU only when the step would not fit without).
    pub remat: RematChoice,
    pub attention: AttentionChoice,
    /// Blockwise attention's block (implies blockwise under `auto`).
    pub attention_block: Option<i64>,
    /// Positions whose logits the loss computes at a time (None: from the
    /// rows one device holds, [`default_loss_chunk`]).
    pub loss_chunk: Option<i64>,
    /// LoRA adapters, or every weight when None (full finetuning).
    pub lora: Option<LoraSpec>,
}

impl Default for StepSpec {
    /// `hlo-train train`'s defaults: batch 8 × seq 128, LoRA r=8.
    fn default() -> StepSpec {
        StepSpec {
            batch: 8,
            seq: 128,
            grad_accum: 1,
            packing: Toggle::Auto,
            scan_layers: Toggle::Auto,
            remat: RematChoice::Auto,
            attention: AttentionChoice::Auto,
            attention_block: None,
            loss_chunk: None,
            lora: Some(LoraSpec::default()),
        }
    }
}

/// The optimizer's and schedule's numbers (constants of the program).
#[derive(Clone, Debug, PartialEq)]
pub struct OptimSpec {
    pub optimizer: OptimizerKind,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// The peak learning rate.
    pub lr: f64,
    /// Linear warmup steps.
    pub warmup: i64,
    pub schedule: ScheduleKind,
    /// The global gradient norm's clip (0: none).
    pub clip_norm: f64,
}

impl Default for OptimSpec {
    /// PyTorch's AdamW defaults, lr 2e-4, constant, clip 1.
    fn default() -> OptimSpec {
        OptimSpec {
            optimizer: OptimizerKind::AdamW,
            weight_decay: 0.01,
            lr: 2e-4,
            warmup: 0,
            schedule: ScheduleKind::Constant,
            clip_norm: 1.0,
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
            lora_rank: self.lora.as_ref().map(|l| l.rank),
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
        let lora = self.lora.as_ref().map(LoraSpec::config).transpose()?;
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
}
