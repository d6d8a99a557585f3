//! The one pipeline every command uses: a traced step is simplified once,
//! laid out over a mesh by its model family's partition rules (roles say
//! which inputs carry an unsplit leading axis), then printed (`dump-hlo`),
//! compiled for its memory figures (`plan`) or compiled and run (`train`,
//! `bench`, `generate`) — as JAX's `jit(f).lower(...).compile()` chain
//! gives one object per stage.

use hlo_ir::Function;
use hlo_models::roles::Step;
use hlo_partitioner::{FunctionShardings, Mesh, PartitionSpec, Rules};
use hlo_runtime::{Mode, Program};

use crate::device::backend::Backend;
use crate::error::Result;

/// A step, simplified, with a layout for every input and output.
pub struct ShardedStep {
    /// The step as it is compiled (folded, CSE'd, dead code removed).
    pub step: Step,
    pub shardings: FunctionShardings,
    /// Whether the printed text carries the shardings (a program printed
    /// without a mesh does not).
    annotated: bool,
}

impl ShardedStep {
    /// Simplifies `step` and lays it out over `mesh` by `rules` (first
    /// match by name, default replicated), leading axes unsplit; every
    /// layout is checked against its tensor's shape.
    pub fn new(step: &Step, mesh: &Mesh, rules: &Rules) -> Result<ShardedStep> {
        let step = step.with_function(hlo_ir::simplify(&step.function));
        let leading = step.leading_axis_names();
        let shardings =
            FunctionShardings::from_rules_stacked(&step.function, mesh, rules, &|name| {
                leading.contains(name)
            })?;
        Ok(ShardedStep {
            step,
            shardings,
            annotated: true,
        })
    }

    /// The train step of `config` under `tc`, laid out over `mesh` by its
    /// family's rules: what `train` compiles, `plan` plans and `compile`
    /// writes.
    pub fn train(
        config: &hlo_models::decoder::ModelConfig,
        tc: &hlo_models::train::TrainConfig,
        mesh: &Mesh,
    ) -> Result<ShardedStep> {
        let traced = hlo_models::train::train_step(config, tc)?;
        ShardedStep::new(&traced, mesh, &hlo_models::decoder::partition_rules(config))
    }

    /// `step`, simplified once, with input `k` laid out as `input(k)`:
    /// state returned updated keeps its input's layout, other outputs are
    /// replicated. For generation programs, whose weights are laid out as
    /// already placed and whose caches split over heads.
    pub fn with_layout(
        step: &Step,
        mesh: &Mesh,
        input: impl Fn(usize) -> PartitionSpec,
    ) -> ShardedStep {
        let step = step.with_function(hlo_ir::simplify(&step.function));
        let f = &step.function;
        let inputs: Vec<PartitionSpec> = (0..f.inputs.len()).map(input).collect();
        let outputs = f
            .outputs
            .iter()
            .map(|o| match f.inputs.iter().position(|b| b.name == o.name) {
                Some(k) => inputs[k].clone(),
                None => PartitionSpec::replicated(),
            })
            .collect();
        let shardings = FunctionShardings {
            mesh: mesh.clone(),
            inputs,
            outputs,
        };
        ShardedStep {
            step,
            shardings,
            annotated: true,
        }
    }

    /// `step` simplified, every input and output on one device (or
    /// replicated): for printing a program without a mesh.
    pub fn unsharded(step: &Step) -> ShardedStep {
        let step = step.with_function(hlo_ir::simplify(&step.function));
        let shardings = FunctionShardings::replicated(&step.function, &Mesh::single());
        ShardedStep {
            step,
            shardings,
            annotated: false,
        }
    }

    pub fn function(&self) -> &Function {
        &self.step.function
    }

    pub fn mesh(&self) -> &Mesh {
        &self.shardings.mesh
    }

    /// The StableHLO text that is compiled: Shardy shardings and
    /// donation.
    pub fn stablehlo(&self) -> String {
        let shardings = self.annotated.then_some(&self.shardings);
        hlo_lowering::to_stablehlo_with(self.function(), shardings, &self.step.donated)
    }

    /// The same program as HLO text, with GSPMD shardings.
    pub fn hlo_text(&self) -> String {
        if self.annotated {
            hlo_lowering::to_hlo_text_sharded(self.function(), &self.shardings)
        } else {
            hlo_lowering::to_hlo_text(self.function())
        }
    }

    /// Compiles for `backend`'s devices (its mesh must be this one).
    pub fn compile(&self, backend: &Backend, mode: Mode) -> Result<Program> {
        Ok(Program::compile(
            backend.client(),
            self.function(),
            self.shardings.clone(),
            &self.step.donated,
            mode,
            backend.devices(),
        )?)
    }

    /// The layout of input `k`.
    pub(crate) fn input_spec(&self, k: usize) -> &PartitionSpec {
        &self.shardings.inputs[k]
    }

    /// Bytes one device holds of input `k`.
    pub(crate) fn input_bytes_per_device(&self, k: usize) -> u64 {
        let f = self.function();
        let ty = f.ty(f.inputs[k].value);
        let block: i64 = self.shardings.inputs[k]
            .shard_shape(self.mesh(), &ty.dims)
            .iter()
            .product();
        block as u64 * ty.dtype.size_in_bytes() as u64
    }
}
