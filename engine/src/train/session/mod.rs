//! A training session: the train step traced for a model and settings,
//! laid out over the backend's mesh and compiled once (JIT or eager), its
//! state (weights, trainable parameters, optimizer moments, step counter)
//! placed on the devices, batches placed beside it, steps launched without
//! waiting, and the held-out loss computed by a compiled eval step.
//!
//! What a session holds is told apart by the step's typed input roles,
//! never by names. The loop around it is [`crate::train::trainer::Trainer`]; saving and
//! resuming is [`crate::train::checkpoint`]. Its initial state is made in
//! `init.rs`, its eval step lives in `eval.rs`.

mod eval;
mod init;

pub(crate) use init::adapter_tensor;

use eval::EvalProgram;
pub use eval::{EvalResult, Evaluator};

use std::time::Instant;

use hlo_data::Batch;
use hlo_ir::{Literal, TensorType};
use hlo_models::adapter::Adapter;
use hlo_models::decoder::{is_stacked, unstack_literal, unstacked_names};
use hlo_models::roles::{BatchField, Role, Step};
use hlo_models::train::{batch_fields, step_flops, TrainConfig};
use hlo_partitioner::Sharding;
use hlo_runtime::{
    CompiledMemoryStats, DeviceArray, EagerStats, HostArray, Mode, Observer, Program, ReadyTime,
};

use crate::device::backend::Backend;
use crate::device::pipeline::ShardedStep;
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;
use crate::train::checkpoint::sharded::StateArray;
use crate::train::checkpoint::SavedTensors;

/// Where the state's initial values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weights {
    /// The model's weights (checkpoint, or random on the host, seeded), a
    /// fresh or given adapter, zero optimizer state.
    FromModel,
    /// Made on the devices from a cheap deterministic pattern scaled as
    /// the initialiser would (base weights still read from a checkpoint
    /// when there is one): for timing models of any size without host
    /// memory.
    Synthetic,
}

/// How a session is built.
pub struct SessionOptions {
    pub mode: Mode,
    /// Seed of random weights and of a fresh adapter.
    pub seed: u64,
    /// Start LoRA from these tensors (their settings must be the
    /// session's).
    pub init_adapter: Option<Adapter>,
    /// A preference loss's frozen reference adapter (its `ref.` inputs).
    pub reference_adapter: Option<Adapter>,
    /// A distillation's teacher (its `teacher.` inputs).
    pub teacher: Option<Model>,
    /// Also compile the eval step (always JIT).
    pub eval: bool,
    pub weights: Weights,
    /// The step to compile instead when the given one fails to compile
    /// (cuDNN's attention chosen under `auto`: the same step with XLA's
    /// attention); see [`Session::fell_back`].
    pub fallback: Option<TrainConfig>,
    /// The step compiled earlier (`train --executable`), loaded in place
    /// of compiling it; refused unless it is this step for these devices.
    pub executable: Option<std::sync::Arc<crate::device::compiled::CompiledStep>>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            mode: Mode::Jit,
            seed: 0,
            init_adapter: None,
            reference_adapter: None,
            teacher: None,
            eval: false,
            weights: Weights::FromModel,
            fallback: None,
            executable: None,
        }
    }
}

/// A batch on the devices, laid out as the step expects.
pub struct PlacedBatch {
    /// (input index, array), one per batch field.
    fields: Vec<(usize, DeviceArray)>,
    /// Tokens whose prediction counts.
    pub targets: usize,
    /// Slots holding a real token, over all slots.
    pub fill: f64,
    /// Rows × sequence length: the tokens the step processes.
    pub tokens: usize,
    /// Figures measured making the batch, reported with its step.
    pub metrics: Vec<(String, f64)>,
    /// Samples of it to show.
    pub samples: Vec<serde_json::Value>,
}

/// A step that has been launched; its figures are read later.
pub struct Launched {
    /// The step number this launch makes (1 for the first step).
    pub step: i64,
    pub loss: DeviceArray,
    pub grad_norm: DeviceArray,
    pub lr: DeviceArray,
    /// The loss's own metrics (a preference loss's, by TRL's names).
    pub metrics: Vec<(String, DeviceArray)>,
    pub targets: usize,
    pub tokens: usize,
    /// The batch's own figures and samples ([`PlacedBatch::metrics`]).
    pub host_metrics: Vec<(String, f64)>,
    pub samples: Vec<serde_json::Value>,
    /// When the host launched it.
    pub launched: Instant,
    /// When its results were computed, as the devices report it.
    ready: Vec<ReadyTime>,
}

