//! The decoder in the tracing DSL, as HF transformers computes
//! `LlamaForCausalLM` and the families that differ from it in a few named
//! places (each a field of [`ModelConfig`], each marked here with the
//! family that needs it), with optional LoRA adapters as PEFT computes
//! them.
//!
//! Parameters are inputs named as in HF checkpoints
//! (`model.layers.3.self_attn.q_proj.weight`, `[out, in]` like
//! `nn.Linear`); adapters are `<module>.lora_a` (`[in, r]`) and
//! `<module>.lora_b` (`[r, out]`), transposed from PEFT's `lora_A.weight`
//! (`[r, in]`) and `lora_B.weight` (`[out, r]`) when read and written. Scope
//! names follow the module tree (`model.layers.3.self_attn.q_proj`).

use hlo_ir::ops::DotGeneral;
use hlo_ir::{checkpoint, constant, iota, scan, scope, DType, Inputs, Literal, Tensor, TensorType};

use std::cell::RefCell;

use crate::attention::{
    blockwise_attention, cudnn_attention, cudnn_supports, grouped_attention, AttentionKind,
    CudnnCase, MaskSpec,
};

use super::config::{Activation, Head, LayerType, ModelConfig, NormStyle, SharedExpert, SCORE};
use super::lora::LoraConfig;
use super::moe::{MoeKind, RouterStats};

/// What a forward pass needs besides the parameters.
pub struct Decoder<'a> {
    pub config: &'a ModelConfig,
    pub lora: Option<&'a LoraConfig>,
    /// Mesh axes the batch is split over. When set, LoRA's `x·A` is
    /// constrained to that layout: without it XLA's SPMD partitioner
    /// miscomputes `x·W + (x·A)·B` on some meshes (docs/internals.md, "Known XLA issues").
    pub batch_axes: Vec<String>,
    /// Run the layers as one scan over stacked parameters.
    pub scan_layers: bool,
    /// Recompute each layer's forward in the backward pass instead of
    /// keeping its activations (only the layer inputs are kept). A scan's
    /// gradient already works this way.
    pub remat_layers: bool,
    /// Recompute each layer's MLP in the backward pass and keep the rest
    /// (MaxText's `save_dot_except_mlp`, roughly): the MLP's activations,
    /// four of its width a token, are what a step keeps most of.
    pub remat_mlp: bool,
    /// How the forward pass computes attention (the decode and serving
    /// steps, whose queries are few, always use the naive form).
    pub attention: AttentionKind,
    /// How mixture-of-experts layers run their experts.
    pub moe: MoeKind,
    /// Each sparse layer's routing, recorded as the layers are traced (the
    /// load-balancing loss reads them).
    pub router: RefCell<Vec<RouterStats>>,
}

/// Which keys each query of a training forward pass sees, in the form its
/// attention needs: a boolean matrix broadcast into the scores along
/// `dims` (naive), described, with the block size (blockwise), or as
/// cuDNN's static sliding window (`None`: causal only).
#[derive(Clone, Copy)]
pub(super) enum Visible {
    Dense(Tensor, &'static [i64]),
    Blockwise(MaskSpec, i64),
    Cudnn(Option<i64>),
}

/// The mesh axis the decoder's heads are split over (the q/k/v
/// projections' output features, [`super::partition_rules`]): cuDNN's
/// manual region splits the heads over it where the mesh has it.
const HEAD_AXIS: &str = "mp";

/// Parameters by name: the traced inputs.
pub struct Params<'a>(pub &'a Inputs);

impl Params<'_> {
    fn names(&self) -> impl Iterator<Item = &str> {
        self.0.names().iter().map(String::as_str)
    }

    pub(super) fn get(&self, name: &str) -> Tensor {
        self.0[name]
    }

    pub(super) fn has(&self, name: &str) -> bool {
        self.0.get(name).is_some()
    }
}

/// One value per layer type: a layer of type `k` uses `of(k)`. Where the
/// types do not differ in it (one rotary embedding, no window), both are
/// the same tensor.
#[derive(Clone, Copy)]
pub(super) struct PerLayerType<T> {
    pub full: T,
    pub sliding: T,
}

impl<T: Copy> PerLayerType<T> {
    pub fn of(&self, kind: LayerType) -> T {
        match kind {
            LayerType::Full => self.full,
            LayerType::Sliding => self.sliding,
        }
    }
}

