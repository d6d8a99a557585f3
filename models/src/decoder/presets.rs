//! Named presets: the exact HF configs of the models people finetune
//! (their `config.json` on the Hub, base models), and `tiny`. Parameter
//! counts equal HF's (`tests/fixtures/llama/param_counts.json`, counted
//! by transformers on the meta device).

use super::config::{
    Activation, ExpertStyle, Family, Head, LayerType, Llama3Scaling, ModelConfig, MoeConfig,
    NormStyle, Rope, RopeScaling, Routing, YarnScaling,
};
use crate::ConfigError;

/// Every preset name, in the order `--help` and errors list them.
pub const PRESETS: [&str; 25] = [
    "tiny",
    "llama3.2-1b",
    "llama3.2-3b",
    "llama3.1-8b",
    "llama3.1-70b",
    "llama3.1-405b",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
    "qwen3-0.6b",
    "qwen3-8b",
    "mistral-7b",
    "gemma3-270m",
    "gemma3-1b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "mixtral-8x7b",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "qwen1.5-moe-a2.7b",
    "glm-4.5",
    "deepseek-v3",
    "kimi-k2",
    "mpt-scale-1b",
    "mpt-scale-3b",
    "mpt-scale-7b",
];

/// Qwen/Qwen1.5-MoE-A2.7B's config.json (the fields that change the
/// computation; the class's defaults for the rest).
const QWEN1_5_MOE_A2_7B: &str = r#"{
  "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
  "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
  "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": false,
  "decoder_sparse_step": 1, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "max_position_embeddings": 8192, "tie_word_embeddings": false,
  "use_sliding_window": false, "bos_token_id": 151643, "eos_token_id": 151643
}"#;

/// zai-org/GLM-4.5's config.json (without its multi-token-prediction
/// layer, which transformers does not build).
const GLM_4_5: &str = r#"{
  "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
  "vocab_size": 151552, "hidden_size": 5120, "intermediate_size": 12288,
  "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
  "head_dim": 128, "partial_rotary_factor": 0.5, "use_qk_norm": true,
  "attention_bias": true, "moe_intermediate_size": 1536, "n_routed_experts": 160,
  "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
  "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000, "max_position_embeddings": 131072,
  "tie_word_embeddings": false, "eos_token_id": [151329, 151336, 151338]
}"#;

/// deepseek-ai/DeepSeek-V3's config.json (DeepSeek-R1's is the same
/// model; without the multi-token-prediction layer 61).
const DEEPSEEK_V3: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
  "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "v_head_dim": 128, "moe_intermediate_size": 2048,
  "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
  "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
  "routed_scaling_factor": 2.5, "norm_topk_prob": true, "rms_norm_eps": 1e-06,
  "rope_theta": 10000, "max_position_embeddings": 163840,
  "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
  "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 1
}"#;

/// moonshotai/Kimi-K2-Instruct's config.json: DeepSeek-V3's architecture
/// with 384 experts, 64 heads, one dense layer, no groups.
const KIMI_K2: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
  "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
  "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
  "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64, "v_head_dim": 128, "moe_intermediate_size": 2048,
  "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
  "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
  "routed_scaling_factor": 2.827, "norm_topk_prob": true, "rms_norm_eps": 1e-06,
  "rope_theta": 50000.0, "max_position_embeddings": 131072,
  "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
  "tie_word_embeddings": false, "bos_token_id": 163584, "eos_token_id": 163585
}"#;

/// The sizes every family names alike: (vocab, hidden, intermediate,
/// layers, heads, K/V heads, head_dim).
type Sizes = (i64, i64, i64, i64, i64, i64, i64);

