//! Inference: generation with a KV cache and on-device sampling
//! ([`generator`]), continuous batching of many requests over many
//! adapters ([`batcher`], what `serve` runs on), and a reward model's
//! scores of whole sequences ([`reward_scorer`], what `score` and a
//! rollout's model reward run on).

pub mod batcher;
pub mod generator;
pub mod reward_scorer;
