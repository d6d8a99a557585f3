//! `hlo-train train`: LoRA (default) or full finetuning, the whole step
//! (forward, backward, clipping, optimizer) compiled once as one SPMD
//! executable over the mesh, parameters and optimizer state donated and
//! updated in place.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_ir::{DType, Literal, TensorType};
use hlo_models::adapter::Adapter;
use hlo_models::chat::ChatTemplate;
use hlo_models::data::{demo_examples, eval_batches, read_jsonl, ChatData, Loader};
use hlo_models::io::{read_safetensors, write_atomic, write_safetensors};
use hlo_models::llama::{is_stacked, stack_literals, unstack_literal, unstacked_names, LoraConfig};
use hlo_models::train::{eval_step, step_flops, train_step};
use hlo_partitioner::{llama_rules, FunctionShardings, Mesh};
use hlo_runtime::{DeviceArray, Eager, HostArray, PluginKind, ShardedFunction};
use serde_json::json;

use crate::common::PluginArgs;
use crate::generate::{Generator, Sampling};
use crate::model_args::{Model, ModelArgs};
use crate::step_args::leading_axis;
use crate::step_args::StepArgs;

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub plugin: PluginArgs,

    #[command(flatten)]
    pub step: StepArgs,

    /// Device mesh; its product is the device count (default dp=1,fsdp=N,mp=1).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// Compile the whole step as one executable (the default).
    #[arg(long, conflicts_with = "eager")]
    pub jit: bool,

    /// Run the step op by op: each node a small cached executable, values
    /// freed after their last use (for debugging and inspection).
    #[arg(long)]
    pub eager: bool,

    /// With --eager: print shape, dtype, min/max/mean and non-finite count
    /// of every value made in scopes matching this regex (first step only).
    #[arg(long, requires = "eager")]
    pub trace_values: Option<String>,

    /// Start LoRA from this PEFT adapter folder.
    #[arg(long, conflicts_with = "full")]
    pub init_adapter: Option<PathBuf>,

    /// JSONL training data (default: the bundled demo task).
    #[arg(long)]
    pub data: Option<PathBuf>,

    /// The folder whose tokenizer_config.json holds the chat template for
    /// `{"messages"}` data (default: the checkpoint's).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,

    /// With `{"messages"}` data, count system and user turns in the loss
    /// too (by default only the assistant's replies are learned).
    #[arg(long)]
    pub train_on_inputs: bool,

    #[arg(long, default_value_t = 100)]
    pub steps: i64,

    /// Seed of data order, adapter init and random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Where the adapter (or HF weights with --full) and train_state/ go.
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// Also save every N steps (needs --out).
    #[arg(long, default_value_t = 0)]
    pub save_every: i64,

    /// Continue the run saved in this folder (same flags as the first run).
    #[arg(long)]
    pub resume: Option<PathBuf>,

    /// One JSON object per step.
    #[arg(long)]
    pub metrics: Option<PathBuf>,

    /// Write the compiled step as StableHLO and HLO text here.
    #[arg(long)]
    pub dump_hlo: Option<PathBuf>,

    /// Held-out JSONL data (same formats as --data): its masked mean loss
    /// and perplexity are computed every --eval-every steps (the demo task
    /// holds out a fresh draw of itself).
    #[arg(long)]
    pub eval_data: Option<PathBuf>,

    /// Steps between evaluations (default: --log-every).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    pub eval_every: i64,

    /// Print a log line every N steps.
    #[arg(long, default_value_t = 10)]
    pub log_every: i64,

    /// The devices' peak TFLOP/s for MFU (default: a table by device kind;
    /// measured for CPUs).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
}

/// An adapter tensor by the step's name: stacked across layers for a
/// scan-over-layers step.
fn adapter_tensor(a: &Adapter, name: &str, layers: i64) -> Option<Literal> {
    if is_stacked(name) {
        let parts: Option<Vec<Literal>> = unstacked_names(name, layers)
            .iter()
            .map(|n| a.get(n).cloned())
            .collect();
        parts.map(|p| stack_literals(&p))
    } else {
        a.get(name).cloned()
    }
}

/// Stacked tensors split back into their layers' names.
fn unstack_all(tensors: Vec<(String, Literal)>) -> Vec<(String, Literal)> {
    tensors
        .into_iter()
        .flat_map(|(name, lit)| {
            if is_stacked(&name) {
                let parts = unstack_literal(&lit);
                unstacked_names(&name, parts.len() as i64)
                    .into_iter()
                    .zip(parts)
                    .collect::<Vec<_>>()
            } else {
                vec![(name, lit)]
            }
        })
        .collect()
}

