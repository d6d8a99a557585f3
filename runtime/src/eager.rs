//! Eager execution: a traced function run node by node, each node a one-op
//! SPMD program compiled once per signature (op, attributes, operand types
//! and layouts, donation) and kept in a bounded cache shared by every clone
//! of the executor. Values live as sharded device arrays and are freed
//! right after their last use; an elementwise op whose first operand dies
//! with it reuses its buffer.

use std::rc::Rc;
use std::sync::{Arc, Mutex};

use hlo_ir::{Function, Node, Op, TensorType};
use hlo_partitioner::{propagate, FunctionShardings, Mesh, PartitionSpec, Sharding};

use crate::client::{Client, Device};
use crate::error::{Error, Result};
use crate::lru::Lru;
use crate::sharded::{DeviceArray, ShardedFunction};

/// One-op programs an executor keeps: a Llama step has a few hundred
/// distinct ones.
pub const EAGER_CACHE_CAPACITY: usize = 4096;

/// What the executor has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EagerStats {
    /// Distinct one-op programs compiled.
    pub programs: usize,
    pub hits: u64,
    pub misses: u64,
    /// Most bytes (over all devices) held by live intermediate values at once.
    pub peak_live_bytes: u64,
    /// Bytes of all intermediate values of the last run, as if none were freed.
    pub intermediate_bytes: u64,
    /// Ops whose result was written over their first operand's buffer
    /// (donated where it died), over all runs.
    pub donated: u64,
}

