//! What the train step holds in each device's memory, before renting the
//! devices: the step is traced from abstract shapes (no weights), laid out
//! over the mesh, compiled on the CPU plugin with as many virtual devices,
//! and XLA's compiled memory figures are read beside the per-device shares
//! of weights, adapters and optimizer state counted from the layouts.
//! A step that does not fit a device's memory gets the nearest settings
//! that do, each planned the same way ([`nearest_fits`]).

use std::time::Instant;

use hlo_ir::DType;
use hlo_models::attention::{default_block, AttentionKind};
use hlo_models::decoder::decode_step;
use hlo_models::decoder::{partition_rules, ModelConfig};
use hlo_models::nf4;
use hlo_models::preference::Reference;
use hlo_models::roles::Role;
use hlo_models::train::{step_flops, TrainConfig};
use hlo_partitioner::{Mesh, PartitionSpec};
use hlo_runtime::{CompiledMemoryStats, Mode, PluginSpec};

use crate::analysis::hardware::Device;
use crate::device::backend::Backend;
use crate::device::pipeline::ShardedStep;
use crate::device::target::TargetCompiler;
use crate::error::Result;
use crate::infer::generator::{cache_bucket, cache_spec, prompt_bucket};
use crate::inputs::model::quantized_config;
use crate::objectives::Objective;
use crate::objectives::{Data, ObjectiveSpecs};
use crate::step::policy::Target;
use crate::step::{OptimSpec, RematChoice, StepSpec};

/// A train step's compute time at a device's data sheet peak.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeEstimate {
    /// Dense peak of one device for the step's dtype.
    pub peak_tflops: f64,
    /// The step's FLOPs ([`step_flops`]), shared evenly over the mesh's
    /// devices, at that peak.
    pub ms: f64,
}

/// The compute time of the step of `config` under `tc` on `mesh` of
/// `device`s, None when the table has no peak for it (the host's is
/// measured, not planned).
pub fn compute_estimate(
    config: &ModelConfig,
    tc: &TrainConfig,
    mesh: &Mesh,
    device: &Device,
) -> Option<ComputeEstimate> {
    let peak_tflops = device.peak_tflops(tc.dtype)?;
    let ms = step_flops(config, tc) / mesh.size() as f64 / (peak_tflops * 1e12) * 1e3;
    Some(ComputeEstimate { peak_tflops, ms })
}

/// Tokens a parameter of a compute-optimal budget (Chinchilla: Hoffmann
/// et al. 2022), what LLM Foundry trained its MPT models to.
pub(crate) const CHINCHILLA_TOKENS_PER_PARAMETER: f64 = 20.0;

/// What a step's compute bounds a run's throughput to, and the time to a
/// compute-optimal token budget at an assumed MFU.
///
/// ```
/// use hlo_engine::analysis::plan::{ComputeEstimate, Throughput};
/// let t = Throughput::of(1_000_000_000, 16_384, ComputeEstimate { peak_tflops: 989.0, ms: 100.0 }, Some(50.0));
/// assert_eq!(t.bound_tokens_per_s(), 163_840.0);
/// assert_eq!(t.tokens_per_s(0.5), 81_920.0);
/// assert_eq!(t.budget_tokens, 20e9);
/// assert_eq!(t.mfu_unoverlapped(), Some(100.0 / 150.0));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Throughput {
    /// Tokens a step takes (every row of every micro-batch).
    pub tokens_per_step: i64,
    pub compute: ComputeEstimate,
    /// The step's communication at the links' peak (None: a link of
    /// unknown speed).
    pub communication_ms: Option<f64>,
    /// The compute-optimal budget of the model's parameters.
    pub budget_tokens: f64,
}

impl Throughput {
    pub fn of(
        parameters: i64,
        tokens_per_step: i64,
        compute: ComputeEstimate,
        communication_ms: Option<f64>,
    ) -> Throughput {
        Throughput {
            tokens_per_step,
            compute,
            communication_ms,
            budget_tokens: CHINCHILLA_TOKENS_PER_PARAMETER * parameters as f64,
        }
    }

    /// Tokens/s with every device at its peak (MFU 100%), communication
    /// hidden behind compute: no run does better.
    pub fn bound_tokens_per_s(&self) -> f64 {
        self.tokens_per_s(1.0)
    }

    /// Tokens/s at MFU `mfu` (0 to 1).
    pub fn tokens_per_s(&self, mfu: f64) -> f64 {
        self.tokens_per_step as f64 * mfu / (self.compute.ms / 1e3)
    }

    /// The MFU left when communication is not overlapped at all (compute
    /// then communication, both at peak).
    pub fn mfu_unoverlapped(&self) -> Option<f64> {
        Some(self.compute.ms / (self.compute.ms + self.communication_ms?))
    }

    /// Hours to the compute-optimal budget at MFU `mfu`.
    pub fn budget_hours(&self, mfu: f64) -> f64 {
        self.budget_tokens / self.tokens_per_s(mfu) / 3600.0
    }
}

