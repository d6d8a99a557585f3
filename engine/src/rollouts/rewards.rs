//! The rollouts' rewards: the built-in ones (accuracy, format, length), a
//! command reading JSON lines and an HTTP endpoint, each bounded in time,
//! weighed and summed as TRL sums them.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

use regex::Regex;
use serde_json::{json, Value};

use super::*;
use crate::error::{EngineError, Result};
use crate::train::trainer::StopFlag;

/// A reward by name, with its weight: `accuracy` (the completion's final
/// answer — the content of its last `\boxed{}`, else its last number,
/// else its last word — equals the row's answer column: 1, else 0),
/// `format` (the completion matches `--format-regex`: 1, else 0),
/// `length` (−len/`max_completion_length`: shorter is better), `command`
/// (an external program's answer), `http` (an endpoint's), `model` (a
/// reward model's score of the prompt and completion, `--reward-model`).
#[derive(Clone, Debug, PartialEq)]
pub struct RewardSpec {
    pub kind: RewardKind,
    pub weight: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RewardKind {
    Accuracy,
    Format,
    Length,
    Command,
    Http,
    Model,
}

impl RewardKind {
    pub const ALL: [RewardKind; 6] = [
        RewardKind::Accuracy,
        RewardKind::Format,
        RewardKind::Length,
        RewardKind::Command,
        RewardKind::Http,
        RewardKind::Model,
    ];
    pub fn name(self) -> &'static str {
        match self {
            RewardKind::Accuracy => "accuracy",
            RewardKind::Format => "format",
            RewardKind::Length => "length",
            RewardKind::Command => "command",
            RewardKind::Http => "http",
            RewardKind::Model => "model",
        }
    }
}

impl std::str::FromStr for RewardSpec {
    type Err = String;
    /// `NAME` or `NAME:WEIGHT`.
    fn from_str(s: &str) -> std::result::Result<RewardSpec, String> {
        let (name, weight) = match s.split_once(':') {
            Some((n, w)) => {
                let w: f64 = w
                    .parse()
                    .map_err(|_| format!("`{w}` is not a weight (a number) in `{s}`"))?;
                if !w.is_finite() {
                    return Err(format!("the weight in `{s}` must be finite"));
                }
                (n, w)
            }
            None => (s, 1.0),
        };
        let kind = RewardKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                format!("`{name}` is not a reward (accuracy, format, length, command, http, model)")
            })?;
        Ok(RewardSpec { kind, weight })
    }
}

impl std::fmt::Display for RewardSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.kind.name(), self.weight)
    }
}

/// The weight of one named reward of logged rollouts (`NAME:WEIGHT`, as
/// `--reward` writes weights).
#[derive(Clone, Debug, PartialEq)]
pub struct RewardWeight {
    pub name: String,
    pub weight: f64,
}

impl std::str::FromStr for RewardWeight {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<RewardWeight, String> {
        let (name, w) = s
            .split_once(':')
            .ok_or_else(|| format!("`{s}` is not NAME:WEIGHT"))?;
        let (name, w) = (name.trim(), w.trim());
        let weight: f64 = w
            .parse()
            .map_err(|_| format!("`{w}` is not a weight (a number) in `{s}`"))?;
        if name.is_empty() || !weight.is_finite() {
            return Err(format!("`{s}` is not NAME:WEIGHT with a finite weight"));
        }
        Ok(RewardWeight {
            name: name.to_string(),
            weight,
        })
    }
}

impl std::fmt::Display for RewardWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.name, self.weight)
    }
}

