//! [`Run`]: a training run as one object. Built from a [`RunSpec`], it
//! takes a saved run's settings back when resuming, refuses an output
//! folder that holds another run, reads the data, decides every `auto`
//! (packing from the data; loss chunk and batch axes from the model and
//! mesh, [`StepSpec::train_config`]; scan, remat and attention from the
//! devices and memory, [`crate::policy`]), compiles the session
//! and restores its state; [`Run::train`] then runs the loop, reporting
//! through [`Hooks`] on process 0 only, and finishes the process group.
//! Every front end (the CLI, `engine/examples/finetune.rs`, the training
//! methods to come) goes through it, so each gets the same policy once.
//!
//! ```no_run
//! use hlo_engine::{Quiet, Run, RunSpec};
//! // `hlo-train train --steps 20 --out run` ...
//! let mut spec = RunSpec { steps: 20, ..RunSpec::default() };
//! spec.output.out = Some("run".into());
//! Run::new(spec)?.train(&mut Quiet)?;
//! // ... then `hlo-train train --resume run --steps 40`.
//! Run::new(RunSpec::resume("run").with_steps(40))?.train(&mut Quiet)?;
//! # Ok::<(), hlo_engine::EngineError>(())
//! ```

use std::path::{Path, PathBuf};

use hlo_data::{
    eval_batches, eval_pair_batches, Batch, DataStats, Loader, PreferencePair, Tokenizer,
};
use hlo_ir::DType;
use hlo_models::adapter::Adapter;
use hlo_models::preference::Reference;
use hlo_models::train::TrainConfig;
use hlo_runtime::PluginKind;
use regex::Regex;

use crate::backend::Backend;
use crate::checkpoint::{self, RunSettings, Saved};
use crate::dataset::{DataSpec, Dataset};
use crate::error::{EngineError, Result};
use crate::flops;
use crate::grpo::{
    read_rollouts, session_generator, PromptSet, Rewards, RolloutOrigin, RolloutSource,
};
use crate::hooks::{Hooks, Quiet, RunStart, TrainSummary};
use crate::model::{Model, ModelSource};
use crate::policy::Target;
use crate::run_spec::Objective;
use crate::run_spec::{differences, RunSpec};
use crate::session::{Session, SessionOptions};
use crate::spec::{auto_packing, Toggle};
use crate::trainer::{BatchSource, StopFlag, Trainer, TrainerOptions};

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
    learning: usize,
    unpacked_fill: f64,
    main: bool,
    out: Option<PathBuf>,
    resumed: bool,
    trace_values: Option<Regex>,
    tokenizer: Option<Tokenizer>,
    stop: StopFlag,
    /// The step's decided `auto` choices ([`crate::policy::StepPolicy::line`]).
    choices: String,
}

/// Prompts of the bundled task a GRPO run without data draws.
const DEMO_PROMPTS: usize = 2000;

/// Whether this process writes and reports (process 0, or the only one).
fn is_main(spec: &RunSpec) -> bool {
    spec.backend
        .launch
        .as_ref()
        .is_none_or(|l| l.process_id == 0)
}

/// Refuses an `out` that holds another run (unless replacing it, or it
/// is the run being resumed), and prepares it.
fn guard_out(spec: &RunSpec, out: &Path) -> Result<()> {
    let canonical = |p: &Path| std::fs::canonicalize(p).ok();
    let continuing = spec
        .output
        .resume
        .as_deref()
        .is_some_and(|r| canonical(r).is_some() && canonical(r) == canonical(out));
    if checkpoint::holds_run(out) && !continuing && !spec.output.overwrite {
        return Err(EngineError::OutHoldsRun {
            out: out.to_path_buf(),
        });
    }
    checkpoint::prepare_out(out)
}

/// An absolute path, for what a run records.
fn absolute(p: &Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_path_buf())
        .display()
        .to_string()
}

/// An absolute path for `p`, which may not exist yet (a metrics file).
fn absolute_new(p: &Path) -> Result<String> {
    if p.exists() {
        return Ok(absolute(p));
    }
    let cwd = std::env::current_dir().map_err(EngineError::io("read", "the working folder"))?;
    Ok(cwd.join(p).display().to_string())
}

/// Settings recorded as a list of their command-line spellings.
fn written_list<T: std::fmt::Display>(items: &[T]) -> serde_json::Value {
    items.iter().map(|t| t.to_string()).collect()
}

