//! `hlo-engine` runs hlo-train's programs. It owns:
//!
//! - [`Backend`]: the plugin's client and the mesh's devices, chosen by the
//!   same rules for every command (`--devices`, `--mesh`).
//! - [`Model`]: which model, with which weights, tokenizer and chat
//!   template.
//! - [`ShardedStep`]: the one pipeline — a traced step simplified once,
//!   laid out by its family's partition rules, then printed, planned or
//!   compiled.
//! - [`Run`]: a training run as one object, built from a typed
//!   [`RunSpec`] (model, data, [`Objective`], step, optimizer, mesh, eval,
//!   checkpointing, output): it resumes or refuses an output folder,
//!   decides every `auto` ([`run::step`]: packing, scan, loss chunk,
//!   attention, batch axes), saves and restores its settings, reports on
//!   process 0 only and finishes the process group.
//! - [`Session`]: the train step compiled for a mesh with its state on the
//!   devices; [`Trainer`]: the loop (evaluation, honest step times,
//!   checkpoints, signals) reporting through [`Hooks`] (several compose as
//!   a [`HookList`]); [`checkpoint`]: saving and resuming.
//! - [`objectives`]: what each [`Objective`] adds to a run, behind one
//!   trait ([`ObjectiveDef`]), each in its folder. Preference objectives
//!   (DPO, IPO, SimPO, ORPO) and KTO run on the same `Run` and `Session`;
//!   [`reference`] computes a reference's log-probabilities before
//!   training (`--precompute-ref`).
//! - Rollouts: [`rollouts`] makes each step's rollouts with the session's
//!   own arrays ([`Generator::over`]), scores them with rewards, and feeds
//!   the trainer through a [`trainer::BatchSource`]; GRPO, RLOO and
//!   distillation each take them with their own advantages
//!   ([`rollouts::AdvantageRule`]) and loss.
//! - [`Generator`]: generation with a KV cache and on-device sampling;
//!   [`Batcher`]: continuous batching of many requests over many LoRA
//!   adapters in one batch (what `serve` runs on).
//! - [`plan`], [`bench`] and [`flops`]: memory plans, timing, MFU;
//!   [`comm`]: what a step sends between devices per mesh axis, within or
//!   across nodes; [`hardware`]: the one table of device kinds (peak,
//!   memory, links) they all read; [`policy`]: the step's `auto` choices
//!   (layers, remat, attention) decided from the device and memory.
//! - [`hub`] (the `hlo-hub` crate, re-exported): Hugging Face Hub ids in place of paths, found in the HF
//!   cache or downloaded into it (`hf-hub` draws a download's progress on
//!   a terminal, as `huggingface_hub` does, unless
//!   `HF_HUB_DISABLE_PROGRESS_BARS` is set).
//! - [`processes`]: one run over several processes — the rendezvous
//!   ([`processes::ProcessGroup`]) through process 0's key-value service,
//!   which the GPU plugins exchange topology over. Who a process is and
//!   the service itself are `hlo-rendezvous`'s ([`rendezvous`]).
//!
//! The modules live in subsystem folders ([`device`], [`inputs`], [`run`],
//! [`train`], [`objectives`], [`infer`], [`analysis`]; docs/architecture.md
//! draws the tree) and keep their names at the crate root.
//!
//! It does not parse flags, print or draw progress (the `hlo-train` CLI
//! does, through [`Hooks`]), write a run's report (the metrics read back,
//! the loss chart, TensorBoard event files: `hlo-report`), and it builds
//! no model (`hlo-models`) or op (`hlo-ir`). The crates below are
//! re-exported so a Rust user needs this one dependency;
//! `engine/examples/finetune.rs` finetunes the tiny model with LoRA
//! through this API alone.

pub mod analysis;
pub mod device;
mod error;
pub mod infer;
pub mod inputs;
pub mod named;
pub mod objectives;
pub mod run;
pub mod step;
pub mod train;

// The modules by their names before the folders, so that paths such as
// `hlo_engine::plan::...` keep working.
pub use analysis::{bench, comm, flops, hardware, plan};
pub use device::{backend, pipeline, processes};
pub use infer::{batcher, generator};
pub use inputs::{dataset, model};
pub use objectives::grpo;
pub use objectives::preference::reference;
pub mod rollouts;
pub use step::policy;
pub use train::{checkpoint, hooks, session, trainer};

pub use backend::{check_mesh_axes, full_mesh, Backend, BackendOptions, MESH_AXES};
pub use batcher::{
    AdapterInfo, Batcher, BatcherHandle, BatcherOptions, BatcherStats, Event, FinishReason,
    GenerationRequest, SubmitError,
};
pub use dataset::{DataSource, DataSpec, Dataset};
pub use error::{EngineError, Result};
pub use generator::{Generator, RowCompletion, Sampling, Timings};
pub use hooks::{
    EvalReport, HookList, Hooks, Quiet, RunStart, StepReport, TracedValue, TrainSummary,
};
pub use model::{Model, ModelSource};
pub use objectives::{Data, ObjectiveDef};
pub use pipeline::ShardedStep;
pub use run::spec::{
    Chosen, EvalSpec, GrpoSpec, Objective, ObjectiveSpecs, OutputSpec, PreferenceSpec, ReportSpec,
    RunSpec,
};
pub use run::Run;
pub use session::{EvalResult, Evaluator, Session, SessionOptions, Weights};
pub use step::{OptimSpec, StepSpec, Toggle};
pub use trainer::{StopFlag, Trainer, TrainerOptions};

pub use hlo_data as data;
pub use hlo_hub as hub;
pub use hlo_ir as ir;
pub use hlo_models as models;
pub use hlo_partitioner as partitioner;
pub use hlo_rendezvous as rendezvous;
pub use hlo_runtime as runtime;
pub use hlo_runtime::Mode;
