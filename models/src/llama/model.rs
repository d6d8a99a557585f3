//! `LlamaForCausalLM` in the tracing DSL, as HF transformers computes it,
//! with optional LoRA adapters as PEFT computes them.
//!
//! Parameters are inputs named as in HF checkpoints
//! (`model.layers.3.self_attn.q_proj.weight`, `[out, in]` like
//! `nn.Linear`); adapters are `<module>.lora_a` (`[in, r]`) and
//! `<module>.lora_b` (`[r, out]`), transposed from PEFT's `lora_A.weight`
//! (`[r, in]`) and `lora_B.weight` (`[out, r]`) when read and written. Scope
//! names follow the module tree (`model.layers.3.self_attn.q_proj`).

use hlo_ir::ops::DotGeneral;
use hlo_ir::{checkpoint, constant, iota, scan, scope, DType, Inputs, Literal, Tensor, TensorType};

use super::config::LlamaConfig;
use super::lora::LoraConfig;

/// What a forward pass needs besides the parameters.
pub struct Llama<'a> {
    pub config: &'a LlamaConfig,
    pub lora: Option<&'a LoraConfig>,
    /// Mesh axes the batch is split over. When set, LoRA's `x·A` is
    /// constrained to that layout: without it XLA's SPMD partitioner
    /// miscomputes `x·W + (x·A)·B` on some meshes (README, "Known XLA issues").
    pub batch_axes: Vec<String>,
    /// Run the layers as one scan over stacked parameters.
    pub scan_layers: bool,
    /// Recompute each layer's forward in the backward pass instead of
    /// keeping its activations (only the layer inputs are kept). A scan's
    /// gradient already works this way.
    pub remat_layers: bool,
}

/// Parameters by name: the traced inputs.
pub struct Params<'a>(pub &'a Inputs);

impl Params<'_> {
    fn names(&self) -> impl Iterator<Item = &str> {
        self.0.names().iter().map(String::as_str)
    }

    pub(super) fn get(&self, name: &str) -> Tensor {
        self.0[name]
    }

    fn has(&self, name: &str) -> bool {
        self.0.get(name).is_some()
    }
}

/// `x · Wᵀ` for an `nn.Linear` weight `[out, in]`; bf16 and f16 products
/// accumulate in f32 and round once.
pub(super) fn linear(x: Tensor, w: Tensor) -> Tensor {
    let dtype = x.dtype();
    let wide = matches!(dtype, DType::BF16 | DType::F16);
    let y = x.dot_general(
        w.cast(dtype),
        DotGeneral {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contracting: vec![x.rank() as i64 - 1],
            rhs_contracting: vec![1],
            precision: None,
            preferred_element_type: wide.then_some(DType::F32),
        },
    );
    y.cast(dtype)
}

/// `softmax(q·kᵀ/√d)·v` over the keys `visible` marks, for `q: [b, heads,
/// tq, d]` and `k`, `v: [b, kv_heads, tk, d]`: query heads are grouped by
/// their K/V head in one `dot_general` (no repeat_kv copies), scores and
/// softmax in f32. `visible` is boolean and broadcasts into `[b, kv_heads,
/// groups, tq, tk]` along `visible_dims`. Returns `[b, tq, heads·d]`.
pub(super) fn grouped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor,
    visible_dims: &[i64],
) -> Tensor {
    let (qd, kd) = (q.dims(), k.dims());
    let (b, nh, tq, hd) = (qd[0], qd[1], qd[2], qd[3]);
    let (nkv, tk) = (kd[1], kd[2]);
    let dtype = q.dtype();
    let wide = matches!(dtype, DType::BF16 | DType::F16).then_some(DType::F32);
    let batched = |lhs_contracting: i64, rhs_contracting: i64| DotGeneral {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contracting: vec![lhs_contracting],
        rhs_contracting: vec![rhs_contracting],
        precision: None,
        preferred_element_type: wide,
    };
    let shape = [b, nkv, nh / nkv, tq, tk];
    let scores = q
        .reshape(&[b, nkv, nh / nkv, tq, hd])
        .dot_general(k, batched(4, 3));
    let scores = (scores.cast(dtype) * (hd as f64).powf(-0.5)).cast(DType::F32);
    let scores = visible
        .broadcast_in_dim(&shape, visible_dims)
        .where_(scores, scores.scalar_like(f32::MIN as f64));
    let probs = scores.softmax(4).cast(dtype);
    probs
        .dot_general(v, batched(4, 2))
        .cast(dtype)
        .reshape(&[b, nh, tq, hd])
        .transpose(&[0, 2, 1, 3])
        .reshape(&[b, tq, nh * hd])
}