impl EagerStats {
    pub fn hit_rate(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

/// A value during a run: one of the caller's arrays, or one we made.
#[derive(Clone)]
enum Value<'a> {
    Borrowed(&'a DeviceArray),
    Owned(Rc<DeviceArray>),
}

impl Value<'_> {
    fn array(&self) -> &DeviceArray {
        match self {
            Value::Borrowed(a) => a,
            Value::Owned(a) => a,
        }
    }
}

/// Bytes an array holds over all its devices.
fn device_bytes(a: &DeviceArray) -> u64 {
    let s = a.sharding();
    let block: i64 = s.spec.shard_shape(&s.mesh, &a.ty().dims).iter().product();
    (block as u64) * a.ty().dtype.size_in_bytes() as u64 * a.buffers().len() as u64
}

/// Where each value of `f` is last needed: the index of the last node
/// that reads it (outputs: `usize::MAX`, never freed during the run).
fn last_uses(f: &Function) -> Vec<usize> {
    let mut last = vec![usize::MAX - 1; f.values.len()];
    for (n, node) in f.nodes.iter().enumerate() {
        for o in &node.operands {
            last[o.index()] = n;
        }
    }
    for b in &f.outputs {
        last[b.value.index()] = usize::MAX;
    }
    last
}

/// Whether node `n` may write its result over its first operand's buffer:
/// an elementwise op, the operand's last use, read once by the node, and
/// held by nothing else.
fn donates_first_operand(node: &Node, n: usize, operands: &[Value], last: &[usize]) -> bool {
    let elementwise = matches!(
        node.op,
        Op::Unary(_) | Op::Binary(_) | Op::Select(_) | Op::Convert(_)
    );
    elementwise
        && last[node.operands[0].index()] == n
        && node
            .operands
            .iter()
            .filter(|o| **o == node.operands[0])
            .count()
            == 1
        // Two holders: the run's slot for the value and our clone of it
        // in `operands` (an identity op's alias would be a third).
        && matches!(&operands[0], Value::Owned(rc) if Rc::strong_count(rc) == 2)
}

/// Bytes held by a run's intermediate values, for [`EagerStats`].
#[derive(Default)]
struct LiveBytes {
    /// Held now.
    live: u64,
    /// Most held at once.
    peak: u64,
    /// Made in all, as if none were freed.
    total: u64,
}

impl LiveBytes {
    fn made(&mut self, a: &DeviceArray) {
        let bytes = device_bytes(a);
        self.live += bytes;
        self.total += bytes;
    }
}

/// Frees the operands node `n` was the last to need. An array another
/// value still shares (an identity's result) keeps its bytes live.
fn free_last_uses(
    node: &Node,
    n: usize,
    last: &[usize],
    env: &mut [Option<Value>],
    bytes: &mut LiveBytes,
) {
    for o in &node.operands {
        if last[o.index()] == n {
            if let Some(Value::Owned(rc)) = env[o.index()].take() {
                if Rc::strong_count(&rc) == 1 {
                    bytes.live = bytes.live.saturating_sub(device_bytes(&rc));
                }
            }
        }
    }
}

/// Sees each node's results as they are made (for `--trace-values`).
pub type Observer<'a> = dyn FnMut(&Node, &[&DeviceArray]) -> Result<()> + 'a;

/// What clones of an executor share: the one-op programs and the counts.
struct Shared {
    cache: Lru<String, Arc<ShardedFunction>>,
    stats: EagerStats,
}

/// Runs functions op by op over a mesh. Clones share the program cache
/// and the statistics.
#[derive(Clone)]
pub struct Eager {
    client: Client,
    mesh: Mesh,
    devices: Vec<Device>,
    shared: Arc<Mutex<Shared>>,
}

impl Eager {
    /// An executor over `mesh`, whose devices are `devices` (mesh order).
    pub fn new(client: &Client, mesh: Mesh, devices: Vec<Device>) -> Result<Eager> {
        mesh.check_devices(devices.len())?;
        // Op by op, every process would have to issue every one-op program
        // in lockstep with the others; only whole programs run across
        // processes.
        if client.spans_processes()? {
            return Err(Error::InvalidArgument(
                "eager mode runs on one process's devices; across processes use --jit".into(),
            ));
        }
        Ok(Eager {
            client: client.clone(),
            mesh,
            devices,
            shared: Arc::new(Mutex::new(Shared {
                cache: Lru::new(EAGER_CACHE_CAPACITY),
                stats: EagerStats::default(),
            })),
        })
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the executor (and its clones) have done so far.
    pub fn stats(&self) -> EagerStats {
        self.shared().stats
    }

    /// The one-op program for `f` under `shardings` and `donated`, compiled
    /// on first use.
    fn program(
        &self,
        f: &Function,
        shardings: FunctionShardings,
        donated: &[(usize, usize)],
    ) -> Result<Arc<ShardedFunction>> {
        let key = hlo_lowering::to_stablehlo_with(f, Some(&shardings), donated);
        {
            let mut shared = self.shared();
            if let Some(p) = shared.cache.get(&key).cloned() {
                shared.stats.hits += 1;
                return Ok(p);
            }
        }
        // Compiled outside the lock; a clone racing for the same program
        // finds it in the client's compile cache.
        let p = Arc::new(ShardedFunction::with_donation(
            &self.client,
            f,
            shardings,
            donated,
        )?);
        let mut shared = self.shared();
        shared.stats.misses += 1;
        shared.cache.insert(key, p.clone());
        shared.stats.programs = shared.cache.len();
        Ok(p)
    }

    /// `a` under `spec` (an identity program when the layout differs or a
    /// fresh copy is needed).
    fn relayout(&self, a: &DeviceArray, spec: &PartitionSpec) -> Result<DeviceArray> {
        let f = Function::single_op(
            Op::StopGradient(hlo_ir::ops::StopGradient),
            std::slice::from_ref(a.ty()),
        )
        .map_err(Error::InvalidArgument)?;
        let shardings = FunctionShardings {
            mesh: self.mesh.clone(),
            inputs: vec![a.sharding().spec.clone()],
            outputs: vec![spec.clone()],
        };
        let p = self.program(&f, shardings, &[])?;
        Ok(p.run(&[a])?.remove(0))
    }

    /// Runs `f` on `inputs` (laid out over the executor's mesh) and returns
    /// its outputs laid out as `output_specs`. `observe` sees every node's
    /// results as they are made.
    pub fn run(
        &self,
        f: &Function,
        inputs: &[&DeviceArray],
        output_specs: &[PartitionSpec],
        mut observe: Option<&mut Observer>,
    ) -> Result<Vec<DeviceArray>> {
        if inputs.len() != f.inputs.len() || output_specs.len() != f.outputs.len() {
            return Err(Error::InvalidArgument(format!(
                "{} takes {} inputs and makes {} outputs; got {} inputs and {} output layouts",
                f.name,
                f.inputs.len(),
                f.outputs.len(),
                inputs.len(),
                output_specs.len()
            )));
        }
        let last = last_uses(f);
        let mut env = self.bind_inputs(f, inputs)?;
        let mut bytes = LiveBytes::default();
        for (n, node) in f.nodes.iter().enumerate() {
            let operands: Vec<Value> = node
                .operands
                .iter()
                .map(|o| env[o.index()].clone().expect("defined before use"))
                .collect();
            let results: Vec<Value> = if node.op.is_identity() {
                vec![operands[0].clone()]
            } else {
                self.dispatch(node, n, &operands, &last)?
                    .into_iter()
                    .map(|a| {
                        bytes.made(&a);
                        Value::Owned(Rc::new(a))
                    })
                    .collect()
            };
            bytes.peak = bytes.peak.max(bytes.live);
            if let Some(obs) = observe.as_mut() {
                let arrays: Vec<&DeviceArray> = results.iter().map(Value::array).collect();
                obs(node, &arrays)?;
            }
            // Our clones of the operands go first, so that the frees below
            // see which values nothing else holds.
            drop(operands);
            for (r, s) in node.results.iter().zip(results) {
                env[r.index()] = Some(s);
            }
            free_last_uses(node, n, &last, &mut env, &mut bytes);
        }
        {
            let mut shared = self.shared();
            shared.stats.peak_live_bytes = shared.stats.peak_live_bytes.max(bytes.peak);
            shared.stats.intermediate_bytes = bytes.total;
        }
        self.take_outputs(f, env, output_specs)
    }

    /// The value environment of a run of `f`, its inputs bound; each input
    /// must have its declared type and live on the executor's mesh.
    fn bind_inputs<'a>(
        &self,
        f: &Function,
        inputs: &[&'a DeviceArray],
    ) -> Result<Vec<Option<Value<'a>>>> {
        let mut env: Vec<Option<Value>> = vec![None; f.values.len()];
        for (b, a) in f.inputs.iter().zip(inputs) {
            if a.ty() != f.ty(b.value) || a.sharding().mesh != self.mesh {
                return Err(Error::InvalidArgument(format!(
                    "input `{}` is {} over {}, expected {} over {}",
                    b.name,
                    a.ty(),
                    a.sharding().mesh,
                    f.ty(b.value),
                    self.mesh
                )));
            }
            env[b.value.index()] = Some(Value::Borrowed(a));
        }
        Ok(env)
    }

