//! The scheduling thread: it owns the devices' state (the weights, the KV
//! cache, the adapter tables), asks its [`Scheduler`] what each step runs,
//! runs those programs and hands out what they sampled.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use hlo_ir::Literal;
use hlo_models::adapter::Adapter;
use hlo_models::decoder::{
    adapter_table_types, base_parameter_types, cache_types, partition_rules, projections,
    AdapterTables, LoraSelect,
};
use hlo_partitioner::PartitionSpec;
use hlo_runtime::{DeviceArray, HostArray, Lru, Program};
use tokio::sync::mpsc::UnboundedSender;

use super::checks::base_names;
use super::programs::{StepCompiler, StepProgram};
use super::scheduler::{Admission, Chunk, Limits, Phase, Placement, Request, Running, Sampled};
use super::scheduler::{Plan, Scheduler};
use super::{
    step_shapes, BatcherHandle, BatcherOptions, BatcherStats, Command, Event, GenerationRequest,
    Pending, Registered, Shared,
};
use crate::device::backend::{Backend, BackendOptions};
use crate::error::{EngineError, Result};
use crate::infer::generator::{cache_spec, Sampling};
use crate::inputs::model::Model;

/// The test hook's variable (see [`Batcher::spawn`]).
const FAIL_ON_TOKEN: &str = "HLO_TRAIN_TEST_FAIL_ON_TOKEN";

/// What a request that fails alone is told when no token was sampled.
const NOT_FINITE: &str = "this request's logits are NaN or infinite (its adapter or prompt overflows); no token was sampled";

/// What the batcher keeps of a request besides what its scheduler does.
#[derive(Debug)]
struct Job {
    adapter: Option<Registered>,
    events: UnboundedSender<Event>,
    sampling: Sampling,
    /// The sampler's 32-bit seed.
    seed: u32,
}

/// What starting a batcher calls and sets besides its options.
struct Hooks {
    /// Called once what can be checked quickly is.
    starting: Box<dyn FnOnce() + Send>,
    /// A request whose prompt holds this token makes the scheduling
    /// thread panic (a test hook).
    fail_on_token: Option<u32>,
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
    sched: Scheduler<Job>,
    commands: mpsc::Receiver<Command>,
    draining: bool,
    /// The test hook's token (see [`Batcher::spawn`]).
    fail_on_token: Option<u32>,
}

/// The devices' state as a batcher starts: the weights laid out by the
/// model's partition rules, zero adapter tables and zero caches.
struct Placed {
    weights: Vec<DeviceArray>,
    tables: Vec<DeviceArray>,
    caches: Vec<DeviceArray>,
}

impl Placed {
    fn new(
        backend: &Backend,
        model: &Model,
        o: &BatcherOptions,
        tables: &AdapterTables,
        cache: &PartitionSpec,
        seed: u64,
    ) -> Result<Placed> {
        let config = &model.config;
        let rules = partition_rules(config);
        let mut weights = Vec::new();
        for (name, ty) in base_parameter_types(config, o.dtype) {
            let spec = rules.spec_for(&name, ty.rank());
            spec.validate(backend.mesh(), &ty.dims, &name)?;
            let lit = model.weight(&name, o.dtype, seed)?;
            weights.push(backend.place(&HostArray::from(lit), &spec)?);
        }
        let zeros = |ty| HostArray::from(Literal::splat(ty, 0.0));
        let tables = adapter_table_types(config, tables)
            .into_iter()
            .map(|(_, ty)| backend.replicate(&zeros(ty)))
            .collect::<Result<Vec<_>>>()?;
        let slots = o.max_batch_size as i64;
        let caches = cache_types(config, slots, o.max_model_len, o.dtype)
            .into_iter()
            .map(|(_, ty)| backend.place(&zeros(ty), cache))
            .collect::<Result<Vec<_>>>()?;
        Ok(Placed {
            weights,
            tables,
            caches,
        })
    }
}

/// Per output of a step program: the adapter entry and the sampling
/// settings of the request it samples for.
#[derive(Default)]
struct Outputs {
    entry: Vec<i32>,
    temp: Vec<f32>,
    top_k: Vec<i32>,
    top_p: Vec<f32>,
    seed: Vec<u32>,
}