/// HF's `LlamaRMSNorm`: normalise in f32, scale in the input dtype.
pub fn rms_norm(x: Tensor, weight: Tensor, eps: f64) -> Tensor {
    let dtype = x.dtype();
    let dims = x.dims();
    let last = dims.len() as i64 - 1;
    let xf = x.cast(DType::F32);
    let var = (xf * xf).mean(&[last]);
    let keep: Vec<i64> = (0..last).collect();
    let normed = xf * (var + eps).rsqrt().broadcast_in_dim(&dims, &keep);
    weight.cast(dtype) * normed.cast(dtype)
}

/// The rotary embedding on `y` (`[b, heads, t, head_dim]`): `y·cos +
/// rotate_half(y)·sin`, `cos` and `sin` broadcast `along` `y`'s dimensions.
pub(super) fn apply_rotary(y: Tensor, cos: Tensor, sin: Tensor, along: &[i64]) -> Tensor {
    let d = y.dims();
    y * cos.broadcast_in_dim(&d, along) + rotate_half(y) * sin.broadcast_in_dim(&d, along)
}

/// `cat(-x2, x1)` of the two halves of the last dimension.
pub(super) fn rotate_half(x: Tensor) -> Tensor {
    let d = x.dims();
    let r = d.len();
    let half = d[r - 1] / 2;
    let mut mid = d.clone();
    mid[r - 1] = half;
    let zeros = vec![0; r];
    let mut start2 = zeros.clone();
    start2[r - 1] = half;
    let x1 = x.slice(&zeros, &mid);
    let x2 = x.slice(&start2, &d);
    Tensor::concat(&[-x2, x1], r as i64 - 1)
}

/// A module's path as PEFT names it: a scanned layer's (`layer.…`, every
/// layer alike, which the step checks) read as layer 0's.
fn layer_path(module: &str) -> String {
    match module.strip_prefix("layer.") {
        Some(rest) => format!("model.layers.0.{rest}"),
        None => module.to_string(),
    }
}

