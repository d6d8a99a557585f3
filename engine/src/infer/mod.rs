//! Inference: generation with a KV cache and on-device sampling
//! ([`generator`]), and continuous batching of many requests over many
//! adapters ([`batcher`], what `serve` runs on).

pub mod batcher;
pub mod generator;