    /// Runs node `n` (not an identity) on `operands` as its one-op program:
    /// result layouts from [`propagate`], the program from the cache, the
    /// first operand's buffer donated where it dies here.
    fn dispatch(
        &self,
        node: &Node,
        n: usize,
        operands: &[Value],
        last: &[usize],
    ) -> Result<Vec<DeviceArray>> {
        let types: Vec<TensorType> = operands.iter().map(|s| s.array().ty().clone()).collect();
        let single = Function::single_op(node.op.clone(), &types).map_err(|e| {
            Error::InvalidArgument(format!("{} in `{}`: {e}", node.op.name(), node.scope))
        })?;
        let specs: Vec<PartitionSpec> = operands
            .iter()
            .map(|s| s.array().sharding().spec.canonical())
            .collect();
        let pairs: Vec<(&TensorType, &PartitionSpec)> = types.iter().zip(&specs).collect();
        let out_specs = propagate(&node.op, &pairs, &single.output_types(), &self.mesh);
        // Writing over the operand needs the result to have its type and
        // layout exactly.
        let donate = donates_first_operand(node, n, operands, last)
            && types[0] == single.output_types()[0]
            && specs[0] == out_specs[0];
        let donated: &[(usize, usize)] = if donate {
            self.shared().stats.donated += 1;
            &[(0, 0)]
        } else {
            &[]
        };
        let shardings = FunctionShardings {
            mesh: self.mesh.clone(),
            inputs: specs,
            outputs: out_specs,
        };
        let program = self.program(&single, shardings, donated)?;
        let arrays: Vec<&DeviceArray> = operands.iter().map(Value::array).collect();
        let made = program.run(&arrays)?;
        // One program in flight at a time on a multi-device mesh: the
        // CPU plugin's collectives deadlock when several queued
        // programs wait on each other's device threads.
        if self.devices.len() > 1 {
            for a in &made {
                for b in a.buffers() {
                    b.block_until_ready()?;
                }
            }
        }
        Ok(made)
    }

    /// `f`'s outputs, from the run's final `env`, in the layouts asked for;
    /// a value the caller still holds (an input, or one output twice) is
    /// copied.
    fn take_outputs(
        &self,
        f: &Function,
        mut env: Vec<Option<Value>>,
        output_specs: &[PartitionSpec],
    ) -> Result<Vec<DeviceArray>> {
        let mut remaining = vec![0usize; f.values.len()];
        for b in &f.outputs {
            remaining[b.value.index()] += 1;
        }
        let mut out = Vec::with_capacity(f.outputs.len());
        for (b, spec) in f.outputs.iter().zip(output_specs) {
            let v = b.value.index();
            remaining[v] -= 1;
            let slot = env[v].clone().expect("outputs are defined");
            let reusable = remaining[v] == 0
                && matches!(&slot, Value::Owned(rc) if Rc::strong_count(rc) == 2)
                && slot.array().sharding().spec.canonical() == spec.canonical();
            if reusable {
                env[v] = None;
                if let Value::Owned(rc) = slot {
                    out.push(
                        Rc::try_unwrap(rc)
                            .map_err(|_| Error::InvalidArgument("an output is shared".into()))?,
                    );
                    continue;
                }
            }
            out.push(self.relayout(slot.array(), spec)?);
        }
        Ok(out)
    }

    /// The sharding of an input laid out as `spec`.
    pub fn sharding(&self, spec: &PartitionSpec) -> Sharding {
        Sharding::new(self.mesh.clone(), spec.clone())
    }

    pub fn devices(&self) -> &[Device] {
        &self.devices
    }
}
