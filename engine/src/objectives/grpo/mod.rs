//! GRPO (TRL 1.16's `GRPOTrainer`) beyond its loss (`hlo_models::grpo`):
//! the shared rollouts ([`super::rollouts`]) with GRPO's advantages, each
//! reward less its group's mean, scaled as `--scale-rewards` says
//! ([`GroupNormalised`]), and its loss's own settings ([`GrpoSpec`]).

use hlo_data::Batch;
use hlo_models::grpo::{advantages, GrpoLoss, GrpoLossType, ImportanceSampling, ScaleRewards};

use hlo_models::adapter::Adapter;
use hlo_models::preference::Reference;
use hlo_models::roles::BatchField;
use hlo_models::train::Loss;

use super::rollouts::{
    self, check_reward_statistics, share, AdvantageRule, Advantaged, RolloutInputs, RolloutSpec,
};
use super::{Data, ObjectiveDef, ObjectiveSpecs};
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::run::settings::Setting;
use crate::run::spec::RunSpec;
use crate::run::step::StepSpec;
use crate::train::checkpoint::RunSettings;

pub(crate) mod settings;

/// GRPO's own settings (TRL 1.16's names and defaults); its rollouts'
/// are [`RolloutSpec`]'s.
#[derive(Clone, Debug, PartialEq)]
pub struct GrpoSpec {
    pub scale_rewards: ScaleRewards,
    pub loss_type: GrpoLossType,
    /// Token or sequence (GSPO) importance ratios
    /// (`importance_sampling_level`): token.
    pub importance_sampling: ImportanceSampling,
    /// The KL estimate weighted by the importance ratio
    /// (`use_bias_correction_kl`): true.
    pub bias_correction_kl: bool,
    /// SAPO's temperatures (`sapo_temperature_pos`, `_neg`): 1.0, 1.05.
    pub sapo_temperature_pos: f64,
    pub sapo_temperature_neg: f64,
}

impl Default for GrpoSpec {
    fn default() -> GrpoSpec {
        GrpoSpec {
            scale_rewards: ScaleRewards::Group,
            loss_type: GrpoLossType::Dapo,
            importance_sampling: ImportanceSampling::Token,
            bias_correction_kl: true,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
        }
    }
}

impl GrpoSpec {
    /// The traced loss's settings, over rollouts of `r`.
    pub fn loss(&self, r: &RolloutSpec) -> GrpoLoss {
        GrpoLoss {
            loss_type: self.loss_type,
            beta: r.beta,
            epsilon: r.epsilon,
            epsilon_high: r.epsilon_high(),
            temperature: r.temperature,
            max_completion_length: r.max_completion_length as i64,
            old_logps: r.num_iterations > 1,
            importance_sampling: self.importance_sampling,
            bias_correction_kl: self.bias_correction_kl,
            sapo_temperature_pos: self.sapo_temperature_pos,
            sapo_temperature_neg: self.sapo_temperature_neg,
        }
    }
}

/// GRPO as an objective of a run.
pub(crate) struct Grpo;

pub(crate) static GRPO: Grpo = Grpo;

