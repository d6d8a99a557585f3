//! `hlo-train generate`: reads the prompts, asks the engine's
//! [`Generator`] to complete them (with adapters, unmerged), and prints the
//! completions.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use hlo_engine::data::{read_prompts, ChatTemplate, Prompt, Tokenizer};
use hlo_engine::device::backend::Backend;
use hlo_engine::infer::generator::{Generator, Sampling, Timings};
use hlo_engine::inputs::model::Model;
use hlo_engine::inputs::model::{BaseSpec, TokenizerSpec};
use hlo_engine::ir::{DType, Literal, TensorType};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::decoder::ModelConfig;
use hlo_engine::models::io::write_safetensors;
use hlo_engine::partitioner::Mesh;
use hlo_engine::runtime::Mode;
use serde_json::Value;

use crate::args::{parse_ids, PluginArgs};
use crate::saved_run::AdapterRuns;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub base: BaseSpec,

    #[command(flatten)]
    pub tokenizer: TokenizerSpec,

    #[command(flatten)]
    pub plugin: PluginArgs,

    /// A PEFT adapter folder or hub id; give it several times to compare
    /// completions. A run folder (with `train_state/`) also gives the
    /// base, tokenizer, NF4 and dtype its run used, where their flags are
    /// not given.
    #[arg(long, value_parser = hlo_engine::settings::hub_adapter)]
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
    /// instead of the checkpoint's; or a hub id.
    #[arg(long, value_parser = hlo_engine::settings::hub_chat_template)]
    pub chat_template: Option<PathBuf>,

    /// Device mesh for the weights (`dp=1,fsdp=2,mp=2`; default one
    /// device, or dp=1,fsdp=N,mp=1 over --devices).
    #[arg(long)]
    pub mesh: Option<Mesh>,

    /// Also stop at these token ids (`1,2`) besides the model's EOS ids
    /// (generation_config.json's, else config.json's).
    #[arg(long)]
    pub stop: Option<String>,

    /// Tokens to generate at most after each prompt.
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
    check_sampling(args)?;
    // What the flags leave open is as the adapters' run computed it.
    let runs = AdapterRuns::read(args.adapter.iter().map(PathBuf::as_path))?;
    let model = Model::open(&runs.model_for(&args.base.model)?)?
        .quantized(runs.nf4_for(&args.base.quantize)?)?;
    let config = &model.config;
    let tokenizer = model.tokenizer(runs.tokenizer_for(&args.tokenizer)?.as_deref())?;
    let dtype = runs.dtype_for(&args.base.dtype, args.plugin.is_cpu())?;
    runs.announce("generate");
    let chat = chat_template(args, &model)?;
    let requests = read_requests(args, tokenizer.as_ref(), chat.as_ref())?;
    check_prompts(&requests, config, args.max_new_tokens)?;
    let backend = Backend::open(&args.plugin.backend(args.mesh.as_ref()))?;
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
        model.generation_eos_ids()?
    };
    if let Some(stop) = &args.stop {
        eos.extend(parse_ids(stop)?);
    }
    let out = Completions {
        args,
        tokenizer: tokenizer.as_ref(),
        sampling: Sampling {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
        eos,
    };
    let mode = if args.eager { Mode::Eager } else { Mode::Jit };
    let mut failures = Vec::new();
    for (k, adapter) in adapters.iter().enumerate() {
        let generator = Generator::new(&backend, config, dtype, adapter.as_ref(), mode, |name| {
            model.weight(name, dtype, args.seed)
        })?;
        if k == 0 {
            if let Some(path) = &args.dump_logits {
                dump_logits(&generator, &requests[0].1, config.vocab_size, path)?;
            }
        }
        let named = |what: String| match args.adapter.get(k) {
            Some(dir) => format!("adapter {}: {what}", dir.display()),
            None => what,
        };
        if args.prompts.is_some() {
            let failed = out.complete_file(&generator, &requests, args.adapter.get(k))?;
            failures.extend(failed.into_iter().map(named));
        } else {
            // Several adapters: each completion under its adapter's name.
            let header = args.adapter.get(k).filter(|_| adapters.len() > 1);
            out.complete_one(&generator, &requests[0].1, header)
                .map_err(|e| anyhow::anyhow!(named(format!("{e:#}"))))?;
        }
    }
    // Every other completion was printed; a failed one is not an answer.
    match failures.len() {
        0 => Ok(()),
        n => bail!(
            "{}{}",
            failures[0],
            if n > 1 {
                format!(
                    " (and {} more prompts failed; their lines carry an \"error\")",
                    n - 1
                )
            } else {
                String::new()
            }
        ),
    }
}

/// Refuses sampling settings outside their range.
fn check_sampling(args: &GenerateArgs) -> Result<()> {
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
    Ok(())
}

/// The chat template with `--chat` or `--chat-template`: the given
/// folder's, else the checkpoint's, else the one beside `--tokenizer`.
fn chat_template(args: &GenerateArgs, model: &Model) -> Result<Option<ChatTemplate>> {
    if !args.chat && args.chat_template.is_none() {
        return Ok(None);
    }
    let dir = match (&args.chat_template, &model.checkpoint, &args.tokenizer.tokenizer) {
        (Some(d), _, _) => d.clone(),
        (None, Some(c), _) => c.dir.clone(),
        (None, None, Some(t)) => t.parent().map(PathBuf::from).unwrap_or_default(),
        _ => bail!("--chat needs a checkpoint or --tokenizer with a tokenizer_config.json, or --chat-template DIR"),
    };
    Ok(Some(ChatTemplate::from_dir(&dir)?))
}

