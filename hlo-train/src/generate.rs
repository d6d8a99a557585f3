//! `hlo-train generate`: complete a prompt with a Llama model (and
//! adapters). One compiled forward pass over the whole window; each new
//! token reruns it (the KV-cache issue makes this fast).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_ir::{DType, Literal, TensorType};
use hlo_models::adapter::Adapter;
use hlo_models::io::write_safetensors;
use hlo_models::llama::forward_function;
use hlo_models::rng::Rng;
use std::cell::RefCell;

use hlo_partitioner::{FunctionShardings, Mesh, PartitionSpec, Sharding};
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

    /// The prompt text.
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,

    /// The prompt as token ids (`1,2,3`); the completion is printed as ids.
    #[arg(long)]
    pub prompt_ids: Option<String>,

    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_new_tokens: u32,

    /// Always take the most likely token (the default).
    #[arg(long, conflicts_with_all = ["temperature", "top_p"])]
    pub greedy: bool,

    /// Sample at this temperature.
    #[arg(long)]
    pub temperature: Option<f64>,

    /// Sample from the smallest set of tokens with this much probability.
    #[arg(long)]
    pub top_p: Option<f64>,

    /// Seed for sampling and for random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Run the forward pass op by op instead of as one executable.
    #[arg(long)]
    pub eager: bool,

    /// Keep going past the model's end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,

    /// Write the prompt's logits `[prompt_len, vocab]` (f32) to this
    /// safetensors file, as tensor `logits`.
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,
}