/// Bytes per device.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    /// Frozen (or, finetuning fully, trained) base weights.
    pub weights_bytes: u64,
    /// The part of `weights_bytes` held in NF4 (codes and block scales).
    pub nf4_bytes: u64,
    /// The largest projection one device dequantizes (in the compute
    /// dtype) just before its matmul: a temporary within XLA's.
    pub dequantized_bytes: u64,
    /// LoRA parameters.
    pub lora_bytes: u64,
    /// Optimizer moments.
    pub optimizer_bytes: u64,
    /// XLA's figures for the compiled step.
    pub xla: CompiledMemoryStats,
    /// Arguments + outputs − aliased + temporaries.
    pub total_bytes: u64,
    /// Seconds XLA took to compile the step.
    pub compile_s: f64,
    /// Which compiler's figures these are.
    pub compiled_by: CompiledBy,
    /// GRPO: what generating the rollouts holds, beside the state; the
    /// total is then the larger of the step's and the rollouts'.
    pub rollout: Option<RolloutMemory>,
}

/// Which compiler gave a plan's figures.
#[derive(Clone, Debug, PartialEq)]
pub enum CompiledBy {
    /// The CPU plugin, with as many virtual devices as the mesh; `why`
    /// the target's own compiler did not (None: none was asked for).
    Cpu { why: Option<String> },
    /// XLA's compiler for the target GPU ([`TargetCompiler::describe`]).
    Target { compiler: String },
}

/// GRPO's rollouts as a plan sees them: each step generates `--batch`
/// completions of up to `max_completion_length` tokens after prompts
/// filling the rest of a row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RolloutShape {
    pub num_generations: i64,
    pub max_completion_length: i64,
}

/// What generating a GRPO step's rollouts holds on each device: the
/// prefill program of the whole batch (the longest prompt a row holds,
/// bucketed, and the cache it fills), compiled as the generator compiles
/// it, with the run's state (weights and adapter, read in place; the
/// optimizer's moments, idle) beside it.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutMemory {
    /// The completions' length, the prompt bucket prefilled and the
    /// cache's length.
    pub completion_tokens: i64,
    pub prompt_tokens: i64,
    pub cache_tokens: i64,
    /// The KV cache's bytes (within XLA's arguments).
    pub cache_bytes: u64,
    pub xla: CompiledMemoryStats,
    /// XLA's total for the prefill plus the optimizer's moments.
    pub total_bytes: u64,
    pub compile_s: f64,
}