/// A Llama-shaped config of `family`'s defaults; the family's
/// differences are set by the caller.
fn base(family: Family, sizes: Sizes, rope: Rope, eps: f64, tied: bool) -> ModelConfig {
    let (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim) = sizes;
    ModelConfig {
        family,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim,
        rms_norm_eps: eps,
        rope,
        sliding_rope: None,
        max_position_embeddings: 131072,
        tie_word_embeddings: tied,
        head: Head::CausalLm,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        initializer_range: 0.02,
        qkv_bias: false,
        o_bias: false,
        attention_sinks: false,
        qk_norm: false,
        layer_types: vec![LayerType::Full; layers as usize],
        sliding_window: None,
        hidden_act: Activation::Silu,
        norm_style: NormStyle::Llama,
        scale_embeddings: false,
        sandwich_norms: false,
        query_pre_attn_scalar: None,
        final_logit_softcapping: None,
        quantization: None,
        moe: None,
        mla: None,
    }
}

fn llama(s: Sizes, tied: bool, factor: f64) -> ModelConfig {
    let rope = Rope {
        theta: 500000.0,
        partial_rotary_factor: 1.0,
        scaling: Some(RopeScaling::Llama3(Llama3Scaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        })),
    };
    ModelConfig {
        bos_token_id: Some(128000),
        eos_token_ids: vec![128001, 128008, 128009],
        ..base(Family::Llama, s, rope, 1e-5, tied)
    }
}

/// An MPT-sized Llama (see [`ModelConfig::preset`]): GPT-NeoX's EOS (0)
/// as BOS and EOS, theta 1e4, 2048 positions.
fn mpt_scale(s: Sizes) -> ModelConfig {
    ModelConfig {
        max_position_embeddings: 2048,
        bos_token_id: Some(0),
        eos_token_ids: vec![0],
        ..base(Family::Llama, s, Rope::new(10000.0), 1e-5, true)
    }
}

/// Qwen2.5 base models: q/k/v biases, theta 1e6, no sliding window
/// (`use_sliding_window: false`).
fn qwen2(s: Sizes, tied: bool, max_positions: i64) -> ModelConfig {
    ModelConfig {
        max_position_embeddings: max_positions,
        bos_token_id: Some(151643),
        eos_token_ids: vec![151643],
        qkv_bias: true,
        ..base(Family::Qwen2, s, Rope::new(1e6), 1e-6, tied)
    }
}

/// Qwen3 (dense): q/k norms, head_dim 128 whatever the width.
fn qwen3(s: Sizes, tied: bool) -> ModelConfig {
    ModelConfig {
        max_position_embeddings: 40960,
        bos_token_id: Some(151643),
        eos_token_ids: vec![151645],
        qk_norm: true,
        ..base(Family::Qwen3, s, Rope::new(1e6), 1e-6, tied)
    }
}

/// Gemma 3 text: five local (sliding, window 512, theta 1e4) layers to
/// one global (theta 1e6), and the rest of Gemma's differences.
fn gemma3(s: Sizes) -> ModelConfig {
    let (_, _, _, layers, _, _, _) = s;
    ModelConfig {
        max_position_embeddings: 32768,
        bos_token_id: Some(2),
        eos_token_ids: vec![1],
        sliding_rope: Some(Rope::new(10000.0)),
        qk_norm: true,
        layer_types: LayerType::pattern(layers, 6),
        sliding_window: Some(512),
        hidden_act: Activation::GeluTanh,
        norm_style: NormStyle::Gemma,
        scale_embeddings: true,
        sandwich_norms: true,
        query_pre_attn_scalar: Some(256.0),
        ..base(Family::Gemma3, s, Rope::new(1e6), 1e-6, true)
    }
}

/// Qwen3-MoE: Qwen3's attention, every MLP 128 experts of which 8 a
/// token, renormalised.
fn qwen3_moe(s: Sizes, moe_intermediate: i64) -> ModelConfig {
    let (_, _, _, layers, _, _, _) = s;
    ModelConfig {
        moe: Some(MoeConfig {
            num_experts: 128,
            top_k: 8,
            moe_intermediate_size: moe_intermediate,
            norm_topk_prob: true,
            sparse_layers: vec![true; layers as usize],
            output_router_logits: false,
            router_aux_loss_coef: 0.001,
            f32_routing_weights: false,
            routing: Routing::Softmax,
            shared_expert: None,
            style: ExpertStyle::SwiGlu,
        }),
        ..ModelConfig {
            family: Family::Qwen3Moe,
            ..qwen3(s, false)
        }
    }
}

