//! [`Run`]: a training run as one object. Built from a [`RunSpec`], it
//! takes a saved run's settings back when resuming, refuses an output
//! folder that holds another run, reads the data, decides every `auto`
//! (packing from the data; loss chunk and batch axes from the model and
//! mesh, [`crate::step::StepSpec::train_config`]; scan, remat and attention from the
//! devices and memory, [`crate::step::policy`]), compiles the session
//! and restores its state; [`Run::train`] then runs the loop, reporting
//! through [`Hooks`] on process 0 only, and finishes the process group.
//! Every front end (the CLI, `engine/examples/finetune.rs`, the training
//! methods to come) goes through it, so each gets the same policy once.
//!
//! ```no_run
//! use hlo_engine::train::hooks::Quiet;
//! use hlo_engine::run::Run;
//! use hlo_engine::run::spec::RunSpec;
//! // `hlo-train train --steps 20 --out run` ...
//! let mut spec = RunSpec { steps: 20, ..RunSpec::default() };
//! spec.output.out = Some("run".into());
//! Run::new(spec)?.train(&mut Quiet)?;
//! // ... then `hlo-train train --resume run --steps 40`.
//! Run::new(RunSpec::resume("run").with_steps(40))?.train(&mut Quiet)?;
//! # Ok::<(), hlo_engine::EngineError>(())
//! ```

pub mod settings;
pub mod spec;

use std::path::{Path, PathBuf};
use std::time::Instant;

use hlo_data::lock::FolderLock;
use hlo_data::{Batch, DataStats, Loader, Tokenizer};
use hlo_ir::DType;
use hlo_models::adapter::Adapter;
use hlo_models::decoder::ModelConfig;
use hlo_models::preference::Reference;
use hlo_models::train::TrainConfig;
use hlo_runtime::PluginKind;
use regex::Regex;

use crate::analysis::flops;
use crate::device::backend::{Backend, CompilerSpec};
use crate::device::compiled::CompiledStep;
use crate::error::{EngineError, Result};
use crate::inputs::model::{BaseSpec, DtypeSpec, Init, Model, QuantizeSpec};
use crate::objectives::sft::RowFeed;
use crate::objectives::RunInputs;
use crate::rollouts::RolloutInputs;
use crate::run::spec::{differences, RunSpec};
use crate::step::policy::Target;
use crate::step::Toggle;
use crate::train::checkpoint::{self, RunSettings, Saved, StateTransfer};
use crate::train::hooks::{Hooks, Quiet, RunStart, TrainSummary};
use crate::train::session::{Session, SessionOptions};
use crate::train::trainer::{BatchSource, StopFlag, Trainer, TrainerOptions};

/// A run resolved and compiled, ready to train.
pub struct Run {
    spec: RunSpec,
    session: Session,
    loader: Option<Box<dyn BatchSource>>,
    eval: Vec<Batch>,
    /// What `train_state/` records: the session's settings and the run's
    /// identities.
    settings: RunSettings,
    identities: RunSettings,
    stats: DataStats,
    /// A mixture's streams and their shares of the draws.
    streams: Option<String>,
    learning: usize,
    unpacked_fill: f64,
    main: bool,
    out: Option<PathBuf>,
    /// The run folder's lock (process 0's), held while the run lives.
    lock: Option<FolderLock>,
    resumed: bool,
    /// The state a resumed run read and placed, timed.
    restored: Option<StateTransfer>,
    trace_values: Option<Regex>,
    tokenizer: Option<Tokenizer>,
    stop: StopFlag,
    /// The step's decided `auto` choices ([`crate::step::policy::StepPolicy::line`]).
    choices: String,
}

/// What [`Run::new`] reads and decides before compiling: the model, the
/// data, the devices, the adapters and the step's configuration with
/// every `auto` decided (packing by the data too).
struct PreparedStep {
    model: Model,
    teacher: Option<Model>,
    tokenizer: Option<Tokenizer>,
    backend: Backend,
    init: Option<Adapter>,
    reference: Option<Adapter>,
    tc: TrainConfig,
    choices: String,
    identities: RunSettings,
    stats: DataStats,
    streams: Option<String>,
    feed: Feed,
}