/// Plans the train step of `config` under `tc` on `mesh`. The CPU plugin
/// that compiles it has no cuDNN: a step with cuDNN's attention is
/// planned with blockwise attention ([`cudnn_stand_in`]), which keeps the
/// output and one f32 statistic a query and head as cuDNN does, and
/// besides them each layer's queries in f32.
pub fn plan(
    config: &ModelConfig,
    tc: &TrainConfig,
    mesh: &Mesh,
    (compile_for, xla_options): (Option<&'static Device>, &[(String, hlo_runtime::XlaOption)]),
) -> Result<(ShardedStep, MemoryPlan)> {
    let mut tc = tc.clone();
    stand_in_for_cudnn(&mut tc);
    let tc = &tc;
    let step = ShardedStep::train(config, tc, mesh)?;
    let (mut weights, mut lora, mut optimizer) = (0u64, 0u64, 0u64);
    let (mut nf4_bytes, mut dequantized) = (0u64, 0u64);
    let f = step.function();
    for (k, input) in step.step.inputs.iter().enumerate() {
        let bytes = step.input_bytes_per_device(k);
        let codes = f.ty(f.inputs[k].value).dtype == DType::U8;
        if codes || f.inputs[k].name.ends_with(nf4::ABSMAX_SUFFIX) {
            nf4_bytes += bytes;
        }
        if codes {
            // Two values a byte, one layer of a stack at a time.
            let layers = if input.leading_axis {
                config.num_hidden_layers as u64
            } else {
                1
            };
            let values = 2 * bytes / layers;
            dequantized = dequantized.max(values * tc.dtype.size_in_bytes() as u64);
        }
        match input.role {
            Role::OptimizerState { .. } => optimizer += bytes,
            Role::Trainable if tc.lora.is_some() => lora += bytes,
            Role::Trainable | Role::Weight => weights += bytes,
            _ => {}
        }
    }
    let (xla, compile_s, compiled_by) = compile_step(&step, mesh, compile_for, xla_options)?;
    let total_bytes = xla.total_device_bytes().max(0) as u64;
    Ok((
        step,
        MemoryPlan {
            weights_bytes: weights,
            nf4_bytes,
            dequantized_bytes: dequantized,
            lora_bytes: lora,
            optimizer_bytes: optimizer,
            xla,
            total_bytes,
            compile_s,
            compiled_by,
            rollout: None,
        },
    ))
}

/// Compiles `step` with the compiler of `compile_for` where it is
/// installed, else on the CPU plugin (saying why): XLA's figures, the
/// seconds it took and which compiler.
fn compile_step(
    step: &ShardedStep,
    mesh: &Mesh,
    compile_for: Option<&'static Device>,
    xla_options: &[(String, hlo_runtime::XlaOption)],
) -> Result<(CompiledMemoryStats, f64, CompiledBy)> {
    let why = match compile_for.map(|d| TargetCompiler::open(d, mesh.size() as usize)) {
        Some(Ok(compiler)) => {
            let options = hlo_runtime::CompileOptions {
                env_option_overrides: xla_options.to_vec(),
                ..Default::default()
            };
            let t = compiler.compile(step, &options)?;
            let by = CompiledBy::Target {
                compiler: compiler.describe(),
            };
            return Ok((t.xla, t.compile_s, by));
        }
        Some(Err(e)) => Some(e.to_string()),
        None => None,
    };
    let backend = Backend::open_for(&PluginSpec::Cpu, mesh.clone())?;
    let t0 = Instant::now();
    let program = step.compile(&backend, Mode::Jit)?;
    let compile_s = t0.elapsed().as_secs_f64();
    let xla = program
        .compiled_memory_stats()?
        .expect("a JIT program has memory figures");
    Ok((xla, compile_s, CompiledBy::Cpu { why }))
}

/// `tc` with cuDNN's attention, which compiles only with a GPU present,
/// replaced by its stand-in ([`cudnn_stand_in`]); whether it was.
pub fn stand_in_for_cudnn(tc: &mut TrainConfig) -> bool {
    let replaced = tc.attention == AttentionKind::Cudnn;
    if replaced {
        tc.attention = cudnn_stand_in(tc.seq);
    }
    replaced
}

/// What `plan` compiles in place of cuDNN's attention for rows of `seq`
/// tokens.
pub fn cudnn_stand_in(seq: i64) -> AttentionKind {
    AttentionKind::Blockwise {
        block: default_block(seq),
    }
}

/// Plans GRPO's rollouts of `tc.batch` completions under `rollout` (see
/// [`RolloutMemory`]), beside `optimizer_bytes` of idle moments.
pub fn plan_rollout(
    config: &ModelConfig,
    tc: &TrainConfig,
    mesh: &Mesh,
    rollout: RolloutShape,
    optimizer_bytes: u64,
) -> Result<RolloutMemory> {
    let completion = rollout.max_completion_length.max(1);
    let prompt = prompt_bucket((tc.seq - completion).max(1) as usize);
    let cache = cache_bucket(prompt, completion as usize);
    let step = decode_step(config, tc.dtype, tc.batch, prompt, cache, tc.lora.as_ref())?;
    let rules = partition_rules(config);
    let cache_layout = cache_spec(mesh, config);
    let f = &step.function;
    let laid = ShardedStep::with_layout(&step, mesh, |k| match step.inputs[k].role {
        Role::Weight => rules.spec_for(&f.inputs[k].name, f.ty(f.inputs[k].value).rank()),
        Role::KvCache => cache_layout.clone(),
        _ => PartitionSpec::replicated(),
    });
    let cache_bytes = (0..laid.step.inputs.len())
        .filter(|&k| laid.step.inputs[k].role == Role::KvCache)
        .map(|k| laid.input_bytes_per_device(k))
        .sum();
    // On the CPU: the generator's programs are not compiled for a target.
    let (xla, compile_s, _) = compile_step(&laid, mesh, None, &[])?;
    Ok(RolloutMemory {
        completion_tokens: completion,
        prompt_tokens: prompt,
        cache_tokens: cache,
        cache_bytes,
        total_bytes: xla.total_device_bytes().max(0) as u64 + optimizer_bytes,
        xla,
        compile_s,
    })
}

/// A train step as `plan` compiles it, before its `auto`s are decided:
/// the search for settings that fit changes these and plans again.
#[derive(Clone, Debug)]
pub struct StepToPlan {
    pub config: ModelConfig,
    /// How the model is named (in a quantization's errors).
    pub name: String,
    pub spec: StepSpec,
    pub optim: OptimSpec,
    pub dtype: DType,
    pub mesh: Mesh,
    /// The run's length: where a cosine schedule ends (no bytes change).
    pub steps: i64,
    /// The step's loss: a preference objective's step holds twice the
    /// rows (`spec.batch` counts pairs) and, for DPO and IPO, the
    /// reference's forward.
    pub objective: Objective,
    /// DPO's and IPO's reference: the base (a fresh adapter's) or a frozen
    /// adapter.
    pub reference: Reference,
    /// GRPO's rollouts (None for the other objectives).
    pub rollout: Option<RolloutShape>,
    /// Distillation's teacher (its weights are the step's too).
    pub teacher: Option<ModelConfig>,
    /// The devices planned for, which decide the step's `auto` choices
    /// ([`crate::step::policy`]).
    pub target: Target,
    /// The GPU whose XLA compiler compiles the step where installed
    /// (None, or not installed: the CPU plugin).
    pub compile_for: Option<&'static Device>,
    /// XLA flags for the target's compiler.
    pub xla_options: Vec<(String, hlo_runtime::XlaOption)>,
}

impl StepToPlan {
    /// The traced step's configuration ([`StepSpec::train_config`], as
    /// the objective takes it: [`ObjectiveDef::step_spec`](crate::objectives::ObjectiveDef::step_spec)).
    pub fn train_config(&self) -> Result<TrainConfig> {
        let mut tc = self
            .objective
            .def()
            .step_spec(&self.spec, &ObjectiveSpecs::default())?
            .train_config(
                &self.optim,
                &self.config,
                self.dtype,
                &self.mesh,
                self.steps,
                &self.policy()?,
            )?;
        let mut specs = crate::objectives::ObjectiveSpecs::default().resolved(self.objective);
        if let Some(r) = self.rollout {
            specs.rollouts.num_generations = Some(r.num_generations.max(1) as usize);
            specs.rollouts.max_completion_length = r.max_completion_length.max(1) as usize;
        }
        specs.distill.teacher_config = self.teacher.clone().map(Box::new);
        tc.loss = self.objective.def().loss(&specs, self.reference);
        Ok(tc)
    }

    /// The step's `auto` choices on the target ([`StepSpec::policy`]).
    pub fn policy(&self) -> Result<crate::step::policy::StepPolicy> {
        self.objective
            .def()
            .step_spec(&self.spec, &ObjectiveSpecs::default())?
            .policy(&self.config, self.dtype, &self.mesh, &self.target)
    }

    /// The policy's estimate of the program compiled, where that is not
    /// the form the policy chose: cuDNN's attention, which compiles only
    /// on a GPU, is compiled as its blockwise stand-in
    /// ([`stand_in_for_cudnn`]), which keeps more (None otherwise, or on
    /// the CPU, where the policy estimates nothing).
    pub fn stand_in_estimate(&self) -> Result<Option<u64>> {
        let chosen = self.policy()?;
        if chosen.attention != AttentionKind::Cudnn {
            return Ok(None);
        }
        let mut stand_in = self.clone();
        stand_in.spec = self
            .spec
            .fixed_to(chosen.layers, cudnn_stand_in(self.spec.seq));
        Ok(stand_in.policy()?.memory.map(|m| m.total()))
    }

    /// Plans the step ([`plan`]), and GRPO's rollouts beside it
    /// ([`plan_rollout`]).
    pub fn plan_step(&self) -> Result<(ShardedStep, MemoryPlan)> {
        let tc = self.train_config()?;
        let compiler = (self.compile_for, self.xla_options.as_slice());
        let (step, mut memory) = plan(&self.config, &tc, &self.mesh, compiler)?;
        if let Some(shape) = self
            .rollout
            .filter(|_| self.objective.data() == Data::Rollouts)
        {
            let r = plan_rollout(&self.config, &tc, &self.mesh, shape, memory.optimizer_bytes)?;
            memory.total_bytes = memory.total_bytes.max(r.total_bytes);
            memory.rollout = Some(r);
        }
        Ok((step, memory))
    }

    /// Plans the step as the policy decides it; then, where the target's
    /// own compiler gave the figure and the step does not fit by it, the
    /// policy's later forms (more recomputed, less attention kept) in its
    /// order, until XLA's figure fits: the estimate chose, the compiler
    /// corrects. Returns the step planned (its spec fixed to the form
    /// taken) and, when another form was taken, what and why.
    pub fn plan_chosen(&self) -> Result<(StepToPlan, ShardedStep, MemoryPlan, Option<Rechosen>)> {
        let (step, memory) = self.plan_step()?;
        let capacity = self.target.memory_bytes.unwrap_or(u64::MAX);
        let by_target = matches!(memory.compiled_by, CompiledBy::Target { .. });
        if !by_target || memory.total_bytes <= capacity {
            return Ok((self.clone(), step, memory, None));
        }
        let chosen = self.policy()?;
        let forms = self
            .spec
            .candidates(&self.config, self.dtype, &self.mesh, &self.target)?;
        let later = forms
            .iter()
            .skip_while(|f| **f != (chosen.layers, chosen.attention))
            .skip(1);
        for &(layers, attention) in later {
            let mut next = self.clone();
            next.spec = self.spec.fixed_to(layers, attention);
            let (s, m) = next.plan_step()?;
            if m.total_bytes <= capacity {
                let mut policy = next.policy()?;
                policy.why = format!(
                    "the policy's next form: XLA's own figure for its first ({}) does not fit",
                    crate::step::policy::form_name(chosen.layers, chosen.attention)
                );
                let rechosen = Rechosen {
                    line: policy.line(),
                    first_form: crate::step::policy::form_name(chosen.layers, chosen.attention),
                    first_bytes: memory.total_bytes,
                };
                return Ok((next, s, m, Some(rechosen)));
            }
        }
        Ok((self.clone(), step, memory, None))
    }

    /// Plans the step ([`StepToPlan::plan_step`]).
    pub fn plan(&self) -> Result<MemoryPlan> {
        Ok(self.plan_step()?.1)
    }
}

/// A form the target's compiler chose over the policy's first: XLA's
/// figure for that one did not fit.
#[derive(Clone, Debug, PartialEq)]
pub struct Rechosen {
    /// The step's choices line for the form taken.
    pub line: String,
    /// The policy's first form, in words, and XLA's bytes for it.
    pub first_form: String,
    pub first_bytes: u64,
}

/// Devices the search for a mesh that fits goes up to (more when the mesh
/// already has more: eight times its size).
pub const MAX_SEARCH_DEVICES: i64 = 64;

/// One change to a step that does not fit, as [`nearest_fits`] tries it.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Fewer rows per micro-batch, and as many more micro-batches as keep
    /// the rows (and tokens) of an optimizer step (`--batch`,
    /// `--grad-accum`).
    Batch { batch: i64, grad_accum: i64 },
    /// Shorter rows (`--seq`).
    Seq(i64),
    /// Each decoder layer recomputed in the backward pass (`--remat
    /// layers`).
    RematLayers,
    /// The base projections in NF4 (`--quantize nf4`).
    Nf4,
    /// More devices, fsdp multiplied. Where the batch's rows do not split
    /// over them it grows to the next multiple of the rows the mesh
    /// splits it into, with fewer micro-batches where that keeps the rows
    /// of an optimizer step.
    Devices {
        mesh: Mesh,
        batch: i64,
        grad_accum: i64,
    },
}