/// `x · Wᵀ (+ b)` for an `nn.Linear` weight `[out, in]`, in `x`'s dtype as
/// PyTorch's `F.linear` returns it. A bf16 product is asked for in bf16,
/// not as f32 cast down afterwards: the GEMM accumulates in f32 and rounds
/// once either way, but an f32 result makes XLA's GEMM write (and the
/// next fusion read) twice the bytes of every projection's output.
pub(super) fn linear(x: Tensor, w: Tensor, bias: Option<Tensor>) -> Tensor {
    let dtype = x.dtype();
    let y = x.dot_general(
        w.cast(dtype),
        DotGeneral {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contracting: vec![x.rank() as i64 - 1],
            rhs_contracting: vec![1],
            precision: None,
            preferred_element_type: None,
        },
    );
    match bias {
        // In the output's dtype, so that on the GPU the add can join the
        // GEMM's epilogue (as cuBLASLt adds PyTorch's bias) instead of
        // keeping the product apart.
        Some(b) => {
            let d = y.dims();
            y + b.cast(dtype).broadcast_in_dim(&d, &[d.len() as i64 - 1])
        }
        None => y,
    }
}

/// `y + delta` as PEFT's LoRA layer adds its branch to the base layer's
/// output: in the branch's dtype (a bf16 output plus the f32 branch is
/// f32 in PyTorch) and rounded once to `y`'s, not with the branch rounded
/// to bf16 first, a second rounding that on the bf16 fixture step
/// (`tests/tests/llama_bf16.rs`) makes the logits err a third more.
pub(super) fn add_lora(y: Tensor, delta: Tensor) -> Tensor {
    (y.cast(delta.dtype()) + delta).cast(y.dtype())
}

/// `x: [g, rows, k]` times `w: [g, k, n]`, batch by batch (each row of a
/// batch its own matrix), in `x`'s dtype.
pub(super) fn batched_matmul(x: Tensor, w: Tensor) -> Tensor {
    x.dot_general(
        w,
        DotGeneral {
            lhs_batch: vec![0],
            rhs_batch: vec![0],
            lhs_contracting: vec![2],
            rhs_contracting: vec![1],
            precision: None,
            preferred_element_type: None,
        },
    )
}

/// HF's RMSNorm over the last dimension: `LlamaRMSNorm` normalises in f32
/// and scales in the input dtype; `Gemma3RMSNorm` scales by `1 + w` in f32
/// and rounds once.
pub fn rms_norm(x: Tensor, weight: Tensor, eps: f64, style: NormStyle) -> Tensor {
    let dtype = x.dtype();
    let dims = x.dims();
    let last = dims.len() as i64 - 1;
    let xf = x.cast(DType::F32);
    let var = (xf * xf).mean(&[last]);
    let keep: Vec<i64> = (0..last).collect();
    let normed = xf * (var + eps).rsqrt().broadcast_in_dim(&dims, &keep);
    let along = |w: Tensor| w.broadcast_in_dim(&dims, &[last]);
    match style {
        NormStyle::Llama => along(weight.cast(dtype)) * normed.cast(dtype),
        NormStyle::Gemma => (normed * along(weight.cast(DType::F32) + 1.0)).cast(dtype),
        NormStyle::F32 => (normed * along(weight.cast(DType::F32))).cast(dtype),
    }
}

/// The rotary embedding on `y` (`[b, heads, t, head_dim]`): `y·cos +
/// rotate_half(y)·sin`, `cos` and `sin` broadcast `along` `y`'s dimensions.
/// Tables narrower than a head (GLM-4.5's partial rotary) turn its first
/// dimensions and pass the rest.
pub(super) fn apply_rotary(y: Tensor, cos: Tensor, sin: Tensor, along: &[i64]) -> Tensor {
    let mut d = y.dims();
    let (last, rotary) = (d.len() - 1, *cos.dims().last().expect("a table"));
    if rotary < d[last] {
        let start = vec![0; d.len()];
        let mut split = start.clone();
        split[last] = rotary;
        let mut upto = d.clone();
        upto[last] = rotary;
        let turned = apply_rotary(y.slice(&start, &upto), cos, sin, along);
        return Tensor::concat(&[turned, y.slice(&split, &d)], last as i64);
    }
    d[last] = rotary;
    y * cos.broadcast_in_dim(&d, along) + rotate_half(y) * sin.broadcast_in_dim(&d, along)
}

/// The first and second halves of `x`'s last dimension.
pub(super) fn halves(x: Tensor) -> (Tensor, Tensor) {
    let d = x.dims();
    let r = d.len();
    let half = d[r - 1] / 2;
    let mut mid = d.clone();
    mid[r - 1] = half;
    let zeros = vec![0; r];
    let mut start2 = zeros.clone();
    start2[r - 1] = half;
    (x.slice(&zeros, &mid), x.slice(&start2, &d))
}

/// `cat(-x2, x1)` of the two halves of the last dimension.
pub(super) fn rotate_half(x: Tensor) -> Tensor {
    let (x1, x2) = halves(x);
    Tensor::concat(&[-x2, x1], x.rank() as i64 - 1)
}