impl PreparedStep {
    fn new(spec: &mut RunSpec, resumed: bool) -> Result<PreparedStep> {
        let model = open_model(spec)?;
        let rollouts = spec.objective.def().rollouts();
        if let Some(r) = rollouts {
            spec.objectives = r.resolve(&spec.view(), &model)?;
        }
        let spec = &*spec;
        let teacher = match rollouts {
            Some(r) => r.teacher(&spec.view())?,
            None => None,
        };
        let tokenizer = model.tokenizer(None)?;
        let inputs = RunInputs::read(&spec.view(), &model, tokenizer.as_ref())?;
        let backend = Backend::open(&spec.backend)?;
        let init = init_adapter(spec, &model, resumed)?;
        let reference = spec.objective.def().reference(&spec.view(), &model)?;
        // A preference objective's reference runs in its step; the
        // rollouts score theirs outside it.
        let step_reference = reference
            .as_ref()
            .filter(|_| spec.objective.data() != crate::objectives::Data::Rollouts);
        let dtype = spec.dtype.unwrap_or(match spec.backend.plugin.kind() {
            PluginKind::Cpu if spec.compile_for.is_none() => DType::F32,
            _ => DType::BF16,
        });
        let references = (init.as_ref(), step_reference);
        let (mut tc, mut choices) =
            train_config(spec, &model, &backend, dtype, references, resumed)?;
        let identities = identities(spec, &model, inputs.fingerprint())?;
        let (stats, streams) = (inputs.stats(), inputs.streams());
        let feed = match inputs {
            RunInputs::Rows(rows) => {
                let placed = (&backend, &model);
                Feed::Rows(rows.feed(&spec.view(), placed, &mut tc, reference.as_ref())?)
            }
            RunInputs::Rollouts(rollouts) => Feed::Rollouts(rollouts),
        };
        // Packed rows may need the step's choices again.
        if let Some(line) = decide_packed(spec, &mut tc, &backend, &model.config)? {
            choices = line;
        }
        Ok(PreparedStep {
            model,
            teacher,
            tokenizer,
            backend,
            init,
            reference,
            tc,
            choices,
            identities,
            stats,
            streams,
            feed,
        })
    }
}

/// The devices the step's `auto` choices are for: `compile`'s target,
/// else the run's own.
fn policy_target(spec: &RunSpec, backend: &Backend) -> Result<Target> {
    match spec.compile_for {
        Some(device) => Ok(Target::of_device(device)),
        None => Target::of_backend(backend),
    }
}

/// Whether this process writes and reports (process 0, or the only one).
fn is_main(spec: &RunSpec) -> bool {
    spec.backend
        .launch
        .as_ref()
        .is_none_or(|l| l.process_id == 0)
}

/// Refuses an `out` that holds another run (unless replacing it, or it
/// is the run being resumed), or that another run writes (its lock held),
/// and prepares it; the lock held for the run's life.
fn guard_out(spec: &RunSpec, out: &Path) -> Result<FolderLock> {
    let canonical = |p: &Path| std::fs::canonicalize(p).ok();
    let continuing = spec
        .output
        .resume
        .as_deref()
        .is_some_and(|r| canonical(r).is_some() && canonical(r) == canonical(out));
    checkpoint::make_out(out)?;
    // Before anything in the folder is read or removed: another run's
    // save in progress is not stale.
    let lock = FolderLock::acquire(out, "train")?;
    if checkpoint::holds_run(out) && !continuing && !spec.output.overwrite {
        return Err(EngineError::OutHoldsRun {
            out: out.to_path_buf(),
        });
    }
    checkpoint::prepare_out(out)?;
    Ok(lock)
}