impl Llama<'_> {
    /// A projection by module path (`model.layers.3.self_attn.q_proj`), with
    /// its LoRA branch if the module is targeted.
    pub(super) fn proj(&self, p: &Params, module: &str, short: &str, x: Tensor) -> Tensor {
        scope(short, || {
            let y = linear(x, p.get(&format!("{module}.weight")));
            match self.lora {
                Some(l) if l.targets(short) && p.has(&format!("{module}.lora_a")) => {
                    let (a, b) = (
                        p.get(&format!("{module}.lora_a")),
                        p.get(&format!("{module}.lora_b")),
                    );
                    // PEFT runs the branch in the adapter's dtype; never forms A·B.
                    let mut xa = x.cast(a.dtype()).matmul(a);
                    if !self.batch_axes.is_empty() {
                        let mut dims = vec![Vec::new(); xa.rank()];
                        dims[0] = self.batch_axes.clone();
                        xa = xa.with_sharding_constraint(dims);
                    }
                    let delta = xa.matmul(b) * l.scale_of(&layer_path(module));
                    y + delta.cast(y.dtype())
                }
                _ => y,
            }
        })
    }

    /// `cos`/`sin` of the rotary angles for positions `0..seq`: `[seq, head_dim]`.
    fn rotary(&self, seq: i64, dtype: DType) -> (Tensor, Tensor) {
        let c = self.config;
        let half = c.head_dim / 2;
        let inv = constant(Literal::from_f64s(
            TensorType::new(DType::F32, [1, half]),
            &c.inv_freq(),
        ));
        let pos = iota(TensorType::new(DType::F32, [seq, 1]), 0);
        let angles = pos.matmul(inv);
        let emb = Tensor::concat(&[angles, angles], 1);
        (emb.cos().cast(dtype), emb.sin().cast(dtype))
    }

    /// `cos`/`sin` of the rotary angles at each token's own position
    /// (`positions: [b, t]`, integers): `[b, t, head_dim]`.
    pub(super) fn rotary_at(&self, positions: Tensor, dtype: DType) -> (Tensor, Tensor) {
        let d = positions.dims();
        let (b, t, half) = (d[0], d[1], self.config.head_dim / 2);
        let inv = constant(Literal::from_f64s(
            TensorType::new(DType::F32, [half]),
            &self.config.inv_freq(),
        ));
        let angles = positions
            .cast(DType::F32)
            .broadcast_in_dim(&[b, t, half], &[0, 1])
            * inv.broadcast_in_dim(&[b, t, half], &[2]);
        let emb = Tensor::concat(&[angles, angles], 2);
        (emb.cos().cast(dtype), emb.sin().cast(dtype))
    }

    /// The projected query, key and value heads of `x: [b, t, hidden]`,
    /// `[b, heads, t, head_dim]`, with `rope` applied to queries and keys.
    pub(super) fn qkv(
        &self,
        p: &Params,
        prefix: &str,
        x: Tensor,
        rope: impl Fn(Tensor) -> Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        self.qkv_with(prefix, x, rope, &|m, short, x| self.proj(p, m, short, x))
    }

    /// [`Llama::qkv`] with `proj(module, short, x)` as each projection.
    pub(super) fn qkv_with(
        &self,
        prefix: &str,
        x: Tensor,
        rope: impl Fn(Tensor) -> Tensor,
        proj: &dyn Fn(&str, &str, Tensor) -> Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let c = self.config;
        let dims = x.dims();
        let (b, t) = (dims[0], dims[1]);
        let heads = |short: &str, n: i64| {
            proj(&format!("{prefix}.{short}"), short, x)
                .reshape(&[b, t, n, c.head_dim])
                .transpose(&[0, 2, 1, 3])
        };
        let q = heads("q_proj", c.num_attention_heads);
        let k = heads("k_proj", c.num_key_value_heads);
        let v = heads("v_proj", c.num_key_value_heads);
        (rope(q), rope(k), v)
    }

    /// Causal grouped-query attention of `x: [b, s, hidden]`; `cos`/`sin`
    /// are `[s, head_dim]`, or `[b, s, head_dim]` for packed rows, whose
    /// `visible: [b, s, s]` mask also keeps each sample to itself.
    fn attention(
        &self,
        p: &Params,
        prefix: &str,
        x: Tensor,
        (cos, sin): (Tensor, Tensor),
        visible: Option<Tensor>,
    ) -> Tensor {
        let along: &[i64] = if cos.rank() == 3 { &[0, 2, 3] } else { &[2, 3] };
        let (q, k, v) = self.qkv(p, prefix, x, |y| apply_rotary(y, cos, sin, along));
        let out = match visible {
            Some(visible) => grouped_attention(q, k, v, visible, &[0, 3, 4]),
            None => {
                let s = x.dims()[1];
                let rows = iota(TensorType::new(DType::I32, [s, s]), 0);
                let cols = iota(TensorType::new(DType::I32, [s, s]), 1);
                grouped_attention(q, k, v, cols.le(rows), &[3, 4])
            }
        };
        self.proj(p, &format!("{prefix}.o_proj"), "o_proj", out)
    }

    pub(super) fn mlp(&self, p: &Params, prefix: &str, x: Tensor) -> Tensor {
        self.mlp_with(prefix, x, &|m, short, x| self.proj(p, m, short, x))
    }

    /// [`Llama::mlp`] with `proj(module, short, x)` as each projection.
    pub(super) fn mlp_with(
        &self,
        prefix: &str,
        x: Tensor,
        proj: &dyn Fn(&str, &str, Tensor) -> Tensor,
    ) -> Tensor {
        let gate = proj(&format!("{prefix}.gate_proj"), "gate_proj", x);
        let up = proj(&format!("{prefix}.up_proj"), "up_proj", x);
        proj(
            &format!("{prefix}.down_proj"),
            "down_proj",
            gate * gate.logistic() * up,
        )
    }

    /// One decoder layer on `h`; its parameters are `{prefix}.<name>` in `p`.
    fn layer(
        &self,
        p: &Params,
        prefix: &str,
        h: Tensor,
        rotary: (Tensor, Tensor),
        visible: Option<Tensor>,
    ) -> Tensor {
        self.layer_with(p, prefix, h, |x| {
            self.attention(p, &format!("{prefix}.self_attn"), x, rotary, visible)
        })
    }

    /// A decoder layer around an attention block `attention(x)`: the
    /// norms, residuals and MLP.
    pub(super) fn layer_with(
        &self,
        p: &Params,
        prefix: &str,
        h: Tensor,
        attention: impl FnOnce(Tensor) -> Tensor,
    ) -> Tensor {
        self.layer_with_mlp(p, prefix, h, attention, |x| {
            self.mlp(p, &format!("{prefix}.mlp"), x)
        })
    }

    /// [`Llama::layer_with`] with the MLP block `mlp(x)` given too.
    pub(super) fn layer_with_mlp(
        &self,
        p: &Params,
        prefix: &str,
        h: Tensor,
        attention: impl FnOnce(Tensor) -> Tensor,
        mlp: impl FnOnce(Tensor) -> Tensor,
    ) -> Tensor {
        let c = self.config;
        let x = scope("input_layernorm", || {
            rms_norm(
                h,
                p.get(&format!("{prefix}.input_layernorm.weight")),
                c.rms_norm_eps,
            )
        });
        let h = h + scope("self_attn", || attention(x));
        let x = scope("post_attention_layernorm", || {
            rms_norm(
                h,
                p.get(&format!("{prefix}.post_attention_layernorm.weight")),
                c.rms_norm_eps,
            )
        });
        h + scope("mlp", || mlp(x))
    }

    /// Logits `[b, s, vocab]` for `input_ids: [b, s]` (integers). With
    /// `scan_layers`, the layers' parameters are stacked
    /// (`model.layers.self_attn.q_proj.weight` `[layers, out, in]`) and the
    /// layers run as one scan, so the program does not grow with depth.
    pub fn forward(&self, p: &Params, input_ids: Tensor, dtype: DType) -> Tensor {
        self.forward_with(p, input_ids, None, dtype)
    }

    /// [`Llama::forward`] over packed rows: several samples per row, told
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
        self.forward_with(p, input_ids, Some((positions, segment_ids)), dtype)
    }

    fn forward_with(
        &self,
        p: &Params,
        input_ids: Tensor,
        packed: Option<(Tensor, Tensor)>,
        dtype: DType,
    ) -> Tensor {
        let c = self.config;
        let (b, s) = (input_ids.dims()[0], input_ids.dims()[1]);
        let mut h = scope("model.embed_tokens", || {
            p.get("model.embed_tokens.weight")
                .cast(dtype)
                .take(input_ids, 0)
        });
        let (cos, sin) = scope("model.rotary_emb", || match packed {
            None => self.rotary(s, dtype),
            Some((positions, _)) => self.rotary_at(positions, dtype),
        });
        // Packed rows: a token sees the earlier tokens of its own sample
        // (HF builds this as the attention mask before the layers).
        let visible = packed.map(|(_, segments)| {
            scope("model.causal_mask", || {
                let sq = [b, s, s];
                let same = segments
                    .broadcast_in_dim(&sq, &[0, 1])
                    .eq(segments.broadcast_in_dim(&sq, &[0, 2]));
                let rows = iota(TensorType::new(DType::I32, [s, s]), 0);
                let cols = iota(TensorType::new(DType::I32, [s, s]), 1);
                let causal = cols.le(rows).broadcast_in_dim(&sq, &[1, 2]);
                same.and(causal)
            })
        });
        if self.scan_layers {
            let stacked: Vec<String> = p
                .names()
                .filter(|n| is_stacked(n))
                .map(str::to_string)
                .collect();
            let xs: Vec<(String, Tensor)> = stacked
                .iter()
                .map(|n| (format!("layer.{}", &n["model.layers.".len()..]), p.get(n)))
                .collect();
            let xs_ref: Vec<(&str, Tensor)> = xs.iter().map(|(n, t)| (n.as_str(), *t)).collect();
            let mut consts = vec![("cos", cos), ("sin", sin)];
            if let Some(v) = visible {
                consts.push(("visible", v));
            }
            let (carry, _) = scope("model.layers", || {
                scan(&[("h", h)], &xs_ref, &consts, |l| {
                    let lp = Params(l);
                    let rotary = (l["cos"], l["sin"]);
                    (
                        vec![self.layer(&lp, "layer", l["h"], rotary, l.get("visible"))],
                        vec![],
                    )
                })
            });
            h = carry[0];
        } else {
            for l in 0..c.num_hidden_layers {
                let prefix = format!("model.layers.{l}");
                let layer = || self.layer(p, &prefix, h, (cos, sin), visible);
                h = if self.remat_layers {
                    checkpoint(&prefix, layer)
                } else {
                    scope(&prefix, layer)
                };
            }
        }
        let h = scope("model.norm", || {
            rms_norm(h, p.get("model.norm.weight"), c.rms_norm_eps)
        });
        self.lm_head(p, h)
    }

    /// The LM head on `h` (`[.., hidden]`), in `h`'s dtype: the embeddings'
    /// transpose when they are tied.
    pub(super) fn lm_head(&self, p: &Params, h: Tensor) -> Tensor {
        let head = if self.config.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        scope("lm_head", || linear(h, p.get(head)))
    }
}

/// True for a stacked layer parameter (`model.layers.<name>`, no layer
/// index), also under a prefix (`opt.m.model.layers.<name>`).
pub fn is_stacked(name: &str) -> bool {
    name.split_once("model.layers.")
        .is_some_and(|(_, rest)| !rest.starts_with(|c: char| c.is_ascii_digit()))
}
