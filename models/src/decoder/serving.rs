//! Serving many requests and many LoRA adapters with one base model: the
//! programs of continuous batching (Orca) with stacked adapter tables
//! (S-LoRA, Punica).
//!
//! The KV cache has one *slot* per running request (`[slots, kv_heads,
//! max_len, head_dim]` per layer). Each engine step is one program
//! ([`slot_step`]): every running request advances one token (a decode row,
//! each slot at its own position), and one chunk of a joining request's
//! prompt (padded on the right to a length bucket, attending to what its
//! slot already holds) is written into its slot, all through the same
//! projections, so the weights are read once a step. A prompt's last chunk
//! samples its first token; a prompt prefix another slot holds (same
//! tokens, same adapter) is copied instead of computed ([`slot_read_step`],
//! [`slot_write_step`]). Every adapter lives in
//! device-resident tables, one per projection (`lora_tables.<module>.a`
//! `[entries, in, max_rank]`, `.b` `[entries, max_rank, out]`, `.scale`
//! `[entries]`); entry 0 is all zero (the base model), an adapter of lower
//! rank is zero-padded (which adds exact zeros), a module it does not target
//! is zero. Each row picks its entry by index, so one batch mixes adapters
//! of different ranks and targets, and loading an adapter is one donated
//! update program. A row's tokens depend only on its own inputs: sampling
//! noise is a hash of the request's seed and token count.

use hlo_ir::ops::DotGeneral;
use hlo_ir::{iota, scope, DType, Inputs, Outputs, Tensor, TensorType, TraceError};

use super::decode::{decoder, hashed_uniform, sample_rows, step_of, with_caches};
use super::model::{add_lora, apply_rotary, batched_matmul, PerLayerType};
use super::{base_parameter_types, Decoder, ModelConfig, Params, Projection};
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

/// Every projection of every layer (see [`ModelConfig::layer_projections`]).
pub fn projections(config: &ModelConfig) -> Vec<Projection> {
    (0..config.num_hidden_layers)
        .flat_map(|l| config.layer_projections(l))
        .collect()
}

/// The table names of a projection: `lora_tables.<module>.{a,b,scale}`.
pub fn table_names(module: &str) -> [String; 3] {
    ["a", "b", "scale"].map(|t| format!("lora_tables.{module}.{t}"))
}