impl Change {
    /// `step` with this change.
    pub fn apply(&self, step: &StepToPlan) -> Result<StepToPlan> {
        let mut s = step.clone();
        match self {
            Change::Batch { batch, grad_accum } => {
                (s.spec.batch, s.spec.grad_accum) = (*batch, *grad_accum);
            }
            Change::Seq(seq) => s.spec.seq = *seq,
            Change::RematLayers => s.spec.remat = RematChoice::Layers,
            Change::Nf4 => {
                let nf4 = nf4::Nf4Config {
                    double_quant: false,
                };
                s.config = quantized_config(&s.config, &s.name, Some(nf4))?;
            }
            Change::Devices {
                mesh,
                batch,
                grad_accum,
            } => {
                s.mesh = mesh.clone();
                (s.spec.batch, s.spec.grad_accum) = (*batch, *grad_accum);
            }
        }
        Ok(s)
    }
}

/// A change whose step fits, as planned.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    pub change: Change,
    /// The changed step's bytes per device.
    pub total_bytes: u64,
}

/// What the search did with one candidate: planned it (compiled), or
/// left it unplanned because its compile was expected to outlast the
/// search's time.
pub enum Tried<'a> {
    Planned(&'a Result<MemoryPlan>),
    OverBudget { expected_s: f64 },
}

