//! The linear projections of a decoder layer, by their HF module names:
//! what LoRA targets by default (`decoder::DEFAULT_TARGETS`) and what NF4
//! stores in 4 bits (`nf4::is_quantized_module`). A module of its own so
//! that `decoder` and `nf4` both read the list without reading each other.

/// Every `nn.Linear` of a decoder layer: attention's q/k/v/o and the MLP's
/// gate/up/down projections.
pub(crate) const LAYER_PROJECTIONS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// The `nn.Linear`s of DeepSeek-V3's latent attention beside `o_proj`
/// (and `q_proj` when it has no query bottleneck): LoRA targets them by
/// name; only a model with latent attention has them.
pub(crate) const LATENT_PROJECTIONS: [&str; 4] =
    ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"];
