//! What a training run writes besides its checkpoints, one hook each: the
//! metrics file (one JSON object per step or evaluation), TensorBoard's
//! event files, the loss chart (`loss.svg` in the output folder) and the
//! run's effective `recipe.yaml`.

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use hlo_engine::train::hooks::{EvalReport, Hooks, RunStart, StepReport, TrainSummary};
use hlo_engine::EngineError;
use hlo_report::{EventWriter, LossCurves, ReportError};
use serde_json::json;

use crate::recipe;

/// A report file's error, as a hook reports one.
fn report(e: ReportError) -> EngineError {
    EngineError::Hook(Box::new(e))
}

/// A write that failed, as the engine reports one.
fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> EngineError {
    let path = path.to_path_buf();
    move |cause| EngineError::Io {
        action,
        path,
        cause,
    }
}

/// `--metrics FILE`: a JSON object per step and per evaluation; a
/// resumed run appends.
pub struct MetricsFile {
    path: PathBuf,
    file: File,
}

impl MetricsFile {
    /// Opens `path` (its folder made if needed), appended to when `append`.
    pub fn open(path: &Path, append: bool) -> hlo_engine::Result<MetricsFile> {
        if let Some(parent) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io("create", parent))?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(io("create", path))?;
        Ok(MetricsFile {
            path: path.to_path_buf(),
            file,
        })
    }

    fn line(&mut self, line: serde_json::Value) -> hlo_engine::Result<()> {
        writeln!(self.file, "{line}").map_err(io("write", &self.path))
    }
}

impl Hooks for MetricsFile {
    fn on_step(&mut self, r: &StepReport) -> hlo_engine::Result<()> {
        let mut line = json!({
            "step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
            "tokens_per_s": r.tokens_per_s, "step_time_s": r.step_time_s, "mfu": r.mfu,
            "targets": r.targets, "elapsed_s": r.elapsed_s,
        });
        // A preference loss's metrics under TRL's names.
        for (name, v) in &r.metrics {
            line[name] = json!(v);
        }
        // GRPO's sampled completions (`--log-completions`).
        if !r.samples.is_empty() {
            line["completions"] = json!(r.samples);
        }
        self.line(line)
    }

    fn on_eval(&mut self, e: &EvalReport) -> hlo_engine::Result<()> {
        let r = &e.result;
        let mut line = json!({"step": e.step, "eval_loss": r.loss, "eval_tokens": r.tokens});
        if r.metrics.is_empty() {
            line["eval_perplexity"] = json!(r.perplexity());
        }
        // TRL prefixes its eval metrics so: `eval_rewards/chosen`.
        for (name, v) in &r.metrics {
            line[format!("eval_{name}")] = json!(v);
        }
        self.line(line)
    }
}

/// `--tensorboard DIR`: the run's scalars as event files, written through
/// at every log line and evaluation.
pub struct TensorBoard {
    pub writer: EventWriter,
    pub log_every: i64,
}

impl Hooks for TensorBoard {
    fn on_step(&mut self, r: &StepReport) -> hlo_engine::Result<()> {
        let mut scalars = vec![
            ("train/loss", r.loss),
            ("train/lr", r.lr),
            ("train/grad_norm", r.grad_norm),
            ("train/tokens_per_s", r.tokens_per_s),
        ];
        if let Some(mfu) = r.mfu {
            scalars.push(("train/mfu", mfu));
        }
        let named: Vec<(String, f64)> = r
            .metrics
            .iter()
            .map(|(n, v)| (format!("train/{n}"), *v))
            .collect();
        scalars.extend(named.iter().map(|(n, v)| (n.as_str(), *v)));
        self.writer.add_scalars(r.step, &scalars).map_err(report)?;
        if r.step % self.log_every == 0 || r.step == r.steps {
            self.writer.flush().map_err(report)?;
        }
        Ok(())
    }

    fn on_eval(&mut self, e: &EvalReport) -> hlo_engine::Result<()> {
        let r = &e.result;
        let named: Vec<(String, f64)> = r
            .metrics
            .iter()
            .map(|(n, v)| (format!("eval/{n}"), *v))
            .collect();
        let mut scalars = vec![("eval/loss", r.loss)];
        if r.metrics.is_empty() {
            scalars.push(("eval/perplexity", r.perplexity()));
        }
        scalars.extend(named.iter().map(|(n, v)| (n.as_str(), *v)));
        self.writer.add_scalars(e.step, &scalars).map_err(report)?;
        self.writer.flush().map_err(report)
    }

