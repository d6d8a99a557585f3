//! Generation with a KV cache kept on the devices: one prefill program
//! over the (left-padded) prompts, then one decode program per token, the
//! caches updated in place and the next token sampled on the devices.
//! Weights are uploaded once, laid out by the family's partition rules;
//! programs are compiled per shape bucket and kept.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::time::Instant;

use hlo_ir::{DType, Literal, TensorType};
use hlo_models::adapter::Adapter;
use hlo_models::decoder::{
    base_parameter_types, decode_step, forward_step, lora_parameter_types, partition_rules,
    LoraConfig, ModelConfig,
};
use hlo_models::roles::{Role, Step};
use hlo_partitioner::PartitionSpec;
use hlo_runtime::{DeviceArray, Eager, EagerStats, HostArray, Mode, Program};

use crate::device::backend::Backend;
use crate::device::pipeline::ShardedStep;
use crate::error::Result;

/// How the next token is chosen (on the device; see
/// [`hlo_models::decoder::sample_tokens`]).
#[derive(Clone, Debug, Default)]
pub struct Sampling {
    /// None (with no top-k or top-p): greedy. 0 is greedy too.
    pub temperature: Option<f64>,
    pub top_k: Option<u32>,
    pub top_p: Option<f64>,
    pub seed: u64,
}

impl Sampling {
    /// The temperature the sampler uses (0: greedy).
    pub fn temperature(&self) -> f64 {
        match self.temperature {
            Some(t) => t,
            None if self.top_k.is_some() || self.top_p.is_some() => 1.0,
            None => 0.0,
        }
    }
}

/// Prompt lengths are padded up to a bucket so a new length rarely means
/// a new program: powers of two from 16.
pub(crate) fn prompt_bucket(len: usize) -> i64 {
    len.next_power_of_two().max(16) as i64
}

/// The cache's length for a bucket and a number of new tokens: a multiple
/// of 128 (again so that programs are shared).
pub(crate) fn cache_bucket(prompt_bucket: i64, max_new: usize) -> i64 {
    (prompt_bucket + max_new as i64 + 127) / 128 * 128
}

/// Appends each row's sampled token in `next` to its completion (`out`),
/// marking rows that end (`done`: a `stop` token) or fail (`failed`: the
/// program's -1 for logits that are not finite, replaced by 0 in `next`,
/// which feeds the next step).
fn take_tokens(
    next: &mut [i32],
    (out, failed, done): (&mut [Vec<u32>], &mut [Option<usize>], &mut [bool]),
    stop: &[u32],
) {
    for (r, tok) in next.iter_mut().enumerate() {
        if done[r] {
            continue;
        }
        match u32::try_from(*tok) {
            Ok(t) => {
                out[r].push(t);
                done[r] = stop.contains(&t);
            }
            Err(_) => {
                failed[r] = Some(out[r].len());
                done[r] = true;
                *tok = 0;
            }
        }
    }
}

/// One row of a batch's completion: its tokens, or the index of the
/// token at which its logits were NaN or infinite.
pub(crate) type RowCompletion = std::result::Result<Vec<u32>, usize>;

/// Where the time of the last [`Generator::complete_batch`] went.
#[derive(Clone, Debug, Default)]
pub struct Timings {
    /// Prompt tokens (all rows, without padding) and the prefill's seconds
    /// (compilation excluded).
    pub prefill_tokens: usize,
    pub prefill_s: f64,
    /// Seconds of each decode step (one token per row).
    pub decode_step_s: Vec<f64>,
    pub batch: usize,
    /// Programs compiled so far, and the seconds that took (not counted
    /// in the steps).
    pub programs: usize,
    pub compile_s: f64,
}

/// The layout of a KV cache `[batch, kv_heads, len, head_dim]`: heads over
/// `mp` where they divide, else whole.
pub(crate) fn cache_spec(mesh: &hlo_partitioner::Mesh, config: &ModelConfig) -> PartitionSpec {
    let mp = mesh.axis_size("mp").unwrap_or(1);
    if mp > 1 && config.num_key_value_heads % mp == 0 {
        PartitionSpec::new(&[&[], &["mp"]])
    } else {
        PartitionSpec::replicated()
    }
}