/// The settings a run records beyond the session's own: which model,
/// tokenizer, adapter and data (with their identities), the objective and
/// the run's length.
fn identities(spec: &RunSpec, model: &Model, fingerprint: &str) -> Result<RunSettings> {
    let mut s = RunSettings::default();
    s.set("model-fingerprint", model.fingerprint()?);
    s.set("data-fingerprint", fingerprint);
    // The base as the run holds it (the source it resolved to, a
    // bitsandbytes checkpoint's own NF4 too; the dtype is the step's).
    let base = BaseSpec {
        model: model.source().spec(),
        quantize: QuantizeSpec::of(model.config.quantization),
        dtype: DtypeSpec::default(),
    };
    // What it trains, the base, the data, and what the run writes (to
    // write the same on resume).
    let typed = [
        record_spec(&spec.training())?,
        record_spec(&base)?,
        record_spec(&spec.tokenizer_spec())?,
        record_spec(&spec.data)?,
        record_spec(&spec.eval)?,
        record_spec(&spec.report)?,
        record_spec(&CompilerSpec {
            xla_options: spec.backend.xla_options.clone(),
        })?,
    ];
    for (key, value) in typed.into_iter().flatten() {
        s.set(&key, value);
    }
    for (key, value) in spec.objectives.record(spec.objective) {
        s.set(&key, value);
    }
    // `--batch` in the objective's units (pairs, examples), not the rows
    // of the step it takes.
    s.set("batch", spec.step.batch);
    Ok(s)
}

/// A typed spec as a run records it (its paths made absolute).
fn record_spec<T: serde::Serialize>(
    spec: &T,
) -> Result<serde_json::Map<String, serde_json::Value>> {
    // Only a path made absolute fails to serialise: the working folder.
    serde_json::to_value(spec)
        .map(|v| crate::settings::record(&v))
        .map_err(|e| EngineError::io("read", "the working folder")(std::io::Error::other(e)))
}

/// Refuses to resume a saved run with settings that differ from its own,
/// every difference at once.
fn check_resumed(saved: Option<&Saved>, settings: &RunSettings, spec: &RunSpec) -> Result<()> {
    let (Some(saved), Some(dir)) = (saved, &spec.output.resume) else {
        return Ok(());
    };
    let found = differences(
        &saved.state.settings,
        settings,
        &spec.chosen,
        saved.state.step,
        dir,
    );
    if found.is_empty() {
        return Ok(());
    }
    Err(EngineError::Resume(format!(
        "{} (a resumed run keeps the settings it was saved with)",
        found.join("; ")
    )))
}

/// The adapter to start from (`init_adapter`, not when resuming: the
/// saved state holds the adapter then), refused when it trains with
/// dropout.
fn init_adapter(spec: &RunSpec, model: &Model, resumed: bool) -> Result<Option<Adapter>> {
    let Some(dir) = spec.init_adapter.as_ref().filter(|_| !resumed) else {
        return Ok(None);
    };
    let dropout = Adapter::dropout(dir);
    if dropout > 0.0 {
        return Err(EngineError::AdapterDropout {
            dir: dir.clone(),
            dropout,
        });
    }
    Ok(Some(Adapter::load(dir, &model.config)?))
}

/// The traced step of `spec` over `backend`'s mesh: LoRA settings from a
/// resumed run's own adapter (unless chosen anew), else the adapter it
/// starts from, else the spec's; a preference objective against
/// `reference`.
fn train_config(
    spec: &RunSpec,
    model: &Model,
    backend: &Backend,
    dtype: DType,
    (init, reference): (Option<&Adapter>, Option<&Adapter>),
    resumed: bool,
) -> Result<(TrainConfig, String)> {
    let kind = match reference {
        _ if spec.objectives.preference.precompute_ref => Reference::Precomputed,
        Some(_) => Reference::Adapter,
        None => Reference::Base,
    };
    let target = policy_target(spec, backend)?;
    let policy = spec.policy(&model.config, dtype, backend.mesh(), &target)?;
    let choices = policy.line();
    let mut tc = spec.train_config(&model.config, dtype, backend.mesh(), kind, &policy)?;
    if tc.lora.is_none() {
        return Ok((tc, choices));
    }
    let lora_chosen = crate::settings::names::<crate::step::LoraSpec>()
        .iter()
        .any(|name| spec.chosen.contains(name));
    match (&spec.output.resume, init) {
        (Some(dir), _) if resumed && !lora_chosen => {
            tc.lora = Some(Adapter::read_config(dir)?.for_model(&model.config)?)
        }
        (_, Some(a)) => tc.lora = Some(a.lora.clone()),
        _ => {}
    }
    if let (Some(r), Reference::Adapter) = (reference, kind) {
        let trained = tc.lora.clone();
        tc.loss = tc.loss.with_reference_lora(trained.as_ref(), &r.lora);
    }
    Ok((tc, choices))
}

