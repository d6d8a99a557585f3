//! [`RunSpec`]: everything a training run is — model, data, objective,
//! step, optimizer and schedule, mesh, evaluation, checkpointing and
//! output — as typed settings, and how a resumed run takes the settings it
//! was saved with.
//!
//! Settings are recorded by name ([`settings`]: the names of `hlo-train
//! train`'s flags, so a recipe, a saved state and an error message speak
//! one vocabulary). A resumed run takes every saved setting its caller did
//! not choose ([`Chosen`]); one it chose must equal the saved one, every
//! difference listed at once. `steps` may extend a constant schedule; a
//! cosine schedule ends where it was planned to.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Args;
use hlo_ir::DType;
use hlo_models::nf4::Nf4Config;
use hlo_models::preference::Reference;
use hlo_models::train::TrainConfig;
use hlo_runtime::Mode;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::device::backend::{BackendOptions, CompilerSpec};
use crate::error::{EngineError, Result};
use crate::inputs::dataset::DataSource;
use crate::inputs::model::{
    BaseSpec, DtypeSpec, Init, ModelSource, ModelSpec, QuantizeSpec, TokenizerSpec,
};
use crate::objectives::{Objective, ObjectiveSpecs, OBJECTIVES};
use crate::run::settings::settings;
use crate::settings::{self, restore};
use crate::step::policy::Target;
use crate::step::{OptimSpec, StepSpec};
use crate::train::checkpoint::RunSettings;

/// Held-out evaluation: settings of what the run writes, which a resumed
/// run takes back unless chosen anew (never a difference).
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct EvalSpec {
    /// Held-out data (same formats as --data): its masked mean loss
    /// and perplexity are computed every --eval-every steps (the demo task
    /// holds out a fresh draw of itself).
    #[arg(long = "eval-data", id = "eval_data", value_name = "EVAL_DATA")]
    #[serde(rename = "eval-data", serialize_with = "settings::absolute_new_path")]
    pub data: Option<PathBuf>,

    /// Steps between evaluations; 0 evaluates every --log-every steps.
    #[arg(long = "eval-every", id = "eval_every", value_name = "EVAL_EVERY",
          default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    #[serde(rename = "eval-every")]
    pub every: i64,
}

impl Default for EvalSpec {
    fn default() -> EvalSpec {
        settings::defaults()
    }
}

impl EvalSpec {
    /// Steps between evaluations, `log_every` for 0.
    pub fn every_or(&self, log_every: i64) -> i64 {
        if self.every > 0 {
            self.every
        } else {
            log_every
        }
    }
}

/// Where the run saves, and whether it continues a saved one (not
/// recorded: a resumed run is told these anew).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OutputSpec {
    /// The adapter (or an HF folder when finetuning fully) and
    /// `train_state/` go here (default with `resume`: that folder).
    pub out: Option<PathBuf>,
    /// Replace a run `out` holds already.
    pub overwrite: bool,
    /// Continue the run saved in this folder.
    pub resume: Option<PathBuf>,
}

/// What the run writes and how often: the engine saves; the front end
/// writes the reports (the engine reports through hooks and keeps these
/// with the run, so a resumed run writes where and as often as it did,
/// unless chosen anew: never a difference).
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ReportSpec {
    /// Write one JSON object per step (and evaluation) to this file;
    /// a resumed run appends.
    #[arg(long)]
    #[serde(serialize_with = "settings::absolute_new_path")]
    pub metrics: Option<PathBuf>,

    /// Write TensorBoard event files under this folder, in a folder of the
    /// run's own (named as --out is, else by its start time): train/loss,
    /// train/lr, train/grad_norm, train/tokens_per_s, train/mfu, eval/loss
    /// and eval/perplexity by step (`tensorboard --logdir DIR`).
    #[arg(long)]
    #[serde(serialize_with = "settings::absolute_new_path")]
    pub tensorboard: Option<PathBuf>,

    /// Print a log line every N steps.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i64).range(1..))]
    pub log_every: i64,

    /// Also save every N steps (needs --out).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    pub save_every: i64,
}

impl Default for ReportSpec {
    fn default() -> ReportSpec {
        settings::defaults()
    }
}