/// gpt-oss (openai/gpt-oss-20b and -120b): `experts` of which 4 a
/// token, every layer sparse, sliding (window 128) and full layers
/// alternating, yarn rotary (factor 32 over theta 150000).
fn gpt_oss(layers: i64, experts: i64) -> ModelConfig {
    let rope = Rope {
        theta: 150000.0,
        partial_rotary_factor: 1.0,
        scaling: Some(RopeScaling::Yarn(YarnScaling {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 4096.0,
            truncate: false,
            attention_factor: 0.1 * 32f64.ln() + 1.0,
            mscale_all_dim: 0.0,
        })),
    };
    ModelConfig {
        bos_token_id: Some(199998),
        eos_token_ids: vec![200002],
        qkv_bias: true,
        o_bias: true,
        attention_sinks: true,
        layer_types: LayerType::pattern(layers, 2),
        sliding_window: Some(128),
        norm_style: NormStyle::F32,
        moe: Some(MoeConfig {
            num_experts: experts,
            top_k: 4,
            moe_intermediate_size: 2880,
            norm_topk_prob: false,
            sparse_layers: vec![true; layers as usize],
            output_router_logits: false,
            router_aux_loss_coef: 0.9,
            f32_routing_weights: false,
            routing: Routing::Softmax,
            shared_expert: None,
            style: ExpertStyle::GptOss {
                swiglu_alpha: 1.702,
                swiglu_limit: 7.0,
            },
        }),
        ..base(
            Family::GptOss,
            (201088, 2880, 2880, layers, 64, 8, 64),
            rope,
            1e-5,
            false,
        )
    }
}

/// Mixtral 8x7B v0.1: 8 experts, 2 a token, no window.
fn mixtral_8x7b() -> ModelConfig {
    ModelConfig {
        max_position_embeddings: 32768,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        moe: Some(MoeConfig {
            num_experts: 8,
            top_k: 2,
            moe_intermediate_size: 14336,
            norm_topk_prob: true,
            sparse_layers: vec![true; 32],
            output_router_logits: false,
            router_aux_loss_coef: 0.02,
            f32_routing_weights: true,
            routing: Routing::Softmax,
            shared_expert: None,
            style: ExpertStyle::SwiGlu,
        }),
        ..base(
            Family::Mixtral,
            (32000, 4096, 14336, 32, 32, 8, 128),
            Rope::new(1e6),
            1e-5,
            false,
        )
    }
}

