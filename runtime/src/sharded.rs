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

/// Copies where two blocks of one array overlap: `src` (dims `src_dims`,
/// starting at `src_at` in the array) into `dst` (`dst_dims` at
/// `dst_at`). Returns the elements copied (0 when they do not meet).
pub fn copy_overlap(
    src: &[u8],
    src_at: &[i64],
    src_dims: &[i64],
    dst: &mut [u8],
    dst_at: &[i64],
    dst_dims: &[i64],
    elem: usize,
) -> u64 {
    let rank = src_dims.len();
    let lo: Vec<i64> = (0..rank).map(|k| src_at[k].max(dst_at[k])).collect();
    let hi: Vec<i64> = (0..rank)
        .map(|k| (src_at[k] + src_dims[k]).min(dst_at[k] + dst_dims[k]))
        .collect();
    if (0..rank).any(|k| lo[k] >= hi[k]) {
        return 0;
    }
    let block: Vec<i64> = (0..rank).map(|k| hi[k] - lo[k]).collect();
    let rel = |at: &[i64]| -> Vec<i64> { (0..rank).map(|k| lo[k] - at[k]).collect() };
    copy_block(
        src,
        src_dims,
        &rel(src_at),
        dst,
        dst_dims,
        &rel(dst_at),
        &block,
        elem,
    );
    block.iter().product::<i64>() as u64
}

/// The blocks of an array of `dims` laid out by `sharding` that the
/// process holding mesh positions `held` writes when every process saves
/// its part once: each distinct block is written by the lowest mesh
/// position that holds it (replicas are skipped), so over all processes
/// every block is written exactly once. Returns (position, offset) pairs.
pub fn blocks_to_write(
    sharding: &Sharding,
    dims: &[i64],
    held: &[usize],
) -> Vec<(usize, Vec<i64>)> {
    let (mesh, spec) = (&sharding.mesh, &sharding.spec);
    let mut seen = std::collections::HashSet::new();
    (0..mesh.size() as usize)
        .filter_map(|d| {
            let at = spec.shard_offset(mesh, dims, d as i64);
            (seen.insert(at.clone()) && held.contains(&d)).then_some((d, at))
        })
        .collect()
}

/// Which rows of an array of `dims` laid out by `sharding` the process
/// holding mesh positions `held` holds: one flag per row, the rows being
/// every index of the dimensions but the last (a batch's `[rows, seq]`,
/// or `[micro-batches, rows, seq]` flattened): the rows a process fills.
pub fn rows_held(sharding: &Sharding, dims: &[i64], held: &[usize]) -> Vec<bool> {
    let (mesh, spec) = (&sharding.mesh, &sharding.spec);
    let outer = &dims[..dims.len().saturating_sub(1)];
    let n: i64 = outer.iter().product();
    let block = spec.shard_shape(mesh, dims);
    let mut out = vec![false; n as usize];
    for &d in held {
        let at = spec.shard_offset(mesh, dims, d as i64);
        for (r, flag) in out.iter_mut().enumerate() {
            // Row r's index in each outer dimension, row-major.
            let mut rest = r as i64;
            let mut inside = true;
            for k in (0..outer.len()).rev() {
                let i = rest % outer[k];
                rest /= outer[k];
                inside &= at[k] <= i && i < at[k] + block[k];
            }
            *flag |= inside;
        }
    }
    out
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
        let elem = ty.dtype.size_in_bytes();
        Self::from_blocks::<Error>(client, &ty, sharding, devices, |at, block| {
            let n: i64 = block.iter().product();
            let mut bytes = vec![0u8; n as usize * elem];
            copy_block(
                host.bytes(),
                &ty.dims,
                at,
                &mut bytes,
                block,
                &vec![0; block.len()],
                block,
                elem,
            );
            HostArray::from_bytes(ty.dtype, block, bytes)
        })
    }

    /// An array of type `ty` laid out by `sharding` whose blocks come from
    /// `fill(offset, block dims)`, asked once per distinct block this
    /// process's devices hold (a restore reads each from a checkpoint, so
    /// the whole array is never on the host). `devices` as for
    /// [`DeviceArray::shard`].
    pub fn from_blocks<E: From<Error>>(
        client: &Client,
        ty: &TensorType,
        sharding: &Sharding,
        devices: &[Device],
        mut fill: impl FnMut(&[i64], &[i64]) -> std::result::Result<HostArray, E>,
    ) -> std::result::Result<Self, E> {
        let (mesh, spec) = (&sharding.mesh, &sharding.spec);
        mesh.check_devices(devices.len()).map_err(Error::from)?;
        spec.validate(mesh, &ty.dims, "array")
            .map_err(Error::from)?;
        let block = spec.shard_shape(mesh, &ty.dims);
        let mut read: std::collections::HashMap<Vec<i64>, HostArray> = Default::default();
        let mut buffers = Vec::with_capacity(devices.len());
        let mut positions = Vec::with_capacity(devices.len());
        for (d, device) in devices.iter().enumerate() {
            if !device.is_addressable()? {
                continue;
            }
            positions.push(d);
            let at = spec.shard_offset(mesh, &ty.dims, d as i64);
            if !read.contains_key(&at) {
                let piece = fill(&at, &block)?;
                if piece.dtype() != ty.dtype || piece.dims() != block.as_slice() {
                    return Err(Error::InvalidArgument(format!(
                        "the block at {at:?} of a {ty} array is {}, not {block:?}",
                        piece.ty()
                    ))
                    .into());
                }
                read.insert(at.clone(), piece);
            }
            buffers.push(client.buffer_from_host(&read[&at], device)?);
        }
        Ok(DeviceArray {
            ty: ty.clone(),
            sharding: sharding.clone(),
            buffers,
            positions,
            client: client.clone(),
            devices: devices.to_vec(),
        })
    }

    /// The dims of each device's block.
    pub fn block_dims(&self) -> Vec<i64> {
        let (mesh, spec) = (&self.sharding.mesh, &self.sharding.spec);
        spec.shard_shape(mesh, &self.ty.dims)
    }

    /// The block at mesh position `d` copied to the host (this process
    /// must hold it).
    pub fn block_to_host(&self, d: usize) -> Result<HostArray> {
        self.buffer_at(d)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("this process holds no block at mesh position {d}"))
            })?
            .to_host()
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