impl Launched {
    /// The moment the devices finished the step (waits for it).
    pub fn finished(&self) -> Instant {
        self.ready
            .iter()
            .map(ReadyTime::wait)
            .max()
            .unwrap_or_else(Instant::now)
    }
}

/// The train step compiled for a mesh, and its state on the devices.
pub struct Session {
    backend: Backend,
    model: Model,
    config: TrainConfig,
    step: ShardedStep,
    program: Program,
    eval: Option<EvalProgram>,
    /// One per step input; batch inputs are None (batches are passed in).
    state: Vec<Option<DeviceArray>>,
    steps_done: i64,
    compile_s: f64,
    seed: u64,
    /// Why the step given failed to compile, when its fallback was
    /// compiled instead.
    fell_back: Option<String>,
}

/// Loads `compiled` into `backend`'s client as `step`'s program (the
/// step's next compile then takes it), or refuses it: not this step, not
/// these devices, not this plugin.
fn preload(
    backend: &Backend,
    model: &Model,
    config: &TrainConfig,
    step: &ShardedStep,
    compiled: &crate::device::compiled::CompiledStep,
) -> Result<()> {
    let program = step.stablehlo();
    let settings = crate::train::checkpoint::step_settings(model, config, backend.mesh());
    compiled.check(backend, &program, &settings)?;
    let options = hlo_runtime::CompileOptions::spmd(backend.mesh().size());
    let loaded = backend
        .client()
        .load_serialized(&compiled.executable, &options)?;
    backend
        .client()
        .preload(hlo_runtime::program_fingerprint(&program), loaded);
    Ok(())
}

