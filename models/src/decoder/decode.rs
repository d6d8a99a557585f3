//! Incremental decoding with a KV cache, and token sampling on the device.
//!
//! A batch of prompts is left-padded to one length, so every row writes its
//! new keys and values at the same cache slot (`cur`) with one
//! `dynamic_update_slice` per layer; row `b`'s first `offsets[b]` slots are
//! padding, masked out of attention, and its rotary positions count from
//! its first real token. The same traced program serves prefill (`T` new
//! tokens from slot 0) and decode (`T = 1`), each compiled once per shape.

use crate::attention::AttentionKind;
use hlo_ir::{full, iota, scope, trace, DType, Outputs, Tensor, TensorType, TraceError};

use super::model::apply_rotary;
use super::{base_parameter_types, lora_parameter_types, Decoder, LoraConfig, ModelConfig, Params};
use crate::roles::{Role, Step, StepInput};

/// The cache tensors of every layer: `cache.layers.<l>.k` and `.v`, each
/// `[batch, kv_heads, max_len, head_dim]` in `dtype`.
pub fn cache_types(
    config: &ModelConfig,
    batch: i64,
    max_len: i64,
    dtype: DType,
) -> Vec<(String, TensorType)> {
    let ty = TensorType::new(
        dtype,
        [batch, config.num_key_value_heads, max_len, config.head_dim],
    );
    (0..config.num_hidden_layers)
        .flat_map(|l| {
            [
                (format!("cache.layers.{l}.k"), ty.clone()),
                (format!("cache.layers.{l}.v"), ty.clone()),
            ]
        })
        .collect()
}

impl Decoder<'_> {
    /// Logits of the last new token of each row, `[batch, vocab]` (f32),
    /// and the updated caches, for `input_ids: [batch, T]` written at cache
    /// slots `cur..cur + T`; `offsets: [batch]` is each row's count of
    /// left padding. The caches are read from `p` (see [`cache_types`]).
    /// Sliding layers see only the last `sliding_window` slots; the cache
    /// keeps every slot (a slot's distance to the query is its distance in
    /// positions, as the padding is all on the left).
    pub(crate) fn forward_cached(
        &self,
        p: &Params,
        input_ids: Tensor,
        offsets: Tensor,
        cur: Tensor,
        dtype: DType,
    ) -> (Tensor, Vec<(String, Tensor)>) {
        let c = self.config;
        let d = input_ids.dims();
        let (b, t) = (d[0], d[1]);
        let max_len = p.get("cache.layers.0.k").dims()[2];
        let mut h = self.embed(p, input_ids, dtype);
        // Slot of each new token, and its position within its own row.
        let slot =
            iota(TensorType::new(DType::I32, [b, t]), 1) + cur.broadcast_in_dim(&[b, t], &[]);
        let position = slot - offsets.broadcast_in_dim(&[b, t], &[0]);
        let rotary = scope("model.rotary_emb", || self.rotary_at(position, dtype));
        // Key slot j is visible to the new token at slot s of row r when
        // offsets[r] <= j <= s (and, in sliding layers, j > s - window).
        let shape = [b, t, max_len];
        let keys = iota(TensorType::new(DType::I32, shape), 2);
        let queries = slot.broadcast_in_dim(&shape, &[0, 1]);
        let causal = keys
            .ge(offsets.broadcast_in_dim(&shape, &[0]))
            .and(keys.le(queries));
        let visible = self.visibility(causal, keys, queries);
        let zero = full(TensorType::scalar(DType::I32), 0.0);
        let mut caches = Vec::new();
        let proj = |m: &str, short: &str, x: Tensor| self.proj(p, m, short, x);
        for l in 0..c.num_hidden_layers {
            let prefix = format!("model.layers.{l}");
            let kind = c.layer_types[l as usize];
            let (cos, sin) = rotary.of(kind);
            h = scope(&prefix, || {
                self.layer_with_mlp(
                    p,
                    &prefix,
                    h,
                    |x| {
                        let a = format!("{prefix}.self_attn");
                        let rope = |y| apply_rotary(y, cos, sin, &[0, 2, 3]);
                        let (q, k, v) = self.qkv_with(p, &a, x, rope, &proj);
                        let (kname, vname) =
                            (format!("cache.layers.{l}.k"), format!("cache.layers.{l}.v"));
                        let (kc, vc) = (p.get(&kname), p.get(&vname));
                        let at = [zero, zero, cur, zero];
                        let kc = kc.dynamic_update_slice(k.cast(kc.dtype()), &at);
                        let vc = vc.dynamic_update_slice(v.cast(vc.dtype()), &at);
                        caches.push((kname, kc));
                        caches.push((vname, vc));
                        let out = self.attend(
                            p,
                            &a,
                            (q, kc.cast(dtype), vc.cast(dtype)),
                            (visible.of(kind), &[0, 3, 4]),
                        );
                        proj(&format!("{a}.o_proj"), "o_proj", self.attention_output(out))
                    },
                    |x| self.mlp_with(p, &format!("{prefix}.mlp"), x, &proj),
                )
            });
        }
        // Only the last token's logits are needed to pick the next one.
        let last = h
            .slice(&[0, t - 1, 0], &[b, t, c.hidden_size])
            .reshape(&[b, c.hidden_size]);
        let last = scope("model.norm", || self.norm(p, "model.norm", last));
        let logits = self.lm_head(p, last).cast(DType::F32);
        (logits, caches)
    }
}