impl ObjectiveDef for Grpo {
    fn name(&self) -> &'static str {
        "grpo"
    }

    fn data(&self) -> Data {
        Data::Rollouts
    }

    /// Its own settings, the rollouts', and β (the KL penalty's weight)
    /// with its reference adapter.
    fn reads(&self, name: &str) -> bool {
        matches!(name, "beta" | "ref-adapter")
            || rollouts::is_setting(name)
            || settings::SETTINGS.iter().any(|s| s.name == name)
    }

    fn settings(&self) -> Vec<&'static [Setting]> {
        vec![settings::SETTINGS, rollouts::settings::SETTINGS]
    }

    fn step_spec(&self, step: &StepSpec, _specs: &ObjectiveSpecs) -> Result<StepSpec> {
        rollouts::step_spec(step).map_err(rollouts::as_objective("grpo"))
    }

    fn loss(&self, specs: &ObjectiveSpecs, _reference: Reference) -> Loss {
        Loss::Grpo(specs.grpo.loss(&specs.rollouts))
    }

    fn batch_fields(&self, _packed: bool) -> Vec<BatchField> {
        vec![
            BatchField::InputIds,
            BatchField::LossMask,
            BatchField::Advantages,
        ]
    }

    /// The step's own (with β also `kl`, first; the clipping figures of
    /// its loss type); the rollouts' figures (`reward`,
    /// `completions/…`) come with the batch.
    fn metrics(&self, specs: &ObjectiveSpecs) -> Vec<&'static str> {
        let mut m = vec!["loss", "entropy"];
        match specs.grpo.loss_type {
            GrpoLossType::Sapo => {}
            GrpoLossType::Cispo => m.push("cispo_clip_ratio"),
            _ => m.extend([
                "clip_ratio/low_mean",
                "clip_ratio/low_min",
                "clip_ratio/high_mean",
                "clip_ratio/high_max",
                "clip_ratio/region_mean",
            ]),
        }
        m
    }

    fn describe(&self, specs: &ObjectiveSpecs, loss: &Loss) -> Option<String> {
        let Loss::Grpo(g) = loss else {
            return None;
        };
        Some(format!(
            "grpo ({} loss, beta {}, epsilon {}..{}, {} iteration(s) per rollout batch)",
            g.loss_type.name(),
            g.beta,
            g.epsilon,
            g.epsilon_high,
            specs.rollouts.num_iterations,
        ))
    }

    fn batch_words(&self, specs: &ObjectiveSpecs, rows: i64) -> String {
        rollouts::batch_words(&specs.rollouts, rows)
    }

    fn check_settings(&self, spec: &RunSpec) -> Result<()> {
        check_settings(spec)
    }

    fn record_settings(&self, settings: &mut RunSettings, spec: &RunSpec) {
        record_settings(settings, spec)
    }

    fn reference(&self, spec: &RunSpec, model: &Model) -> Result<Option<Adapter>> {
        RolloutInputs::reference(spec, model)
    }

    /// Each reward less its group's mean, scaled as `--scale-rewards` says.
    fn advantages(&self, specs: &ObjectiveSpecs) -> Option<Box<dyn AdvantageRule>> {
        Some(Box::new(GroupNormalised {
            group: specs.rollouts.num_generations,
            scale: specs.grpo.scale_rewards,
        }))
    }
}

/// Refuses GRPO settings that cannot go together.
fn check_settings(spec: &RunSpec) -> Result<()> {
    rollouts::check(spec, true)?;
    let g = &spec.objectives.grpo;
    let refuse = |why: String| {
        Err(EngineError::Objective {
            objective: "grpo",
            why,
        })
    };
    for (what, t) in [
        ("sapo-temperature-pos", g.sapo_temperature_pos),
        ("sapo-temperature-neg", g.sapo_temperature_neg),
    ] {
        if !t.is_finite() || t <= 0.0 {
            return refuse(format!("--{what} must be a finite number > 0, not {t}"));
        }
    }
    let default = GrpoSpec::default();
    let temperatures = (g.sapo_temperature_pos, g.sapo_temperature_neg);
    if g.loss_type != GrpoLossType::Sapo
        && temperatures != (default.sapo_temperature_pos, default.sapo_temperature_neg)
    {
        return refuse(format!(
            "--sapo-temperature-pos and --sapo-temperature-neg are the sapo loss's; --loss-type is {}",
            g.loss_type.name()
        ));
    }
    Ok(())
}

/// GRPO's settings, as a run records them with its identities.
fn record_settings(s: &mut RunSettings, spec: &RunSpec) {
    rollouts::record(s, spec, |name| GRPO.reads(name));
    let g = &spec.objectives.grpo;
    s.set("scale-rewards", g.scale_rewards.name());
    s.set("loss-type", g.loss_type.name());
    s.set("importance-sampling-level", g.importance_sampling.name());
    s.set("use-bias-correction-kl", g.bias_correction_kl);
    s.set("sapo-temperature-pos", g.sapo_temperature_pos);
    s.set("sapo-temperature-neg", g.sapo_temperature_neg);
}

/// GRPO's advantages: each reward less its group's mean, scaled as
/// `scale_rewards` says ([`advantages`]).
pub struct GroupNormalised {
    pub group: usize,
    pub scale: ScaleRewards,
}

impl AdvantageRule for GroupNormalised {
    fn reads_old_logps(&self) -> bool {
        false
    }

    fn advantages(&self, rewards: &[f64], _batch: &Batch) -> Result<Advantaged> {
        let (adv, zero_std) = advantages(rewards, self.group, self.scale);
        check_reward_statistics(rewards, &adv)?;
        Ok((adv, vec![("frac_reward_zero_std".into(), share(&zero_std))]))
    }
}
