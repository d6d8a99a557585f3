//! What a training run shows: its header, the demo's generations before
//! and after, a progress bar with moving averages and an ETA, a log line
//! every few steps, eval and value-trace lines, the metrics file (one
//! JSON object per step or evaluation) and TensorBoard's event files.

use std::fs::File;
use std::io::Write;

use anyhow::Result;
use hlo_engine::data::Tokenizer;
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::attention::AttentionKind;
use hlo_engine::{
    EngineError, EvalReport, Generator, Hooks, Mode, Sampling, Session, StepReport, TracedValue,
};
use hlo_report::{EventWriter, LossCurves, ReportError};

use crate::args::printable;
use crate::train::TrainArgs;
use indicatif::ProgressBar;
use serde_json::json;

/// Steps the progress figures average over.
pub const SMOOTHING_WINDOW: usize = 20;

/// What the console, the metrics file and TensorBoard show of a run.
pub struct Console {
    pub bar: ProgressBar,
    pub metrics: Option<File>,
    /// `--tensorboard`: the run's scalars as event files.
    pub tensorboard: Option<EventWriter>,
    pub log_every: i64,
    /// This session's losses, for the loss plot of a run without a
    /// metrics file.
    pub curves: LossCurves,
}

impl Console {
    fn metric(&mut self, line: serde_json::Value) -> hlo_engine::Result<()> {
        if let Some(m) = self.metrics.as_mut() {
            writeln!(m, "{line}").map_err(|e| {
                hlo_engine::EngineError::Setting(format!("cannot write the metrics file: {e}"))
            })?;
        }
        Ok(())
    }

    /// Scalars for TensorBoard at `step`, written through to the file
    /// when `flush` (each log line and evaluation).
    fn scalars(
        &mut self,
        step: i64,
        values: &[(&str, f64)],
        flush: bool,
    ) -> hlo_engine::Result<()> {
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.add_scalars(step, values).map_err(engine_error)?;
            if flush {
                tb.flush().map_err(engine_error)?;
            }
        }
        Ok(())
    }
}

/// A report error where a hook must return the engine's: the trainer stops
/// with it as with any other. Event files only fail to be written, which
/// is the engine's `Io`; the rest keep their message.
fn engine_error(e: ReportError) -> EngineError {
    match e {
        ReportError::Io {
            action,
            path,
            cause,
        } => EngineError::Io {
            action,
            path,
            cause,
        },
        other => EngineError::Setting(other.to_string()),
    }
}

impl Hooks for Console {
    fn on_step(&mut self, r: &StepReport) -> hlo_engine::Result<()> {
        self.bar.set_position(r.step as u64);
        self.bar.set_message(format!(
            "loss {:.4}  {:.0} tokens/s  eta {}",
            r.loss,
            r.smoothed_tokens_per_s,
            duration(r.eta_s)
        ));
        self.metric(json!({
            "step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
            "tokens_per_s": r.tokens_per_s, "step_time_s": r.step_time_s, "mfu": r.mfu,
            "targets": r.targets, "elapsed_s": r.elapsed_s,
        }))?;
        let log = r.step % self.log_every == 0 || r.step == r.steps;
        self.curves.train.push((r.step, r.loss));
        let mut scalars = vec![
            ("train/loss", r.loss),
            ("train/lr", r.lr),
            ("train/grad_norm", r.grad_norm),
            ("train/tokens_per_s", r.tokens_per_s),
        ];
        if let Some(mfu) = r.mfu {
            scalars.push(("train/mfu", mfu));
        }
        self.scalars(r.step, &scalars, log)?;
        if log {
            // The window's average: one step's own figure jumps with the
            // machine's other work.
            let mfu = r.mfu.unwrap_or(f64::NAN) * r.smoothed_tokens_per_s / r.tokens_per_s;
            self.bar.suspend(|| {
                println!(
                    "step {:>5}/{} loss {:.4} lr {:.3e} grad_norm {:.4} tokens/s {:.0} mfu {:.2}%",
                    r.step,
                    r.steps,
                    r.loss,
                    r.lr,
                    r.grad_norm,
                    r.smoothed_tokens_per_s,
                    mfu * 100.0
                )
            });
        }
        Ok(())
    }

    fn on_eval(&mut self, e: &EvalReport) -> hlo_engine::Result<()> {
        let r = e.result;
        self.bar.suspend(|| {
            println!(
                "eval  {:>5}/{} eval_loss {:.4} perplexity {:.3} ({} tokens)",
                e.step,
                e.steps,
                r.loss,
                r.perplexity(),
                r.tokens
            )
        });
        self.bar.set_message(format!("eval_loss {:.4}", r.loss));
        self.curves.eval.push((e.step, r.loss));
        self.scalars(
            e.step,
            &[("eval/loss", r.loss), ("eval/perplexity", r.perplexity())],
            true,
        )?;
        self.metric(json!({
            "step": e.step, "eval_loss": r.loss, "eval_perplexity": r.perplexity(),
            "eval_tokens": r.tokens,
        }))
    }

