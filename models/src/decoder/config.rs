//! What a decoder is: its family, shape, and each way the family departs
//! from Llama, resolved (HF's `config.json` is read and written by
//! `hf_config`); and the sizes derived from them.
//!
//! Every family is Llama with a few named differences (HF's
//! `modeling_qwen2.py`, `modeling_qwen3.py`, `modeling_mistral.py`,
//! `modeling_gemma3.py`); each difference is a field of [`ModelConfig`],
//! so the decoder reads one field where a family departs from Llama.

use crate::ConfigError;

/// The model families hlo-train runs, by HF architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `LlamaForCausalLM` (Llama 3.x).
    Llama,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): biases on q/k/v.
    Qwen2,
    /// `Qwen3ForCausalLM` (dense Qwen3): per-head q/k RMSNorm.
    Qwen3,
    /// `MistralForCausalLM`: sliding-window attention.
    Mistral,
    /// `Gemma3ForCausalLM` (Gemma 3 text): local/global layers, (1 + w)
    /// norms, GELU-tanh, scaled embeddings, sandwich norms.
    Gemma3,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention, mixture-of-experts MLPs.
    Qwen3Moe,
    /// `MixtralForCausalLM`: Mistral's attention, mixture-of-experts MLPs.
    Mixtral,
    /// `Qwen2MoeForCausalLM` (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's
    /// attention, mixture-of-experts MLPs with a shared expert behind a
    /// sigmoid gate.
    Qwen2Moe,
    /// `Glm4MoeForCausalLM` (GLM-4.5, GLM-4.6): attention with partial
    /// rotary and optional q/k norms; sigmoid-routed experts (a selection
    /// bias, groups) with shared experts, the first layers dense.
    Glm4Moe,
    /// `DeepseekV3ForCausalLM` (DeepSeek-V3, R1; Kimi K2): multi-head
    /// latent attention, GLM-4.5's routing and shared experts.
    DeepseekV3,
    /// `GptOssForCausalLM`: biased attention with sinks, alternating
    /// sliding layers, yarn rotary, experts with biases and a clamped
    /// SwiGLU.
    GptOss,
}

/// Every family, in the order errors list them.
pub const FAMILIES: [Family; 11] = [
    Family::Llama,
    Family::Qwen2,
    Family::Qwen3,
    Family::Mistral,
    Family::Gemma3,
    Family::Qwen3Moe,
    Family::Mixtral,
    Family::Qwen2Moe,
    Family::Glm4Moe,
    Family::DeepseekV3,
    Family::GptOss,
];

impl Family {
    /// HF's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mistral => "mistral",
            Family::Gemma3 => "gemma3_text",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Mixtral => "mixtral",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Glm4Moe => "glm4_moe",
            Family::DeepseekV3 => "deepseek_v3",
            Family::GptOss => "gpt_oss",
        }
    }

    /// HF's architecture (the class in `architectures`).
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen2Moe => "Qwen2MoeForCausalLM",
            Family::Glm4Moe => "Glm4MoeForCausalLM",
            Family::DeepseekV3 => "DeepseekV3ForCausalLM",
            Family::GptOss => "GptOssForCausalLM",
        }
    }

    /// Whether transformers has a sequence-classification class of it
    /// (GLM-4.5 has none).
    pub fn has_classifier(self) -> bool {
        self != Family::Glm4Moe
    }

    /// Its sequence-classification class, as transformers names it.
    pub(crate) fn classifier_architecture(self) -> String {
        match self {
            Family::Gemma3 => "Gemma3TextForSequenceClassification".into(),
            f => f
                .architecture()
                .replace("ForCausalLM", "ForSequenceClassification"),
        }
    }

    pub(super) fn from_model_type(t: &str) -> Option<Family> {
        // Kimi K2 is DeepSeek-V3's architecture under its own name.
        let t = if t == "kimi_k2" { "deepseek_v3" } else { t };
        FAMILIES.into_iter().find(|f| f.model_type() == t)
    }

    pub(super) fn from_architecture(a: &str) -> Option<Family> {
        FAMILIES.into_iter().find(|f| f.architecture() == a)
    }
}
/// `rope_type` `llama3` (Llama 3.1+).
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// `rope_type` `yarn` (YaRN; gpt-oss, long-context Qwen3): frequencies
/// blended between interpolated (`/ factor`) and kept along a ramp over
/// the dimensions between `beta_fast` and `beta_slow` rotations, and
/// `cos`/`sin` multiplied by `attention_factor`.
#[derive(Clone, Debug, PartialEq)]
pub struct YarnScaling {
    pub factor: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub original_max_position_embeddings: f64,
    /// The correction range is floored/ceiled to whole dimensions.
    pub truncate: bool,
    /// HF's `attention_factor`; absent, `0.1 ln(factor) + 1`.
    pub attention_factor: f64,
    /// DeepSeek-V3's `mscale_all_dim` (0: none): its attention scores are
    /// scaled by `yarn_mscale(factor, mscale_all_dim)²` more.
    pub mscale_all_dim: f64,
}

