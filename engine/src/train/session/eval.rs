//! The eval step: forward and summed loss over held-out batches, no
//! gradients, compiled once (JIT even when training eagerly) and fed the
//! train step's weights in place.

use hlo_data::Batch;
use hlo_models::adapter::Adapter;
use hlo_models::attention::AttentionKind;
use hlo_models::decoder::partition_rules;
use hlo_models::preference::reference_of;
use hlo_models::roles::{BatchField, Role};
use hlo_models::train::{eval_step, Loss, Preference, TrainConfig};
use hlo_runtime::{DeviceArray, HostArray, Mode, Program};

use super::{field_array, scalar, Session};
use crate::device::backend::Backend;
use crate::device::pipeline::ShardedStep;
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;

/// The eval step and where its inputs come from.
pub(super) struct EvalProgram {
    program: Program,
    /// The step's outputs are a preference loss and its metrics (named
    /// `output_names`), not a summed loss and its token count.
    preference: bool,
    output_names: Vec<String>,
    /// Per eval input: the train step's input index (weights) or a batch
    /// field.
    sources: Vec<EvalSource>,
}

#[derive(Clone, Copy)]
enum EvalSource {
    State(usize),
    Batch(BatchField),
}

/// The held-out loss of the current weights.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalResult {
    /// Masked mean cross-entropy over every counted token; for a
    /// preference objective its loss, the mean over the pairs.
    pub loss: f64,
    pub tokens: f64,
    /// A preference objective's metrics (TRL's names), means over the
    /// pairs; empty for SFT.
    pub metrics: Vec<(String, f64)>,
}

impl EvalResult {
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

impl EvalProgram {
    /// Traces, lays out and compiles the eval step of `config`, finding
    /// each of its weights among the train `step`'s inputs.
    pub(super) fn build(
        model: &Model,
        config: &TrainConfig,
        backend: &Backend,
        step: &ShardedStep,
    ) -> Result<EvalProgram> {
        let rules = partition_rules(&model.config);
        let traced = eval_step(&model.config, config)?;
        let laid = ShardedStep::new(&traced, backend.mesh(), &rules)?;
        let program = laid.compile(backend, Mode::Jit)?;
        let sources = laid
            .step
            .inputs
            .iter()
            .zip(&laid.function().inputs)
            .map(|(input, b)| match &input.role {
                Role::Batch(field) => Ok(EvalSource::Batch(*field)),
                _ => step
                    .function()
                    .inputs
                    .iter()
                    .position(|t| t.name == b.name)
                    .map(EvalSource::State)
                    .ok_or_else(|| {
                        EngineError::Internal(format!(
                            "the eval step's input `{}` is not a train step input",
                            b.name
                        ))
                    }),
            })
            .collect::<Result<_>>()?;
        Ok(EvalProgram {
            program,
            preference: matches!(config.loss, Loss::Preference(_)),
            output_names: output_names(&laid),
            sources,
        })
    }
}

impl EvalProgram {
    /// The masked mean loss over `batches` (or a preference loss and its
    /// metrics, each a mean over the pairs: `preference`); `state(k)` is
    /// the array of the weights at train-step input `k`.
    fn run<'a>(
        &self,
        backend: &Backend,
        dims: [i64; 2],
        batches: &[Batch],
        state: impl Fn(usize) -> &'a DeviceArray,
    ) -> Result<EvalResult> {
        let (mut sum, mut tokens) = (0.0f64, 0.0f64);
        // A preference batch's outputs are means over its pairs: weighted
        // by its pairs (a chosen row with a learned token).
        let mut pairs_seen = 0.0f64;
        let mut metrics: Vec<(String, f64)> = Vec::new();
        for b in batches {
            let mut placed: Vec<DeviceArray> = Vec::new();
            for (k, source) in self.sources.iter().enumerate() {
                if let EvalSource::Batch(field) = *source {
                    let host = field_array(b, field, &dims)?;
                    placed.push(backend.place(&host, &self.program.shardings().inputs[k])?);
                }
            }
            let mut next_batch = placed.iter();
            let inputs: Vec<&DeviceArray> = self
                .sources
                .iter()
                .map(|s| match *s {
                    EvalSource::State(k) => state(k),
                    EvalSource::Batch(_) => next_batch.next().expect("placed in order"),
                })
                .collect();
            let out = self.program.run(&inputs)?;
            if !self.preference {
                sum += scalar(&out[0])?;
                tokens += scalar(&out[1])?;
                continue;
            }
            let seq = dims[1] as usize;
            let pairs = (0..dims[0] as usize / 2)
                .filter(|r| b.loss_mask[r * seq..(r + 1) * seq].iter().any(|&m| m > 0.0))
                .count() as f64;
            pairs_seen += pairs;
            tokens += b.targets as f64;
            for (k, (name, a)) in self.output_names.iter().zip(&out).enumerate() {
                let v = scalar(a)? * pairs;
                match metrics.get_mut(k) {
                    Some(m) => m.1 += v,
                    None => metrics.push((name.clone(), v)),
                }
            }
        }
        if !self.preference {
            return Ok(EvalResult {
                loss: sum / tokens.max(1.0),
                tokens,
                metrics,
            });
        }
        for m in &mut metrics {
            m.1 /= pairs_seen.max(1.0);
        }
        // The first output is the loss.
        let loss = if metrics.is_empty() {
            f64::NAN
        } else {
            metrics.remove(0).1
        };
        Ok(EvalResult {
            loss,
            tokens,
            metrics,
        })
    }
}

