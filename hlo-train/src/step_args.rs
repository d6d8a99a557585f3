//! Flags that shape the traced step, shared by `train`, `dump-hlo` and `plan`.

use anyhow::Result;
use clap::{Args, ValueEnum};
use hlo_ir::DType;
use hlo_models::llama::{LlamaConfig, LoraConfig};
use hlo_models::train::{Optimizer, Schedule, TrainConfig};
use hlo_partitioner::Mesh;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    Adamw,
    Sgd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScheduleArg {
    Constant,
    Cosine,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Toggle {
    On,
    Off,
    Auto,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RematArg {
    None,
    Layers,
}

#[derive(Args, Clone, Debug)]
pub struct StepArgs {
    /// Run the decoder layers as one scan over stacked parameters, so the
    /// program and its compile time do not grow with depth (auto: for
    /// models of 32 layers or more).
    #[arg(long, value_enum, default_value = "auto")]
    pub scan_layers: Toggle,

    /// What the backward pass recomputes instead of keeping: `layers`
    /// keeps only each decoder layer's input (less memory, about one more
    /// forward of compute). A scan over layers always works this way.
    #[arg(long, value_enum, default_value = "none")]
    pub remat: RematArg,

    /// Micro-batches of --batch rows per optimizer step; the update is that
    /// of one batch of K·batch rows (the loss normalised by all of their
    /// tokens), at the memory of one micro-batch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i64).range(1..=4096))]
    pub grad_accum: i64,

    /// Pack several samples into each row (attention kept within each
    /// sample, positions restarting); auto: when samples average at most
    /// half of --seq.
    #[arg(long, value_enum, default_value = "auto")]
    pub packing: Toggle,

    /// Train every base weight instead of LoRA adapters.
    #[arg(long)]
    pub full: bool,

    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=65_536))]
    pub lora_rank: i64,

    #[arg(long, default_value_t = 16.0, value_parser = positive)]
    pub lora_alpha: f64,

    /// Comma-separated module names that get adapters.
    #[arg(
        long,
        default_value = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )]
    pub lora_targets: String,

    /// PEFT's rank-stabilised LoRA scale alpha/sqrt(r).
    #[arg(long)]
    pub use_rslora: bool,

    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub batch: i64,

    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(i64).range(1..=10_000_000))]
    pub seq: i64,

    #[arg(long, value_enum, default_value = "adamw")]
    pub optimizer: OptimizerArg,

    /// AdamW's decoupled weight decay (PyTorch's default).
    #[arg(long, default_value_t = 0.01, value_parser = non_negative)]
    pub weight_decay: f64,

    #[arg(long, default_value_t = 2e-4, value_parser = non_negative, allow_negative_numbers = true)]
    pub lr: f64,

    /// Linear warmup steps.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    pub warmup: i64,

    #[arg(long, value_enum, default_value = "constant")]
    pub schedule: ScheduleArg,

    /// Clip the global gradient norm to this; 0 turns clipping off.
    #[arg(long, default_value_t = 1.0, value_parser = non_negative)]
    pub clip_norm: f64,
}

/// A finite number >= 0.
pub fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(_) => Err("must be a finite number >= 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A finite number > 0.
pub fn positive(s: &str) -> Result<f64, String> {
    match non_negative(s) {
        Ok(v) if v > 0.0 => Ok(v),
        Ok(_) => Err("must be > 0".into()),
        Err(e) => Err(e),
    }
}

/// Which step inputs carry a leading axis the partition rules do not
/// mention (left unsplit): stacked layer parameters, and the batch's
/// micro-batch axis under gradient accumulation.
pub fn leading_axis(tc: &TrainConfig) -> impl Fn(&str) -> bool {
    let accum = tc.grad_accum > 1;
    move |name: &str| {
        hlo_models::llama::is_stacked(name) || (accum && hlo_models::train::is_batch_input(name))
    }
}

impl StepArgs {
    /// The traced step's configuration for `config` over `mesh`; `lora`
    /// overrides the LoRA flags (an adapter's own settings).
    pub fn train_config(
        &self,
        config: &LlamaConfig,
        dtype: DType,
        mesh: &Mesh,
        steps: i64,
        lora: Option<LoraConfig>,
    ) -> Result<TrainConfig> {
        let lora = if self.full {
            None
        } else {
            match lora {
                Some(l) => Some(l),
                None => {
                    let targets: Vec<&str> = self.lora_targets.split(',').map(str::trim).collect();
                    Some(LoraConfig::new(
                        self.lora_rank,
                        self.lora_alpha,
                        &targets,
                        self.use_rslora,
                    )?)
                }
            }
        };
        // The batch axes, for the LoRA branch's layout constraint.
        let batch_axes: Vec<String> = if mesh.size() > 1 {
            ["dp", "fsdp"]
                .iter()
                .filter(|a| mesh.axis_index(a).is_some())
                .map(|a| a.to_string())
                .collect()
        } else {
            Vec::new()
        };
        Ok(TrainConfig {
            dtype,
            batch: self.batch,
            seq: self.seq,
            lr: self.lr,
            optimizer: match self.optimizer {
                OptimizerArg::Adamw => Optimizer::adamw(self.weight_decay),
                OptimizerArg::Sgd => Optimizer::Sgd,
            },
            schedule: match self.schedule {
                ScheduleArg::Constant => Schedule::Constant {
                    warmup: self.warmup,
                },
                ScheduleArg::Cosine => Schedule::Cosine {
                    warmup: self.warmup,
                    total: steps,
                },
            },
            clip_norm: (self.clip_norm > 0.0).then_some(self.clip_norm),
            lora,
            batch_axes,
            scan_layers: match self.scan_layers {
                Toggle::On => true,
                Toggle::Off => false,
                Toggle::Auto => config.num_hidden_layers >= 32,
            },
            remat_layers: self.remat == RematArg::Layers,
            grad_accum: self.grad_accum,
            // `auto` is decided by `train` from the data.
            packing: self.packing == Toggle::On,
        })
    }
}
