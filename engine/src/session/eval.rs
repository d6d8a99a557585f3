//! The eval step: forward and summed loss over held-out batches, no
//! gradients, compiled once (JIT even when training eagerly) and fed the
//! train step's weights in place.

use hlo_data::Batch;
use hlo_models::adapter::Adapter;
use hlo_models::attention::AttentionKind;
use hlo_models::decoder::partition_rules;
use hlo_models::roles::{BatchField, Role};
use hlo_models::train::{eval_step, TrainConfig};
use hlo_runtime::{DeviceArray, HostArray, Mode, Program};

use super::{field_array, scalar, Session};
use crate::backend::Backend;
use crate::error::{EngineError, Result};
use crate::model::Model;
use crate::pipeline::ShardedStep;

/// The eval step and where its inputs come from.
pub(super) struct EvalProgram {
    program: Program,
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
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalResult {
    /// Masked mean cross-entropy over every counted token.
    pub loss: f64,
    pub tokens: f64,
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
        let rules = partition_rules();
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
        Ok(EvalProgram { program, sources })
    }
}

impl EvalProgram {
    /// The masked mean loss over `batches`; `state(k)` is the array of
    /// the weights at train-step input `k`.
    fn run<'a>(
        &self,
        backend: &Backend,
        dims: [i64; 2],
        batches: &[Batch],
        state: impl Fn(usize) -> &'a DeviceArray,
    ) -> Result<EvalResult> {
        let (mut sum, mut tokens) = (0.0f64, 0.0f64);
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
            sum += scalar(&out[0])?;
            tokens += scalar(&out[1])?;
        }
        Ok(EvalResult {
            loss: sum / tokens.max(1.0),
            tokens,
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
    pub fn new(
        backend: Backend,
        model: &Model,
        dtype: hlo_ir::DType,
        (batch, seq): (i64, i64),
        attention: AttentionKind,
        adapter: Option<&Adapter>,
    ) -> Result<Evaluator> {
        model.check_weights()?;
        let mut config =
            TrainConfig::new(dtype, batch, seq).with_lora(adapter.map(|a| a.lora.clone()));
        config.attention = attention;
        let traced = eval_step(&model.config, &config)?;
        let laid = ShardedStep::new(&traced, backend.mesh(), &partition_rules())?;
        let program = EvalProgram {
            program: laid.compile(&backend, Mode::Jit)?,
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
            // place of the base's; the model's for the rest.
            let lit = match (
                &laid.step.inputs[k].role,
                adapter.and_then(|a| a.get(&b.name)),
            ) {
                (Role::Batch(_), _) => {
                    weights.push(None);
                    continue;
                }
                (_, Some(t)) => t.clone(),
                (Role::Trainable, None) if adapter.is_some() => {
                    return Err(EngineError::AdapterLacks {
                        tensor: b.name.clone(),
                    })
                }
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
