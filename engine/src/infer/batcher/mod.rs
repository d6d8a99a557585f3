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
//!
//! The files: what each step runs (which request takes which slot, from
//! which prefix, in which adapter entry; which chunk beside which decode
//! rows) is decided by plain code in `scheduler.rs`, tested without a
//! device; `thread.rs` runs the programs it plans (`programs.rs` compiles
//! them); `checks.rs` checks requests and adapters' declared bases.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use hlo_ir::DType;
use hlo_models::adapter::Adapter;
use hlo_models::decoder::{lora_parameter_types, LoraSelect, ModelConfig};
use hlo_runtime::Lru;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::error::{EngineError, Result};
use crate::infer::generator::{prompt_bucket, Sampling};

mod checks;
mod programs;
mod scheduler;
mod thread;

use checks::{check_declared_base, check_request};
use scheduler::{chunk_alone, chunk_beside_decode, queue_room};
pub use thread::Batcher;

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
    /// The weights' and caches' element type.
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
}

/// One completion to generate.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// A registered adapter's name; None for the base model.
    pub adapter: Option<String>,
    /// The most tokens to generate.
    pub max_tokens: usize,
    /// How tokens are drawn, with the request's seed.
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
    /// A sampled token, and when.
    Token { id: u32, at: std::time::Instant },
    /// The completion ended.
    Finished(FinishReason),
    /// The request failed, and why; no event follows.
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
    /// Requests waiting for a slot.
    pub queued: AtomicUsize,
    /// Requests in slots.
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
    /// Steps that ran decode rows.
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
    /// The name requests give.
    pub name: String,
    /// The PEFT folder it was read from.
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

/// What a handle tells the scheduling thread.
enum Command {
    Submit(Pending),
    /// Take no more requests; end once those held are done.
    Shutdown,
}

/// A request as submitted, its adapter looked up.
struct Pending {
    request: GenerationRequest,
    adapter: Option<Registered>,
    events: UnboundedSender<Event>,
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
        if let Err(full) = queue_room(queued, s.options.max_queue) {
            s.stats.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(full);
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

    /// The batcher's counters.
    pub fn stats(&self) -> &BatcherStats {
        &self.shared.stats
    }

    /// Why the scheduling thread died, if it has: every request it held
    /// was failed, and new ones are refused ([`SubmitError::Failed`]).
    pub fn failure(&self) -> Option<String> {
        self.shared.failure()
    }

    /// The options the batcher was started with.
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
pub(crate) fn prefill_bucket(len: usize, max_len: i64) -> i64 {
    prompt_bucket(len).min(max_len)
}

/// The largest chunk a step with decode rows carries: half the token
/// budget (a power of two, at least 16).
pub fn mixed_chunk(options: &BatcherOptions) -> usize {
    chunk_beside_decode(options.max_num_batched_tokens)
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
    let most = chunk_alone(options.max_num_batched_tokens);
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
