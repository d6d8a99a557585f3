//! `hlo-train generate`: complete prompts with a Llama model (and
//! adapters, unmerged): a prefill program over the prompts, then one decode
//! program per token over a KV cache kept on the device, tokens sampled on
//! the device.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_ir::{DType, Literal, TensorType};
use hlo_models::adapter::Adapter;
use hlo_models::chat::{ChatTemplate, Message};
use hlo_models::io::write_safetensors;
use hlo_models::llama::{
    base_parameter_types, decode_function, forward_function, lora_parameter_types,
};

use hlo_partitioner::{llama_rules, FunctionShardings, Mesh, PartitionSpec, Sharding};
use hlo_runtime::{DeviceArray, Eager, HostArray, PluginKind, ShardedFunction};

use crate::common::PluginArgs;
use crate::model_args::{parse_ids, ModelArgs};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub plugin: PluginArgs,

    /// A PEFT adapter folder; give it several times to compare completions.
    #[arg(long)]
    pub adapter: Vec<PathBuf>,

    /// The prompt text (with `--chat`, the user's message).
    #[arg(long, conflicts_with_all = ["prompt_ids", "prompts"], required_unless_present_any = ["prompt_ids", "prompts"])]
    pub prompt: Option<String>,

    /// The prompt as token ids (`1,2,3`); the completion is printed as ids.
    #[arg(long, conflicts_with = "prompts")]
    pub prompt_ids: Option<String>,

    /// A JSONL file of prompts, one per line (`{"prompt"}`, `{"input_ids"}`
    /// or `{"messages"}`), completed in batches; prints one JSON line per
    /// prompt (and adapter).
    #[arg(long)]
    pub prompts: Option<PathBuf>,

    /// Prompts completed together with `--prompts`.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub batch_size: u32,

    /// Render the prompt as a user message with the model's chat template
    /// (`tokenizer_config.json` of the checkpoint or beside `--tokenizer`).
    #[arg(long)]
    pub chat: bool,

    /// The chat template's folder (holding `tokenizer_config.json`),
    /// instead of the checkpoint's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,

    /// Device mesh for the weights (`dp=1,fsdp=2,mp=2`; default one
    /// device). With the CPU plugin, as many virtual devices are made.
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// Also stop at these token ids (`1,2`) besides the config's EOS ids.
    #[arg(long)]
    pub stop: Option<String>,

    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_new_tokens: u32,

    /// Always take the most likely token (the default).
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    pub greedy: bool,

    /// Sample at this temperature.
    #[arg(long)]
    pub temperature: Option<f64>,

    /// Sample from the smallest set of tokens with this much probability.
    #[arg(long)]
    pub top_p: Option<f64>,

    /// Sample from the k most likely tokens only.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub top_k: Option<u32>,

    /// Seed for sampling and for random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Run the forward pass op by op instead of as one executable.
    #[arg(long)]
    pub eager: bool,

    /// Keep going past the model's end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,

    /// Print the prefill and decode speeds, and each decode step's time, as
    /// one JSON object on stderr.
    #[arg(long)]
    pub stats: bool,

    /// Write the prompt's logits `[prompt_len, vocab]` (f32) to this
    /// safetensors file, as tensor `logits`.
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    if let Some(t) = args.temperature {
        if !(t.is_finite() && t >= 0.0) {
            bail!("--temperature must be a non-negative number, got {t}");
        }
    }
    if let Some(p) = args.top_p {
        if !(p > 0.0 && p <= 1.0) {
            bail!("--top-p must be in (0, 1], got {p}");
        }
    }
    let model = args.model.open()?;
    let config = &model.config;
    let tokenizer = args.model.tokenizer(&model)?;
    let chat = if args.chat || args.chat_template.is_some() {
        let dir = match (&args.chat_template, &model.checkpoint, &args.model.tokenizer) {
            (Some(d), _, _) => d.clone(),
            (None, Some(c), _) => c.dir.clone(),
            (None, None, Some(t)) => t.parent().map(PathBuf::from).unwrap_or_default(),
            _ => bail!("--chat needs a checkpoint or --tokenizer with a tokenizer_config.json, or --chat-template DIR"),
        };
        Some(ChatTemplate::from_dir(&dir)?)
    } else {
        None
    };
    let encode = |text: &str| -> Result<Vec<u32>> {
        let Some(t) = &tokenizer else {
            bail!("no tokenizer for this model: pass --tokenizer FILE or token ids");
        };
        // A rendered chat template carries its own BOS.
        Ok(t.encode(text, chat.is_none())?)
    };
    let render = |messages: &[Message]| -> Result<Vec<u32>> {
        let Some(c) = &chat else {
            bail!("`messages` prompts need a chat template (--chat)");
        };
        encode(&c.render(messages, true)?)
    };
    // (what to echo back, token ids) for every prompt.
    let mut requests: Vec<(serde_json::Value, Vec<u32>)> = Vec::new();
    match (&args.prompt, &args.prompt_ids, &args.prompts) {
        (_, Some(ids), _) => requests.push((serde_json::Value::Null, parse_ids(ids)?)),
        (Some(text), None, _) => {
            let ids = if chat.is_some() {
                render(&[Message::new("user", text)])?
            } else {
                encode(text)?
            };
            requests.push((serde_json::Value::Null, ids));
        }
        (None, None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            for (n, line) in text.lines().enumerate() {
                let at = || format!("{}:{}", path.display(), n + 1);
                if line.trim().is_empty() {
                    bail!("{}: empty line", at());
                }
                let v: serde_json::Value = serde_json::from_str(line)
                    .map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", at()))?;
                let ids = if let Some(ids) = v.get("input_ids").and_then(|x| x.as_array()) {
                    ids.iter()
                        .map(|t| t.as_u64().map(|t| t as u32))
                        .collect::<Option<Vec<u32>>>()
                        .with_context(|| {
                            format!("{}: input_ids must be non-negative integers", at())
                        })?
                } else if let Some(p) = v.get("prompt").and_then(|x| x.as_str()) {
                    if chat.is_some() {
                        render(&[Message::new("user", p)])
                    } else {
                        encode(p)
                    }
                    .with_context(at)?
                } else if let Some(m) = v.get("messages") {
                    let messages: Vec<Message> = serde_json::from_value(m.clone())
                        .map_err(|e| anyhow::anyhow!("{}: messages: {e}", at()))?;
                    render(&messages).with_context(at)?
                } else {
                    bail!(
                        "{}: expected {{\"prompt\"}}, {{\"input_ids\"}} or {{\"messages\"}}",
                        at()
                    );
                };
                requests.push((v, ids));
            }
            if requests.is_empty() {
                bail!("{} has no prompts", path.display());
            }
        }
        (None, None, None) => bail!("give --prompt, --prompt-ids or --prompts"),
    }
    for (_, prompt) in &requests {
        if prompt.is_empty() {
            bail!("a prompt is empty");
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as i64 >= config.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                config.vocab_size
            );
        }
        let window = prompt.len() as i64 + args.max_new_tokens as i64;
        if window > config.max_position_embeddings {
            bail!(
                "prompt ({}) + --max-new-tokens ({}) exceed the model's {} positions",
                prompt.len(),
                args.max_new_tokens,
                config.max_position_embeddings
            );
        }
    }
    let mesh = args.mesh.clone().unwrap_or_else(Mesh::single);
    let (client, _) = args.plugin.client_for(&mesh)?;
    let dtype = args
        .model
        .dtype(args.plugin.plugin.kind() == PluginKind::Cpu);
    model.check_weights()?;
    let adapters: Vec<Option<Adapter>> = if args.adapter.is_empty() {
        vec![None]
    } else {
        args.adapter
            .iter()
            .map(|d| Adapter::load(d, config).map(Some))
            .collect::<Result<_, _>>()?
    };
    let mut eos: Vec<u32> = if args.ignore_eos {
        Vec::new()
    } else {
        config.eos_token_ids.iter().map(|&e| e as u32).collect()
    };
    if let Some(stop) = &args.stop {
        eos.extend(parse_ids(stop)?);
    }
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    for (k, adapter) in adapters.iter().enumerate() {
        let generator = Generator::on_mesh(
            &client,
            mesh.clone(),
            config,
            dtype,
            adapter.as_ref(),
            args.eager,
            |name| model.weight(name, dtype, args.seed),
        )?;
        if k == 0 {
            if let Some(path) = &args.dump_logits {
                let prompt = &requests[0].1;
                let logits = generator.prompt_logits(prompt)?;
                let lit = Literal::from_f64s(
                    TensorType::new(DType::F32, [prompt.len() as i64, config.vocab_size]),
                    &logits,
                );
                write_safetensors(path, &[("logits".to_string(), lit)])?;
            }
        }
        let show = |ids: &[u32]| -> Result<String> {
            Ok(match (&args.prompt_ids, &tokenizer) {
                (None, Some(t)) => t.decode(ids)?,
                _ => ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
            })
        };
        if args.prompts.is_some() {
            for chunk in requests.chunks(args.batch_size as usize) {
                let prompts: Vec<Vec<u32>> = chunk.iter().map(|(_, p)| p.clone()).collect();
                let outs = generator.complete_batch(
                    &prompts,
                    args.max_new_tokens as usize,
                    &sampling,
                    &eos,
                )?;
                for ((line, _), out) in chunk.iter().zip(outs) {
                    let mut v = line.clone();
                    v["completion"] = show(&out)?.into();
                    v["completion_ids"] = out.into();
                    if let Some(dir) = args.adapter.get(k) {
                        v["adapter"] = dir.display().to_string().into();
                    }
                    println!("{v}");
                }
                if args.stats {
                    eprintln!("{}", timings_json(&generator.timings()));
                }
            }
            continue;
        }
        let completion = generator.complete(
            &requests[0].1,
            args.max_new_tokens as usize,
            &sampling,
            &eos,
        )?;
        if adapters.len() > 1 {
            println!("== {}", args.adapter[k].display());
        }
        if args.stats {
            eprintln!("{}", timings_json(&generator.timings()));
        }
        if let Some(s) = generator.eager_stats() {
            eprintln!(
                "eager: {} one-op programs, op cache hit rate {:.1}%, peak live intermediates {:.1} MB",
                s.programs,
                s.hit_rate() * 100.0,
                s.peak_live_bytes as f64 / 1e6
            );
        }
        println!("{}", show(&completion)?);
    }
    Ok(())
}

