//! The decoder's partition rules give the recipe's table (and place the
//! families' biases and norms); LoRA targets read as a set.

use hlo_models::decoder::partition_rules;
use hlo_partitioner::PartitionSpec;

fn p(dims: &[&[&str]]) -> PartitionSpec {
    PartitionSpec::new(dims)
}

#[test]
fn default_llama_rules_follow_the_recipe_table() {
    let r = partition_rules();
    let cases = [
        ("model.embed_tokens.weight", p(&[&["mp"], &["fsdp"]])),
        ("lm_head.weight", p(&[&["mp"], &["fsdp"]])),
        (
            "model.layers.3.self_attn.q_proj.weight",
            p(&[&["mp"], &["fsdp"]]),
        ),
        (
            "model.layers.3.self_attn.o_proj.weight",
            p(&[&["fsdp"], &["mp"]]),
        ),
        (
            "model.layers.3.mlp.down_proj.weight",
            p(&[&["fsdp"], &["mp"]]),
        ),
        (
            "model.layers.3.self_attn.q_proj.lora_a",
            p(&[&["fsdp"], &["mp"]]),
        ),
        (
            "model.layers.3.self_attn.q_proj.lora_b",
            p(&[&["mp"], &["fsdp"]]),
        ),
        (
            "model.layers.3.input_layernorm.weight",
            PartitionSpec::replicated(),
        ),
        ("model.norm.weight", PartitionSpec::replicated()),
        // Qwen2's biases follow their kernels' output features.
        ("model.layers.3.self_attn.q_proj.bias", p(&[&["mp"]])),
        ("model.layers.3.self_attn.v_proj.bias", p(&[&["mp"]])),
        // Qwen3's and Gemma's head norms, Gemma's sandwich norms.
        (
            "model.layers.3.self_attn.k_norm.weight",
            PartitionSpec::replicated(),
        ),
        (
            "model.layers.3.pre_feedforward_layernorm.weight",
            PartitionSpec::replicated(),
        ),
        ("input_ids", p(&[&["dp", "fsdp"], &[]])),
    ];
    for (name, want) in cases {
        assert_eq!(r.spec_for(name, 2), want, "{name}");
    }
}

#[test]
fn a_repeated_lora_target_counts_once() {
    let l = hlo_models::decoder::LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "q_proj"], false)
        .unwrap();
    assert_eq!(l.target_modules, ["q_proj", "v_proj"]);
}