/// Picks one token per row of `logits: [batch, vocab]` (f32) on the device
/// with one setting for every row (see [`sample_rows`]); the uniform noise
/// comes from `rng` (`u64[2]`, threefry). Returns the tokens `[batch]`
/// (i32) and the next rng state.
pub fn sample_tokens(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    rng: Tensor,
) -> (Tensor, Tensor) {
    let d = logits.dims();
    let (b, v) = (d[0], d[1]);
    let each = |x: Tensor| x.broadcast_in_dim(&[b], &[]);
    let (rng, bits) = rng.rng_bits(TensorType::new(DType::U32, [b, v]));
    let uniform = bits.cast(DType::F32) * 2f64.powi(-32);
    let next = sample_rows(logits, each(temperature), each(top_k), each(top_p), uniform);
    (next, rng)
}

/// Picks one token per row of `logits: [batch, vocab]` (f32), each row with
/// its own setting (`temperature`, `top_k`, `top_p`: `[batch]`): greedy
/// (argmax) where the temperature is 0, else a draw from
/// `softmax(logits / temperature)` restricted to the `top_k` most likely
/// tokens (0: all) and to the smallest set holding `top_p` of the
/// probability (1: all). The draw is the Gumbel-max trick on `uniform`
/// (`[batch, vocab]`, in [0, 1)); the k-th largest logit and the top-p
/// threshold are found by bisection, so nothing is sorted. A row's token
/// depends only on its own logits, setting and noise.
pub fn sample_rows(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    uniform: Tensor,
) -> Tensor {
    const STEPS: usize = 40;
    let d = logits.dims();
    let (b, v) = (d[0], d[1]);
    let rows = |x: Tensor| x.broadcast_in_dim(&[b, v], &[0]);
    let greedy = temperature.le(temperature.scalar_like(0.0).broadcast_in_dim(&[b], &[]));
    let temp = greedy.where_(
        temperature.scalar_like(1.0).broadcast_in_dim(&[b], &[]),
        temperature,
    );
    let z = logits / rows(temp);
    let zmax = z.max(&[1]);
    let zmin = z.min(&[1]);
    // The k-th largest logit: the largest x with count(z >= x) >= k.
    let k = top_k.cast(DType::F32);
    let (mut lo, mut hi) = (zmin, zmax);
    for _ in 0..STEPS {
        let mid = (lo + hi) * 0.5;
        let count = z.ge(rows(mid)).cast(DType::F32).sum(&[1]);
        let enough = count.ge(k);
        lo = enough.where_(mid, lo);
        hi = enough.where_(hi, mid);
    }
    let all_k = top_k.le(top_k.scalar_like(0.0).broadcast_in_dim(&[b], &[]));
    let kth = all_k.where_(zmin, lo);
    let in_k = z.ge(rows(kth));
    // Probabilities over the top-k, then the top-p threshold: the largest
    // tau with sum(p where p >= tau) >= top_p.
    let e = in_k.where_((z - rows(zmax)).exp(), z.scalar_like(0.0));
    let probs = e / rows(e.sum(&[1]));
    let pmax = probs.max(&[1]);
    let (mut lo, mut hi) = (pmax.scalar_like(0.0).broadcast_in_dim(&[b], &[]), pmax);
    for _ in 0..STEPS {
        let mid = (lo + hi) * 0.5;
        let mass = probs
            .ge(rows(mid))
            .where_(probs, probs.scalar_like(0.0))
            .sum(&[1]);
        let enough = mass.ge(top_p);
        lo = enough.where_(mid, lo);
        hi = enough.where_(hi, mid);
    }
    let all_p = top_p.ge(top_p.scalar_like(1.0).broadcast_in_dim(&[b], &[]));
    let tau = all_p.where_(pmax.scalar_like(0.0).broadcast_in_dim(&[b], &[]), lo);
    let kept = in_k.and(probs.ge(rows(tau)));
    // Gumbel-max: argmax(z + g) over the kept tokens, g = -log(-log(u)).
    let u = uniform
        .maximum(z.scalar_like(1e-20))
        .minimum(z.scalar_like(1.0 - 2f64.powi(-24)));
    let gumbel = -(-(u.log())).log();
    let noisy = rows(greedy).where_(z, z + gumbel);
    let masked = kept.where_(noisy, z.scalar_like(f32::MIN as f64));
    argmax(masked)
}