/// What a training run trains: its objective, the weights it starts
/// from, its length and its seed (`train`'s flags, each declared once
/// here; a [`RunSpec`] holds them as its own fields, [`RunSpec::training`]).
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct TrainingSpec {
    /// What the run's loss is, each as TRL 1.16's trainer of that name
    /// computes it (docs/training.md has a section for each): sft, the
    /// causal-LM loss on the data's learned tokens (supervised
    /// finetuning), or an objective over the data it reads: pairs of
    /// chosen and rejected completions (--batch counts pairs), unpaired
    /// completions labelled desirable or not (--batch counts examples),
    /// or the policy's own completions of prompts, generated as it trains
    /// (--batch counts completions). `hlo-train data --objective` shows
    /// what rows an objective reads.
    #[arg(long, value_parser = settings::named::<Objective>(), default_value = "sft")]
    #[serde(with = "settings::by_name")]
    pub objective: Objective,

    /// Start LoRA from this PEFT adapter folder (or hub id).
    #[arg(long, value_parser = settings::hub_adapter)]
    #[serde(serialize_with = "settings::absolute_path")]
    pub init_adapter: Option<PathBuf>,

    /// random: train from scratch, every weight made as transformers'
    /// `_init_weights` makes a new model's (normal with the config's
    /// initializer_range, zero biases, unit norms), with --full; a
    /// --checkpoint then gives its config and tokenizer, not its weights
    /// (a preset or --config is random already).
    #[arg(long, value_parser = settings::named::<Init>())]
    #[serde(with = "settings::opt_by_name", default)]
    pub init: Option<Init>,

    /// Optimizer steps to reach (a resumed run counts its saved steps).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
    pub steps: i64,

    /// Seed of data order, adapter init and random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl Default for TrainingSpec {
    /// SFT from the base's weights, 100 steps, seed 0.
    fn default() -> TrainingSpec {
        settings::defaults()
    }
}

/// Which settings the caller chose; on resume the others take the saved
/// values.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Chosen {
    /// Every setting (a spec built in code): each must equal the saved.
    #[default]
    All,
    /// These, by [`settings`] name (a command line's flags).
    Only(BTreeSet<String>),
}

impl Chosen {
    pub fn contains(&self, setting: &str) -> bool {
        match self {
            Chosen::All => true,
            Chosen::Only(set) => set.contains(setting),
        }
    }
}

/// A training run, before anything is resolved. [`RunSpec::default`] is
/// `hlo-train train` without flags: LoRA r=8 on the tiny preset's demo
/// task, on one CPU device.
#[derive(Clone, Debug)]
pub struct RunSpec {
    pub model: ModelSource,
    /// A `tokenizer.json` in place of the checkpoint's.
    pub tokenizer: Option<PathBuf>,
    /// The base's projections in NF4 (QLoRA).
    pub quantize: Option<Nf4Config>,
    /// The base's dtype (None: f32 on the CPU plugin, bf16 elsewhere).
    pub dtype: Option<DType>,
    pub data: DataSource,
    pub objective: Objective,
    /// Each objective's own settings (read by the objectives that read
    /// them only).
    pub objectives: ObjectiveSpecs,
    pub step: StepSpec,
    /// Start LoRA from this PEFT adapter folder.
    pub init_adapter: Option<PathBuf>,
    /// How the weights are made instead of read (`--init random`: as HF
    /// initialises a new model of the config, whatever the checkpoint
    /// stores); None: the checkpoint's.
    pub init: Option<Init>,
    pub optim: OptimSpec,
    /// The step count the run ends at (a resumed run counts its saved
    /// steps).
    pub steps: i64,
    /// Seed of data order, adapter init and random weights.
    pub seed: u64,
    /// Plugin, devices, mesh and this process's place in a launch.
    pub backend: BackendOptions,
    pub mode: Mode,
    pub eval: EvalSpec,
    pub output: OutputSpec,
    pub report: ReportSpec,
    /// Eager mode: report every value of scopes matching this regex in the
    /// first step, and stop at the first non-finite one.
    pub trace_values: Option<String>,
    /// The devices' peak TFLOP/s for MFU (None: the hardware table's,
    /// measured for CPUs).
    pub peak_tflops: Option<f64>,
    pub chosen: Chosen,
    /// `compile`: the devices the step is compiled for (its `auto`
    /// choices are theirs, and bf16 by default), not run.
    pub compile_for: Option<&'static crate::analysis::hardware::Device>,
    /// `train --executable`: the step compiled earlier (`compile`),
    /// loaded instead of compiled.
    pub executable: Option<PathBuf>,
}