    fn on_traced_value(&mut self, v: &TracedValue) {
        self.bar.suspend(|| {
            println!(
                "trace {:<48} {:<20} {:<18} min {:+.4e} max {:+.4e} mean {:+.4e} non-finite {}",
                v.scope, v.op, v.ty, v.min, v.max, v.mean, v.non_finite
            )
        });
    }
}

/// `1h02m`, `3m05s`, `12s`.
fn duration(s: f64) -> String {
    if !s.is_finite() {
        return "?".into();
    }
    let s = s.round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// The demo's prompts, completed before and after training.
const DEMO_PROMPTS: [&str; 3] = ["cat=", "hello=", "rust="];

/// Prints the demo prompts' greedy completions, one line each.
pub fn demo_show(
    label: &str,
    session: &Session,
    tokenizer: &Tokenizer,
    adapter: Option<&Adapter>,
    seed: u64,
) -> Result<()> {
    let model = session.model();
    // Generation of three short prompts: one device is plenty.
    let backend = session.backend().first_device();
    let dtype = session.config().dtype;
    let generator = Generator::new(&backend, &model.config, dtype, adapter, Mode::Jit, |n| {
        model.weight(n, dtype, seed)
    })?;
    let prompts: Vec<Vec<u32>> = DEMO_PROMPTS
        .iter()
        .map(|p| tokenizer.encode(p, true))
        .collect::<Result<_, _>>()?;
    let outs = generator.complete_batch(&prompts, 8, &Sampling::default(), &model.eos_ids())?;
    println!("{label}:");
    for (p, out) in DEMO_PROMPTS.iter().zip(&outs) {
        let text = tokenizer.decode(out)?;
        println!("  {p:<8} {}", printable(&text, out));
    }
    Ok(())
}

/// The run's header: model, devices, what is trained, the data and how
/// many epochs the steps make.
pub fn print_header(
    args: &TrainArgs,
    session: &Session,
    stats: &hlo_engine::data::DataStats,
    learning: usize,
    unpacked_fill: f64,
) -> Result<()> {
    let c = session.config();
    let model = session.model();
    let trained = match &c.lora {
        Some(l) => format!(
            "LoRA r={} alpha={}{} on {}",
            l.rank,
            l.alpha,
            if l.use_rslora { " (rsLoRA)" } else { "" },
            l.target_modules.join(",")
        ),
        None => "every weight (full finetuning)".to_string(),
    };
    let accum = if c.grad_accum > 1 {
        format!(" × {} micro-batches", c.grad_accum)
    } else {
        String::new()
    };
    // Samples a step takes: its rows, or with packing about as many as
    // fit in them.
    let per_step = if c.packing {
        c.rows() as f64 * c.seq as f64 * 0.9 / (unpacked_fill * c.seq as f64).max(1.0)
    } else {
        c.rows() as f64
    };
    // Said only when the step departs from the plain forms.
    let long = match (c.attention, c.loss_chunk_for(model.config.vocab_size)) {
        (AttentionKind::Naive, chunk) if chunk >= c.seq => String::new(),
        _ => format!("; {}", c.long_context_summary(model.config.vocab_size)),
    };
    let remaining = (args.steps - session.steps_done()).max(0) as f64;
    println!(
        "training {} ({} parameters, {}) on {} ({}): {trained}; batch {} × seq {}{accum}{long}; {}",
        model.name,
        model.config.parameter_count(),
        c.dtype,
        session.backend().mesh(),
        session.backend().describe()?,
        c.batch,
        c.seq,
        match session.mode() {
            Mode::Jit => format!("compiled in {:.2}s", session.compile_s()),
            Mode::Eager => "eager (each op compiles when it first runs)".to_string(),
        }
    );
    println!(
        "data: {} samples, {} tokens, {} learned within --seq {}{}{}; {}{:.2} epochs in {} steps",
        stats.samples,
        stats.tokens,
        stats.learned,
        c.seq,
        if stats.cut > 0 {
            format!("; {} samples cut to --seq", stats.cut)
        } else {
            String::new()
        },
        if stats.no_signal > 0 {
            format!(
                "; {} samples left out (no learned token within --seq)",
                stats.no_signal
            )
        } else {
            String::new()
        },
        if c.packing { "about " } else { "" },
        remaining * per_step / learning.max(1) as f64,
        remaining
    );
    Ok(())
}