/// `prefill_tokens_per_s`, `decode_tokens_per_s` (median step) and the
/// steps' times.
fn timings_json(t: &Timings) -> serde_json::Value {
    let mut sorted = t.decode_step_s.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
    serde_json::json!({
        "batch": t.batch,
        "prefill_tokens": t.prefill_tokens,
        "prefill_s": t.prefill_s,
        "prefill_tokens_per_s": t.prefill_tokens as f64 / t.prefill_s,
        "decode_steps": t.decode_step_s.len(),
        "decode_tokens_per_s": t.batch as f64 / median,
        "decode_step_s": t.decode_step_s,
        "programs": t.programs,
        "compile_s": t.compile_s,
    })
}

/// How the next token is chosen (on the device; see
/// [`hlo_models::llama::sample_tokens`]).
#[derive(Clone, Debug, Default)]
pub struct Sampling {
    /// None (with no top-k or top-p): greedy. 0 is greedy too.
    pub temperature: Option<f64>,
    pub top_k: Option<u32>,
    pub top_p: Option<f64>,
    pub seed: u64,
}

impl Sampling {
    fn temperature(&self) -> f64 {
        match self.temperature {
            Some(t) => t,
            None if self.top_k.is_some() || self.top_p.is_some() => 1.0,
            None => 0.0,
        }
    }
}

