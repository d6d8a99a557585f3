//! LoRA-finetunes the tiny Llama on the bundled demo task (write a word in
//! capitals: `cat=` → `CAT`) through the public `hlo-engine` API alone:
//! `cargo run --release --example finetune`.
use hlo_engine::data::{demo_examples, tokenizer::BYTE_EOS, Loader, Tokenizer};
use hlo_engine::models::decoder::{LoraConfig, DEFAULT_TARGETS};
use hlo_engine::models::train::{Schedule, TrainConfig};
use hlo_engine::{ir::DType, Backend, BackendOptions, EngineError, Hooks, Model, ModelSource};
use hlo_engine::{Session, SessionOptions, StepReport, StopFlag, Trainer, TrainerOptions};

/// The engine calls this after every step; we print every 50th.
struct Print;
impl Hooks for Print {
    fn on_step(&mut self, r: &StepReport) -> hlo_engine::Result<()> {
        if r.step % 50 == 0 {
            let tps = r.smoothed_tokens_per_s;
            println!(
                "step {:>3}/{} loss {:.4} {tps:.0} tokens/s",
                r.step, r.steps, r.loss
            );
        }
        Ok(())
    }
}

fn main() -> hlo_engine::Result<()> {
    // Quiet XLA's own INFO logs (set before the plugin loads).
    std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    // The `tiny` preset (random weights) on one CPU device.
    let model = Model::open(&ModelSource::Preset("tiny".into()))?;
    let backend = Backend::open(&BackendOptions::cpu())?;
    // LoRA r=16, alpha=32 on every projection; AdamW at 2e-3 with warmup
    // and cosine decay; 16 rows of 16 tokens a step.
    let steps = 400;
    let lora = LoraConfig::new(16, 32.0, &DEFAULT_TARGETS, false)?;
    let schedule = Schedule::cosine(20, steps);
    let config = TrainConfig::new(DType::F32, 16, 16)
        .with_lora(Some(lora))
        .with_lr(2e-3, schedule);
    // The demo task tokenized byte by byte, shuffled by seed 0.
    let examples = demo_examples(&Tokenizer::bytes(), Some(BYTE_EOS), 2000, 0);
    let loader = Loader::new(examples, 16, 16, 0);
    // Trace, lay out and compile the step once; place weights and adapter.
    let mut session = Session::new(backend, model, config, SessionOptions::default())?;
    let (options, stop) = (TrainerOptions::new(steps), StopFlag::default());
    let summary = Trainer::new(&mut session, loader, vec![], options, stop)?.run(&mut Print)?;
    let first = summary.first_loss.unwrap_or(f64::NAN);
    let last = summary.last_loss.unwrap_or(f64::NAN);
    println!(
        "loss {first:.4} -> {last:.4} in {} steps",
        summary.steps_run
    );
    // The trained adapter, which `adapter.save(dir, None)` writes as PEFT does.
    let adapter = session.adapter()?.expect("a LoRA session");
    println!("trained {} LoRA tensors", adapter.tensors.len());
    if last.is_nan() || last >= 0.5 * first {
        return Err(EngineError::Setting("the loss did not fall".into()));
    }
    Ok(())
}