impl Session {
    /// Traces the step for `model` under `config`, lays it out over the
    /// backend's mesh, compiles it, and places the initial state.
    pub fn new(
        backend: Backend,
        model: Model,
        config: TrainConfig,
        options: SessionOptions,
    ) -> Result<Session> {
        if options.weights == Weights::FromModel {
            model.check_weights()?;
        }
        let compile = |config: &TrainConfig| -> Result<(ShardedStep, Program)> {
            let step = ShardedStep::train(&model.config, config, backend.mesh())?;
            if let Some(compiled) = &options.executable {
                preload(&backend, &model, config, &step, compiled)?;
            }
            let program = step.compile(&backend, options.mode)?;
            Ok((step, program))
        };
        let t0 = Instant::now();
        let mut config = config;
        let mut fell_back = None;
        let (step, program) = match (compile(&config), options.fallback) {
            (Ok(compiled), _) => compiled,
            (Err(e), Some(other)) => {
                fell_back = Some(e.to_string());
                config = other;
                compile(&config)?
            }
            (Err(e), None) => return Err(e),
        };
        let eval = if options.eval {
            Some(EvalProgram::build(&model, &config, &backend, &step)?)
        } else {
            None
        };
        let compile_s = t0.elapsed().as_secs_f64();
        let mut session = Session {
            backend,
            model,
            config,
            step,
            program,
            eval,
            state: Vec::new(),
            steps_done: 0,
            compile_s,
            seed: options.seed,
            fell_back,
        };
        session.state = match options.weights {
            Weights::FromModel => session.initial_state(
                options.init_adapter.as_ref(),
                options.reference_adapter.as_ref(),
                options.teacher.as_ref(),
            )?,
            Weights::Synthetic => session.synthetic_state(options.teacher.as_ref())?,
        };
        Ok(session)
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Why the step asked for failed to compile, when the session
    /// compiled its fallback ([`SessionOptions::fallback`]) instead.
    pub fn fell_back(&self) -> Option<&str> {
        self.fell_back.as_deref()
    }

    /// Waits until the last launched step has updated the trained
    /// parameters (its outputs are ready): what a program reading them
    /// between steps waits for anyway, made explicit so its own time can
    /// be measured apart.
    pub(crate) fn wait_trained(&self) -> Result<()> {
        for k in self.step().inputs_where(|r| *r == Role::Trainable) {
            if let Some(a) = self.state.get(k).and_then(Option::as_ref) {
                for t in a.ready_times()? {
                    t.wait();
                }
            }
        }
        Ok(())
    }

    /// The array the step reads as input `name` now (weights, trainable
    /// parameters, optimizer state; not a batch field), and its layout:
    /// what a program run between steps (GRPO's generation) reads in
    /// place, with no copy.
    pub fn array(&self, name: &str) -> Option<&DeviceArray> {
        let f = self.step.function();
        let k = f.inputs.iter().position(|b| b.name == name)?;
        self.state.get(k)?.as_ref()
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The traced step, as compiled, with its roles.
    pub fn step(&self) -> &Step {
        &self.step.step
    }

    /// The step laid out over the mesh (for printing it).
    pub fn sharded_step(&self) -> &ShardedStep {
        &self.step
    }

    /// The seed of random weights and of a fresh adapter.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Steps taken so far (restored ones included).
    pub fn steps_done(&self) -> i64 {
        self.steps_done
    }

    /// Seconds spent compiling the step (and the eval step).
    pub fn compile_s(&self) -> f64 {
        self.compile_s
    }

    pub fn mode(&self) -> Mode {
        self.program.mode()
    }

    pub fn has_eval(&self) -> bool {
        self.eval.is_some()
    }

    /// FLOPs of one step as MaxText counts them (see
    /// [`hlo_models::train::step_flops`]).
    pub fn step_flops(&self) -> f64 {
        step_flops(&self.model.config, &self.config)
    }

    /// Tokens a step processes (rows × sequence length, padding included).
    pub fn tokens_per_step(&self) -> usize {
        (self.config.rows() * self.config.seq) as usize
    }

    pub fn compiled_memory_stats(&self) -> Result<Option<CompiledMemoryStats>> {
        Ok(self.program.compiled_memory_stats()?)
    }

    pub fn eager_stats(&self) -> Option<EagerStats> {
        self.program.eager_stats()
    }

    /// Replaces the checkpointed state (trainable parameters, optimizer
    /// state, step counter) with `tensors`, by name; every checkpointed
    /// input must be there with its type.
    pub fn restore(&mut self, tensors: &[(String, Literal)]) -> Result<()> {
        let f = self.step.function().clone();
        let mut steps = None;
        for k in self.step().inputs_where(Role::is_checkpointed) {
            let b = &f.inputs[k];
            let want = f.ty(b.value);
            let lit = tensors.iter().find(|(n, _)| n == &b.name).map(|(_, l)| l);
            check_saved(&b.name, lit.map(|l| &l.ty), want)?;
            let lit = lit.expect("checked");
            if self.step().inputs[k].role == Role::StepCounter {
                steps = lit.to_f64s().first().map(|&s| s as i64);
            }
            self.state[k] = Some(
                self.backend
                    .place(&HostArray::from(lit.clone()), self.step.input_spec(k))?,
            );
        }
        if let Some(s) = steps {
            self.steps_done = s;
        }
        Ok(())
    }

    /// Restores a saved run's tensors: whole ones as
    /// [`Session::restore`]; a sharded state block by block, each device
    /// reading only its block from the saved blocks it overlaps (any mesh
    /// and process count).
    /// Returns the bytes placed on this process's devices (each distinct
    /// block once).
    pub fn restore_saved(&mut self, saved: &SavedTensors) -> Result<u64> {
        let state = match saved {
            SavedTensors::Whole(tensors) => {
                self.restore(tensors)?;
                return Ok(tensors.iter().map(|(_, l)| l.bytes.len() as u64).sum());
            }
            SavedTensors::Sharded(state) => state,
        };
        let mut bytes = 0u64;
        let f = self.step.function().clone();
        let wanted = self.step().inputs_where(Role::is_checkpointed);
        // A tensor the step does not have (a layer past the model's, say)
        // is refused, not left unread.
        let names: std::collections::HashSet<&str> =
            wanted.iter().map(|&k| f.inputs[k].name.as_str()).collect();
        if let Some(extra) = state
            .manifest()
            .tensors
            .keys()
            .find(|n| !names.contains(n.as_str()))
        {
            return Err(EngineError::Resume(format!(
                "the saved state holds `{extra}`, which the run's model and step do not have"
            )));
        }
        for k in wanted {
            let b = &f.inputs[k];
            let want = f.ty(b.value);
            check_saved(&b.name, state.tensor_type(&b.name)?.as_ref(), want)?;
            let spec = self.step.input_spec(k).clone();
            let array = self.backend.place_blocks(want, &spec, |at, dims| {
                let block = state.read_region(&b.name, at, dims)?;
                bytes += block.bytes().len() as u64;
                Ok(block)
            })?;
            if self.step().inputs[k].role == Role::StepCounter {
                self.steps_done = scalar(&array)? as i64;
            }
            self.state[k] = Some(array);
        }
        Ok(bytes)
    }

    /// The rows of each batch this process fills (a flag per row of the
    /// loader's `batch × grad_accum`): those its devices hold under the
    /// step's batch layout. None when it holds every row (one process,
    /// or rows replicated).
    pub(crate) fn owned_rows(&self) -> Result<Option<Vec<bool>>> {
        let Some(k) = self.step().batch_input(BatchField::InputIds) else {
            return Ok(None);
        };
        let f = self.step.function();
        let dims = &f.ty(f.inputs[k].value).dims;
        let mut held = Vec::new();
        for (d, device) in self.backend.devices().iter().enumerate() {
            if device.is_addressable()? {
                held.push(d);
            }
        }
        let sharding = Sharding::new(self.backend.mesh().clone(), self.step.input_spec(k).clone());
        let rows = hlo_runtime::rows_held(&sharding, dims, &held);
        Ok((!rows.iter().all(|&r| r)).then_some(rows))
    }

    /// The checkpointed state on the devices (trainable parameters,
    /// optimizer state, step counter), under the step's names: what a
    /// sharded save writes.
    pub fn state_arrays(&self) -> Vec<StateArray<'_>> {
        let f = self.step.function();
        self.step()
            .inputs_where(Role::is_checkpointed)
            .into_iter()
            .map(|k| StateArray {
                name: f.inputs[k].name.clone(),
                role: match self.step().inputs[k].role {
                    Role::Trainable => "parameter",
                    Role::OptimizerState { .. } => "optimizer",
                    Role::StepCounter => "step",
                    _ => "state",
                },
                array: self.state[k].as_ref().expect("state is set"),
            })
            .collect()
    }

    /// Places `batch` ([rows, seq] vectors; [K, batch, seq] under gradient
    /// accumulation) as the step expects it.
    pub(crate) fn place_batch(&self, batch: &Batch) -> Result<PlacedBatch> {
        let c = &self.config;
        let dims = if c.grad_accum > 1 {
            vec![c.grad_accum, c.batch, c.seq]
        } else {
            vec![c.batch, c.seq]
        };
        let mut fields = Vec::new();
        for field in batch_fields(c) {
            let k = self
                .step()
                .batch_input(field)
                .expect("the step takes each of its batch fields");
            let host = field_array(batch, field, &dims)?;
            fields.push((k, self.backend.place(&host, self.step.input_spec(k))?));
        }
        Ok(PlacedBatch {
            fields,
            targets: batch.targets,
            fill: batch.fill(),
            tokens: self.tokens_per_step(),
            metrics: Vec::new(),
            samples: Vec::new(),
        })
    }

    /// Launches one step on `batch` without waiting for it; the state is
    /// updated in place (donated).
    pub fn launch(&mut self, batch: &PlacedBatch) -> Result<Launched> {
        self.launch_observed(batch, None)
    }

    /// [`Session::launch`]; in eager mode `observe` sees every node's
    /// results.
    pub(crate) fn launch_observed(
        &mut self,
        batch: &PlacedBatch,
        observe: Option<&mut Observer>,
    ) -> Result<Launched> {
        let launched = Instant::now();
        let outputs = {
            let inputs: Vec<&DeviceArray> = self
                .state
                .iter()
                .enumerate()
                .map(|(k, a)| match a {
                    Some(a) => a,
                    None => {
                        &batch
                            .fields
                            .iter()
                            .find(|(j, _)| *j == k)
                            .expect("every batch field is placed")
                            .1
                    }
                })
                .collect();
            self.program.run_observed(&inputs, observe)?
        };
        // JIT: every output is ready at once, the loss stands for all.
        // Eager: the last output made marks the end.
        let ready = match self.program.mode() {
            Mode::Jit => outputs[self.output("loss")].ready_times()?,
            Mode::Eager => {
                let mut all = Vec::new();
                for o in &outputs {
                    all.extend(o.ready_times()?);
                }
                all
            }
        };
        let mut outputs: Vec<Option<DeviceArray>> = outputs.into_iter().map(Some).collect();
        let mut take = |name: &str| -> DeviceArray {
            let k = self
                .step
                .step
                .output(name)
                .expect("the train step has this output");
            outputs[k].take().expect("each output is taken once")
        };
        let (loss, grad_norm, lr) = (take("loss"), take("grad_norm"), take("lr"));
        // Donated inputs were consumed: the outputs take their places.
        for &(input, output) in &self.step.step.donated {
            self.state[input] = outputs[output].take();
        }
        // What is left: the loss's metrics, in the step's order.
        let names = &self.step.function().outputs;
        let metrics = names
            .iter()
            .zip(outputs)
            .filter_map(|(b, a)| Some((b.name.clone(), a?)))
            .collect();
        self.steps_done += 1;
        Ok(Launched {
            step: self.steps_done,
            loss,
            grad_norm,
            lr,
            metrics,
            targets: batch.targets,
            tokens: batch.tokens,
            host_metrics: batch.metrics.clone(),
            samples: batch.samples.clone(),
            launched,
            ready,
        })
    }

    fn output(&self, name: &str) -> usize {
        self.step().output(name).expect("the step has this output")
    }

    /// The checkpointed state (trainable parameters, optimizer state, step
    /// counter) gathered to the host, under the step's names.
    pub fn checkpoint_tensors(&self) -> Result<Vec<(String, Literal)>> {
        self.gather(Role::is_checkpointed)
    }

    /// The state whose role satisfies `keep`, gathered to the host under
    /// the step's names.
    fn gather(&self, keep: impl Fn(&Role) -> bool) -> Result<Vec<(String, Literal)>> {
        let f = self.step.function();
        self.step()
            .inputs_where(keep)
            .into_iter()
            .map(|k| {
                let a = self.state[k].as_ref().expect("state is set");
                Ok((f.inputs[k].name.clone(), Literal::from(a.gather()?)))
            })
            .collect()
    }

    /// The trained parameters gathered to the host, per layer (stacked
    /// tensors split back into their layers' names).
    pub fn trained_tensors(&self) -> Result<Vec<(String, Literal)>> {
        Ok(unstack_all(self.gather(|r| *r == Role::Trainable)?))
    }

    /// The trained adapter (None when finetuning fully).
    pub fn adapter(&self) -> Result<Option<Adapter>> {
        match &self.config.lora {
            Some(l) => Ok(Some(Adapter {
                lora: l.clone(),
                tensors: self.trained_tensors()?,
            })),
            None => Ok(None),
        }
    }
}

/// A saved state holds input `name` (its type `saved`), of the type
/// `want` the step needs.
fn check_saved(name: &str, saved: Option<&TensorType>, want: &TensorType) -> Result<()> {
    match saved {
        None => Err(EngineError::Resume(format!(
            "the saved state has no `{name}`"
        ))),
        Some(ty) if ty != want => Err(EngineError::Resume(format!(
            "`{name}` is saved as {ty}, the step needs {want}"
        ))),
        Some(_) => Ok(()),
    }
}

/// One field of `batch` as a host array of `dims`.
pub(crate) fn field_array(batch: &Batch, field: BatchField, dims: &[i64]) -> Result<HostArray> {
    Ok(match field {
        BatchField::InputIds => HostArray::new(dims, &batch.ids)?,
        BatchField::LossMask => HostArray::new(dims, &batch.loss_mask)?,
        BatchField::Positions => HostArray::new(dims, &batch.positions)?,
        BatchField::SegmentIds => HostArray::new(dims, &batch.segment_ids)?,
        // One per row: the dims less the sequence.
        BatchField::RefLogps => HostArray::new(&dims[..dims.len() - 1], &batch.ref_logps)?,
        BatchField::Advantages => HostArray::new(&dims[..dims.len() - 1], &batch.advantages)?,
        BatchField::OldLogps => HostArray::new(dims, &batch.old_logps)?,
        BatchField::RefTokenLogps => HostArray::new(dims, &batch.ref_token_logps)?,
        BatchField::Desirable => HostArray::new(&dims[..dims.len() - 1], &batch.desirable)?,
        BatchField::Margin => HostArray::new(&dims[..dims.len() - 1], &batch.margin)?,
    })
}

/// A scalar array's value.
pub(crate) fn scalar(a: &DeviceArray) -> Result<f64> {
    Ok(a.gather()?
        .to_f64_vec()
        .first()
        .copied()
        .unwrap_or(f64::NAN))
}

/// Stacked tensors split back into their layers' names.
pub(crate) fn unstack_all(tensors: Vec<(String, Literal)>) -> Vec<(String, Literal)> {
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