/// Prompt lengths are padded up to a bucket so a new length rarely means
/// a new program: powers of two from 16.
pub fn prompt_bucket(len: usize) -> i64 {
    len.next_power_of_two().max(16) as i64
}

/// The cache's length for a bucket and a number of new tokens: a multiple
/// of 128 (again so that programs are shared).
pub fn cache_bucket(prompt_bucket: i64, max_new: usize) -> i64 {
    (prompt_bucket + max_new as i64 + 127) / 128 * 128
}

/// A compiled prefill/decode program for one (batch, new tokens, cache
/// length) shape.
struct Program {
    function: hlo_ir::Function,
    jit: Option<ShardedFunction>,
}

/// Completes prompts with a KV cache: one prefill program over the
/// (left-padded) prompts, then one decode program per new token, the cache
/// updated in place on the device and the next token sampled there. The
/// weights are uploaded once; programs are compiled per shape bucket and
/// kept.
pub struct Generator {
    client: hlo_runtime::Client,
    config: hlo_models::llama::LlamaConfig,
    lora: Option<hlo_models::llama::LoraConfig>,
    dtype: DType,
    mesh: Mesh,
    devices: Vec<hlo_runtime::Device>,
    eager: Option<RefCell<Eager>>,
    /// (name, array) of every parameter, in the programs' input order,
    /// laid out over the mesh by the training rules.
    params: Vec<(String, DeviceArray)>,
    param_specs: Vec<PartitionSpec>,
    /// The caches' layout: heads over `mp` where they divide, else whole.
    cache_spec: PartitionSpec,
    programs: RefCell<HashMap<(i64, i64, i64), Program>>,
    timings: RefCell<Timings>,
    /// Seconds spent tracing and compiling programs, in all.
    compile_s: std::cell::Cell<f64>,
}

