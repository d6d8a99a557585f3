//! Rollouts as data: prompts to complete, logged rollouts read
//! from a file, and a group of completions laid out as a batch with its
//! advantages.

use std::path::Path;

use hlo_data::{Batch, ChatTemplate, Prompt, Tokenizer};
use serde_json::Value;

use super::*;
use crate::error::{EngineError, Result};

/// One completion of a prompt and its reward.
#[derive(Clone, Debug, PartialEq)]
pub struct Rollout {
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// Each reward function's value (a logged rollout's one `reward`).
    pub rewards: Vec<f64>,
    /// Their weighted sum: what the advantage is of.
    pub reward: f64,
}

/// Logged rollouts, and the names of their rewards: `reward`, or those
/// each row's `rewards` gives (in name order).
#[derive(Clone, Debug, PartialEq)]
pub struct Logged {
    pub rollouts: Vec<Rollout>,
    pub names: Vec<String>,
}

/// A logged rollout's rewards by name: `reward` alone, or each of
/// `rewards`; else why not.
fn line_rewards(v: &Value) -> std::result::Result<(Vec<String>, Vec<f64>), &'static str> {
    let finite = |v: &Value| v.as_f64().filter(|r| r.is_finite());
    match (v.get("reward"), v.get("rewards")) {
        (Some(r), None) => Ok((
            vec!["reward".into()],
            vec![finite(r).ok_or("`reward` must be a finite number")?],
        )),
        (None, Some(Value::Object(m))) if !m.is_empty() => Ok((
            m.keys().cloned().collect(),
            m.values()
                .map(finite)
                .collect::<Option<_>>()
                .ok_or("`rewards` must give each name a finite number")?,
        )),
        (Some(_), Some(_)) => Err("give `reward` or `rewards`, not both"),
        (None, Some(_)) => Err("`rewards` must be an object of names and numbers"),
        (None, None) => Err(
            "expected {\"prompt_ids\", \"completion_ids\", \"reward\"} (or \"rewards\": {NAME: number}); no `reward`",
        ),
    }
}

/// Reads logged rollouts: one JSON object a line, `{"prompt_ids",
/// "completion_ids", "reward"}`, or with `"rewards": {NAME: value, ..}`
/// (several reward functions, summed with `weights` by name: TRL's
/// `reward_weights`; none given: each 1); consecutive lines of one prompt
/// form its group, so the count must be a multiple of `group`.
pub fn read_rollouts(path: &Path, group: usize, weights: &[RewardWeight]) -> Result<Logged> {
    read_logged(path, group, weights, true)
}

/// Reads logged rollouts (see [`read_rollouts`]); `rewarded` false: an
/// objective without rewards (distillation), whose lines carry none.
pub(crate) fn read_logged(
    path: &Path,
    group: usize,
    weights: &[RewardWeight],
    rewarded: bool,
) -> Result<Logged> {
    let text = std::fs::read_to_string(path).map_err(|cause| {
        EngineError::Rollout(format!(
            "cannot read --rollouts {}: {cause}",
            path.display()
        ))
    })?;
    let mut out = Vec::new();
    let mut names: Option<Vec<String>> = None;
    for (n, line) in hlo_data::jsonl_lines(&text) {
        let bad =
            |why: &str| EngineError::Rollout(format!("{} line {}: {why}", path.display(), n + 1));
        let (rollout, row_names) = logged_line(line, rewarded, &bad)?;
        match &names {
            None => names = Some(row_names),
            Some(first) if *first != row_names => {
                return Err(bad(&format!(
                    "its rewards are {}, and the first line's {}",
                    row_names.join(", "),
                    first.join(", ")
                )))
            }
            Some(_) => {}
        }
        out.push(rollout);
    }
    let Some(names) = names else {
        return Err(EngineError::Rollout(format!(
            "{} holds no rollouts",
            path.display()
        )));
    };
    check_groups(path, &out, group)?;
    let w = logged_weights(path, &names, weights)?;
    for r in &mut out {
        r.reward = r.rewards.iter().zip(&w).map(|(r, w)| w * r).sum();
    }
    Ok(Logged {
        rollouts: out,
        names,
    })
}