/// What a search found, and what it ruled out without compiling.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Found {
    pub fits: Vec<Fit>,
    /// Candidates whose lower bound (see [`nearest_fits`]) exceeds the
    /// device's memory: not compiled.
    pub ruled_out: usize,
    /// Candidates not planned for lack of time.
    pub unplanned: usize,
}

/// For a step that does not fit `capacity` bytes per device (its plan
/// `base`), the nearest settings that do, each compiled and kept only if
/// its plan fits: the largest batch (more micro-batches keeping the rows
/// of a step where the objective accumulates, else fewer rows a step),
/// the longest rows (to within an eighth), per-layer rematerialization,
/// NF4 projections (a LoRA step of a full-precision base), and the fewest
/// devices over fsdp up to [`MAX_SEARCH_DEVICES`]; only settings the
/// objective accepts. A candidate is compiled only if a lower bound of
/// its bytes fits: the state plus the rest scaled with the rows (batch),
/// with the square of the length (rows), everything over the devices
/// (more devices), the state alone (remat; NF4, its weights at 4 bits);
/// and only while its
/// compile is expected to end within `budget_s` seconds of the search's
/// start (from `base`'s compile time, longer for more devices).
/// Bisection bounds the compiles further. `progress` hears of each
/// candidate as it is planned or passed over for time (a failed plan
/// counts as not fitting).
pub fn nearest_fits(
    step: &StepToPlan,
    base: &MemoryPlan,
    capacity: u64,
    budget_s: f64,
    progress: &mut dyn FnMut(&Change, Tried),
) -> Result<Found> {
    let tc = step.train_config()?;
    let mut search = Search {
        step,
        base,
        capacity,
        started: Instant::now(),
        budget_s,
        progress,
        found: Found::default(),
    };
    let mut fits = Vec::new();
    fits.extend(search.first_fitting(&batch_changes(step)));
    fits.extend(search.first_fitting(&seq_changes(step)));
    if !tc.scan_layers && !tc.remat_layers {
        fits.extend(search.first_fitting(&[Change::RematLayers]));
    }
    if step.config.quantization.is_none() && step.spec.adapter().is_some() {
        fits.extend(search.first_fitting(&[Change::Nf4]));
    }
    // Linear, not bisection: the smaller meshes compile faster, and the
    // fewest devices are the likeliest answer.
    for change in device_changes(step) {
        if let Some(fit) = search.fits(&change) {
            fits.push(fit);
            break;
        }
    }
    search.found.fits = fits;
    Ok(search.found)
}