/// The step's choices again once the data has packed its rows, when
/// they took an attention form that packed rows cannot use (cuDNN's
/// call takes no segment ids); None when nothing changes (rows not
/// packed, or the attention chosen by flag).
fn decide_packed(
    spec: &RunSpec,
    tc: &mut TrainConfig,
    backend: &Backend,
    config: &ModelConfig,
) -> Result<Option<String>> {
    if !tc.packing || !chose_cudnn(spec, tc) {
        return Ok(None);
    }
    let (step, line) = without_cudnn(spec, tc, backend, config)?;
    *tc = step;
    Ok(Some(line))
}

/// Whether `auto` chose cuDNN's attention for the step.
fn chose_cudnn(spec: &RunSpec, tc: &TrainConfig) -> bool {
    tc.attention == hlo_models::attention::AttentionKind::Cudnn
        && spec.step.attention == crate::step::AttentionChoice::Auto
}

/// The step `tc` as `auto` decides it without cuDNN's attention (as for
/// packed rows, which it cannot take), and the choices' line.
fn without_cudnn(
    spec: &RunSpec,
    tc: &TrainConfig,
    backend: &Backend,
    config: &ModelConfig,
) -> Result<(TrainConfig, String)> {
    let mut packed = spec.clone();
    packed.step.packing = Toggle::On;
    let target = policy_target(spec, backend)?;
    let policy = packed.policy(config, tc.dtype, backend.mesh(), &target)?;
    let mut tc = tc.clone();
    tc.attention = policy.attention;
    tc.scan_layers = policy.scan_layers();
    tc.remat_layers = policy.remat_layers();
    tc.remat_mlp = policy.remat_mlp();
    Ok((tc, policy.line()))
}

/// The adapters a session starts from: the initial one, the reference,
/// the teacher.
type Adapters = (Option<Adapter>, Option<Adapter>, Option<Model>);

/// The session of step `tc`, compiled and its state placed (`eval`: with
/// its eval step), and the choices' line: under `auto`, cuDNN's attention
/// that fails to compile falls back to XLA's, and the line says so.
fn open_session(
    spec: &RunSpec,
    (backend, model): (Backend, Model),
    tc: TrainConfig,
    (init, reference, teacher): Adapters,
    (eval, choices): (bool, String),
) -> Result<(Session, String)> {
    let (fallback, line) = match chose_cudnn(spec, &tc) {
        true => {
            let (step, line) = without_cudnn(spec, &tc, &backend, &model.config)?;
            (Some(step), Some(line))
        }
        false => (None, None),
    };
    let in_step = tc.loss.step_loss().reference() == Some(Reference::Adapter);
    let executable = match &spec.executable {
        Some(_) if spec.mode != hlo_runtime::Mode::Jit => {
            return Err(EngineError::Executable(
                "--executable loads a compiled step; --eager compiles op by op".into(),
            ))
        }
        Some(path) => Some(std::sync::Arc::new(CompiledStep::read(path)?)),
        None => None,
    };
    let options = SessionOptions {
        mode: spec.mode,
        seed: spec.seed,
        init_adapter: init,
        // Only a reference in the step needs its tensors placed.
        reference_adapter: reference.filter(|_| in_step),
        teacher,
        eval,
        fallback,
        executable,
        ..SessionOptions::default()
    };
    let session = Session::new(backend, model, tc, options)?;
    let mut choices = match (session.fell_back(), line) {
        (Some(why), Some(line)) => format!(
            "{line} (cuDNN's attention, chosen first, failed to compile: {})",
            why.lines().next().unwrap_or_default()
        ),
        _ => choices,
    };
    if let Some(path) = &spec.executable {
        choices.push_str(&format!(
            "; the train step loaded from {} (compiled by `hlo-train compile`), not compiled",
            path.display()
        ));
    }
    Ok((session, choices))
}

/// What feeds the trainer, by objective.
enum Feed {
    Rows(RowFeed),
    Rollouts(RolloutInputs),
}