/// The final answer of a completion: the content of its last
/// `\boxed{...}`, else its last number, else its last word (ASCII
/// punctuation around it trimmed).
pub(crate) fn final_answer(text: &str) -> Option<String> {
    if let Some(at) = text.rfind("\\boxed{") {
        let rest = &text[at + 7..];
        let mut depth = 1;
        for (k, c) in rest.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(rest[..k].trim().to_string());
                    }
                }
                _ => {}
            }
        }
    }
    // Compiled once: it is asked of every completion of every step.
    static NUMBER: std::sync::LazyLock<Regex> = std::sync::LazyLock::new(|| {
        Regex::new(r"-?\d[\d,]*(\.\d+)?").expect("the number pattern compiles")
    });
    if let Some(m) = NUMBER.find_iter(text).last() {
        return Some(m.as_str().replace(',', ""));
    }
    text.split_whitespace()
        .last()
        // Punctuation around the word goes ("(CAT)."); anything else —
        // an undecodable byte's U+FFFD among them — stays part of it.
        .map(|w| {
            w.trim_matches(|c: char| c.is_ascii_punctuation())
                .to_string()
        })
        .filter(|w| !w.is_empty())
}

/// Whether two answers agree: equal as numbers when both are, else equal
/// as trimmed text.
pub(super) fn same_answer(a: &str, b: &str) -> bool {
    match (a.trim().parse::<f64>(), b.trim().parse::<f64>()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a.trim() == b.trim(),
    }
}

/// What a reward sees of one completion.
pub struct Scored<'a> {
    pub prompt: &'a str,
    pub completion: &'a str,
    pub prompt_ids: &'a [u32],
    pub completion_ids: &'a [u32],
    /// The prompt's dataset row (every column).
    pub row: &'a Value,
}

impl Scored<'_> {
    /// What an external reward is sent: the prompt and completion (text
    /// and ids) and the prompt's row's columns.
    fn request(&self) -> Value {
        let mut request = json!({
            "prompt": self.prompt,
            "completion": self.completion,
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
        });
        if let (Some(obj), Some(row)) = (request.as_object_mut(), self.row.as_object()) {
            for (k, v) in row {
                obj.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        request
    }
}

/// How long an external reward may take, and what ends the wait early.
#[derive(Clone, Debug)]
pub(super) struct Wait {
    timeout: Duration,
    stop: StopFlag,
}

impl Wait {
    /// `rx`'s next message (None: its sender is gone), waiting at most
    /// the timeout and giving up when the run is stopped by a signal.
    fn next<T>(&self, rx: &Receiver<T>, name: &str, what: &str) -> Result<Option<T>> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let now = Instant::now();
            if self.stop.is_set() {
                return Err(EngineError::Interrupted {
                    during: format!("waiting for --reward {name}"),
                });
            }
            if now >= deadline {
                return Err(EngineError::Reward {
                    name: name.into(),
                    why: format!(
                        "{what} did not answer within {} s (--reward-timeout)",
                        self.timeout.as_secs_f64()
                    ),
                });
            }
            // Short slices, so that a signal is noticed within one.
            match rx.recv_timeout((deadline - now).min(Duration::from_millis(50))) {
                Ok(v) => return Ok(Some(v)),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Ok(None),
            }
        }
    }
}