/// How rotary frequencies are rescaled for longer contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `rope_type` `linear`: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// `rope_type` `llama3`.
    Llama3(Llama3Scaling),
    /// `rope_type` `yarn`.
    Yarn(YarnScaling),
}

/// A rotary embedding: its base and scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
    /// The share of each head's dimensions it rotates, the first ones
    /// (GLM-4.5's `partial_rotary_factor`, 0.5); the rest pass unrotated.
    pub partial_rotary_factor: f64,
}

/// Multi-head latent attention (DeepSeek-V3's `DeepseekV3Attention`):
/// queries through a low-rank bottleneck (`q_a_proj`, `q_a_layernorm`,
/// `q_b_proj`; `q_proj` without one), keys and values from one shared
/// latent (`kv_a_proj_with_mqa` gives the latent and one rotary key head
/// shared by all heads; `kv_a_layernorm`; `kv_b_proj` expands the latent
/// into each head's unrotated key and value). A query or key head is its
/// `qk_nope_head_dim` unrotated dimensions then its `qk_rope_head_dim`
/// rotary ones (the model's `head_dim` is their sum); a value head has
/// `v_head_dim`, padded with zeros to `head_dim` inside the attention so
/// that every attention form and the KV cache hold one width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaConfig {
    pub q_lora_rank: Option<i64>,
    pub kv_lora_rank: i64,
    pub qk_nope_head_dim: i64,
    pub qk_rope_head_dim: i64,
    pub v_head_dim: i64,
    /// The rotary dimensions come in interleaved pairs (`rope_interleave`:
    /// `(x0, x1), (x2, x3), ...`), each turned by one frequency; they are
    /// laid out de-interleaved (evens, then odds) before turning, as HF
    /// does.
    pub rope_interleave: bool,
}

impl Rope {
    pub fn new(theta: f64) -> Rope {
        Rope {
            theta,
            scaling: None,
            partial_rotary_factor: 1.0,
        }
    }
}

/// Which keys a layer's queries see.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerType {
    /// Every earlier position (HF's `full_attention`).
    Full,
    /// The last `sliding_window` positions, itself included (HF's
    /// `sliding_attention`).
    Sliding,
}

impl LayerType {
    /// `layers` layers sliding but every `period`-th, which attends fully
    /// (Gemma 3: 6; gpt-oss: 2), as the config classes lay them out.
    pub fn pattern(layers: i64, period: i64) -> Vec<LayerType> {
        (0..layers)
            .map(|i| {
                if (i + 1) % period != 0 {
                    LayerType::Sliding
                } else {
                    LayerType::Full
                }
            })
            .collect()
    }

    /// HF's spelling in `layer_types`.
    pub fn name(self) -> &'static str {
        match self {
            LayerType::Full => "full_attention",
            LayerType::Sliding => "sliding_attention",
        }
    }
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu` (SwiGLU).
    Silu,
    /// `gelu_pytorch_tanh` (GeGLU with the tanh approximation).
    GeluTanh,
}

/// What a family's experts are (the router, the expert tensors' layout
/// and the activation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertStyle {
    /// Qwen3-MoE, Mixtral: the router `mlp.gate` (no bias) takes the top-k
    /// of the softmax of its logits; experts `[experts, out, in]` as
    /// `nn.Linear` holds them, `gate_up_proj` with the gate rows first,
    /// no biases; SwiGLU.
    SwiGlu,
    /// gpt-oss: the router `mlp.router` (with a bias) takes the top-k of
    /// its logits and softmaxes those k; experts stored transposed
    /// (`[experts, in, out]`, used as `x · W`), `gate_up_proj`'s columns
    /// interleaved (gate even, up odd), each with a bias
    /// (`gate_up_proj_bias`, `down_proj_bias`); the activation
    /// `(clamp(up, ±limit) + 1) · g · σ(alpha · g)` with `g = min(gate,
    /// limit)`.
    GptOss {
        swiglu_alpha: f64,
        swiglu_limit: f64,
    },
}

/// How an RMSNorm applies its weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormStyle {
    /// `w · x̂`, normalised in f32 and multiplied in the input dtype
    /// (`LlamaRMSNorm`; weights start at 1).
    Llama,
    /// `(1 + w) · x̂`, all in f32, then cast (`Gemma3RMSNorm`; weights
    /// start at 0).
    Gemma,
    /// `w · x̂`, all in f32, then cast (`GptOssRMSNorm`, whose weights
    /// transformers keeps in f32).
    F32,
}