/// The adapter tables (f32) of every projection: see the module's docs.
pub fn adapter_table_types(config: &ModelConfig, t: &AdapterTables) -> Vec<(String, TensorType)> {
    let mut out = Vec::new();
    for Projection {
        module,
        dims: (din, dout),
        ..
    } in projections(config)
    {
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
    /// each row's adapter entry in `adapter_ids` (`[rows]`).
    fn new(
        config: &'a ModelConfig,
        p: &'a Params<'a>,
        select: LoraSelect,
        adapter_ids: Tensor,
    ) -> Serving<'a> {
        Serving {
            model: decoder(config),
            p,
            adapter_ids,
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
                    let delta = batched_matmul(batched_matmul(x, pick(a)), pick(b));
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
            add_lora(y, delta)
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
                        let out = self.model.attention_output(attend(l, qkv));
                        proj(&format!("{a}.o_proj"), "o_proj", out)
                    },
                    |x| self.model.mlp_with(p, &format!("{prefix}.mlp"), x, &proj),
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

/// The program of one engine step: `rows` decode rows (0 for none) and one
/// chunk of `chunk` prompt tokens (0 for none), run together so that the
/// weights are read once a step however the step's tokens are split
/// (vLLM's mixed batch). The step's tokens go through the projections and
/// the MLPs as one batch of `rows + chunk` tokens; only attention is done
/// apart, the rows against their slots and the chunk against its slot.
///
/// Inputs after the weights, tables and caches (donated):
/// - `input_ids: [rows + chunk]`: each decode row's last token, then the
///   chunk (right-padded; `length []` real tokens);
/// - decode rows (when `rows > 0`): `positions: [rows]`, where each row's
///   token goes in its slot's cache. The rows are the first `rows` slots;
///   a free one, or one whose prompt is still being prefilled, is given
///   position `max_len` and writes nothing; its token is ignored;
/// - the chunk (when `chunk > 0`): `start []`, `length []` and `slot []`:
///   its tokens are positions `start..start + chunk` of slot `slot` (the
///   caller keeps that inside the cache; padding's keys and values are
///   overwritten before they are read);
/// - `adapter_ids` and the sampling inputs, one per row and then one for
///   the chunk: `[rows + (chunk > 0)]`.
///
/// Keys and values are written into the caches with NaN and infinities as
/// 0 ([`finite_or_zero`]). Each decode row attends to its slot up to its
/// position; the chunk's queries attend, causally, to its slot as written:
/// the prompt's first `start` positions (earlier chunks, or a prefix copied
/// from another slot by [`slot_read_step`] and [`slot_write_step`]) and the
/// chunk. Positions after a query may hold what the slot's last request
/// left: they are masked out, and since no cache ever holds a non-finite
/// value their weight of exactly 0 adds exactly 0. Each row samples its
/// next token (noise counter `position + 1`), the chunk its last real
/// token's (counter `start + length`: the prompt's length when this is its
/// last chunk). Outputs: `next [rows + (chunk > 0)]` (-1 where the logits
/// are not finite, see [`finite_or_flag`]; the chunk's is meaningful only
/// for a prompt's last chunk), the caches (other slots' rows unchanged).
/// Fewer rows read less of the cache: the batcher picks the smallest row
/// count that covers its decoding slots.
pub fn slot_step(
    config: &ModelConfig,
    dtype: DType,
    slots: i64,
    max_len: i64,
    rows: i64,
    chunk: i64,
    tables: &AdapterTables,
) -> Result<Step, TraceError> {
    if rows < 0 || rows > slots || chunk < 0 || chunk > max_len || rows + chunk == 0 {
        return Err(TraceError {
            op: "slot_step".into(),
            scope: String::new(),
            operands: vec![],
            message: format!(
                "{rows} decode rows of {slots} slots and a {chunk}-token chunk of a {max_len}-position cache"
            ),
        });
    }
    let shape = StepShape {
        slots,
        max_len,
        rows,
        chunk,
    };
    let inputs = slot_step_inputs(config, dtype, shape, tables);
    let name = match (rows, chunk) {
        (_, 0) => "llama_decode_slots",
        (0, _) => "llama_prefill_slot",
        _ => "llama_step_slots",
    };
    step_of(name, inputs, |i| {
        slot_step_body(config, dtype, shape, tables.select, i)
    })
}

/// The shape of one engine step ([`slot_step`]): `rows` decode rows and a
/// chunk of `chunk` prompt tokens over caches of `slots` slots of
/// `max_len` positions.
#[derive(Clone, Copy)]
struct StepShape {
    slots: i64,
    max_len: i64,
    rows: i64,
    chunk: i64,
}

impl StepShape {
    /// The tokens the step runs: the decode rows', then the chunk's.
    fn tokens(self) -> i64 {
        self.rows + self.chunk
    }

    /// The tokens the step samples: one per decode row, one for the chunk.
    fn outs(self) -> i64 {
        self.rows + i64::from(self.chunk > 0)
    }
}

/// The inputs of [`slot_step`]: the weights, tables and caches, then its
/// control inputs and the sampling inputs of each token it samples.
fn slot_step_inputs(
    config: &ModelConfig,
    dtype: DType,
    sh: StepShape,
    tables: &AdapterTables,
) -> Vec<(String, TensorType, Role)> {
    let mut inputs = common_inputs(config, dtype, sh.slots, sh.max_len, tables);
    let mut control = vec![("input_ids", TensorType::new(DType::I32, [sh.tokens()]))];
    if sh.rows > 0 {
        control.push(("positions", TensorType::new(DType::I32, [sh.rows])));
    }
    if sh.chunk > 0 {
        for name in ["start", "length", "slot"] {
            control.push((name, TensorType::scalar(DType::I32)));
        }
    }
    control.push(("adapter_ids", TensorType::new(DType::I32, [sh.outs()])));
    for (name, ty) in control {
        inputs.push((name.to_string(), ty, Role::Control));
    }
    inputs.extend(sampling_inputs(sh.outs()));
    inputs
}

/// The program of [`slot_step`] on its inputs `i`: every token through
/// the layers, each layer's attention and cache writes by [`SlotLayers`],
/// then the sampled tokens and the caches.
fn slot_step_body(
    c: &ModelConfig,
    dtype: DType,
    sh: StepShape,
    select: LoraSelect,
    i: &Inputs,
) -> Outputs {
    let p = Params(i);
    let n = sh.tokens();
    let zero = i["input_ids"].scalar_like(0.0).reshape(&[]);
    let (positions, entries) = token_positions(sh, i);
    let s = Serving::new(c, &p, select, Tensor::concat(&entries, 0));
    let layers = SlotLayers::new(&s, i, sh, dtype, zero);
    let mut caches = Vec::new();
    let h = s.hidden(
        i["input_ids"].reshape(&[n, 1]),
        Tensor::concat(&positions, 0).reshape(&[n, 1]),
        dtype,
        |l, qkv| layers.layer(l, qkv, &mut caches),
    );
    let next = sample_next(&s, h, sh, i, zero);
    with_caches(Outputs::new().add("next", next), caches)
}

/// Each token's position and adapter entry, as the parts to concatenate:
/// the decode rows' (`positions` and their `adapter_ids`), then the
/// chunk's (`start..start + chunk`, its entry for each of its tokens).
fn token_positions(sh: StepShape, i: &Inputs) -> (Vec<Tensor>, Vec<Tensor>) {
    let (rows, chunk) = (sh.rows, sh.chunk);
    let chunk_range = || iota(TensorType::new(DType::I32, [chunk]), 0);
    let mut positions = Vec::new();
    let mut entries = Vec::new();
    let ids = i["adapter_ids"];
    if rows > 0 {
        positions.push(i["positions"]);
        entries.push(ids.slice(&[0], &[rows]));
    }
    if chunk > 0 {
        positions.push(chunk_range() + i["start"].broadcast_in_dim(&[chunk], &[]));
        entries.push(
            ids.slice(&[rows], &[sh.outs()])
                .reshape(&[])
                .broadcast_in_dim(&[chunk], &[]),
        );
    }
    (positions, entries)
}

/// The next token of each decode row and of the chunk's last real token
/// (`[rows + (chunk > 0)]`, -1 where the logits are not finite), from the
/// hidden states `h` of every token.
fn sample_next(s: &Serving, h: Tensor, sh: StepShape, i: &Inputs, zero: Tensor) -> Tensor {
    let c = s.model.config;
    let (n, rows) = (sh.tokens(), sh.rows);
    let hidden = c.hidden_size;
    let h = h.reshape(&[n, hidden]);
    // The rows' hidden states, then the chunk's last real token's.
    let mut last = Vec::new();
    let mut counters = Vec::new();
    if rows > 0 {
        last.push(h.slice(&[0, 0], &[rows, hidden]));
        counters.push(i["positions"] + 1.0);
    }
    if sh.chunk > 0 {
        let (start, length) = (i["start"], i["length"]);
        last.push(h.dynamic_slice(&[length - 1.0 + rows as f64, zero], &[1, hidden]));
        counters.push((start + length).broadcast_in_dim(&[1], &[]));
    }
    let logits = s.logits(Tensor::concat(&last, 0));
    let uniform = hashed_uniform(i["seed"], Tensor::concat(&counters, 0), c.vocab_size);
    scope("sample", || {
        let next = sample_rows(logits, i["temperature"], i["top_k"], i["top_p"], uniform);
        finite_or_flag(logits, next)
    })
}

/// What every layer of a [`slot_step`] shares: the serving layers, the
/// step's inputs and shape, and which cache positions each query sees.
struct SlotLayers<'a> {
    s: &'a Serving<'a>,
    i: &'a Inputs,
    sh: StepShape,
    dtype: DType,
    /// The scalar 0 (i32) of dynamic slices' start indices.
    zero: Tensor,
    /// The cache positions each decode row sees (`[rows, 1, max_len]`).
    decode_visible: Option<PerLayerType<Tensor>>,
    /// The cache positions each chunk query sees (`[chunk, max_len]`).
    chunk_visible: Option<PerLayerType<Tensor>>,
    /// Where each decode row's token goes in its slot's cache
    /// (`[rows, kv_heads, max_len, head_dim]`).
    here: Option<Tensor>,
}

impl<'a> SlotLayers<'a> {
    /// Decode rows see their slot up to their position; the chunk's
    /// queries see its slot up to their own.
    fn new(
        s: &'a Serving<'a>,
        i: &'a Inputs,
        sh: StepShape,
        dtype: DType,
        zero: Tensor,
    ) -> SlotLayers<'a> {
        let c = s.model.config;
        let (rows, chunk, max_len) = (sh.rows, sh.chunk, sh.max_len);
        let decode_visible = (rows > 0).then(|| {
            let keys = iota(TensorType::new(DType::I32, [rows, 1, max_len]), 2);
            let queries = i["positions"].broadcast_in_dim(&[rows, 1, max_len], &[0]);
            s.model.visibility(keys.le(queries), keys, queries)
        });
        let chunk_visible = (chunk > 0).then(|| {
            let keys = iota(TensorType::new(DType::I32, [chunk, max_len]), 1);
            let queries = iota(TensorType::new(DType::I32, [chunk, max_len]), 0)
                + i["start"].broadcast_in_dim(&[chunk, max_len], &[]);
            s.model.visibility(keys.le(queries), keys, queries)
        });
        let shape = [rows, c.num_key_value_heads, max_len, c.head_dim];
        let here = (rows > 0).then(|| {
            iota(TensorType::new(DType::I32, shape), 2)
                .eq(i["positions"].broadcast_in_dim(&shape, &[0]))
        });
        SlotLayers {
            s,
            i,
            sh,
            dtype,
            zero,
            decode_visible,
            chunk_visible,
            here,
        }
    }

    /// Layer `l`'s attention of `(q, k, v)` (q: `[n, heads, 1, d]`; k, v:
    /// `[n, kv_heads, 1, d]`): its keys and values written into the
    /// caches (pushed to `caches`), then each part's attention.
    fn layer(
        &self,
        l: i64,
        (q, k, v): (Tensor, Tensor, Tensor),
        caches: &mut Vec<(String, Tensor)>,
    ) -> Tensor {
        let ((q_d, q_c), (k_d, k_c), (v_d, v_c)) = (self.split(q), self.split(k), self.split(v));
        let (mut decode_kv, mut chunk_kv) = (Vec::new(), Vec::new());
        for (short, new_d, new_c) in [("k", k_d, k_c), ("v", v_d, v_c)] {
            let name = format!("cache.layers.{l}.{short}");
            let (cache, decode, chunk) = self.write_cache(self.i[name.as_str()], new_d, new_c);
            decode_kv.extend(decode);
            chunk_kv.extend(chunk);
            caches.push((name, cache));
        }
        self.attend(l, (q_d, q_c), &decode_kv, &chunk_kv)
    }

    /// `x` (`[n, h, 1, d]`) split into the decode rows' (`[rows, h, 1,
    /// d]`) and the chunk's (`[1, h, chunk, d]`).
    fn split(&self, x: Tensor) -> (Option<Tensor>, Option<Tensor>) {
        let (n, rows) = (self.sh.tokens(), self.sh.rows);
        let d = x.dims();
        let decode = (rows > 0).then(|| x.slice(&[0, 0, 0, 0], &[rows, d[1], 1, d[3]]));
        let prompt = (self.sh.chunk > 0).then(|| {
            x.slice(&[rows, 0, 0, 0], &[n, d[1], 1, d[3]])
                .transpose(&[2, 1, 0, 3])
        });
        (decode, prompt)
    }

    /// One cache with the chunk's keys or values `new_c` and the decode
    /// rows' `new_d` written (non-finite values as 0), and what attention
    /// reads of it: the decode rows' slots and the chunk's slot (in the
    /// step's dtype).
    fn write_cache(
        &self,
        mut cache: Tensor,
        new_d: Option<Tensor>,
        new_c: Option<Tensor>,
    ) -> (Tensor, Option<Tensor>, Option<Tensor>) {
        let c = self.s.model.config;
        let (zero, i, sh) = (self.zero, self.i, self.sh);
        let (kv_heads, rows) = (c.num_key_value_heads, sh.rows);
        let shape = [rows, kv_heads, sh.max_len, c.head_dim];
        let (mut decode, mut chunk) = (None, None);
        // The chunk is written in place (the cache is donated),
        // at its slot and start.
        if let Some(new) = new_c {
            cache = cache.dynamic_update_slice(
                finite_or_zero(new.cast(cache.dtype())),
                &[i["slot"], zero, i["start"], zero],
            );
        }
        // Each decode row writes at its own position: a select,
        // not one dynamic_update_slice for all.
        if let (Some(new), Some(here)) = (new_d, self.here) {
            let mine = if rows == sh.slots {
                cache
            } else {
                cache.slice(&[0, 0, 0, 0], &shape)
            };
            let new = finite_or_zero(new.cast(cache.dtype()))
                .reshape(&[rows, kv_heads, c.head_dim])
                .broadcast_in_dim(&shape, &[0, 1, 3]);
            let updated = here.where_(new, mine);
            decode = Some(updated.cast(self.dtype));
            cache = if rows == sh.slots {
                updated
            } else {
                cache.dynamic_update_slice(updated, &[zero, zero, zero, zero])
            };
        }
        // The chunk's slot read back from the written cache
        // (reading it from the operand would cost a copy of
        // the whole cache).
        if sh.chunk > 0 {
            let row = [1, kv_heads, sh.max_len, c.head_dim];
            let mine = cache.dynamic_slice(&[i["slot"], zero, zero, zero], &row);
            chunk = Some(mine.cast(self.dtype));
        }
        (cache, decode, chunk)
    }

    /// Layer `l`'s attention output (`[rows + chunk, 1, heads·d]`): the
    /// decode rows' queries `q_d` against their slots (`decode_kv`, keys
    /// then values), then the chunk's `q_c` against its slot (`chunk_kv`).
    fn attend(
        &self,
        l: i64,
        (q_d, q_c): (Option<Tensor>, Option<Tensor>),
        decode_kv: &[Tensor],
        chunk_kv: &[Tensor],
    ) -> Tensor {
        let (s, chunk) = (self.s, self.sh.chunk);
        let kind = s.model.config.layer_types[l as usize];
        let attn = format!("model.layers.{l}.self_attn");
        let mut out = Vec::new();
        if let (Some(q), Some(visible)) = (q_d, &self.decode_visible) {
            out.push(s.model.attend(
                s.p,
                &attn,
                (q, decode_kv[0], decode_kv[1]),
                (visible.of(kind), &[0, 3, 4]),
            ));
        }
        if let (Some(q), Some(visible)) = (q_c, &self.chunk_visible) {
            let a = s.model.attend(
                s.p,
                &attn,
                (q, chunk_kv[0], chunk_kv[1]),
                (visible.of(kind), &[3, 4]),
            );
            // [1, chunk, heads·d] → [chunk, 1, heads·d]
            out.push(a.reshape(&[chunk, 1, a.dims()[2]]));
        }
        Tensor::concat(&out, 0)
    }
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