/// Where the time of the last [`Generator::complete_batch`] went.
#[derive(Clone, Debug, Default)]
pub struct Timings {
    /// Prompt tokens (all rows, without padding) and the prefill's seconds
    /// (the first run of a shape includes its compilation).
    pub prefill_tokens: usize,
    pub prefill_s: f64,
    /// Seconds of each decode step (one token per row).
    pub decode_step_s: Vec<f64>,
    pub batch: usize,
    /// Programs compiled so far, and the seconds that took (not counted
    /// in the steps).
    pub programs: usize,
    pub compile_s: f64,
}

impl Generator {
    /// Uploads the weights (`weight(name)`, one tensor at a time) and the
    /// adapter's tensors (applied unmerged) to one device.
    pub fn new(
        client: &hlo_runtime::Client,
        config: &hlo_models::llama::LlamaConfig,
        dtype: DType,
        adapter: Option<&Adapter>,
        eager: bool,
        weight: impl Fn(&str) -> Result<Literal>,
    ) -> Result<Generator> {
        Self::on_mesh(
            client,
            Mesh::single(),
            config,
            dtype,
            adapter,
            eager,
            weight,
        )
    }

    /// [`Generator::new`] over a mesh: the weights laid out by the
    /// training rules ([`llama_rules`]), the KV cache split over heads by
    /// `mp`, the programs SPMD-partitioned by XLA.
    pub fn on_mesh(
        client: &hlo_runtime::Client,
        mesh: Mesh,
        config: &hlo_models::llama::LlamaConfig,
        dtype: DType,
        adapter: Option<&Adapter>,
        eager: bool,
        weight: impl Fn(&str) -> Result<Literal>,
    ) -> Result<Generator> {
        let lora = adapter.map(|a| a.lora.clone());
        let devices = crate::common::mesh_devices(client, &mesh)?;
        let mut types = base_parameter_types(config, dtype);
        if let Some(l) = &lora {
            types.extend(lora_parameter_types(config, l));
        }
        let rules = llama_rules();
        let mut params = Vec::new();
        let mut param_specs = Vec::new();
        for (name, ty) in types {
            let spec = rules.spec_for(&name, ty.rank());
            spec.validate(&mesh, &ty.dims, &name)?;
            let lit = match adapter.and_then(|a| a.get(&name)) {
                Some(l) => l.clone(),
                None => weight(&name)?,
            };
            let sharding = Sharding::new(mesh.clone(), spec.clone());
            let array = DeviceArray::shard(client, &HostArray::from(lit), &sharding, &devices)?;
            params.push((name, array));
            param_specs.push(spec);
        }
        let mp = mesh.axis_size("mp").unwrap_or(1);
        let cache_spec = if mp > 1 && config.num_key_value_heads % mp == 0 {
            PartitionSpec::new(&[&[], &["mp"]])
        } else {
            PartitionSpec::replicated()
        };
        let eager = if eager {
            Some(RefCell::new(Eager::new(
                client,
                mesh.clone(),
                devices.clone(),
            )?))
        } else {
            None
        };
        Ok(Generator {
            client: client.clone(),
            config: config.clone(),
            lora,
            dtype,
            mesh,
            devices,
            eager,
            params,
            param_specs,
            cache_spec,
            programs: RefCell::new(HashMap::new()),
            timings: RefCell::new(Timings::default()),
            compile_s: std::cell::Cell::new(0.0),
        })
    }

    /// The eager executor's statistics, when running eagerly.
    pub fn eager_stats(&self) -> Option<hlo_runtime::EagerStats> {
        self.eager.as_ref().map(|e| e.borrow().stats)
    }

