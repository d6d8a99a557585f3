//! What a training run shows on the terminal: its header, the demo's
//! generations before and after, a progress bar with moving averages and
//! an ETA, a log line every few steps, eval and value-trace lines. (What
//! it writes to files is `outputs`.)

use anyhow::Result;
use hlo_engine::data::Tokenizer;
use hlo_engine::infer::generator::{Generator, Sampling};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::attention::AttentionKind;
use hlo_engine::models::decoder::{LoraConfig, ModelConfig};
use hlo_engine::objectives::Data;
use hlo_engine::run::Run;
use hlo_engine::runtime::Mode;
use hlo_engine::train::checkpoint::StateTransfer;
use hlo_engine::train::hooks::{EvalReport, Hooks, StepReport, TracedValue, TrainSummary};
use hlo_engine::train::session::Session;
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::{gb, printable};

/// The progress bar, a log line every `log_every` steps, eval lines and
/// `--trace-values` lines.
pub struct Progress {
    pub bar: ProgressBar,
    pub log_every: i64,
}

impl Progress {
    /// A bar over the run's `steps`, at `step` (a resumed run's).
    pub fn new(steps: i64, step: i64, log_every: i64) -> Progress {
        let bar = ProgressBar::new(steps as u64);
        bar.set_position(step as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Progress { bar, log_every }
    }
}

impl Hooks for Progress {
    fn on_step(&mut self, r: &StepReport) -> hlo_engine::Result<()> {
        self.bar.set_position(r.step as u64);
        self.bar.set_message(format!(
            "loss {:.4}  {:.0} tokens/s  eta {}",
            r.loss,
            r.smoothed_tokens_per_s,
            duration(r.eta_s)
        ));
        if r.step % self.log_every == 0 || r.step == r.steps {
            // The window's average: one step's own figure jumps with the
            // machine's other work.
            let mfu = r.mfu.unwrap_or(f64::NAN) * r.smoothed_tokens_per_s / r.tokens_per_s;
            self.bar.suspend(|| {
                println!(
                    "step {:>5}/{} loss {:.4}{} lr {:.3e} grad_norm {:.4} tokens/s {:.0} mfu {:.2}%",
                    r.step,
                    r.steps,
                    r.loss,
                    pair_figures(&r.metrics),
                    r.lr,
                    r.grad_norm,
                    r.smoothed_tokens_per_s,
                    mfu * 100.0
                );
                // GRPO's sampled completions, with their rewards.
                for sample in &r.samples {
                    println!("  {sample}");
                }
            });
        }
        Ok(())
    }

    fn on_eval(&mut self, e: &EvalReport) -> hlo_engine::Result<()> {
        let r = &e.result;
        self.bar.suspend(|| {
            if r.metrics.is_empty() {
                println!(
                    "eval  {:>5}/{} eval_loss {:.4} perplexity {:.3} ({} tokens)",
                    e.step,
                    e.steps,
                    r.loss,
                    r.perplexity(),
                    r.tokens
                )
            } else {
                println!(
                    "eval  {:>5}/{} eval_loss {:.4}{}",
                    e.step,
                    e.steps,
                    r.loss,
                    pair_figures(&r.metrics)
                )
            }
        });
        self.bar.set_message(format!("eval_loss {:.4}", r.loss));
        Ok(())
    }

    fn on_traced_value(&mut self, v: &TracedValue) {
        self.bar.suspend(|| {
            println!(
                "trace {:<48} {:<20} {:<18} min {:+.4e} max {:+.4e} mean {:+.4e} non-finite {}",
                v.scope, v.op, v.ty, v.min, v.max, v.mean, v.non_finite
            )
        });
    }

    fn on_save(&mut self, saved: &StateTransfer) -> hlo_engine::Result<()> {
        self.bar.suspend(|| println!("{}", saved_line(saved)));
        Ok(())
    }

