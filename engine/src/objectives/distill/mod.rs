//! On-policy distillation (TRL 1.16's `DistillationTrainer`) beyond its
//! loss (`hlo_models::distill`): the student generates one completion a
//! prompt with the shared rollout machinery (no rewards), and a teacher — another
//! checkpoint of the same vocabulary, opened here and held frozen on the
//! same devices, its weights the step's `teacher.` inputs — scores them in
//! the step.

use std::path::PathBuf;

use hlo_data::Batch;
use hlo_models::decoder::ModelConfig;
use hlo_models::distill::step::Distill;
use hlo_models::distill::DistillLoss;
use hlo_models::preference::Reference;
use hlo_models::train::Loss;

use crate::rollouts::{
    self, as_objective, AdvantageRule, Advantaged, RolloutDefaults, RolloutObjective, RolloutSpec,
};
use clap::Args;
use serde::{Deserialize, Serialize};

use super::{Data, Objective, ObjectiveDef, ObjectiveSpecs};
use crate::error::{EngineError, Result};
use crate::inputs::model::{Model, ModelSource};
use crate::objectives::RunView;
use crate::settings;
use crate::step::StepSpec;

/// Distillation's β unless `--beta` says otherwise (TRL 1.16: the reverse
/// KL).
pub(crate) const DEFAULT_BETA: f64 = 1.0;

/// Distillation's own settings (TRL 1.16's `DistillationConfig` names);
/// its β (default 1.0), temperature, completion length and sampling are
/// the shared settings.
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DistillSpec {
    /// Distillation: the teacher's checkpoint folder (TRL's
    /// teacher_model): a causal LM of the student's vocabulary, any size,
    /// held frozen on the same devices.
    #[arg(long)]
    #[serde(serialize_with = "settings::absolute_path")]
    pub teacher: Option<PathBuf>,

    /// Its config, read once the run opens the student (not a setting).
    #[arg(skip)]
    #[serde(skip)]
    pub teacher_config: Option<Box<ModelConfig>>,
}

/// Distillation as an objective of a run.
pub(crate) struct Distillation;

pub(crate) static DISTILLATION: Distillation = Distillation;

/// The rollout settings distillation reads (less the rewards, groups,
/// clipping and iterations), with β.
const READS: &[&str] = &[
    "beta",
    "temperature",
    "top-p",
    "top-k",
    "max-completion-length",
    "rollouts",
    "log-completions",
];

impl ObjectiveDef for Distillation {
    fn name(&self) -> &'static str {
        "distillation"
    }

    fn data(&self) -> Data {
        Data::Rollouts
    }

    fn reads(&self, name: &str) -> bool {
        READS.contains(&name) || settings::names::<DistillSpec>().iter().any(|s| s == name)
    }

    fn step_spec(&self, step: &StepSpec, _specs: &ObjectiveSpecs) -> Result<StepSpec> {
        rollouts::step_spec(step).map_err(as_objective("distillation"))
    }

    fn loss(&self, specs: &ObjectiveSpecs, _reference: Reference) -> Loss {
        Loss::Distill(Distill {
            loss: DistillLoss {
                beta: specs.beta(Objective::Distillation),
                temperature: specs.rollouts.temperature,
            },
            teacher: specs.distill.teacher_config.clone(),
        })
    }

    fn describe(&self, specs: &ObjectiveSpecs, _loss: &Loss) -> Option<String> {
        let beta = specs.beta(Objective::Distillation);
        let divergence = match beta {
            0.0 => "forward KL".to_string(),
            1.0 => "reverse KL".to_string(),
            b => format!("generalized JSD, beta {b}"),
        };
        let teacher = specs
            .distill
            .teacher
            .as_ref()
            .map_or(String::new(), |t| format!(" from {}", t.display()));
        Some(format!(
            "distillation{teacher} ({divergence}, temperature {})",
            specs.rollouts.temperature
        ))
    }

    fn batch_words(&self, _specs: &ObjectiveSpecs, rows: i64) -> String {
        format!("{rows} completions (one a prompt)")
    }

    fn check_settings(&self, spec: &RunView) -> Result<()> {
        check_settings(spec)
    }

    /// β is the divergence's (`DistillationConfig`'s reverse KL).
    fn rollout_defaults(&self) -> RolloutDefaults {
        RolloutDefaults {
            beta: DEFAULT_BETA,
            ..RolloutDefaults::GRPO
        }
    }

    fn rollouts(&self) -> Option<&dyn RolloutObjective> {
        Some(self)
    }
}

impl RolloutObjective for Distillation {
    /// One completion a prompt, no rewards, no KL reference, one step a
    /// batch.
    fn rollout_spec(&self, specs: &ObjectiveSpecs) -> RolloutSpec {
        RolloutSpec {
            num_generations: Some(1),
            num_iterations: 1,
            reward: Vec::new(),
            ..specs.rollouts.clone()
        }
    }

    fn rewarded(&self) -> bool {
        false
    }

    fn advantages(&self, _specs: &ObjectiveSpecs) -> Box<dyn AdvantageRule> {
        Box::new(Unrewarded)
    }

    fn teacher(&self, spec: &RunView) -> Result<Option<Model>> {
        Ok(Some(open_teacher(spec)?))
    }

    /// The teacher's config, its vocabulary the student's (refused else).
    fn resolve(&self, spec: &RunView, model: &Model) -> Result<ObjectiveSpecs> {
        let teacher = open_teacher(spec)?;
        let (theirs, ours) = (teacher.config.vocab_size, model.config.vocab_size);
        if theirs != ours {
            return Err(refuse(format!(
                "the teacher {} has a vocabulary of {theirs}, the student {ours}: distillation compares their next-token distributions, which needs one vocabulary",
                teacher.name
            )));
        }
        let mut specs = spec.objectives.clone();
        specs.distill.teacher_config = Some(Box::new(teacher.config));
        Ok(specs)
    }
}

fn refuse(why: String) -> EngineError {
    EngineError::Objective {
        objective: "distillation",
        why,
    }
}

/// `--teacher`'s checkpoint, a causal LM.
fn open_teacher(spec: &RunView) -> Result<Model> {
    let dir = spec
        .objectives
        .distill
        .teacher
        .as_ref()
        .ok_or_else(|| refuse("give --teacher DIR, the checkpoint to distil from".into()))?;
    let teacher = Model::open(&ModelSource::Checkpoint(dir.clone()))?;
    if !teacher.config.is_causal_lm() {
        return Err(refuse(format!(
            "the teacher {} is a sequence classifier, not a causal LM",
            dir.display()
        )));
    }
    Ok(teacher)
}

/// Refuses distillation settings that cannot go together.
fn check_settings(spec: &RunView) -> Result<()> {
    // (No teacher is refused when the run opens it: `open_teacher`.)
    let beta = spec.objectives.beta(Objective::Distillation);
    if !(0.0..=1.0).contains(&beta) {
        return Err(refuse(format!(
            "--beta must be in [0, 1] (0 the forward KL, 1 the reverse), not {beta}"
        )));
    }
    if spec.eval_data.is_some() {
        return Err(refuse(
            "held-out scoring of distillation is not built yet; leave out --eval-data".into(),
        ));
    }
    rollouts::check(spec, false)
}

/// Distillation's completions have no advantages: the step reads none.
struct Unrewarded;

impl AdvantageRule for Unrewarded {
    fn reads_old_logps(&self) -> bool {
        false
    }

    fn advantages(&self, rewards: &[f64], _batch: &Batch) -> Result<Advantaged> {
        Ok((vec![0.0; rewards.len()], Vec::new()))
    }
}
