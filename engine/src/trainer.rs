//! The training loop over a [`Session`]: batches drawn and placed while the
//! previous step runs, each step's figures read only after the next step
//! is launched (the host never holds the devices up), step times taken
//! from the devices' own completion reports, held-out evaluation,
//! checkpoints written only after their step's loss is known to be finite,
//! and a clean stop on SIGINT/SIGTERM. What is printed or written to
//! files is the caller's, through [`Hooks`].

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hlo_data::{Batch, Loader};
use hlo_runtime::{DeviceArray, Mode};
use regex::Regex;

use crate::checkpoint::{self, RunSettings, RunState};
use crate::error::{EngineError, Result};
use crate::hooks::{EvalReport, Hooks, StepReport, TracedValue, TrainSummary};
use crate::session::{scalar, Launched, PlacedBatch, Session};

/// Set when the run should stop after the step in flight (and save).
#[derive(Clone, Debug, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// A flag that SIGINT and SIGTERM set; a second signal exits at once
    /// (code 130). One per process.
    pub fn on_signals() -> StopFlag {
        static FLAG: std::sync::OnceLock<StopFlag> = std::sync::OnceLock::new();
        FLAG.get_or_init(|| {
            let flag = StopFlag::default();
            let seen = flag.clone();
            let _ = ctrlc::set_handler(move || {
                if seen.0.swap(true, Ordering::SeqCst) {
                    std::process::exit(130);
                }
            });
            flag
        })
        .clone()
    }

    pub fn stop(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// How the loop runs.
#[derive(Clone, Debug)]
pub struct TrainerOptions {
    /// The step count the run ends at (restored steps included).
    pub steps: i64,
    /// Evaluate every this many steps (and before the first and after the
    /// last); 0: only before the first and after the last.
    pub eval_every: i64,
    /// Save every this many steps (0: only at the end); needs `out`.
    pub save_every: i64,
    /// Where checkpoints go.
    pub out: Option<PathBuf>,
    /// What a checkpoint records besides the session's own settings (the
    /// data's and model's identities, say).
    pub settings: RunSettings,
    /// Eager mode: report every value made in scopes matching this, for
    /// the first step, and stop at the first non-finite one.
    pub trace_values: Option<Regex>,
    /// The mesh's peak FLOP/s, for MFU (None: no MFU).
    pub peak_flops: Option<f64>,
    /// Steps the moving averages of the progress figures span.
    pub smoothing_window: usize,
}

impl TrainerOptions {
    /// `steps` steps, evaluating only before the first and after the last,
    /// saving nowhere, averaging figures over 20 steps.
    pub fn new(steps: i64) -> TrainerOptions {
        TrainerOptions {
            steps,
            eval_every: 0,
            save_every: 0,
            out: None,
            settings: RunSettings::default(),
            trace_values: None,
            peak_flops: None,
            smoothing_window: 20,
        }
    }
}

/// The loop: a session, its data, and when to evaluate and save.
pub struct Trainer<'a> {
    session: &'a mut Session,
    loader: Loader,
    eval_batches: Vec<Batch>,
    options: TrainerOptions,
    stop: StopFlag,
    // The moving window of (seconds, tokens) of the last steps.
    window: VecDeque<(f64, usize)>,
    last_finished: Option<Instant>,
    started: Instant,
    summary: TrainSummary,
}

