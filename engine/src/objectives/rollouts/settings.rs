//! The rollout settings, one table the objectives over rollouts share,
//! declared as `crate::run::settings` declares every setting (β and the
//! reference adapter are the preference objectives' table's).

use serde_json::json;

use crate::run::settings::{of, parsed_list, path, put, shown, shown_path, text, Kind, Setting};

pub(crate) static SETTINGS: &[Setting] = &[
    of(
        "num-generations",
        |s| json!(s.objectives.rollouts.num_generations),
        |s, v| {
            put(
                &mut s.objectives.rollouts.num_generations,
                v.as_u64()? as usize,
            )
        },
    ),
    of(
        "epsilon",
        |s| json!(s.objectives.rollouts.epsilon),
        |s, v| put(&mut s.objectives.rollouts.epsilon, v.as_f64()?),
    ),
    of(
        "epsilon-high",
        |s| json!(s.objectives.rollouts.epsilon_high),
        |s, v| put(&mut s.objectives.rollouts.epsilon_high, Some(v.as_f64()?)),
    ),
    of(
        "num-iterations",
        |s| json!(s.objectives.rollouts.num_iterations),
        |s, v| {
            put(
                &mut s.objectives.rollouts.num_iterations,
                v.as_u64()? as usize,
            )
        },
    ),
    of(
        "max-completion-length",
        |s| json!(s.objectives.rollouts.max_completion_length),
        |s, v| {
            put(
                &mut s.objectives.rollouts.max_completion_length,
                v.as_u64()? as usize,
            )
        },
    ),
    of(
        "temperature",
        |s| json!(s.objectives.rollouts.temperature),
        |s, v| put(&mut s.objectives.rollouts.temperature, v.as_f64()?),
    ),
    of(
        "top-p",
        |s| json!(s.objectives.rollouts.top_p),
        |s, v| put(&mut s.objectives.rollouts.top_p, v.as_f64()?),
    ),
    of(
        "top-k",
        |s| json!(s.objectives.rollouts.top_k),
        |s, v| {
            put(
                &mut s.objectives.rollouts.top_k,
                u32::try_from(v.as_u64()?).ok()?,
            )
        },
    ),
    of(
        "reward",
        |s| shown(&s.objectives.rollouts.rewards),
        |s, v| put(&mut s.objectives.rollouts.rewards, parsed_list(v)?),
    ),
    of(
        "rollouts",
        |s| shown_path(&s.objectives.rollouts.rollouts),
        |s, v| put(&mut s.objectives.rollouts.rollouts, path(v)?),
    ),
    of(
        "reward-weights",
        |s| shown(&s.objectives.rollouts.reward_weights),
        |s, v| put(&mut s.objectives.rollouts.reward_weights, parsed_list(v)?),
    ),
    of(
        "answer-column",
        |s| json!(s.objectives.rollouts.answer_column),
        |s, v| put(&mut s.objectives.rollouts.answer_column, text(v)?),
    ),
    of(
        "format-regex",
        |s| json!(s.objectives.rollouts.format_regex),
        |s, v| {
            put(
                &mut s.objectives.rollouts.format_regex,
                v.as_str().map(str::to_string),
            )
        },
    ),
    of(
        "reward-command",
        |s| json!(s.objectives.rollouts.reward_command),
        |s, v| {
            put(
                &mut s.objectives.rollouts.reward_command,
                v.as_str().map(str::to_string),
            )
        },
    ),
    of(
        "reward-url",
        |s| json!(s.objectives.rollouts.reward_url),
        |s, v| {
            put(
                &mut s.objectives.rollouts.reward_url,
                v.as_str().map(str::to_string),
            )
        },
    ),
    of(
        "reward-model",
        |s| shown_path(&s.objectives.rollouts.reward_model),
        |s, v| put(&mut s.objectives.rollouts.reward_model, path(v)?),
    ),
    of(
        "log-completions",
        |s| json!(s.objectives.rollouts.log_completions),
        |s, v| {
            put(
                &mut s.objectives.rollouts.log_completions,
                v.as_u64()? as usize,
            )
        },
    ),
    Setting {
        name: "reward-timeout",
        kind: Kind::Output,
        value: Some(|s| json!(s.objectives.rollouts.reward_timeout)),
        restore: |s, v| put(&mut s.objectives.rollouts.reward_timeout, v.as_f64()?),
    },
];