/// One logged line: its rollout (reward not yet weighed) and the names
/// of its rewards; `bad` words an error about the line.
fn logged_line(
    line: &str,
    rewarded: bool,
    bad: &dyn Fn(&str) -> EngineError,
) -> Result<(Rollout, Vec<String>)> {
    let v: Value = serde_json::from_str(line).map_err(|e| bad(&format!("not JSON: {e}")))?;
    let ids = |key: &str| -> Result<Vec<u32>> {
        v.get(key)
            .and_then(Value::as_array)
            .ok_or_else(|| {
                bad(&format!(
                    "expected {{\"prompt_ids\", \"completion_ids\", \"reward\"}}; no `{key}` list"
                ))
            })?
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| {
                bad(&format!(
                    "`{key}` must hold token ids (non-negative integers)"
                ))
            })
    };
    let prompt_ids = ids("prompt_ids")?;
    let completion_ids = ids("completion_ids")?;
    if prompt_ids.is_empty() {
        return Err(bad("`prompt_ids` is empty"));
    }
    let (names, rewards) = match rewarded {
        true => line_rewards(&v).map_err(bad)?,
        false if v.get("reward").is_some() || v.get("rewards").is_some() => {
            return Err(bad(
                "the objective has no rewards; the rollouts carry some (drop `reward`)",
            ))
        }
        false => (Vec::new(), Vec::new()),
    };
    let rollout = Rollout {
        prompt_ids,
        completion_ids,
        reward: 0.0,
        rewards,
    };
    Ok((rollout, names))
}

/// The rollouts come in whole groups of `group` consecutive lines, each
/// group over one prompt.
fn check_groups(path: &Path, out: &[Rollout], group: usize) -> Result<()> {
    if !out.len().is_multiple_of(group) {
        return Err(EngineError::Rollout(format!(
            "{} holds {} rollouts, not a multiple of --num-generations {group} (consecutive lines of one prompt form its group)",
            path.display(),
            out.len()
        )));
    }
    for (g, rows) in out.chunks(group).enumerate() {
        if rows.iter().any(|r| r.prompt_ids != rows[0].prompt_ids) {
            return Err(EngineError::Rollout(format!(
                "{}: the rollouts of group {} (lines {}-{}) do not share one prompt (consecutive lines of one prompt form its group of --num-generations {group})",
                path.display(),
                g + 1,
                g * group + 1,
                (g + 1) * group
            )));
        }
    }
    Ok(())
}

/// Each logged reward's weight: `weights` must name every one of `names`
/// once, or be empty (each 1).
pub(super) fn logged_weights(
    path: &Path,
    names: &[String],
    weights: &[RewardWeight],
) -> Result<Vec<f64>> {
    if weights.is_empty() {
        return Ok(vec![1.0; names.len()]);
    }
    let refuse = |why: String| Err(EngineError::Rollout(why));
    for (k, w) in weights.iter().enumerate() {
        if !names.contains(&w.name) {
            return refuse(format!(
                "--reward-weights names `{}`, which {} does not log (its rewards: {})",
                w.name,
                path.display(),
                names.join(", ")
            ));
        }
        if weights[..k].iter().any(|o| o.name == w.name) {
            return refuse(format!("--reward-weights gives `{}` twice", w.name));
        }
    }
    names
        .iter()
        .map(|n| match weights.iter().find(|w| &w.name == n) {
            Some(w) => Ok(w.weight),
            None => Err(EngineError::Rollout(format!(
                "--reward-weights gives no weight for `{n}` (give one for each of {})",
                names.join(", ")
            ))),
        })
        .collect()
}