/// A run's batches from `cursor` on, its held-out batches, the samples
/// it learns from and the unpacked fill.
type Source = (Box<dyn BatchSource>, Vec<Batch>, usize, f64);

impl Feed {
    /// The batch source of the placed `session` (`samples`: the data's,
    /// what rollouts count as learned from).
    fn source(
        self,
        session: &Session,
        spec: &RunSpec,
        reference: Option<&Adapter>,
        (cursor, samples): (u64, usize),
    ) -> Result<Source> {
        Ok(match self {
            Feed::Rows(RowFeed {
                mut loader,
                eval,
                learning,
                unpacked_fill,
                ..
            }) => {
                loader.cursor = cursor;
                let rows = own_rows(loader, session, spec)?;
                (Box::new(rows), eval, learning, unpacked_fill)
            }
            Feed::Rollouts(r) => {
                let source = r.source(session, &spec.view(), reference, cursor)?;
                (source, Vec::new(), samples, 1.0)
            }
        })
    }
}

/// Where the run writes (`out`, else the folder it resumes), checked
/// and prepared by the process that writes (`main`).
fn output_folder(spec: &RunSpec, main: bool) -> Result<(Option<PathBuf>, Option<FolderLock>)> {
    let out = spec
        .output
        .out
        .clone()
        .or_else(|| spec.output.resume.clone());
    if spec.report.save_every > 0 && out.is_none() {
        return Err(EngineError::SaveEveryNeedsOut);
    }
    let lock = match out.as_ref().filter(|_| main) {
        Some(out) => Some(guard_out(spec, out)?),
        None => None,
    };
    Ok((out, lock))
}

/// Where a resumed run's data continues: the saved cursor, refused when
/// the saved step count cannot have reached it (a row holds at most
/// `seq` samples; one batch more was drawn ahead).
fn saved_cursor(saved: Option<&Saved>, session: &Session) -> Result<u64> {
    let Some(saved) = saved else {
        return Ok(0);
    };
    let (cursor, step) = (saved.state.data_cursor, saved.state.step.max(0) as u64);
    let c = session.config();
    let per_step = (c.rows().max(1) as u64).saturating_mul(c.seq.max(1) as u64);
    let reachable = step.saturating_add(1).saturating_mul(per_step);
    if cursor > reachable {
        return Err(EngineError::Resume(format!(
            "the saved data_cursor {cursor} is past what {step} steps of {} rows of {} tokens can have drawn ({reachable}): state.json was changed or damaged",
            c.rows(),
            c.seq
        )));
    }
    Ok(cursor)
}

/// The saved run `spec` resumes (its settings taken back into `spec`),
/// with the objective's settings then checked.
fn take_saved(spec: &mut RunSpec) -> Result<Option<Saved>> {
    let saved = match &spec.output.resume {
        Some(dir) => {
            let saved = checkpoint::load(dir)?;
            spec.merge_saved(&saved.state.settings)?;
            Some(saved)
        }
        None => None,
    };
    spec.objectives = std::mem::take(&mut spec.objectives).resolved(spec.objective);
    spec.check_objective_settings()?;
    Ok(saved)
}

/// `--trace-values`' pattern, compiled.
fn trace_values(spec: &RunSpec) -> Result<Option<Regex>> {
    let Some(r) = &spec.trace_values else {
        return Ok(None);
    };
    Regex::new(r).map(Some).map_err(|cause| EngineError::Regex {
        what: "--trace-values",
        pattern: r.clone(),
        cause,
    })
}

/// The run's model with its tokenizer and quantization, its weights
/// checked; NF4 weights are frozen, so full finetuning of them is refused.
fn open_model(spec: &RunSpec) -> Result<Model> {
    let model = Model::open(&spec.model)?
        .with_tokenizer_file(spec.tokenizer.clone())
        .with_random_weights(spec.init == Some(Init::Random))
        .quantized(spec.quantize)?;
    let model = spec.objective.model(model)?;
    if spec.step.full && model.config.quantization.is_some() {
        return Err(EngineError::FullOfNf4);
    }
    if spec.init == Some(Init::Random) && !spec.step.full {
        return Err(EngineError::RandomInitLora);
    }
    model.check_weights()?;
    Ok(model)
}

