//! A session's initial state: the model's weights (read, or random on the
//! host), a fresh or given adapter and zero optimizer state, placed a
//! chunk of tensors at a time; or synthetic values made on the devices.

use hlo_ir::{full, iota, trace, DType, Literal, Tensor, TensorType};
use hlo_models::adapter::Adapter;
use hlo_models::decoder::{initializer, is_stacked, stack_literals, unstacked_names, Init};
use hlo_models::roles::Role;
use hlo_partitioner::FunctionShardings;
use hlo_runtime::{DeviceArray, HostArray, Mode, Program};

use hlo_models::distill::step::teacher_of;
use hlo_models::preference::reference_of;

use super::Session;
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;

impl Session {
    /// The initial value of every input but the batch, made a chunk of
    /// tensors at a time on all cores (bounded host memory).
    pub(super) fn initial_state(
        &self,
        init_adapter: Option<&Adapter>,
        reference: Option<&Adapter>,
        teacher: Option<&Model>,
    ) -> Result<Vec<Option<DeviceArray>>> {
        let fresh;
        let adapter = match (&self.config.lora, init_adapter) {
            (Some(_), Some(a)) => Some(a),
            (Some(l), None) => {
                fresh = Adapter::init(&self.model.config, l, self.seed);
                Some(&fresh)
            }
            (None, _) => None,
        };
        let sources = Sources {
            adapter,
            fresh: init_adapter.is_none(),
            reference,
            teacher,
        };
        self.place_made(|k| self.initial_value(k, &sources))
    }