/// Uniform noise in (0, 1), `[batch, vocab]` (f32), that depends only on
/// each row's `seed` (u32) and `counter` (i32, `[batch]` each) and the
/// token index: a counter-based hash (murmur3's finaliser, three rounds),
/// so a row's draws do not depend on the other rows of its batch.
pub fn hashed_uniform(seed: Tensor, counter: Tensor, vocab: i64) -> Tensor {
    let b = seed.dims()[0];
    let shape = [b, vocab];
    let u32s = |x: Tensor| x.broadcast_in_dim(&shape, &[0]);
    let k = |c: f64| full(TensorType::new(DType::U32, shape), c);
    let fmix = |h: Tensor| {
        let h = h.xor(h.shift_right_logical(k(16.0))) * k(2246822507.0);
        let h = h.xor(h.shift_right_logical(k(13.0))) * k(3266489909.0);
        h.xor(h.shift_right_logical(k(16.0)))
    };
    let token = iota(TensorType::new(DType::U32, shape), 1);
    let h = fmix(u32s(seed) + k(2654435769.0));
    let h = fmix(h.xor(u32s(counter.cast(DType::U32)) * k(2654435761.0)));
    let h = fmix(h.xor(token * k(2246822519.0) + k(374761393.0)));
    // The top 24 bits, centred in their interval: never 0 or 1.
    (h.shift_right_logical(k(8.0)).cast(DType::F32) + 0.5) * 2f64.powi(-24)
}

/// The index of each row's largest value (the first on ties), `[batch]` i32.
pub fn argmax(x: Tensor) -> Tensor {
    let d = x.dims();
    let (b, v) = (d[0], d[1]);
    let m = x.max(&[1]).broadcast_in_dim(&[b, v], &[0]);
    let idx = iota(TensorType::new(DType::I32, [b, v]), 1);
    x.eq(m).where_(idx, idx.scalar_like(v as f64)).min(&[1])
}

