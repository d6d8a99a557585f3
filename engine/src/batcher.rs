//! Continuous batching of many requests over many LoRA adapters, with one
//! base model on the devices (the programs are
//! [`hlo_models::decoder::slot_step`] and its siblings).
//!
//! A [`Batcher`] runs on its own thread and owns the devices' state: the
//! weights, the KV cache of `max_batch_size` slots and the adapter tables of
//! `max_loras` entries. Between two decode steps, requests that finished or
//! whose caller went away leave their slots, and waiting requests join.
//! Each step is one program of at most `max_num_batched_tokens` tokens: a
//! decode token per running request, and a chunk of a joining prompt in
//! what is left (a long prompt takes several steps), prefilled straight
//! into its slot; the weights are read once a step. A prompt prefix another
//! slot holds under the same adapter is copied rather than computed. Each
//! slot keeps its own position, sampling settings, seed and stop
//! tokens, so a request's tokens are the same whichever requests share its
//! batch. Adapters are registered by name (parsed and checked once), kept
//! parsed in a host LRU of `max_cpu_loras`, read from disk beyond that, and
//! uploaded into a free or least recently used table entry that no running
//! request holds, by one donated update program.
//!
//! Callers talk to it through a [`BatcherHandle`] (cheap to clone, usable
//! from any thread or async task): [`BatcherHandle::submit`] returns a
//! channel of [`Event`]s; dropping it cancels the request.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use hlo_ir::{DType, Literal};
use hlo_models::adapter::Adapter;
use hlo_models::decoder::{
    adapter_table_types, base_parameter_types, cache_types, lora_parameter_types, partition_rules,
    projections, slot_read_step, slot_step, slot_write_step, table_update_step, AdapterTables,
    LoraSelect, ModelConfig,
};
use hlo_models::roles::{Role, Step};
use hlo_partitioner::PartitionSpec;
use hlo_runtime::{DeviceArray, HostArray, Lru, Mode, Program};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::backend::{Backend, BackendOptions};
use crate::error::{EngineError, Result};
use crate::generator::{cache_spec, prompt_bucket, Sampling};
use crate::model::Model;
use crate::pipeline::ShardedStep;

/// How many requests, adapters and tokens a batcher holds.
#[derive(Clone, Debug)]
pub struct BatcherOptions {
    /// Decode slots: requests generating at once.
    pub max_batch_size: usize,
    /// Adapters resident in the device tables at once.
    pub max_loras: usize,
    /// Parsed adapters kept on the host.
    pub max_cpu_loras: usize,
    /// The largest adapter rank the tables hold.
    pub max_lora_rank: i64,
    /// Prompt plus completion, in tokens: each slot's cache length.
    pub max_model_len: i64,
    /// Requests waiting for a slot before [`BatcherHandle::submit`] refuses
    /// more.
    pub max_queue: usize,
    /// How rows read their adapter entries; None picks by rows: a gather
    /// for one or two rows, the one-hot contraction above (the faster of
    /// the two at each size, BENCHMARKS.md).
    pub select: Option<LoraSelect>,
    pub dtype: DType,
    /// The token budget of an engine step (vLLM's
    /// `max_num_batched_tokens`): a step with no running request prefills
    /// a prompt chunk of up to this many tokens; one with running requests
    /// computes their decode tokens and a chunk of a joining prompt of up
    /// to half the budget. A
    /// longer prompt is prefilled over several steps, so arrivals never
    /// stall running streams for more than one chunk's work.
    pub max_num_batched_tokens: usize,
    /// Compile the programs of steps that run decode rows and a prompt
    /// chunk together on a second thread once the batcher is ready, which
    /// it then is sooner (each program takes seconds to compile); until
    /// one is compiled, such a step runs its chunk and its decode rows as
    /// two programs. Off: every program is compiled before the batcher is
    /// ready.
    pub background_compile: bool,
    /// Reuse the keys and values of a prompt prefix another slot holds
    /// (same tokens, same adapter) instead of computing them again.
    pub prefix_caching: bool,
    /// Test hook: a request whose prompt holds this token makes the
    /// scheduling thread panic, so tests can see what a server does when
    /// its batcher dies (`hlo-train serve` reads it from
    /// `HLO_TRAIN_TEST_FAIL_ON_TOKEN`). None in service.
    pub fail_on_token: Option<u32>,
}

/// One completion to generate.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    /// A registered adapter's name; None for the base model.
    pub adapter: Option<String>,
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Tokens that end the completion (included in it, as the model's EOS).
    pub stop_ids: Vec<u32>,
}

/// Why a completion ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token.
    Stop,
    /// `max_tokens` tokens.
    Length,
}

/// What a request's channel receives: tokens as they are sampled (with
/// when: a reader that falls behind still times them right), then
/// `Finished` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token { id: u32, at: std::time::Instant },
    Finished(FinishReason),
    Failed(String),
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("adapter `{0}` is not loaded")]
    UnknownAdapter(String),
    /// A field of the request is out of range; the field's name and why.
    #[error("{1}")]
    Invalid(&'static str, String),
    /// The scheduling thread died: the server is not ready.
    #[error("the batcher failed ({0}); the server must be restarted")]
    Failed(String),
}

/// Counters of a running batcher (read by `/metrics`).
#[derive(Debug, Default)]
pub struct BatcherStats {
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    /// A request's adapter was already in the device tables.
    pub adapter_hits: AtomicU64,
    /// It was not, and was uploaded (a load).
    pub adapter_misses: AtomicU64,
    pub adapter_loads: AtomicU64,
    /// A resident adapter replaced to make room.
    pub adapter_evictions: AtomicU64,
    /// Parsed adapters found on the host, and read from disk again.
    pub adapter_host_hits: AtomicU64,
    pub adapter_host_misses: AtomicU64,
    /// Prompts prefilled, and the chunks (program runs) that took.
    pub prefills: AtomicU64,
    pub prefill_chunks: AtomicU64,
    /// Prompt tokens computed, and prompt tokens whose keys and values were
    /// reused from another request's (prefix caching).
    pub prompt_tokens_computed: AtomicU64,
    pub prompt_tokens_reused: AtomicU64,
    pub decode_steps: AtomicU64,
    /// Step programs still being compiled (see
    /// [`BatcherOptions::background_compile`]).
    pub programs_pending: AtomicUsize,
    /// Requests whose caller went away before they finished.
    pub cancelled: AtomicU64,
}

/// A registered adapter: where it is read from, an id that changes when
/// the name is registered again, and the base model it declares.
#[derive(Clone, Debug)]
struct Registered {
    id: u64,
    path: PathBuf,
    declared_base: Option<String>,
}

/// A registered adapter as `/v1/models` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterInfo {
    pub name: String,
    pub path: PathBuf,
    /// Its `base_model_name_or_path`, when it names one.
    pub declared_base: Option<String>,
}

/// What the handle and the batcher thread share.
struct Shared {
    config: ModelConfig,
    options: BatcherOptions,
    stats: BatcherStats,
    registry: Mutex<HashMap<String, Registered>>,
    host: Mutex<Lru<u64, Arc<Adapter>>>,
    next_id: AtomicU64,
    /// The names the served model answers to, for adapters' declared bases.
    base_names: Vec<String>,
    /// Why the scheduling thread died, once it has.
    failure: Mutex<Option<String>>,
}