/// A mixture-of-experts MLP (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`,
/// Mixtral's `MixtralSparseMoeBlock`): a router (`mlp.gate`, `[experts,
/// hidden]`) picks each token's top-k experts from the softmax of its
/// logits; each expert is a SwiGLU MLP, stored fused as transformers 5
/// holds it (`mlp.experts.gate_up_proj` `[experts, 2·moe_intermediate,
/// hidden]`, gate rows first, and `mlp.experts.down_proj` `[experts,
/// hidden, moe_intermediate]`).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: i64,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: i64,
    pub moe_intermediate_size: i64,
    /// The top-k probabilities are divided by their sum (Qwen3-MoE's
    /// `norm_topk_prob`; Mixtral always).
    pub norm_topk_prob: bool,
    /// Which layers are sparse (Qwen3-MoE's `decoder_sparse_step` and
    /// `mlp_only_layers`); the others have the dense MLP of
    /// `intermediate_size`.
    pub sparse_layers: Vec<bool>,
    /// Training adds `router_aux_loss_coef` times HF's load-balancing
    /// loss (`output_router_logits`).
    pub output_router_logits: bool,
    pub router_aux_loss_coef: f64,
    /// Mixtral keeps the routing weights in f32 and rounds each expert's
    /// weighted output; Qwen3-MoE rounds the weights to the model's dtype
    /// first.
    pub f32_routing_weights: bool,
    pub style: ExpertStyle,
    /// An expert every token goes through beside its routed ones
    /// (Qwen2-MoE's `mlp.shared_expert`, DeepSeek-V3's and GLM-4.5's
    /// `mlp.shared_experts`).
    pub shared_expert: Option<SharedExpert>,
    /// How the router scores and picks the experts.
    pub routing: Routing,
}

/// How a router scores the experts and weighs the chosen ones.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// The softmax of the router's logits over every expert, its top k
    /// (Qwen-MoE, Mixtral; gpt-oss's departs in [`ExpertStyle::GptOss`]).
    Softmax,
    /// DeepSeek-V3's and GLM-4.5's (`DeepseekV3TopkRouter`): in f32, the
    /// sigmoid of each logit is the expert's score; the experts are chosen
    /// on the scores plus `mlp.gate.e_score_correction_bias` (a buffer,
    /// never trained), only among the `topk_group` of `n_group` equal
    /// groups whose two best biased scores sum highest; the chosen
    /// experts' unbiased scores, renormalised with `norm_topk_prob`, times
    /// `routed_scaling_factor`, weigh their outputs (in f32).
    Sigmoid {
        n_group: i64,
        topk_group: i64,
        routed_scaling_factor: f64,
    },
}

/// A dense SwiGLU MLP in a sparse layer that every token goes through,
/// its output added to the routed experts' (Qwen2-MoE's
/// `Qwen2MoeSparseMoeBlock.shared_expert`; DeepSeek-V3's and GLM-4.5's
/// `shared_experts`, `n_shared_experts` experts' width as one MLP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExpert {
    /// Its MLP's width (Qwen2-MoE's `shared_expert_intermediate_size`;
    /// `moe_intermediate_size · n_shared_experts`).
    pub intermediate_size: i64,
    /// Its output is scaled by `σ(shared_expert_gate(x))`, a linear map
    /// of the hidden state to one logit per token (Qwen2-MoE).
    pub gated: bool,
}

impl SharedExpert {
    /// Its gate's module under the layer's `mlp` (`[1, hidden]`).
    pub const GATE: &'static str = "shared_expert_gate";

    /// Its module under the layer's `mlp`: Qwen2-MoE's gated
    /// `shared_expert`, the others' `shared_experts`.
    pub fn module(self) -> &'static str {
        match self.gated {
            true => "shared_expert",
            false => "shared_experts",
        }
    }
}

impl MoeConfig {
    /// The router's module name under `mlp` (`gate`; gpt-oss: `router`).
    pub fn router(&self) -> &'static str {
        match self.style {
            ExpertStyle::SwiGlu => "gate",
            ExpertStyle::GptOss { .. } => "router",
        }
    }

    /// Whether the expert tensors are `[experts, in, out]` (used as `x ·
    /// W`), not `[experts, out, in]`.
    pub fn transposed(&self) -> bool {
        matches!(self.style, ExpertStyle::GptOss { .. })
    }

    /// Whether the experts (and the router) carry biases.
    pub fn biased(&self) -> bool {
        self.transposed()
    }

    /// `(experts, in, out)` of a fused expert tensor of shape `dims`.
    pub(crate) fn expert_dims(&self, dims: &[i64]) -> (i64, i64, i64) {
        if self.transposed() {
            (dims[0], dims[1], dims[2])
        } else {
            (dims[0], dims[2], dims[1])
        }
    }
}