impl Outputs {
    /// Adds the output of `r` (None: a row no request decodes in).
    fn push(&mut self, r: Option<&Running<Job>>, vocab: i64) {
        let s = r.map(|r| &r.request.payload.sampling);
        self.entry.push(r.map_or(0, |r| r.entry as i32));
        self.temp.push(s.map_or(0.0, |s| s.temperature() as f32));
        self.top_k.push(s.map_or(0, |s| top_k(s, vocab)));
        self.top_p
            .push(s.and_then(|s| s.top_p).unwrap_or(1.0) as f32);
        self.seed.push(r.map_or(0, |r| r.request.payload.seed));
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
    ///
    /// A test hook, read here once: with `HLO_TRAIN_TEST_FAIL_ON_TOKEN`
    /// set to a token id, a request whose prompt holds that token makes
    /// the scheduling thread panic, so that tests can see what a server
    /// does when its batcher dies; any other value is an error. Unset in
    /// service.
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
        let fail_on_token = fail_on_token(std::env::var(FAIL_ON_TOKEN))?;
        let hooks = Hooks {
            starting,
            fail_on_token,
        };
        Self::start(backend, model, options, adapters, seed, hooks)
    }

    /// [`Batcher::spawn`] with the test hook set to `token` for this
    /// batcher alone, whatever the environment holds: for tests that
    /// share their process with other batchers.
    #[doc(hidden)]
    pub fn spawn_failing_on_token(
        backend: BackendOptions,
        model: Model,
        options: BatcherOptions,
        adapters: &[(String, PathBuf)],
        seed: u64,
        token: u32,
    ) -> Result<BatcherHandle> {
        let hooks = Hooks {
            starting: Box::new(|| {}),
            fail_on_token: Some(token),
        };
        Self::start(backend, model, options, adapters, seed, hooks)
    }