impl<'a> Trainer<'a> {
    pub fn new(
        session: &'a mut Session,
        loader: Loader,
        eval_batches: Vec<Batch>,
        options: TrainerOptions,
        stop: StopFlag,
    ) -> Result<Trainer<'a>> {
        if options.save_every > 0 && options.out.is_none() {
            return Err(EngineError::SaveEveryNeedsOut);
        }
        if !eval_batches.is_empty() && !session.has_eval() {
            return Err(EngineError::NoEvalStep);
        }
        if options.trace_values.is_some() && session.mode() != Mode::Eager {
            return Err(EngineError::TraceNeedsEager);
        }
        Ok(Trainer {
            session,
            loader,
            eval_batches,
            options,
            stop,
            window: VecDeque::new(),
            last_finished: None,
            started: Instant::now(),
            summary: TrainSummary::default(),
        })
    }

    /// The loader's position: the samples handed out so far.
    pub fn cursor(&self) -> u64 {
        self.loader.cursor
    }

    fn prepare(&mut self) -> Result<(PlacedBatch, u64)> {
        let batch = self.loader.next_batch();
        Ok((self.session.place_batch(&batch)?, self.loader.cursor))
    }

    /// Reads a finished step's figures and hands them to the hooks; a
    /// non-finite loss stops the run.
    fn report(&mut self, p: Launched, hooks: &mut dyn Hooks) -> Result<()> {
        let (loss, grad_norm, lr) = (scalar(&p.loss)?, scalar(&p.grad_norm)?, scalar(&p.lr)?);
        let finished = p.finished();
        let started = match self.last_finished {
            Some(t) if t > p.launched => t,
            _ => p.launched,
        };
        self.last_finished = Some(finished.max(self.last_finished.unwrap_or(finished)));
        let dt = finished.saturating_duration_since(started).as_secs_f64();
        if !loss.is_finite() || !grad_norm.is_finite() {
            return Err(EngineError::NonFinite {
                step: p.step,
                loss,
                grad_norm,
                kept: self.options.out.is_some(),
            });
        }
        self.window.push_back((dt, p.tokens));
        while self.window.len() > self.options.smoothing_window.max(1) {
            self.window.pop_front();
        }
        let (secs, tokens) = self
            .window
            .iter()
            .fold((0.0, 0usize), |(s, n), (dt, t)| (s + dt, n + t));
        let per_step = secs / self.window.len() as f64;
        let metrics = p
            .metrics
            .iter()
            .map(|(name, a)| Ok((name.clone(), scalar(a)?)))
            .collect::<Result<Vec<_>>>()?;
        let report = StepReport {
            step: p.step,
            steps: self.options.steps,
            loss,
            lr,
            grad_norm,
            metrics,
            step_time_s: dt,
            tokens_per_s: p.tokens as f64 / dt,
            mfu: self
                .options
                .peak_flops
                .map(|peak| self.session.step_flops() / dt / peak),
            targets: p.targets,
            smoothed_tokens_per_s: tokens as f64 / secs,
            eta_s: per_step * (self.options.steps - p.step).max(0) as f64,
            elapsed_s: self.started.elapsed().as_secs_f64(),
        };
        self.summary.first_loss.get_or_insert(loss);
        self.summary.last_loss = Some(loss);
        hooks.on_step(&report)
    }

    fn evaluate(&mut self, hooks: &mut dyn Hooks) -> Result<()> {
        if self.eval_batches.is_empty() {
            return Ok(());
        }
        let result = self.session.evaluate(&self.eval_batches)?;
        hooks.on_eval(&EvalReport {
            step: self.session.steps_done(),
            steps: self.options.steps,
            result,
        })
    }

    fn save(&mut self, cursor: u64, hooks: &mut dyn Hooks) -> Result<()> {
        let Some(out) = self.options.out.clone() else {
            return Ok(());
        };
        let mut settings = RunSettings::of(self.session);
        settings.extend(&self.options.settings);
        let state = RunState {
            version: 2,
            step: self.session.steps_done(),
            data_cursor: cursor,
            settings,
            checksum: None,
        };
        checkpoint::save(&out, self.session, &state)?;
        hooks.on_save(state.step, &out)
    }

    /// Runs steps until the session has taken `steps` (or the stop flag is
    /// set), then saves to `out`.
    pub fn run(&mut self, hooks: &mut dyn Hooks) -> Result<TrainSummary> {
        self.started = Instant::now();
        let steps = self.options.steps;
        let start = self.session.steps_done();
        let eval_every = self.options.eval_every;
        self.evaluate(hooks)?;
        let mut next = if start < steps {
            Some(self.prepare()?)
        } else {
            None
        };
        let mut pending: Option<Launched> = None;
        let mut cursor = self.loader.cursor;
        let (mut fill_sum, mut fills) = (0.0f64, 0usize);
        let mut interrupted = false;
        while self.session.steps_done() < steps {
            let (batch, batch_cursor) = next.take().expect("a prepared batch");
            fill_sum += batch.fill;
            fills += 1;
            let this = self.launch(&batch, start, hooks)?;
            cursor = batch_cursor;
            let step = self.session.steps_done();
            if step < steps {
                next = Some(self.prepare()?);
            }
            if let Some(p) = pending.replace(this) {
                self.report(p, hooks)?;
            }
            interrupted = self.stop.is_set() && step < steps;
            let saving = self.options.out.is_some()
                && (interrupted
                    || (self.options.save_every > 0
                        && step % self.options.save_every == 0
                        && step < steps));
            let evaluating = !self.eval_batches.is_empty()
                && ((eval_every > 0 && step % eval_every == 0) || step == steps);
            if saving || evaluating {
                // A checkpoint is written only once its step's loss is
                // known to be finite; an evaluation follows the step's
                // own figures.
                if let Some(p) = pending.take() {
                    self.report(p, hooks)?;
                }
            }
            if evaluating {
                self.evaluate(hooks)?;
            }
            if saving {
                self.save(cursor, hooks)?;
            }
            if interrupted {
                break;
            }
        }
        if let Some(p) = pending.take() {
            self.report(p, hooks)?;
        }
        self.summary.steps_run = self.session.steps_done() - start;
        self.summary.step = self.session.steps_done();
        self.summary.interrupted = interrupted;
        self.summary.fill = (fills > 0).then(|| fill_sum / fills as f64);
        if !interrupted {
            // The end: the loader's position after every batch drawn.
            self.save(
                self.loader.cursor.min(cursor.max(self.loader.cursor)),
                hooks,
            )?;
        }
        self.summary.saved = self.options.out.is_some();
        self.summary.wall_s = self.started.elapsed().as_secs_f64();
        Ok(self.summary.clone())
    }

    /// Launches one step; in eager mode with value tracing, watches every
    /// matching value for the first non-finite one.
    fn launch(
        &mut self,
        batch: &PlacedBatch,
        start: i64,
        hooks: &mut dyn Hooks,
    ) -> Result<Launched> {
        let Some(re) = self.options.trace_values.clone() else {
            return self.session.launch(batch);
        };
        let first = self.session.steps_done() == start;
        let mut first_bad: Option<(String, String, usize, usize)> = None;
        let mut observe = |node: &hlo_ir::Node,
                           values: &[&DeviceArray]|
         -> std::result::Result<(), hlo_runtime::Error> {
            if !re.is_match(&node.scope) {
                return Ok(());
            }
            for v in values {
                let x = v.gather()?.to_f64_vec();
                let finite: Vec<f64> = x.iter().copied().filter(|v| v.is_finite()).collect();
                let bad = x.len() - finite.len();
                // Constants may be infinite on purpose (a max's identity).
                let made = node.op.name() != "constant";
                if made && bad > 0 && first_bad.is_none() {
                    first_bad =
                        Some((node.op.name().to_string(), node.scope.clone(), bad, x.len()));
                }
                if first {
                    let (min, max) = finite
                        .iter()
                        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
                            (a.min(v), b.max(v))
                        });
                    hooks.on_traced_value(&TracedValue {
                        scope: node.scope.clone(),
                        op: node.op.name().to_string(),
                        ty: v.ty().to_string(),
                        min,
                        max,
                        mean: finite.iter().sum::<f64>() / finite.len().max(1) as f64,
                        non_finite: bad,
                    });
                }
            }
            Ok(())
        };
        let launched = self.session.launch_observed(batch, Some(&mut observe))?;
        if let Some((op, scope, bad, total)) = first_bad {
            return Err(EngineError::NonFiniteValue {
                step: launched.step,
                op,
                scope,
                bad,
                total,
                kept: self.options.out.is_some(),
            });
        }
        Ok(launched)
    }
}
