//! `hlo-models` owns the models and everything about training them that is
//! not the compiler: Llama 3.x written in the tracing DSL as HF transformers
//! defines it ([`llama`]), LoRA as PEFT defines it, safetensors checkpoints
//! (HF in, [`checkpoint`]), PEFT adapters in and out ([`adapter`]),
//! tokenizers, and a small example MLP ([`mlp`]). It knows nothing about
//! PJRT structs; it asks `hlo-runtime` to compile and run.

pub mod adapter;
pub mod chat;
pub mod checkpoint;
pub mod data;
mod error;
pub mod io;
pub mod llama;
pub mod mlp;
pub mod rng;
pub mod tokenizer;
pub mod train;

pub use error::ModelError;