/// The executor every program shares in eager mode (None for JIT).
fn eager_executor(backend: &Backend, mode: Mode) -> Result<Option<Eager>> {
    Ok(match mode {
        Mode::Eager => Some(Eager::new(
            backend.client(),
            backend.mesh().clone(),
            backend.devices().to_vec(),
        )?),
        Mode::Jit => None,
    })
}

/// The prompts left-padded to `t` tokens, row after row (every row's
/// last prompt token at slot `t - 1`), and each row's padding.
fn left_padded(prompts: &[Vec<u32>], t: usize) -> (Vec<i32>, Vec<i32>) {
    let mut ids = vec![0i32; prompts.len() * t];
    let mut offsets = Vec::with_capacity(prompts.len());
    for (r, p) in prompts.iter().enumerate() {
        let off = t - p.len();
        offsets.push(off as i32);
        for (j, &tok) in p.iter().enumerate() {
            ids[r * t + off + j] = tok as i32;
        }
    }
    (ids, offsets)
}

/// What every step of a batch takes besides the caches and the tokens:
/// the rows' padding, the sampler's settings, and its random state (each
/// step's replaced by the one the step returns).
struct StepInputs {
    offsets: DeviceArray,
    temperature: DeviceArray,
    top_k: DeviceArray,
    top_p: DeviceArray,
    rng: DeviceArray,
}

/// A compiled generation program and where its parameters go.
struct Compiled {
    program: Program,
    /// Per input, the parameter it takes (by name); None for a per-call
    /// input.
    weights: Vec<Option<String>>,
}

/// Finds a parameter's array by name (a generator's own, or those of a
/// training session it generates for).
pub(crate) type ParamLookup<'p> = dyn Fn(&str) -> Option<&'p DeviceArray> + 'p;

/// Completes prompts with a model (and an adapter, applied unmerged).
pub struct Generator {
    backend: Backend,
    config: ModelConfig,
    lora: Option<LoraConfig>,
    dtype: DType,
    mode: Mode,
    /// Shared by every program in eager mode.
    eager: Option<Eager>,
    /// Every parameter, laid out by the training rules, and where each
    /// name is among them (empty for a generator over a session's
    /// arrays, [`Generator::over`]).
    params: Vec<DeviceArray>,
    param_index: HashMap<String, usize>,
    /// Each parameter's layout.
    specs: HashMap<String, PartitionSpec>,
    /// The caches' layout: heads over `mp` where they divide, else whole.
    cache_spec: PartitionSpec,
    programs: RefCell<HashMap<(i64, i64, i64), Compiled>>,
    timings: RefCell<Timings>,
    compile_s: Cell<f64>,
    /// Batches completed so far: each draws from its own random stream.
    batches: Cell<u64>,
}

impl Generator {
    /// Uploads the weights (`weight(name)`, one tensor at a time) and the
    /// adapter's tensors to the backend's mesh: weights by the training
    /// rules, the KV cache split over heads by `mp`.
    pub fn new(
        backend: &Backend,
        config: &ModelConfig,
        dtype: DType,
        adapter: Option<&Adapter>,
        mode: Mode,
        weight: impl Fn(&str) -> Result<Literal>,
    ) -> Result<Generator> {
        let mesh = backend.mesh();
        let lora = adapter.map(|a| a.lora.clone());
        let mut types = base_parameter_types(config, dtype);
        if let Some(l) = &lora {
            types.extend(lora_parameter_types(config, l));
        }
        let rules = partition_rules(config);
        let (mut params, mut param_index, mut specs) = (Vec::new(), HashMap::new(), HashMap::new());
        for (name, ty) in types {
            let spec = rules.spec_for(&name, ty.rank());
            spec.validate(mesh, &ty.dims, &name)?;
            let lit = match adapter.and_then(|a| a.get(&name)) {
                Some(l) => l.clone(),
                None => weight(&name)?,
            };
            let array = backend.place(&HostArray::from(lit), &spec)?;
            specs.insert(name.clone(), spec);
            param_index.insert(name, params.len());
            params.push(array);
        }
        let mut g = Generator::over(backend, config, dtype, lora, mode, specs)?;
        (g.params, g.param_index) = (params, param_index);
        Ok(g)
    }