/// An HTTP reward: each batch of completions posted to `url` as a JSON
/// array of requests (as the command's lines), answered by a JSON array of
/// as many numbers. The request runs on its own thread so that the wait
/// can end at the timeout or on a signal (the thread then ends at the
/// same timeout, its answer unread).
pub(super) fn http_rewards(url: &str, items: &[Scored], wait: &Wait) -> Result<Vec<f64>> {
    let fail = |why: String| EngineError::Reward {
        name: "http".into(),
        why,
    };
    let body = Value::from(items.iter().map(Scored::request).collect::<Vec<_>>()).to_string();
    let (tx, rx) = mpsc::channel();
    let (target, timeout) = (url.to_string(), wait.timeout);
    std::thread::Builder::new()
        .name("reward-http".into())
        .spawn(move || {
            let agent = ureq::AgentBuilder::new().timeout(timeout).build();
            let answer = agent
                .post(&target)
                .set("Content-Type", "application/json")
                .send_string(&body)
                .map_err(|e| format!("POST {target}: {e}"))
                .and_then(|r| {
                    r.into_string()
                        .map_err(|e| format!("reading {target}'s answer: {e}"))
                });
            let _ = tx.send(answer);
        })
        .map_err(|cause| EngineError::Thread {
            what: "the reward's HTTP request",
            cause,
        })?;
    let text = match wait.next(&rx, "http", url)? {
        Some(answer) => answer.map_err(fail)?,
        None => {
            return Err(fail(format!(
                "POST {url}: the request ended without an answer"
            )))
        }
    };
    let values: Vec<f64> = match serde_json::from_str::<Value>(&text) {
        Ok(Value::Array(v)) => v
            .iter()
            .map(|x| {
                x.as_f64().ok_or_else(|| {
                    fail(format!(
                        "{url} answered {x} among its rewards, not a number"
                    ))
                })
            })
            .collect::<Result<_>>()?,
        _ => {
            let shown: String = text.chars().take(80).collect();
            return Err(fail(format!(
                "{url} answered `{shown}`, not a JSON array of numbers"
            )));
        }
    };
    if values.len() != items.len() {
        return Err(fail(format!(
            "{url} answered {} rewards for {} completions",
            values.len(),
            items.len()
        )));
    }
    Ok(values)
}

/// How long a command's surplus answers are waited for after a batch's
/// last one: a line that comes within this is refused with the batch.
pub(super) const SURPLUS_WAIT: Duration = Duration::from_millis(25);

/// An external reward: a command started once, in a process group of its
/// own (killed whole when the run ends, however it ends), that reads one
/// JSON object per line and answers one number per line. Its lines are
/// read by a thread of ours as they come, so that a line it prints
/// before it is asked, or beyond one per request, is seen and refused
/// rather than taken as the next completion's reward.
pub(super) struct RewardCommand {
    command: String,
    child: Child,
    /// Requests, written by a thread of ours (a command that stops
    /// reading cannot block the run).
    requests: Option<Sender<String>>,
    answers: Receiver<std::io::Result<String>>,
}

impl RewardCommand {
    fn start(command: &str) -> Result<RewardCommand> {
        let fail = |why: String| EngineError::Reward {
            name: "command".into(),
            why,
        };
        let mut child = crate::device::children::spawn_group(
            Command::new("sh")
                .arg("-c")
                .arg(command)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped()),
        )
        .map_err(|e| fail(format!("cannot start `{command}`: {e}")))?;
        let stdin = child.stdin.take().ok_or_else(|| fail("no stdin".into()))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| fail("no stdout".into()))?;
        let thread = |what: &'static str| move |cause| EngineError::Thread { what, cause };
        let (requests, to_write) = mpsc::channel::<String>();
        std::thread::Builder::new()
            .name("reward-command-in".into())
            .spawn(move || {
                let mut stdin = stdin;
                for line in to_write {
                    if writeln!(stdin, "{line}")
                        .and_then(|_| stdin.flush())
                        .is_err()
                    {
                        return;
                    }
                }
            })
            .map_err(thread("the reward command's writer"))?;
        let (lines, answers) = mpsc::channel();
        std::thread::Builder::new()
            .name("reward-command-out".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    if lines.send(line).is_err() {
                        return;
                    }
                }
            })
            .map_err(thread("the reward command's reader"))?;
        Ok(RewardCommand {
            command: command.to_string(),
            child,
            requests: Some(requests),
            answers,
        })
    }

    fn fail(&self, why: String) -> EngineError {
        EngineError::Reward {
            name: "command".into(),
            why: format!("`{}` {why}", self.command),
        }
    }

    /// The error for a command whose output has ended.
    fn stopped(&mut self) -> EngineError {
        let status = self
            .child
            .try_wait()
            .ok()
            .flatten()
            .map(|s| format!(" ({s})"))
            .unwrap_or_default();
        self.fail(format!(
            "stopped before answering (closed its output{status})"
        ))
    }

    /// A line the command printed unasked, refused.
    fn unasked(&mut self, line: std::io::Result<String>, when: &str) -> EngineError {
        match line {
            Ok(line) => self.fail(format!(
                "printed `{}` {when}; it must answer exactly one number per completion, after reading it",
                line.trim()
            )),
            Err(e) => self.fail(format!("could not be read: {e}")),
        }
    }

    /// One number per item, asked one line at a time, each waited for at
    /// most `wait`'s timeout.
    fn score(&mut self, items: &[Scored], wait: &Wait) -> Result<Vec<f64>> {
        match self.answers.try_recv() {
            Ok(line) => return Err(self.unasked(line, "before it was asked")),
            Err(TryRecvError::Disconnected) => return Err(self.stopped()),
            Err(TryRecvError::Empty) => {}
        }
        let mut out = Vec::with_capacity(items.len());
        for (k, s) in items.iter().enumerate() {
            if let Ok(line) = self.answers.try_recv() {
                return Err(self.unasked(line, &format!("beyond its {k} answers")));
            }
            let sent = self
                .requests
                .as_ref()
                .is_some_and(|r| r.send(s.request().to_string()).is_ok());
            if !sent {
                return Err(self.stopped());
            }
            let what = format!("`{}`", self.command);
            let line = match wait.next(&self.answers, "command", &what)? {
                Some(Ok(line)) => line,
                Some(Err(e)) => return Err(self.fail(format!("could not be read: {e}"))),
                None => return Err(self.stopped()),
            };
            let v: f64 = line
                .trim()
                .parse()
                .map_err(|_| self.fail(format!("answered `{}`, not a number", line.trim())))?;
            out.push(v);
        }
        // A surplus line of this batch's is refused with it, before its
        // rewards are used.
        if let Ok(line) = self.answers.recv_timeout(SURPLUS_WAIT) {
            let when = format!("beyond its {} answers", items.len());
            return Err(self.unasked(line, &when));
        }
        Ok(out)
    }
}