    /// Makes every input's value with `make` (None: an input left out),
    /// one chunk of as many inputs as there are cores at a time, each
    /// chunk's made in parallel and placed before the next is made: host
    /// memory holds one chunk's tensors at most.
    fn place_made(
        &self,
        make: impl Fn(usize) -> Result<Option<Literal>> + Sync,
    ) -> Result<Vec<Option<DeviceArray>>> {
        let make = &make;
        let inputs = self.step.function().inputs.len();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let order: Vec<usize> = (0..inputs).collect();
        let mut state = Vec::with_capacity(inputs);
        for chunk in order.chunks(threads) {
            let values: Vec<Result<Option<Literal>>> = std::thread::scope(|scope| {
                let handles: Vec<_> = chunk
                    .iter()
                    .map(|&k| scope.spawn(move || make(k)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(EngineError::Internal("making a weight panicked".into()))
                        })
                    })
                    .collect()
            });
            for (&k, value) in chunk.iter().zip(values) {
                state.push(match value? {
                    Some(lit) => Some(
                        self.backend
                            .place(&HostArray::from(lit), self.step.input_spec(k))?,
                    ),
                    None => None,
                });
            }
        }
        Ok(state)
    }

    /// Input `k`'s initial value on the host, by its role (None for the
    /// batch, which each step gives).
    fn initial_value(&self, k: usize, sources: &Sources) -> Result<Option<Literal>> {
        let f = self.step.function();
        let b = &f.inputs[k];
        let ty = f.ty(b.value).clone();
        Ok(Some(match &self.step().inputs[k].role {
            Role::Batch(_) => return Ok(None),
            Role::StepCounter => Literal::scalar(DType::I32, self.steps_done as f64),
            Role::OptimizerState { .. } => Literal::splat(ty, 0.0),
            Role::Trainable if self.config.lora.is_some() => {
                self.adapter_value(&b.name, sources)?
            }
            Role::Weight if teacher_of(&b.name).is_some() => {
                let (t, name) = sources
                    .teacher
                    .zip(teacher_of(&b.name))
                    .ok_or_else(|| EngineError::Internal(format!("no teacher for `{}`", b.name)))?;
                t.weight(name, self.config.dtype, self.seed)?
            }
            Role::Weight if reference_of(&b.name).is_some() => {
                let (r, name) = sources
                    .reference
                    .zip(reference_of(&b.name))
                    .ok_or_else(|| {
                        EngineError::Internal(format!("no reference adapter for `{}`", b.name))
                    })?;
                adapter_tensor(r, name, self.model.config.num_hidden_layers).ok_or_else(|| {
                    EngineError::AdapterLacks {
                        tensor: name.to_string(),
                    }
                })?
            }
            Role::Trainable | Role::Weight => {
                self.model.weight(&b.name, self.config.dtype, self.seed)?
            }
            other => {
                return Err(EngineError::Internal(format!(
                    "a train step has no {other:?} input"
                )))
            }
        }))
    }

    /// A LoRA session's trainable tensor `name`: the adapter's; for a
    /// fresh adapter, a module it saves whole starts as the base's weight
    /// (as PEFT copies them); else the adapter lacks it.
    fn adapter_value(&self, name: &str, sources: &Sources) -> Result<Literal> {
        let a = sources.adapter.expect("an adapter for a LoRA session");
        match adapter_tensor(a, name, self.model.config.num_hidden_layers) {
            Some(t) => Ok(t),
            None if sources.fresh
                && self
                    .config
                    .lora
                    .as_ref()
                    .is_some_and(|l| l.saves_weight(name)) =>
            {
                self.model.weight(name, self.config.dtype, self.seed)
            }
            None => Err(EngineError::AdapterLacks {
                tensor: name.to_string(),
            }),
        }
    }

    /// State made on the devices (see [`Weights::Synthetic`]).
    pub(super) fn synthetic_state(
        &self,
        teacher: Option<&Model>,
    ) -> Result<Vec<Option<DeviceArray>>> {
        let f = self.step.function();
        let mut state = Vec::with_capacity(f.inputs.len());
        for (k, b) in f.inputs.iter().enumerate() {
            let ty = f.ty(b.value).clone();
            let role = &self.step().inputs[k].role;
            // (A reference adapter's `ref.` tensors are LoRA tensors.)
            let base = (*role == Role::Weight && reference_of(&b.name).is_none())
                || (*role == Role::Trainable && self.config.lora.is_none());
            let fill = match role {
                Role::Batch(_) => {
                    state.push(None);
                    continue;
                }
                // A teacher's weights: read, or as its config initialises them.
                Role::Weight if teacher_of(&b.name).is_some() => {
                    let (t, name) = teacher.zip(teacher_of(&b.name)).ok_or_else(|| {
                        EngineError::Internal(format!("no teacher for `{}`", b.name))
                    })?;
                    match !t.is_random() {
                        true => {
                            let lit = t.weight(name, self.config.dtype, 0)?;
                            state.push(Some(
                                self.backend
                                    .place(&HostArray::from(lit), self.step.input_spec(k))?,
                            ));
                            continue;
                        }
                        false => initializer(&t.config, name, &ty),
                    }
                }
                _ if base && !self.model.is_random() => {
                    let lit = self.model.weight(&b.name, self.config.dtype, 0)?;
                    state.push(Some(
                        self.backend
                            .place(&HostArray::from(lit), self.step.input_spec(k))?,
                    ));
                    continue;
                }
                Role::StepCounter | Role::OptimizerState { .. } => Init::Zeros,
                _ => initializer(&self.model.config, &b.name, &ty),
            };
            let made = trace("init", &[] as &[(&str, TensorType)], |_| {
                vec![(
                    "x",
                    match fill {
                        Init::Zeros => full(ty.clone(), 0.0),
                        Init::Ones => full(ty.clone(), 1.0),
                        Init::Normal { std: scale } | Init::Uniform { bound: scale } => {
                            pattern(&ty, scale)
                        }
                    },
                )]
            })?;
            let shardings = FunctionShardings {
                mesh: self.backend.mesh().clone(),
                inputs: vec![],
                outputs: vec![self.step.input_spec(k).clone()],
            };
            let init = Program::compile(
                self.backend.client(),
                &made,
                shardings,
                &[],
                Mode::Jit,
                self.backend.devices(),
            )?;
            state.push(Some(init.run(&[])?.remove(0)));
        }
        Ok(state)
    }
}

/// Where [`Session::initial_state`] takes values from besides the model.
struct Sources<'a> {
    /// The LoRA session's adapter: the one given, or a fresh one.
    adapter: Option<&'a Adapter>,
    /// Whether `adapter` is fresh (none was given).
    fresh: bool,
    /// The reference adapter, for the step's `ref.` inputs.
    reference: Option<&'a Adapter>,
    /// The distillation teacher, for the step's `teacher.` inputs.
    teacher: Option<&'a Model>,
}

/// An adapter tensor by the step's name: stacked across layers for a
/// scan-over-layers step.
pub(crate) fn adapter_tensor(a: &Adapter, name: &str, layers: i64) -> Option<Literal> {
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

/// A deterministic, value-spread tensor made on the devices: `scale ·
/// sin(Σ_d i_d · c_d)`, each device computing its own block.
fn pattern(ty: &TensorType, scale: f64) -> Tensor {
    let f32t = ty.with_dtype(DType::F32);
    let consts = [12.9898, 78.233, 37.719, 4.581];
    let mut h = full(f32t.clone(), 0.25);
    for d in 0..ty.rank() {
        h = h + iota(f32t.clone(), d as i64) * consts[d % consts.len()];
    }
    (h.sin() * scale).cast(ty.dtype)
}