/// A module's path as PEFT names it: a scanned layer's (`layer.…`, every
/// layer alike, which the step checks) read as layer 0's.
pub(super) fn layer_path(module: &str) -> String {
    match module.strip_prefix("layer.") {
        Some(rest) => format!("model.layers.0.{rest}"),
        None => module.to_string(),
    }
}

/// The scan input that tells a scanned layer its type (1: sliding).
const LAYER_IS_SLIDING: &str = "layer_is_sliding";

impl Decoder<'_> {
    /// The frozen projection at `module` (`x·Wᵀ`, plus its bias where the
    /// family has one: Qwen2's q/k/v).
    pub(super) fn base_proj(&self, p: &Params, module: &str, short: &str, x: Tensor) -> Tensor {
        let c = self.config;
        let biased = (c.qkv_bias && matches!(short, "q_proj" | "k_proj" | "v_proj"))
            || (c.o_bias && short == "o_proj");
        let bias = biased.then(|| p.get(&format!("{module}.bias")));
        let mut w = p.get(&format!("{module}.weight"));
        if w.dtype() == DType::U8 {
            // NF4 codes: dequantized here, next to their only use, so XLA
            // fuses the dequantization into the matmul's operand.
            let absmax = p.get(&format!("{module}.weight{}", crate::nf4::ABSMAX_SUFFIX));
            w = crate::nf4::dequantize(w, absmax, x.dtype());
        }
        linear(x, w, bias)
    }

    /// A projection by module path (`model.layers.3.self_attn.q_proj`), with
    /// its LoRA branch if the module is targeted.
    pub(super) fn proj(&self, p: &Params, module: &str, short: &str, x: Tensor) -> Tensor {
        scope(short, || {
            let y = self.base_proj(p, module, short, x);
            match self.lora {
                Some(l) if l.targets(short) && p.has(&format!("{module}.lora_a")) => {
                    let (a, b) = (
                        p.get(&format!("{module}.lora_a")),
                        p.get(&format!("{module}.lora_b")),
                    );
                    // PEFT runs the branch in the adapter's dtype; never forms A·B.
                    let xa = self.rows_split(x.cast(a.dtype()).matmul(a));
                    let delta = xa.matmul(b) * l.scale_of(&layer_path(module));
                    add_lora(y, delta)
                }
                _ => y,
            }
        })
    }

    /// `x` (batch first) constrained to rows split over the batch axes:
    /// the residual stream's layout at each layer's edge. Without it,
    /// under FSDP (weights and rows split over the same axis) XLA's SPMD
    /// propagation may keep the weights split and gather the rows instead,
    /// so each device holds (and computes) every row.
    pub(super) fn rows_split(&self, x: Tensor) -> Tensor {
        if self.batch_axes.is_empty() {
            return x;
        }
        let mut dims = vec![Vec::new(); x.rank()];
        dims[0] = self.batch_axes.clone();
        x.with_sharding_constraint(dims)
    }

    /// An RMSNorm of the family's style with weight `{name}.weight`.
    pub(super) fn norm(&self, p: &Params, name: &str, x: Tensor) -> Tensor {
        let c = self.config;
        rms_norm(
            x,
            p.get(&format!("{name}.weight")),
            c.rms_norm_eps,
            c.norm_style,
        )
    }

    /// The token embeddings of `input_ids` (Gemma 3: times √hidden_size,
    /// rounded to `dtype` as HF holds it).
    pub(super) fn embed(&self, p: &Params, input_ids: Tensor, dtype: DType) -> Tensor {
        scope("model.embed_tokens", || {
            let h = p
                .get("model.embed_tokens.weight")
                .cast(dtype)
                .take(input_ids, 0);
            if self.config.scale_embeddings {
                h * (self.config.hidden_size as f64).sqrt()
            } else {
                h
            }
        })
    }

    /// `cos`/`sin` of the rotary angles at `positions` (`[b, t]` integers,
    /// or `[t]`), `[.., head_dim]`, for each layer type's rotary embedding
    /// (Gemma 3's local layers have their own base).
    pub(super) fn rotary_at(
        &self,
        positions: Tensor,
        dtype: DType,
    ) -> PerLayerType<(Tensor, Tensor)> {
        let c = self.config;
        let tables = |kind: LayerType| {
            let mut dims = positions.dims();
            let half = c.rotary_dim() / 2;
            let inv = constant(Literal::from_f64s(
                TensorType::new(DType::F32, [half]),
                &c.inv_freq(kind),
            ));
            let rank = dims.len() as i64;
            dims.push(half);
            let keep: Vec<i64> = (0..rank).collect();
            let angles = positions.cast(DType::F32).broadcast_in_dim(&dims, &keep)
                * inv.broadcast_in_dim(&dims, &[rank]);
            let emb = Tensor::concat(&[angles, angles], rank);
            // Yarn scales both (HF's `attention_scaling`), in f32.
            let scaling = c.rope_attention_scaling(kind);
            let (cos, sin) = if scaling == 1.0 {
                (emb.cos(), emb.sin())
            } else {
                (emb.cos() * scaling, emb.sin() * scaling)
            };
            (cos.cast(dtype), sin.cast(dtype))
        };
        let full = tables(LayerType::Full);
        PerLayerType {
            full,
            sliding: if c.sliding_rope.is_some() {
                tables(LayerType::Sliding)
            } else {
                full
            },
        }
    }

    /// Which keys each query sees in each layer type: `causal` (boolean)
    /// for full attention, and for sliding layers also `keys > queries −
    /// window` (HF's `sliding_window_overlay`); `keys` and `queries` are
    /// the key and query positions, shaped as `causal`.
    pub(super) fn visibility(
        &self,
        causal: Tensor,
        keys: Tensor,
        queries: Tensor,
    ) -> PerLayerType<Tensor> {
        // (A config has a window only when some layer slides.)
        let sliding = match self.config.sliding_window {
            Some(w) => causal.and(keys.gt(queries - w as f64)),
            None => causal,
        };
        PerLayerType {
            full: causal,
            sliding,
        }
    }

    /// [`grouped_attention`] with the family's score scale, and the
    /// attention sinks of the layer at `attn` (`model.layers.3.self_attn`)
    /// where the family has them.
    pub(super) fn attend(
        &self,
        p: &Params,
        attn: &str,
        qkv: (Tensor, Tensor, Tensor),
        visible: (Tensor, &[i64]),
    ) -> Tensor {
        grouped_attention(
            qkv,
            visible,
            self.config.attention_scale(),
            self.sinks(p, attn),
        )
    }

    /// gpt-oss's per-head sink logits of the layer at `attn`.
    pub(super) fn sinks(&self, p: &Params, attn: &str) -> Option<Tensor> {
        self.config
            .attention_sinks
            .then(|| p.get(&format!("{attn}.sinks")))
    }

    /// The projected query, key and value heads of `x: [b, t, hidden]`,
    /// `[b, heads, t, head_dim]`, with `rope` applied to queries and keys
    /// (Qwen3, Gemma 3: after each head's RMSNorm), `proj(module, short,
    /// x)` as each projection.
    pub(super) fn qkv_with(
        &self,
        p: &Params,
        prefix: &str,
        x: Tensor,
        rope: impl Fn(Tensor) -> Tensor,
        proj: &dyn Fn(&str, &str, Tensor) -> Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let c = self.config;
        if let Some(m) = c.mla {
            return self.latent_qkv(p, prefix, x, m, &rope, proj);
        }
        let dims = x.dims();
        let (b, t) = (dims[0], dims[1]);
        let heads = |short: &str, n: i64| {
            let y = proj(&format!("{prefix}.{short}"), short, x).reshape(&[b, t, n, c.head_dim]);
            let y = match short {
                "q_proj" | "k_proj" if c.qk_norm => {
                    let norm = if short == "q_proj" {
                        "q_norm"
                    } else {
                        "k_norm"
                    };
                    scope(norm, || self.norm(p, &format!("{prefix}.{norm}"), y))
                }
                _ => y,
            };
            y.transpose(&[0, 2, 1, 3])
        };
        let q = heads("q_proj", c.num_attention_heads);
        let k = heads("k_proj", c.num_key_value_heads);
        let v = heads("v_proj", c.num_key_value_heads);
        (rope(q), rope(k), v)
    }

    /// Causal grouped-query attention of `x: [b, s, hidden]`; `cos`/`sin`
    /// are `[s, head_dim]`, or `[b, s, head_dim]` for packed rows, and
    /// `visible` says which keys each query sees.
    fn attention(
        &self,
        p: &Params,
        prefix: &str,
        x: Tensor,
        (cos, sin): (Tensor, Tensor),
        visible: Visible,
    ) -> Tensor {
        let along: &[i64] = if cos.rank() == 3 { &[0, 2, 3] } else { &[2, 3] };
        let proj = |m: &str, short: &str, x: Tensor| self.proj(p, m, short, x);
        let qkv = self.qkv_with(p, prefix, x, |y| apply_rotary(y, cos, sin, along), &proj);
        let out = match visible {
            Visible::Blockwise(mask, block) => blockwise_attention(
                qkv,
                mask,
                self.config.attention_scale(),
                block,
                self.sinks(p, prefix),
            ),
            Visible::Dense(m, dims) => self.attend(p, prefix, qkv, (m, dims)),
            Visible::Cudnn(window) => cudnn_attention(
                qkv,
                window,
                self.config.attention_scale(),
                (&self.batch_axes, &[HEAD_AXIS.to_string()]),
            ),
        };
        let out = self.attention_output(out);
        self.proj(p, &format!("{prefix}.o_proj"), "o_proj", out)
    }

    /// The gated MLP: `down(act(gate(x)) · up(x))`, SiLU (SwiGLU) or
    /// Gemma 3's tanh-approximated GELU, `proj(module, short, x)` as each
    /// projection; a mixture of experts where the layer has a router
    /// (`{prefix}.gate.weight`), plus its shared expert where it has one.
    pub(super) fn mlp_with(
        &self,
        p: &Params,
        prefix: &str,
        x: Tensor,
        proj: &dyn Fn(&str, &str, Tensor) -> Tensor,
    ) -> Tensor {
        if !(p.has(&format!("{prefix}.gate.weight")) || p.has(&format!("{prefix}.router.weight"))) {
            return self.dense_mlp(prefix, x, proj);
        }
        let routed = self.sparse_mlp(p, prefix, x);
        let shared = self.config.moe.as_ref().and_then(|m| m.shared_expert);
        let Some(shared) = shared else {
            return routed;
        };
        let at = format!("{prefix}.{}", shared.module());
        let mut y = scope(shared.module(), || self.dense_mlp(&at, x, proj));
        if shared.gated {
            // Qwen2-MoE: σ(one logit a token) in the model's dtype.
            let gate = scope(SharedExpert::GATE, || {
                let at = format!("{prefix}.{}", SharedExpert::GATE);
                self.base_proj(p, &at, SharedExpert::GATE, x).logistic()
            });
            let d = y.dims();
            let keep: Vec<i64> = (0..d.len() as i64).collect();
            y = gate.broadcast_in_dim(&d, &keep) * y;
        }
        routed + y
    }

    /// The MLP at `prefix` (`model.layers.3.mlp`) on `x: [.., hidden]`:
    /// dense, or its experts and shared expert (see [`Self::mlp_with`]),
    /// each projection with its LoRA branch where targeted.
    pub fn mlp(&self, p: &Params, prefix: &str, x: Tensor) -> Tensor {
        self.mlp_with(p, prefix, x, &|m, short, x| self.proj(p, m, short, x))
    }

    /// The dense gated MLP at `prefix` (its `gate_proj`, `up_proj`,
    /// `down_proj`).
    fn dense_mlp(
        &self,
        prefix: &str,
        x: Tensor,
        proj: &dyn Fn(&str, &str, Tensor) -> Tensor,
    ) -> Tensor {
        let gate = proj(&format!("{prefix}.gate_proj"), "gate_proj", x);
        let up = proj(&format!("{prefix}.up_proj"), "up_proj", x);
        let act = match self.config.hidden_act {
            Activation::Silu => gate * gate.logistic(),
            Activation::GeluTanh => {
                // PyTorch evaluates it in f32 and rounds once.
                let g = gate.cast(DType::F32);
                let inner = (g + g * g * g * 0.044715) * (2.0 / std::f64::consts::PI).sqrt();
                (g * 0.5 * ((inner.tanh()) + 1.0)).cast(gate.dtype())
            }
        };
        proj(&format!("{prefix}.down_proj"), "down_proj", act * up)
    }

    /// A decoder layer around an attention block `attention(x)` and an MLP
    /// block `mlp(x)`: the norms and residuals. Llama normalises each
    /// block's input (`input_layernorm`, `post_attention_layernorm`);
    /// Gemma 3 also each block's output ("sandwich" norms:
    /// `post_attention_layernorm` on the attention's output,
    /// `pre_feedforward_layernorm` and `post_feedforward_layernorm` around
    /// the MLP).
    pub(super) fn layer_with_mlp(
        &self,
        p: &Params,
        prefix: &str,
        h: Tensor,
        attention: impl FnOnce(Tensor) -> Tensor,
        mlp: impl FnOnce(Tensor) -> Tensor,
    ) -> Tensor {
        let norm =
            |name: &str, x: Tensor| scope(name, || self.norm(p, &format!("{prefix}.{name}"), x));
        let x = norm("input_layernorm", h);
        let a = scope("self_attn", || attention(x));
        let mlp = |x: Tensor| {
            if self.remat_mlp {
                checkpoint("mlp", || mlp(x))
            } else {
                scope("mlp", || mlp(x))
            }
        };
        if self.config.sandwich_norms {
            let h = h + norm("post_attention_layernorm", a);
            let x = norm("pre_feedforward_layernorm", h);
            h + norm("post_feedforward_layernorm", mlp(x))
        } else {
            let h = h + a;
            let x = norm("post_attention_layernorm", h);
            h + mlp(x)
        }
    }

    /// One decoder layer of the training forward pass on `h`; its
    /// parameters are `{prefix}.<name>` in `p`.
    fn layer(
        &self,
        p: &Params,
        prefix: &str,
        h: Tensor,
        rotary: (Tensor, Tensor),
        visible: Visible,
    ) -> Tensor {
        let proj = |m: &str, short: &str, x: Tensor| self.proj(p, m, short, x);
        self.layer_with_mlp(
            p,
            prefix,
            h,
            |x| self.attention(p, &format!("{prefix}.self_attn"), x, rotary, visible),
            |x| self.mlp_with(p, &format!("{prefix}.mlp"), x, &proj),
        )
    }

    /// Logits `[b, s, vocab]` for `input_ids: [b, s]` (integers). With
    /// `scan_layers`, the layers' parameters are stacked
    /// (`model.layers.self_attn.q_proj.weight` `[layers, out, in]`) and the
    /// layers run as one scan, so the program does not grow with depth.
    pub fn forward(&self, p: &Params, input_ids: Tensor, dtype: DType) -> Tensor {
        self.lm_head(p, self.last_hidden(p, input_ids, None, dtype))
    }

    /// [`Decoder::forward`] over packed rows: several samples per row, told
    /// apart by `segment_ids: [b, s]`; a token attends only to earlier
    /// tokens of its own segment, and `positions: [b, s]` (restarting at 0
    /// in each segment) place it for the rotary embedding, so each sample
    /// sees exactly what it would alone.
    pub fn forward_packed(
        &self,
        p: &Params,
        input_ids: Tensor,
        positions: Tensor,
        segment_ids: Tensor,
        dtype: DType,
    ) -> Tensor {
        let packed = Some((positions, segment_ids));
        self.lm_head(p, self.last_hidden(p, input_ids, packed, dtype))
    }

    /// The final norm's output `[b, s, hidden]`: what the LM head reads
    /// (the loss may apply it a chunk at a time). `packed` is
    /// `(positions, segment_ids)` as [`Decoder::forward_packed`] takes them.
    pub fn last_hidden(
        &self,
        p: &Params,
        input_ids: Tensor,
        packed: Option<(Tensor, Tensor)>,
        dtype: DType,
    ) -> Tensor {
        let c = self.config;
        let (b, s) = (input_ids.dims()[0], input_ids.dims()[1]);
        let mut h = self.embed(p, input_ids, dtype);
        let rotary = scope("model.rotary_emb", || match packed {
            None => self.rotary_at(iota(TensorType::new(DType::I32, [s]), 0), dtype),
            Some((positions, _)) => self.rotary_at(positions, dtype),
        });
        // Which keys each query sees (HF builds these masks before the
        // layers): earlier tokens, of its own sample when rows are packed,
        // and within the window in sliding layers.
        let visible = scope("model.causal_mask", || {
            self.masks(b, s, packed.map(|(_, segments)| segments), dtype)
        });
        if self.scan_layers {
            h = self.scanned_layers(p, h, rotary, visible, s);
        } else {
            for l in 0..c.num_hidden_layers {
                let prefix = format!("model.layers.{l}");
                let kind = c.layer_types[l as usize];
                let (rotary, visible) = (rotary.of(kind), visible.of(kind));
                let layer = || self.layer(p, &prefix, h, rotary, visible);
                h = self.rows_split(if self.remat_layers {
                    checkpoint(&prefix, layer)
                } else {
                    scope(&prefix, layer)
                });
            }
        }
        scope("model.norm", || self.norm(p, "model.norm", h))
    }

    /// The layers as one scan over their stacked parameters, from `h`
    /// (rows of `s` tokens): [`Decoder::last_hidden`] with `scan_layers`.
    fn scanned_layers(
        &self,
        p: &Params,
        h: Tensor,
        rotary: PerLayerType<(Tensor, Tensor)>,
        visible: PerLayerType<Visible>,
        s: i64,
    ) -> Tensor {
        let c = self.config;
        let stacked: Vec<String> = p
            .names()
            .filter(|n| is_stacked(n))
            .map(str::to_string)
            .collect();
        let mut xs: Vec<(String, Tensor)> = stacked
            .iter()
            .map(|n| (format!("layer.{}", &n["model.layers.".len()..]), p.get(n)))
            .collect();
        // Gemma 3's local and global layers differ in their mask and
        // rotary base: each scanned layer picks its own by a flag.
        let mixed = c.mixed_layer_types();
        if mixed {
            let flags: Vec<f64> = c
                .layer_types
                .iter()
                .map(|t| f64::from(u8::from(*t == LayerType::Sliding)))
                .collect();
            let ty = TensorType::new(DType::I32, [c.num_hidden_layers]);
            xs.push((
                LAYER_IS_SLIDING.into(),
                constant(Literal::from_f64s(ty, &flags)),
            ));
        }
        let xs_ref: Vec<(&str, Tensor)> = xs.iter().map(|(n, t)| (n.as_str(), *t)).collect();
        // The full layers' (or, unmixed, every layer's), then with
        // mixed types the sliding layers' under `<name>.sliding`.
        let kind = if mixed {
            LayerType::Full
        } else {
            c.layer_types[0]
        };
        let mut consts = vec![("cos", rotary.of(kind).0), ("sin", rotary.of(kind).1)];
        if mixed {
            consts.extend([
                ("cos.sliding", rotary.sliding.0),
                ("sin.sliding", rotary.sliding.1),
            ]);
        }
        consts.extend(mask_consts(visible, kind, mixed, s));
        let template = visible.of(kind);
        let (carry, _) = scope("model.layers", || {
            scan(&[("h", h)], &xs_ref, &consts, |l| {
                let lp = Params(l);
                let pick = |name: &str| match l.get(LAYER_IS_SLIDING) {
                    Some(flag) => {
                        let (full, sliding) = (l[name], l[format!("{name}.sliding").as_str()]);
                        let on = flag
                            .eq(flag.scalar_like(1.0))
                            .broadcast_in_dim(&full.dims(), &[]);
                        on.where_(sliding, full)
                    }
                    None => l[name],
                };
                let rotary = (pick("cos"), pick("sin"));
                let visible = match template {
                    Visible::Dense(_, dims) => Visible::Dense(pick("visible"), dims),
                    // Mixed types share one range of key blocks (the
                    // full layers'); the window masks within it.
                    Visible::Blockwise(mask, block) => Visible::Blockwise(
                        MaskSpec {
                            window: l.get("window").map(|_| pick("window")),
                            skip_outside: if mixed { None } else { mask.skip_outside },
                            segments: l.get("segments"),
                        },
                        block,
                    ),
                    cudnn @ Visible::Cudnn(_) => cudnn, // one static window
                };
                (
                    vec![self.rows_split(self.layer(&lp, "layer", l["h"], rotary, visible))],
                    vec![],
                )
            })
        });
        carry[0]
    }

    /// Whether cuDNN can compute every attention of this decoder's
    /// training forward pass in `dtype` (`packed`: rows hold several
    /// samples); the reason when not.
    pub fn cudnn_supports(&self, dtype: DType, packed: bool) -> Result<(), String> {
        let c = self.config;
        if self.scan_layers && c.mixed_layer_types() && c.sliding_window.is_some() {
            return Err(
                "cuDNN's window is fixed per call, and a scan over layers of mixed types runs \
                 one call for all: unroll the layers (--scan-layers off)"
                    .into(),
            );
        }
        cudnn_supports(&CudnnCase {
            dtype,
            head_dim: c.head_dim,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            window: c.sliding_window,
            packed,
            sinks: c.attention_sinks,
        })
    }

    /// Each layer type's mask for `b` rows of `s` tokens (`segments`: of
    /// packed rows) in `dtype`, in the form [`Decoder::attention`]
    /// computes with. cuDNN attention where [`Decoder::cudnn_supports`]
    /// refuses the case falls back to [`AttentionKind::auto`] (the train
    /// step refuses it before tracing; other callers get correct
    /// attention).
    fn masks(
        &self,
        b: i64,
        s: i64,
        segments: Option<Tensor>,
        dtype: DType,
    ) -> PerLayerType<Visible> {
        let attention = match self.attention {
            AttentionKind::Cudnn if self.cudnn_supports(dtype, segments.is_some()).is_ok() => {
                return PerLayerType {
                    full: Visible::Cudnn(None),
                    sliding: Visible::Cudnn(self.config.sliding_window),
                };
            }
            AttentionKind::Cudnn => AttentionKind::auto(s),
            kind => kind,
        };
        if let AttentionKind::Blockwise { block } = attention {
            let window = self.config.sliding_window;
            let described = |w: Option<i64>| {
                Visible::Blockwise(
                    MaskSpec {
                        window: w.map(|w| {
                            constant(Literal::from_f64s(
                                TensorType::scalar(DType::I32),
                                &[w as f64],
                            ))
                        }),
                        skip_outside: w,
                        segments,
                    },
                    block,
                )
            };
            return PerLayerType {
                full: described(None),
                sliding: described(window),
            };
        }
        let rows = iota(TensorType::new(DType::I32, [s, s]), 0);
        let cols = iota(TensorType::new(DType::I32, [s, s]), 1);
        let dense = |m: PerLayerType<Tensor>, dims: &'static [i64]| PerLayerType {
            full: Visible::Dense(m.full, dims),
            sliding: Visible::Dense(m.sliding, dims),
        };
        match segments {
            None => dense(self.visibility(cols.le(rows), cols, rows), &[3, 4]),
            Some(segments) => {
                let sq = [b, s, s];
                let same = segments
                    .broadcast_in_dim(&sq, &[0, 1])
                    .eq(segments.broadcast_in_dim(&sq, &[0, 2]));
                let (rows, cols) = (
                    rows.broadcast_in_dim(&sq, &[1, 2]),
                    cols.broadcast_in_dim(&sq, &[1, 2]),
                );
                dense(
                    self.visibility(same.and(cols.le(rows)), cols, rows),
                    &[0, 3, 4],
                )
            }
        }
    }

    /// The LM head on `h` (`[.., hidden]`), in `h`'s dtype: the embeddings'
    /// transpose when they are tied; soft-capped where the config says.
    pub(crate) fn lm_head(&self, p: &Params, h: Tensor) -> Tensor {
        self.logits(p.get(self.lm_head_name()), h)
    }

    /// A sequence classifier's logits, `[rows, num_labels]` f32: `score` on
    /// `h` (`[rows, seq, hidden]`) at each row's rightmost position that
    /// holds a real token (`real`, `[rows, seq]` bool) other than the pad
    /// id, or at position 0 where none does — transformers' pooling (a
    /// trailing EOS that is also the pad token is skipped). None without
    /// such a head.
    pub(crate) fn classify(
        &self,
        p: &Params,
        h: Tensor,
        ids: Tensor,
        real: Tensor,
    ) -> Option<Tensor> {
        let Head::SequenceClassification { pad_token_id, .. } = self.config.head else {
            return None;
        };
        Some(scope("score", || {
            let dims = ids.dims();
            let at = iota(TensorType::new(DType::I32, dims.clone()), 1);
            let keep = match pad_token_id {
                Some(pad) => real.and(ids.ne(ids.scalar_like(pad as f64))),
                None => real,
            };
            let zero = at.scalar_like(0.0);
            let last = keep.where_(at, zero).max(&[1]);
            let chosen = at.eq(last.broadcast_in_dim(&dims, &[0]));
            let hd = h.dims();
            let pooled = chosen
                .broadcast_in_dim(&hd, &[0, 1])
                .where_(h, h.scalar_like(0.0))
                .sum(&[1]);
            linear(pooled, p.get(SCORE), None).cast(DType::F32)
        }))
    }

    /// The LM head's weight (`[vocab, hidden]`): the embeddings when tied.
    pub(crate) fn lm_head_name(&self) -> &'static str {
        if self.config.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        }
    }

    /// [`Decoder::lm_head`] with its weight given.
    pub(crate) fn logits(&self, weight: Tensor, h: Tensor) -> Tensor {
        scope("lm_head", || {
            let logits = linear(h, weight, None);
            match self.config.final_logit_softcapping {
                Some(cap) => (logits / cap).tanh() * cap,
                None => logits,
            }
        })
    }
}