    fn start(
        backend: BackendOptions,
        model: Model,
        options: BatcherOptions,
        adapters: &[(String, PathBuf)],
        seed: u64,
        hooks: Hooks,
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
                move || match Batcher::new(backend, &model, shared, rx, seed, hooks) {
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
        hooks: Hooks,
    ) -> Result<Batcher> {
        let backend = Backend::open(&backend)?;
        model.check_weights()?;
        (hooks.starting)();
        let o = &shared.options;
        let tables_shape = AdapterTables {
            entries: o.max_loras as i64 + 1,
            max_rank: o.max_lora_rank,
            select: LoraSelect::Gather,
        };
        let cache = cache_spec(backend.mesh(), &shared.config);
        let placed = Placed::new(&backend, model, o, &tables_shape, &cache, seed)?;
        let compile = StepCompiler {
            backend: Arc::new(backend),
            config: shared.config.clone(),
            options: o.clone(),
            tables: tables_shape,
            weights: placed
                .weights
                .iter()
                .map(|w| w.sharding().spec.clone())
                .collect(),
            cache,
        };
        // Every program a step can need is compiled before the first
        // request (none pays a compilation, no running stream waits for
        // one); those of steps with decode rows and a chunk maybe later,
        // on a second thread, since they have fallbacks.
        let (now, later): (Vec<_>, Vec<_>) = step_shapes(o)
            .into_iter()
            .partition(|&(rows, chunk)| !o.background_compile || rows == 0 || chunk == 0);
        let steps = now
            .into_iter()
            .map(|shape| Ok((shape, compile.program(shape)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        let programs = compile.state_programs()?;
        let backend = compile.backend.clone();
        // Started last: nothing below returns early without the
        // batcher, whose drop stops and joins it.
        let stop_compiling = Arc::new(AtomicBool::new(false));
        let (compiled, compiler) = match later.is_empty() {
            true => (None, None),
            false => {
                let (rx, thread) = compile.spawn(later, stop_compiling.clone(), shared.clone())?;
                (Some(rx), Some(thread))
            }
        };
        let shapes: Vec<(i64, i64)> = steps.keys().copied().collect();
        let mut b = Batcher {
            sched: Scheduler::new(Limits::of(o)),
            shared: shared.clone(),
            backend,
            weights: placed.weights,
            tables: placed.tables,
            caches: placed.caches,
            tables_shape,
            steps,
            compiled,
            stop_compiling,
            compiler,
            update: programs.update,
            read: programs.read,
            write: programs.write,
            commands,
            draining: false,
            fail_on_token: hooks.fail_on_token,
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
        let slot = match chunk {
            0 => 0,
            _ => match self.sched.untouched_from(start) {
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

    /// The loop: take commands, admit waiting requests, decode one step.
    /// An error here is the devices' (a program that failed, its donated
    /// state lost): it ends the loop, see [`Batcher::die`].
    fn run(&mut self) -> Result<()> {
        loop {
            if !self.sched.busy() {
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
        let (running, waiting) = self.sched.drain();
        for job in running {
            let _ = job.events.send(Event::Failed(message.clone()));
        }
        let stats = &self.shared.stats;
        for job in waiting {
            stats.queued.fetch_sub(1, Ordering::SeqCst);
            let _ = job.events.send(Event::Failed(message.clone()));
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
            Command::Submit(p) if self.draining => {
                self.shared.stats.queued.fetch_sub(1, Ordering::SeqCst);
                let _ = p
                    .events
                    .send(Event::Failed("the server is shutting down".into()));
            }
            Command::Submit(Pending {
                request,
                adapter,
                events,
            }) => {
                let GenerationRequest {
                    prompt,
                    max_tokens,
                    sampling,
                    stop_ids,
                    ..
                } = request;
                self.sched.enqueue(Request {
                    prompt,
                    adapter: adapter.as_ref().map(|a| a.id),
                    max_tokens,
                    stop_ids,
                    payload: Job {
                        adapter,
                        events,
                        seed: fold_seed(sampling.seed),
                        sampling,
                    },
                });
            }
            Command::Shutdown => self.draining = true,
        }
    }

    fn publish(&self) {
        let running = self.sched.running();
        self.shared.stats.running.store(running, Ordering::SeqCst);
    }

    /// Frees the slots (and drops the waiting requests) whose caller went
    /// away.
    fn drop_cancelled(&mut self) {
        let stats = &self.shared.stats;
        let gone = self.sched.cancel(|job| job.events.is_closed());
        stats.queued.fetch_sub(gone.waiting, Ordering::SeqCst);
        let cancelled = (gone.running + gone.waiting) as u64;
        stats.cancelled.fetch_add(cancelled, Ordering::Relaxed);
    }

    /// One engine step, as the scheduler plans it: a decode token for
    /// every running request, and one chunk of a joining prompt (the
    /// oldest one being prefilled, else a waiting request moved into a
    /// free slot first). A request whose adapter can no longer be read
    /// fails alone; a device error is returned.
    fn step(&mut self) -> Result<()> {
        let Plan {
            chunk, rows, split, ..
        } = loop {
            let steps = &self.steps;
            let plan = self.sched.plan(|shape| steps.contains_key(&shape));
            match &plan.admit {
                // Its request failed alone: plan again without it.
                Some(a) if !self.admit(a)? => continue,
                _ => break plan,
            }
        };
        match chunk {
            None if rows == 0 => Ok(()),
            // Not compiled yet (see `BatcherOptions::background_compile`):
            // the chunk, then the decode rows, as two programs.
            Some(c) if split => {
                self.run_step(0, Some(c))?;
                match self.sched.decode_rows() {
                    0 => Ok(()),
                    rows => self.run_step(rows, None),
                }
            }
            chunk => self.run_step(rows, chunk),
        }
    }

    /// Moves a waiting request into its slot as `a` says: its adapter
    /// uploaded if it is not resident, its prefix copied from another
    /// slot. False when its adapter cannot be read (it fails alone).
    fn admit(&mut self, a: &Admission) -> Result<bool> {
        let stale = || EngineError::Internal("an admission of another scheduler state".into());
        let w = self.sched.waiting().get(a.waiting).ok_or_else(stale)?;
        if let Some(t) = self.fail_on_token {
            if w.prompt.contains(&t) {
                panic!("test hook: a prompt holds token {t} ({FAIL_ON_TOKEN})");
            }
        }
        // Read from the host before anything runs on the devices: a file
        // gone since it was registered fails this request only.
        let parsed = match w.payload.adapter.clone() {
            None => None,
            Some(r) => match self.shared.adapter(&r) {
                Ok(parsed) => Some(parsed),
                Err(e) => {
                    if let Some(w) = self.sched.remove_waiting(a.waiting) {
                        self.shared.stats.queued.fetch_sub(1, Ordering::SeqCst);
                        let _ = w.payload.events.send(Event::Failed(e.to_string()));
                    }
                    return Ok(false);
                }
            },
        };
        if let (Some(placement), Some(parsed)) = (a.entry, parsed) {
            self.place_adapter(placement, &parsed)?;
        }
        if let Some(src) = a.copy_from {
            self.copy_prefix(src, a.slot, a.reused)?;
        }
        if !self.sched.admit(a) {
            return Err(stale());
        }
        let stats = &self.shared.stats;
        stats.queued.fetch_sub(1, Ordering::SeqCst);
        let reused = a.reused as u64;
        stats
            .prompt_tokens_reused
            .fetch_add(reused, Ordering::Relaxed);
        Ok(true)
    }

    /// Uploads `parsed` into its table entry unless it is resident there.
    fn place_adapter(&mut self, placement: Placement, parsed: &Adapter) -> Result<()> {
        let shared = self.shared.clone();
        let stats = &shared.stats;
        if !placement.loads() {
            stats.adapter_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        stats.adapter_misses.fetch_add(1, Ordering::Relaxed);
        self.load_entry(placement.entry(), parsed)?;
        if let Placement::Evict { .. } = placement {
            stats.adapter_evictions.fetch_add(1, Ordering::Relaxed);
        }
        stats.adapter_loads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Writes adapter `parsed` into table entry `entry` (1-based), every
    /// part of the entry: what the entry held before leaves no trace.
    fn load_entry(&mut self, entry: usize, parsed: &Adapter) -> Result<()> {
        let config = &self.shared.config;
        let r = self.tables_shape.max_rank;
        let mut inputs: Vec<DeviceArray> = Vec::new();
        let entry_arr = self.backend.replicate(&HostArray::scalar(entry as i32))?;
        for hlo_models::decoder::Projection {
            module,
            dims: (din, dout),
            ..
        } in projections(config)
        {
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
        Ok(())
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

    /// Runs the step program of `rows` decode rows and `chunk`, and hands
    /// out what it sampled.
    fn run_step(&mut self, rows: usize, chunk: Option<Chunk>) -> Result<()> {
        let bucket = chunk.map_or(0, |c| c.bucket);
        let controls = self.controls(rows, chunk.as_ref())?;
        let next: Vec<i32> = self
            .run_program((rows as i64, bucket), &controls)?
            .gather()?
            .to_vec()?;
        let outs = rows + usize::from(chunk.is_some());
        if next.len() != outs {
            return Err(EngineError::Internal(format!(
                "a step program sampled {} tokens for {outs} outputs",
                next.len()
            )));
        }
        let stats = &self.shared.stats;
        if rows > 0 {
            stats.decode_steps.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(c) = &chunk {
            stats.prefill_chunks.fetch_add(1, Ordering::Relaxed);
            let fresh = c.fresh as u64;
            stats
                .prompt_tokens_computed
                .fetch_add(fresh, Ordering::Relaxed);
            if c.completes {
                stats.prefills.fetch_add(1, Ordering::Relaxed);
            }
        }
        let vocab = self.shared.config.vocab_size;
        self.sched.record(rows, chunk.as_ref(), &next, vocab, tell);
        Ok(())
    }

    /// The per-call inputs of the step program of `rows` decode rows and
    /// `chunk`: the input tokens (each row's last token, then the chunk's
    /// prompt tokens padded to its bucket), the rows' positions, the
    /// chunk's start, length and slot, and each output's adapter entry
    /// and sampling settings.
    fn controls(&self, rows: usize, chunk: Option<&Chunk>) -> Result<Vec<DeviceArray>> {
        let vocab = self.shared.config.vocab_size;
        // A free row, or one whose prompt is still being prefilled, gets
        // position max_len: it writes nothing.
        let free = i32::try_from(self.shared.options.max_model_len).unwrap_or(i32::MAX);
        let (mut ids, mut pos) = (Vec::new(), vec![free; rows]);
        let mut outs = Outputs::default();
        for (k, pos) in pos.iter_mut().enumerate() {
            let r = self.sched.slot(k);
            let last = match r.map(|r| r.phase) {
                Some(Phase::Decoding { position, last }) => {
                    *pos = position as i32;
                    Some(last)
                }
                _ => None,
            };
            ids.push(last.map_or(0, |t| t as i32));
            outs.push(r.filter(|_| last.is_some()), vocab);
        }
        let place = |h: HostArray| self.backend.replicate(&h);
        let mut controls = Vec::new();
        if let Some(c) = chunk {
            let r = self.sched.slot(c.slot);
            let prompt = r.map_or(&[][..], |r| &r.request.prompt[c.start..c.end]);
            ids.extend(prompt.iter().map(|&t| t as i32));
            ids.resize(rows + c.bucket as usize, 0);
            outs.push(r, vocab);
            controls.push(place(HostArray::new(&[ids.len() as i64], &ids)?)?);
            if rows > 0 {
                controls.push(place(HostArray::new(&[rows as i64], &pos)?)?);
            }
            for v in [c.start, c.end - c.start, c.slot] {
                controls.push(place(HostArray::scalar(v as i32))?);
            }
        } else {
            controls.push(place(HostArray::new(&[rows as i64], &ids)?)?);
            controls.push(place(HostArray::new(&[rows as i64], &pos)?)?);
        }
        let n = [outs.entry.len() as i64];
        controls.push(place(HostArray::new(&n, &outs.entry)?)?);
        controls.push(place(HostArray::new(&n, &outs.temp)?)?);
        controls.push(place(HostArray::new(&n, &outs.top_k)?)?);
        controls.push(place(HostArray::new(&n, &outs.top_p)?)?);
        controls.push(place(HostArray::new(&n, &outs.seed)?)?);
        Ok(controls)
    }
}

/// Sends a request what a step gave it.
fn tell(job: &Job, sampled: Sampled) {
    let token = |id| Event::Token {
        id,
        at: std::time::Instant::now(),
    };
    match sampled {
        Sampled::Token(id) => {
            let _ = job.events.send(token(id));
        }
        Sampled::Last(id, reason) => {
            let _ = job.events.send(token(id));
            let _ = job.events.send(Event::Finished(reason));
        }
        Sampled::NotFinite => {
            let _ = job.events.send(Event::Failed(NOT_FINITE.into()));
        }
    }
}

/// The sampler's top-k for a request: 0 (all) or at most the
/// vocabulary, which fits the program's i32.
fn top_k(sampling: &Sampling, vocab: i64) -> i32 {
    sampling.top_k.map_or(0, |k| {
        i32::try_from(i64::from(k).min(vocab)).unwrap_or(i32::MAX)
    })
}

/// The test hook's token from `HLO_TRAIN_TEST_FAIL_ON_TOKEN` (`var`, as
/// read): None when it is unset, an error when it is not a token id.
fn fail_on_token(var: std::result::Result<String, std::env::VarError>) -> Result<Option<u32>> {
    match var {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Ok(value) => value
            .parse()
            .map(Some)
            .map_err(|_| EngineError::TestHookToken(value)),
        Err(std::env::VarError::NotUnicode(value)) => Err(EngineError::TestHookToken(
            value.to_string_lossy().into_owned(),
        )),
    }
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

#[cfg(test)]
mod tests {
    use std::env::VarError;

    use super::*;

    #[test]
    fn the_test_hook_is_a_token_id_or_unset() {
        assert_eq!(fail_on_token(Err(VarError::NotPresent)).unwrap(), None);
        assert_eq!(fail_on_token(Ok("77".into())).unwrap(), Some(77));
        for bad in ["", "x", "-1", "4294967296"] {
            let e = fail_on_token(Ok(bad.into())).unwrap_err();
            assert!(
                e.to_string().contains("HLO_TRAIN_TEST_FAIL_ON_TOKEN"),
                "{e}"
            );
        }
        let odd = std::ffi::OsString::from("7");
        assert!(fail_on_token(Err(VarError::NotUnicode(odd))).is_err());
    }
}