#[cfg(test)]
mod tests {
    use super::*;
    use hlo_partitioner::Mesh;

    /// Two processes of 4 devices each over `dp=2, fsdp=4`: every block of
    /// an array is written once, by a process that holds it, whatever the
    /// layout.
    #[test]
    fn every_block_is_written_once_by_a_process_holding_it() {
        let mesh: Mesh = "dp=2,fsdp=4".parse().unwrap();
        let dims = [8i64, 12];
        for spec in [
            PartitionSpec::new(&[&["fsdp"], &[]]),
            PartitionSpec::new(&[&["dp", "fsdp"], &[]]),
            PartitionSpec::new(&[&[], &["dp"]]),
            PartitionSpec::replicated(),
        ] {
            let sharding = Sharding::new(mesh.clone(), spec.clone());
            let processes: [Vec<usize>; 2] = [(0..4).collect(), (4..8).collect()];
            let mut written: Vec<Vec<i64>> = Vec::new();
            for held in &processes {
                for (d, at) in blocks_to_write(&sharding, &dims, held) {
                    assert!(held.contains(&d), "{spec}: {d} is not this process's");
                    written.push(at);
                }
            }
            let distinct: std::collections::HashSet<Vec<i64>> =
                (0..8).map(|d| spec.shard_offset(&mesh, &dims, d)).collect();
            let once: std::collections::HashSet<Vec<i64>> = written.iter().cloned().collect();
            assert_eq!(written.len(), distinct.len(), "{spec}: {written:?}");
            assert_eq!(once, distinct, "{spec}");
        }
    }

    /// Rows split over `dp=2, fsdp=2` (4 devices, 2 processes of 2):
    /// each process holds its half of each micro-batch, together all.
    #[test]
    fn each_process_holds_its_rows_of_every_micro_batch() {
        let mesh: Mesh = "dp=2,fsdp=2".parse().unwrap();
        let spec = PartitionSpec::new(&[&[], &["dp", "fsdp"], &[]]);
        let sharding = Sharding::new(mesh, spec);
        let dims = [2i64, 8, 16]; // 2 micro-batches of 8 rows
        let first = rows_held(&sharding, &dims, &[0, 1]);
        let second = rows_held(&sharding, &dims, &[2, 3]);
        let want_first: Vec<bool> = (0..16).map(|r| r % 8 < 4).collect();
        assert_eq!(first, want_first);
        assert!(first.iter().zip(&second).all(|(a, b)| a != b));
        assert!(rows_held(&sharding, &dims, &[0, 1, 2, 3])
            .iter()
            .all(|&x| x));
    }

    /// Blocks of one layout read into another's: each element lands where
    /// a host f64 index computation says.
    #[test]
    fn overlapping_blocks_copy_exactly_their_common_region() {
        let dims = [6i64, 4];
        let value = |r: i64, c: i64| (r * 10 + c) as f32;
        // Saved as 3 row blocks of [2, 4]; read as 2 column blocks of [6, 2].
        let saved: Vec<(Vec<i64>, Vec<u8>)> = (0..3)
            .map(|b| {
                let bytes = (0..2)
                    .flat_map(|r| (0..4).map(move |c| value(b * 2 + r, c)))
                    .flat_map(f32::to_le_bytes)
                    .collect();
                (vec![b * 2, 0], bytes)
            })
            .collect();
        for col in [0i64, 2] {
            let mut out = vec![0u8; 6 * 2 * 4];
            let copied: u64 = saved
                .iter()
                .map(|(at, bytes)| {
                    copy_overlap(bytes, at, &[2, 4], &mut out, &[0, col], &[6, 2], 4)
                })
                .sum();
            assert_eq!(copied, 12);
            let got: Vec<f32> = out
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let want: Vec<f32> = (0..dims[0])
                .flat_map(|r| (col..col + 2).map(move |c| value(r, c)))
                .collect();
            assert_eq!(got, want);
        }
        // Blocks that do not meet copy nothing.
        let mut out = vec![0u8; 4];
        assert_eq!(
            copy_overlap(&saved[0].1, &[0, 0], &[2, 4], &mut out, &[5, 3], &[1, 1], 4),
            0
        );
    }
}
