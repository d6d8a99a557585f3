//! Arrays laid out over a mesh, and programs run SPMD over all its devices.
//!
//! Device `d` of a mesh is partition `d` of the program. In one process
//! that is the `d`-th device of the executable (XLA's default assignment)
//! and a [`DeviceArray`] keeps one buffer per mesh device in that order.
//! When the mesh spans processes, the program is compiled with the
//! explicit assignment of the run's devices in process order, and each
//! process holds, feeds and reads only the blocks of its own devices.

use std::sync::Arc;

use hlo_ir::{Function, TensorType};
use hlo_partitioner::{FunctionShardings, PartitionSpec, Sharding};

use crate::buffer::{Buffer, ReadyTime};
use crate::client::{Client, Device};
use crate::compile_options::CompileOptions;
use crate::error::{Error, Result};
use crate::executable::LoadedExecutable;
use crate::host::HostArray;
use crate::jit::check_signature;

/// Copies the block at `offset` of size `block` between row-major arrays
/// `src` (dims `src_dims`, block at `src_at`) and `dst` (at `dst_at`).
#[allow(clippy::too_many_arguments)]
fn copy_block(
    src: &[u8],
    src_dims: &[i64],
    src_at: &[i64],
    dst: &mut [u8],
    dst_dims: &[i64],
    dst_at: &[i64],
    block: &[i64],
    elem: usize,
) {
    let rank = block.len();
    if block.contains(&0) {
        return;
    }
    if rank == 0 {
        dst[..elem].copy_from_slice(&src[..elem]);
        return;
    }
    let strides = |dims: &[i64]| {
        let mut s = vec![1i64; dims.len()];
        for i in (0..dims.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * dims[i + 1];
        }
        s
    };
    let (ss, ds) = (strides(src_dims), strides(dst_dims));
    let run = block[rank - 1] as usize * elem;
    let outer: Vec<i64> = block[..rank - 1].to_vec();
    let mut idx = vec![0i64; rank - 1];
    loop {
        let mut so = src_at[rank - 1];
        let mut d = dst_at[rank - 1];
        for k in 0..rank - 1 {
            so += (src_at[k] + idx[k]) * ss[k];
            d += (dst_at[k] + idx[k]) * ds[k];
        }
        let (so, d) = (so as usize * elem, d as usize * elem);
        dst[d..d + run].copy_from_slice(&src[so..so + run]);
        let mut k = outer.len();
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < outer[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// A global array laid out over a mesh: its type, its sharding, and the
/// block each mesh device holds.
pub struct DeviceArray {
    ty: TensorType,
    sharding: Sharding,
    /// This process's blocks, at mesh positions `positions` (ascending;
    /// every position when the mesh lies in one process).
    buffers: Vec<Buffer>,
    positions: Vec<usize>,
    client: Client,
    /// The mesh's devices (every process's), for the programs that move
    /// this array.
    devices: Vec<Device>,
}

impl DeviceArray {
    /// Splits `host` by `sharding` and copies each device only its block.
    /// `devices` are the mesh's devices in mesh order; those of other
    /// processes are skipped (each process places its own).
    pub fn shard(
        client: &Client,
        host: &HostArray,
        sharding: &Sharding,
        devices: &[Device],
    ) -> Result<Self> {
        let ty = host.ty();
        let (mesh, spec) = (&sharding.mesh, &sharding.spec);
        mesh.check_devices(devices.len())?;
        spec.validate(mesh, &ty.dims, "array")?;
        let block = spec.shard_shape(mesh, &ty.dims);
        let elem = ty.dtype.size_in_bytes();
        let n: i64 = block.iter().product();
        let mut buffers = Vec::with_capacity(devices.len());
        let mut positions = Vec::with_capacity(devices.len());
        for (d, device) in devices.iter().enumerate() {
            if !device.is_addressable()? {
                continue;
            }
            positions.push(d);
            let at = spec.shard_offset(mesh, &ty.dims, d as i64);
            let mut bytes = vec![0u8; n as usize * elem];
            copy_block(
                host.bytes(),
                &ty.dims,
                &at,
                &mut bytes,
                &block,
                &vec![0; block.len()],
                &block,
                elem,
            );
            let piece = HostArray::from_bytes(ty.dtype, &block, bytes)?;
            buffers.push(client.buffer_from_host(&piece, device)?);
        }
        Ok(DeviceArray {
            ty,
            sharding: sharding.clone(),
            buffers,
            positions,
            client: client.clone(),
            devices: devices.to_vec(),
        })
    }

    /// Assembles the global array on the host (one read per distinct block).
    /// When other processes hold some blocks, a program first replicates
    /// the array on every device (XLA's collectives move them), so every
    /// process of the run must gather the same arrays in the same order.
    pub fn gather(&self) -> Result<HostArray> {
        let (mesh, spec) = (&self.sharding.mesh, &self.sharding.spec);
        let dims = &self.ty.dims;
        let held: std::collections::HashSet<Vec<i64>> = self
            .positions
            .iter()
            .map(|&d| spec.shard_offset(mesh, dims, d as i64))
            .collect();
        let all: std::collections::HashSet<Vec<i64>> = (0..mesh.size())
            .map(|d| spec.shard_offset(mesh, dims, d))
            .collect();
        if held.len() < all.len() {
            return self
                .reshard(&self.client, &PartitionSpec::replicated())?
                .gather();
        }
        let block = spec.shard_shape(mesh, dims);
        let elem = self.ty.dtype.size_in_bytes();
        let mut out = vec![0u8; self.ty.size_in_bytes()];
        let mut done = std::collections::HashSet::new();
        for (&d, buffer) in self.positions.iter().zip(&self.buffers) {
            let at = spec.shard_offset(mesh, dims, d as i64);
            if !done.insert(at.clone()) {
                continue; // a replica of a block already read
            }
            let piece = buffer.to_host()?;
            copy_block(
                piece.bytes(),
                &block,
                &vec![0; block.len()],
                &mut out,
                dims,
                &at,
                &block,
                elem,
            );
        }
        HostArray::from_bytes(self.ty.dtype, dims, out)
    }

    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    pub fn sharding(&self) -> &Sharding {
        &self.sharding
    }

    /// The moment every device's block of this array is computed (see
    /// [`Buffer::ready_time`]), noted without waiting.
    pub fn ready_times(&self) -> Result<Vec<ReadyTime>> {
        self.buffers.iter().map(Buffer::ready_time).collect()
    }

    /// This process's buffers, in mesh order: one per mesh device when
    /// the mesh lies in one process.
    pub fn buffers(&self) -> &[Buffer] {
        &self.buffers
    }

    /// The mesh positions of [`DeviceArray::buffers`].
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// The buffer at mesh position `d`, if this process holds it.
    fn buffer_at(&self, d: usize) -> Option<&Buffer> {
        self.positions
            .binary_search(&d)
            .ok()
            .map(|i| &self.buffers[i])
    }

    /// The same values under `target`: an identity program whose input and
    /// output shardings differ, so XLA moves the data between devices with
    /// its own collectives (no trip through the host).
    pub fn reshard(&self, client: &Client, target: &PartitionSpec) -> Result<DeviceArray> {
        let f = hlo_ir::trace("reshard", &[("x", self.ty.clone())], |i| {
            vec![("x", i["x"])]
        })
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let shardings = FunctionShardings {
            mesh: self.sharding.mesh.clone(),
            inputs: vec![self.sharding.spec.clone()],
            outputs: vec![target.clone()],
        };
        let exe = ShardedFunction::with_devices(client, &f, shardings, &[], &self.devices)?;
        Ok(exe.run(&[self])?.remove(0))
    }
}

/// A traced function compiled for SPMD execution over a mesh.
pub struct ShardedFunction {
    client: Client,
    function: Function,
    shardings: FunctionShardings,
    stablehlo: String,
    executable: Arc<LoadedExecutable>,
    /// The mesh position of each of the executable's (this process's)
    /// devices, in its execution order.
    positions: Vec<usize>,
    /// The mesh's devices in mesh order (every process's).
    devices: Vec<Device>,
}

/// The compile options for a program over `devices` (the mesh's, in mesh
/// order; None: the client's first `n`), and its explicit assignment when
/// one is needed: XLA's default assignment puts partition `d` on the
/// client's `d`-th addressable device, which fits a mesh over those devices
/// in that order; a mesh over other devices, another order, or other
/// processes' devices (every process compiling the same assignment of
/// global ids) is assigned explicitly.
fn spmd_options(
    client: &Client,
    n: i64,
    devices: Option<&[Device]>,
) -> Result<(CompileOptions, Option<Vec<i64>>)> {
    let ids_of =
        |ds: &[Device]| -> Result<Vec<i64>> { ds.iter().map(|d| d.id().map(i64::from)).collect() };
    let ids = match devices {
        Some(d) => ids_of(d)?,
        None if client.spans_processes()? => {
            let all = client.devices_in_process_order()?;
            ids_of(&all[..all.len().min(n as usize)])?
        }
        None => return Ok((CompileOptions::spmd(n), None)),
    };
    let local = client.addressable_devices()?;
    if ids_of(&local[..local.len().min(n as usize)])? == ids {
        return Ok((CompileOptions::spmd(n), None));
    }
    Ok((CompileOptions::spmd_on(&ids), Some(ids)))
}

impl ShardedFunction {
    /// Lowers `f` as given (simplify it first: `hlo_ir::simplify`) with
    /// `shardings` and compiles it for `mesh.size()` partitions with
    /// Shardy.
    pub fn new(client: &Client, f: &Function, shardings: FunctionShardings) -> Result<Self> {
        Self::with_donation(client, f, shardings, &[])
    }

    /// Like [`ShardedFunction::new`], with (input, output) pairs whose
    /// buffers the run reuses: those inputs are consumed by `run`.
    pub fn with_donation(
        client: &Client,
        f: &Function,
        shardings: FunctionShardings,
        donated: &[(usize, usize)],
    ) -> Result<Self> {
        Self::compile(client, f, shardings, donated, None)
    }

    /// [`ShardedFunction::with_donation`] over the mesh's `devices` (in
    /// mesh order), which may include other processes' devices.
    pub fn with_devices(
        client: &Client,
        f: &Function,
        shardings: FunctionShardings,
        donated: &[(usize, usize)],
        devices: &[Device],
    ) -> Result<Self> {
        shardings.mesh.check_devices(devices.len())?;
        Self::compile(client, f, shardings, donated, Some(devices))
    }

    fn compile(
        client: &Client,
        f: &Function,
        shardings: FunctionShardings,
        donated: &[(usize, usize)],
        devices: Option<&[Device]>,
    ) -> Result<Self> {
        let function = f.clone();
        let n = shardings.mesh.size();
        if shardings.inputs.len() != function.inputs.len()
            || shardings.outputs.len() != function.outputs.len()
        {
            return Err(Error::InvalidArgument(format!(
                "{} has {} inputs and {} outputs; the shardings give {} and {}",
                function.name,
                function.inputs.len(),
                function.outputs.len(),
                shardings.inputs.len(),
                shardings.outputs.len()
            )));
        }
        for (b, spec) in function.inputs.iter().zip(&shardings.inputs) {
            spec.validate(&shardings.mesh, &function.ty(b.value).dims, &b.name)?;
        }
        for (b, spec) in function.outputs.iter().zip(&shardings.outputs) {
            spec.validate(&shardings.mesh, &function.ty(b.value).dims, &b.name)?;
        }
        let stablehlo = hlo_lowering::to_stablehlo_with(&function, Some(&shardings), donated);
        let (options, assignment) = spmd_options(client, n, devices)?;
        let executable = client.compile_cached(&stablehlo, &options)?;
        let devices = match devices {
            Some(d) => d.to_vec(),
            None if assignment.is_some() => client
                .devices_in_process_order()?
                .into_iter()
                .take(n as usize)
                .collect(),
            None => executable.devices().to_vec(),
        };
        let positions = match assignment {
            None => (0..executable.devices().len()).collect(),
            Some(ids) => executable
                .devices()
                .iter()
                .map(|d| {
                    let id = i64::from(d.id()?);
                    ids.iter().position(|&x| x == id).ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "the executable runs on device {id}, which its assignment {ids:?} lacks"
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()?,
        };
        Ok(ShardedFunction {
            client: client.clone(),
            function,
            shardings,
            stablehlo,
            executable,
            positions,
            devices,
        })
    }

    pub fn function(&self) -> &Function {
        &self.function
    }

    pub fn shardings(&self) -> &FunctionShardings {
        &self.shardings
    }

    pub fn stablehlo(&self) -> &str {
        &self.stablehlo
    }

    pub fn executable(&self) -> &LoadedExecutable {
        &self.executable
    }

    /// The mesh's devices, in mesh order (other processes' too, when the
    /// mesh spans processes).
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The sharding input `i` must have.
    pub fn input_sharding(&self, i: usize) -> Sharding {
        Sharding::new(
            self.shardings.mesh.clone(),
            self.shardings.inputs[i].clone(),
        )
    }

    /// Runs on arrays already laid out as the program expects.
    pub fn run(&self, inputs: &[&DeviceArray]) -> Result<Vec<DeviceArray>> {
        let f = &self.function;
        check_signature(f, inputs.iter().map(|a| a.ty()))?;
        for (i, (b, a)) in f.inputs.iter().zip(inputs).enumerate() {
            let want = self.input_sharding(i);
            if a.sharding().mesh != want.mesh
                || a.sharding().spec.canonical() != want.spec.canonical()
            {
                return Err(Error::InvalidArgument(format!(
                    "input `{}` is laid out as {} over {}, the program expects {} over {} (reshard it first)",
                    b.name,
                    a.sharding().spec,
                    a.sharding().mesh,
                    self.shardings.inputs[i],
                    self.shardings.mesh
                )));
            }
        }
        let devices = self.positions.len();
        let args: Vec<Vec<&Buffer>> = self
            .positions
            .iter()
            .map(|&d| {
                inputs
                    .iter()
                    .zip(&f.inputs)
                    .map(|(a, b)| {
                        a.buffer_at(d).ok_or_else(|| {
                            Error::InvalidArgument(format!(
                                "input `{}` has no block on this process's device at mesh position {d}",
                                b.name
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        let outputs = self.executable.execute(&args)?;
        // outputs[device][k] → one DeviceArray per output k, its blocks in
        // mesh order.
        let mut order: Vec<usize> = (0..devices).collect();
        order.sort_by_key(|&i| self.positions[i]);
        let mut outputs: Vec<Option<Vec<Buffer>>> = outputs.into_iter().map(Some).collect();
        let mut per_output: Vec<Vec<Buffer>> = (0..f.outputs.len())
            .map(|_| Vec::with_capacity(devices))
            .collect();
        for &i in &order {
            let device_outputs = outputs[i].take().unwrap_or_default();
            for (k, b) in device_outputs.into_iter().enumerate() {
                per_output[k].push(b);
            }
        }
        let positions: Vec<usize> = order.iter().map(|&i| self.positions[i]).collect();
        Ok(per_output
            .into_iter()
            .zip(&f.outputs)
            .zip(&self.shardings.outputs)
            .map(|((buffers, b), spec)| DeviceArray {
                ty: f.ty(b.value).clone(),
                sharding: Sharding::new(self.shardings.mesh.clone(), spec.clone()),
                buffers,
                positions: positions.clone(),
                client: self.client.clone(),
                devices: self.devices.clone(),
            })
            .collect())
    }

    /// Shards host inputs as the program expects, runs, and gathers the outputs.
    pub fn run_host(&self, inputs: &[HostArray]) -> Result<Vec<HostArray>> {
        let arrays = inputs
            .iter()
            .enumerate()
            .map(|(i, h)| {
                DeviceArray::shard(&self.client, h, &self.input_sharding(i), self.devices())
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&DeviceArray> = arrays.iter().collect();
        self.run(&refs)?.iter().map(DeviceArray::gather).collect()
    }
}