/// A completion cut after its first EOS (kept), and whether it ended so.
pub(super) fn terminated<'a>(completion: &'a [u32], eos: &[u32]) -> (&'a [u32], bool) {
    match completion.iter().position(|t| eos.contains(t)) {
        Some(k) => (&completion[..=k], true),
        None => (completion, false),
    }
}

/// Refuses rewards too large for their statistics: a group's mean or
/// deviation that overflows f64, or an advantage past f32 (what the step
/// reads), would train on zeros or infinities without a word.
pub(crate) fn check_reward_statistics(rewards: &[f64], advantages: &[f64]) -> Result<()> {
    let largest = rewards.iter().fold(0.0f64, |m, r| m.max(r.abs()));
    // The sum of squared deviations is at most n·(2·largest)².
    let deviations = (2.0 * largest).powi(2) * rewards.len() as f64;
    let overflows = !deviations.is_finite()
        || advantages
            .iter()
            .any(|&a| !a.is_finite() || a.abs() > f64::from(f32::MAX));
    if overflows {
        return Err(EngineError::Rollout(format!(
            "rewards as large as {largest:e} overflow their statistics (the group's mean and standard deviation, the advantages in f32); scale the rewards down"
        )));
    }
    Ok(())
}

/// Each completion's advantage, with the figures TRL logs of them.
pub(crate) type Advantaged = (Vec<f64>, Vec<(String, f64)>);

/// How a batch of rollouts' rewards become the advantages the step
/// reads: an objective's rule (GRPO's group normalisation, RLOO's leave
/// one out), applied once the batch is laid out and
/// scored.
pub trait AdvantageRule: Send {
    /// Whether the rule reads the policy's per-token log-probabilities
    /// from when the rollouts were made (`batch.old_logps`) and the
    /// reference's (`batch.ref_token_logps`, scored whenever β ≠ 0).
    fn reads_old_logps(&self) -> bool;

    /// Each completion's advantage of `rewards` (their weighted sums),
    /// with the figures TRL logs of them, for `batch` (its loss mask and
    /// any scored log-probabilities).
    fn advantages(&self, rewards: &[f64], batch: &Batch) -> Result<Advantaged>;
}

/// The share of `flags` that are set (TRL's `frac_reward_zero_std`).
pub fn share(flags: &[bool]) -> f64 {
    flags.iter().filter(|&&z| z).count() as f64 / flags.len().max(1) as f64
}