/// The settings a run records beyond the session's own: which model,
/// tokenizer, adapter and data (with their identities), the objective and
/// the run's length.
fn identities(spec: &RunSpec, model: &Model, data: &Dataset) -> Result<RunSettings> {
    let mut s = RunSettings::default();
    match model.source() {
        ModelSource::Preset(name) => s.set("model", name.as_str()),
        ModelSource::Config(p) => s.set("config", absolute(p)),
        ModelSource::Checkpoint(p) => s.set("checkpoint", absolute(p)),
    }
    s.set("model-fingerprint", model.fingerprint()?);
    // The base as the run holds it (a bitsandbytes checkpoint's own NF4 too).
    if let Some(q) = model.config.quantization {
        s.set("quantize", "nf4");
        s.set("double-quant", q.double_quant);
    }
    for (key, path) in [
        ("tokenizer", &spec.tokenizer),
        ("init-adapter", &spec.init_adapter),
        ("data", &spec.data.path),
        ("chat-template", &spec.data.chat_template),
    ] {
        if let Some(p) = path {
            s.set(key, absolute(p));
        }
    }
    s.set("data-fingerprint", data.fingerprint.as_str());
    // What it writes, to write the same on resume.
    for (key, path) in [
        ("eval-data", &spec.eval.data),
        ("metrics", &spec.report.metrics),
        ("tensorboard", &spec.report.tensorboard),
    ] {
        if let Some(p) = path {
            s.set(key, absolute_new(p)?);
        }
    }
    s.set("eval-every", spec.eval.every);
    s.set("save-every", spec.output.save_every);
    s.set("log-every", spec.report.log_every);
    s.set("train-on-inputs", spec.data.train_on_inputs);
    s.set("objective", spec.objective.name());
    if spec.objective.is_preference() {
        // `batch` counts pairs (the step's rows are twice as many).
        s.set("batch", spec.step.batch);
        let p = &spec.preference;
        s.set("beta", p.beta);
        s.set("simpo-gamma", p.simpo_gamma);
        s.set("label-smoothing", p.label_smoothing);
        s.set("cpo-alpha", p.cpo_alpha);
        if let Some(dir) = &p.ref_adapter {
            s.set("ref-adapter", absolute(dir));
        }
        s.set("precompute-ref", p.precompute_ref);
    }
    if spec.objective == Objective::Grpo {
        grpo_identities(&mut s, spec);
    }
    s.set("steps", spec.steps);
    // As `--xla-option` spells each, so a recipe and a resume read them back.
    let xla: Vec<String> = spec
        .backend
        .xla_options
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    s.set("xla-option", xla);
    Ok(s)
}