/// (what to echo back, token ids) for every prompt: `--prompt-ids`,
/// `--prompt` or each line of `--prompts`.
fn read_requests(
    args: &GenerateArgs,
    tokenizer: Option<&Tokenizer>,
    chat: Option<&ChatTemplate>,
) -> Result<Vec<(Value, Vec<u32>)>> {
    let mut requests = Vec::new();
    match (&args.prompt, &args.prompt_ids, &args.prompts) {
        (_, Some(ids), _) => requests.push((Value::Null, parse_ids(ids)?)),
        (Some(text), None, _) => requests.push((
            Value::Null,
            Prompt::Text(text.clone()).encode(tokenizer, chat)?,
        )),
        (None, None, Some(path)) => {
            for p in read_prompts(path)? {
                let ids = p
                    .prompt
                    .encode(tokenizer, chat)
                    .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), p.number))?;
                requests.push((p.line, ids));
            }
        }
        (None, None, None) => bail!("give --prompt, --prompt-ids or --prompts"),
    }
    Ok(requests)
}

/// Refuses an empty prompt, a token outside the vocabulary, or a prompt
/// that with `max_new_tokens` more exceeds the model's positions.
fn check_prompts(
    requests: &[(Value, Vec<u32>)],
    config: &ModelConfig,
    max_new_tokens: u32,
) -> Result<()> {
    for (_, prompt) in requests {
        if prompt.is_empty() {
            bail!("a prompt is empty");
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as i64 >= config.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary (size {})",
                config.vocab_size
            );
        }
        let window = prompt.len() as i64 + max_new_tokens as i64;
        if window > config.max_position_embeddings {
            bail!(
                "prompt ({}) + --max-new-tokens ({}) exceed the model's {} positions",
                prompt.len(),
                max_new_tokens,
                config.max_position_embeddings
            );
        }
    }
    Ok(())
}

/// Writes the prompt's logits `[prompt_len, vocab]` as tensor `logits`.
fn dump_logits(generator: &Generator, prompt: &[u32], vocab: i64, path: &Path) -> Result<()> {
    let logits = generator.prompt_logits(prompt)?;
    let lit = Literal::from_f64s(
        TensorType::new(DType::F32, [prompt.len() as i64, vocab]),
        &logits,
    );
    write_safetensors(path, &[("logits".to_string(), lit)])?;
    Ok(())
}

/// How completions are made and printed, the same for every adapter.
struct Completions<'a> {
    args: &'a GenerateArgs,
    tokenizer: Option<&'a Tokenizer>,
    sampling: Sampling,
    /// Token ids that end a completion.
    eos: Vec<u32>,
}

impl Completions<'_> {
    /// A completion as text, or as ids when the prompt was ids or there is
    /// no tokenizer.
    fn show(&self, ids: &[u32]) -> Result<String> {
        Ok(match (&self.args.prompt_ids, self.tokenizer) {
            (None, Some(t)) => t.decode(ids)?,
            _ => ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        })
    }

    /// `--prompts`: completes them `--batch-size` at a time and prints a
    /// JSON line each (the prompt's line with the completion and, when
    /// given, the adapter; a prompt whose logits turn NaN or infinite
    /// gets an `error` instead, and is returned: the others are
    /// completed as they would be alone).
    fn complete_file(
        &self,
        generator: &Generator,
        requests: &[(Value, Vec<u32>)],
        adapter: Option<&PathBuf>,
    ) -> Result<Vec<String>> {
        let args = self.args;
        let mut failed = Vec::new();
        let mut number = 0;
        for chunk in requests.chunks(args.batch_size as usize) {
            let prompts: Vec<Vec<u32>> = chunk.iter().map(|(_, p)| p.clone()).collect();
            let outs = generator.complete_rows(
                &prompts,
                args.max_new_tokens as usize,
                &self.sampling,
                &self.eos,
            )?;
            for ((line, _), out) in chunk.iter().zip(outs) {
                number += 1;
                let mut v = line.clone();
                match out {
                    Ok(out) => {
                        v["completion"] = self.show(&out)?.into();
                        v["completion_ids"] = out.into();
                    }
                    Err(token) => {
                        let why = hlo_engine::EngineError::NonFiniteLogits {
                            row: number,
                            rows: requests.len(),
                            token: token + 1,
                        }
                        .to_string();
                        v["error"] = why.clone().into();
                        failed.push(why);
                    }
                }
                if let Some(dir) = adapter {
                    v["adapter"] = dir.display().to_string().into();
                }
                println!("{v}");
            }
            if args.stats {
                eprintln!("{}", timings_json(&generator.timings()));
            }
        }
        Ok(failed)
    }

    /// One prompt: prints its completion, under `== ADAPTER` when a
    /// header is given (with `--stats` the timings, and eager's op cache
    /// figures, on stderr).
    fn complete_one(
        &self,
        generator: &Generator,
        prompt: &[u32],
        header: Option<&PathBuf>,
    ) -> Result<()> {
        let args = self.args;
        let completion = generator.complete(
            prompt,
            args.max_new_tokens as usize,
            &self.sampling,
            &self.eos,
        )?;
        if let Some(adapter) = header {
            println!("== {}", adapter.display());
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
        println!("{}", self.show(&completion)?);
        Ok(())
    }
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