/// Dense peak TFLOP/s of one device by kind, for MFU (datasheets).
pub(crate) fn peak_tflops(kind: &str, dtype: DType) -> Option<f64> {
    let bf16 = [
        ("H100", 989.0),
        ("H200", 989.0),
        ("MI300X", 1307.4),
        ("MI250", 362.1),
        ("A100", 312.0),
    ];
    let k = kind.to_uppercase();
    let v = bf16
        .iter()
        .find(|(name, _)| k.contains(name))
        .map(|(_, v)| *v)?;
    Some(if dtype == DType::F32 { v / 2.0 } else { v })
}

/// Measures a CPU device's f32 matmul TFLOP/s once (a 512³ product chain).
pub(crate) fn measure_cpu_peak(client: &hlo_runtime::Client) -> Result<f64> {
    // Large enough to reach the matmul kernels' steady rate; the best of a
    // few runs, so a busy moment does not inflate every MFU.
    let (n, chain) = (1024i64, 4);
    let t = TensorType::new(DType::F32, [n, n]);
    let f = hlo_ir::trace("peak", &[("a", t.clone()), ("b", t)], |i| {
        let mut x = i["a"];
        for _ in 0..chain {
            x = x.matmul(i["b"]);
        }
        vec![("x", x)]
    })?;
    let exe = hlo_runtime::CompiledFunction::new(client, &f)?;
    let a = HostArray::new(&[n, n], &vec![1e-3f32; (n * n) as usize])?;
    let args = [a.clone(), a];
    exe.run(&args)?;
    let mut best = f64::INFINITY;
    for _ in 0..4 {
        let t0 = Instant::now();
        exe.run(&args)?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(chain as f64 * 2.0 * (n * n * n) as f64 / best / 1e12)
}

fn validate(args: &TrainArgs) -> Result<()> {
    if !(args.step.lr.is_finite() && args.step.lr > 0.0) {
        bail!("--lr must be positive, got {}", args.step.lr);
    }
    if args.step.seq < 2 {
        bail!("--seq must be at least 2, got {}", args.step.seq);
    }
    if args.step.batch < 1 || args.steps < 1 {
        bail!("--batch and --steps must be at least 1");
    }
    if args.save_every < 0 {
        bail!("--save-every must not be negative");
    }
    if args.save_every > 0 && args.out.is_none() {
        bail!("--save-every needs --out");
    }
    if args.log_every < 1 {
        bail!("--log-every must be at least 1");
    }
    Ok(())
}

/// What `train_state/state.json` records. `packed` is whether rows are
/// packed (after `--packing auto` is resolved): the data cursor counts
/// samples either way, but the rows they make differ.
fn state_json(args: &TrainArgs, packed: bool, step: i64, cursor: u64) -> serde_json::Value {
    json!({
        "version": 1,
        "step": step,
        "data_cursor": cursor,
        "seed": args.seed,
        "batch": args.step.batch,
        "grad_accum": args.step.grad_accum,
        "packed": packed,
        "seq": args.step.seq,
        "full": args.step.full,
        "lora_rank": args.step.lora_rank,
        "optimizer": format!("{:?}", args.step.optimizer).to_lowercase(),
    })
}

/// The compiled eval step, where its inputs are among the train step's,
/// the held-out batches, and the batch layout.
type EvalStep = (
    ShardedFunction,
    Vec<usize>,
    Vec<hlo_models::data::Batch>,
    hlo_partitioner::PartitionSpec,
);

/// A batch on the devices, ready for the next step.
struct Prepared {
    ids: DeviceArray,
    loss_mask: DeviceArray,
    /// (input index, array) of the packing inputs, when packing.
    packing: Vec<(usize, DeviceArray)>,
    /// Real tokens over slots.
    fill: f64,
    targets: usize,
    /// The loader's position after this batch (what a checkpoint records).
    cursor: u64,
}

/// A launched step whose figures are read once the next step is launched.
struct Pending {
    step: i64,
    loss: DeviceArray,
    grad_norm: DeviceArray,
    lr: DeviceArray,
    targets: usize,
    launched: Instant,
}

/// Writes the run's state into `out`: the adapter (PEFT) or HF weights, and
/// `train_state/` (built under a temporary name, then swapped in whole).
#[allow(clippy::too_many_arguments)]
fn save(
    out: &Path,
    args: &TrainArgs,
    model: &Model,
    lora: Option<&LoraConfig>,
    names: &[String],
    arrays: &[&DeviceArray],
    packed: bool,
    step: i64,
    cursor: u64,
) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let tensors: Vec<(String, Literal)> = names
        .iter()
        .zip(arrays)
        .map(|(n, a)| Ok((n.clone(), Literal::from(a.gather()?))))
        .collect::<Result<_>>()?;
    let trainable: Vec<(String, Literal)> = unstack_all(
        tensors
            .iter()
            .filter(|(n, _)| !n.starts_with("opt.") && n != "step")
            .cloned()
            .collect(),
    );
    match lora {
        Some(l) => Adapter {
            lora: l.clone(),
            tensors: trainable,
        }
        .save(out, Some(&model.name))?,
        None => {
            write_safetensors(&out.join("model.safetensors"), &trainable)?;
            write_atomic(&out.join("config.json"), model.config.to_json().as_bytes())?;
        }
    }
    let fresh = out.join("train_state.new");
    let _ = std::fs::remove_dir_all(&fresh);
    std::fs::create_dir_all(&fresh)?;
    write_safetensors(&fresh.join("state.safetensors"), &tensors)?;
    write_atomic(
        &fresh.join("state.json"),
        serde_json::to_string_pretty(&state_json(args, packed, step, cursor))?.as_bytes(),
    )?;
    let current = out.join("train_state");
    let old = out.join("train_state.old");
    if current.exists() {
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&current, &old)?;
    }
    std::fs::rename(&fresh, &current)?;
    // The renames are durable once the folder itself is synced.
    std::fs::File::open(out)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot sync {}", out.display()))?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