    fn on_end(&mut self, _summary: &TrainSummary) -> hlo_engine::Result<()> {
        self.bar.finish_and_clear();
        Ok(())
    }
}

/// `saved step 40 to out/: train_state 1.30 GB in 2.10 s (0.62 GB/s), HF weights 0.40 s`.
pub fn saved_line(s: &StateTransfer) -> String {
    let after = match s.model {
        Some((what, seconds)) => format!(", {what} {seconds:.2} s"),
        None => String::new(),
    };
    format!(
        "saved step {} to {}: train_state {} in {:.2} s ({:.2} GB/s){after}",
        s.step,
        s.dir.display(),
        gb(s.bytes),
        s.seconds,
        s.gb_per_s(),
    )
}

/// `resumed step 40 from out/: train_state 1.30 GB read and placed in 1.20 s (1.08 GB/s)`.
pub fn resumed_line(s: &StateTransfer) -> String {
    format!(
        "resumed step {} from {}: train_state {} read and placed in {:.2} s ({:.2} GB/s)",
        s.step,
        s.dir.display(),
        gb(s.bytes),
        s.seconds,
        s.gb_per_s()
    )
}

/// An objective's step figures for a log line (nothing for SFT): a
/// preference objective's reward accuracy and margin, and the share of
/// pairs whose chosen side the policy finds likelier (` accuracy 0.75
/// margin 0.0312 prefers chosen 0.81`); a rollout objective's reward;
/// else its [`HEADLINE`] figures.
fn pair_figures(metrics: &[(String, f64)]) -> String {
    let get = |name: &str| metrics.iter().find(|(n, _)| n == name).map(|m| m.1);
    match (
        get("rewards/accuracies"),
        get("rewards/margins"),
        get("logps/accuracies"),
    ) {
        (Some(a), Some(m), Some(p)) => {
            format!(" accuracy {a:.2} margin {m:.4} prefers chosen {p:.2}")
        }
        _ => match (get("reward"), get("rollout/tokens_per_s")) {
            // GRPO: the rollouts' mean reward, and how fast they came.
            (Some(r), Some(t)) => format!(" reward {r:.4} rollout tokens/s {t:.0}"),
            (Some(r), None) => format!(" reward {r:.4}"),
            // KTO's and a reward model's own figures, as TRL logs them.
            _ => HEADLINE
                .iter()
                .filter_map(|&name| get(name).map(|v| format!(" {name} {v:.4}")))
                .collect(),
        },
    }
}

/// The figures of an objective's step that its log line shows when it
/// computes them (TRL's names): KTO's KL estimate and rewards, a reward
/// model's accuracy and margin.
const HEADLINE: [&str; 6] = [
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "accuracy",
    "margin",
];

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

/// The modules an adapter trains, as the model has them: a target no
/// layer has (a sparse layer's `gate_proj`) is not named; the experts'
/// fused tensors are (`experts.gate_up_proj`); modules found in only some
/// layers say in how many.
///
/// For example `q_proj,v_proj; experts.gate_up_proj (2 of 3 layers)`.
fn trained_modules(
    config: &hlo_engine::models::decoder::ModelConfig,
    lora: &hlo_engine::models::decoder::LoraConfig,
) -> String {
    let layers = config.num_hidden_layers;
    // Each module, in order of first appearance, with its layer count.
    let mut modules: Vec<(String, i64)> = Vec::new();
    for (name, _) in hlo_engine::models::decoder::lora_parameter_types(config, lora) {
        let Some(rest) = name.strip_suffix(".lora_a") else {
            continue;
        };
        // model.layers.L.GROUP.MODULE: the module, past its group.
        let module = rest.splitn(5, '.').nth(4).unwrap_or(rest).to_string();
        match modules.iter_mut().find(|(m, _)| *m == module) {
            Some((_, n)) => *n += 1,
            None => modules.push((module, 1)),
        }
    }
    if modules.is_empty() {
        return "no module of this model (none of the targets is in it)".into();
    }
    // Consecutive modules of the same layer count, together.
    let mut groups: Vec<(Vec<&str>, i64)> = Vec::new();
    for (m, n) in &modules {
        match groups.last_mut() {
            Some((names, k)) if k == n => names.push(m),
            _ => groups.push((vec![m], *n)),
        }
    }
    groups
        .iter()
        .map(|(names, n)| {
            let which = if *n == layers {
                String::new()
            } else {
                format!(" ({n} of {layers} layers)")
            };
            format!("{}{which}", names.join(","))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The run's header: model, devices, what is trained, the data and how
/// many epochs the steps make, in each objective's terms.
pub fn print_header(run: &Run) -> Result<()> {
    let session = run.session();
    let c = session.config();
    let model = session.model();
    let on = format!(
        "training {} ({} parameters, {}) on {} ({}): {}",
        model.name,
        model.config.parameter_count(),
        c.dtype,
        session.backend().mesh(),
        session.backend().describe()?,
        trained(c.lora.as_ref(), &model.config)
    );
    let compiled = match session.mode() {
        Mode::Jit => format!("compiled in {:.2}s", session.compile_s()),
        Mode::Eager => "eager (each op compiles when it first runs)".to_string(),
    };
    match run.spec().objective.data() {
        Data::Rollouts => print_rollouts_header(run, &on, &compiled),
        Data::Samples | Data::Pairs | Data::Unpaired => print_rows_header(run, &on, &compiled),
    }
    Ok(())
}

/// What a run trains: its LoRA adapter (and modules saved whole), or
/// every weight.
fn trained(lora: Option<&LoraConfig>, config: &ModelConfig) -> String {
    let Some(l) = lora else {
        return "every weight (full finetuning)".to_string();
    };
    let whole = match l.modules_to_save.is_empty() {
        true => String::new(),
        false => format!(", training {} whole", l.modules_to_save.join(",")),
    };
    format!(
        "LoRA r={} alpha={}{} on {}{whole}",
        l.rank,
        l.alpha,
        if l.use_rslora { " (rsLoRA)" } else { "" },
        trained_modules(config, l)
    )
}

/// The header of a run over rows of a dataset (SFT's samples, a
/// preference objective's pairs).
fn print_rows_header(run: &Run, on: &str, compiled: &str) {
    let session = run.session();
    let c = session.config();
    let stats = run.data_stats();
    let accum = match c.grad_accum > 1 {
        true => format!(" × {} micro-batches", c.grad_accum),
        false => String::new(),
    };
    let vocab = session.model().config.vocab_size;
    // Said only when the step departs from the plain forms.
    let long = match (c.attention, c.loss_chunk_for(vocab)) {
        (AttentionKind::Naive, chunk) if chunk >= c.seq => String::new(),
        _ => format!("; {}", c.long_context_summary(vocab)),
    };
    let remaining = (run.spec().steps - session.steps_done()).max(0);
    // A preference step's rows are its pairs' two sides; `learning` counts
    // pairs.
    let (rows, samples) = match run.spec().objective.data() {
        Data::Pairs => (c.batch / 2, "pair sides"),
        Data::Unpaired => (c.batch / c.loss.step_loss().rows_per_example(), "examples"),
        Data::Samples | Data::Rollouts => (c.rows(), "samples"),
    };
    let batch = objective_words(run);
    let (fill, learning) = (run.unpacked_fill(), run.learning_samples());
    let epochs = hlo_engine::step::epochs(remaining, rows, c.seq, c.packing, fill, learning);
    println!("{on}; {batch} × seq {}{accum}{long}; {compiled}", c.seq);
    let cut = match stats.cut {
        0 => String::new(),
        n => format!("; {n} samples cut to --seq"),
    };
    let mut left_out = match stats.no_signal {
        0 => String::new(),
        n => format!("; {n} samples left out (no learned token within --seq)"),
    };
    // Unpaired examples come in whole batches of a fixed shape.
    let past = (stats.samples - stats.no_signal).saturating_sub(learning);
    if run.spec().objective.data() == Data::Unpaired && past > 0 {
        left_out += &format!(
            "; {past} examples past the last whole batch of {rows} left out (TRL trains a shorter last batch)"
        );
    }
    println!(
        "data: {} {samples}, {} tokens, {} learned within --seq {}{cut}{left_out}; {}{epochs:.2} epochs in {remaining} steps",
        stats.samples,
        stats.tokens,
        stats.learned,
        c.seq,
        if c.packing { "about " } else { "" },
    );
    if let Some(streams) = run.streams() {
        println!("data: a mixture drawn as {streams}");
    }
}

/// The objective's words and the step's batch in its units, e.g. `dpo
/// against the base (adapter off); batch 4 pairs (8 rows)`.
fn objective_words(run: &Run) -> String {
    let (spec, c) = (run.spec(), run.session().config());
    let def = spec.objective.def();
    let batch = def.batch_words(&spec.objectives, c.batch);
    match def.describe(&spec.objectives, &c.loss) {
        Some(d) => format!("{d}; batch {batch}"),
        None => format!("batch {batch}"),
    }
}

/// The header of a run over rollouts: the objective's loss settings,
/// groups, and the prompts or logged rollouts it draws.
fn print_rollouts_header(run: &Run, on: &str, compiled: &str) {
    let c = run.session().config();
    let Some(rollouts) = run.spec().objective.def().rollouts() else {
        return;
    };
    let spec = &rollouts.rollout_spec(&run.spec().objectives);
    let stats = run.data_stats();
    let groups = c.batch as usize / spec.num_generations();
    println!("{on}; {} × seq {}; {compiled}", objective_words(run), c.seq);
    let remaining = (run.spec().steps - run.session().steps_done()).max(0);
    let generations = remaining as usize / spec.num_iterations.max(1);
    match &spec.rollouts {
        Some(path) => println!(
            "data: {} logged rollouts ({} prompts) from {}; {:.2} epochs in {} steps",
            stats.samples,
            stats.samples / spec.num_generations(),
            path.display(),
            (generations * c.batch as usize) as f64 / stats.samples.max(1) as f64,
            remaining
        ),
        None => println!(
            "data: {} prompts; {} completions each, up to {} tokens, sampled at temperature {} by the policy being trained; {:.2} epochs in {} steps",
            stats.samples,
            spec.num_generations(),
            spec.max_completion_length,
            spec.temperature,
            (generations * groups) as f64 / stats.samples.max(1) as f64,
            remaining
        ),
    }
}

/// GRPO's mean reward of each step's rollouts, gathered for the run's
/// last lines (shared with the hook that gathers it).
#[derive(Clone, Default)]
pub struct RewardCourse(std::rc::Rc<std::cell::RefCell<Vec<f64>>>);

impl Hooks for RewardCourse {
    fn on_step(&mut self, r: &StepReport) -> hlo_engine::Result<()> {
        if let Some((_, v)) = r.metrics.iter().find(|(k, _)| k == "reward") {
            self.0.borrow_mut().push(*v);
        }
        Ok(())
    }
}

impl RewardCourse {
    /// The mean reward over the first and the last eighth of the steps
    /// (at most 50 each; a step's own reward is noisy), or None before
    /// any step.
    pub fn line(&self, last_step: i64) -> Option<String> {
        let rewards = self.0.borrow();
        let n = rewards.len();
        if n == 0 {
            return None;
        }
        let w = (n / 8).clamp(1, 50);
        let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
        let first_step = last_step - n as i64 + 1;
        Some(format!(
            "reward (the mean of a step's completions) {:.4} over steps {}..{} -> {:.4} over steps {}..{}",
            mean(&rewards[..w]),
            first_step,
            first_step + w as i64 - 1,
            mean(&rewards[n - w..]),
            last_step - w as i64 + 1,
            last_step
        ))
    }
}