struct Search<'a> {
    step: &'a StepToPlan,
    base: &'a MemoryPlan,
    capacity: u64,
    started: Instant,
    budget_s: f64,
    progress: &'a mut dyn FnMut(&Change, Tried),
    found: Found,
}

impl Search<'_> {
    /// Plans `change`: Some when it fits (None, uncompiled, when its
    /// lower bound does not fit or there is no time for it).
    fn fits(&mut self, change: &Change) -> Option<Fit> {
        if self.lower_bound(change) > self.capacity {
            self.found.ruled_out += 1;
            return None;
        }
        let expected_s = self.expected_compile_s(change);
        if self.started.elapsed().as_secs_f64() + expected_s > self.budget_s {
            self.found.unplanned += 1;
            (self.progress)(change, Tried::OverBudget { expected_s });
            return None;
        }
        let planned = change.apply(self.step).and_then(|s| s.plan());
        (self.progress)(change, Tried::Planned(&planned));
        let total_bytes = planned.ok()?.total_bytes;
        (total_bytes <= self.capacity).then(|| Fit {
            change: change.clone(),
            total_bytes,
        })
    }

    /// Bytes `change`'s step holds at least: what does not shrink with
    /// it (the state: weights, adapter, optimizer) plus the rest shrunk
    /// as fast as it can (see [`nearest_fits`]).
    fn lower_bound(&self, change: &Change) -> u64 {
        let b = self.base;
        let state = b.weights_bytes + b.lora_bytes + b.optimizer_bytes;
        let rest = b.total_bytes.saturating_sub(state) as f64;
        let state = state as f64;
        let spec = &self.step.spec;
        let bound = match change {
            Change::Batch { batch, .. } => state + rest * *batch as f64 / spec.batch as f64,
            Change::Seq(seq) => state + rest * (*seq as f64 / spec.seq as f64).powi(2),
            Change::RematLayers => state,
            Change::Nf4 => {
                // Its state: 4 bits of each weight's 8, 16 or 32 (the
                // step changes too: its temporaries may shrink or grow).
                let bits = 8.0 * self.step.dtype.size_in_bytes() as f64;
                state - b.weights_bytes as f64 * (1.0 - 4.0 / bits)
            }
            Change::Devices { mesh, batch, .. } => {
                let k = (mesh.size() / self.step.mesh.size()).max(1) as f64;
                (state + rest * (*batch as f64 / spec.batch as f64).max(1.0)) / k
            }
        };
        bound.max(0.0) as u64
    }

    /// The seconds `change`'s plan is expected to take: the base plan's,
    /// and more for more virtual devices (a quarter again per device).
    fn expected_compile_s(&self, change: &Change) -> f64 {
        let base = self.base.compile_s + self.base.rollout.as_ref().map_or(0.0, |r| r.compile_s);
        match change {
            Change::Devices { mesh, .. } => {
                let k = (mesh.size() / self.step.mesh.size()).max(1) as f64;
                base * (1.0 + k / 4.0)
            }
            _ => base,
        }
    }

    /// The first of `changes` that fits, by bisection: they are ordered
    /// so that each needs no more memory than the one before.
    fn first_fitting(&mut self, changes: &[Change]) -> Option<Fit> {
        let (mut lo, mut hi, mut best) = (0, changes.len(), None);
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.fits(&changes[mid]) {
                Some(fit) => (best, hi) = (Some(fit), mid),
                None => lo = mid + 1,
            }
        }
        best
    }
}

/// Rows a mesh splits each micro-batch into.
fn batch_shards(mesh: &Mesh) -> i64 {
    StepSpec::batch_axes(mesh)
        .iter()
        .filter_map(|a| mesh.axis_size(a))
        .product::<i64>()
        .max(1)
}

/// Micro-batches a step may take (`--grad-accum`'s range).
const MAX_GRAD_ACCUM: i64 = 4096;

/// What a batch must be a multiple of beside the mesh's split: GRPO's
/// whole groups of completions.
fn batch_unit(step: &StepToPlan) -> i64 {
    match (step.objective, step.rollout) {
        (o, Some(r)) if o.data() == Data::Rollouts => r.num_generations.max(1),
        _ => 1,
    }
}