/// A saved run: its step, data cursor and tensors.
struct Saved {
    step: i64,
    cursor: u64,
    tensors: Vec<(String, Literal)>,
}

/// Reads `train_state/` (or the `.old` copy a crash mid-swap left behind).
fn load_state(dir: &Path, args: &TrainArgs, packed: bool) -> Result<Saved> {
    let state = [dir.join("train_state"), dir.join("train_state.old")]
        .into_iter()
        .find(|d| d.join("state.json").is_file())
        .with_context(|| format!("{} has no train_state/ to resume from", dir.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(state.join("state.json"))?)
            .with_context(|| format!("{}/state.json is not JSON", state.display()))?;
    let want = state_json(args, packed, 0, 0);
    let mut v = v;
    // Saved before accumulation and packing existed: neither was used.
    if v.get("grad_accum").is_none() {
        v["grad_accum"] = 1.into();
    }
    if v.get("packed").is_none() {
        v["packed"] = false.into();
    }
    for key in [
        "seed",
        "batch",
        "grad_accum",
        "packed",
        "seq",
        "full",
        "lora_rank",
        "optimizer",
    ] {
        if v[key] != want[key] {
            bail!(
                "--resume: the run was saved with {key} = {}, this run has {}",
                v[key],
                want[key]
            );
        }
    }
    let step = v["step"].as_i64().context("state.json has no step")?;
    let cursor = v["data_cursor"]
        .as_u64()
        .context("state.json has no data_cursor")?;
    Ok(Saved {
        step,
        cursor,
        tensors: read_safetensors(&state.join("state.safetensors"))?,
    })
}

pub fn run(args: &TrainArgs) -> Result<()> {
    validate(args)?;
    let model = args.model.open()?;
    model.check_weights()?;
    let config = &model.config;
    let tokenizer = args.model.tokenizer(&model)?;
    let eos = config.eos_token_ids.first().map(|&e| e as u32);
    let demo = args.data.is_none();
    // `{"messages"}` lines use the model's chat template: --chat-template,
    // or the checkpoint's tokenizer_config.json when it has one.
    let template = match (&args.chat_template, &model.checkpoint) {
        (Some(dir), _) => Some(ChatTemplate::from_dir(dir)?),
        (None, Some(c)) => ChatTemplate::from_dir(&c.dir).ok(),
        (None, None) => None,
    };
    let chat = template.as_ref().map(|template| ChatData {
        template,
        stop: config.eos_token_ids.iter().map(|&e| e as u32).collect(),
        train_on_inputs: args.train_on_inputs,
    });
    let examples = match &args.data {
        Some(path) => read_jsonl(
            path,
            tokenizer.as_ref(),
            eos,
            config.vocab_size,
            chat.as_ref(),
        )?,
        None => {
            let t = tokenizer
                .as_ref()
                .context("the demo data needs a tokenizer: pass --data or --tokenizer")?;
            demo_examples(t, eos, 2000, args.seed)
        }
    };
    // A step takes --grad-accum micro-batches of --batch rows.
    let rows = args.step.batch * args.step.grad_accum;
    let mut loader = Loader::new(examples, args.step.seq as usize, rows as usize, args.seed);

    // Mesh and devices.
    let devices = args.plugin.devices.map(i64::from);
    let mesh = match &args.mesh {
        Some(m) => m.clone(),
        None => format!("dp=1,fsdp={},mp=1", devices.unwrap_or(1)).parse()?,
    };
    let (client, devices) = args.plugin.client_for(&mesh)?;
    let cpu = args.plugin.plugin.kind() == PluginKind::Cpu;
    let dtype = args.model.dtype(cpu);

    // The step.
    let init_lora = match &args.init_adapter {
        Some(dir) => Some(Adapter::load(dir, config)?.lora),
        None => None,
    };
    let mut tc = args
        .step
        .train_config(config, dtype, &mesh, args.steps, init_lora)?;
    // Packing: on request, or (auto) when samples fill at most half a row.
    let unpacked_fill = loader.mean_len().min(args.step.seq as f64) / args.step.seq as f64;
    if args.step.packing == crate::step_args::Toggle::Auto {
        tc.packing = unpacked_fill <= 0.5;
    }
    loader = loader.packed(tc.packing);
    let lora = tc.lora.clone();
    let step_fn = train_step(config, &tc)?;
    // What is run, JIT or eager: folded, CSE'd, dead code removed.
    let simplified = hlo_ir::simplify(&step_fn.function);
    let f = &simplified;
    let shardings =
        FunctionShardings::from_rules_stacked(f, &mesh, &llama_rules(), &leading_axis(&tc))?;
    let trace_values = match &args.trace_values {
        Some(r) => Some(
            regex::Regex::new(r).with_context(|| format!("--trace-values `{r}` is not a regex"))?,
        ),
        None => None,
    };
    let t0 = Instant::now();
    let (exe, mut eager) = if args.eager {
        (
            None,
            Some(Eager::new(&client, mesh.clone(), devices.clone())?),
        )
    } else {
        (
            Some(ShardedFunction::with_donation(
                &client,
                f,
                shardings.clone(),
                &step_fn.donated,
            )?),
            None,
        )
    };
    // The held-out set and its compiled eval step (JIT even when training
    // eagerly): `--eval-data`, or for the demo task a fresh draw of it.
    let eval_examples = match (&args.eval_data, demo) {
        (Some(path), _) => Some(read_jsonl(
            path,
            tokenizer.as_ref(),
            eos,
            config.vocab_size,
            chat.as_ref(),
        )?),
        (None, true) => tokenizer
            .as_ref()
            .map(|t| demo_examples(t, eos, 256, args.seed.wrapping_add(1))),
        (None, false) => None,
    };
    let eval = match eval_examples {
        Some(examples) => {
            let batches = eval_batches(&examples, args.step.seq as usize, args.step.batch as usize);
            let ef = hlo_ir::simplify(&eval_step(config, &tc)?);
            let es =
                FunctionShardings::from_rules_stacked(&ef, &mesh, &llama_rules(), &is_stacked)?;
            let ids_in = ef.inputs.iter().position(|b| b.name == "input_ids");
            let batch_spec = es.inputs[ids_in.expect("the eval step takes input_ids")].clone();
            let exe = ShardedFunction::new(&client, &ef, es)?;
            // Where each eval input is among the train step's inputs.
            let at: Vec<usize> = ef
                .inputs
                .iter()
                .map(|b| {
                    f.inputs
                        .iter()
                        .position(|t| t.name == b.name)
                        .expect("a step input")
                })
                .collect();
            Some((exe, at, batches, batch_spec))
        }
        None => None,
    };
    let eval_every = if args.eval_every > 0 {
        args.eval_every
    } else {
        args.log_every
    };
    let compile_s = t0.elapsed().as_secs_f64();
    if let Some(dir) = &args.dump_hlo {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        write_atomic(
            &dir.join("train_step.stablehlo.mlir"),
            hlo_lowering::to_stablehlo_with(f, Some(&shardings), &step_fn.donated).as_bytes(),
        )?;
        write_atomic(
            &dir.join("train_step.hlo.txt"),
            hlo_lowering::to_hlo_text_sharded(f, &shardings).as_bytes(),
        )?;
    }
    let place = |k: usize, lit: Literal| -> Result<DeviceArray> {
        Ok(DeviceArray::shard(
            &client,
            &HostArray::from(lit),
            &hlo_partitioner::Sharding::new(mesh.clone(), shardings.inputs[k].clone()),
            &devices,
        )?)
    };

    // State: every input but the batch.
    let (mut step, resumed) = match &args.resume {
        Some(dir) => {
            let saved = load_state(dir, args, tc.packing)?;
            loader.cursor = saved.cursor;
            (saved.step, Some(saved.tensors))
        }
        None => (0, None),
    };
    let init_adapter = match (&lora, &args.init_adapter) {
        (Some(l), Some(dir)) => Some(Adapter {
            lora: l.clone(),
            tensors: Adapter::load(dir, config)?.tensors,
        }),
        (Some(l), None) => Some(Adapter::init(config, l, args.seed)),
        _ => None,
    };
    // The value of every input but the batch; random weights are made on
    // all cores, a chunk of tensors at a time (bounded host memory).
    let make = |b: &hlo_ir::Binding| -> Result<Option<Literal>> {
        let ty = f.ty(b.value).clone();
        let from_resume = resumed
            .as_ref()
            .and_then(|t| t.iter().find(|(n, _)| n == &b.name))
            .map(|(_, l)| l.clone());
        Ok(Some(if hlo_models::train::is_batch_input(&b.name) {
            return Ok(None);
        } else if let Some(l) = from_resume {
            if l.ty != ty {
                bail!(
                    "--resume: `{}` is saved as {}, the step needs {ty}",
                    b.name,
                    l.ty
                );
            }
            l
        } else if resumed.is_some()
            && (step_fn.trainable.contains(&b.name) || b.name.starts_with("opt."))
        {
            bail!("--resume: the saved state has no `{}`", b.name);
        } else if b.name == "step" {
            Literal::scalar(DType::I32, step as f64)
        } else if b.name.starts_with("opt.") {
            Literal::splat(ty, 0.0)
        } else if let Some(l) = init_adapter
            .as_ref()
            .and_then(|a| adapter_tensor(a, &b.name, config.num_hidden_layers))
        {
            l
        } else {
            model.weight(&b.name, dtype, args.seed)?
        }))
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let order: Vec<usize> = (0..f.inputs.len()).collect();
    let mut state: Vec<Option<DeviceArray>> = Vec::with_capacity(f.inputs.len());
    for chunk in order.chunks(threads) {
        let values: Vec<Result<Option<Literal>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&k| scope.spawn(move || make(&f.inputs[k])))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("making a weight failed")))
                })
                .collect()
        });
        for (&k, value) in chunk.iter().zip(values) {
            state.push(match value? {
                Some(lit) => Some(place(k, lit)?),
                None => None,
            });
        }
    }
    let index = |name: &str| {
        f.inputs
            .iter()
            .position(|b| b.name == name)
            .expect("a step input")
    };
    let (ids_at, mask_at) = (index("input_ids"), index("loss_mask"));
    let packing_at: Vec<usize> = if tc.packing {
        hlo_models::train::BATCH_PACKING
            .iter()
            .map(|n| index(n))
            .collect()
    } else {
        Vec::new()
    };

    // Demo: a generation before training.
    let demo_prompts = ["cat=", "hello=", "rust="];
    let demo_show = |label: &str, adapter: Option<&Adapter>| -> Result<()> {
        let t = tokenizer.as_ref().expect("the demo has a tokenizer");
        let generator = Generator::new(&client, config, dtype, adapter, false, |n| {
            model.weight(n, dtype, args.seed)
        })?;
        let stop: Vec<u32> = eos.into_iter().collect();
        let prompts: Vec<Vec<u32>> = demo_prompts
            .iter()
            .map(|p| t.encode(p, true))
            .collect::<Result<_, _>>()?;
        let outs = generator.complete_batch(&prompts, 8, &Sampling::default(), &stop)?;
        let shown: Vec<String> = demo_prompts
            .iter()
            .zip(&outs)
            .map(|(p, out)| Ok(format!("{p}{}", t.decode(out)?)))
            .collect::<Result<_>>()?;
        println!("{label}: {}", shown.join("  "));
        Ok(())
    };
    if demo && !args.step.full {
        demo_show("before", init_adapter.as_ref())?;
    }

    let peak = match args.peak_tflops {
        Some(p) => p,
        None => match peak_tflops(&devices[0].kind()?, dtype) {
            Some(p) => p,
            None => measure_cpu_peak(&client)?,
        },
    } * 1e12
        * mesh.size() as f64;
    let flops = step_flops(config, &tc);
    let metrics = match &args.metrics {
        Some(p) => {
            if let Some(parent) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .with_context(|| format!("cannot create {}", parent.display()))?;
            }
            Some(
                std::fs::File::create(p)
                    .with_context(|| format!("cannot create {}", p.display()))?,
            )
        }
        None => None,
    };
    let metrics = std::cell::RefCell::new(metrics);
    println!(
        "training {} ({} parameters, {}) on {} {}: {} step, batch {} × seq {}, {} trainable tensors; compiled in {compile_s:.2}s",
        model.name,
        config.parameter_count(),
        dtype,
        mesh,
        client.platform_name()?,
        if args.step.full { "full" } else { "LoRA" },
        args.step.batch,
        args.step.seq,
        step_fn.trainable.len()
    );
    let bar = indicatif::ProgressBar::new(args.steps as u64);
    bar.set_position(step as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let start_step = step;
    let mut first_loss = None;
    let mut last_loss = f64::NAN;
    // What a checkpoint holds: the trained parameters, optimizer state, step.
    let saved: Vec<(String, usize)> = f
        .inputs
        .iter()
        .enumerate()
        .filter(|(_, b)| {
            step_fn.trainable.contains(&b.name) || b.name.starts_with("opt.") || b.name == "step"
        })
        .map(|(k, b)| (b.name.clone(), k))
        .collect();
    let saved_names: Vec<String> = saved.iter().map(|(n, _)| n.clone()).collect();
    // The next batch is drawn and sent to the devices while the current
    // step runs, and a step's loss is fetched only after the next step is
    // launched, so the host never holds the devices up.
    let prepare = |loader: &mut hlo_models::data::Loader| -> Result<Prepared> {
        let batch = loader.next_batch();
        let dims = if args.step.grad_accum > 1 {
            vec![args.step.grad_accum, args.step.batch, args.step.seq]
        } else {
            vec![args.step.batch, args.step.seq]
        };
        let packing = packing_at
            .iter()
            .zip([&batch.positions, &batch.segment_ids])
            .map(|(&k, v)| Ok((k, place(k, Literal::from(HostArray::new(&dims, v)?))?)))
            .collect::<Result<_>>()?;
        Ok(Prepared {
            ids: place(ids_at, Literal::from(HostArray::new(&dims, &batch.ids)?))?,
            loss_mask: place(
                mask_at,
                Literal::from(HostArray::new(&dims, &batch.loss_mask)?),
            )?,
            packing,
            fill: batch.fill(),
            targets: batch.targets,
            cursor: loader.cursor,
        })
    };
    let output_at = |name: &str| {
        f.outputs
            .iter()
            .position(|b| b.name == name)
            .expect("a step output")
    };
    let (loss_at, grad_norm_at, lr_at) =
        (output_at("loss"), output_at("grad_norm"), output_at("lr"));
    let mut next = if step < args.steps {
        Some(prepare(&mut loader)?)
    } else {
        None
    };
    let mut pending: Option<Pending> = None;
    let mut last_ready = Instant::now();
    // Reads a finished step's figures, logs them, and stops the run on a
    // non-finite loss.
    let report = |p: Pending, last_ready: &mut Instant| -> Result<f64> {
        let scalar = |a: &DeviceArray| -> Result<f64> { Ok(a.gather()?.to_f64_vec()[0]) };
        let (loss, grad_norm, lr) = (scalar(&p.loss)?, scalar(&p.grad_norm)?, scalar(&p.lr)?);
        let now = Instant::now();
        let dt = now
            .duration_since((*last_ready).max(p.launched))
            .as_secs_f64();
        *last_ready = now;
        if !loss.is_finite() || !grad_norm.is_finite() {
            bar.abandon();
            bail!(
                "step {}: the loss is {loss} and the gradient norm {grad_norm}; stopped{}",
                p.step,
                if args.out.is_some() {
                    " (the last saved checkpoint is kept)"
                } else {
                    ""
                }
            );
        }
        let tokens_per_s = (rows * args.step.seq) as f64 / dt;
        let mfu = flops / dt / peak;
        bar.set_position(p.step as u64);
        bar.set_message(format!("loss {loss:.4} tok/s {tokens_per_s:.0}"));
        if let Some(m) = metrics.borrow_mut().as_mut() {
            let line = json!({"step": p.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s, "step_time_s": dt, "mfu": mfu, "targets": p.targets});
            writeln!(m, "{line}")?;
        }
        if p.step % args.log_every == 0 || p.step == args.steps {
            bar.suspend(|| {
                println!("step {:>5}/{} loss {loss:.4} lr {lr:.3e} grad_norm {grad_norm:.4} tokens/s {tokens_per_s:.0} mfu {:.2}%", p.step, args.steps, mfu * 100.0)
            });
        }
        Ok(loss)
    };
    // The held-out loss of the weights in `state` after `step` steps: logged,
    // and written to the metrics file.
    let evaluate = |(exe, at, batches, spec): &EvalStep,
                    state: &[Option<DeviceArray>],
                    step: i64|
     -> Result<()> {
        let (mut sum, mut tokens) = (0.0f64, 0.0f64);
        let sharding = hlo_partitioner::Sharding::new(mesh.clone(), spec.clone());
        for b in batches {
            let dims = [args.step.batch, args.step.seq];
            let ids = DeviceArray::shard(
                &client,
                &HostArray::new(&dims, &b.ids)?,
                &sharding,
                &devices,
            )?;
            let mask = DeviceArray::shard(
                &client,
                &HostArray::new(&dims, &b.loss_mask)?,
                &sharding,
                &devices,
            )?;
            let put = |v: &[i32]| -> Result<DeviceArray> {
                Ok(DeviceArray::shard(
                    &client,
                    &HostArray::new(&dims, v)?,
                    &sharding,
                    &devices,
                )?)
            };
            let packing: Vec<(usize, DeviceArray)> = packing_at
                .iter()
                .zip([&b.positions, &b.segment_ids])
                .map(|(&k, v)| Ok((k, put(v)?)))
                .collect::<Result<_>>()?;
            let inputs: Vec<&DeviceArray> = at
                .iter()
                .map(|&k| match k {
                    k if k == ids_at => &ids,
                    k if k == mask_at => &mask,
                    k => match packing.iter().find(|(j, _)| *j == k) {
                        Some((_, a)) => a,
                        None => state[k].as_ref().expect("every input is set"),
                    },
                })
                .collect();
            let out = exe.run(&inputs)?;
            sum += out[0].gather()?.to_f64_vec()[0];
            tokens += out[1].gather()?.to_f64_vec()[0];
        }
        let eval_loss = sum / tokens.max(1.0);
        bar.suspend(|| {
            println!(
                "eval  {step:>5}/{} eval_loss {eval_loss:.4} perplexity {:.3} ({tokens} tokens)",
                args.steps,
                eval_loss.exp()
            )
        });
        bar.set_message(format!("eval_loss {eval_loss:.4}"));
        if let Some(m) = metrics.borrow_mut().as_mut() {
            let line = json!({"step": step, "eval_loss": eval_loss, "eval_perplexity": eval_loss.exp(), "eval_tokens": tokens});
            writeln!(m, "{line}")?;
        }
        Ok(())
    };
    // The starting point, as a baseline.
    if let Some(e) = &eval {
        evaluate(e, &state, step)?;
    }
    // SIGINT/SIGTERM: finish the step, save, stop; a second one stops at once.
    static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let _ = ctrlc::set_handler(|| {
        if STOP.swap(true, std::sync::atomic::Ordering::SeqCst) {
            std::process::exit(130);
        }
    });
    let mut interrupted = false;
    let (mut fill_sum, mut fills) = (0.0f64, 0usize);
    while step < args.steps {
        let batch = next.take().expect("a prepared batch");
        let launched = Instant::now();
        state[ids_at] = Some(batch.ids);
        state[mask_at] = Some(batch.loss_mask);
        for (k, a) in batch.packing {
            state[k] = Some(a);
        }
        fill_sum += batch.fill;
        fills += 1;
        let inputs: Vec<&DeviceArray> = state
            .iter()
            .map(|a| a.as_ref().expect("every input is set"))
            .collect();
        let outputs = match (&exe, eager.as_mut()) {
            (Some(exe), _) => exe.run(&inputs)?,
            (None, Some(eager)) => {
                let first = step == start_step;
                // With --trace-values, every step also watches the matching
                // nodes for the first one whose value is not finite.
                let mut first_bad: Option<String> = None;
                let mut show = |node: &hlo_ir::Node,
                                values: &[&DeviceArray]|
                 -> Result<(), hlo_runtime::Error> {
                    if let Some(re) = trace_values.as_ref() {
                        if re.is_match(&node.scope) {
                            for v in values {
                                let x = v.gather()?.to_f64_vec();
                                let finite: Vec<f64> =
                                    x.iter().copied().filter(|v| v.is_finite()).collect();
                                // Constants may be infinite on purpose (a max's identity).
                                let made = node.op.name() != "constant";
                                if made && finite.len() < x.len() && first_bad.is_none() {
                                    first_bad = Some(format!(
                                        "`{}` in scope `{}` ({} of {} values)",
                                        node.op.name(),
                                        node.scope,
                                        x.len() - finite.len(),
                                        x.len()
                                    ));
                                }
                                if !first {
                                    continue;
                                }
                                let (lo, hi) = finite
                                    .iter()
                                    .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
                                        (a.min(v), b.max(v))
                                    });
                                let mean = finite.iter().sum::<f64>() / finite.len().max(1) as f64;
                                println!(
                                    "trace {:<48} {:<20} {:<18} min {lo:+.4e} max {hi:+.4e} mean {mean:+.4e} non-finite {}",
                                    node.scope,
                                    node.op.name(),
                                    v.ty().to_string(),
                                    x.len() - finite.len()
                                );
                            }
                        }
                    }
                    Ok(())
                };
                let outputs = eager.run(f, &inputs, &shardings.outputs, Some(&mut show))?;
                if let Some(bad) = first_bad {
                    bar.abandon();
                    bail!(
                        "step {}: the first non-finite value comes from {bad}; stopped{}",
                        step + 1,
                        if args.out.is_some() {
                            " (the last saved checkpoint is kept)"
                        } else {
                            ""
                        }
                    );
                }
                outputs
            }
            _ => unreachable!("one of JIT or eager"),
        };
        let mut outputs: Vec<Option<DeviceArray>> = outputs.into_iter().map(Some).collect();
        let mut take = |k: usize| outputs[k].take().expect("each output is taken once");
        let this = Pending {
            step: step + 1,
            loss: take(loss_at),
            grad_norm: take(grad_norm_at),
            lr: take(lr_at),
            targets: batch.targets,
            launched,
        };
        // Donated inputs were consumed: the outputs take their places.
        for &(input, output) in &step_fn.donated {
            state[input] = outputs[output].take();
        }
        step += 1;
        if step < args.steps {
            next = Some(prepare(&mut loader)?);
        }
        if let Some(p) = pending.replace(this) {
            let loss = report(p, &mut last_ready)?;
            first_loss.get_or_insert(loss);
            last_loss = loss;
        }
        interrupted = STOP.load(std::sync::atomic::Ordering::SeqCst) && step < args.steps;
        let saving = args.out.is_some()
            && (interrupted
                || (args.save_every > 0 && step % args.save_every == 0 && step < args.steps));
        if saving {
            // A checkpoint is written only after its step's loss is known finite.
            if let Some(p) = pending.take() {
                let loss = report(p, &mut last_ready)?;
                first_loss.get_or_insert(loss);
                last_loss = loss;
            }
        }
        if let (Some(e), true) = (&eval, step % eval_every == 0 || step == args.steps) {
            // The step's own figures first, then the held-out loss of the
            // weights it produced.
            if let Some(p) = pending.take() {
                let loss = report(p, &mut last_ready)?;
                first_loss.get_or_insert(loss);
                last_loss = loss;
            }
            evaluate(e, &state, step)?;
        }
        if let (Some(out), true) = (&args.out, saving) {
            let arrays: Vec<&DeviceArray> = saved
                .iter()
                .map(|(_, k)| state[*k].as_ref().expect("set"))
                .collect();
            save(
                out,
                args,
                &model,
                lora.as_ref(),
                &saved_names,
                &arrays,
                tc.packing,
                step,
                batch.cursor,
            )?;
        }
        if interrupted {
            break;
        }
    }
    if let Some(p) = pending.take() {
        let loss = report(p, &mut last_ready)?;
        first_loss.get_or_insert(loss);
        last_loss = loss;
    }
    bar.finish_and_clear();
    if interrupted {
        match &args.out {
            Some(out) => println!(
                "stopped by a signal after step {step}; saved to {} (continue with --resume {})",
                out.display(),
                out.display()
            ),
            None => println!("stopped by a signal after step {step} (nothing saved: no --out)"),
        }
        return Ok(());
    }
    let kept: Vec<&DeviceArray> = saved
        .iter()
        .map(|(_, k)| state[*k].as_ref().expect("set"))
        .collect();
    if let Some(out) = &args.out {
        save(
            out,
            args,
            &model,
            lora.as_ref(),
            &saved_names,
            &kept,
            tc.packing,
            step,
            loader.cursor,
        )?;
        println!(
            "saved {} and train_state/ to {}",
            if args.step.full {
                "model.safetensors"
            } else {
                "the PEFT adapter"
            },
            out.display()
        );
    }
    if let Some(first) = first_loss {
        println!("loss {first:.4} -> {last_loss:.4} in {} steps", step);
    }
    if fills > 0 {
        println!(
            "packing {}: {:.1}% of the slots hold real tokens ({:.1}% unpacked)",
            if tc.packing { "on" } else { "off" },
            100.0 * fill_sum / fills as f64,
            100.0 * unpacked_fill
        );
    }
    if let Some(exe) = &exe {
        let m = exe.executable().compiled_memory_stats()?;
        println!(
            "jit: compiled memory per device: arguments {:.1} MB, outputs {:.1} MB (aliased {:.1} MB), temporaries {:.1} MB",
            m.argument_size_in_bytes as f64 / 1e6,
            m.output_size_in_bytes as f64 / 1e6,
            m.alias_size_in_bytes as f64 / 1e6,
            m.temp_size_in_bytes as f64 / 1e6
        );
    }
    if let Some(e) = &eager {
        let s = e.stats;
        println!(
            "eager: {} one-op programs, op cache hit rate {:.1}% ({} hits, {} compiles), peak live intermediates {:.1} MB of {:.1} MB made per step",
            s.programs,
            s.hit_rate() * 100.0,
            s.hits,
            s.misses,
            s.peak_live_bytes as f64 / 1e6,
            s.intermediate_bytes as f64 / 1e6
        );
    }
    if demo && !args.step.full {
        let tensors: Vec<(String, Literal)> = saved_names
            .iter()
            .zip(&kept)
            .filter(|(n, _)| step_fn.trainable.contains(n))
            .map(|(n, a)| Ok((n.clone(), Literal::from(a.gather()?))))
            .collect::<Result<_>>()?;
        let trained = Adapter {
            lora: lora.clone().expect("LoRA run"),
            tensors: unstack_all(tensors),
        };
        demo_show("after", Some(&trained))?;
    }
    Ok(())
}