/// One linear projection of a layer: see [`ModelConfig::layer_projections`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Projection {
    /// Its module path (`model.layers.3.mlp.shared_expert.up_proj`).
    pub module: String,
    /// Its name as LoRA's `target_modules` lists it (`up_proj`).
    pub short: &'static str,
    /// `(in, out)` features.
    pub dims: (i64, i64),
}

/// A sigmoid router's selection bias under a sparse layer (a buffer: read
/// from checkpoints, never trained).
pub const E_SCORE_CORRECTION_BIAS: &str = "mlp.gate.e_score_correction_bias";

/// Whether base parameter `name` is a buffer (a sigmoid router's
/// selection bias): read and saved, never trained, not even by full
/// finetuning.
pub fn is_buffer(name: &str) -> bool {
    name.ends_with("e_score_correction_bias")
}

/// A sequence-classification head's weight, `[num_labels, hidden]`.
pub const SCORE: &str = "score.weight";

/// What a decoder's last hidden states feed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Head {
    /// The LM head (`lm_head`, or the embeddings when tied): next-token
    /// logits at every position.
    #[default]
    CausalLm,
    /// `score` (`[num_labels, hidden]`, no bias) at one position a row:
    /// the rightmost token that is not `pad_token_id` (the last position
    /// without one), as transformers' `GenericForSequenceClassification`.
    SequenceClassification {
        num_labels: i64,
        pad_token_id: Option<i64>,
    },
}

/// A decoder's shape and its family's differences from Llama, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    /// The rotary embedding of full-attention layers (of every layer
    /// unless `sliding_rope` is set).
    pub rope: Rope,
    /// Gemma 3: the sliding layers' own rotary embedding
    /// (`rope_local_base_freq`).
    pub sliding_rope: Option<Rope>,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    /// What the decoder's last hidden states feed: the LM head, or a
    /// sequence-classification head (`<Family>ForSequenceClassification`).
    pub head: Head,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    /// Standard deviation of random initial weights (HF's `initializer_range`).
    pub initializer_range: f64,
    /// Qwen2, gpt-oss: the q/k/v projections carry biases.
    pub qkv_bias: bool,
    /// gpt-oss: `o_proj` carries a bias too (`attention_bias`).
    pub o_bias: bool,
    /// gpt-oss: each query head has a learned logit (`self_attn.sinks`
    /// `[heads]`) that joins its softmax as one more key with no value,
    /// so the weights over the real keys sum to less than 1.
    pub attention_sinks: bool,
    /// Qwen3, Gemma 3: an RMSNorm over each head's queries and keys
    /// (`self_attn.q_norm`, `self_attn.k_norm`) before RoPE.
    pub qk_norm: bool,
    /// Each layer's attention (Gemma 3 alternates; Mistral's are all
    /// sliding when it has a window).
    pub layer_types: Vec<LayerType>,
    /// How many positions a sliding layer's query sees, itself included.
    pub sliding_window: Option<i64>,
    pub hidden_act: Activation,
    pub norm_style: NormStyle,
    /// Gemma 3: embeddings are multiplied by √hidden_size.
    pub scale_embeddings: bool,
    /// Gemma 3: the attention and MLP outputs are normalised too
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`) and the
    /// MLP's input by `pre_feedforward_layernorm`.
    pub sandwich_norms: bool,
    /// Gemma 3: scores are scaled by `query_pre_attn_scalar^-0.5`
    /// instead of `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f64>,
    /// Logits become `c·tanh(logits / c)`.
    pub final_logit_softcapping: Option<f64>,
    /// The base projections in NF4 (QLoRA), dequantized just before each
    /// matmul; None: in the compute dtype.
    pub quantization: Option<crate::nf4::Nf4Config>,
    /// Qwen3-MoE, Mixtral, gpt-oss: the experts of the sparse layers.
    pub moe: Option<MoeConfig>,
    /// DeepSeek-V3: multi-head latent attention in place of q/k/v_proj.
    pub mla: Option<MlaConfig>,
}

impl ModelConfig {
    /// Refuses a length of `len` tokens, given as `what` (a flag:
    /// `--seq`), beyond the model's positions (`max_position_embeddings`):
    /// the one check of every command that bounds a length by them.
    ///
    /// ```
    /// let c = hlo_models::decoder::ModelConfig::preset("tiny").unwrap();
    /// assert!(c.check_positions("--seq", c.max_position_embeddings).is_ok());
    /// let e = c.check_positions("--seq", c.max_position_embeddings + 1).unwrap_err();
    /// assert!(e.to_string().starts_with("--seq "), "{e}");
    /// ```
    pub fn check_positions(&self, what: &str, len: i64) -> Result<(), crate::ModelError> {
        match len > self.max_position_embeddings {
            true => Err(crate::ModelError::BeyondPositions {
                what: what.to_string(),
                len,
                positions: self.max_position_embeddings,
            }),
            false => Ok(()),
        }
    }