impl Drop for RewardCommand {
    fn drop(&mut self) {
        // Its stdin closes first: a command that ends at end of input can.
        self.requests = None;
        crate::device::children::kill_group(&mut self.child);
    }
}

/// The run's rewards, ready to score.
pub struct Rewards {
    specs: Vec<RewardSpec>,
    wait: Wait,
    answer_column: String,
    format: Option<Regex>,
    command: Option<RewardCommand>,
    url: Option<String>,
    max_completion_length: usize,
    /// `--reward-model`'s folder, and its scorer once placed on the run's
    /// devices ([`Rewards::place_model`]).
    model_dir: Option<std::path::PathBuf>,
    model: Option<Box<ModelReward>>,
}

/// A reward model on the run's devices, with the tokenizer its texts take.
struct ModelReward {
    scorer: crate::infer::reward_scorer::RewardScorer,
    tokenizer: hlo_data::Tokenizer,
}

impl Rewards {
    /// Checks the settings each reward reads and starts the command.
    pub fn new(spec: &RolloutSpec) -> Result<Rewards> {
        let refuse = |why: String| EngineError::Rollout(why);
        if spec.reward.is_empty() {
            return Err(refuse(
                "give at least one --reward (accuracy, format, length, command, http, model), or --rollouts"
                    .into(),
            ));
        }
        let has = |k: RewardKind| spec.reward.iter().any(|r| r.kind == k);
        for k in RewardKind::ALL {
            if spec.reward.iter().filter(|r| r.kind == k).count() > 1 {
                return Err(refuse(format!("--reward {} is given twice", k.name())));
            }
        }
        let format = match (&spec.format_regex, has(RewardKind::Format)) {
            (Some(r), true) => Some(Regex::new(r).map_err(|cause| EngineError::Regex {
                what: "--format-regex",
                pattern: r.clone(),
                cause,
            })?),
            (None, true) => return Err(refuse("--reward format needs --format-regex".into())),
            (Some(_), false) => {
                return Err(refuse(
                    "--format-regex is read by --reward format only".into(),
                ))
            }
            (None, false) => None,
        };
        let command = match (&spec.reward_command, has(RewardKind::Command)) {
            (Some(c), true) => Some(RewardCommand::start(c)?),
            (None, true) => return Err(refuse("--reward command needs --reward-command".into())),
            (Some(_), false) => {
                return Err(refuse(
                    "--reward-command is read by --reward command only".into(),
                ))
            }
            (None, false) => None,
        };
        let url = match (&spec.reward_url, has(RewardKind::Http)) {
            (Some(u), true) => Some(u.clone()),
            (None, true) => return Err(refuse("--reward http needs --reward-url".into())),
            (Some(_), false) => {
                return Err(refuse("--reward-url is read by --reward http only".into()))
            }
            (None, false) => None,
        };
        let model_dir = match (&spec.reward_model, has(RewardKind::Model)) {
            (Some(d), true) => Some(d.clone()),
            (None, true) => return Err(refuse("--reward model needs --reward-model DIR".into())),
            (Some(_), false) => {
                return Err(refuse(
                    "--reward-model is read by --reward model only".into(),
                ))
            }
            (None, false) => None,
        };
        if !(spec.reward_timeout.is_finite() && spec.reward_timeout > 0.0) {
            return Err(refuse(format!(
                "--reward-timeout must be a positive number of seconds, not {}",
                spec.reward_timeout
            )));
        }
        let wait = Wait {
            timeout: Duration::from_secs_f64(spec.reward_timeout.min(1e9)),
            stop: StopFlag::default(),
        };
        Ok(Rewards {
            specs: spec.reward.clone(),
            wait,
            answer_column: spec.answer_column.clone(),
            format,
            command,
            url,
            max_completion_length: spec.max_completion_length,
            model_dir,
            model: None,
        })
    }

