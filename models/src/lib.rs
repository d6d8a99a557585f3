//! `hlo-models` will own the models and everything about training them that
//! is not the compiler: Llama 3.x written in the tracing DSL as HF
//! transformers defines it, LoRA as PEFT defines it, losses, optimizers and
//! schedules, safetensors checkpoints (HF in, PEFT and HF out), tokenizers and
//! the data pipeline. It knows nothing about PJRT structs; it asks
//! `hlo-runtime` to compile and run.
//!
//! Until the Llama issue lands it holds [`mlp`], a small example program.

pub mod mlp;