/// The consts a scan over layers passes for their masks: each type's
/// matrix (`visible`, with mixed types the sliding layers' as
/// `visible.sliding`), or described: the window as a scalar (`window`,
/// with mixed types the whole sequence for full layers and
/// `window.sliding`) and the segments.
fn mask_consts(
    visible: PerLayerType<Visible>,
    kind: LayerType,
    mixed: bool,
    s: i64,
) -> Vec<(&'static str, Tensor)> {
    let mut consts = Vec::new();
    match (visible.of(kind), visible.sliding) {
        (Visible::Dense(m, _), Visible::Dense(sliding, _)) => {
            consts.push(("visible", m));
            if mixed {
                consts.push(("visible.sliding", sliding));
            }
        }
        (Visible::Blockwise(mask, _), Visible::Blockwise(sliding, _)) => {
            let whole = || {
                constant(Literal::from_f64s(
                    TensorType::scalar(DType::I32),
                    &[s as f64],
                ))
            };
            if let Some(w) = mask.window.or_else(|| mixed.then(whole)) {
                consts.push(("window", w));
            }
            if let (true, Some(w)) = (mixed, sliding.window) {
                consts.push(("window.sliding", w));
            }
            if let Some(segments) = mask.segments {
                consts.push(("segments", segments));
            }
        }
        // The window is static; nothing to pass.
        (Visible::Cudnn(_), Visible::Cudnn(_)) => {}
        _ => unreachable!("`masks` gives every layer type's mask one form"),
    }
    consts
}

/// True for a stacked layer parameter (`model.layers.<name>`, no layer
/// index), also under a prefix (`opt.m.model.layers.<name>`).
pub fn is_stacked(name: &str) -> bool {
    name.split_once("model.layers.")
        .is_some_and(|(_, rest)| !rest.starts_with(|c: char| c.is_ascii_digit()))
}
