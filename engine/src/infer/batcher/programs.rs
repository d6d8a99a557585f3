//! The batcher's device programs, compiled with the layouts its state was
//! placed with: the step programs (on the scheduling thread, or on a
//! second one as they come), a slot's prefix read and write, and the
//! adapter tables' update.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use hlo_models::decoder::{
    slot_read_step, slot_step, slot_write_step, table_update_step, AdapterTables, LoraSelect,
    ModelConfig,
};
use hlo_models::roles::{Role, Step};
use hlo_partitioner::PartitionSpec;
use hlo_runtime::{Mode, Program};

use super::{BatcherOptions, Shared};
use crate::device::backend::Backend;
use crate::device::pipeline::ShardedStep;
use crate::error::{EngineError, Result};

/// A step program and its (decode rows, chunk tokens).
pub(super) type StepProgram = ((i64, i64), Program);

/// The programs besides the steps.
pub(super) struct StatePrograms {
    /// A prefix read from one slot, and written into another.
    pub read: Program,
    pub write: Program,
    /// One adapter table entry replaced.
    pub update: Program,
}

/// The tables as a program of `rows` rows reads them: `select`, else by
/// rows (see [`BatcherOptions::select`]).
fn tables_for(shape: &AdapterTables, select: Option<LoraSelect>, rows: i64) -> AdapterTables {
    AdapterTables {
        select: select.unwrap_or(if rows <= 2 {
            LoraSelect::Gather
        } else {
            LoraSelect::OneHot
        }),
        ..*shape
    }
}

/// What compiles the batcher's programs, on its thread or on another.
#[derive(Clone)]
pub(super) struct StepCompiler {
    pub backend: Arc<Backend>,
    pub config: ModelConfig,
    pub options: BatcherOptions,
    pub tables: AdapterTables,
    /// The weights' layouts, as uploaded.
    pub weights: Vec<PartitionSpec>,
    pub cache: PartitionSpec,
}

impl StepCompiler {
    /// The step program of `rows` decode rows and a `chunk`-token chunk.
    pub(super) fn program(&self, (rows, chunk): (i64, i64)) -> Result<Program> {
        let o = &self.options;
        let step = slot_step(
            &self.config,
            o.dtype,
            o.max_batch_size as i64,
            o.max_model_len,
            rows,
            chunk,
            &tables_for(&self.tables, o.select, rows + chunk),
        )?;
        self.compile(&self.weights, step)
    }

    /// The prefix read and write and the table update.
    pub(super) fn state_programs(&self) -> Result<StatePrograms> {
        let (config, o) = (&self.config, &self.options);
        let (dtype, slots) = (o.dtype, o.max_batch_size as i64);
        Ok(StatePrograms {
            read: self.compile(&[], slot_read_step(config, dtype, slots, o.max_model_len)?)?,
            write: self.compile(&[], slot_write_step(config, dtype, slots, o.max_model_len)?)?,
            update: self.compile(&self.weights, table_update_step(config, &self.tables)?)?,
        })
    }

    /// Compiles a serving program: weights laid out as `weights`, caches
    /// as uploaded, tables and per-call inputs replicated.
    fn compile(&self, weights: &[PartitionSpec], step: Step) -> Result<Program> {
        let sharded =
            ShardedStep::with_layout(&step, self.backend.mesh(), |k| match step.inputs[k].role {
                Role::Weight => weights[k].clone(),
                Role::KvCache => self.cache.clone(),
                _ => PartitionSpec::replicated(),
            });
        sharded.compile(&self.backend, Mode::Jit)
    }

    /// Compiles the step programs of `shapes` on a thread of its own,
    /// sending each as it is ready, until `stop` is set; counts them in
    /// `shared`'s pending programs.
    pub(super) fn spawn(
        self,
        shapes: Vec<(i64, i64)>,
        stop: Arc<AtomicBool>,
        shared: Arc<Shared>,
    ) -> Result<(
        mpsc::Receiver<Result<StepProgram>>,
        std::thread::JoinHandle<()>,
    )> {
        let (tx, rx) = mpsc::channel();
        let pending = &shared.stats.programs_pending;
        pending.store(shapes.len(), Ordering::SeqCst);
        let compiler = std::thread::Builder::new()
            .name("step-compiler".into())
            .spawn(move || {
                for shape in shapes {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let program = self.program(shape).map(|p| (shape, p));
                    if tx.send(program).is_err() {
                        return;
                    }
                    // Taken by the batcher before its next step.
                    let pending = &shared.stats.programs_pending;
                    pending.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .map_err(|cause| EngineError::Thread {
                what: "the compiler thread",
                cause,
            })?;
        Ok((rx, compiler))
    }
}