/// Picks the next token from one row of logits.
fn sample(logits: &[f64], temperature: Option<f64>, top_p: Option<f64>, rng: &mut Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0, f64::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 {
                    (i, v)
                } else {
                    best
                }
            })
            .0 as u32
    };
    let t = match temperature {
        None if top_p.is_none() => return argmax(),
        None => 1.0,
        Some(t) if t <= 0.0 => return argmax(),
        Some(t) => t,
    };
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .map(|&l| ((l - max) / t).exp())
        .enumerate()
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= total);
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    let p = top_p.unwrap_or(1.0);
    let mut kept = 0.0;
    let mut cut = probs.len();
    for (k, (_, q)) in probs.iter().enumerate() {
        kept += q;
        if kept >= p {
            cut = k + 1;
            break;
        }
    }
    let probs = &probs[..cut];
    let mut r = rng.next_f64() * probs.iter().map(|p| p.1).sum::<f64>();
    for (i, q) in probs {
        if r < *q {
            return *i as u32;
        }
        r -= q;
    }
    probs[probs.len() - 1].0 as u32
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
    let prompt: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => parse_ids(ids)?,
        (Some(text), None) => match &tokenizer {
            Some(t) => t.encode(text, true)?,
            None => bail!("no tokenizer for this model: pass --tokenizer FILE or --prompt-ids"),
        },
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
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
    let client = args.plugin.client()?;
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
    let eos: Vec<u32> = if args.ignore_eos {
        Vec::new()
    } else {
        config.eos_token_ids.iter().map(|&e| e as u32).collect()
    };
    for (k, adapter) in adapters.iter().enumerate() {
        let generator = Generator::new(
            &client,
            config,
            dtype,
            window,
            adapter.as_ref(),
            args.eager,
            |name| model.weight(name, dtype, args.seed),
        )?;
        let sampling = Sampling {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: args.seed,
        };
        let (completion, logits) =
            generator.complete(&prompt, args.max_new_tokens as usize, &sampling, &eos)?;
        if k == 0 {
            if let Some(path) = &args.dump_logits {
                let vocab = config.vocab_size as usize;
                let rows: Vec<f64> = logits[..prompt.len() * vocab].to_vec();
                let lit = Literal::from_f64s(
                    TensorType::new(DType::F32, [prompt.len() as i64, vocab as i64]),
                    &rows,
                );
                write_safetensors(path, &[("logits".to_string(), lit)])?;
            }
        }
        if adapters.len() > 1 {
            println!("== {}", args.adapter[k].display());
        }
        if let Some(s) = generator.eager_stats() {
            eprintln!(
                "eager: {} one-op programs, op cache hit rate {:.1}%, peak live intermediates {:.1} MB",
                s.programs,
                s.hit_rate() * 100.0,
                s.peak_live_bytes as f64 / 1e6
            );
        }
        match (&args.prompt_ids, &tokenizer) {
            (None, Some(t)) => println!("{}", t.decode(&completion)?),
            _ => println!(
                "{}",
                completion
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
    Ok(())
}

/// How the next token is chosen.
pub struct Sampling {
    /// None (and no top-p): greedy.
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: u64,
}

/// A forward pass over a fixed window, compiled whole (JIT) or run op by op
/// (eager), with the parameters on the device; completes prompts by rerunning
/// it once per new token.
pub struct Generator {
    client: hlo_runtime::Client,
    function: hlo_ir::Function,
    mesh: Mesh,
    devices: Vec<hlo_runtime::Device>,
    jit: Option<ShardedFunction>,
    eager: Option<RefCell<Eager>>,
    params: Vec<DeviceArray>,
    window: i64,
    vocab: usize,
}

impl Generator {
    /// Builds the forward pass and uploads the weights (`weight(name)`, one
    /// tensor at a time) and the adapter's tensors.
    pub fn new(
        client: &hlo_runtime::Client,
        config: &hlo_models::llama::LlamaConfig,
        dtype: DType,
        window: i64,
        adapter: Option<&Adapter>,
        eager: bool,
        weight: impl Fn(&str) -> Result<Literal>,
    ) -> Result<Generator> {
        let lora = adapter.map(|a| &a.lora);
        let traced =
            forward_function(config, dtype, 1, window, lora).context("tracing the forward pass")?;
        let function = hlo_ir::simplify(&traced);
        let mesh = Mesh::single();
        let devices = client.addressable_devices()?[..1].to_vec();
        let replicated = Sharding::replicated(mesh.clone());
        let mut params = Vec::new();
        for b in &function.inputs[..function.inputs.len() - 1] {
            let lit = match adapter.and_then(|a| a.get(&b.name)) {
                Some(l) => l.clone(),
                None => weight(&b.name)?,
            };
            params.push(DeviceArray::shard(
                client,
                &HostArray::from(lit),
                &replicated,
                &devices,
            )?);
        }
        let (jit, eager) = if eager {
            (
                None,
                Some(RefCell::new(Eager::new(
                    client,
                    mesh.clone(),
                    devices.clone(),
                )?)),
            )
        } else {
            let shardings = FunctionShardings::replicated(&function, &mesh);
            (
                Some(ShardedFunction::new(client, &function, shardings)?),
                None,
            )
        };
        Ok(Generator {
            client: client.clone(),
            function,
            mesh,
            devices,
            jit,
            eager,
            params,
            window,
            vocab: config.vocab_size as usize,
        })
    }

    /// The logits `[window, vocab]` for `tokens` (padded with 0).
    fn logits(&self, tokens: &[u32]) -> Result<Vec<f64>> {
        let mut ids = vec![0i32; self.window as usize];
        for (i, t) in tokens.iter().enumerate() {
            ids[i] = *t as i32;
        }
        let ids = DeviceArray::shard(
            &self.client,
            &HostArray::new(&[1, self.window], &ids)?,
            &Sharding::replicated(self.mesh.clone()),
            &self.devices,
        )?;
        let mut inputs: Vec<&DeviceArray> = self.params.iter().collect();
        inputs.push(&ids);
        let out = match (&self.jit, &self.eager) {
            (Some(jit), _) => jit.run(&inputs)?,
            (None, Some(eager)) => eager.borrow_mut().run(
                &self.function,
                &inputs,
                &[PartitionSpec::replicated()],
                None,
            )?,
            _ => unreachable!("JIT or eager"),
        };
        Ok(out[0].gather()?.to_f64_vec())
    }

    /// The eager executor's statistics, when running eagerly.
    pub fn eager_stats(&self) -> Option<hlo_runtime::EagerStats> {
        self.eager.as_ref().map(|e| e.borrow().stats)
    }

    /// Up to `max_new` tokens after `prompt` (stopping after a `stop` token),
    /// and the logits of the first forward pass (`[window, vocab]`).
    pub fn complete(
        &self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<(Vec<u32>, Vec<f64>)> {
        let mut tokens = prompt.to_vec();
        let mut rng = Rng::new(sampling.seed);
        let mut first = Vec::new();
        let max_new = max_new.min((self.window as usize).saturating_sub(prompt.len()));
        for step in 0..max_new {
            let logits = self.logits(&tokens)?;
            let v = self.vocab;
            let next = sample(
                &logits[(tokens.len() - 1) * v..tokens.len() * v],
                sampling.temperature,
                sampling.top_p,
                &mut rng,
            );
            if step == 0 {
                first = logits;
            }
            tokens.push(next);
            if stop.contains(&next) {
                break;
            }
        }
        Ok((tokens[prompt.len()..].to_vec(), first))
    }
}
