//! Serving many requests and many LoRA adapters with one base model: the
//! programs of continuous batching (Orca) with stacked adapter tables
//! (S-LoRA, Punica).
//!
//! The KV cache has one *slot* per running request (`[slots, kv_heads,
//! max_len, head_dim]` per layer). A request joins by prefill programs that
//! run its prompt in chunks (batch 1, each padded on the right to a length
//! bucket, attending to what the slot already holds), write their keys and
//! values into its slot of the donated caches, and sample its first token
//! from the last chunk; a prompt prefix another slot holds (same tokens,
//! same adapter) is copied instead of computed ([`slot_read_step`],
//! [`slot_write_step`]). Then
//! every running request advances one token per decode program, each slot
//! at its own position. Every adapter lives in
//! device-resident tables, one per projection (`lora_tables.<module>.a`
//! `[entries, in, max_rank]`, `.b` `[entries, max_rank, out]`, `.scale`
//! `[entries]`); entry 0 is all zero (the base model), an adapter of lower
//! rank is zero-padded (which adds exact zeros), a module it does not target
//! is zero. Each row picks its entry by index, so one batch mixes adapters
//! of different ranks and targets, and loading an adapter is one donated
//! update program. A row's tokens depend only on its own inputs: sampling
//! noise is a hash of the request's seed and token count.

use hlo_ir::ops::DotGeneral;
use hlo_ir::{iota, scope, DType, Outputs, Tensor, TensorType, TraceError};

use super::decode::{decoder, hashed_uniform, sample_rows, step_of, with_caches};
use super::model::apply_rotary;
use super::{base_parameter_types, Decoder, ModelConfig, Params, DEFAULT_TARGETS};
use crate::roles::{Role, Step};

/// How each row's adapter entry is picked from a table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoraSelect {
    /// `table.take(index)`: each row's A and B gathered, then two batched
    /// products per row.
    Gather,
    /// A contraction over the entries: every entry's `x·A`, weighted by the
    /// row's one-hot, contracted over (entry, rank) with every entry's B
    /// (BENCHMARKS.md compares the two).
    OneHot,
}

/// The shape of the adapter tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AdapterTables {
    /// Adapters resident at once, plus entry 0 (the base model).
    pub entries: i64,
    /// The largest rank an entry holds.
    pub max_rank: i64,
    pub select: LoraSelect,
}

/// Every projection of every layer, as (module path, short name).
pub fn projections(config: &ModelConfig) -> Vec<(String, &'static str)> {
    (0..config.num_hidden_layers)
        .flat_map(|l| {
            DEFAULT_TARGETS.iter().map(move |short| {
                let group = if ["q_proj", "k_proj", "v_proj", "o_proj"].contains(short) {
                    "self_attn"
                } else {
                    "mlp"
                };
                (format!("model.layers.{l}.{group}.{short}"), *short)
            })
        })
        .collect()
}

/// The table names of a projection: `lora_tables.<module>.{a,b,scale}`.
pub fn table_names(module: &str) -> [String; 3] {
    ["a", "b", "scale"].map(|t| format!("lora_tables.{module}.{t}"))
}

/// The adapter tables (f32) of every projection: see the module's docs.
pub fn adapter_table_types(config: &ModelConfig, t: &AdapterTables) -> Vec<(String, TensorType)> {
    let mut out = Vec::new();
    for (module, short) in projections(config) {
        let (din, dout) = config.projection_dims(short).expect("a known projection");
        let [a, b, scale] = table_names(&module);
        out.push((a, TensorType::new(DType::F32, [t.entries, din, t.max_rank])));
        out.push((
            b,
            TensorType::new(DType::F32, [t.entries, t.max_rank, dout]),
        ));
        out.push((scale, TensorType::new(DType::F32, [t.entries])));
    }
    out
}

