//! One compiled program behind one `run`, whichever way it executes: as a
//! single SPMD executable (JIT) or op by op (eager).

use hlo_ir::Function;
use hlo_partitioner::{FunctionShardings, Sharding};

use crate::client::{Client, Device};
use crate::eager::{Eager, EagerStats, Observer};
use crate::error::Result;
use crate::executable::CompiledMemoryStats;
use crate::sharded::{DeviceArray, ShardedFunction};

/// How a program executes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One executable for the whole function, compiled once.
    Jit,
    /// Node by node, each a small cached executable, values freed after
    /// their last use (for debugging and inspection).
    Eager,
}

enum Executor {
    Jit(Box<ShardedFunction>),
    Eager(Eager),
}

/// A function laid out over a mesh, ready to run on arrays placed as its
/// shardings say.
///
/// ```no_run
/// use hlo_ir::{trace, DType, TensorType};
/// use hlo_partitioner::{FunctionShardings, Mesh};
/// use hlo_runtime::{Client, ClientOptions, DeviceArray, HostArray, Mode, Plugin, PluginSpec, Program};
/// let client = Client::new(&Plugin::load(PluginSpec::Cpu.resolve()?)?, &ClientOptions::cpu(1))?;
/// let f = trace("double", &[("x", TensorType::new(DType::F32, [2]))], |i| i["x"] * 2.0).unwrap();
/// let mesh = Mesh::single();
/// let devices = client.addressable_devices()?;
/// let program = Program::compile(&client, &f, FunctionShardings::replicated(&f, &mesh), &[], Mode::Jit, &devices)?;
/// let x = DeviceArray::shard(&client, &HostArray::new(&[2], &[1.0f32, 2.0])?, &program.input_sharding(0), &devices)?;
/// let y = program.run(&[&x])?;
/// assert_eq!(y[0].gather()?.to_vec::<f32>()?, vec![2.0, 4.0]);
/// # Ok::<(), hlo_runtime::Error>(())
/// ```
pub struct Program {
    function: Function,
    shardings: FunctionShardings,
    executor: Executor,
}

impl Program {
    /// Compiles `function` as given (simplify it first) for `shardings`'
    /// mesh, whose devices are `devices` in mesh order. Under JIT the
    /// `donated` (input, output) pairs update in place: those inputs are
    /// consumed by [`Program::run`].
    pub fn compile(
        client: &Client,
        function: &Function,
        shardings: FunctionShardings,
        donated: &[(usize, usize)],
        mode: Mode,
        devices: &[Device],
    ) -> Result<Program> {
        match mode {
            Mode::Jit => {
                let exe = ShardedFunction::with_devices(
                    client,
                    function,
                    shardings.clone(),
                    donated,
                    devices,
                )?;
                Ok(Program {
                    function: function.clone(),
                    shardings,
                    executor: Executor::Jit(Box::new(exe)),
                })
            }
            Mode::Eager => {
                let executor = Eager::new(client, shardings.mesh.clone(), devices.to_vec())?;
                Self::eager_with(function, shardings, &executor)
            }
        }
    }

    /// [`Program::compile`] in eager mode sharing `executor`'s one-op
    /// programs (several programs of one run, say prefill and decode).
    pub fn eager_with(
        function: &Function,
        shardings: FunctionShardings,
        executor: &Eager,
    ) -> Result<Program> {
        for (b, spec) in function.inputs.iter().zip(&shardings.inputs) {
            spec.validate(&shardings.mesh, &function.ty(b.value).dims, &b.name)?;
        }
        Ok(Program {
            function: function.clone(),
            shardings,
            executor: Executor::Eager(executor.clone()),
        })
    }

    pub fn mode(&self) -> Mode {
        match self.executor {
            Executor::Jit(_) => Mode::Jit,
            Executor::Eager(_) => Mode::Eager,
        }
    }

    /// The function that runs.
    pub fn function(&self) -> &Function {
        &self.function
    }

    pub fn shardings(&self) -> &FunctionShardings {
        &self.shardings
    }

    /// The layout input `i` must have.
    pub fn input_sharding(&self, i: usize) -> Sharding {
        Sharding::new(
            self.shardings.mesh.clone(),
            self.shardings.inputs[i].clone(),
        )
    }

    /// Runs on arrays laid out as [`Program::input_sharding`] says; the
    /// outputs come back laid out as the shardings say.
    pub fn run(&self, inputs: &[&DeviceArray]) -> Result<Vec<DeviceArray>> {
        self.run_observed(inputs, None)
    }

    /// [`Program::run`]; in eager mode `observe` sees every node's results
    /// as they are made (JIT makes no intermediate values to see).
    pub fn run_observed(
        &self,
        inputs: &[&DeviceArray],
        observe: Option<&mut Observer>,
    ) -> Result<Vec<DeviceArray>> {
        match &self.executor {
            Executor::Jit(exe) => exe.run(inputs),
            Executor::Eager(eager) => {
                eager.run(&self.function, inputs, &self.shardings.outputs, observe)
            }
        }
    }

    /// XLA's memory figures per device (JIT only).
    pub fn compiled_memory_stats(&self) -> Result<Option<CompiledMemoryStats>> {
        match &self.executor {
            Executor::Jit(exe) => Ok(Some(exe.executable().compiled_memory_stats()?)),
            Executor::Eager(_) => Ok(None),
        }
    }

    /// The plugin's serialization of the compiled program (JIT only).
    pub fn serialize(&self) -> Result<Option<Vec<u8>>> {
        match &self.executor {
            Executor::Jit(exe) => Ok(Some(exe.executable().serialize()?)),
            Executor::Eager(_) => Ok(None),
        }
    }

    /// The eager executor's counts (eager only).
    pub fn eager_stats(&self) -> Option<EagerStats> {
        match &self.executor {
            Executor::Jit(_) => None,
            Executor::Eager(e) => Some(e.stats()),
        }
    }

    /// The StableHLO text that was compiled (JIT only).
    pub fn stablehlo(&self) -> Option<&str> {
        match &self.executor {
            Executor::Jit(exe) => Some(exe.stablehlo()),
            Executor::Eager(_) => None,
        }
    }
}