impl Default for RunSpec {
    fn default() -> RunSpec {
        let training = TrainingSpec::default();
        RunSpec {
            model: ModelSource::Preset("tiny".into()),
            tokenizer: None,
            quantize: None,
            dtype: None,
            data: DataSource::default(),
            objective: training.objective,
            objectives: ObjectiveSpecs::default(),
            step: StepSpec::default(),
            init_adapter: training.init_adapter,
            init: training.init,
            optim: OptimSpec::default(),
            steps: training.steps,
            seed: training.seed,
            backend: BackendOptions::cpu(),
            mode: Mode::Jit,
            eval: EvalSpec::default(),
            output: OutputSpec::default(),
            report: ReportSpec::default(),
            trace_values: None,
            peak_tflops: None,
            chosen: Chosen::All,
            compile_for: None,
            executable: None,
        }
    }
}

/// Settings that pick the model; one chosen replaces all saved ones.
const MODEL_SETTINGS: [&str; 3] = ["model", "config", "checkpoint"];

/// A saved setting of the wrong kind.
fn unreadable(key: &str, value: &Value) -> EngineError {
    EngineError::Resume(format!(
        "the saved setting `{key}` is {value}, which this build cannot read"
    ))
}

impl RunSpec {
    /// Continues the run saved in `dir` with every setting it was saved
    /// with (the caller may then change where it ends: `steps`).
    pub fn resume(dir: impl Into<PathBuf>) -> RunSpec {
        RunSpec {
            output: OutputSpec {
                resume: Some(dir.into()),
                ..OutputSpec::default()
            },
            chosen: Chosen::Only(BTreeSet::new()),
            ..RunSpec::default()
        }
    }

    /// The settings of the run saved in `dir` (a run folder, or the
    /// adapter folder holding its `train_state/`), None when `dir` holds no
    /// saved run: what a command that reads the run's adapter (`eval`,
    /// `generate`, `serve`, `merge`) computes with where its own flags
    /// are silent, so it scores and completes as the run did.
    pub fn saved_in(dir: &Path) -> Result<Option<RunSpec>> {
        let Some(saved) = crate::train::checkpoint::saved_settings(dir)? else {
            return Ok(None);
        };
        let mut spec = RunSpec {
            chosen: Chosen::Only(BTreeSet::new()),
            ..RunSpec::default()
        };
        spec.merge_saved(&saved)?;
        Ok(Some(spec))
    }

    /// The same spec ending at `steps`, chosen (so a resumed run takes it
    /// over the saved step count: a constant schedule may be extended).
    pub fn with_steps(mut self, steps: i64) -> RunSpec {
        self.steps = steps;
        if let Chosen::Only(set) = &mut self.chosen {
            set.insert("steps".to_string());
        }
        self
    }

    /// The step's `auto` choices on `target` ([`StepSpec::policy`] of the
    /// objective's step).
    pub fn policy(
        &self,
        config: &hlo_models::decoder::ModelConfig,
        dtype: DType,
        mesh: &hlo_partitioner::Mesh,
        target: &Target,
    ) -> Result<crate::step::policy::StepPolicy> {
        self.objective
            .def()
            .step_spec(&self.step, &self.objectives)?
            .policy(config, dtype, mesh, target)
    }

    /// The traced step's settings for a model of `config` in `dtype` over
    /// `mesh`: the step spec's, and for a preference objective its loss
    /// against `reference` (see [`ObjectiveDef::step_spec`](crate::objectives::ObjectiveDef::step_spec)).
    pub fn train_config(
        &self,
        config: &hlo_models::decoder::ModelConfig,
        dtype: DType,
        mesh: &hlo_partitioner::Mesh,
        reference: Reference,
        policy: &crate::step::policy::StepPolicy,
    ) -> Result<TrainConfig> {
        let step = self
            .objective
            .def()
            .step_spec(&self.step, &self.objectives)?;
        let mut tc = step.train_config(&self.optim, config, dtype, mesh, self.steps, policy)?;
        tc.loss = self.objective.def().loss(&self.objectives, reference);
        Ok(tc)
    }