impl Shared {
    /// Reads and checks the adapter at `path` for serving.
    fn parse(&self, path: &Path) -> Result<Adapter> {
        let adapter = Adapter::load(path, &self.config)?;
        if !adapter.lora.modules_to_save.is_empty() {
            return Err(EngineError::AdapterModulesToSave {
                dir: path.to_path_buf(),
                modules: adapter.lora.modules_to_save.clone(),
            });
        }
        if !adapter.lora.target_parameters.is_empty() {
            return Err(EngineError::AdapterOnExperts {
                dir: path.to_path_buf(),
                parameters: adapter.lora.target_parameters.clone(),
            });
        }
        // lora_a is [in, rank].
        let rank = lora_parameter_types(&self.config, &adapter.lora)
            .iter()
            .filter(|(n, _)| n.ends_with(".lora_a"))
            .map(|(_, t)| t.dims[1])
            .max()
            .unwrap_or(0);
        if rank > self.options.max_lora_rank {
            return Err(EngineError::AdapterRankAbove {
                dir: path.to_path_buf(),
                rank,
                max: self.options.max_lora_rank,
            });
        }
        Ok(adapter)
    }

    /// The parsed adapter `r`: from the host cache, else from disk.
    fn adapter(&self, r: &Registered) -> Result<Arc<Adapter>> {
        if let Some(a) = self.host().get(&r.id) {
            self.stats.adapter_host_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(a.clone());
        }
        self.stats
            .adapter_host_misses
            .fetch_add(1, Ordering::Relaxed);
        let a = Arc::new(self.parse(&r.path)?);
        self.host().insert(r.id, a.clone());
        Ok(a)
    }

    fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn host(&self) -> std::sync::MutexGuard<'_, Lru<u64, Arc<Adapter>>> {
        self.host.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, HashMap<String, Registered>> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }
}

enum Command {
    Submit(Pending),
    Shutdown,
}

struct Pending {
    request: GenerationRequest,
    adapter: Option<Registered>,
    events: UnboundedSender<Event>,
}

/// A request in a slot: its prompt being prefilled, chunk by chunk, then
/// decoding.
struct Active {
    request: GenerationRequest,
    events: UnboundedSender<Event>,
    /// The adapter table entry it reads (0: none).
    entry: usize,
    /// Prompt tokens whose keys and values are in the slot; below the
    /// prompt's length while it is being prefilled.
    prefilled: usize,
    /// Where its next input token goes in its cache.
    position: i64,
    last: u32,
    generated: usize,
    seed: u32,
    /// When it took its slot: prefills go first come, first served.
    admitted: u64,
}

impl Active {
    fn decoding(&self) -> bool {
        self.prefilled == self.request.prompt.len()
    }
}

/// What a slot's cache row holds, for prefix reuse: the keys and values of
/// `tokens` (from position 0) under adapter registration `adapter` (0: the
/// base model). Kept after its request leaves, until the slot is taken.
#[derive(Clone, Debug, Default)]
struct Held {
    adapter: u64,
    tokens: Vec<u32>,
}

/// A table entry holding an adapter.
struct Entry {
    adapter_id: u64,
    used: u64,
}

/// The handle through which servers and tests drive a [`Batcher`].
#[derive(Clone)]
pub struct BatcherHandle {
    commands: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl BatcherHandle {
    /// Queues a request; its tokens arrive on the returned channel.
    /// Dropping the channel cancels it (its slot is freed before the next
    /// decode step).
    pub fn submit(
        &self,
        request: GenerationRequest,
    ) -> Result<UnboundedReceiver<Event>, SubmitError> {
        let s = &self.shared;
        if let Some(why) = s.failure() {
            return Err(SubmitError::Failed(why));
        }
        check_request(&request, &s.config, s.options.max_model_len)?;
        let adapter = match &request.adapter {
            None => None,
            Some(name) => Some(
                s.registry()
                    .get(name)
                    .cloned()
                    .ok_or_else(|| SubmitError::UnknownAdapter(name.clone()))?,
            ),
        };
        // Counted before it is sent, so the queue never overshoots.
        let queued = s.stats.queued.fetch_add(1, Ordering::SeqCst);
        if queued >= s.options.max_queue {
            s.stats.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::QueueFull(queued));
        }
        let (events, rx) = unbounded_channel();
        self.commands
            .send(Command::Submit(Pending {
                request,
                adapter,
                events,
            }))
            .map_err(|_| {
                s.stats.queued.fetch_sub(1, Ordering::SeqCst);
                SubmitError::ShuttingDown
            })?;
        Ok(rx)
    }

    /// Registers adapter `name` from the PEFT folder `path`, after reading
    /// and checking it (same base shapes, floating finite weights, rank at
    /// most `max_lora_rank`, nothing that replaces base weights, and a
    /// declared base of the served architecture where that base's config
    /// can be read here). A name already registered is refused. Returns
    /// the base the adapter declares, if any.
    pub fn load_adapter(&self, name: &str, path: &Path) -> Result<Option<String>> {
        let s = &self.shared;
        if s.registry().contains_key(name) {
            return Err(EngineError::AdapterLoaded {
                name: name.to_string(),
            });
        }
        let adapter = Arc::new(s.parse(path)?);
        let declared_base = Adapter::declared_base(path);
        if let Some(base) = &declared_base {
            check_declared_base(path, base, &s.base_names, &s.config)?;
        }
        let id = s.next_id.fetch_add(1, Ordering::SeqCst);
        let mut registry = s.registry();
        if registry.contains_key(name) {
            return Err(EngineError::AdapterLoaded {
                name: name.to_string(),
            });
        }
        registry.insert(
            name.to_string(),
            Registered {
                id,
                path: path.to_path_buf(),
                declared_base: declared_base.clone(),
            },
        );
        s.host().insert(id, adapter);
        Ok(declared_base)
    }

    /// Forgets adapter `name`; requests already running with it finish.
    /// False if it was not registered.
    pub fn unload_adapter(&self, name: &str) -> bool {
        let removed = self.shared.registry().remove(name);
        if let Some(r) = &removed {
            self.shared.host().remove(&r.id);
        }
        removed.is_some()
    }

    /// The registered adapters' names, sorted.
    pub fn adapters(&self) -> Vec<String> {
        let mut names: Vec<String> = self.shared.registry().keys().cloned().collect();
        names.sort();
        names
    }