/// Restores the saved run `spec` resumes onto `session`, timed from
/// `read_s` (the seconds reading it took).
fn restore(
    session: &mut Session,
    saved: Option<&Saved>,
    spec: &RunSpec,
    read_s: f64,
) -> Result<Option<StateTransfer>> {
    let (Some(saved), Some(dir)) = (saved, &spec.output.resume) else {
        return Ok(None);
    };
    let placing = Instant::now();
    let bytes = session.restore_saved(&saved.tensors)?;
    Ok(Some(StateTransfer {
        step: saved.state.step,
        dir: dir.clone(),
        bytes,
        seconds: read_s + placing.elapsed().as_secs_f64(),
        model: None,
    }))
}

/// Across processes each fills only its rows of a batch of samples
/// (pairs and unpaired rows are still filled whole).
fn own_rows(loader: Loader, session: &Session, spec: &RunSpec) -> Result<Loader> {
    if spec.objective.data() != crate::objectives::Data::Samples {
        return Ok(loader);
    }
    Ok(match session.owned_rows()? {
        Some(owned) => loader.with_owned_rows(owned),
        None => loader,
    })
}

impl Run {
    /// Resolves `spec` (resuming its saved run if it names one), reads
    /// the data, compiles the step and places (or restores) its state.
    /// What differs between objectives (the data, the reference, the
    /// batches) comes from the objective's own module
    /// ([`crate::objectives`]).
    pub fn new(mut spec: RunSpec) -> Result<Run> {
        let reading = Instant::now();
        let saved = take_saved(&mut spec)?;
        let read_s = reading.elapsed().as_secs_f64();
        let resumed = saved.is_some();
        let main = is_main(&spec);
        let (out, lock) = output_folder(&spec, main)?;
        let trace_values = trace_values(&spec)?;
        let p = PreparedStep::new(&mut spec, resumed)?;
        let mut settings = RunSettings::of_config(&p.tc, spec.seed);
        settings.extend(&p.identities);
        check_resumed(saved.as_ref(), &settings, &spec)?;
        let reference = p.reference.clone();
        let adapters = (p.init, p.reference, p.teacher);
        let eval = matches!(&p.feed, Feed::Rows(f) if f.has_eval);
        let (mut session, choices) = open_session(
            &spec,
            (p.backend, p.model),
            p.tc,
            adapters,
            (eval, p.choices),
        )?;
        let restored = restore(&mut session, saved.as_ref(), &spec, read_s)?;
        let cursor = saved_cursor(saved.as_ref(), &session)?;
        let (loader, eval, learning, unpacked_fill) = p.feed.source(
            &session,
            &spec,
            reference.as_ref(),
            (cursor, p.stats.samples),
        )?;
        Ok(Run {
            spec,
            session,
            loader: Some(loader),
            eval,
            settings,
            identities: p.identities,
            stats: p.stats,
            streams: p.streams,
            learning,
            unpacked_fill,
            main,
            out,
            lock,
            resumed,
            restored,
            trace_values,
            tokenizer: p.tokenizer,
            stop: StopFlag::default(),
            choices,
        })
    }

    /// The run's train step, traced as [`Run::new`] would compile it and
    /// compiled for `spec.compile_for`'s devices (their own XLA compiler,
    /// no GPU needed) or else by the run's plugin, with no state placed:
    /// what `hlo-train compile` writes for `train --executable`, and the
    /// step's choices line. Under `auto`, cuDNN's attention, which cannot
    /// be compiled without a GPU, is replaced by XLA's (a run loading the
    /// result falls back to the same step).
    pub fn compile(mut spec: RunSpec) -> Result<(CompiledStep, String)> {
        let mut p = PreparedStep::new(&mut spec, false)?;
        let mut choices = p.choices;
        if spec.compile_for.is_some() && chose_cudnn(&spec, &p.tc) {
            let (tc, line) = without_cudnn(&spec, &p.tc, &p.backend, &p.model.config)?;
            p.tc = tc;
            choices = format!("{line} (cuDNN's attention, chosen first, cannot be compiled without a GPU; a run loading this step falls back to it)");
        }
        let mesh = p.backend.mesh();
        let step = crate::device::pipeline::ShardedStep::train(&p.model.config, &p.tc, mesh)?;
        let settings = crate::train::checkpoint::step_settings(&p.model, &p.tc, mesh);
        let target = (spec.compile_for, spec.backend.xla_options.as_slice());
        let compiled = CompiledStep::compile(&step, &p.backend, target, settings)?;
        Ok((compiled, choices))
    }