/// Smaller batches that split over the mesh, largest first: dividing the
/// rows of an optimizer step, with as many more micro-batches, where the
/// objective accumulates; else simply fewer rows a step (whole groups of
/// GRPO's completions).
fn batch_changes(step: &StepToPlan) -> Vec<Change> {
    let (batch, shards, unit) = (step.spec.batch, batch_shards(&step.mesh), batch_unit(step));
    if !step.objective.accumulates() {
        return (1..batch)
            .rev()
            .filter(|b| b % shards == 0 && b % unit == 0)
            .map(|b| Change::Batch {
                batch: b,
                grad_accum: 1,
            })
            .collect();
    }
    let rows = batch * step.spec.grad_accum;
    (1..batch)
        .rev()
        .filter(|b| batch % b == 0 && b % shards == 0 && rows / b <= MAX_GRAD_ACCUM)
        .map(|b| Change::Batch {
            batch: b,
            grad_accum: rows / b,
        })
        .collect()
}

/// Shorter rows, longest first: seven eighths of them down to a half in
/// eighths, then halving down to 2 tokens; only lengths the step's own
/// settings allow (an explicit attention block or loss chunk divides
/// them).
fn seq_changes(step: &StepToPlan) -> Vec<Change> {
    let seq = step.spec.seq;
    let mut lengths: Vec<i64> = (4..8).rev().map(|k| seq * k / 8).collect();
    let mut s = seq / 4;
    while s >= 2 {
        lengths.push(s);
        s /= 2;
    }
    // GRPO's rows hold a prompt and the longest completion.
    let least = step
        .rollout
        .map_or(2, |r| r.max_completion_length + 1)
        .max(2);
    lengths.retain(|&s| s >= least && s < seq);
    lengths.dedup();
    lengths
        .into_iter()
        .map(Change::Seq)
        .filter(|c| c.apply(step).and_then(|s| s.train_config()).is_ok())
        .collect()
}

/// Meshes of 2, 4, 8… times the devices over fsdp, up to
/// [`MAX_SEARCH_DEVICES`] (or 8 times the mesh's size when larger).
fn device_changes(step: &StepToPlan) -> Vec<Change> {
    let mesh = &step.mesh;
    let Some(fsdp) = mesh.axis_size("fsdp") else {
        return Vec::new();
    };
    let most = MAX_SEARCH_DEVICES.max(8 * mesh.size()).min(4096);
    let rows = step.spec.batch * step.spec.grad_accum;
    let mut changes = Vec::new();
    let mut k = 2;
    while mesh.size() * k <= most {
        let axes: Vec<(&str, i64)> = mesh
            .axes()
            .iter()
            .map(|(a, n)| (a.as_str(), if a == "fsdp" { fsdp * k } else { *n }))
            .collect();
        let Ok(bigger) = Mesh::new(&axes) else { break };
        let shards = lcm(batch_shards(&bigger), batch_unit(step));
        let batch = (step.spec.batch + shards - 1) / shards * shards;
        let grad_accum = if rows % batch == 0 && step.objective.accumulates() {
            rows / batch
        } else {
            step.spec.grad_accum
        };
        changes.push(Change::Devices {
            mesh: bigger,
            batch,
            grad_accum,
        });
        k *= 2;
    }
    changes
}

fn lcm(a: i64, b: i64) -> i64 {
    let gcd = |mut a: i64, mut b: i64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b).max(1) * b
}

/// One distinct layout of a step's state: every tensor of one shape and
/// dtype laid out by one spec.
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutGroup {
    /// The spec over the whole shape (an unsplit leading axis included).
    pub spec: PartitionSpec,
    /// The global shape, and the block one device holds.
    pub shape: Vec<i64>,
    pub block: Vec<i64>,
    pub dtype: String,
    /// Bytes one device holds of each tensor.
    pub bytes_per_device: u64,
    /// The tensors laid out so (weights, trainable parameters, optimizer
    /// state), by name.
    pub tensors: Vec<String>,
    /// Whether the first axis is a stack of layers (a scan's), never split.
    pub stacked: bool,
}