impl ModelConfig {
    /// A preset by name (see [`PRESETS`]): `tiny` or the exact HF config
    /// of Llama 3.2 1B/3B, 3.1 8B/70B/405B, Qwen2.5 0.5B/7B, Qwen3
    /// 0.6B/8B, Mistral 7B v0.3, Gemma 3 270M/1B, Qwen3-30B-A3B,
    /// Qwen3-235B-A22B, Mixtral 8x7B, gpt-oss-20b/120b, Qwen1.5-MoE-A2.7B,
    /// GLM-4.5, DeepSeek-V3, Kimi K2.
    ///
    /// ```
    /// let q = hlo_models::decoder::ModelConfig::preset("qwen2.5-0.5b").unwrap();
    /// assert_eq!(q.parameter_count(), 494_032_768);
    /// ```
    pub fn preset(name: &str) -> Result<ModelConfig, ConfigError> {
        // The presets given as their Hub config.json.
        let hub = [
            ("qwen1.5-moe-a2.7b", QWEN1_5_MOE_A2_7B),
            ("glm-4.5", GLM_4_5),
            ("deepseek-v3", DEEPSEEK_V3),
            ("kimi-k2", KIMI_K2),
        ];
        if let Some((_, json)) = hub.iter().find(|(n, _)| *n == name) {
            return ModelConfig::from_json(json);
        }
        Ok(match name {
            // The vocabulary of hlo-data's byte-level tokenizer: 256 bytes,
            // BOS 256, EOS 257, padded to 264 (hlo-engine tests that they
            // agree).
            "tiny" => ModelConfig {
                max_position_embeddings: 512,
                bos_token_id: Some(256),
                eos_token_ids: vec![257],
                // 1/sqrt(hidden): a random tiny model whose frozen head can
                // still express confident predictions, so LoRA can learn.
                initializer_range: 0.125,
                ..base(
                    Family::Llama,
                    (264, 64, 128, 2, 4, 2, 16),
                    Rope::new(10000.0),
                    1e-5,
                    false,
                )
            },
            "llama3.2-1b" => llama((128256, 2048, 8192, 16, 32, 8, 64), true, 32.0),
            // LLM Foundry's MPT sizes (1B and 3B pretrained on 64 MI250,
            // 7B) as Llama-architecture configs, for planning pretraining
            // from scratch: MPT's width, depth, heads, tied embeddings,
            // vocabulary (GPT-NeoX's, padded) and sequence of 2048, with a
            // SwiGLU MLP of about 2.7× the width for MPT's 4× GELU MLP.
            "mpt-scale-1b" => mpt_scale((50432, 2048, 5632, 24, 16, 16, 128)),
            "mpt-scale-3b" => mpt_scale((50432, 2560, 6912, 32, 20, 20, 128)),
            "mpt-scale-7b" => mpt_scale((50432, 4096, 11008, 32, 32, 32, 128)),
            "llama3.2-3b" => llama((128256, 3072, 8192, 28, 24, 8, 128), true, 32.0),
            "llama3.1-8b" => llama((128256, 4096, 14336, 32, 32, 8, 128), false, 8.0),
            "llama3.1-70b" => llama((128256, 8192, 28672, 80, 64, 8, 128), false, 8.0),
            "llama3.1-405b" => llama((128256, 16384, 53248, 126, 128, 8, 128), false, 8.0),
            "qwen2.5-0.5b" => qwen2((151936, 896, 4864, 24, 14, 2, 64), true, 32768),
            "qwen2.5-7b" => qwen2((152064, 3584, 18944, 28, 28, 4, 128), false, 131072),
            "qwen3-0.6b" => qwen3((151936, 1024, 3072, 28, 16, 8, 128), true),
            "qwen3-8b" => qwen3((151936, 4096, 12288, 36, 32, 8, 128), false),
            // v0.3: the 32768 vocabulary, theta 1e6, no sliding window.
            "mistral-7b" => ModelConfig {
                max_position_embeddings: 32768,
                bos_token_id: Some(1),
                eos_token_ids: vec![2],
                ..base(
                    Family::Mistral,
                    (32768, 4096, 14336, 32, 32, 8, 128),
                    Rope::new(1e6),
                    1e-5,
                    false,
                )
            },
            "gemma3-270m" => gemma3((262144, 640, 2048, 18, 4, 1, 256)),
            "gemma3-1b" => gemma3((262144, 1152, 6912, 26, 4, 1, 256)),
            "qwen3-30b-a3b" => qwen3_moe((151936, 2048, 6144, 48, 32, 4, 128), 768),
            "qwen3-235b-a22b" => qwen3_moe((151936, 4096, 12288, 94, 64, 4, 128), 1536),
            "mixtral-8x7b" => mixtral_8x7b(),
            "gpt-oss-20b" => gpt_oss(24, 32),
            "gpt-oss-120b" => gpt_oss(36, 128),
            other => {
                return Err(ConfigError::UnknownPreset {
                    name: other.to_string(),
                    known: PRESETS.join(", "),
                })
            }
        })
    }
}
