//! The linear projections of a decoder layer, by their HF module names:
//! what LoRA targets by default (`decoder::DEFAULT_TARGETS`) and what NF4
//! stores in 4 bits (`nf4::QUANTIZED_MODULES`). A module of its own so
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