/// One prefill or decode step with on-device sampling: inputs are the
/// parameters (and LoRA tensors), the caches, `input_ids [batch, new]`,
/// `offsets [batch]`, `cur []`, `temperature []`, `top_k []`, `top_p []`
/// and `rng u64[2]`; outputs `next [batch]` (-1 for a row whose logits
/// are not finite), `logits [batch, vocab]`,
/// the updated caches and `rng`. As a [`Step`]: parameters are weights,
/// the caches and the rng state are updated in place (donated), the rest
/// are per-call inputs.
pub fn decode_step(
    config: &ModelConfig,
    dtype: DType,
    batch: i64,
    new: i64,
    max_len: i64,
    lora: Option<&LoraConfig>,
) -> Result<Step, TraceError> {
    let mut params = base_parameter_types(config, dtype);
    if let Some(l) = lora {
        params.extend(lora_parameter_types(config, l));
    }
    let mut inputs: Vec<(String, TensorType, Role)> = params
        .into_iter()
        .map(|(n, t)| (n, t, Role::Weight))
        .collect();
    inputs.extend(
        cache_types(config, batch, max_len, dtype)
            .into_iter()
            .map(|(n, t)| (n, t, Role::KvCache)),
    );
    let control = [
        ("input_ids", TensorType::new(DType::I32, [batch, new])),
        ("offsets", TensorType::new(DType::I32, [batch])),
        ("cur", TensorType::scalar(DType::I32)),
        ("temperature", TensorType::scalar(DType::F32)),
        ("top_k", TensorType::scalar(DType::I32)),
        ("top_p", TensorType::scalar(DType::F32)),
    ];
    inputs.extend(control.map(|(n, t)| (n.to_string(), t, Role::Control)));
    inputs.push((
        "rng".into(),
        TensorType::new(DType::U64, [2]),
        Role::RngState,
    ));
    let model = Decoder {
        lora,
        ..decoder(config)
    };
    step_of("llama_decode", inputs, |i| {
        let (logits, caches) =
            model.forward_cached(&Params(i), i["input_ids"], i["offsets"], i["cur"], dtype);
        let (next, rng) = scope("sample", || {
            let (next, rng) =
                sample_tokens(logits, i["temperature"], i["top_k"], i["top_p"], i["rng"]);
            // -1 for a row whose logits are not finite, as serving's.
            (super::serving::finite_or_flag(logits, next), rng)
        });
        let out = Outputs::new().add("next", next).add("logits", logits);
        with_caches(out, caches).add("rng", rng)
    })
}

/// A generation model (no batch axes, layers unrolled, no remat).
pub(super) fn decoder(config: &ModelConfig) -> Decoder<'_> {
    Decoder {
        config,
        lora: None,
        batch_axes: Vec::new(),
        scan_layers: false,
        remat_layers: false,
        remat_mlp: false,
        attention: AttentionKind::Naive,
        moe: super::MoeKind::default(),
        router: Default::default(),
    }
}

/// `out` with the updated caches added.
pub(super) fn with_caches(mut out: Outputs, caches: Vec<(String, Tensor)>) -> Outputs {
    for (name, t) in caches {
        out = out.add(&name, t);
    }
    out
}

/// Traces `body` over `inputs` (name, type, role) as a [`Step`].
pub(super) fn step_of(
    name: &str,
    inputs: Vec<(String, TensorType, Role)>,
    body: impl FnOnce(&hlo_ir::Inputs) -> Outputs,
) -> Result<Step, TraceError> {
    let types: Vec<(String, TensorType)> = inputs
        .iter()
        .map(|(n, t, _)| (n.clone(), t.clone()))
        .collect();
    let function = trace(name, &types, body)?;
    Ok(Step::new(function, |name| StepInput {
        role: inputs
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, _, r)| r.clone())
            .expect("every input has a role"),
        leading_axis: false,
    }))
}