    /// Whether base parameter `name` is held in f32 whatever the run's
    /// dtype: a sigmoid router's weight and selection bias, which
    /// transformers keeps so (`_keep_in_fp32_modules_strict`) and routes
    /// with in f32.
    pub fn kept_in_f32(&self, name: &str) -> bool {
        let sigmoid = self
            .moe
            .as_ref()
            .is_some_and(|m| matches!(m.routing, Routing::Sigmoid { .. }));
        sigmoid && (name.ends_with("mlp.gate.weight") || is_buffer(name))
    }

    /// Whether layer `l`'s MLP is a mixture of experts.
    pub(crate) fn is_sparse(&self, l: i64) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| m.sparse_layers.get(l as usize) == Some(&true))
    }

    /// Whether some layers are sparse and others dense, so a scan over
    /// layers (one body for all) cannot run them.
    pub fn mixed_mlps(&self) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| m.sparse_layers.windows(2).any(|w| w[0] != w[1]))
    }

    /// Whether layers differ in their attention (Gemma 3's local and
    /// global layers), so a scan over layers must be told which is which.
    pub fn mixed_layer_types(&self) -> bool {
        self.layer_types.windows(2).any(|w| w[0] != w[1])
    }

    /// The window a layer of `kind` attends through (None: all earlier positions).
    pub(crate) fn window_of(&self, kind: LayerType) -> Option<i64> {
        match kind {
            LayerType::Full => None,
            LayerType::Sliding => self.sliding_window,
        }
    }

    /// The scale of attention scores: `query_pre_attn_scalar^-0.5` (Gemma
    /// 3), else `head_dim^-0.5`.
    pub(crate) fn attention_scale(&self) -> f64 {
        let scale = self
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim as f64)
            .powf(-0.5);
        // DeepSeek-V3's yarn: times mscale(factor, mscale_all_dim)².
        match (&self.mla, &self.rope.scaling) {
            (Some(_), Some(RopeScaling::Yarn(y))) if y.mscale_all_dim != 0.0 => {
                let m = yarn_mscale(y.factor, y.mscale_all_dim);
                scale * m * m
            }
            _ => scale,
        }
    }

    /// Every base parameter: (HF name, shape), in checkpoint order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<i64>)> {
        let h = self.hidden_size;
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, h],
        )];
        for l in 0..self.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mut push = |name: &str, shape: Vec<i64>| out.push((format!("{p}.{name}"), shape));
            push("input_layernorm.weight", vec![h]);
            for (name, shape) in self.attention_shapes() {
                push(&format!("self_attn.{name}"), shape);
            }
            push("post_attention_layernorm.weight", vec![h]);
            if self.sandwich_norms {
                push("pre_feedforward_layernorm.weight", vec![h]);
                push("post_feedforward_layernorm.weight", vec![h]);
            }
            for (name, shape) in self.mlp_shapes(l) {
                push(&format!("mlp.{name}"), shape);
            }
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        match self.head {
            Head::SequenceClassification { num_labels, .. } => {
                out.push((SCORE.to_string(), vec![num_labels, h]));
            }
            Head::CausalLm if !self.tie_word_embeddings => {
                out.push(("lm_head.weight".to_string(), vec![self.vocab_size, h]));
            }
            Head::CausalLm => {}
        }
        out
    }

    /// A layer's attention parameters under `self_attn`, in checkpoint
    /// order.
    fn attention_shapes(&self) -> Vec<(String, Vec<i64>)> {
        if let Some(m) = &self.mla {
            return self.latent_attention_shapes(m);
        }
        let (h, hd) = (self.hidden_size, self.head_dim);
        let (q, kv) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
        let mut out = Vec::new();
        let mut push = |name: &str, shape: Vec<i64>| out.push((name.to_string(), shape));
        push("q_proj.weight", vec![q, h]);
        push("k_proj.weight", vec![kv, h]);
        push("v_proj.weight", vec![kv, h]);
        if self.qkv_bias {
            push("q_proj.bias", vec![q]);
            push("k_proj.bias", vec![kv]);
            push("v_proj.bias", vec![kv]);
        }
        if self.qk_norm {
            push("q_norm.weight", vec![hd]);
            push("k_norm.weight", vec![hd]);
        }
        push("o_proj.weight", vec![h, q]);
        if self.o_bias {
            push("o_proj.bias", vec![h]);
        }
        if self.attention_sinks {
            push("sinks", vec![self.num_attention_heads]);
        }
        out
    }

    /// Layer `l`'s MLP parameters under `mlp`, in checkpoint order: the
    /// dense MLP's, or the router's, the experts' and the shared expert's.
    fn mlp_shapes(&self, l: i64) -> Vec<(String, Vec<i64>)> {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let mut out = Vec::new();
        let mut push = |name: &str, shape: Vec<i64>| out.push((name.to_string(), shape));
        let Some(m) = self.moe.as_ref().filter(|_| self.is_sparse(l)) else {
            push("gate_proj.weight", vec![i, h]);
            push("up_proj.weight", vec![i, h]);
            push("down_proj.weight", vec![h, i]);
            return out;
        };
        let (e, mi) = (m.num_experts, m.moe_intermediate_size);
        if m.transposed() {
            push("router.weight", vec![e, h]);
            push("router.bias", vec![e]);
            push("experts.gate_up_proj", vec![e, h, 2 * mi]);
            push("experts.gate_up_proj_bias", vec![e, 2 * mi]);
            push("experts.down_proj", vec![e, mi, h]);
            push("experts.down_proj_bias", vec![e, h]);
            return out;
        }
        push("gate.weight", vec![e, h]);
        if matches!(m.routing, Routing::Sigmoid { .. }) {
            push(E_SCORE_CORRECTION_BIAS.trim_start_matches("mlp."), vec![e]);
        }
        push("experts.gate_up_proj", vec![e, 2 * mi, h]);
        push("experts.down_proj", vec![e, h, mi]);
        if let Some(s) = m.shared_expert {
            let (si, at) = (s.intermediate_size, s.module());
            push(&format!("{at}.gate_proj.weight"), vec![si, h]);
            push(&format!("{at}.up_proj.weight"), vec![si, h]);
            push(&format!("{at}.down_proj.weight"), vec![h, si]);
            if s.gated {
                push(&format!("{}.weight", SharedExpert::GATE), vec![1, h]);
            }
        }
        out
    }

    /// A latent attention's parameters under `self_attn` (see
    /// [`MlaConfig`]), in checkpoint order.
    fn latent_attention_shapes(&self, m: &MlaConfig) -> Vec<(String, Vec<i64>)> {
        let mut out = Vec::new();
        for p in self.latent_projections(m) {
            out.push((format!("{}.weight", p.0), vec![p.2, p.1]));
            if p.0 == "q_a_proj" {
                out.push(("q_a_layernorm.weight".into(), vec![p.2]));
            }
            if p.0 == "kv_a_proj_with_mqa" {
                out.push(("kv_a_layernorm.weight".into(), vec![m.kv_lora_rank]));
            }
        }
        out
    }

    /// A latent attention's projections as (module under `self_attn`, in,
    /// out), in module order.
    fn latent_projections(&self, m: &MlaConfig) -> Vec<(&'static str, i64, i64)> {
        let (h, heads) = (self.hidden_size, self.num_attention_heads);
        let query = heads * self.head_dim;
        let mut out = match m.q_lora_rank {
            Some(r) => vec![("q_a_proj", h, r), ("q_b_proj", r, query)],
            None => vec![("q_proj", h, query)],
        };
        out.push(("kv_a_proj_with_mqa", h, m.kv_lora_rank + m.qk_rope_head_dim));
        let kv = heads * (m.qk_nope_head_dim + m.v_head_dim);
        out.push(("kv_b_proj", m.kv_lora_rank, kv));
        out.push(("o_proj", heads * m.v_head_dim, h));
        out
    }

    /// The config with a sequence-classification head of `num_labels`
    /// (`score`, no LM head) pooled at the last token that is not
    /// `pad_token_id`, as transformers' `AutoModelForSequenceClassification`
    /// builds one from a causal LM's config.
    pub fn with_score_head(mut self, num_labels: i64, pad_token_id: Option<i64>) -> ModelConfig {
        self.head = Head::SequenceClassification {
            num_labels,
            pad_token_id,
        };
        self
    }

    /// Whether the model has the LM head (it can generate).
    pub fn is_causal_lm(&self) -> bool {
        self.head == Head::CausalLm
    }

    /// This config with its base projections stored in NF4 (QLoRA).
    /// Refused when a projection's input features are not a multiple of
    /// 64, so that every block of 64 lies in one row (true of every
    /// released model).
    pub fn with_nf4(mut self, nf4: crate::nf4::Nf4Config) -> Result<ModelConfig, ConfigError> {
        self.quantization = Some(nf4);
        self.check_quantization()?;
        Ok(self)
    }

    pub(super) fn check_quantization(&self) -> Result<(), ConfigError> {
        if self.quantization.is_none() {
            return Ok(());
        }
        let quantized = self
            .parameter_shapes()
            .into_iter()
            .filter(|(name, _)| crate::nf4::is_quantized(name));
        for (name, shape) in quantized {
            let din = shape[shape.len() - 1];
            let m = name
                .trim_end_matches(".weight")
                .rsplit('.')
                .next()
                .unwrap_or(&name)
                .to_string();
            if din % crate::nf4::BLOCK_SIZE as i64 != 0 {
                return Err(ConfigError::Unsupported(format!(
                    "NF4 quantization needs each projection's input features to be a multiple of {}; {m} has {din}",
                    crate::nf4::BLOCK_SIZE
                )));
            }
        }
        Ok(())
    }

    /// The shape of base parameter `name` (HF's name), if the model has it.
    pub fn parameter_shape(&self, name: &str) -> Option<Vec<i64>> {
        self.parameter_shapes()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s)
    }

    /// How far two correct f32 evaluations of this model's forward over
    /// `seq` positions may differ in values of magnitude up to `scale`
    /// (logits, or a loss made of them), whatever order each sums in
    /// (PyTorch, XLA's CPU code at another vector width, another mesh's
    /// partial sums): what comparisons with HF's fixtures allow.
    ///
    /// A sum of K rounded terms errs by about √K·u of its terms' magnitude
    /// (u = 2⁻²⁴; the probabilistic bound of Higham and Mary, 2019:
    /// rounding errors behave as independent, so they grow with √K, not
    /// the worst case's K); normalised activations keep those magnitudes
    /// near the result's own. A token's logits pass through 6 such sums in
    /// series in each layer (the q/k/v projection, the scores, the
    /// weighted values, the output projection, the MLP's two) and one more
    /// in the LM head, each of at most K terms (the hidden size, the MLP's
    /// width, a head's dimension, the positions); both evaluations err so.
    ///
    /// ```
    /// let c = hlo_models::decoder::ModelConfig::preset("tiny").unwrap();
    /// // 2 layers, sums of at most 128 terms, logits up to 5.
    /// let bound = c.f32_forward_bound(16, 5.0);
    /// assert!((bound - 2.0 * 13.0 * 128f64.sqrt() * 2f64.powi(-24) * 5.0).abs() < 1e-12);
    /// ```
    pub fn f32_forward_bound(&self, seq: i64, scale: f64) -> f64 {
        let u = f64::from(f32::EPSILON) / 2.0;
        let widest = self
            .hidden_size
            .max(self.intermediate_size)
            .max(self.moe.as_ref().map_or(0, |m| m.moe_intermediate_size))
            .max(self.head_dim)
            .max(seq);
        let sums_in_series = 6 * self.num_hidden_layers + 1;
        2.0 * sums_in_series as f64 * (widest as f64).sqrt() * u * scale.abs().max(1.0)
    }

    /// Number of base parameters (HF's count: buffers are not).
    pub fn parameter_count(&self) -> i64 {
        self.parameter_shapes()
            .iter()
            .filter(|(n, _)| !is_buffer(n))
            .map(|(_, s)| s.iter().product::<i64>())
            .sum()
    }

    /// The parameters one token uses: all but the experts it is not routed
    /// to (the embeddings included).
    pub fn active_parameter_count(&self) -> i64 {
        let Some(m) = &self.moe else {
            return self.parameter_count();
        };
        let (h, mi) = (self.hidden_size, m.moe_intermediate_size);
        let biases = if m.biased() { 2 * mi + h } else { 0 };
        let expert = 3 * h * mi + biases;
        let sparse = (0..self.num_hidden_layers)
            .filter(|l| self.is_sparse(*l))
            .count() as i64;
        self.parameter_count() - sparse * (m.num_experts - m.top_k) * expert
    }

    /// `(in, out)` features of a projection by module name (`q_proj`, ...).
    pub fn projection_dims(&self, module: &str) -> Option<(i64, i64)> {
        if let Some(m) = &self.mla {
            let latent = self.latent_projections(m).into_iter();
            if let Some((_, din, dout)) = latent.clone().find(|p| p.0 == module) {
                return Some((din, dout));
            }
            if latent.clone().any(|p| p.0 == "q_a_proj") && module == "q_proj"
                || matches!(module, "k_proj" | "v_proj")
            {
                return None;
            }
        }
        let (h, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (q, kv) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
        Some(match module {
            "q_proj" => (h, q),
            "k_proj" | "v_proj" => (h, kv),
            "o_proj" => (q, h),
            "gate_proj" | "up_proj" => (h, i),
            "down_proj" => (i, h),
            _ => return None,
        })
    }

    /// Layer `l`'s linear projections (the modules LoRA targets by their
    /// short names), in module order: attention's q/k/v/o, then the MLP's
    /// gate/up/down (a dense layer's; a sparse layer's shared expert's,
    /// under `mlp.shared_expert`, none else: its experts are parameters,
    /// not modules).
    ///
    /// ```
    /// let c = hlo_models::decoder::ModelConfig::preset("tiny").unwrap();
    /// let p = c.layer_projections(1);
    /// assert_eq!(p[0].module, "model.layers.1.self_attn.q_proj");
    /// assert_eq!((p[6].short, p[6].dims), ("down_proj", (c.intermediate_size, c.hidden_size)));
    /// ```
    pub fn layer_projections(&self, l: i64) -> Vec<Projection> {
        let mlp = match self.moe.as_ref().filter(|_| self.is_sparse(l)) {
            None => Some(("mlp".to_string(), self.intermediate_size)),
            Some(m) => m
                .shared_expert
                .map(|s| (format!("mlp.{}", s.module()), s.intermediate_size)),
        };
        let mut out = Vec::new();
        if let Some(m) = &self.mla {
            for (short, din, dout) in self.latent_projections(m) {
                out.push(Projection {
                    module: format!("model.layers.{l}.self_attn.{short}"),
                    short,
                    dims: (din, dout),
                });
            }
        }
        for short in crate::projections::LAYER_PROJECTIONS {
            let (group, width) = match short {
                "q_proj" | "k_proj" | "v_proj" | "o_proj" if self.mla.is_some() => continue,
                "q_proj" | "k_proj" | "v_proj" | "o_proj" => ("self_attn".to_string(), 0),
                _ => match &mlp {
                    Some((at, width)) => (at.clone(), *width),
                    None => continue,
                },
            };
            let (h, dims) = (self.hidden_size, self.projection_dims(short));
            let dims = match short {
                "gate_proj" | "up_proj" => (h, width),
                "down_proj" => (width, h),
                _ => dims.expect("an attention projection"),
            };
            out.push(Projection {
                module: format!("model.layers.{l}.{group}.{short}"),
                short,
                dims,
            });
        }
        out
    }

    /// The rotary embedding of layers of `kind`.
    pub fn rope_of(&self, kind: LayerType) -> &Rope {
        match (kind, &self.sliding_rope) {
            (LayerType::Sliding, Some(r)) => r,
            _ => &self.rope,
        }
    }

    /// What `cos` and `sin` of layers of `kind` are multiplied by (HF's
    /// `attention_scaling`: yarn's attention factor, else 1).
    pub fn rope_attention_scaling(&self, kind: LayerType) -> f64 {
        match &self.rope_of(kind).scaling {
            Some(RopeScaling::Yarn(y)) => y.attention_factor,
            _ => 1.0,
        }
    }

    /// The dimensions of each query and key head that the rotary
    /// embedding turns, the first ones: `int(head_dim ·
    /// partial_rotary_factor)` as HF rounds it.
    pub fn rotary_dim(&self) -> i64 {
        match &self.mla {
            Some(m) => m.qk_rope_head_dim,
            None => (self.head_dim as f64 * self.rope.partial_rotary_factor) as i64,
        }
    }

    /// The rotary inverse frequencies of layers of `kind`, scaled as HF
    /// computes them (then rounded to f32 as HF holds them), one for each
    /// two of the [`Self::rotary_dim`] rotated dimensions.
    pub fn inv_freq(&self, kind: LayerType) -> Vec<f64> {
        let rope = self.rope_of(kind);
        let d = self.rotary_dim() as f64;
        let base: Vec<f64> = (0..self.rotary_dim() / 2)
            .map(|i| (1.0 / rope.theta.powf((2 * i) as f64 / d)) as f32 as f64)
            .collect();
        let s = match &rope.scaling {
            None => return base,
            Some(RopeScaling::Linear { factor }) => {
                return base.iter().map(|f| (f / factor) as f32 as f64).collect()
            }
            Some(RopeScaling::Yarn(y)) => return yarn_inv_freq(y, rope.theta, d),
            Some(RopeScaling::Llama3(s)) => s,
        };
        let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
        let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
        base.into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                let scaled = if wavelen > low_wavelen {
                    f / s.factor
                } else {
                    f
                };
                if wavelen < high_wavelen || wavelen > low_wavelen {
                    return scaled as f32 as f64;
                }
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                ((1.0 - smooth) * scaled / s.factor + smooth * scaled) as f32 as f64
            })
            .collect()
    }
}

/// YaRN's attention scale of a context `scale` times the original:
/// `0.1 · mscale · ln(scale) + 1` (1 when not longer).
pub(crate) fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * mscale * scale.ln() + 1.0,
    }
}

/// YaRN's inverse frequencies (transformers' `_compute_yarn_parameters`):
/// each frequency blended between itself (extrapolated) and itself over
/// `factor` (interpolated) by a ramp over the dimensions whose rotations
/// within the original context lie between `beta_fast` and `beta_slow`.
fn yarn_inv_freq(y: &YarnScaling, theta: f64, d: f64) -> Vec<f64> {
    let correction = |rotations: f64| {
        d * (y.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction(y.beta_fast), correction(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
    if low == high {
        high += 0.001;
    }
    (0..(d as i64) / 2)
        .map(|i| {
            let pos_freq = theta.powf((2 * i) as f64 / d);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            // `1 - ramp` of the extrapolated frequency, `ramp` of the interpolated.
            (ramp / (y.factor * pos_freq) + (1.0 - ramp) / pos_freq) as f32 as f64
        })
        .collect()
}