    /// Stops the run when `stop` is set (after the step in flight, saving
    /// to `out`): `StopFlag::on_signals()` for SIGINT and SIGTERM.
    pub fn with_stop(mut self, stop: StopFlag) -> Run {
        self.stop = stop;
        self
    }

    /// Trains to the spec's step count (or until stopped), evaluating and
    /// saving as it says; `hooks` hear the run on process 0 (the other
    /// processes compute alongside, silently). Then waits for every
    /// process of the run to finish.
    pub fn train(&mut self, hooks: &mut dyn Hooks) -> Result<TrainSummary> {
        let mut quiet = Quiet;
        let hooks: &mut dyn Hooks = if self.main { hooks } else { &mut quiet };
        let loader = self.loader.take().ok_or(EngineError::RunFinished)?;
        let dtype = self.session.config().dtype;
        let peak = flops::peak_flops(self.session.backend(), dtype, self.spec.peak_tflops)?;
        hooks.on_start(&RunStart {
            settings: self.settings.clone(),
            mesh: self.session.backend().mesh().clone(),
            out: self.out.clone(),
            step: self.session.steps_done(),
            steps: self.spec.steps,
            resumed: self.resumed,
            choices: self.choices.clone(),
        })?;
        let options = TrainerOptions {
            steps: self.spec.steps,
            eval_every: self.spec.eval.every_or(self.spec.report.log_every),
            save_every: self.spec.report.save_every,
            out: self.out.clone(),
            settings: self.identities.clone(),
            trace_values: self.trace_values.clone(),
            peak_flops: Some(peak),
            smoothing_window: 20,
        };
        let eval = std::mem::take(&mut self.eval);
        let summary =
            Trainer::with_source(&mut self.session, loader, eval, options, self.stop.clone())?
                .run(hooks)?;
        // Process 0 serves the rendezvous until every process is done.
        if let Some(group) = self.session.backend().group() {
            group.finish()?;
        }
        hooks.on_end(&summary)?;
        Ok(summary)
    }

    /// The spec as resolved: a resumed run's with its saved settings.
    pub fn spec(&self) -> &RunSpec {
        &self.spec
    }

    /// The step's decided `auto` choices and why, in one line
    /// ([`crate::step::policy::StepPolicy::line`]).
    pub fn choices(&self) -> &str {
        &self.choices
    }

    /// The compiled step and its state (the trained adapter after
    /// [`Run::train`]).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Every setting the run's result depends on, resolved.
    pub fn settings(&self) -> &RunSettings {
        &self.settings
    }

    /// What the training data holds.
    pub fn data_stats(&self) -> &DataStats {
        &self.stats
    }

    /// A mixture's streams and their shares of the draws (`web 0.700,
    /// code 0.300`), said in the header.
    pub fn streams(&self) -> Option<&str> {
        self.streams.as_deref()
    }

    /// Samples that teach something within a row.
    pub fn learning_samples(&self) -> usize {
        self.learning
    }

    /// The mean share of a row the samples fill unpacked.
    pub fn unpacked_fill(&self) -> f64 {
        self.unpacked_fill
    }

    /// The model's tokenizer, if it has one.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// Where the run saves.
    pub fn out(&self) -> Option<&Path> {
        self.out.as_deref()
    }

    /// The line to print when the run folder's lock was taken over from
    /// a run that died holding it.
    pub fn lock_note(&self) -> Option<String> {
        self.lock.as_ref().and_then(FolderLock::took_over_line)
    }

    /// Whether this process writes and reports.
    pub fn is_main(&self) -> bool {
        self.main
    }

    /// Whether the run continues a saved one.
    pub fn resumed(&self) -> bool {
        self.resumed
    }

    /// What a resumed run read and placed, and how long it took.
    pub fn restored(&self) -> Option<&StateTransfer> {
        self.restored.as_ref()
    }
}
