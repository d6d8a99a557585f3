//! The decoder's partition rules give the recipe's table (and place the
//! families' biases and norms); LoRA targets read as a set.

use hlo_models::decoder::{partition_rules, ModelConfig};
use hlo_partitioner::PartitionSpec;

fn p(dims: &[&[&str]]) -> PartitionSpec {
    PartitionSpec::new(dims)
}

#[test]
fn default_llama_rules_follow_the_recipe_table() {
    let r = partition_rules(&ModelConfig::preset("tiny").unwrap());
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
fn experts_split_over_fsdp_and_gpt_oss_experts_over_mp_within() {
    let experts = |preset: &str, name: &str| {
        let r = partition_rules(&ModelConfig::preset(preset).unwrap());
        r.spec_for(&format!("model.layers.3.mlp.experts.{name}"), 3)
    };
    // nn.Linear layout: whole experts on each device (gate rows first).
    for name in ["gate_up_proj", "down_proj"] {
        assert_eq!(
            experts("qwen3-30b-a3b", name),
            p(&[&["fsdp"], &[], &[]]),
            "{name}"
        );
    }
    // gpt-oss [E, H, 2I] and [E, I, H]: intermediate features over mp.
    assert_eq!(
        experts("gpt-oss-20b", "gate_up_proj"),
        p(&[&["fsdp"], &[], &["mp"]])
    );
    assert_eq!(
        experts("gpt-oss-20b", "down_proj"),
        p(&[&["fsdp"], &["mp"], &[]])
    );
    let r = partition_rules(&ModelConfig::preset("gpt-oss-20b").unwrap());
    assert_eq!(
        r.spec_for("model.layers.3.mlp.experts.gate_up_proj_bias", 2),
        p(&[&["fsdp"], &["mp"]])
    );
    assert_eq!(
        r.spec_for("model.layers.3.mlp.router.bias", 1),
        PartitionSpec::replicated()
    );
}

#[test]
fn a_repeated_lora_target_counts_once() {
    let l = hlo_models::decoder::LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "q_proj"], false)
        .unwrap();
    assert_eq!(l.target_modules, ["q_proj", "v_proj"]);
}
