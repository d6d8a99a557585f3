//! What a run reports and who hears it: the figures of each step and
//! evaluation, and [`Hooks`], the callbacks a front end implements to
//! print, draw progress or write files. Several hooks compose as a
//! [`HookList`] of named hooks, called in the order they were added (as
//! GoMLX's train loop calls its named `OnStep` hooks), so a progress bar,
//! a metrics file, TensorBoard and a checkpoint callback stay apart.

use std::path::PathBuf;

use hlo_partitioner::Mesh;

use crate::error::Result;
use crate::train::checkpoint::{RunSettings, StateTransfer};
use crate::train::session::EvalResult;

/// One finished step's figures.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    pub step: i64,
    /// The step count the run ends at.
    pub steps: i64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// The loss's own metrics besides `loss` (a preference objective's,
    /// by TRL's names: `rewards/chosen`, `rewards/accuracies`, ...), in
    /// the step's order; empty for SFT.
    pub metrics: Vec<(String, f64)>,
    /// The time this step took on the devices: from when they started it
    /// (its launch, or the previous step's end if later) to its end.
    pub step_time_s: f64,
    /// Tokens processed (padding included) over `step_time_s`.
    pub tokens_per_s: f64,
    /// Model FLOPs over the devices' peak in that time (when the peak is
    /// known).
    pub mfu: Option<f64>,
    /// Tokens whose prediction counted in the loss.
    pub targets: usize,
    /// Tokens/s over the last steps (the moving window).
    pub smoothed_tokens_per_s: f64,
    /// Seconds to the last step at the window's pace.
    pub eta_s: f64,
    /// Wall-clock seconds since the loop started, when these figures
    /// were read (a clock independent of the devices' reports).
    pub elapsed_s: f64,
    /// Samples of what the step trained on, to show (GRPO's completions
    /// with their rewards, every so many steps); usually empty.
    pub samples: Vec<serde_json::Value>,
}

/// A held-out evaluation.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalReport {
    pub step: i64,
    pub steps: i64,
    pub result: EvalResult,
}

/// Statistics of one value made in eager mode (`--trace-values`).
#[derive(Clone, Debug, PartialEq)]
pub struct TracedValue {
    pub scope: String,
    pub op: String,
    /// The value's type (`f32[2,16,64]`).
    pub ty: String,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    pub non_finite: usize,
}

/// How a run went.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainSummary {
    /// Steps run by this call.
    pub steps_run: i64,
    /// The step count reached.
    pub step: i64,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    /// Stopped early by the stop flag.
    pub interrupted: bool,
    /// Mean share of the row slots holding real tokens.
    pub fill: Option<f64>,
    /// The step whose state `out` holds for a `--resume` (saved by this
    /// run, or the one it resumed from); None: nothing kept.
    pub saved_step: Option<i64>,
    /// Wall-clock seconds of the loop.
    pub wall_s: f64,
}

/// What a run is about to do, once it is resolved and compiled.
#[derive(Clone, Debug)]
pub struct RunStart {
    /// Every setting the run's result depends on, resolved (what
    /// `train_state/state.json` records).
    pub settings: RunSettings,
    /// The mesh the step runs over.
    pub mesh: Mesh,
    /// Where the run saves (None: nowhere).
    pub out: Option<PathBuf>,
    /// The step the run starts from (a resumed run's saved step, else 0).
    pub step: i64,
    /// The step count it ends at.
    pub steps: i64,
    /// Whether it continues a saved run.
    pub resumed: bool,
    /// The step's `auto` choices and why ([`crate::step::policy::StepPolicy::line`]).
    pub choices: String,
}

/// What the caller does with a run's events: print, draw progress, write
/// files. Every method has a do-nothing default.
pub trait Hooks {
    /// The run is resolved and compiled; no step has run yet.
    fn on_start(&mut self, _start: &RunStart) -> Result<()> {
        Ok(())
    }
    fn on_step(&mut self, _report: &StepReport) -> Result<()> {
        Ok(())
    }
    fn on_eval(&mut self, _report: &EvalReport) -> Result<()> {
        Ok(())
    }
    /// A checkpoint of step `step` was written to `out`.
    fn on_save(&mut self, _saved: &StateTransfer) -> Result<()> {
        Ok(())
    }
    fn on_traced_value(&mut self, _value: &TracedValue) {}
    /// The loop ended (finished, or stopped by a signal) and the
    /// processes of the run have all finished.
    fn on_end(&mut self, _summary: &TrainSummary) -> Result<()> {
        Ok(())
    }
}

/// Hooks that do nothing.
pub struct Quiet;
impl Hooks for Quiet {}

/// Named hooks called in turn, in the order they were added; the first
/// error stops the call (and the run).
///
/// ```
/// use hlo_engine::train::hooks::{HookList, Hooks, Quiet, StepReport};
/// struct Count(usize);
/// impl Hooks for Count {
///     fn on_step(&mut self, _: &StepReport) -> hlo_engine::Result<()> {
///         self.0 += 1;
///         Ok(())
///     }
/// }
/// let mut hooks = HookList::default();
/// hooks.add("count", Count(0)).add("quiet", Quiet);
/// assert_eq!(hooks.names(), ["count", "quiet"]);
/// ```
#[derive(Default)]
pub struct HookList {
    hooks: Vec<(String, Box<dyn Hooks>)>,
}

impl HookList {
    /// Adds `hook` under `name` (replacing a hook of that name in place).
    pub fn add(&mut self, name: &str, hook: impl Hooks + 'static) -> &mut HookList {
        let hook: Box<dyn Hooks> = Box::new(hook);
        match self.hooks.iter_mut().find(|(n, _)| n == name) {
            Some(slot) => slot.1 = hook,
            None => self.hooks.push((name.to_string(), hook)),
        }
        self
    }

    /// Removes the hook called `name`, if any.
    pub fn remove(&mut self, name: &str) -> &mut HookList {
        self.hooks.retain(|(n, _)| n != name);
        self
    }

    /// The hooks' names, in call order.
    pub fn names(&self) -> Vec<&str> {
        self.hooks.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn each(&mut self, mut f: impl FnMut(&mut dyn Hooks) -> Result<()>) -> Result<()> {
        self.hooks.iter_mut().try_for_each(|(_, h)| f(h.as_mut()))
    }
}

impl Hooks for HookList {
    fn on_start(&mut self, start: &RunStart) -> Result<()> {
        self.each(|h| h.on_start(start))
    }
    fn on_step(&mut self, report: &StepReport) -> Result<()> {
        self.each(|h| h.on_step(report))
    }
    fn on_eval(&mut self, report: &EvalReport) -> Result<()> {
        self.each(|h| h.on_eval(report))
    }
    fn on_save(&mut self, saved: &StateTransfer) -> Result<()> {
        self.each(|h| h.on_save(saved))
    }
    fn on_traced_value(&mut self, value: &TracedValue) {
        for (_, h) in &mut self.hooks {
            h.on_traced_value(value);
        }
    }
    fn on_end(&mut self, summary: &TrainSummary) -> Result<()> {
        self.each(|h| h.on_end(summary))
    }
}
