//! GRPO's own settings, declared as `crate::run::settings` declares
//! every setting.

use serde_json::json;

use crate::run::settings::{
    named, of, parsed_list, path, put, shown, shown_path, text, Kind, Setting, GRPO,
};

pub(crate) static SETTINGS: &[Setting] = &[
    of(
        "num-generations",
        GRPO,
        |s| json!(s.grpo.num_generations),
        |s, v| put(&mut s.grpo.num_generations, v.as_u64()? as usize),
    ),
    of(
        "epsilon",
        GRPO,
        |s| json!(s.grpo.epsilon),
        |s, v| put(&mut s.grpo.epsilon, v.as_f64()?),
    ),
    of(
        "epsilon-high",
        GRPO,
        |s| json!(s.grpo.epsilon_high),
        |s, v| put(&mut s.grpo.epsilon_high, Some(v.as_f64()?)),
    ),
    of(
        "num-iterations",
        GRPO,
        |s| json!(s.grpo.num_iterations),
        |s, v| put(&mut s.grpo.num_iterations, v.as_u64()? as usize),
    ),
    of(
        "scale-rewards",
        GRPO,
        |s| json!(s.grpo.scale_rewards.name()),
        |s, v| put(&mut s.grpo.scale_rewards, named(v)?),
    ),
    of(
        "loss-type",
        GRPO,
        |s| json!(s.grpo.loss_type.name()),
        |s, v| put(&mut s.grpo.loss_type, named(v)?),
    ),
    of(
        "max-completion-length",
        GRPO,
        |s| json!(s.grpo.max_completion_length),
        |s, v| put(&mut s.grpo.max_completion_length, v.as_u64()? as usize),
    ),
    of(
        "temperature",
        GRPO,
        |s| json!(s.grpo.temperature),
        |s, v| put(&mut s.grpo.temperature, v.as_f64()?),
    ),
    of(
        "top-p",
        GRPO,
        |s| json!(s.grpo.top_p),
        |s, v| put(&mut s.grpo.top_p, v.as_f64()?),
    ),
    of(
        "top-k",
        GRPO,
        |s| json!(s.grpo.top_k),
        |s, v| put(&mut s.grpo.top_k, u32::try_from(v.as_u64()?).ok()?),
    ),
    of(
        "reward",
        GRPO,
        |s| shown(&s.grpo.rewards),
        |s, v| put(&mut s.grpo.rewards, parsed_list(v)?),
    ),
    of(
        "rollouts",
        GRPO,
        |s| shown_path(&s.grpo.rollouts),
        |s, v| put(&mut s.grpo.rollouts, path(v)?),
    ),
    of(
        "reward-weights",
        GRPO,
        |s| shown(&s.grpo.reward_weights),
        |s, v| put(&mut s.grpo.reward_weights, parsed_list(v)?),
    ),
    of(
        "answer-column",
        GRPO,
        |s| json!(s.grpo.answer_column),
        |s, v| put(&mut s.grpo.answer_column, text(v)?),
    ),
    of(
        "format-regex",
        GRPO,
        |s| json!(s.grpo.format_regex),
        |s, v| put(&mut s.grpo.format_regex, v.as_str().map(str::to_string)),
    ),
    of(
        "reward-command",
        GRPO,
        |s| json!(s.grpo.reward_command),
        |s, v| put(&mut s.grpo.reward_command, v.as_str().map(str::to_string)),
    ),
    of(
        "reward-url",
        GRPO,
        |s| json!(s.grpo.reward_url),
        |s, v| put(&mut s.grpo.reward_url, v.as_str().map(str::to_string)),
    ),
    of(
        "log-completions",
        GRPO,
        |s| json!(s.grpo.log_completions),
        |s, v| put(&mut s.grpo.log_completions, v.as_u64()? as usize),
    ),
    Setting {
        name: "reward-timeout",
        kind: Kind::Output,
        read_by: GRPO,
        value: Some(|s| json!(s.grpo.reward_timeout)),
        restore: |s, v| put(&mut s.grpo.reward_timeout, v.as_f64()?),
    },
];