/// The step's state grouped by layout: each distinct (spec, shape, dtype)
/// once, with the tensors that share it, largest share per device first.
pub fn layout_groups(step: &ShardedStep) -> Vec<LayoutGroup> {
    let f = step.function();
    let mut groups: Vec<LayoutGroup> = Vec::new();
    for (k, b) in f.inputs.iter().enumerate() {
        let input = &step.step.inputs[k];
        let state = matches!(
            input.role,
            Role::Weight | Role::Trainable | Role::OptimizerState { .. }
        );
        if !state {
            continue;
        }
        let ty = f.ty(b.value);
        let spec = step.input_spec(k).clone();
        let key = (spec.clone(), ty.dims.clone(), ty.dtype.to_string());
        match groups
            .iter_mut()
            .find(|g| (g.spec.clone(), g.shape.clone(), g.dtype.clone()) == key)
        {
            Some(g) => g.tensors.push(b.name.clone()),
            None => groups.push(LayoutGroup {
                block: spec.shard_shape(step.mesh(), &ty.dims),
                spec,
                shape: ty.dims.clone(),
                dtype: ty.dtype.to_string(),
                bytes_per_device: step.input_bytes_per_device(k),
                tensors: vec![b.name.clone()],
                stacked: input.leading_axis,
            }),
        }
    }
    groups.sort_by(|a, b| {
        (b.bytes_per_device * b.tensors.len() as u64)
            .cmp(&(a.bytes_per_device * a.tensors.len() as u64))
    });
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::hardware::Kind;

    fn tiny_step(batch: i64, seq: i64, mesh: &str) -> StepToPlan {
        StepToPlan {
            config: ModelConfig::preset("tiny").unwrap(),
            name: "tiny".into(),
            spec: StepSpec {
                batch,
                seq,
                ..StepSpec::default()
            },
            optim: OptimSpec::default(),
            dtype: DType::BF16,
            mesh: mesh.parse().unwrap(),
            steps: 100,
            objective: Objective::Sft,
            reference: Reference::Base,
            rollout: None,
            teacher: None,
            target: Target::cpu(),
            compile_for: None,
            xla_options: Vec::new(),
        }
    }

    #[test]
    fn smaller_batches_keep_the_rows_of_a_step_and_split_over_the_mesh() {
        let step = tiny_step(8, 16, "dp=1,fsdp=1,mp=1");
        let batches = |s: &StepToPlan| -> Vec<(i64, i64)> {
            batch_changes(s)
                .into_iter()
                .map(|c| match c {
                    Change::Batch { batch, grad_accum } => (batch, grad_accum),
                    c => panic!("{c:?}"),
                })
                .collect()
        };
        assert_eq!(batches(&step), [(4, 2), (2, 4), (1, 8)]);
        // Over fsdp=2 each micro-batch still needs its two rows.
        let mut step = tiny_step(12, 16, "dp=1,fsdp=2,mp=1");
        step.spec.grad_accum = 2;
        assert_eq!(batches(&step), [(6, 4), (4, 6), (2, 12)]);
        assert!(batches(&tiny_step(1, 16, "dp=1,fsdp=1,mp=1")).is_empty());
    }

    #[test]
    fn shorter_rows_go_down_by_eighths_then_halves_within_the_settings() {
        let seqs = |s: &StepToPlan| -> Vec<i64> {
            seq_changes(s)
                .into_iter()
                .map(|c| match c {
                    Change::Seq(s) => s,
                    c => panic!("{c:?}"),
                })
                .collect()
        };
        let step = tiny_step(8, 64, "dp=1,fsdp=1,mp=1");
        assert_eq!(seqs(&step), [56, 48, 40, 32, 16, 8, 4, 2]);
        // An explicit loss chunk of 8 must divide the row.
        let mut chunked = step.clone();
        chunked.spec.loss_chunk = Some(8);
        assert_eq!(seqs(&chunked), [56, 48, 40, 32, 16, 8]);
        assert!(seqs(&tiny_step(8, 2, "dp=1,fsdp=1,mp=1")).is_empty());
    }

    #[test]
    fn more_devices_double_fsdp_and_give_each_a_row() {
        let meshes = |s: &StepToPlan| -> Vec<(String, i64, i64)> {
            device_changes(s)
                .into_iter()
                .map(|c| match c {
                    Change::Devices {
                        mesh,
                        batch,
                        grad_accum,
                    } => (mesh.to_string(), batch, grad_accum),
                    c => panic!("{c:?}"),
                })
                .collect()
        };
        let got = meshes(&tiny_step(8, 16, "dp=1,fsdp=1,mp=1"));
        assert_eq!(got.len(), 6, "2 to 64 devices: {got:?}");
        assert_eq!(got[0], ("dp=1,fsdp=2,mp=1".into(), 8, 1));
        // 16 devices for 8 rows: 16 rows, the step's rows grown.
        assert_eq!(got[3], ("dp=1,fsdp=16,mp=1".into(), 16, 1));
        // Batch 1 of 4 micro-batches: 2 rows of 2 micro-batches.
        let mut step = tiny_step(1, 16, "dp=2,fsdp=1,mp=2");
        step.spec.grad_accum = 4;
        let got = meshes(&step);
        assert_eq!(got[0], ("dp=2,fsdp=2,mp=2".into(), 4, 1));
        assert_eq!(got.last().unwrap().0, "dp=2,fsdp=16,mp=2");
    }

    #[test]
    fn compute_time_is_the_step_flops_per_device_at_the_peak() {
        let config = ModelConfig::preset("tiny").unwrap();
        let tc = TrainConfig::new(DType::BF16, 8, 16);
        let mesh: Mesh = "dp=1,fsdp=4,mp=1".parse().unwrap();
        let e = compute_estimate(&config, &tc, &mesh, Kind::H100.device()).unwrap();
        assert_eq!(e.peak_tflops, 989.0);
        let ms = step_flops(&config, &tc) / 4.0 / 989e12 * 1e3;
        assert!((e.ms - ms).abs() <= 1e-12 * ms, "{} vs {ms}", e.ms);
        assert_eq!(
            compute_estimate(&config, &tc, &mesh, Kind::Host.device()),
            None
        );
    }
}
