//! `hlo-engine` runs hlo-train's programs. Each item has one path, its
//! folder's (docs/architecture.md draws the tree). It owns:
//!
//! - [`device`]: the plugin's client and the mesh's devices
//!   ([`device::backend::Backend`], chosen by the same rules for every
//!   command: `--devices`, `--mesh`), the one pipeline
//!   ([`device::pipeline::ShardedStep`]: a traced step simplified once,
//!   laid out by its family's partition rules, then printed, planned or
//!   compiled), and one run over several processes
//!   ([`device::processes`]: the rendezvous through process 0's
//!   key-value service, which the GPU plugins exchange topology over; who
//!   a process is and the service itself are `hlo-rendezvous`'s,
//!   [`rendezvous`]).
//! - [`inputs`]: which model ([`inputs::model::Model`]: weights,
//!   tokenizer, chat template) and which data ([`inputs::dataset`]).
//! - [`run`]: a training run as one object ([`run::Run`]), built from a
//!   typed [`run::spec::RunSpec`] (model, data, objective, step,
//!   optimizer, mesh, eval, checkpointing, output): it resumes or refuses
//!   an output folder, decides every `auto`, saves and restores its
//!   settings, reports on process 0 only and finishes the process group.
//! - [`step`]: the step's settings and their `auto` choices
//!   ([`step::policy`]: layers, remat, attention, decided from the device
//!   and memory).
//! - [`train`]: the train step compiled for a mesh with its state on the
//!   devices ([`train::session::Session`]), the loop
//!   ([`train::trainer::Trainer`]: evaluation, honest step times,
//!   checkpoints, signals) reporting through [`train::hooks::Hooks`], and
//!   saving and resuming ([`train::checkpoint`]).
//! - [`objectives`]: what each [`objectives::Objective`] adds to a run,
//!   behind one trait ([`objectives::ObjectiveDef`]), each in its folder;
//!   a reference's log-probabilities computed before training
//!   ([`objectives::preference::reference`], `--precompute-ref`).
//! - [`rollouts`]: each step's rollouts made with the session's own
//!   arrays, scored with rewards, fed to the trainer through a
//!   [`train::trainer::BatchSource`]; the objectives over them each take
//!   them with their own advantages ([`rollouts::AdvantageRule`]) and
//!   loss.
//! - [`infer`]: generation with a KV cache and on-device sampling
//!   ([`infer::generator::Generator`]) and continuous batching of many
//!   requests over many LoRA adapters in one batch
//!   ([`infer::batcher::Batcher`], what `serve` runs on).
//! - [`analysis`]: memory plans, timing and MFU ([`analysis::plan`],
//!   [`analysis::bench`], [`analysis::flops`]), what a step sends between
//!   devices per mesh axis ([`analysis::comm`]), and the one table of
//!   device kinds (peak, memory, links) they all read
//!   ([`analysis::hardware`]).
//! - [`hub`] (the `hlo-hub` crate, re-exported): Hugging Face Hub ids in
//!   place of paths, found in the HF cache or downloaded into it.
//!
//! It does not parse flags, print or draw progress (the `hlo-train` CLI
//! does, through [`train::hooks::Hooks`]), write a run's report (the metrics read back,
//! the loss chart, TensorBoard event files: `hlo-report`), and it builds
//! no model (`hlo-models`) or op (`hlo-ir`). The crates below are
//! re-exported so a Rust user needs this one dependency;
//! `engine/examples/finetune.rs` finetunes the tiny model with LoRA
//! through this API alone.

pub mod analysis;
pub mod device;
mod error;
mod files;
pub mod infer;
pub mod inputs;
pub mod named;
pub mod objectives;
pub mod run;
pub mod settings;
pub mod step;
pub mod train;

pub mod rollouts;

pub use error::{EngineError, Result};

pub use hlo_data as data;
pub use hlo_hub as hub;
pub use hlo_ir as ir;
pub use hlo_models as models;
pub use hlo_partitioner as partitioner;
pub use hlo_rendezvous as rendezvous;
pub use hlo_runtime as runtime;