    fn on_end(&mut self, _summary: &TrainSummary) -> hlo_engine::Result<()> {
        self.writer.flush().map_err(report)
    }
}

/// `out/loss.svg`: the train and eval loss over the whole run (the
/// metrics file's, which holds the steps before a resume too; else this
/// session's).
pub struct LossChart {
    pub out: PathBuf,
    pub metrics: Option<PathBuf>,
    /// `<model>: loss`; once the run starts, the objective's name is put
    /// before `loss` (`tiny: RLOO loss`), SFT's left out.
    pub title: String,
    pub curves: LossCurves,
    /// Also chart the rollouts' rewards (`reward.svg`, titled
    /// `<model>: <OBJECTIVE> reward`).
    pub rewards: bool,
}

impl LossChart {
    /// The title of the rewards' chart: the loss chart's, of the reward.
    fn reward_title(&self) -> String {
        match self.title.strip_suffix("loss") {
            Some(head) => format!("{head}reward"),
            None => format!("{}: reward", self.title),
        }
    }
}

impl Hooks for LossChart {
    fn on_start(&mut self, start: &RunStart) -> hlo_engine::Result<()> {
        // The objective as the run recorded it (what a resume runs).
        let objective = start
            .settings
            .0
            .get("objective")
            .and_then(serde_json::Value::as_str)
            .filter(|o| *o != "sft");
        if let (Some(o), Some(model)) = (objective, self.title.strip_suffix(": loss")) {
            self.title = format!("{model}: {} loss", o.to_uppercase());
        }
        Ok(())
    }

    fn on_step(&mut self, r: &StepReport) -> hlo_engine::Result<()> {
        self.curves.train.push((r.step, r.loss));
        Ok(())
    }

    fn on_eval(&mut self, e: &EvalReport) -> hlo_engine::Result<()> {
        self.curves.eval.push((e.step, e.result.loss));
        Ok(())
    }

    fn on_end(&mut self, _summary: &TrainSummary) -> hlo_engine::Result<()> {
        let curves = match &self.metrics {
            Some(m) => LossCurves::read_metrics(m).map_err(report)?,
            None => std::mem::take(&mut self.curves),
        };
        if !curves.is_empty() {
            curves
                .write_svg(&self.out.join("loss.svg"), &self.title)
                .map_err(report)?;
        }
        // GRPO, RLOO: the rollouts' mean reward per step, and its moving
        // mean.
        if let (Some(m), true) = (&self.metrics, self.rewards) {
            let rewards = LossCurves::read_smoothed(m, "reward", 20).map_err(report)?;
            if !rewards.is_empty() {
                let labels = hlo_report::Labels {
                    y: "mean reward of the step's rollouts",
                    train: "reward",
                    eval: "mean of the last 20 steps",
                    eval_markers: false,
                };
                let title = self.reward_title();
                rewards
                    .write_chart(&self.out.join("reward.svg"), &title, labels)
                    .map_err(report)?;
            }
        }
        Ok(())
    }
}

/// `out/recipe.yaml`: the run's flags with its resolved settings and mesh,
/// written when the run starts.
pub struct RecipeFile {
    /// `train`'s flags.
    pub command: clap::Command,
    /// The command line's `train` flags as read.
    pub matches: clap::ArgMatches,
}

impl RecipeFile {
    /// The recipe of `argv` (`hlo-train train ...`), read with `command`
    /// (`train`'s flags).
    pub fn new(command: clap::Command, argv: &[OsString]) -> anyhow::Result<RecipeFile> {
        let matches = command
            .clone()
            .try_get_matches_from(argv.iter().skip(1))
            .map_err(|e| anyhow::anyhow!("{}", crate::args::usage_error(&e)))?;
        Ok(RecipeFile { command, matches })
    }
}

impl Hooks for RecipeFile {
    fn on_start(&mut self, start: &RunStart) -> hlo_engine::Result<()> {
        let Some(out) = &start.out else {
            return Ok(());
        };
        let mut resolved: Vec<(String, serde_json::Value)> = start
            .settings
            .0
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        resolved.push(("mesh".into(), start.mesh.to_string().into()));
        resolved.push(("devices".into(), start.mesh.size().into()));
        let text = recipe::effective(&self.command, &self.matches, &resolved);
        let path = out.join("recipe.yaml");
        Ok(hlo_engine::models::io::write_atomic(
            &path,
            text.as_bytes(),
        )?)
    }
}
