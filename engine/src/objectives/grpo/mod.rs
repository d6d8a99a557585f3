//! GRPO (TRL 1.16's `GRPOTrainer`) beyond its loss (`hlo_models::grpo`):
//! the shared rollouts ([`crate::rollouts`]) with GRPO's advantages, each
//! reward less its group's mean, scaled as `--scale-rewards` says
//! ([`GroupNormalised`]), and its loss's own settings ([`GrpoSpec`]).

use hlo_data::Batch;
use hlo_models::grpo::{advantages, GrpoLoss, GrpoLossType, ImportanceSampling, ScaleRewards};

use hlo_models::adapter::Adapter;
use hlo_models::preference::Reference;
use hlo_models::train::Loss;

use crate::rollouts::{
    self, check_reward_statistics, share, AdvantageRule, Advantaged, RolloutDefaults,
    RolloutInputs, RolloutObjective, RolloutSpec,
};
use clap::Args;
use serde::{Deserialize, Serialize};

use super::{Data, Objective, ObjectiveDef, ObjectiveSpecs};
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::named::Named;
use crate::objectives::RunView;
use crate::settings;
use crate::step::StepSpec;

/// GRPO's own settings (TRL 1.16's `GRPOConfig` names and defaults: its
/// loss's); its rollouts' are [`RolloutSpec`]'s.
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct GrpoSpec {
    /// GRPO: how rewards become advantages: less the group's mean, over
    /// the group's standard deviation (group), the batch's (batch), or
    /// not scaled (none).
    #[arg(long, value_parser = settings::named::<ScaleRewards>(), default_value = "group")]
    #[serde(with = "settings::by_name")]
    pub scale_rewards: ScaleRewards,

    /// GRPO: the loss, as TRL's loss_type: the clipped ratio pooled per
    /// completion (grpo), over completions × --max-completion-length
    /// (dr_grpo), over the batch's completion tokens (dapo, bnpo); cispo
    /// (each token's log-probability weighted by its ratio clipped above
    /// at --epsilon-high, without gradient); sapo (a soft gate of the
    /// ratio at --sapo-temperature-pos or -neg).
    #[arg(long, value_parser = settings::named::<GrpoLossType>(), default_value = "dapo")]
    #[serde(with = "settings::by_name")]
    pub loss_type: GrpoLossType,

    /// GRPO: the importance ratio of each token (token), or one of each
    /// completion, its tokens' mean log-ratio (sequence: GSPO), as TRL's
    /// importance_sampling_level.
    #[arg(long, value_parser = settings::named::<ImportanceSampling>(), default_value = "token")]
    #[serde(with = "settings::by_name")]
    pub importance_sampling_level: ImportanceSampling,

    /// GRPO: weight the KL estimate by the importance ratio (TRL's
    /// use_bias_correction_kl); false leaves it unweighted.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub use_bias_correction_kl: bool,

    /// GRPO with --loss-type sapo: the temperature of a positive advantage.
    #[arg(long, default_value_t = 1.0, value_parser = settings::positive)]
    pub sapo_temperature_pos: f64,

    /// GRPO with --loss-type sapo: the temperature of a non-positive advantage.
    #[arg(long, default_value_t = 1.05, value_parser = settings::positive)]
    pub sapo_temperature_neg: f64,
}

impl Default for GrpoSpec {
    fn default() -> GrpoSpec {
        settings::defaults()
    }
}

impl Named for ScaleRewards {
    const ALL: &'static [ScaleRewards] = &ScaleRewards::ALL;
    fn name(self) -> &'static str {
        ScaleRewards::name(self)
    }
}

impl Named for GrpoLossType {
    const ALL: &'static [GrpoLossType] = &GrpoLossType::ALL;
    fn name(self) -> &'static str {
        GrpoLossType::name(self)
    }
}

impl Named for ImportanceSampling {
    const ALL: &'static [ImportanceSampling] = &ImportanceSampling::ALL;
    fn name(self) -> &'static str {
        ImportanceSampling::name(self)
    }
}

impl GrpoSpec {
    /// The traced loss's settings, over rollouts of `r`, with the KL
    /// penalty's weight `beta`.
    pub fn loss(&self, r: &RolloutSpec, beta: f64) -> GrpoLoss {
        GrpoLoss {
            loss_type: self.loss_type,
            beta,
            epsilon: r.epsilon,
            epsilon_high: r.epsilon_high(),
            temperature: r.temperature,
            max_completion_length: r.max_completion_length as i64,
            old_logps: r.num_iterations > 1,
            importance_sampling: self.importance_sampling_level,
            bias_correction_kl: self.use_bias_correction_kl,
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
            || settings::names::<GrpoSpec>().iter().any(|s| s == name)
    }

    fn step_spec(&self, step: &StepSpec, _specs: &ObjectiveSpecs) -> Result<StepSpec> {
        rollouts::step_spec(step).map_err(rollouts::as_objective("grpo"))
    }

    /// `GRPOConfig`'s: no KL penalty, 8 completions a prompt.
    fn rollout_defaults(&self) -> RolloutDefaults {
        RolloutDefaults::GRPO
    }

    fn loss(&self, specs: &ObjectiveSpecs, _reference: Reference) -> Loss {
        Loss::Grpo(
            specs
                .grpo
                .loss(&specs.rollouts, specs.beta(Objective::Grpo)),
        )
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
        rollouts::batch_words(&self.rollout_spec(specs), rows)
    }

    fn check_settings(&self, spec: &RunView) -> Result<()> {
        check_settings(spec)
    }

    fn reference(&self, spec: &RunView, model: &Model) -> Result<Option<Adapter>> {
        RolloutInputs::reference(spec, model)
    }

    fn rollouts(&self) -> Option<&dyn RolloutObjective> {
        Some(self)
    }
}

impl RolloutObjective for Grpo {
    fn rollout_spec(&self, specs: &ObjectiveSpecs) -> RolloutSpec {
        rollouts::with_defaults(specs, self)
    }

    /// Each reward less its group's mean, scaled as `--scale-rewards` says.
    fn advantages(&self, specs: &ObjectiveSpecs) -> Box<dyn AdvantageRule> {
        Box::new(GroupNormalised {
            group: self.rollout_spec(specs).num_generations(),
            scale: specs.grpo.scale_rewards,
        })
    }
}

/// Refuses GRPO settings that cannot go together.
fn check_settings(spec: &RunView) -> Result<()> {
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