    /// The registered adapters with where they came from, sorted by name.
    pub fn adapter_infos(&self) -> Vec<AdapterInfo> {
        let mut out: Vec<AdapterInfo> = self
            .shared
            .registry()
            .iter()
            .map(|(name, r)| AdapterInfo {
                name: name.clone(),
                path: r.path.clone(),
                declared_base: r.declared_base.clone(),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    pub fn stats(&self) -> &BatcherStats {
        &self.shared.stats
    }

    /// Why the scheduling thread died, if it has: every request it held
    /// was failed, and new ones are refused ([`SubmitError::Failed`]).
    pub fn failure(&self) -> Option<String> {
        self.shared.failure()
    }

    pub fn options(&self) -> &BatcherOptions {
        &self.shared.options
    }

    /// Stops taking requests, lets every queued and running one finish,
    /// and waits for the batcher's thread to end.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// The batcher: spawn it with [`Batcher::spawn`].
pub struct Batcher {
    shared: Arc<Shared>,
    backend: Arc<Backend>,
    weights: Vec<DeviceArray>,
    tables: Vec<DeviceArray>,
    caches: Vec<DeviceArray>,
    tables_shape: AdapterTables,
    /// The step programs by (decode rows, chunk tokens): see
    /// [`step_shapes`].
    steps: HashMap<(i64, i64), Program>,
    /// Step programs compiled on the compiler thread, as they come.
    compiled: Option<mpsc::Receiver<Result<StepProgram>>>,
    /// Tells the compiler thread to stop (the batcher has ended).
    stop_compiling: Arc<AtomicBool>,
    compiler: Option<std::thread::JoinHandle<()>>,
    update: Program,
    /// A prefix read from one slot, and written into another.
    read: Program,
    write: Program,
    slots: Vec<Option<Active>>,
    held: Vec<Held>,
    entries: Vec<Option<Entry>>,
    waiting: VecDeque<Pending>,
    tick: u64,
    commands: mpsc::Receiver<Command>,
    draining: bool,
}

/// The tables as a program of `rows` rows reads them: `select`, else by
/// rows (see [`BatcherOptions::select`]).
fn tables_for(shape: &AdapterTables, select: Option<LoraSelect>, rows: i64) -> AdapterTables {
    AdapterTables {
        select: select.unwrap_or(if rows <= 2 {
            LoraSelect::Gather
        } else {
            LoraSelect::OneHot
        }),
        ..*shape
    }
}

/// The row counts decode programs are compiled for: powers of two from 2
/// below `slots`, and `slots`. Not 1: on the CPU plugin a one-row decode
/// program ran 3× slower than a two-row one (BENCHMARKS.md; the cause
/// inside XLA is not known).
pub fn decode_buckets(slots: i64) -> Vec<i64> {
    let mut out: Vec<i64> = (1..)
        .map(|k| 1i64 << k)
        .take_while(|&r| r < slots)
        .collect();
    out.push(slots);
    out
}

/// The prefill bucket of a prompt: the generator's prompt bucket, at most
/// the cache's length.
pub fn prefill_bucket(len: usize, max_len: i64) -> i64 {
    prompt_bucket(len).min(max_len)
}

/// The largest chunk a step with decode rows carries: half the token
/// budget (a power of two, at least 16).
pub fn mixed_chunk(options: &BatcherOptions) -> usize {
    1usize << (options.max_num_batched_tokens / 2).max(16).ilog2()
}

/// The (decode rows, chunk tokens) of every step program a batcher with
/// `options` compiles: decode alone ([`decode_buckets`] rows); a chunk
/// alone (powers of two from 16 to the token budget); and decode rows
/// with a chunk (powers of two from 16 to [`mixed_chunk`]). Chunks are at
/// most the cache's length.
pub fn step_shapes(options: &BatcherOptions) -> Vec<(i64, i64)> {
    let chunks = |most: usize| {
        (4..=most.max(16).ilog2()).map(|k| prefill_bucket(1 << k, options.max_model_len))
    };
    let most = 1usize << options.max_num_batched_tokens.max(16).ilog2();
    let mut shapes: Vec<(i64, i64)> = Vec::new();
    let mut add = |shape| {
        if !shapes.contains(&shape) {
            shapes.push(shape);
        }
    };
    chunks(most).for_each(|c| add((0, c)));
    for rows in decode_buckets(options.max_batch_size as i64) {
        add((rows, 0));
        chunks(mixed_chunk(options)).for_each(|c| add((rows, c)));
    }
    shapes
}

/// A chunk of a prompt in a step: tokens `start..end` of the prompt of the
/// request in `slot`, padded to `bucket` (the slot holds the prompt up to
/// at least `start`).
#[derive(Clone, Copy, Debug)]
struct Chunk {
    slot: usize,
    start: usize,
    end: usize,
    bucket: i64,
}

/// A step program and its (decode rows, chunk tokens).
type StepProgram = ((i64, i64), Program);

/// What compiles a step program, on the batcher's thread or on its own.
#[derive(Clone)]
struct StepCompiler {
    backend: Arc<Backend>,
    config: ModelConfig,
    options: BatcherOptions,
    tables: AdapterTables,
    /// The weights' layouts, as uploaded.
    weights: Vec<PartitionSpec>,
    cache: PartitionSpec,
}

impl StepCompiler {
    /// The step program of `rows` decode rows and a `chunk`-token chunk.
    fn program(&self, (rows, chunk): (i64, i64)) -> Result<Program> {
        let o = &self.options;
        let step = slot_step(
            &self.config,
            o.dtype,
            o.max_batch_size as i64,
            o.max_model_len,
            rows,
            chunk,
            &tables_for(&self.tables, o.select, rows + chunk),
        )?;
        Batcher::compile_with(&self.backend, &self.weights, &self.cache, step)
    }
}

impl Drop for Batcher {
    /// Stops the compiler thread and waits for the compilation it is in: a
    /// process that exits while XLA compiles on another thread can crash
    /// in XLA's own teardown.
    fn drop(&mut self) {
        self.stop_compiling.store(true, Ordering::SeqCst);
        if let Some(compiler) = self.compiler.take() {
            let _ = compiler.join();
        }
    }
}

impl Batcher {
    /// Starts a batcher for `model` on a backend opened with `backend`:
    /// uploads the weights, builds the caches and tables, compiles the
    /// decode and table-update programs, and registers `adapters` (name,
    /// folder). Returns once it is ready, or with the first error.
    pub fn spawn(
        backend: BackendOptions,
        model: Model,
        options: BatcherOptions,
        adapters: &[(String, PathBuf)],
        seed: u64,
    ) -> Result<BatcherHandle> {
        Self::spawn_announced(backend, model, options, adapters, seed, Box::new(|| {}))
    }

    /// [`Batcher::spawn`], calling `starting` once everything that can be
    /// checked quickly is (limits, adapters, the mesh, the weights),
    /// before the weights are placed and the programs compiled: seconds
    /// to minutes a server may want to announce.
    pub fn spawn_announced(
        backend: BackendOptions,
        model: Model,
        options: BatcherOptions,
        adapters: &[(String, PathBuf)],
        seed: u64,
        starting: Box<dyn FnOnce() + Send>,
    ) -> Result<BatcherHandle> {
        if options.max_batch_size == 0 || options.max_loras == 0 || options.max_lora_rank < 1 {
            return Err(EngineError::ServingLimits(
                "--max-batch-size, --max-loras and --max-lora-rank must be at least 1",
            ));
        }
        if options.max_model_len < 2 {
            return Err(EngineError::ServingLimits(
                "--max-model-len must be at least 2",
            ));
        }
        let shared = Arc::new(Shared {
            config: model.config.clone(),
            options: options.clone(),
            stats: BatcherStats::default(),
            registry: Mutex::new(HashMap::new()),
            host: Mutex::new(Lru::new(options.max_cpu_loras.max(1))),
            next_id: AtomicU64::new(1),
            base_names: base_names(&model),
            failure: Mutex::new(None),
        });
        let (commands, rx) = mpsc::channel();
        let handle = BatcherHandle {
            commands,
            shared: shared.clone(),
            thread: Arc::new(Mutex::new(None)),
        };
        for (name, path) in adapters {
            handle.load_adapter(name, path)?;
        }
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("batcher".into())
            .spawn(
                move || match Batcher::new(backend, &model, shared, rx, seed, starting) {
                    Ok(mut b) => {
                        let _ = ready_tx.send(Ok(()));
                        // A failure (or a bug's panic) must not leave a
                        // server whose requests hang: every request held
                        // is failed, and the handle reports the failure.
                        let why = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                            || b.run(),
                        )) {
                            Ok(Ok(())) => return,
                            Ok(Err(e)) => e.to_string(),
                            Err(panic) => panic_message(panic.as_ref()),
                        };
                        b.die(&why);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                },
            )
            .map_err(|cause| EngineError::Thread {
                what: "the batcher",
                cause,
            })?;
        match ready_rx.recv() {
            Ok(Ok(())) => {
                *handle.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(thread);
                Ok(handle)
            }
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(EngineError::BatcherStopped),
        }
    }

    fn new(
        backend: BackendOptions,
        model: &Model,
        shared: Arc<Shared>,
        commands: mpsc::Receiver<Command>,
        seed: u64,
        starting: Box<dyn FnOnce() + Send>,
    ) -> Result<Batcher> {
        let backend = Backend::open(&backend)?;
        model.check_weights()?;
        starting();
        let config = &shared.config;
        let o = &shared.options;
        let dtype = o.dtype;
        let tables_shape = AdapterTables {
            entries: o.max_loras as i64 + 1,
            max_rank: o.max_lora_rank,
            select: LoraSelect::Gather,
        };
        let mesh = backend.mesh().clone();
        let rules = partition_rules(config);
        let mut weights = Vec::new();
        for (name, ty) in base_parameter_types(config, dtype) {
            let spec = rules.spec_for(&name, ty.rank());
            spec.validate(&mesh, &ty.dims, &name)?;
            let lit = model.weight(&name, dtype, seed)?;
            weights.push(backend.place(&HostArray::from(lit), &spec)?);
        }
        let tables = adapter_table_types(config, &tables_shape)
            .into_iter()
            .map(|(_, ty)| backend.replicate(&HostArray::from(Literal::splat(ty, 0.0))))
            .collect::<Result<Vec<_>>>()?;
        let spec = cache_spec(&mesh, config);
        let slots = o.max_batch_size as i64;
        let caches = cache_types(config, slots, o.max_model_len, dtype)
            .into_iter()
            .map(|(_, ty)| backend.place(&HostArray::from(Literal::splat(ty, 0.0)), &spec))
            .collect::<Result<Vec<_>>>()?;
        // Every program a step can need is compiled before the first
        // request (none pays a compilation, no running stream waits for
        // one); those of steps with decode rows and a chunk maybe later,
        // on a second thread, since they have fallbacks.
        let backend = Arc::new(backend);
        let (now, later): (Vec<_>, Vec<_>) = step_shapes(o)
            .into_iter()
            .partition(|&(rows, chunk)| !o.background_compile || rows == 0 || chunk == 0);
        let compile = StepCompiler {
            backend: backend.clone(),
            config: config.clone(),
            options: o.clone(),
            tables: tables_shape,
            weights: weights.iter().map(|w| w.sharding().spec.clone()).collect(),
            cache: spec.clone(),
        };
        let mut steps = HashMap::new();
        for shape in now {
            steps.insert(shape, compile.program(shape)?);
        }
        let stop_compiling = Arc::new(AtomicBool::new(false));
        let read = Self::compile_with(
            &backend,
            &[],
            &spec,
            slot_read_step(config, dtype, slots, o.max_model_len)?,
        )?;
        let write = Self::compile_with(
            &backend,
            &[],
            &spec,
            slot_write_step(config, dtype, slots, o.max_model_len)?,
        )?;
        let update = Self::compile_with(
            &backend,
            &compile.weights,
            &spec,
            table_update_step(config, &tables_shape)?,
        )?;
        // Started last: nothing below returns early without the
        // batcher, whose drop stops and joins it.
        let (compiled, compiler) = if later.is_empty() {
            (None, None)
        } else {
            let (tx, rx) = mpsc::channel();
            let stop = stop_compiling.clone();
            let compile = compile.clone();
            let shared = shared.clone();
            shared
                .stats
                .programs_pending
                .store(later.len(), Ordering::SeqCst);
            let compiler = std::thread::Builder::new()
                .name("step-compiler".into())
                .spawn(move || {
                    for shape in later {
                        if stop.load(Ordering::SeqCst) {
                            return;
                        }
                        let program = compile.program(shape).map(|p| (shape, p));
                        if tx.send(program).is_err() {
                            return;
                        }
                        // Taken by the batcher before its next step.
                        shared.stats.programs_pending.fetch_sub(1, Ordering::SeqCst);
                    }
                })
                .map_err(|cause| EngineError::Thread {
                    what: "the compiler thread",
                    cause,
                })?;
            (Some(rx), Some(compiler))
        };
        let shapes: Vec<(i64, i64)> = steps.keys().copied().collect();
        let mut b = Batcher {
            steps,
            compiled,
            stop_compiling,
            compiler,
            update,
            backend,
            weights,
            tables,
            caches,
            tables_shape,
            read,
            write,
            held: vec![Held::default(); o.max_batch_size],
            slots: (0..o.max_batch_size).map(|_| None).collect(),
            entries: (0..o.max_loras).map(|_| None).collect(),
            waiting: VecDeque::new(),
            tick: 0,
            commands,
            draining: false,
            shared: shared.clone(),
        };
        for shape in shapes {
            b.warm_up(shape)?;
        }
        Ok(b)
    }

    /// Runs step program `(rows, chunk)` once on inputs that change nothing
    /// a request can read, so that no request pays its first run (on the
    /// CPU plugin a program's first run took up to 0.5 s more than the
    /// next ones): every decode row is free (position `max_len`, writes
    /// nothing), and the chunk goes at the end of a slot no request
    /// reaches and whose held prefix ends before it. Skipped when every
    /// slot reaches that far.
    fn warm_up(&mut self, (rows, chunk): (i64, i64)) -> Result<()> {
        let max_len = self.shared.options.max_model_len;
        let start = max_len - chunk;
        let reach = |k: usize| {
            let used = self.slots[k]
                .as_ref()
                .map_or(0, |a| (a.position as usize).max(a.prefilled));
            used.max(self.held[k].tokens.len())
        };
        let slot = match chunk {
            0 => 0,
            _ => match (0..self.slots.len()).find(|&k| reach(k) as i64 <= start) {
                Some(k) => k,
                None => return Ok(()),
            },
        };
        let outs = rows + i64::from(chunk > 0);
        let place = |h: HostArray| self.backend.replicate(&h);
        let int = |n: i64, v: i32| place(HostArray::new(&[n], &vec![v; n as usize])?);
        let free = i32::try_from(max_len).unwrap_or(i32::MAX);
        let mut controls = vec![int(rows + chunk, 0)?];
        if rows > 0 {
            controls.push(int(rows, free)?);
        }
        if chunk > 0 {
            for v in [start, 1, slot as i64] {
                controls.push(place(HostArray::scalar(v as i32))?);
            }
        }
        controls.push(int(outs, 0)?);
        controls.push(place(HostArray::new(&[outs], &vec![0f32; outs as usize])?)?);
        controls.push(int(outs, 0)?);
        controls.push(place(HostArray::new(&[outs], &vec![1f32; outs as usize])?)?);
        controls.push(place(HostArray::new(&[outs], &vec![0u32; outs as usize])?)?);
        self.run_program((rows, chunk), &controls)?;
        Ok(())
    }

    /// Runs step program `shape` on the weights, tables, caches (replaced
    /// by the ones it returns) and `controls`; returns its `next`.
    fn run_program(&mut self, shape: (i64, i64), controls: &[DeviceArray]) -> Result<DeviceArray> {
        let program = self.steps.get(&shape).ok_or_else(|| {
            EngineError::Internal(format!(
                "no serving program for {} decode rows and a {}-token chunk",
                shape.0, shape.1
            ))
        })?;
        let mut args: Vec<&DeviceArray> = self.weights.iter().collect();
        args.extend(self.tables.iter());
        args.extend(self.caches.iter());
        args.extend(controls.iter());
        let mut out = program.run(&args)?;
        self.caches = out.split_off(1);
        Ok(out.remove(0))
    }

    /// Compiles a serving program: weights laid out as uploaded, caches by
    /// `cache`, tables and per-call inputs replicated.
    fn compile_with(
        backend: &Backend,
        weights: &[PartitionSpec],
        cache: &PartitionSpec,
        step: Step,
    ) -> Result<Program> {
        let sharded =
            ShardedStep::with_layout(&step, backend.mesh(), |k| match step.inputs[k].role {
                Role::Weight => weights[k].clone(),
                Role::KvCache => cache.clone(),
                _ => PartitionSpec::replicated(),
            });
        sharded.compile(backend, Mode::Jit)
    }

    /// The loop: take commands, admit waiting requests, decode one step.
    /// An error here is the devices' (a program that failed, its donated
    /// state lost): it ends the loop, see [`Batcher::die`].
    fn run(&mut self) -> Result<()> {
        loop {
            let busy = self.slots.iter().any(Option::is_some) || !self.waiting.is_empty();
            if !busy {
                if self.draining {
                    return Ok(());
                }
                match self.commands.recv() {
                    Ok(c) => self.command(c),
                    Err(_) => return Ok(()),
                }
            }
            while let Ok(c) = self.commands.try_recv() {
                self.command(c);
            }
            self.drop_cancelled();
            self.receive_programs()?;
            self.step()?;
            self.publish();
        }
    }

    /// Takes the step programs the compiler thread has finished. One
    /// that failed to compile fails the batcher, as it would have at start.
    fn receive_programs(&mut self) -> Result<()> {
        let Some(compiled) = &self.compiled else {
            return Ok(());
        };
        let mut fresh = Vec::new();
        while let Ok(program) = compiled.try_recv() {
            let (shape, program) = program?;
            self.steps.insert(shape, program);
            fresh.push(shape);
        }
        for shape in fresh {
            self.warm_up(shape)?;
        }
        Ok(())
    }

    /// After the loop failed with `why`: records it (the handle refuses
    /// new requests and `/health` turns 503), fails every running and
    /// waiting request, and then every request still sent before the
    /// handles saw the failure.
    fn die(&mut self, why: &str) {
        *self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(why.to_string());
        let message = format!("the batcher failed: {why}");
        for slot in &mut self.slots {
            if let Some(a) = slot.take() {
                let _ = a.events.send(Event::Failed(message.clone()));
            }
        }
        let stats = &self.shared.stats;
        for p in self.waiting.drain(..) {
            stats.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = p.events.send(Event::Failed(message.clone()));
        }
        while let Ok(c) = self.commands.try_recv() {
            if let Command::Submit(p) = c {
                stats.queued.fetch_sub(1, Ordering::SeqCst);
                let _ = p.events.send(Event::Failed(message.clone()));
            }
        }
        self.publish();
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Submit(p) => {
                if self.draining {
                    self.shared.stats.queued.fetch_sub(1, Ordering::SeqCst);
                    let _ = p
                        .events
                        .send(Event::Failed("the server is shutting down".into()));
                } else {
                    self.waiting.push_back(p);
                }
            }
            Command::Shutdown => self.draining = true,
        }
    }

    fn publish(&self) {
        let s = &self.shared.stats;
        s.running.store(
            self.slots.iter().filter(|a| a.is_some()).count(),
            Ordering::SeqCst,
        );
    }

    /// Frees the slots (and drops the waiting requests) whose caller went
    /// away.
    fn drop_cancelled(&mut self) {
        let stats = &self.shared.stats;
        for slot in &mut self.slots {
            if slot.as_ref().is_some_and(|a| a.events.is_closed()) {
                *slot = None;
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
            }
        }
        let before = self.waiting.len();
        self.waiting.retain(|p| !p.events.is_closed());
        let gone = before - self.waiting.len();
        stats.queued.fetch_sub(gone, Ordering::SeqCst);
        stats.cancelled.fetch_add(gone as u64, Ordering::Relaxed);
    }

    /// Entries held by running requests.
    fn held(&self) -> Vec<bool> {
        let mut held = vec![false; self.entries.len()];
        for a in self.slots.iter().flatten() {
            if a.entry > 0 {
                held[a.entry - 1] = true;
            }
        }
        held
    }

    /// The table entry of `adapter` if it is resident, else one it can be
    /// loaded into now (free, else the least recently used one not held),
    /// with whether it must be loaded. None when every entry is held.
    fn entry_for(&self, adapter: &Registered) -> Option<(usize, bool)> {
        if let Some(k) = self
            .entries
            .iter()
            .position(|e| e.as_ref().is_some_and(|e| e.adapter_id == adapter.id))
        {
            return Some((k + 1, false));
        }
        if let Some(k) = self.entries.iter().position(Option::is_none) {
            return Some((k + 1, true));
        }
        let held = self.held();
        self.entries
            .iter()
            .enumerate()
            .filter(|(k, _)| !held[*k])
            .min_by_key(|(_, e)| e.as_ref().map_or(0, |e| e.used))
            .map(|(k, _)| (k + 1, true))
    }

    /// Writes `adapter` (read as `parsed`) into table entry `entry`
    /// (1-based), every part of the entry: what the entry held before
    /// leaves no trace.
    fn load_entry(&mut self, entry: usize, adapter: &Registered, parsed: &Adapter) -> Result<()> {
        let config = &self.shared.config;
        let r = self.tables_shape.max_rank;
        let mut inputs: Vec<DeviceArray> = Vec::new();
        let entry_arr = self.backend.replicate(&HostArray::scalar(entry as i32))?;
        for (module, short) in projections(config) {
            let (din, dout) = config.projection_dims(short).expect("a known projection");
            let mut a_new = vec![0f32; (din * r) as usize];
            let mut b_new = vec![0f32; (r * dout) as usize];
            let mut scale = 0f32;
            if let (Some(la), Some(lb)) = (
                parsed.get(&format!("{module}.lora_a")),
                parsed.get(&format!("{module}.lora_b")),
            ) {
                // A [in, rank] into [in, r]; B [rank, out] into [r, out].
                let rank = la.ty.dims[1] as usize;
                for (k, v) in la.to_f64s().iter().enumerate() {
                    a_new[(k / rank) * r as usize + k % rank] = *v as f32;
                }
                for (k, v) in lb.to_f64s().iter().enumerate() {
                    b_new[k] = *v as f32;
                }
                scale = parsed.lora.scale_of(&module) as f32;
            }
            inputs.push(
                self.backend
                    .replicate(&HostArray::new(&[din, r], &a_new)?)?,
            );
            inputs.push(
                self.backend
                    .replicate(&HostArray::new(&[r, dout], &b_new)?)?,
            );
            inputs.push(self.backend.replicate(&HostArray::scalar(scale))?);
        }
        let mut args: Vec<&DeviceArray> = self.tables.iter().collect();
        args.push(&entry_arr);
        args.extend(inputs.iter());
        self.tables = self.update.run(&args)?;
        self.tick += 1;
        let stats = &self.shared.stats;
        if self.entries[entry - 1].is_some() {
            stats.adapter_evictions.fetch_add(1, Ordering::Relaxed);
        }
        stats.adapter_loads.fetch_add(1, Ordering::Relaxed);
        self.entries[entry - 1] = Some(Entry {
            adapter_id: adapter.id,
            used: self.tick,
        });
        Ok(())
    }

    /// One engine step, one program: a decode token for every running
    /// request, and one chunk of a joining prompt of up to half the token
    /// budget, the whole budget when nothing decodes (the oldest prompt
    /// still being prefilled, else a waiting request moved into a free
    /// slot). The chunk's last token
    /// samples the request's first token when its prompt is in. A request
    /// whose adapter can no longer be read fails alone; a device error is
    /// returned.
    fn step(&mut self) -> Result<()> {
        let shared = self.shared.clone();
        let o = &shared.options;
        let (max_len, budget) = (o.max_model_len, o.max_num_batched_tokens);
        let prefilling = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(k, a)| {
                a.as_ref()
                    .filter(|a| !a.decoding())
                    .map(|a| (a.admitted, k))
            })
            .min()
            .map(|(_, k)| k);
        let chunk_slot = match prefilling {
            Some(k) => Some(k),
            None => self.admit()?,
        };
        let rows = self.decode_rows();
        // The chunk: a power of two up to the budget alone, up to half of
        // it beside decode rows (see `step_shapes`).
        let most = if rows == 0 {
            1usize << budget.max(16).ilog2()
        } else {
            mixed_chunk(o)
        };
        let chunk = chunk_slot.and_then(|slot| {
            let a = self.slots[slot].as_ref()?;
            let len = a.request.prompt.len();
            let n = (len - a.prefilled).min(most);
            let bucket = prefill_bucket(n, max_len);
            // A chunk that would pass the cache's end starts earlier,
            // computing again a few positions it already holds.
            let start = a
                .prefilled
                .min(usize::try_from(max_len - bucket).unwrap_or(0));
            Some(Chunk {
                slot,
                start,
                end: a.prefilled + n,
                bucket,
            })
        });
        match chunk {
            None if rows == 0 => Ok(()),
            // Not compiled yet (see `BatcherOptions::background_compile`):
            // the chunk, then the decode rows, as two programs.
            Some(c) if rows > 0 && !self.steps.contains_key(&(rows as i64, c.bucket)) => {
                self.run_step(0, Some(c))?;
                match self.decode_rows() {
                    0 => Ok(()),
                    rows => self.run_step(rows, None),
                }
            }
            chunk => self.run_step(rows, chunk),
        }
    }

    /// The smallest decode row count covering every decoding slot (new
    /// requests take the lowest free slot, so running ones gather at the
    /// front); 0 when none decodes.
    fn decode_rows(&self) -> usize {
        match self
            .slots
            .iter()
            .rposition(|a| a.as_ref().is_some_and(Active::decoding))
        {
            None => 0,
            Some(last) => decode_buckets(self.slots.len() as i64)
                .into_iter()
                .find(|&r| r > last as i64)
                .unwrap_or(self.slots.len() as i64) as usize,
        }
    }

    /// Runs the step program of `rows` decode rows and `chunk`, and hands
    /// out what it sampled.
    fn run_step(&mut self, rows: usize, chunk: Option<Chunk>) -> Result<()> {
        let max_len = self.shared.options.max_model_len;
        let bucket = chunk.map_or(0, |c| c.bucket);
        // A free row, or one whose prompt is still being prefilled, gets
        // position max_len: it writes nothing.
        let free = i32::try_from(max_len).unwrap_or(i32::MAX);
        let mut ids = Vec::with_capacity(rows + bucket as usize);
        let (mut pos, mut entry) = (vec![free; rows], Vec::new());
        let (mut temp, mut top_k, mut top_p, mut seed) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut sampling = |a: Option<&Active>, entry: &mut Vec<i32>| {
            let s = a.map(|a| &a.request.sampling);
            entry.push(a.map_or(0, |a| a.entry as i32));
            temp.push(s.map_or(0.0, |s| s.temperature() as f32));
            top_k.push(s.map_or(0, |s| self.top_k(s)));
            top_p.push(s.and_then(|s| s.top_p).unwrap_or(1.0) as f32);
            seed.push(a.map_or(0, |a| a.seed));
        };
        for (k, a) in self.slots.iter().take(rows).enumerate() {
            let a = a.as_ref().filter(|a| a.decoding());
            ids.push(a.map_or(0, |a| a.last as i32));
            if let Some(a) = a {
                pos[k] = a.position as i32;
            }
            sampling(a, &mut entry);
        }
        let place = |h: HostArray| self.backend.replicate(&h);
        let mut controls = Vec::new();
        if let Some(Chunk {
            slot,
            start,
            end,
            bucket,
        }) = chunk
        {
            let a = self.slots[slot].as_ref();
            let prompt = a.map_or(&[][..], |a| &a.request.prompt[start..end]);
            ids.extend(prompt.iter().map(|&t| t as i32));
            ids.resize(rows + bucket as usize, 0);
            sampling(a, &mut entry);
            controls.push(place(HostArray::new(&[ids.len() as i64], &ids)?)?);
            if rows > 0 {
                controls.push(place(HostArray::new(&[rows as i64], &pos)?)?);
            }
            for v in [start, end - start, slot] {
                controls.push(place(HostArray::scalar(v as i32))?);
            }
        } else {
            controls.push(place(HostArray::new(&[rows as i64], &ids)?)?);
            controls.push(place(HostArray::new(&[rows as i64], &pos)?)?);
        }
        let outs = [entry.len() as i64];
        controls.push(place(HostArray::new(&outs, &entry)?)?);
        controls.push(place(HostArray::new(&outs, &temp)?)?);
        controls.push(place(HostArray::new(&outs, &top_k)?)?);
        controls.push(place(HostArray::new(&outs, &top_p)?)?);
        controls.push(place(HostArray::new(&outs, &seed)?)?);
        let next: Vec<i32> = self
            .run_program((rows as i64, bucket), &controls)?
            .gather()?
            .to_vec()?;
        let stats = &self.shared.stats;
        let vocab = self.shared.config.vocab_size;
        if rows > 0 {
            stats.decode_steps.fetch_add(1, Ordering::Relaxed);
        }
        for ((slot, held), &next) in self.slots.iter_mut().zip(&mut self.held).zip(&next[..rows]) {
            let Some(a) = slot.as_mut().filter(|a| a.decoding()) else {
                continue;
            };
            let finished = match Self::token(vocab, next, &a.events) {
                None => {
                    *held = Held::default();
                    true
                }
                Some(t) => {
                    held.tokens.push(a.last);
                    a.position += 1;
                    Self::emit(a, t)
                }
            };
            if finished {
                *slot = None;
            }
        }
        let Some(Chunk { slot, end, .. }) = chunk else {
            return Ok(());
        };
        stats.prefill_chunks.fetch_add(1, Ordering::Relaxed);
        let Some(a) = &mut self.slots[slot] else {
            return Ok(());
        };
        let computed = end - a.prefilled;
        stats
            .prompt_tokens_computed
            .fetch_add(computed as u64, Ordering::Relaxed);
        self.held[slot]
            .tokens
            .extend_from_slice(&a.request.prompt[a.prefilled..end]);
        a.prefilled = end;
        if end < a.request.prompt.len() {
            return Ok(());
        }
        // The prompt is in: its first token.
        stats.prefills.fetch_add(1, Ordering::Relaxed);
        let finished = match Self::token(vocab, next[rows], &a.events) {
            None => {
                // What it computed is not a prefix worth reusing.
                self.held[slot] = Held::default();
                true
            }
            Some(token) => {
                a.position = end as i64;
                Self::emit(a, token)
            }
        };
        if finished {
            self.slots[slot] = None;
        }
        Ok(())
    }

    /// Moves the first waiting request whose adapter can be placed into a
    /// free slot: the slot holding the longest prefix of its prompt under
    /// its adapter, else the lowest free one (which then starts from the
    /// longest such prefix any slot holds, copied). Returns the slot, or
    /// None when no slot is free or no request can be placed.
    fn admit(&mut self) -> Result<Option<usize>> {
        loop {
            let Some(free) = self.slots.iter().position(Option::is_none) else {
                return Ok(None);
            };
            let Some(k) = self.waiting.iter().position(|p| match &p.adapter {
                None => true,
                Some(a) => self.entry_for(a).is_some(),
            }) else {
                return Ok(None);
            };
            if let Some(t) = self.shared.options.fail_on_token {
                if self.waiting[k].request.prompt.contains(&t) {
                    panic!("test hook: a prompt holds token {t} (HLO_TRAIN_TEST_FAIL_ON_TOKEN)");
                }
            }
            let Some(p) = self.waiting.remove(k) else {
                return Ok(None);
            };
            self.shared.stats.queued.fetch_sub(1, Ordering::SeqCst);
            // Read from the host before anything runs on the devices: a
            // file gone since it was registered fails this request only.
            let parsed = match &p.adapter {
                None => None,
                Some(a) => match self.shared.adapter(a) {
                    Ok(parsed) => Some(parsed),
                    Err(e) => {
                        let _ = p.events.send(Event::Failed(e.to_string()));
                        continue;
                    }
                },
            };
            let owner = p.adapter.as_ref().map_or(0, |a| a.id);
            let (source, reused) = self.longest_prefix(owner, &p.request.prompt);
            let slot = match source {
                Some(s) if self.slots[s].is_none() => s,
                _ => free,
            };
            let entry = self.place_adapter(&p, parsed.as_deref())?;
            match source {
                Some(src) if src != slot && reused > 0 => self.copy_prefix(src, slot, reused)?,
                _ => {}
            }
            self.held[slot] = Held {
                adapter: owner,
                tokens: p.request.prompt[..reused].to_vec(),
            };
            let stats = &self.shared.stats;
            stats
                .prompt_tokens_reused
                .fetch_add(reused as u64, Ordering::Relaxed);
            self.tick += 1;
            let seed = fold_seed(p.request.sampling.seed);
            self.slots[slot] = Some(Active {
                request: p.request,
                events: p.events,
                entry,
                prefilled: reused,
                position: reused as i64,
                last: 0,
                generated: 0,
                seed,
                admitted: self.tick,
            });
            return Ok(Some(slot));
        }
    }

    /// The slot whose cache holds the longest prefix of `prompt` under
    /// adapter registration `owner` (0: the base model), and its length,
    /// at most all but the last prompt token (whose logits must be
    /// computed). (None, 0) without prefix caching or a match.
    fn longest_prefix(&self, owner: u64, prompt: &[u32]) -> (Option<usize>, usize) {
        if !self.shared.options.prefix_caching {
            return (None, 0);
        }
        let most = prompt.len() - 1;
        let mut best = (None, 0);
        for (k, held) in self.held.iter().enumerate() {
            if held.adapter != owner {
                continue;
            }
            let n = held
                .tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
                .min(most);
            // Ties go to a free slot, which needs no copy.
            if n > best.1 || (n == best.1 && n > 0 && self.slots[k].is_none()) {
                best = (Some(k), n);
            }
        }
        best
    }

    /// Starts slot `dst` from the first `length` positions of slot `src`
    /// (zeros after them).
    fn copy_prefix(&mut self, src: usize, dst: usize, length: usize) -> Result<()> {
        let place = |v: usize| self.backend.replicate(&HostArray::scalar(v as i32));
        let (src, dst, length) = (place(src)?, place(dst)?, place(length)?);
        let mut args: Vec<&DeviceArray> = self.caches.iter().collect();
        args.extend([&src, &length]);
        let rows = self.read.run(&args)?;
        let mut args: Vec<&DeviceArray> = self.caches.iter().collect();
        args.extend(rows.iter());
        args.push(&dst);
        self.caches = self.write.run(&args)?;
        Ok(())
    }

    /// The table entry of `p`'s adapter (`parsed`), uploaded if it is not
    /// resident; 0 for the base model.
    fn place_adapter(&mut self, p: &Pending, parsed: Option<&Adapter>) -> Result<usize> {
        let (Some(a), Some(parsed)) = (&p.adapter, parsed) else {
            return Ok(0);
        };
        let shared = self.shared.clone();
        let stats = &shared.stats;
        let (entry, load) = self
            .entry_for(a)
            .ok_or_else(|| EngineError::Internal("no adapter entry is free".into()))?;
        if load {
            stats.adapter_misses.fetch_add(1, Ordering::Relaxed);
            self.load_entry(entry, a, parsed)?;
        } else {
            stats.adapter_hits.fetch_add(1, Ordering::Relaxed);
        }
        self.tick += 1;
        if let Some(e) = &mut self.entries[entry - 1] {
            e.used = self.tick;
        }
        Ok(entry)
    }

    /// The sampler's top-k for a request: 0 (all) or at most the
    /// vocabulary, which fits the program's i32.
    fn top_k(&self, sampling: &Sampling) -> i32 {
        let vocab = self.shared.config.vocab_size;
        sampling.top_k.map_or(0, |k| {
            i32::try_from(i64::from(k).min(vocab)).unwrap_or(i32::MAX)
        })
    }

    /// The token a program gave a request, or None after telling the
    /// request that its logits were not finite (the programs' -1, or any
    /// id outside the `vocab`).
    fn token(vocab: i64, next: i32, events: &UnboundedSender<Event>) -> Option<u32> {
        match u32::try_from(next) {
            Ok(t) if i64::from(t) < vocab => Some(t),
            _ => {
                let _ = events.send(Event::Failed(
                    "this request's logits are NaN or infinite (its adapter or prompt overflows); no token was sampled".into(),
                ));
                None
            }
        }
    }

    /// Sends `token`; true when the request is finished (and told so).
    fn emit(a: &mut Active, token: u32) -> bool {
        a.generated += 1;
        a.last = token;
        let _ = a.events.send(Event::Token {
            id: token,
            at: std::time::Instant::now(),
        });
        let reason = if a.request.stop_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if a.generated >= a.request.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        match reason {
            Some(r) => {
                let _ = a.events.send(Event::Finished(r));
                true
            }
            None => false,
        }
    }
}

/// Checks a request against the model and the cache in exact arithmetic:
/// a prompt of known tokens that leaves room for at least one generated
/// token, and `max_tokens` that fits what is left.
fn check_request(
    request: &GenerationRequest,
    config: &ModelConfig,
    max_model_len: i64,
) -> Result<(), SubmitError> {
    let len = request.prompt.len();
    if len == 0 {
        return Err(SubmitError::Invalid("prompt", "the prompt is empty".into()));
    }
    if let Some(&bad) = request
        .prompt
        .iter()
        .find(|&&t| i64::from(t) >= config.vocab_size)
    {
        return Err(SubmitError::Invalid(
            "prompt",
            format!(
                "token id {bad} is outside the vocabulary (size {})",
                config.vocab_size
            ),
        ));
    }
    let max_len = usize::try_from(max_model_len).unwrap_or(usize::MAX);
    if len >= max_len {
        return Err(SubmitError::Invalid(
            "prompt",
            format!(
                "the prompt has {len} tokens; this model's maximum context length is {max_len}, which must also hold at least one generated token"
            ),
        ));
    }
    if request.max_tokens == 0 {
        return Err(SubmitError::Invalid(
            "max_tokens",
            "max_tokens must be at least 1".into(),
        ));
    }
    if len
        .checked_add(request.max_tokens)
        .is_none_or(|total| total > max_len)
    {
        return Err(SubmitError::Invalid(
            "max_tokens",
            format!(
                "this model's maximum context length is {max_len} tokens; the prompt has {len} and max_tokens is {}: at most {} can be generated",
                request.max_tokens,
                max_len - len
            ),
        ));
    }
    Ok(())
}

/// The names a served model answers to, as an adapter's
/// `base_model_name_or_path` may give them: how the user named it, its
/// folder (resolved), and the hub id of a hub cache snapshot
/// (`.../models--ORG--NAME/snapshots/REV`).
fn base_names(model: &Model) -> Vec<String> {
    let mut names = vec![model.name.clone()];
    if let Some(c) = &model.checkpoint {
        let dir = std::fs::canonicalize(&c.dir).unwrap_or_else(|_| c.dir.clone());
        names.push(dir.display().to_string());
        let parts: Vec<String> = dir
            .components()
            .map(|p| p.as_os_str().to_string_lossy().into_owned())
            .collect();
        if let [.., repo, snapshots, _] = parts.as_slice() {
            if let (Some(id), "snapshots") = (repo.strip_prefix("models--"), snapshots.as_str()) {
                names.push(id.replacen("--", "/", 1));
            }
        }
    }
    names
}

/// Refuses an adapter (`dir`) whose declared base is not the served model
/// (`served`, `config`) when that base's `config.json` can be read here
/// (a folder, or a hub id in the local cache: nothing is downloaded) and
/// describes another architecture or other shapes. A base that cannot be
/// read is accepted: its shapes were checked against the served model's.
fn check_declared_base(
    dir: &Path,
    declared: &str,
    served: &[String],
    config: &ModelConfig,
) -> Result<()> {
    let same_path =
        |p: &Path| std::fs::canonicalize(p).is_ok_and(|p| served.iter().any(|s| Path::new(s) == p));
    if served.iter().any(|s| s == declared) || same_path(Path::new(declared)) {
        return Ok(());
    }
    let env = crate::hub::HubEnv {
        offline: true,
        ..crate::hub::HubEnv::from_env()
    };
    let Ok(folder) =
        crate::hub::resolve_with(Path::new(declared), crate::hub::HubFiles::Model, &env)
    else {
        return Ok(());
    };
    let file = folder.join("config.json");
    if !file.is_file() || same_path(&folder) {
        return Ok(());
    }
    let refuse = |why: String| EngineError::AdapterBase {
        dir: dir.to_path_buf(),
        declared: declared.to_string(),
        why,
    };
    let theirs = ModelConfig::from_file(&file).map_err(|e| {
        refuse(format!(
            "whose config.json is not a served architecture ({e})"
        ))
    })?;
    let shape = |c: &ModelConfig| {
        (
            c.family.model_type(),
            [
                c.vocab_size,
                c.hidden_size,
                c.intermediate_size,
                c.num_hidden_layers,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
            ],
        )
    };
    let (ours, base) = (shape(config), shape(&theirs));
    if ours.0 != base.0 {
        return Err(refuse(format!(
            "a {} model, and the served model is {}",
            base.0, ours.0
        )));
    }
    if ours.1 != base.1 {
        return Err(refuse(format!(
            "whose shapes (vocabulary, hidden, intermediate, layers, heads, key/value heads, head size) are {:?}, the served model's {:?}",
            base.1, ours.1
        )));
    }
    Ok(())
}

/// What a panic said, for the failure it causes.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    format!("the scheduling thread panicked: {text}")
}

/// A request's 64-bit seed as the sampler's 32-bit one.
fn fold_seed(seed: u64) -> u32 {
    (seed ^ (seed >> 32)) as u32
}

/// A seed for a request that gives none: from the clock and a counter.
pub fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut h = hlo_ir::rng::Fnv1a::new();
    h.update(&t.to_le_bytes());
    h.update(&n.to_le_bytes());
    h.finish()
}