    /// A generator that owns no parameters: each completion reads them
    /// from arrays already on the devices ([`Generator::complete_batch_with`]),
    /// laid out as `specs` says (by name) — a training session's, so the
    /// adapter being trained generates with no copy of any weight.
    pub fn over(
        backend: &Backend,
        config: &ModelConfig,
        dtype: DType,
        lora: Option<LoraConfig>,
        mode: Mode,
        specs: HashMap<String, PartitionSpec>,
    ) -> Result<Generator> {
        Ok(Generator {
            backend: backend.clone(),
            config: config.clone(),
            lora,
            dtype,
            mode,
            params: Vec::new(),
            param_index: HashMap::new(),
            specs,
            eager: eager_executor(backend, mode)?,
            cache_spec: cache_spec(backend.mesh(), config),
            programs: RefCell::new(HashMap::new()),
            timings: RefCell::new(Timings::default()),
            compile_s: Cell::new(0.0),
            batches: Cell::new(0),
        })
    }

    /// Makes the next completed batch draw from random stream `n` (the
    /// n-th batch's, counting from 0): a resumed run continues the
    /// streams where it stopped.
    pub(crate) fn set_stream(&self, n: u64) {
        self.batches.set(n);
    }

    /// The eager executor's statistics, when running eagerly.
    pub fn eager_stats(&self) -> Option<EagerStats> {
        self.eager.as_ref().map(Eager::stats)
    }

    /// The timings of the last completion.
    pub fn timings(&self) -> Timings {
        self.timings.borrow().clone()
    }

    /// Compiles a generation program: weights laid out as placed, caches
    /// by the cache layout, the rest replicated.
    fn compile(&self, step: Step) -> Result<Compiled> {
        let started = Instant::now();
        let f = &step.function;
        let sharded =
            ShardedStep::with_layout(&step, self.backend.mesh(), |k| match step.inputs[k].role {
                Role::Weight => self.specs[&f.inputs[k].name].clone(),
                Role::KvCache => self.cache_spec.clone(),
                _ => PartitionSpec::replicated(),
            });
        let program = match &self.eager {
            Some(e) => Program::eager_with(sharded.function(), sharded.shardings.clone(), e)?,
            None => sharded.compile(&self.backend, self.mode)?,
        };
        let step = &sharded.step;
        self.compile_s
            .set(self.compile_s.get() + started.elapsed().as_secs_f64());
        let weights = (0..step.inputs.len())
            .map(|k| match step.inputs[k].role {
                Role::Weight => Some(step.function.inputs[k].name.clone()),
                _ => None,
            })
            .collect();
        Ok(Compiled { program, weights })
    }

