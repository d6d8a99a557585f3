//! LoRA-finetunes the tiny Llama on the bundled demo task (write a word in
//! capitals: `cat=` → `CAT`) through the public `hlo-engine` API alone:
//! `cargo run --release --example finetune`.
//!
//! It trains twice: once straight through, and once stopped after half
//! its steps and resumed from the saved folder by a second [`Run`]. The
//! two adapters must be equal to the bit, and the loss must have fallen.
use std::path::Path;

use hlo_engine::run::spec::RunSpec;
use hlo_engine::run::Run;
use hlo_engine::step::StepSpec;
use hlo_engine::step::{LoraSpec, ScheduleKind};
use hlo_engine::train::hooks::{Hooks, StepReport};
use hlo_engine::train::trainer::StopFlag;

/// The engine calls this after every step: prints every 100th, and stops
/// the run at `stop_at` (it saves and returns after the step in flight).
struct Print {
    stop_at: Option<i64>,
    stop: StopFlag,
}

impl Hooks for Print {
    fn on_step(&mut self, r: &StepReport) -> hlo_engine::Result<()> {
        if r.step % 100 == 0 {
            let tps = r.smoothed_tokens_per_s;
            println!(
                "step {:>3}/{} loss {:.4} {tps:.0} tokens/s",
                r.step, r.steps, r.loss
            );
        }
        if self.stop_at == Some(r.step) {
            self.stop.stop();
        }
        Ok(())
    }
}

/// The run: LoRA r=16, alpha=32 on every projection of the `tiny` preset
/// (random weights) on one CPU device; 16 rows of 16 tokens of the demo
/// task a step; AdamW at 2e-3 with 20 warmup steps and cosine decay.
fn spec(steps: i64, out: &Path) -> RunSpec {
    let mut spec = RunSpec {
        steps,
        step: StepSpec {
            batch: 16,
            seq: 16,
            lora: LoraSpec {
                rank: 16,
                alpha: 32.0,
                ..LoraSpec::default()
            },
            ..StepSpec::default()
        },
        ..RunSpec::default()
    };
    spec.optim.lr = 2e-3;
    spec.optim.warmup = 20;
    spec.optim.schedule = ScheduleKind::Cosine;
    spec.output.out = Some(out.to_path_buf());
    spec.output.overwrite = true;
    spec
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Quiet XLA's own INFO logs (set before the plugin loads).
    std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    let steps = 400;
    let dir = std::env::temp_dir().join(format!("hlo-finetune-{}", std::process::id()));
    let (straight, halves) = (dir.join("straight"), dir.join("halves"));

    println!("straight through:");
    let mut run = Run::new(spec(steps, &straight))?;
    let mut print = Print {
        stop_at: None,
        stop: StopFlag::default(),
    };
    let summary = run.train(&mut print)?;
    let (first, last) = (summary.first_loss, summary.last_loss);
    let want = run.session().adapter()?.ok_or("not a LoRA run")?;

    println!("stopped after half, then resumed:");
    let stop = StopFlag::default();
    let mut print = Print {
        stop_at: Some(steps / 2),
        stop: stop.clone(),
    };
    let stopped = Run::new(spec(steps, &halves))?
        .with_stop(stop)
        .train(&mut print)?;
    println!("stopped at step {}", stopped.step);
    // Every setting comes back from the folder.
    let mut resumed = Run::new(RunSpec::resume(&halves))?;
    let mut print = Print {
        stop_at: None,
        stop: StopFlag::default(),
    };
    let summary = resumed.train(&mut print)?;
    let got = resumed.session().adapter()?.ok_or("not a LoRA run")?;
    std::fs::remove_dir_all(&dir)?;

    let (first, last) = (first.unwrap_or(f64::NAN), last.unwrap_or(f64::NAN));
    println!(
        "loss {first:.4} -> {last:.4} in {steps} steps; resumed at step {} and ended at {} with loss {:.4}",
        stopped.step,
        summary.step,
        summary.last_loss.unwrap_or(f64::NAN)
    );
    if !stopped.interrupted || stopped.step >= steps {
        return Err("the run was not stopped half way".into());
    }
    if got.tensors != want.tensors {
        return Err("the resumed run's adapter differs from the straight run's".into());
    }
    println!(
        "the resumed run's {} LoRA tensors equal the straight run's",
        got.tensors.len()
    );
    if last.is_nan() || last >= 0.5 * first {
        return Err("the loss did not fall".into());
    }
    Ok(())
}