/// GRPO's settings, as [`identities`] records them.
fn grpo_identities(s: &mut RunSettings, spec: &RunSpec) {
    let g = &spec.grpo;
    s.set("beta", g.beta);
    s.set("num-generations", g.num_generations as u64);
    s.set("epsilon", g.epsilon);
    if let Some(e) = g.epsilon_high {
        s.set("epsilon-high", e);
    }
    s.set("num-iterations", g.num_iterations as u64);
    s.set("scale-rewards", g.scale_rewards.name());
    s.set("loss-type", g.loss_type.name());
    s.set("max-completion-length", g.max_completion_length as u64);
    s.set("temperature", g.temperature);
    s.set("top-p", g.top_p);
    s.set("top-k", g.top_k);
    s.set("reward", written_list(&g.rewards));
    if let Some(p) = &g.rollouts {
        s.set("rollouts", absolute(p));
    }
    if !g.reward_weights.is_empty() {
        s.set("reward-weights", written_list(&g.reward_weights));
    }
    s.set("answer-column", g.answer_column.as_str());
    if let Some(r) = &g.format_regex {
        s.set("format-regex", r.as_str());
    }
    if let Some(c) = &g.reward_command {
        s.set("reward-command", c.as_str());
    }
    if let Some(u) = &g.reward_url {
        s.set("reward-url", u.as_str());
    }
    s.set("reward-timeout", g.reward_timeout);
    s.set("log-completions", g.log_completions as u64);
    if let Some(dir) = &spec.preference.ref_adapter {
        s.set("ref-adapter", absolute(dir));
    }
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

/// DPO's and IPO's reference adapter, as TRL 1.16 chooses the reference:
/// `--ref-adapter`, else a frozen copy of the adapter training started
/// from (read again on resume), else None: the base with the adapter off
/// (a fresh adapter's starting policy). Refused where the objective has
/// no reference, or would need a second copy of the base.
fn reference_adapter(spec: &RunSpec, model: &Model) -> Result<Option<Adapter>> {
    let objective = spec.objective;
    let refuse = |why: String| EngineError::Preference {
        objective: objective.name(),
        why,
    };
    let needs = spec
        .objective
        .preference_loss(&spec.preference)
        .is_some_and(|l| l.needs_reference());
    // (A reference setting given to an objective without one is refused
    // by `RunSpec::check_objective_settings`.)
    if !needs {
        return Ok(None);
    }
    if spec.step.lora.is_none() {
        if spec.preference.precompute_ref {
            // The base as training starts, scored before it changes.
            return Ok(None);
        }
        return Err(refuse(
            "full finetuning would keep a second copy of the base as the reference; add --precompute-ref (its log-probabilities computed before training) or train LoRA".into(),
        ));
    }
    let Some(dir) = spec
        .preference
        .ref_adapter
        .as_ref()
        .or(spec.init_adapter.as_ref())
    else {
        return Ok(None);
    };
    let adapter = Adapter::load(dir, &model.config)?;
    if !adapter.lora.modules_to_save.is_empty() {
        return Err(refuse(format!(
            "the reference adapter {} saves whole modules ({}), which a reference adapter cannot",
            dir.display(),
            adapter.lora.modules_to_save.join(", ")
        )));
    }
    Ok(Some(adapter))
}

/// Each pair's reference log-probabilities when `tc`'s reference is
/// precomputed (None otherwise).
fn reference_scores(
    backend: &Backend,
    model: &Model,
    tc: &TrainConfig,
    reference: Option<&Adapter>,
    pairs: &[PreferencePair],
    seed: u64,
) -> Result<Option<Vec<[f32; 2]>>> {
    match tc.preference.map(|p| p.reference) {
        Some(Reference::Precomputed) => Ok(Some(crate::reference::precompute(
            backend, model, tc, reference, pairs, seed,
        )?)),
        _ => Ok(None),
    }
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
        _ if spec.preference.precompute_ref => Reference::Precomputed,
        Some(_) => Reference::Adapter,
        None => Reference::Base,
    };
    let target = Target::of_backend(backend)?;
    let policy = spec.policy(&model.config, dtype, backend.mesh(), &target)?;
    let choices = policy.line();
    let mut tc = spec.train_config(&model.config, dtype, backend.mesh(), kind, &policy)?;
    if tc.lora.is_none() {
        return Ok((tc, choices));
    }
    let lora_chosen = [
        "lora-rank",
        "lora-alpha",
        "lora-targets",
        "use-rslora",
        "modules-to-save",
    ]
    .iter()
    .any(|k| spec.chosen.contains(k));
    match (&spec.output.resume, init) {
        (Some(dir), _) if resumed && !lora_chosen => tc.lora = Some(Adapter::read_config(dir)?),
        (_, Some(a)) => tc.lora = Some(a.lora.clone()),
        _ => {}
    }
    // A reference in the step runs in the policy's form on its own
    // tensors (a precomputed one runs in its own).
    if let (Some(r), Some(l), Reference::Adapter) = (reference, &tc.lora, kind) {
        if &r.lora != l {
            return Err(EngineError::Preference {
                objective: spec.objective.name(),
                why: format!(
                    "the reference adapter is r={} alpha={} on {}, the trained one r={} alpha={} on {}: a reference adapter must have the trained adapter's LoRA settings",
                    r.lora.rank,
                    r.lora.alpha,
                    r.lora.target_modules.join(","),
                    l.rank,
                    l.alpha,
                    l.target_modules.join(",")
                ),
            });
        }
    }
    Ok((tc, choices))
}