/// `x · W_iᵀ`-style batched product of `x: [rows, t, k]` with each row's
/// matrix `m: [rows, k, n]`.
fn row_matmul(x: Tensor, m: Tensor) -> Tensor {
    x.dot_general(
        m,
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

/// What the layers of a serving program share: the weights and tables,
/// each row's adapter entry, and how the tables are read.
struct Serving<'a> {
    model: Decoder<'a>,
    p: &'a Params<'a>,
    adapter_ids: Tensor,
    select: LoraSelect,
}

impl<'a> Serving<'a> {
    /// The serving layers of `config` on the weights and tables in `p`,
    /// each row's adapter entry its `adapter_ids` input.
    fn new(config: &'a ModelConfig, p: &'a Params<'a>, select: LoraSelect) -> Serving<'a> {
        Serving {
            model: decoder(config),
            p,
            adapter_ids: p.get("adapter_ids"),
            select,
        }
    }

    /// A projection with each row's adapter: `x·Wᵀ + scale·(x·A)·B` as
    /// PEFT computes it (the branch in f32), A, B and scale of the row's
    /// entry.
    fn proj(&self, module: &str, short: &str, x: Tensor) -> Tensor {
        scope(short, || {
            let y = self.model.base_proj(self.p, module, short, x);
            let [a, b, scale] = table_names(module).map(|n| self.p.get(&n));
            let x = x.cast(DType::F32);
            let (rows, t) = (x.dims()[0], x.dims()[1]);
            let delta = match self.select {
                LoraSelect::Gather => {
                    let pick = |table: Tensor| table.take(self.adapter_ids, 0);
                    let delta = row_matmul(row_matmul(x, pick(a)), pick(b));
                    let dims = delta.dims();
                    delta * pick(scale).broadcast_in_dim(&dims, &[0])
                }
                LoraSelect::OneHot => {
                    // Every entry's x·A ([rows, t, entries, rank]), kept for
                    // the row's entry by a select on its one-hot, contracted
                    // over (entry, rank) with every entry's B: the tables
                    // are read once, nothing is built per row. Other entries
                    // add exact zeros. A select, not a product with the
                    // one-hot: another entry's x·A may overflow to inf
                    // (0 · inf is NaN), and no row may read what another
                    // entry computes.
                    let entries = a.dims()[0];
                    let one_hot = iota(TensorType::new(DType::I32, [rows, entries]), 1)
                        .eq(self.adapter_ids.broadcast_in_dim(&[rows, entries], &[0]));
                    let contract = |lhs: Vec<i64>, rhs: Vec<i64>| DotGeneral {
                        lhs_batch: vec![],
                        rhs_batch: vec![],
                        lhs_contracting: lhs,
                        rhs_contracting: rhs,
                        precision: None,
                        preferred_element_type: None,
                    };
                    let xa = x.dot_general(a, contract(vec![2], vec![1]));
                    let dims = xa.dims();
                    let xa = one_hot
                        .broadcast_in_dim(&dims, &[0, 2])
                        .where_(xa, xa.scalar_like(0.0));
                    let delta = xa.dot_general(b, contract(vec![2, 3], vec![0, 1]));
                    let scales = scale.broadcast_in_dim(&[rows, entries], &[1]);
                    let row_scale = one_hot.where_(scales, scales.scalar_like(0.0)).sum(&[1]);
                    let dims = delta.dims();
                    delta * row_scale.broadcast_in_dim(&dims, &[0])
                }
            };
            debug_assert_eq!(delta.dims()[..2], [rows, t]);
            y + delta.cast(y.dtype())
        })
    }

    /// Hidden states `[rows, t, hidden]` after the last norm, for
    /// `input_ids: [rows, t]` at `positions: [rows, t]`; `attend(layer,
    /// (q, k, v))` is each layer's attention (and cache update).
    fn hidden(
        &self,
        input_ids: Tensor,
        positions: Tensor,
        dtype: DType,
        mut attend: impl FnMut(i64, (Tensor, Tensor, Tensor)) -> Tensor,
    ) -> Tensor {
        let c = self.model.config;
        let p = self.p;
        let mut h = self.model.embed(p, input_ids, dtype);
        let rotary = scope("model.rotary_emb", || {
            self.model.rotary_at(positions, dtype)
        });
        let proj = |module: &str, short: &str, x: Tensor| self.proj(module, short, x);
        for l in 0..c.num_hidden_layers {
            let prefix = format!("model.layers.{l}");
            let (cos, sin) = rotary.of(c.layer_types[l as usize]);
            let rope = |y: Tensor| apply_rotary(y, cos, sin, &[0, 2, 3]);
            h = scope(&prefix, || {
                self.model.layer_with_mlp(
                    p,
                    &prefix,
                    h,
                    |x| {
                        let a = format!("{prefix}.self_attn");
                        let qkv = self.model.qkv_with(p, &a, x, rope, &proj);
                        proj(&format!("{a}.o_proj"), "o_proj", attend(l, qkv))
                    },
                    |x| self.model.mlp_with(&format!("{prefix}.mlp"), x, &proj),
                )
            });
        }
        scope("model.norm", || self.model.norm(p, "model.norm", h))
    }

    /// Logits `[rows, vocab]` (f32) of hidden states `[rows, hidden]`.
    fn logits(&self, h: Tensor) -> Tensor {
        self.model.lm_head(self.p, h).cast(DType::F32)
    }
}

/// The inputs every serving program starts with: weights and tables
/// (read only), then the caches (donated).
fn common_inputs(
    config: &ModelConfig,
    dtype: DType,
    slots: i64,
    max_len: i64,
    tables: &AdapterTables,
) -> Vec<(String, TensorType, Role)> {
    let mut inputs: Vec<(String, TensorType, Role)> = base_parameter_types(config, dtype)
        .into_iter()
        .map(|(n, t)| (n, t, Role::Weight))
        .collect();
    inputs.extend(
        adapter_table_types(config, tables)
            .into_iter()
            .map(|(n, t)| (n, t, Role::AdapterTable)),
    );
    inputs.extend(cache_inputs(config, dtype, slots, max_len));
    inputs
}

/// The caches as program inputs (`Role::KvCache`: donated where the
/// program returns them).
fn cache_inputs(
    config: &ModelConfig,
    dtype: DType,
    slots: i64,
    max_len: i64,
) -> Vec<(String, TensorType, Role)> {
    super::cache_types(config, slots, max_len, dtype)
        .into_iter()
        .map(|(n, t)| (n, t, Role::KvCache))
        .collect()
}

/// Per-row sampling inputs: `temperature` (f32), `top_k` (i32), `top_p`
/// (f32), `seed` (u32), each `[rows]`.
fn sampling_inputs(rows: i64) -> [(String, TensorType, Role); 4] {
    [
        ("temperature", DType::F32),
        ("top_k", DType::I32),
        ("top_p", DType::F32),
        ("seed", DType::U32),
    ]
    .map(|(n, d)| (n.to_string(), TensorType::new(d, [rows]), Role::Control))
}

/// The prefill program of one chunk of one request's prompt: `input_ids:
/// [1, chunk]` (right-padded; `length []` real tokens) at positions `start
/// []` onwards of slot `slot []`, with adapter entry `adapter_ids: [1]`.
/// The chunk's keys and values are written at `start..start + chunk` (the
/// caller keeps that inside the cache; padding's are overwritten before
/// they are read), with NaN and infinities as 0 ([`finite_or_zero`]); its
/// queries attend, causally, to the slot's row as written: the prompt's
/// first `start` positions (earlier chunks, or a prefix copied from another
/// slot by [`slot_read_step`] and [`slot_write_step`]) and the chunk.
/// Positions after the chunk may hold what the slot's last request left:
/// they are masked out of attention, and since no cache ever holds a
/// non-finite value their weight of exactly 0 adds exactly 0. The first
/// token is sampled from the last real token (noise counter `start +
/// length`, the prompt's length when this is its last chunk). Outputs:
/// `next [1]` (-1 where the logits are not finite, see [`finite_or_flag`];
/// meaningful only for a prompt's last chunk), the caches. A short prompt
/// is one chunk from `start` 0.
pub fn slot_prefill_step(
    config: &ModelConfig,
    dtype: DType,
    slots: i64,
    max_len: i64,
    chunk: i64,
    tables: &AdapterTables,
) -> Result<Step, TraceError> {
    let mut inputs = common_inputs(config, dtype, slots, max_len, tables);
    for (n, ty) in [
        ("input_ids", TensorType::new(DType::I32, [1, chunk])),
        ("start", TensorType::scalar(DType::I32)),
        ("length", TensorType::scalar(DType::I32)),
        ("slot", TensorType::scalar(DType::I32)),
        ("adapter_ids", TensorType::new(DType::I32, [1])),
    ] {
        inputs.push((n.to_string(), ty, Role::Control));
    }
    inputs.extend(sampling_inputs(1));
    let select = tables.select;
    let c = config;
    step_of("llama_prefill_slot", inputs, |i| {
        let p = Params(i);
        let s = Serving::new(config, &p, select);
        let (start, length) = (i["start"], i["length"]);
        let positions = iota(TensorType::new(DType::I32, [1, chunk]), 1)
            + start.broadcast_in_dim(&[1, chunk], &[]);
        let keys = iota(TensorType::new(DType::I32, [chunk, max_len]), 1);
        let queries = iota(TensorType::new(DType::I32, [chunk, max_len]), 0)
            + start.broadcast_in_dim(&[chunk, max_len], &[]);
        let visible = s.model.visibility(keys.le(queries), keys, queries);
        let row = [1, c.num_key_value_heads, max_len, c.head_dim];
        let zero = start.scalar_like(0.0);
        let mut caches = Vec::new();
        let h = s.hidden(i["input_ids"], positions, dtype, |l, (q, k, v)| {
            let mut kv = Vec::new();
            for (name, new) in [("k", k), ("v", v)] {
                let name = format!("cache.layers.{l}.{name}");
                let cache = i[name.as_str()];
                // Written in place (the cache is donated and this is its
                // only use), then the slot's row read back from the result.
                let updated = cache.dynamic_update_slice(
                    finite_or_zero(new.cast(cache.dtype())),
                    &[i["slot"], zero, start, zero],
                );
                let mine = updated.dynamic_slice(&[i["slot"], zero, zero, zero], &row);
                kv.push(mine.cast(dtype));
                caches.push((name, updated));
            }
            let kind = config.layer_types[l as usize];
            s.model
                .attend((q, kv[0], kv[1]), (visible.of(kind), &[3, 4]))
        });
        let hidden = config.hidden_size;
        let last = h
            .dynamic_slice(&[zero, length - 1.0, zero], &[1, 1, hidden])
            .reshape(&[1, hidden]);
        let logits = s.logits(last);
        let uniform = hashed_uniform(
            i["seed"],
            (start + length).broadcast_in_dim(&[1], &[]),
            config.vocab_size,
        );
        let next = scope("sample", || {
            let next = sample_rows(logits, i["temperature"], i["top_k"], i["top_p"], uniform);
            finite_or_flag(logits, next)
        });
        with_caches(Outputs::new().add("next", next), caches)
    })
}

/// The program that reads the first `length []` positions of slot `src
/// []` (a shared prompt prefix: the same tokens under the same adapter have
/// the same keys and values), zeros after them: inputs the caches (read
/// only), `src`, `length`; outputs `row.<cache>` `[1, kv_heads, max_len,
/// head_dim]` per cache, for [`slot_write_step`]. Two programs rather than
/// one: a program that reads a cache and writes it again is given a copy
/// of the whole cache by XLA (measured: 0.3 s a call on the CPU for 400 MB
/// of caches), one that only writes updates it in place.
pub fn slot_read_step(
    config: &ModelConfig,
    dtype: DType,
    slots: i64,
    max_len: i64,
) -> Result<Step, TraceError> {
    let mut inputs = cache_inputs(config, dtype, slots, max_len);
    let caches: Vec<String> = inputs.iter().map(|(n, _, _)| n.clone()).collect();
    for n in ["src", "length"] {
        inputs.push((n.to_string(), TensorType::scalar(DType::I32), Role::Control));
    }
    step_of("kv_prefix_read", inputs, |i| {
        let row = [1, config.num_key_value_heads, max_len, config.head_dim];
        let at = iota(TensorType::new(DType::I32, row), 2);
        let shared = at.lt(i["length"].broadcast_in_dim(&row, &[]));
        let zero = i["length"].scalar_like(0.0);
        let mut out = Outputs::new();
        for n in &caches {
            let src = i[n.as_str()].dynamic_slice(&[i["src"], zero, zero, zero], &row);
            out = out.add(format!("row.{n}"), shared.where_(src, src.scalar_like(0.0)));
        }
        out
    })
}

/// The program that writes rows read by [`slot_read_step`] into slot
/// `dst []`: inputs the caches (donated), `row.<cache>` each, `dst`;
/// outputs the caches.
pub fn slot_write_step(
    config: &ModelConfig,
    dtype: DType,
    slots: i64,
    max_len: i64,
) -> Result<Step, TraceError> {
    let row = [1, config.num_key_value_heads, max_len, config.head_dim];
    let mut inputs = cache_inputs(config, dtype, slots, max_len);
    let caches: Vec<String> = inputs.iter().map(|(n, _, _)| n.clone()).collect();
    for n in &caches {
        inputs.push((
            format!("row.{n}"),
            TensorType::new(dtype, row),
            Role::Control,
        ));
    }
    inputs.push(("dst".into(), TensorType::scalar(DType::I32), Role::Control));
    step_of("kv_prefix_write", inputs, |i| {
        let zero = i["dst"].scalar_like(0.0);
        let mut out = Outputs::new();
        for n in &caches {
            let written = i[n.as_str()].dynamic_update_slice(
                i[format!("row.{n}").as_str()],
                &[i["dst"], zero, zero, zero],
            );
            out = out.add(n, written);
        }
        out
    })
}

/// The decode program of the first `rows` slots (those that run; a free
/// slot among them computes too and its token is ignored; given position
/// `max_len` it writes nothing; what it writes is finite, see
/// [`finite_or_zero`]): `input_ids: [rows]` (each slot's last
/// token) at `positions: [rows]` (where it goes in the slot's cache) with
/// adapter entries `adapter_ids: [rows]`; each slot attends to its cache up
/// to its position and samples its next token (noise counter `position +
/// 1`). Outputs: `next [rows]` (-1 for a row whose logits are not finite),
/// the caches (the other slots' rows unchanged). Fewer rows read less of
/// the cache: the batcher picks the smallest program that covers its
/// running slots.
pub fn slot_decode_step(
    config: &ModelConfig,
    dtype: DType,
    slots: i64,
    rows: i64,
    max_len: i64,
    tables: &AdapterTables,
) -> Result<Step, TraceError> {
    let mut inputs = common_inputs(config, dtype, slots, max_len, tables);
    for n in ["input_ids", "positions", "adapter_ids"] {
        inputs.push((
            n.to_string(),
            TensorType::new(DType::I32, [rows]),
            Role::Control,
        ));
    }
    inputs.extend(sampling_inputs(rows));
    let select = tables.select;
    let c = config;
    step_of("llama_decode_slots", inputs, |i| {
        let p = Params(i);
        let s = Serving::new(config, &p, select);
        let pos = i["positions"];
        let keys = iota(TensorType::new(DType::I32, [rows, 1, max_len]), 2);
        let queries = pos.broadcast_in_dim(&[rows, 1, max_len], &[0]);
        let visible = s.model.visibility(keys.le(queries), keys, queries);
        let shape = [rows, c.num_key_value_heads, max_len, c.head_dim];
        let here =
            iota(TensorType::new(DType::I32, shape), 2).eq(pos.broadcast_in_dim(&shape, &[0]));
        let zero = pos.scalar_like(0.0);
        let mut caches = Vec::new();
        let h = s.hidden(
            i["input_ids"].reshape(&[rows, 1]),
            pos.reshape(&[rows, 1]),
            dtype,
            |l, (q, k, v)| {
                let mut kv = Vec::new();
                for (name, new) in [("k", k), ("v", v)] {
                    let name = format!("cache.layers.{l}.{name}");
                    let cache = i[name.as_str()];
                    let mine = if rows == slots {
                        cache
                    } else {
                        cache.slice(&[0, 0, 0, 0], &shape)
                    };
                    // Each slot writes at its own position: a select, not
                    // one dynamic_update_slice for all.
                    let new = finite_or_zero(new.cast(cache.dtype()))
                        .reshape(&[rows, c.num_key_value_heads, c.head_dim])
                        .broadcast_in_dim(&shape, &[0, 1, 3]);
                    let updated = here.where_(new, mine);
                    kv.push(updated.cast(dtype));
                    let whole = if rows == slots {
                        updated
                    } else {
                        cache.dynamic_update_slice(updated, &[zero, zero, zero, zero])
                    };
                    caches.push((name, whole));
                }
                let kind = c.layer_types[l as usize];
                s.model
                    .attend((q, kv[0], kv[1]), (visible.of(kind), &[0, 3, 4]))
            },
        );
        let logits = s.logits(h.reshape(&[rows, c.hidden_size]));
        let uniform = hashed_uniform(i["seed"], pos + 1.0, c.vocab_size);
        let next = scope("sample", || {
            let next = sample_rows(logits, i["temperature"], i["top_k"], i["top_p"], uniform);
            finite_or_flag(logits, next)
        });
        with_caches(Outputs::new().add("next", next), caches)
    })
}

/// `x` with every NaN or infinite value replaced by 0: what the serving
/// programs write into a cache. A cache then never holds a non-finite
/// value, so a position masked out of attention (weight exactly 0) adds
/// exactly 0 whoever wrote it; 0 · NaN would be NaN. A select on the few
/// values written, not on the whole row read (which costs a copy of it
/// every step).
pub fn finite_or_zero(x: Tensor) -> Tensor {
    x.is_finite().where_(x, x.scalar_like(0.0))
}

/// `next` where a row's logits are all finite, else -1: a request whose
/// adapter or prompt overflows is told so instead of getting the token an
/// argmax over NaN happens to give.
pub fn finite_or_flag(logits: Tensor, next: Tensor) -> Tensor {
    let finite = logits.is_finite().cast(DType::I32).min(&[1]);
    finite
        .eq(finite.scalar_like(1.0))
        .where_(next, next.scalar_like(-1.0))
}

/// The program that writes one adapter into entry `entry []` of every
/// table (donated): inputs are the tables, then `entry`, then per table
/// the new entry (`<table>.new`: A `[in, max_rank]`, B `[max_rank, out]`,
/// scale `[]`). Outputs: the tables.
pub fn table_update_step(config: &ModelConfig, tables: &AdapterTables) -> Result<Step, TraceError> {
    let types = adapter_table_types(config, tables);
    let mut inputs: Vec<(String, TensorType, Role)> = types
        .iter()
        .map(|(n, t)| (n.clone(), t.clone(), Role::AdapterTable))
        .collect();
    inputs.push((
        "entry".into(),
        TensorType::scalar(DType::I32),
        Role::Control,
    ));
    for (n, t) in &types {
        inputs.push((
            format!("{n}.new"),
            TensorType::new(t.dtype, t.dims[1..].to_vec()),
            Role::Control,
        ));
    }
    step_of("lora_tables_update", inputs, |i| {
        let mut out = Outputs::new();
        for (n, t) in &types {
            let mut dims = vec![1];
            dims.extend(&t.dims[1..]);
            let new = i[format!("{n}.new").as_str()].reshape(&dims);
            let zero = i["entry"].scalar_like(0.0);
            let mut starts = vec![i["entry"]];
            starts.extend(std::iter::repeat_n(zero, dims.len() - 1));
            out = out.add(n, i[n.as_str()].dynamic_update_slice(new, &starts));
        }
        out
    })
}