    /// `compiled`'s arguments: the parameters where it takes them, `rest`
    /// (the per-call inputs, in order) elsewhere.
    fn arguments<'a, 'p: 'a>(
        compiled: &Compiled,
        params: &ParamLookup<'p>,
        mut rest: impl Iterator<Item = &'a DeviceArray>,
    ) -> Result<Vec<&'a DeviceArray>> {
        compiled
            .weights
            .iter()
            .map(|w| match w {
                Some(name) => params(name)
                    .map(|a| -> &'a DeviceArray { a })
                    .ok_or_else(|| {
                        crate::EngineError::Internal(format!("no array for the parameter {name}"))
                    }),
                None => Ok(rest.next().expect("an input for every non-weight")),
            })
            .collect()
    }

    /// This generator's own parameter `name`.
    fn own(&self, name: &str) -> Option<&DeviceArray> {
        self.param_index.get(name).map(|&k| &self.params[k])
    }

    /// Runs the decode program for `shape` (compiling it first if needed)
    /// on `inputs`: every input after the weights, in order.
    fn run<'a, 'p: 'a>(
        &self,
        shape: (i64, i64, i64),
        params: &ParamLookup<'p>,
        inputs: &[&'a DeviceArray],
    ) -> Result<Vec<DeviceArray>> {
        let (batch, new, max_len) = shape;
        let mut programs = self.programs.borrow_mut();
        if let std::collections::hash_map::Entry::Vacant(slot) = programs.entry(shape) {
            let step = decode_step(
                &self.config,
                self.dtype,
                batch,
                new,
                max_len,
                self.lora.as_ref(),
            )?;
            slot.insert(self.compile(step)?);
        }
        let compiled = &programs[&shape];
        let all = Self::arguments(compiled, params, inputs.iter().copied())?;
        Ok(compiled.program.run(&all)?)
    }

    fn place(&self, host: HostArray) -> Result<DeviceArray> {
        self.backend.replicate(&host)
    }

    /// Up to `max_new` tokens after each prompt, each row stopping after
    /// one of the `stop` tokens. Sampling is reproducible from the seed and
    /// the order of calls: the n-th batch of a generator draws from its
    /// own stream.
    pub fn complete_batch(
        &self,
        prompts: &[Vec<u32>],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<Vec<Vec<u32>>> {
        self.complete_batch_with(&|n| self.own(n), prompts, max_new, sampling, stop)
    }

    /// [`Generator::complete_batch`] with the parameters `params` finds
    /// (for a generator made by [`Generator::over`]). A row whose logits
    /// turn NaN or infinite fails the whole batch, after every other row
    /// has finished as it would have alone.
    pub fn complete_batch_with<'p>(
        &self,
        params: &ParamLookup<'p>,
        prompts: &[Vec<u32>],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<Vec<Vec<u32>>> {
        self.complete_rows_with(params, prompts, max_new, sampling, stop)?
            .into_iter()
            .enumerate()
            .map(|(row, c)| {
                c.map_err(|token| crate::EngineError::NonFiniteLogits {
                    row: row + 1,
                    rows: prompts.len(),
                    token: token + 1,
                })
            })
            .collect()
    }

    /// [`Generator::complete_batch`], each row on its own: its tokens, or
    /// the index of the token whose logits were NaN or infinite (its
    /// adapter or prompt overflows; the row stops there, and no other row
    /// is changed by it).
    pub fn complete_rows(
        &self,
        prompts: &[Vec<u32>],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<Vec<RowCompletion>> {
        self.complete_rows_with(&|n| self.own(n), prompts, max_new, sampling, stop)
    }

    /// Completes `prompts` as [`Generator::complete_rows`] says, reading
    /// the parameters through `params`: one prefill step over the
    /// left-padded prompts, then one decode step a token until every row
    /// is done or has `max_new` tokens.
    fn complete_rows_with<'p>(
        &self,
        params: &ParamLookup<'p>,
        prompts: &[Vec<u32>],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<Vec<RowCompletion>> {
        let batch = prompts.len();
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        if batch == 0 || longest == 0 || prompts.iter().any(Vec::is_empty) || max_new == 0 {
            return Ok(vec![Ok(Vec::new()); batch]);
        }
        let t = prompt_bucket(longest);
        let max_len = cache_bucket(t, max_new);
        let b = batch as i64;
        let (ids, offsets) = left_padded(prompts, t as usize);
        let mut caches = self.empty_caches(b, max_len)?;
        let mut fixed = self.step_inputs(&offsets, sampling)?;
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); batch];
        let mut failed: Vec<Option<usize>> = vec![None; batch];
        let mut done = vec![false; batch];
        let mut input = self.place(HostArray::new(&[b, t], &ids)?)?;
        let mut cur = 0i64;
        let mut new = t;
        let mut timings = Timings {
            prefill_tokens: prompts.iter().map(Vec::len).sum(),
            batch,
            ..Timings::default()
        };
        for _ in 0..max_new {
            let started = Instant::now();
            let compiling = self.compile_s.get();
            let shape = (b, new, max_len);
            let mut next = self.step(shape, params, &mut caches, &input, cur, &mut fixed)?;
            let took = started.elapsed().as_secs_f64() - (self.compile_s.get() - compiling);
            if cur == 0 {
                timings.prefill_s = took;
            } else {
                timings.decode_step_s.push(took);
            }
            take_tokens(&mut next, (&mut out, &mut failed, &mut done), stop);
            if done.iter().all(|&d| d) {
                break;
            }
            cur += new;
            new = 1;
            input = self.place(HostArray::new(&[b, 1], &next)?)?;
        }
        timings.programs = self.programs.borrow().len();
        timings.compile_s = self.compile_s.get();
        *self.timings.borrow_mut() = timings;
        Ok(out
            .into_iter()
            .zip(failed)
            .map(|(tokens, f)| f.map_or(Ok(tokens), Err))
            .collect())
    }

    /// Zeroed K and V caches `[batch, kv_heads, max_len, head_dim]` for
    /// every layer, laid out by the cache layout.
    fn empty_caches(&self, batch: i64, max_len: i64) -> Result<Vec<DeviceArray>> {
        let c = &self.config;
        let cache_ty = [batch, c.num_key_value_heads, max_len, c.head_dim];
        let zeros = HostArray::from(Literal::splat(TensorType::new(self.dtype, cache_ty), 0.0));
        (0..2 * c.num_hidden_layers)
            .map(|_| self.backend.place(&zeros, &self.cache_spec))
            .collect()
    }

    /// The inputs a batch's steps share, placed once: the rows' padding
    /// `offsets` and the sampler's settings, and its random state, which
    /// starts this batch's own stream (taking the stream's number).
    fn step_inputs(&self, offsets: &[i32], sampling: &Sampling) -> Result<StepInputs> {
        let offsets = self.place(HostArray::new(&[offsets.len() as i64], offsets)?)?;
        let temperature = self.place(HostArray::scalar(sampling.temperature() as f32))?;
        let top_k = self.place(HostArray::scalar(sampling.top_k.unwrap_or(0) as i32))?;
        let top_p = self.place(HostArray::scalar(sampling.top_p.unwrap_or(1.0) as f32))?;
        // The sampler's state: the seed, and which batch of this
        // generator's this is, so no two batches draw alike (rows of one
        // batch draw from rows of one random tensor).
        let stream = self.batches.get();
        self.batches.set(stream + 1);
        let rng = self.place(HostArray::from(Literal::from_i128s(
            TensorType::new(DType::U64, [2]),
            &[sampling.seed as i128, stream as i128],
        )))?;
        Ok(StepInputs {
            offsets,
            temperature,
            top_k,
            top_p,
            rng,
        })
    }

    /// One prefill or decode step of `shape` on the tokens `input` at
    /// position `cur`: the caches and the sampler's random state become
    /// the program's new ones, and each row's sampled token comes back
    /// (-1 where its logits were not finite).
    fn step<'p>(
        &self,
        shape: (i64, i64, i64),
        params: &ParamLookup<'p>,
        caches: &mut Vec<DeviceArray>,
        input: &DeviceArray,
        cur: i64,
        fixed: &mut StepInputs,
    ) -> Result<Vec<i32>> {
        let cur_arr = self.place(HostArray::scalar(cur as i32))?;
        let mut inputs: Vec<&DeviceArray> = caches.iter().collect();
        inputs.extend([
            input,
            &fixed.offsets,
            &cur_arr,
            &fixed.temperature,
            &fixed.top_k,
            &fixed.top_p,
            &fixed.rng,
        ]);
        let mut outputs = self.run(shape, params, &inputs)?;
        // Outputs: next, logits, caches.., rng.
        fixed.rng = outputs.pop().expect("rng");
        let next_arr = outputs.remove(0);
        *caches = outputs.split_off(1);
        Ok(next_arr.gather()?.to_vec()?)
    }

    /// [`Generator::complete_batch`] for one prompt.
    pub fn complete(
        &self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<Vec<u32>> {
        Ok(self
            .complete_batch(&[prompt.to_vec()], max_new, sampling, stop)?
            .remove(0))
    }

    /// The logits `[prompt_len, vocab]` of every prompt position, from one
    /// full forward pass.
    pub fn prompt_logits(&self, prompt: &[u32]) -> Result<Vec<f64>> {
        let n = prompt.len() as i64;
        let step = forward_step(&self.config, self.dtype, 1, n, self.lora.as_ref(), false)?;
        let compiled = self.compile(step)?;
        let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let ids = self.place(HostArray::new(&[1, n], &ids)?)?;
        let all = Self::arguments(&compiled, &|n| self.own(n), std::iter::once(&ids))?;
        let out = compiled.program.run(&all)?;
        Ok(out[0].gather()?.to_f64_vec())
    }
}
