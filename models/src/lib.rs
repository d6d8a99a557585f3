//! `hlo-models` owns what the programs are, with no device in sight: the
//! decoder of every family hlo-train runs (Llama 3.x, Qwen2/2.5, Qwen3,
//! Mistral, Gemma 3 text, and the mixtures of experts Qwen3-MoE, Mixtral
//! and gpt-oss) written in the tracing DSL as HF transformers defines them
//! ([`decoder`]), with presets, partition rules and
//! initialisers; LoRA as PEFT
//! defines it; the train, eval, forward and decode steps as traced
//! functions whose inputs carry typed [`roles`] (weight, trainable,
//! optimizer state of X, batch field, step counter, cache); losses,
//! optimizers and schedules ([`train`], [`loss`]); preference losses
//! (DPO, IPO, SimPO, ORPO as TRL defines them, [`preference`]); GRPO's
//! loss as TRL's `GRPOTrainer` computes it ([`grpo`]); KTO's as
//! `KTOTrainer` does ([`kto`]); RLOO's as `RLOOTrainer` does ([`rloo`]); reward models' as `RewardTrainer` does ([`reward`]); on-policy distillation's as `DistillationTrainer` does ([`distill`]); each loss's place in the step behind one
//! trait, [`train::StepLoss`]; attention in the naive
//! and the blockwise (FlashAttention) form ([`attention`]); safetensors checkpoints (HF in,
//! bitsandbytes 4-bit and gpt-oss's MXFP4 experts too, [`checkpoint`],
//! [`mxfp4`]) and PEFT adapters in and out
//! ([`adapter`]); QLoRA's NF4 base weights, quantized as bitsandbytes
//! does and dequantized inside the steps ([`nf4`]); and a small example
//! MLP ([`mlp`]).
//!
//! It does not compile or run anything (that is `hlo-runtime`, driven by
//! `hlo-engine`), and it does not read training data (`hlo-data`).
//!
//! ```
//! use hlo_models::decoder::{ModelConfig, LoraConfig};
//! use hlo_models::roles::Role;
//! use hlo_models::train::{train_step, Optimizer, Schedule, TrainConfig};
//! let config = ModelConfig::preset("tiny").unwrap();
//! let tc = TrainConfig::new(hlo_ir::DType::F32, 2, 16)
//!     .with_lora(Some(LoraConfig::new(4, 8.0, &["q_proj", "v_proj"], false).unwrap()));
//! let step = train_step(&config, &tc).unwrap();
//! let trained = step.inputs_where(|r| *r == Role::Trainable);
//! assert_eq!(trained.len(), 2 * 2 * config.num_hidden_layers as usize);
//! ```

pub mod adapter;
pub mod attention;
pub mod checkpoint;
pub mod cpo;
pub mod decoder;
pub mod distill;
mod error;
pub mod grpo;
pub mod io;
pub mod kto;
pub mod loss;
pub mod mlp;
pub mod mxfp4;
pub mod nf4;
pub mod preference;
mod projections;
mod reference;
pub mod reward;
pub mod rloo;
pub mod roles;
mod safetensors_file;
pub mod train;

pub use error::{ConfigError, LoraError, ModelError};
