//! GRPO's own settings, declared as `crate::run::settings` declares
//! every setting.

use hlo_models::grpo::ImportanceSampling;
use serde_json::json;

use crate::run::named::Named;

use crate::run::settings::{
    named, of, parsed_list, path, put, shown, shown_path, text, Kind, Setting,
};

impl Named for ImportanceSampling {
    const ALL: &'static [ImportanceSampling] = &ImportanceSampling::ALL;
    fn name(self) -> &'static str {
        ImportanceSampling::name(self)
    }
}

pub(crate) static SETTINGS: &[Setting] = &[
    of(
        "num-generations",
        |s| json!(s.objectives.grpo.num_generations),
        |s, v| put(&mut s.objectives.grpo.num_generations, v.as_u64()? as usize),
    ),
    of(
        "epsilon",
        |s| json!(s.objectives.grpo.epsilon),
        |s, v| put(&mut s.objectives.grpo.epsilon, v.as_f64()?),
    ),
    of(
        "epsilon-high",
        |s| json!(s.objectives.grpo.epsilon_high),
        |s, v| put(&mut s.objectives.grpo.epsilon_high, Some(v.as_f64()?)),
    ),
    of(
        "num-iterations",
        |s| json!(s.objectives.grpo.num_iterations),
        |s, v| put(&mut s.objectives.grpo.num_iterations, v.as_u64()? as usize),
    ),
    of(
        "scale-rewards",
        |s| json!(s.objectives.grpo.scale_rewards.name()),
        |s, v| put(&mut s.objectives.grpo.scale_rewards, named(v)?),
    ),
    of(
        "loss-type",
        |s| json!(s.objectives.grpo.loss_type.name()),
        |s, v| put(&mut s.objectives.grpo.loss_type, named(v)?),
    ),
    of(
        "importance-sampling-level",
        |s| json!(s.objectives.grpo.importance_sampling.name()),
        |s, v| put(&mut s.objectives.grpo.importance_sampling, named(v)?),
    ),
    of(
        "use-bias-correction-kl",
        |s| json!(s.objectives.grpo.bias_correction_kl),
        |s, v| put(&mut s.objectives.grpo.bias_correction_kl, v.as_bool()?),
    ),
    of(
        "sapo-temperature-pos",
        |s| json!(s.objectives.grpo.sapo_temperature_pos),
        |s, v| put(&mut s.objectives.grpo.sapo_temperature_pos, v.as_f64()?),
    ),
    of(
        "sapo-temperature-neg",
        |s| json!(s.objectives.grpo.sapo_temperature_neg),
        |s, v| put(&mut s.objectives.grpo.sapo_temperature_neg, v.as_f64()?),
    ),
    of(
        "max-completion-length",
        |s| json!(s.objectives.grpo.max_completion_length),
        |s, v| {
            put(
                &mut s.objectives.grpo.max_completion_length,
                v.as_u64()? as usize,
            )
        },
    ),
    of(
        "temperature",
        |s| json!(s.objectives.grpo.temperature),
        |s, v| put(&mut s.objectives.grpo.temperature, v.as_f64()?),
    ),
    of(
        "top-p",
        |s| json!(s.objectives.grpo.top_p),
        |s, v| put(&mut s.objectives.grpo.top_p, v.as_f64()?),
    ),
    of(
        "top-k",
        |s| json!(s.objectives.grpo.top_k),
        |s, v| {
            put(
                &mut s.objectives.grpo.top_k,
                u32::try_from(v.as_u64()?).ok()?,
            )
        },
    ),
    of(
        "reward",
        |s| shown(&s.objectives.grpo.rewards),
        |s, v| put(&mut s.objectives.grpo.rewards, parsed_list(v)?),
    ),
    of(
        "rollouts",
        |s| shown_path(&s.objectives.grpo.rollouts),
        |s, v| put(&mut s.objectives.grpo.rollouts, path(v)?),
    ),
    of(
        "reward-weights",
        |s| shown(&s.objectives.grpo.reward_weights),
        |s, v| put(&mut s.objectives.grpo.reward_weights, parsed_list(v)?),
    ),
    of(
        "answer-column",
        |s| json!(s.objectives.grpo.answer_column),
        |s, v| put(&mut s.objectives.grpo.answer_column, text(v)?),
    ),
    of(
        "format-regex",
        |s| json!(s.objectives.grpo.format_regex),
        |s, v| {
            put(
                &mut s.objectives.grpo.format_regex,
                v.as_str().map(str::to_string),
            )
        },
    ),
    of(
        "reward-command",
        |s| json!(s.objectives.grpo.reward_command),
        |s, v| {
            put(
                &mut s.objectives.grpo.reward_command,
                v.as_str().map(str::to_string),
            )
        },
    ),
    of(
        "reward-url",
        |s| json!(s.objectives.grpo.reward_url),
        |s, v| {
            put(
                &mut s.objectives.grpo.reward_url,
                v.as_str().map(str::to_string),
            )
        },
    ),
    of(
        "reward-model",
        |s| shown_path(&s.objectives.grpo.reward_model),
        |s, v| put(&mut s.objectives.grpo.reward_model, path(v)?),
    ),
    of(
        "log-completions",
        |s| json!(s.objectives.grpo.log_completions),
        |s, v| put(&mut s.objectives.grpo.log_completions, v.as_u64()? as usize),
    ),
    Setting {
        name: "reward-timeout",
        kind: Kind::Output,
        value: Some(|s| json!(s.objectives.grpo.reward_timeout)),
        restore: |s, v| put(&mut s.objectives.grpo.reward_timeout, v.as_f64()?),
    },
];