/// The step's choices again once the data has packed its rows, when
/// they took an attention form that packed rows cannot use (cuDNN's
/// call takes no segment ids); None when nothing changes.
fn decide_packed(
    spec: &RunSpec,
    tc: &mut TrainConfig,
    backend: &Backend,
    config: &hlo_models::decoder::ModelConfig,
) -> Result<Option<String>> {
    if tc.attention != hlo_models::attention::AttentionKind::Cudnn
        || spec.step.attention != crate::spec::AttentionChoice::Auto
    {
        return Ok(None);
    }
    let mut packed = spec.clone();
    packed.step.packing = Toggle::On;
    let target = Target::of_backend(backend)?;
    let policy = packed.policy(config, tc.dtype, backend.mesh(), &target)?;
    tc.attention = policy.attention;
    tc.scan_layers = policy.scan_layers();
    tc.remat_layers = policy.remat_layers();
    Ok(Some(policy.line()))
}

impl Run {
    /// Resolves `spec` (resuming its saved run if it names one), reads
    /// the data, compiles the step and places (or restores) its state.
    pub fn new(mut spec: RunSpec) -> Result<Run> {
        let saved: Option<Saved> = match &spec.output.resume {
            Some(dir) => {
                let saved = checkpoint::load(dir)?;
                spec.merge_saved(&saved.state.settings)?;
                Some(saved)
            }
            None => None,
        };
        let resumed = saved.is_some();
        spec.check_objective_settings()?;
        let out = spec
            .output
            .out
            .clone()
            .or_else(|| spec.output.resume.clone());
        let main = is_main(&spec);
        if let Some(out) = out.as_ref().filter(|_| main) {
            guard_out(&spec, out)?;
        }
        if spec.output.save_every > 0 && out.is_none() {
            return Err(EngineError::SaveEveryNeedsOut);
        }
        let trace_values = match &spec.trace_values {
            Some(r) => Some(Regex::new(r).map_err(|cause| EngineError::Regex {
                what: "--trace-values",
                pattern: r.clone(),
                cause,
            })?),
            None => None,
        };
        let model = Model::open(&spec.model)?
            .with_tokenizer_file(spec.tokenizer.clone())
            .quantized(spec.quantize)?;
        if spec.step.lora.is_none() && model.config.quantization.is_some() {
            return Err(EngineError::FullOfNf4);
        }
        model.check_weights()?;
        let tokenizer = model.tokenizer(None)?;
        if spec.objective == Objective::Grpo {
            return Run::grpo(spec, saved, model, tokenizer, main, out, trace_values);
        }
        let seq = spec.step.seq as usize;
        let data_spec = DataSpec {
            path: spec.data.path.clone(),
            chat_template: spec.data.chat_template.clone(),
            train_on_inputs: spec.data.train_on_inputs,
            seq,
            pairs: spec.objective.is_preference(),
        };
        let data = Dataset::read(&model, &data_spec, spec.seed)?;
        let held_out = Dataset::held_out(&model, &data_spec, spec.eval.data.as_deref(), spec.seed)?;
        let backend = Backend::open(&spec.backend)?;
        let dtype = spec.dtype.unwrap_or(match spec.backend.plugin.kind() {
            PluginKind::Cpu => DType::F32,
            _ => DType::BF16,
        });
        let init = init_adapter(&spec, &model, resumed)?;
        let reference = reference_adapter(&spec, &model)?;
        let (mut tc, mut choices) = train_config(
            &spec,
            &model,
            &backend,
            dtype,
            (init.as_ref(), reference.as_ref()),
            resumed,
        )?;
        let stats = data.stats;
        let identities = identities(&spec, &model, &data)?;
        let preference = spec.objective.is_preference();
        // A precomputed reference scores the pairs now, before the step's
        // state is placed.
        let precompute = |pairs: &[PreferencePair]| {
            reference_scores(&backend, &model, &tc, reference.as_ref(), pairs, spec.seed)
        };
        let (loader, learning) = if preference {
            // Pairs whose prompt fills the row are left out (TRL's filter).
            let pairs = data.learning_pairs(seq)?;
            let n = pairs.len();
            let scores = precompute(&pairs)?;
            let loader = Loader::pairs(pairs, seq, spec.step.batch as usize, spec.seed);
            let loader = match scores {
                Some(s) => loader.with_reference(s),
                None => loader,
            };
            (loader, n)
        } else {
            // Samples with nothing to learn within a row are left out.
            let examples = data.learning(seq)?;
            let n = examples.len();
            // A step takes `grad_accum` micro-batches of `batch` rows.
            (Loader::new(examples, seq, tc.rows() as usize, spec.seed), n)
        };
        let per_batch = spec.step.batch as usize;
        let has_eval = held_out.is_some();
        let eval = match held_out {
            Some(e) if preference => {
                let scores = precompute(&e.pairs)?;
                eval_pair_batches(&e.pairs, seq, per_batch, scores.as_deref())
            }
            Some(e) => eval_batches(&e.examples, seq, per_batch),
            None => Vec::new(),
        };
        let unpacked_fill = loader.mean_len().min(seq as f64) / seq as f64;
        if spec.step.packing == Toggle::Auto && !preference {
            tc.packing = auto_packing(unpacked_fill);
            if tc.packing {
                choices =
                    decide_packed(&spec, &mut tc, &backend, &model.config)?.unwrap_or(choices);
            }
        }
        let mut loader = loader.packed(tc.packing);
        let mut settings = RunSettings::of_config(&tc, spec.seed);
        settings.extend(&identities);
        check_resumed(saved.as_ref(), &settings, &spec)?;
        let in_step = tc.preference.map(|p| p.reference) == Some(Reference::Adapter);
        let mut session = Session::new(
            backend,
            model,
            tc,
            SessionOptions {
                mode: spec.mode,
                seed: spec.seed,
                init_adapter: init,
                // Only a reference in the step needs its tensors placed.
                reference_adapter: reference.clone().filter(|_| in_step),
                eval: has_eval,
                ..SessionOptions::default()
            },
        )?;
        if let Some(saved) = &saved {
            session.restore(&saved.tensors)?;
            loader.cursor = saved.state.data_cursor;
        }

        Ok(Run {
            spec,
            session,
            loader: Some(Box::new(loader)),
            eval,
            settings,
            identities,
            stats,
            learning,
            unpacked_fill,
            main,
            out,
            resumed,
            trace_values,
            tokenizer,
            stop: StopFlag::default(),
            choices,
        })
    }

