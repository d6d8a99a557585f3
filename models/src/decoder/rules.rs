//! How a decoder's tensors are laid out over a `(dp, fsdp, mp)` mesh: the
//! partition rules of the recipe hlo-train grew from, for HF names and
//! layouts (`nn.Linear` weights are `[out, in]`), shared by every family.

use hlo_partitioner::{PartitionSpec, Rules};

use super::config::ModelConfig;

/// Kernels and embeddings over `fsdp` and `mp`, norms (Qwen3's and Gemma
/// 3's per-head q/k norms, Gemma's sandwich norms too) replicated, `lora_a`
/// `("fsdp", "mp")`, `lora_b` `("mp", "fsdp")`, token batches `(("dp",
/// "fsdp"), None)`. Qwen2's q/k/v biases are split over `mp` as their
/// kernels' output features are, so each device adds its own heads'
/// biases. Stacked layer parameters carry a leading layer axis these rules
/// do not mention (see `Step::leading_axis_names`). A mixture of experts'
/// fused expert tensors (and gpt-oss's expert biases) are split over
/// `fsdp` by expert (gpt-oss's also over `mp` within each expert), its
/// router replicated.
///
/// ```
/// use hlo_partitioner::PartitionSpec;
/// let config = hlo_models::decoder::ModelConfig::preset("tiny").unwrap();
/// let rules = hlo_models::decoder::partition_rules(&config);
/// assert_eq!(
///     rules.spec_for("model.layers.0.self_attn.q_proj.lora_a", 2),
///     PartitionSpec::new(&[&["fsdp"], &["mp"]])
/// );
/// ```
pub fn partition_rules(config: &ModelConfig) -> Rules {
    let p = |dims: &[&[&str]]| PartitionSpec::new(dims);
    // `nn.Linear`-layout experts ([E, 2I, H] with the gate rows first, [E,
    // H, I]) stay whole within each device: split over `mp`, the gate and
    // up halves would fall on different devices.
    let transposed = config.moe.as_ref().is_some_and(|m| m.transposed());
    let expert = |within: &[&[&str]; 2]| {
        if transposed {
            p(&[&["fsdp"], within[0], within[1]])
        } else {
            p(&[&["fsdp"], &[], &[]])
        }
    };
    Rules::new(&[
        (r"embed_tokens\.weight$", p(&[&["mp"], &["fsdp"]])),
        (r"lm_head\.weight$", p(&[&["mp"], &["fsdp"]])),
        // A classifier's few labels stay whole; its features split as
        // the hidden states' are.
        (r"^score\.weight$", p(&[&[], &["fsdp"]])),
        // LoRA on fused experts: per expert, split as the experts are.
        (
            r"mlp\.experts\.(gate_up_proj|down_proj)\.lora_[ab]$",
            p(&[&["fsdp"], &[], &[]]),
        ),
        (r"lora_a$", p(&[&["fsdp"], &["mp"]])),
        (r"lora_b$", p(&[&["mp"], &["fsdp"]])),
        // NF4 codes and block scales (`.weight.absmax`) as the weights
        // they replace: rows of whole blocks keep the layout's meaning.
        (
            r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight(\.absmax)?$",
            p(&[&["mp"], &["fsdp"]]),
        ),
        (
            r"(o_proj|down_proj)\.weight(\.absmax)?$",
            p(&[&["fsdp"], &["mp"]]),
        ),
        (r"(q_proj|k_proj|v_proj)\.bias$", p(&[&["mp"]])),
        // Latent attention: the expansions into heads split over `mp` by
        // head, as q/k/v_proj; the bottlenecks' outputs (normalised whole)
        // kept whole, their inputs split as the hidden states.
        (
            r"(q_b_proj|kv_b_proj)\.weight(\.absmax)?$",
            p(&[&["mp"], &["fsdp"]]),
        ),
        (
            r"(q_a_proj|kv_a_proj_with_mqa|shared_expert_gate)\.weight(\.absmax)?$",
            p(&[&[], &["fsdp"]]),
        ),
        (
            r"mlp\.gate\.e_score_correction_bias$",
            PartitionSpec::replicated(),
        ),
        (r"norm\.weight$", PartitionSpec::replicated()),
        // Mixtures of experts: the experts split over `fsdp` along their
        // leading (expert) axis; gpt-oss's transposed ones also over `mp`
        // along their intermediate features (`gate_up_proj` [E, H, 2I]:
        // whole gate/up column pairs on each device; `down_proj` [E, I,
        // H]: the contraction, summed over `mp`), so the blocks' gathered
        // weights are split `mp` ways. The router whole.
        (r"mlp\.experts\.gate_up_proj$", expert(&[&[], &["mp"]])),
        (r"mlp\.experts\.down_proj$", expert(&[&["mp"], &[]])),
        // gpt-oss: the experts' biases split as their outputs; the router
        // (with its bias), the attention sinks and o_proj's bias whole.
        (
            r"mlp\.experts\.gate_up_proj_bias$",
            p(&[&["fsdp"], &["mp"]]),
        ),
        (r"mlp\.experts\.down_proj_bias$", p(&[&["fsdp"], &[]])),
        (
            r"(mlp\.gate\.weight|mlp\.router\.(weight|bias)|self_attn\.sinks|o_proj\.bias)$",
            PartitionSpec::replicated(),
        ),
        (
            r"^(input_ids|labels|loss_mask|positions|segment_ids|old_logps|ref_token_logps)$",
            p(&[&["dp", "fsdp"], &[]]),
        ),
        // A preference batch's per-row reference log-probs, split as rows.
        (
            r"^(ref_logps|advantages|desirable|pair_margin)$",
            p(&[&["dp", "fsdp"]]),
        ),
    ])
    .expect("the decoder rules compile")
}