    /// What the objective's hooks may read of this run.
    pub fn view(&self) -> crate::objectives::RunView<'_> {
        crate::objectives::RunView {
            objective: self.objective,
            objectives: &self.objectives,
            step: &self.step,
            data: &self.data,
            eval_data: self.eval.data.as_deref(),
            init_adapter: self.init_adapter.as_deref(),
            resume: self.output.resume.as_deref(),
            seed: self.seed,
            log_every: self.report.log_every,
        }
    }

    /// Refuses an objective's setting this objective does not read, set
    /// to anything but its default (which would change nothing), naming
    /// it (`--beta` for SFT, `--simpo-gamma` for DPO, `--ref-adapter` for
    /// ORPO, `--num-generations` for DPO, ...), and what the objective's
    /// own checks refuse.
    pub fn check_objective_settings(&self) -> Result<()> {
        let objective = self.objective.name();
        let given = self.objectives.given();
        let unread: Vec<&str> = given
            .iter()
            .map(String::as_str)
            .filter(|key| !self.objective.reads(key))
            .collect();
        let readers = |key: &str| -> Vec<Objective> {
            OBJECTIVES
                .into_iter()
                .filter(|o| o.def().reads(key))
                .collect()
        };
        // A setting of an objective's own spec first (not of the specs
        // several share: the preference objectives', the rollouts'): it
        // names its owner.
        let shared = crate::objectives::ObjectiveSpecs::shared_names();
        for key in unread.iter().filter(|k| !shared.iter().any(|s| s == *k)) {
            if let [owner] = readers(key)[..] {
                return Err(EngineError::Objective {
                    objective: owner.name(),
                    why: format!(
                        "--{key} is a {} setting; it needs --objective {owner} (not {objective})",
                        owner.name().to_uppercase(),
                    ),
                });
            }
        }
        self.objective.def().check_settings(&self.view())?;
        if let Some(&key) = unread.first() {
            let referenced = self.objective.reads("ref-adapter");
            let why = match key {
                "ref-adapter" | "precompute-ref" if !referenced => {
                    format!("{objective} compares with no reference model; leave out --{key}")
                }
                _ => {
                    let names: Vec<&str> = readers(key).iter().map(|o| o.name()).collect();
                    format!(
                        "{objective} has no such setting; leave out --{key} (it is read by {})",
                        names.join(", ")
                    )
                }
            };
            return Err(EngineError::Objective { objective, why });
        }
        Ok(())
    }

    /// The base model's settings as this spec holds them.
    pub fn base_spec(&self) -> BaseSpec {
        BaseSpec {
            model: self.model.spec(),
            quantize: QuantizeSpec::of(self.quantize),
            dtype: DtypeSpec { dtype: self.dtype },
        }
    }

    /// What this run trains as its flags say it
    /// ([`TrainingSpec`]).
    pub fn training(&self) -> TrainingSpec {
        TrainingSpec {
            objective: self.objective,
            init_adapter: self.init_adapter.clone(),
            init: self.init,
            steps: self.steps,
            seed: self.seed,
        }
    }

    /// Trains as `training` says.
    pub fn set_training(&mut self, training: TrainingSpec) {
        self.objective = training.objective;
        self.init_adapter = training.init_adapter;
        self.init = training.init;
        self.steps = training.steps;
        self.seed = training.seed;
    }

    /// The tokenizer's setting as this spec holds it.
    pub fn tokenizer_spec(&self) -> TokenizerSpec {
        TokenizerSpec {
            tokenizer: self.tokenizer.clone(),
        }
    }

    /// Takes every saved setting the caller did not choose.
    pub fn merge_saved(&mut self, saved: &RunSettings) -> Result<()> {
        let saved_map = saved.0.clone().into_iter().collect();
        let chosen = &self.chosen.clone();
        // One of the model's settings chosen replaces all saved ones; a
        // block size belongs to the attention it was saved with.
        let model_chosen = MODEL_SETTINGS.iter().any(|k| chosen.contains(k));
        let tied = |key: &str| {
            (model_chosen && MODEL_SETTINGS.contains(&key))
                || (key == "attention-block" && chosen.contains("attention"))
        };
        let take = |key: &str| !chosen.contains(key) && !tied(key);
        let refused = |key: String| match saved.get(&key) {
            Some(value) => unreadable(&key, value),
            None => EngineError::Resume(format!("the saved settings cannot be read: {key}")),
        };
        self.step = restore(&self.step, &saved_map, take).map_err(refused)?;
        self.optim = restore(&self.optim, &saved_map, take).map_err(refused)?;
        self.objectives = restore(&self.objectives, &saved_map, take).map_err(refused)?;
        self.eval = restore(&self.eval, &saved_map, take).map_err(refused)?;
        self.report = restore(&self.report, &saved_map, take).map_err(refused)?;
        self.data = restore(&self.data, &saved_map, take).map_err(refused)?;
        let mut base = self.base_spec();
        // A saved model replaces the one this spec holds (not chosen).
        if !model_chosen && MODEL_SETTINGS.iter().any(|k| saved.get(k).is_some()) {
            base.model = ModelSpec::default();
        }
        let base = restore(&base, &saved_map, take).map_err(refused)?;
        self.model = base.model.source();
        self.quantize = base.quantize.nf4();
        self.dtype = base.dtype.dtype;
        let training = restore(&self.training(), &saved_map, take).map_err(refused)?;
        self.set_training(training);
        let compiler = CompilerSpec {
            xla_options: std::mem::take(&mut self.backend.xla_options),
        };
        self.backend.xla_options = restore(&compiler, &saved_map, take)
            .map_err(refused)?
            .xla_options;
        self.tokenizer = restore(&self.tokenizer_spec(), &saved_map, take)
            .map_err(refused)?
            .tokenizer;
        Ok(())
    }
}