    /// The timings of the last completion.
    pub fn timings(&self) -> Timings {
        self.timings.borrow().clone()
    }

    fn place(&self, host: HostArray) -> Result<DeviceArray> {
        self.place_as(host, PartitionSpec::replicated())
    }

    fn place_as(&self, host: HostArray, spec: PartitionSpec) -> Result<DeviceArray> {
        Ok(DeviceArray::shard(
            &self.client,
            &host,
            &Sharding::new(self.mesh.clone(), spec),
            &self.devices,
        )?)
    }

    /// Every input's and output's layout in a decode program.
    fn shardings(&self, function: &hlo_ir::Function) -> FunctionShardings {
        let layout = |name: &str| {
            if name.starts_with("cache.") {
                self.cache_spec.clone()
            } else {
                PartitionSpec::replicated()
            }
        };
        let mut inputs = self.param_specs.clone();
        inputs.extend(
            function.inputs[self.params.len()..]
                .iter()
                .map(|b| layout(&b.name)),
        );
        FunctionShardings {
            mesh: self.mesh.clone(),
            inputs,
            outputs: function.outputs.iter().map(|b| layout(&b.name)).collect(),
        }
    }

    /// Runs the program for `shape` on `inputs` (everything after the
    /// parameters), compiling it first if needed.
    fn run(&self, shape: (i64, i64, i64), inputs: &[&DeviceArray]) -> Result<Vec<DeviceArray>> {
        let (batch, new, max_len) = shape;
        let mut programs = self.programs.borrow_mut();
        if let std::collections::hash_map::Entry::Vacant(slot) = programs.entry(shape) {
            let started = std::time::Instant::now();
            let traced = decode_function(
                &self.config,
                self.dtype,
                batch,
                new,
                max_len,
                self.lora.as_ref(),
            )
            .context("tracing the decode step")?;
            let function = hlo_ir::simplify(&traced);
            let jit = if self.eager.is_none() {
                // The caches and the rng state are updated in place.
                let donated: Vec<(usize, usize)> = function
                    .inputs
                    .iter()
                    .enumerate()
                    .filter_map(|(k, b)| {
                        let name = &b.name;
                        (name.starts_with("cache.") || name == "rng").then(|| {
                            let out = function
                                .outputs
                                .iter()
                                .position(|o| &o.name == name)
                                .expect("each cache is an output");
                            (k, out)
                        })
                    })
                    .collect();
                let shardings = self.shardings(&function);
                Some(ShardedFunction::with_donation(
                    &self.client,
                    &function,
                    shardings,
                    &donated,
                )?)
            } else {
                None
            };
            slot.insert(Program { function, jit });
            self.compile_s
                .set(self.compile_s.get() + started.elapsed().as_secs_f64());
        }
        let program = &programs[&shape];
        let mut all: Vec<&DeviceArray> = self.params.iter().map(|(_, a)| a).collect();
        all.extend_from_slice(inputs);
        Ok(match (&program.jit, &self.eager) {
            (Some(jit), _) => jit.run(&all)?,
            (None, Some(eager)) => {
                let specs = self.shardings(&program.function).outputs;
                eager
                    .borrow_mut()
                    .run(&program.function, &all, &specs, None)?
            }
            _ => unreachable!("JIT or eager"),
        })
    }

