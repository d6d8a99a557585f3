//! A preference run's reference log-probabilities computed once, before
//! training (`--precompute-ref`): the reference (the base, or the base
//! with a reference adapter) scores every pair's two sides in a compiled
//! forward of its own, whose weights are placed for it and freed before the
//! train step's state is placed, so the reference occupies no device memory
//! during training and its forward leaves the step.

use hlo_data::{eval_pair_batches, PreferencePair};
use hlo_ir::Literal;
use hlo_models::adapter::Adapter;
use hlo_models::decoder::partition_rules;
use hlo_models::roles::Role;
use hlo_models::train::{reference_logps_step, TrainConfig};
use hlo_runtime::{DeviceArray, HostArray, Mode};

use crate::device::backend::Backend;
use crate::device::pipeline::ShardedStep;
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::train::session::field_array;

/// Each pair's reference log-probabilities (chosen, rejected), summed over
/// its completion's tokens within rows of `tc.seq`, in the order of
/// `pairs`; computed `tc.batch / 2` pairs at a time by `model` (its random
/// weights, without a checkpoint, drawn with `seed` as the session's are;
/// with `adapter`, a frozen reference adapter) on `backend`'s mesh.
pub fn precompute(
    backend: &Backend,
    model: &Model,
    tc: &TrainConfig,
    adapter: Option<&Adapter>,
    pairs: &[PreferencePair],
    seed: u64,
) -> Result<Vec<[f32; 2]>> {
    let traced = reference_logps_step(&model.config, tc, adapter.map(|a| &a.lora))?;
    let laid = ShardedStep::new(&traced, backend.mesh(), &partition_rules(&model.config))?;
    let program = laid.compile(backend, Mode::Jit)?;
    let f = laid.function();
    let mut weights: Vec<Option<DeviceArray>> = Vec::with_capacity(f.inputs.len());
    for (k, b) in f.inputs.iter().enumerate() {
        let lit: Literal = match (&laid.step.inputs[k].role, adapter) {
            (Role::Batch(_), _) => {
                weights.push(None);
                continue;
            }
            (Role::Trainable, Some(a))
                if b.name.ends_with("lora_a") || b.name.ends_with("lora_b") =>
            {
                crate::train::session::adapter_tensor(a, &b.name, model.config.num_hidden_layers)
                    .ok_or_else(|| EngineError::AdapterLacks {
                        tensor: b.name.clone(),
                    })?
            }
            _ => model.weight(&b.name, tc.dtype, seed)?,
        };
        weights.push(Some(
            backend.place(&HostArray::from(lit), laid.input_spec(k))?,
        ));
    }
    let per_batch = (tc.batch / 2) as usize;
    let dims = [tc.batch, tc.seq];
    let mut out = Vec::with_capacity(pairs.len());
    for (k, batch) in eval_pair_batches(pairs, tc.seq as usize, per_batch, None)
        .iter()
        .enumerate()
    {
        let placed: Vec<Option<DeviceArray>> = laid
            .step
            .inputs
            .iter()
            .enumerate()
            .map(|(j, input)| match input.role {
                Role::Batch(field) => {
                    let host = field_array(batch, field, &dims)?;
                    Ok(Some(backend.place(&host, laid.input_spec(j))?))
                }
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        let inputs: Vec<&DeviceArray> = weights
            .iter()
            .zip(&placed)
            .map(|(w, p)| w.as_ref().or(p.as_ref()).expect("every input is placed"))
            .collect();
        let logps = program.run(&inputs)?[0].gather()?.to_f64_vec();
        let here = (pairs.len() - k * per_batch).min(per_batch);
        for row in 0..here {
            out.push([logps[row] as f32, logps[per_batch + row] as f32]);
        }
    }
    Ok(out)
}
