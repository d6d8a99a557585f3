//! A reward model's scores of whole sequences: its classifier's one logit
//! at each sequence's last token that is not padding, compiled once over
//! the model's weights (and an adapter's, unmerged), as `hlo-train
//! score` runs it.

use hlo_data::{Batch, Example};
use hlo_models::adapter::Adapter;
use hlo_models::decoder::{partition_rules, Head};
use hlo_models::reward::step::score_step;
use hlo_models::roles::{BatchField, Role};
use hlo_models::train::TrainConfig;
use hlo_runtime::{DeviceArray, HostArray, Mode, Program};

use crate::device::backend::Backend;
use crate::device::pipeline::ShardedStep;
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::train::session::field_array;

/// A compiled scoring program with its weights placed.
pub struct RewardScorer {
    backend: Backend,
    program: Program,
    /// Per input: its placed weight, or the batch field it takes.
    inputs: Vec<Result<DeviceArray, BatchField>>,
    specs: Vec<hlo_partitioner::PartitionSpec>,
    rows: i64,
    seq: i64,
    vocab: i64,
}

impl RewardScorer {
    /// Compiles the scores of `rows` sequences of up to `seq` tokens a
    /// call for `model` (a sequence classifier: see
    /// [`Model::as_reward_model`]) with `adapter`, unmerged, and places
    /// the weights. A causal LM made a classifier has no trained head
    /// unless the adapter brings it: refused.
    pub fn new(
        backend: Backend,
        model: &Model,
        dtype: hlo_ir::DType,
        (rows, seq): (i64, i64),
        adapter: Option<&Adapter>,
    ) -> Result<RewardScorer> {
        let trained_head = adapter.is_some_and(|a| a.get(hlo_models::decoder::SCORE).is_some())
            || model
                .checkpoint
                .as_ref()
                .is_some_and(|c| c.config.head != Head::CausalLm);
        if !trained_head {
            return Err(EngineError::Objective {
                objective: "reward",
                why: format!(
                    "{} has no trained score head: give a reward model's checkpoint, or --adapter a reward run's adapter",
                    model.name
                ),
            });
        }
        model.check_weights()?;
        let tc = TrainConfig::new(dtype, rows, seq).with_lora(adapter.map(|a| a.lora.clone()));
        let traced = score_step(&model.config, &tc)?;
        let laid = ShardedStep::new(&traced, backend.mesh(), &partition_rules(&model.config))?;
        let program = laid.compile(&backend, Mode::Jit)?;
        let f = laid.function();
        let mut inputs = Vec::with_capacity(f.inputs.len());
        let mut specs = Vec::with_capacity(f.inputs.len());
        for (k, b) in f.inputs.iter().enumerate() {
            specs.push(laid.input_spec(k).clone());
            let lit = match (
                &laid.step.inputs[k].role,
                adapter.and_then(|a| a.get(&b.name)),
            ) {
                (Role::Batch(field), _) => {
                    inputs.push(Err(*field));
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
            inputs.push(Ok(backend.place(&HostArray::from(lit), laid.input_spec(k))?));
        }
        Ok(RewardScorer {
            backend,
            program,
            inputs,
            specs,
            rows,
            seq,
            vocab: model.config.vocab_size,
        })
    }

    /// The reward of each sequence (each at most `seq` tokens, refused
    /// otherwise), `rows` at a time.
    pub fn score(&self, sequences: &[Vec<u32>]) -> Result<Vec<f64>> {
        let (rows, seq) = (self.rows as usize, self.seq as usize);
        if let Some(long) = sequences.iter().find(|s| s.len() > seq || s.is_empty()) {
            return Err(EngineError::Objective {
                objective: "reward",
                why: format!(
                    "a sequence of {} tokens: scored sequences hold 1 to --seq {seq}",
                    long.len()
                ),
            });
        }
        if let Some(t) = sequences
            .iter()
            .flatten()
            .find(|&&t| i64::from(t) >= self.vocab)
        {
            return Err(EngineError::Objective {
                objective: "reward",
                why: format!(
                    "token id {t} is outside the reward model's vocabulary of {}",
                    self.vocab
                ),
            });
        }
        let mut out = Vec::with_capacity(sequences.len());
        for chunk in sequences.chunks(rows) {
            let mut batch = Batch::empty(rows, seq);
            for (r, ids) in chunk.iter().enumerate() {
                let ex = Example {
                    target: vec![true; ids.len()],
                    ids: ids.clone(),
                };
                batch.put_row(&ex, r, seq);
            }
            let placed = self
                .inputs
                .iter()
                .zip(&self.specs)
                .map(|(input, spec)| match input {
                    Ok(_) => Ok(None),
                    Err(field) => {
                        let host = field_array(&batch, *field, &[self.rows, self.seq])?;
                        Ok(Some(self.backend.place(&host, spec)?))
                    }
                })
                .collect::<Result<Vec<_>>>()?;
            let args: Vec<&DeviceArray> = self
                .inputs
                .iter()
                .zip(&placed)
                .map(|(input, p)| match (input, p) {
                    (Ok(w), _) => w,
                    (Err(_), Some(p)) => p,
                    (Err(_), None) => unreachable!("every batch field is placed"),
                })
                .collect();
            let scores = self.program.run(&args)?[0].gather()?.to_f64_vec();
            out.extend(scores.into_iter().take(chunk.len()));
        }
        Ok(out)
    }
}