    /// A GRPO run: rollouts generated by the session's own policy (or
    /// read from `--rollouts`), no held-out set.
    #[allow(clippy::too_many_arguments)]
    fn grpo(
        spec: RunSpec,
        saved: Option<Saved>,
        model: Model,
        tokenizer: Option<Tokenizer>,
        main: bool,
        out: Option<PathBuf>,
        trace_values: Option<Regex>,
    ) -> Result<Run> {
        let resumed = saved.is_some();
        let g = spec.grpo.clone();
        let refuse = |why: String| EngineError::Grpo(why);
        // No data: the bundled task's prompts.
        let data_path = g.rollouts.as_ref().or(spec.data.path.as_ref()).cloned();
        // Read (and check) the data before anything is compiled.
        let logged = match &g.rollouts {
            Some(path) => Some(read_rollouts(path, g.num_generations, &g.reward_weights)?),
            None => None,
        };
        let prompts = match (&logged, &data_path) {
            (None, Some(path)) => {
                let chat = model.chat_template(spec.data.chat_template.as_deref())?;
                Some(PromptSet::read(path, tokenizer.as_ref(), chat.as_ref())?)
            }
            (None, None) => {
                let t = tokenizer.as_ref().ok_or(EngineError::DemoNeedsTokenizer)?;
                Some(PromptSet::demo(t, DEMO_PROMPTS, spec.seed)?)
            }
            (Some(_), _) => None,
        };
        let rewards = match &logged {
            None => Some(Rewards::new(&g)?),
            Some(_) => None,
        };
        let vocab = model.config.vocab_size;
        let too_big = |ids: &[u32]| ids.iter().find(|&&t| t as i64 >= vocab).copied();
        if let Some(l) = &logged {
            for r in &l.rollouts {
                if let Some(t) = too_big(&r.prompt_ids).or(too_big(&r.completion_ids)) {
                    return Err(refuse(format!(
                        "{}: token id {t} is outside the model's vocabulary of {vocab}",
                        data_path
                            .as_deref()
                            .unwrap_or(Path::new("the demo task"))
                            .display()
                    )));
                }
            }
        }
        if let Some(p) = &prompts {
            for (ids, _, _) in &p.prompts {
                if let Some(t) = too_big(ids) {
                    return Err(refuse(format!(
                        "{}: token id {t} is outside the model's vocabulary of {vocab}",
                        data_path
                            .as_deref()
                            .unwrap_or(Path::new("the demo task"))
                            .display()
                    )));
                }
            }
        }
        let dataset = Dataset {
            examples: Vec::new(),
            pairs: Vec::new(),
            stats: DataStats {
                samples: logged.as_ref().map_or_else(
                    || prompts.as_ref().map_or(0, |p| p.prompts.len()),
                    |l| l.rollouts.len(),
                ),
                ..DataStats::default()
            },
            fingerprint: match &data_path {
                Some(p) => crate::dataset::data_fingerprint(p)?,
                None => "demo".into(),
            },
        };
        let backend = Backend::open(&spec.backend)?;
        let dtype = spec.dtype.unwrap_or(match spec.backend.plugin.kind() {
            PluginKind::Cpu => DType::F32,
            _ => DType::BF16,
        });
        if spec.step.lora.is_none() && g.beta != 0.0 {
            return Err(refuse(
                "full finetuning with --beta would keep a second copy of the base as the reference; train LoRA, or leave out --beta".into(),
            ));
        }
        let init = init_adapter(&spec, &model, resumed)?;
        // The KL's reference: --ref-adapter, else a frozen copy of the
        // adapter training starts from (read again on resume), else the
        // base with the adapter off.
        let reference = match (
            g.beta != 0.0,
            spec.preference
                .ref_adapter
                .as_ref()
                .or(spec.init_adapter.as_ref()),
        ) {
            (true, Some(dir)) => Some(Adapter::load(dir, &model.config)?),
            _ => None,
        };
        let (tc, choices) = train_config(
            &spec,
            &model,
            &backend,
            dtype,
            (init.as_ref(), None),
            resumed,
        )?;
        let identities = identities(&spec, &model, &dataset)?;
        let mut settings = RunSettings::of_config(&tc, spec.seed);
        settings.extend(&identities);
        check_resumed(saved.as_ref(), &settings, &spec)?;
        // What ends a completion, as TRL takes it: the tokenizer's EOS and
        // the generation config's.
        let mut eos = Vec::new();
        if let (Some(text), Some(t)) = (model.eos_token_text()?, tokenizer.as_ref()) {
            if let [id] = t.encode(&text, false)?[..] {
                eos.push(id);
            }
        }
        for id in model.eos_ids() {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let mut session = Session::new(
            backend,
            model,
            tc,
            SessionOptions {
                mode: spec.mode,
                seed: spec.seed,
                init_adapter: init,
                reference_adapter: None,
                eval: false,
                ..SessionOptions::default()
            },
        )?;
        let mut cursor = 0;
        if let Some(saved) = &saved {
            session.restore(&saved.tensors)?;
            cursor = saved.state.data_cursor;
        }
        let origin = match (logged, prompts, rewards) {
            (Some(rows), _, _) => RolloutOrigin::Logged(rows),
            (None, Some(prompts), Some(rewards)) => RolloutOrigin::Online {
                prompts,
                rewards: Box::new(rewards),
                generator: Box::new(session_generator(&session)?),
            },
            _ => unreachable!("logged rollouts, or prompts and rewards"),
        };
        let mut source = RolloutSource::new(
            &session,
            &g,
            origin,
            eos,
            session.model().tokenizer(None)?,
            reference.as_ref(),
            spec.seed,
            cursor,
            spec.report.log_every,
        )?;
        // Resumed in the middle of a batch's iterations: that batch.
        let mu = g.num_iterations.max(1) as u64;
        if let (Some(dir), true) = (&spec.output.resume, !cursor.is_multiple_of(mu)) {
            let tc = session.config();
            source.current = Some(crate::grpo::saved_batch(
                dir,
                cursor,
                tc.batch as usize,
                tc.seq as usize,
            )?);
        }
        let learning = dataset.stats.samples;
        Ok(Run {
            spec,
            session,
            loader: Some(Box::new(source)),
            eval: Vec::new(),
            settings,
            identities,
            stats: dataset.stats,
            learning,
            unpacked_fill: 1.0,
            main,
            out,
            resumed,
            trace_values,
            tokenizer,
            stop: StopFlag::default(),
            choices,
        })
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
            eval_every: self.spec.eval.every,
            save_every: self.spec.output.save_every,
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
    /// ([`crate::policy::StepPolicy::line`]).
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

    /// Whether this process writes and reports.
    pub fn is_main(&self) -> bool {
        self.main
    }

    /// Whether the run continues a saved one.
    pub fn resumed(&self) -> bool {
        self.resumed
    }
}