    /// Up to `max_new` tokens after each prompt, each row stopping after
    /// one of the `stop` tokens.
    pub fn complete_batch(
        &self,
        prompts: &[Vec<u32>],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<Vec<Vec<u32>>> {
        let batch = prompts.len();
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        if batch == 0 || longest == 0 || prompts.iter().any(Vec::is_empty) || max_new == 0 {
            return Ok(vec![Vec::new(); batch]);
        }
        let t = prompt_bucket(longest);
        let max_len = cache_bucket(t, max_new);
        let b = batch as i64;
        // Left padding: every row's last prompt token sits at slot t - 1.
        let mut ids = vec![0i32; batch * t as usize];
        let mut offsets = Vec::with_capacity(batch);
        for (r, p) in prompts.iter().enumerate() {
            let off = t as usize - p.len();
            offsets.push(off as i32);
            for (j, &tok) in p.iter().enumerate() {
                ids[r * t as usize + off + j] = tok as i32;
            }
        }
        let c = &self.config;
        let cache_ty = [b, c.num_key_value_heads, max_len, c.head_dim];
        let zeros = HostArray::from(Literal::splat(TensorType::new(self.dtype, cache_ty), 0.0));
        let mut caches: Vec<DeviceArray> = (0..2 * c.num_hidden_layers)
            .map(|_| self.place_as(zeros.clone(), self.cache_spec.clone()))
            .collect::<Result<_>>()?;
        let offsets = self.place(HostArray::new(&[b], &offsets)?)?;
        let temperature = self.place(HostArray::scalar(sampling.temperature() as f32))?;
        let top_k = self.place(HostArray::scalar(sampling.top_k.unwrap_or(0) as i32))?;
        let top_p = self.place(HostArray::scalar(sampling.top_p.unwrap_or(1.0) as f32))?;
        let mut rng = self.place(HostArray::from(Literal::from_f64s(
            TensorType::new(DType::U64, [2]),
            &[sampling.seed as f64, 0.0],
        )))?;
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); batch];
        let mut done = vec![false; batch];
        let mut input = self.place(HostArray::new(&[b, t], &ids)?)?;
        let mut cur = 0i64;
        let mut new = t;
        let mut timings = Timings {
            prefill_tokens: prompts.iter().map(Vec::len).sum(),
            batch,
            ..Timings::default()
        };
        for _ in 0..max_new {
            let started = std::time::Instant::now();
            let compiling = self.compile_s.get();
            let cur_arr = self.place(HostArray::scalar(cur as i32))?;
            let mut inputs: Vec<&DeviceArray> = caches.iter().collect();
            inputs.extend([
                &input,
                &offsets,
                &cur_arr,
                &temperature,
                &top_k,
                &top_p,
                &rng,
            ]);
            let mut outputs = self.run((b, new, max_len), &inputs)?;
            // Outputs: next, logits, caches.., rng.
            rng = outputs.pop().expect("rng");
            let next_arr = outputs.remove(0);
            caches = outputs.split_off(1);
            let next: Vec<i32> = next_arr.gather()?.to_vec()?;
            let took = started.elapsed().as_secs_f64() - (self.compile_s.get() - compiling);
            if cur == 0 {
                timings.prefill_s = took;
            } else {
                timings.decode_step_s.push(took);
            }
            for (r, &tok) in next.iter().enumerate() {
                if !done[r] {
                    out[r].push(tok as u32);
                    done[r] = stop.contains(&(tok as u32));
                }
            }
            if done.iter().all(|&d| d) {
                break;
            }
            cur += new;
            new = 1;
            input = self.place(HostArray::new(&[b, 1], &next)?)?;
        }
        timings.programs = self.programs.borrow().len();
        timings.compile_s = self.compile_s.get();
        *self.timings.borrow_mut() = timings;
        Ok(out)
    }

    /// [`Generator::complete_batch`] for one prompt.
    pub fn complete(
        &self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<Vec<u32>> {
        Ok(self
            .complete_batch(&[prompt.to_vec()], max_new, sampling, stop)?
            .remove(0))
    }

    /// The logits `[prompt_len, vocab]` of every prompt position, from one
    /// full forward pass (for `--dump-logits`).
    pub fn prompt_logits(&self, prompt: &[u32]) -> Result<Vec<f64>> {
        let n = prompt.len() as i64;
        let traced = forward_function(&self.config, self.dtype, 1, n, self.lora.as_ref())
            .context("tracing the forward pass")?;
        let function = hlo_ir::simplify(&traced);
        let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let ids = self.place(HostArray::new(&[1, n], &ids)?)?;
        let mut all: Vec<&DeviceArray> = self.params.iter().map(|(_, a)| a).collect();
        all.push(&ids);
        let out = match &self.eager {
            Some(eager) => {
                eager
                    .borrow_mut()
                    .run(&function, &all, &[PartitionSpec::replicated()], None)?
            }
            None => {
                let mut shardings = FunctionShardings::replicated(&function, &self.mesh);
                shardings.inputs[..self.param_specs.len()].clone_from_slice(&self.param_specs);
                ShardedFunction::new(&self.client, &function, shardings)?.run(&all)?
            }
        };
        Ok(out[0].gather()?.to_f64_vec())
    }
}