/// Every chosen setting of `now` that differs from the `saved` run's,
/// and every identity that changed, as one line each (`saved_step`: the
/// saved run's step; `dir`: its folder, named in the advice).
pub fn differences(
    saved: &RunSettings,
    now: &RunSettings,
    chosen: &Chosen,
    saved_step: i64,
    dir: &Path,
) -> Vec<String> {
    let mut out = Vec::new();
    let show = |v: Option<&Value>| match v {
        None | Some(Value::Null) => "(none)".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    };
    for (key, what) in [
        (
            "model-fingerprint",
            "the base model (its config.json or weight files)",
        ),
        ("data-fingerprint", "the training data"),
    ] {
        if let (Some(a), Some(b)) = (saved.get(key), now.get(key)) {
            if a != b {
                out.push(format!("{what} changed since the run was saved"));
            }
        }
    }
    let cosine = saved.get("schedule") == Some(&Value::from("cosine"));
    for key in settings() {
        if !chosen.contains(key) {
            continue;
        }
        let (a, b) = (saved.get(key), now.get(key));
        // A moved model or data file is the same if its identity is.
        let moved_same = match key {
            "model" | "config" | "checkpoint" => {
                saved.get("model-fingerprint") == now.get("model-fingerprint")
            }
            "data" => saved.get("data-fingerprint") == now.get("data-fingerprint"),
            _ => false,
        };
        // Runs saved before objectives were recorded were all SFT.
        let unrecorded = key == "objective" && a.is_none();
        if a == b || moved_same || unrecorded {
            continue;
        }
        if key == "steps" && !cosine {
            continue; // a constant schedule may be extended
        }
        if key == "steps" {
            out.push(format!(
                "the run's cosine schedule ends at step {}, --steps {} would reshape it (continue without --steps, or start a new run from this adapter with --init-adapter {})",
                show(a),
                show(b),
                dir.display()
            ));
            continue;
        }
        out.push(format!(
            "--{key} was {} when the run was saved, this run has {}",
            show(a),
            show(b)
        ));
    }
    if let Some(steps) = now.get("steps").and_then(Value::as_i64) {
        if steps <= saved_step {
            out.push(if chosen.contains("steps") {
                format!("the run is at step {saved_step} already, --steps {steps} leaves nothing to train")
            } else if cosine {
                format!(
                    "the run finished its cosine schedule at step {saved_step}: start a new run from it with --init-adapter {}",
                    dir.display()
                )
            } else {
                format!("the run reached its last step ({saved_step}): give a larger --steps to train further")
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objectives::preference::PreferenceSpec;
    use crate::step::{LoraSpec, ScheduleKind, Toggle};
    use hlo_models::roles::BatchField;

    fn settings(pairs: &[(&str, Value)]) -> RunSettings {
        let mut s = RunSettings::default();
        for (k, v) in pairs {
            s.set(k, v.clone());
        }
        s
    }

    #[test]
    fn a_resumed_spec_takes_every_saved_setting_it_did_not_choose() {
        let saved = settings(&[
            ("checkpoint", "/m".into()),
            ("lr", 0.5.into()),
            ("lora-rank", 4.into()),
            ("full", false.into()),
            ("schedule", "cosine".into()),
            ("packing", "on".into()),
            ("attention", "blockwise".into()),
            ("attention-block", 32.into()),
        ]);
        let mut spec = RunSpec::resume("/run");
        spec.chosen = Chosen::Only(["lora-rank".to_string()].into());
        spec.step.lora = LoraSpec {
            rank: 16,
            ..LoraSpec::default()
        };
        spec.merge_saved(&saved).unwrap();
        assert_eq!(spec.model, ModelSource::Checkpoint("/m".into()));
        assert_eq!(spec.optim.lr, 0.5);
        assert_eq!(spec.optim.schedule, ScheduleKind::Cosine);
        assert_eq!(spec.step.packing, Toggle::On);
        assert_eq!(spec.step.attention_block, Some(32));
        // Chosen: kept (and compared by `differences`).
        assert_eq!(spec.step.adapter().map(|l| l.rank), Some(16));
    }

    #[test]
    fn a_resumed_spec_keeps_the_steps_it_chose() {
        let saved = settings(&[("steps", 10.into()), ("seed", 3.into())]);
        let mut spec = RunSpec::resume("/run").with_steps(30);
        spec.merge_saved(&saved).unwrap();
        assert_eq!((spec.steps, spec.seed), (30, 3));
        let mut spec = RunSpec::resume("/run");
        spec.merge_saved(&saved).unwrap();
        assert_eq!(spec.steps, 10);
    }

    #[test]
    fn every_objectives_step_traces_over_its_rows() {
        let causal = hlo_models::decoder::ModelConfig::preset("tiny").unwrap();
        let mesh = "dp=1,fsdp=1,mp=1".parse().unwrap();
        for objective in OBJECTIVES {
            // A reward model's step is a classifier's.
            let config = match objective.def().classifier() {
                true => causal.clone().with_score_head(1, Some(257)),
                false => causal.clone(),
            };
            for packed in [false, true] {
                // Only SFT packs its rows.
                if packed && objective != Objective::Sft {
                    continue;
                }
                let mut spec = RunSpec {
                    objective,
                    step: StepSpec {
                        batch: 2,
                        seq: 16,
                        packing: if packed { Toggle::On } else { Toggle::Off },
                        ..StepSpec::default()
                    },
                    ..RunSpec::default()
                };
                // Distillation's teacher: the student's config again.
                spec.objectives.distill.teacher_config = Some(Box::new(causal.clone()));
                let tc = spec
                    .train_config(
                        &config,
                        DType::F32,
                        &mesh,
                        Reference::Base,
                        &spec
                            .policy(&config, DType::F32, &mesh, &Target::cpu())
                            .unwrap(),
                    )
                    .unwrap();
                // Its step traces, reading the ids (every objective's
                // first batch field).
                let traced = hlo_models::train::train_step(&config, &tc).unwrap();
                let first = traced.inputs.iter().find_map(|i| match i.role {
                    hlo_models::roles::Role::Batch(f) => Some(f),
                    _ => None,
                });
                assert_eq!(first, Some(BatchField::InputIds), "{objective}");
                // Pairs, and KTO's examples with their KL rows: twice
                // the rows.
                let doubled = objective.is_preference() || objective == Objective::Kto;
                let rows = if doubled { 4 } else { 2 };
                assert_eq!(tc.batch, rows);
            }
        }
    }

    #[test]
    fn a_setting_the_objective_does_not_read_is_refused_unless_default() {
        let spec = |objective, preference| RunSpec {
            objective,
            objectives: ObjectiveSpecs {
                preference,
                ..ObjectiveSpecs::default()
            },
            ..RunSpec::default()
        };
        let d = PreferenceSpec::default;
        // Defaults change nothing: every objective takes them.
        for o in OBJECTIVES {
            assert!(spec(o, d()).check_objective_settings().is_ok(), "{o}");
        }
        let gamma = PreferenceSpec {
            simpo_gamma: 1.0,
            ..d()
        };
        assert!(spec(Objective::Simpo, gamma.clone())
            .check_objective_settings()
            .is_ok());
        let cases = [
            (
                Objective::Sft,
                PreferenceSpec {
                    beta: Some(0.5),
                    ..d()
                },
                "--beta",
            ),
            (Objective::Dpo, gamma, "--simpo-gamma"),
            (
                Objective::Ipo,
                PreferenceSpec {
                    label_smoothing: 0.1,
                    ..d()
                },
                "--label-smoothing",
            ),
            (
                Objective::Orpo,
                PreferenceSpec {
                    precompute_ref: true,
                    ..d()
                },
                "--precompute-ref",
            ),
            (
                Objective::Simpo,
                PreferenceSpec {
                    ref_adapter: Some("/a".into()),
                    ..d()
                },
                "--ref-adapter",
            ),
        ];
        for (o, p, flag) in cases {
            let err = spec(o, p)
                .check_objective_settings()
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("; leave out {flag}")), "{err}");
        }
    }

    #[test]
    fn a_preference_objective_refuses_packing_and_accumulation() {
        let config = hlo_models::decoder::ModelConfig::preset("tiny").unwrap();
        let mesh = "dp=1,fsdp=1,mp=1".parse().unwrap();
        for (packing, grad_accum, what) in [
            (Toggle::On, 1, "packed"),
            (Toggle::Auto, 2, "--grad-accum 2"),
        ] {
            let spec = RunSpec {
                objective: Objective::Dpo,
                step: StepSpec {
                    packing,
                    grad_accum,
                    ..StepSpec::default()
                },
                ..RunSpec::default()
            };
            let err = spec
                .policy(&config, DType::F32, &mesh, &Target::cpu())
                .and_then(|p| spec.train_config(&config, DType::F32, &mesh, Reference::Base, &p))
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with("--objective dpo: ") && err.contains(what),
                "{err}"
            );
        }
    }

    #[test]
    fn what_a_run_writes_comes_back_unless_chosen_anew() {
        let saved = settings(&[
            ("metrics", "/run/m.jsonl".into()),
            ("eval-data", "/data/held.jsonl".into()),
            ("eval-every", 5.into()),
            ("log-every", 5.into()),
        ]);
        let mut spec = RunSpec::resume("/run");
        spec.chosen = Chosen::Only(["log-every".to_string()].into());
        spec.report.log_every = 2;
        spec.merge_saved(&saved).unwrap();
        assert_eq!(spec.report.metrics, Some("/run/m.jsonl".into()));
        assert_eq!(spec.eval.data, Some("/data/held.jsonl".into()));
        assert_eq!((spec.eval.every, spec.report.log_every), (5, 2));
        // Chosen anew: not a difference.
        let now = settings(&[("log-every", 2.into())]);
        let d = differences(&saved, &now, &spec.chosen, 0, Path::new("/run"));
        assert!(d.iter().all(|l| !l.contains("log-every")), "{d:?}");
    }

    #[test]
    fn a_setting_of_the_wrong_kind_is_refused_naming_it() {
        let mut spec = RunSpec::resume("/run");
        let err = spec
            .merge_saved(&settings(&[("lr", "fast".into())]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`lr`"), "{err}");
    }

    #[test]
    fn differences_list_each_chosen_change_and_allow_a_longer_constant_run() {
        let saved = settings(&[("lr", 0.5.into()), ("steps", 10.into())]);
        let now = settings(&[("lr", 0.25.into()), ("steps", 20.into())]);
        let chosen = Chosen::Only(["lr".to_string(), "steps".to_string()].into());
        let d = differences(&saved, &now, &chosen, 10, Path::new("/run"));
        assert_eq!(
            d,
            ["--lr was 0.5 when the run was saved, this run has 0.25"]
        );
    }
}