/// The batch of `rollouts` (rows of `seq`: prompt then completion,
/// right-padded; the mask on the completion's tokens up to its first EOS)
/// with the metrics TRL logs of a generation batch (its completions and
/// rewards); the advantages are an [`AdvantageRule`]'s, once the batch is
/// scored.
pub fn rollout_batch(
    rollouts: &[Rollout],
    seq: usize,
    eos: &[u32],
    reward_names: Option<&[&str]>,
) -> Result<(Batch, Vec<(String, f64)>)> {
    let rows = rollouts.len();
    let mut b = Batch::empty(rows, seq);
    let rewards: Vec<f64> = rollouts.iter().map(|r| r.reward).collect();
    let mut lengths = Vec::with_capacity(rows);
    let mut term_lengths = Vec::new();
    for (r, ro) in rollouts.iter().enumerate() {
        let (completion, ended) = terminated(&ro.completion_ids, eos);
        let p = ro.prompt_ids.len();
        if p + completion.len() > seq {
            return Err(EngineError::Rollout(format!(
                "a prompt of {p} tokens and its completion of {} do not fit in --seq {seq}",
                completion.len()
            )));
        }
        let base = r * seq;
        for (t, &tok) in ro.prompt_ids.iter().chain(completion).enumerate() {
            b.ids[base + t] = tok as i32;
            b.positions[base + t] = t as i32;
            b.segment_ids[base + t] = 1;
        }
        // Position t predicts token t + 1: the completion's tokens are
        // predicted from p − 1 on.
        for t in 0..completion.len() {
            b.loss_mask[base + p - 1 + t] = 1.0;
        }
        b.targets += completion.len();
        lengths.push(completion.len() as f64);
        if ended {
            term_lengths.push(completion.len() as f64);
        }
    }
    let n = rows as f64;
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len().max(1) as f64;
    let std = |x: &[f64]| {
        if x.len() < 2 {
            return f64::NAN;
        }
        let m = mean(x);
        (x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (x.len() as f64 - 1.0)).sqrt()
    };
    let min = |x: &[f64]| x.iter().copied().fold(f64::INFINITY, f64::min);
    let max = |x: &[f64]| x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if term_lengths.is_empty() {
        term_lengths.push(0.0);
    }
    let mut m = vec![
        ("completions/mean_length".to_string(), mean(&lengths)),
        ("completions/min_length".to_string(), min(&lengths)),
        ("completions/max_length".to_string(), max(&lengths)),
        (
            "completions/clipped_ratio".to_string(),
            rollouts
                .iter()
                .filter(|r| !terminated(&r.completion_ids, eos).1)
                .count() as f64
                / n,
        ),
        (
            "completions/mean_terminated_length".to_string(),
            mean(&term_lengths),
        ),
        (
            "completions/min_terminated_length".to_string(),
            min(&term_lengths),
        ),
        (
            "completions/max_terminated_length".to_string(),
            max(&term_lengths),
        ),
    ];
    // An objective without rewards (None) logs none.
    if let Some(names) = reward_names {
        for (k, name) in names.iter().enumerate() {
            let v: Vec<f64> = rollouts.iter().map(|r| r.rewards[k]).collect();
            m.push((format!("rewards/{name}/mean"), mean(&v)));
            m.push((format!("rewards/{name}/std"), std(&v)));
        }
        m.push(("reward".to_string(), mean(&rewards)));
        m.push(("reward_std".to_string(), std(&rewards)));
    }
    Ok((b, m))
}

/// Prompts to roll out, with their rows and text.
pub struct PromptSet {
    /// Each prompt's ids, text (for rewards) and dataset row.
    pub prompts: Vec<(Vec<u32>, String, Value)>,
}

impl PromptSet {
    /// Reads a prompt file (`{"prompt"}`, `{"messages"}` through the chat
    /// template, `{"prompt_ids"}`), keeping every column for the rewards.
    pub fn read(
        path: &Path,
        tokenizer: Option<&Tokenizer>,
        chat: Option<&ChatTemplate>,
    ) -> Result<PromptSet> {
        let lines = hlo_data::read_prompts(path)?;
        let mut prompts = Vec::with_capacity(lines.len());
        for l in lines {
            let chat = match l.prompt {
                Prompt::Messages(_) => chat,
                _ => None,
            };
            let ids = l.prompt.encode(tokenizer, chat)?;
            if ids.is_empty() {
                return Err(EngineError::Rollout(format!(
                    "{} line {}: the prompt is empty",
                    path.display(),
                    l.number
                )));
            }
            let text = match tokenizer {
                Some(t) => t.decode(&ids)?,
                None => String::new(),
            };
            prompts.push((ids, text, l.line));
        }
        Ok(PromptSet { prompts })
    }

    /// The bundled task's prompts (`word=`, answered `WORD`): `count`
    /// drawn with `seed`.
    pub fn demo(tokenizer: &Tokenizer, count: usize, seed: u64) -> Result<PromptSet> {
        let prompts = hlo_data::demo_prompt_rows(count, seed)
            .into_iter()
            .map(|row| {
                let text = row["prompt"].as_str().unwrap_or_default().to_string();
                Ok((tokenizer.encode(&text, true)?, text, row))
            })
            .collect::<Result<_>>()?;
        Ok(PromptSet { prompts })
    }
}