    /// No rewards (an objective whose rollouts are not rewarded).
    pub fn none(spec: &RolloutSpec) -> Rewards {
        Rewards {
            specs: Vec::new(),
            wait: Wait {
                timeout: Duration::from_secs_f64(DEFAULT_REWARD_TIMEOUT),
                stop: StopFlag::default(),
            },
            answer_column: spec.answer_column.clone(),
            format: None,
            command: None,
            url: None,
            max_completion_length: spec.max_completion_length,
            model_dir: None,
            model: None,
        }
    }

    /// Places `--reward-model` (a sequence classifier's folder: a merged
    /// reward run, or an HF reward model) on `backend`, in `dtype`, to
    /// score `rows` texts of up to `seq` tokens at a time, with its own
    /// tokenizer or else `tokenizer` (the policy's); a no-op without it.
    pub fn place_model(
        &mut self,
        backend: &crate::device::backend::Backend,
        dtype: hlo_ir::DType,
        (rows, seq): (i64, i64),
        tokenizer: Option<hlo_data::Tokenizer>,
    ) -> Result<()> {
        let Some(dir) = &self.model_dir else {
            return Ok(());
        };
        if !dir.join("config.json").is_file() && dir.join("adapter_config.json").is_file() {
            return Err(EngineError::Reward {
                name: "model".into(),
                why: format!(
                    "--reward-model {} is a reward run's LoRA adapter: fold it into its base with `hlo-train merge --adapter {} --out MERGED` and give --reward-model MERGED",
                    dir.display(),
                    dir.display()
                ),
            });
        }
        let source = crate::inputs::model::ModelSource::Checkpoint(dir.clone());
        let model = crate::inputs::model::Model::open(&source)?.as_reward_model()?;
        let tokenizer = match (model.tokenizer(None)?, tokenizer) {
            (Some(own), _) => own,
            (None, Some(policy)) => policy,
            (None, None) => {
                return Err(EngineError::Reward {
                    name: "model".into(),
                    why: format!(
                        "{} has no tokenizer.json, and the run has none",
                        dir.display()
                    ),
                })
            }
        };
        let scorer = crate::infer::reward_scorer::RewardScorer::new(
            backend.clone(),
            &model,
            dtype,
            (rows, seq),
            None,
        )?;
        self.model = Some(Box::new(ModelReward { scorer, tokenizer }));
        Ok(())
    }