impl Session {
    /// The held-out loss of the current weights over `batches` (each of
    /// `batch` rows, not accumulated): the exact masked mean over every
    /// counted token.
    pub fn evaluate(&self, batches: &[Batch]) -> Result<EvalResult> {
        let eval = self.eval.as_ref().ok_or(EngineError::NoEvalStep)?;
        let c = &self.config;
        eval.run(&self.backend, [c.batch, c.seq], batches, |k| {
            self.state[k].as_ref().expect("weights are set")
        })
    }
}

/// A model (and adapter) evaluated without training: only the eval step
/// is compiled, and only the weights are placed.
pub struct Evaluator {
    backend: Backend,
    config: TrainConfig,
    program: EvalProgram,
    weights: Vec<Option<DeviceArray>>,
}

impl Evaluator {
    /// Compiles the eval step of `model` (with `adapter`, unmerged) for
    /// batches of `batch` rows of `seq` tokens, attention computed as
    /// `attention`, and places the weights.
    ///
    /// With `pairs`, a batch is `batch` preference pairs (each its chosen
    /// and its rejected row), scored by the pairs' loss and TRL's metrics:
    /// against the base with the adapter off, or with a reference adapter
    /// (`Reference::Adapter`) against the one given.
    pub fn new(
        backend: Backend,
        model: &Model,
        dtype: hlo_ir::DType,
        (batch, seq): (i64, i64),
        attention: AttentionKind,
        adapter: Option<&Adapter>,
        pairs: Option<(Preference, Option<&Adapter>)>,
    ) -> Result<Evaluator> {
        let rows = if pairs.is_some() { 2 * batch } else { batch };
        let mut config =
            TrainConfig::new(dtype, rows, seq).with_lora(adapter.map(|a| a.lora.clone()));
        config.attention = attention;
        if let Some((p, r)) = &pairs {
            let own = r.map(|r| &r.lora);
            config.loss =
                Loss::Preference(p.clone().with_reference_lora(config.lora.as_ref(), own));
        }
        let reference = pairs.and_then(|(_, r)| r);
        model.check_weights()?;
        let traced = eval_step(&model.config, &config)?;
        let laid = ShardedStep::new(&traced, backend.mesh(), &partition_rules(&model.config))?;
        let program = EvalProgram {
            program: laid.compile(&backend, Mode::Jit)?,
            preference: matches!(config.loss, Loss::Preference(_)),
            output_names: output_names(&laid),
            sources: laid
                .step
                .inputs
                .iter()
                .enumerate()
                .map(|(k, i)| match i.role {
                    Role::Batch(field) => EvalSource::Batch(field),
                    _ => EvalSource::State(k),
                })
                .collect(),
        };
        let f = laid.function();
        let mut weights = Vec::with_capacity(f.inputs.len());
        for (k, b) in f.inputs.iter().enumerate() {
            // The adapter's tensors, and the whole weights it saves in
            // place of the base's; a reference adapter's copies of its
            // LoRA tensors; the model's for the rest.
            let lacks = |tensor: &str| EngineError::AdapterLacks {
                tensor: tensor.to_string(),
            };
            let lit = match (
                &laid.step.inputs[k].role,
                adapter.and_then(|a| a.get(&b.name)),
                reference_of(&b.name),
            ) {
                (Role::Batch(_), _, _) => {
                    weights.push(None);
                    continue;
                }
                (_, Some(t), _) => t.clone(),
                (_, None, Some(name)) => reference
                    .and_then(|r| r.get(name))
                    .cloned()
                    .ok_or_else(|| lacks(name))?,
                (Role::Trainable, None, None) if adapter.is_some() => return Err(lacks(&b.name)),
                _ => model.weight(&b.name, dtype, 0)?,
            };
            weights.push(Some(
                backend.place(&HostArray::from(lit), laid.input_spec(k))?,
            ));
        }
        Ok(Evaluator {
            backend,
            config,
            program,
            weights,
        })
    }

    /// The masked mean loss over `batches` and its perplexity.
    pub fn evaluate(&self, batches: &[Batch]) -> Result<EvalResult> {
        let c = &self.config;
        self.program
            .run(&self.backend, [c.batch, c.seq], batches, |k| {
                self.weights[k].as_ref().expect("weights are set")
            })
    }
}

/// The names of a laid-out step's outputs, in order.
fn output_names(laid: &ShardedStep) -> Vec<String> {
    laid.function()
        .outputs
        .iter()
        .map(|b| b.name.clone())
        .collect()
}
