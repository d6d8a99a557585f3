//! Arrays laid out over a mesh, and programs run SPMD over all its devices.
//!
//! Device `d` of a mesh is partition `d` of the program and the `d`-th
//! device of the executable (XLA's default assignment), so a
//! [`DeviceArray`] keeps one buffer per mesh device in that order.

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
    buffers: Vec<Buffer>,
}

impl DeviceArray {
    /// Splits `host` by `sharding` and copies each device only its block.
    /// `devices` are the mesh's devices in mesh order.
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
        for (d, device) in devices.iter().enumerate() {
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
        })
    }

    /// Assembles the global array on the host (one read per distinct block).
    pub fn gather(&self) -> Result<HostArray> {
        let (mesh, spec) = (&self.sharding.mesh, &self.sharding.spec);
        let dims = &self.ty.dims;
        let block = spec.shard_shape(mesh, dims);
        let elem = self.ty.dtype.size_in_bytes();
        let mut out = vec![0u8; self.ty.size_in_bytes()];
        let mut done = std::collections::HashSet::new();
        for (d, buffer) in self.buffers.iter().enumerate() {
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

    /// One buffer per mesh device, in mesh order.
    pub fn buffers(&self) -> &[Buffer] {
        &self.buffers
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
        let exe = ShardedFunction::new(client, &f, shardings)?;
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
        let executable = client.compile_cached(&stablehlo, &CompileOptions::spmd(n))?;
        Ok(ShardedFunction {
            client: client.clone(),
            function,
            shardings,
            stablehlo,
            executable,
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

    /// The mesh's devices, in mesh order.
    pub fn devices(&self) -> &[Device] {
        self.executable.devices()
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
        let devices = self.devices().len();
        let args: Vec<Vec<&Buffer>> = (0..devices)
            .map(|d| inputs.iter().map(|a| &a.buffers[d]).collect())
            .collect();
        let outputs = self.executable.execute(&args)?;
        // outputs[device][k] → one DeviceArray per output k.
        let mut per_output: Vec<Vec<Buffer>> = (0..f.outputs.len())
            .map(|_| Vec::with_capacity(devices))
            .collect();
        for device_outputs in outputs {
            for (k, b) in device_outputs.into_iter().enumerate() {
                per_output[k].push(b);
            }
        }
        Ok(per_output
            .into_iter()
            .zip(&f.outputs)
            .zip(&self.shardings.outputs)
            .map(|((buffers, b), spec)| DeviceArray {
                ty: f.ty(b.value).clone(),
                sharding: Sharding::new(self.shardings.mesh.clone(), spec.clone()),
                buffers,
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