    /// The reward model's score of each item's prompt and completion, as
    /// TRL scores them: the two texts joined, tokenized without special
    /// tokens.
    fn model_rewards(&self, items: &[Scored]) -> Result<Vec<f64>> {
        let fail = |why: String| EngineError::Reward {
            name: "model".into(),
            why,
        };
        let m = self
            .model
            .as_ref()
            .ok_or_else(|| fail("the reward model is not placed on the devices".into()))?;
        let ids = items
            .iter()
            .map(|s| {
                if s.row.get("messages").is_some() {
                    return Err(fail(
                        "conversational prompts are not scored by a reward model yet".into(),
                    ));
                }
                // The row's prompt as written (TRL's), else its decoded ids.
                let prompt = s
                    .row
                    .get("prompt")
                    .and_then(Value::as_str)
                    .unwrap_or(s.prompt);
                let text = format!("{prompt}{}", s.completion);
                m.tokenizer
                    .encode(&text, false)
                    .map_err(|e| fail(e.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        m.scorer.score(&ids).map_err(|e| fail(e.to_string()))
    }

    /// Ends any wait for an external reward when `stop` is set (with
    /// [`EngineError::Interrupted`]).
    pub fn watch(&mut self, stop: StopFlag) {
        self.wait.stop = stop;
    }

    /// The rewards' names, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.specs.iter().map(|s| s.kind.name()).collect()
    }

    /// Each reward of each item (`[item][reward]`); a reward that fails
    /// or gives a non-finite value is an error naming it.
    pub fn score(&mut self, items: &[Scored]) -> Result<Vec<Vec<f64>>> {
        let mut per_reward = Vec::new();
        for spec in self.specs.clone() {
            let name = spec.kind.name();
            let values: Vec<f64> = match spec.kind {
                RewardKind::Accuracy => items
                    .iter()
                    .map(|s| {
                        let want = match s.row.get(&self.answer_column) {
                            Some(Value::String(a)) => a.clone(),
                            Some(Value::Number(n)) => n.to_string(),
                            _ => {
                                return Err(EngineError::Reward {
                                    name: name.into(),
                                    why: format!(
                                        "the prompt's row has no `{}` column (--answer-column)",
                                        self.answer_column
                                    ),
                                })
                            }
                        };
                        let got = final_answer(s.completion);
                        Ok(f64::from(got.is_some_and(|g| same_answer(&g, &want)) as u8))
                    })
                    .collect::<Result<_>>()?,
                RewardKind::Format => {
                    let re = self.format.as_ref().expect("checked in new");
                    items
                        .iter()
                        .map(|s| f64::from(re.is_match(s.completion) as u8))
                        .collect()
                }
                RewardKind::Length => items
                    .iter()
                    .map(|s| -(s.completion_ids.len() as f64) / self.max_completion_length as f64)
                    .collect(),
                RewardKind::Command => self
                    .command
                    .as_mut()
                    .expect("checked in new")
                    .score(items, &self.wait)?,
                RewardKind::Http => http_rewards(
                    self.url.as_deref().expect("checked in new"),
                    items,
                    &self.wait,
                )?,
                RewardKind::Model => self.model_rewards(items)?,
            };
            if let Some((k, v)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(EngineError::Reward {
                    name: name.into(),
                    why: format!("it gave {v} for completion {} of the batch", k + 1),
                });
            }
            per_reward.push(values);
        }
        Ok((0..items.len())
            .map(|i| per_reward.iter().map(|r| r[i]).collect())
            .collect())
    }

    /// The weighted sum of one item's rewards.
    pub fn total(&self, rewards: &[f64]) -> f64 {
        self.specs
            .iter()
            .zip(rewards)
            .map(|(s, r)| s.weight * r)
            .sum()
    }
}
