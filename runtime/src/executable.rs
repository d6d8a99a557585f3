//! Compiled programs, loaded on devices, and their execution.

use std::sync::Arc;

use crate::buffer::Buffer;
use crate::client::{Client, ClientInner, Device};
use crate::compile_options::CompileOptions;
use crate::error::{Error, Result};
use crate::ffi::{self, Args, Slot};
use crate::plugin::lossy;
use crate::signature::ParamType;

/// What the compiler says the program needs per device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompiledMemoryStats {
    pub generated_code_size_in_bytes: i64,
    pub argument_size_in_bytes: i64,
    pub output_size_in_bytes: i64,
    /// Bytes of outputs that alias (reuse) donated arguments.
    pub alias_size_in_bytes: i64,
    pub temp_size_in_bytes: i64,
    /// 0 when the plugin does not report it.
    pub peak_memory_in_bytes: i64,
}

impl CompiledMemoryStats {
    /// Arguments + outputs − aliased + temporaries: what one device holds at
    /// most while the program runs.
    pub fn total_device_bytes(&self) -> i64 {
        self.argument_size_in_bytes + self.output_size_in_bytes - self.alias_size_in_bytes
            + self.temp_size_in_bytes
    }
}

/// A `PJRT_Executable` we own (for queries about the compiled program).
struct Executable {
    raw: *mut ffi::PJRT_Executable,
    client: Arc<ClientInner>,
}

impl Drop for Executable {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_Executable_Destroy_Args::new();
        a.executable = self.raw;
        // SAFETY: destroyed exactly once.
        let _ = unsafe { self.client.api.call(Slot::PJRT_Executable_Destroy, &mut a) };
    }
}

/// A compiled program loaded on its devices; destroyed on drop.
pub struct LoadedExecutable {
    raw: *mut ffi::PJRT_LoadedExecutable,
    client: Arc<ClientInner>,
    devices: Vec<Device>,
    num_outputs: usize,
    options: CompileOptions,
    /// Declared parameter types, when the program text told us.
    params: Option<Vec<Option<ParamType>>>,
}

// SAFETY: PJRT executables may be executed from any thread.
unsafe impl Send for LoadedExecutable {}
unsafe impl Sync for LoadedExecutable {}

impl Drop for LoadedExecutable {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_LoadedExecutable_Destroy_Args::new();
        a.executable = self.raw;
        // SAFETY: destroyed exactly once.
        let _ = unsafe {
            self.client
                .api
                .call(Slot::PJRT_LoadedExecutable_Destroy, &mut a)
        };
    }
}

impl LoadedExecutable {
    pub(crate) fn wrap(
        client: &Client,
        raw: *mut ffi::PJRT_LoadedExecutable,
        options: CompileOptions,
        params: Option<Vec<Option<ParamType>>>,
    ) -> Result<Self> {
        if raw.is_null() {
            return Err(Error::InvalidArgument(
                "the plugin returned no executable".into(),
            ));
        }
        let mut exe = LoadedExecutable {
            raw,
            client: client.inner.clone(),
            devices: Vec::new(),
            num_outputs: 0,
            options,
            params,
        };
        let mut a = ffi::PJRT_LoadedExecutable_AddressableDevices_Args::new();
        a.executable = raw;
        // SAFETY: matching args; the device array is owned by the executable.
        unsafe {
            client
                .inner
                .api
                .call(Slot::PJRT_LoadedExecutable_AddressableDevices, &mut a)?
        };
        exe.devices = client.wrap_devices(a.addressable_devices, a.num_addressable_devices);
        let inner = exe.executable()?;
        let mut n = ffi::PJRT_Executable_NumOutputs_Args::new();
        n.executable = inner.raw;
        // SAFETY: matching args.
        unsafe {
            client
                .inner
                .api
                .call(Slot::PJRT_Executable_NumOutputs, &mut n)?
        };
        exe.num_outputs = n.num_outputs;
        Ok(exe)
    }

    fn executable(&self) -> Result<Executable> {
        let mut a = ffi::PJRT_LoadedExecutable_GetExecutable_Args::new();
        a.loaded_executable = self.raw;
        // SAFETY: matching args; the returned executable is ours to destroy.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_LoadedExecutable_GetExecutable, &mut a)?
        };
        if a.executable.is_null() {
            return Err(Error::InvalidArgument(
                "the plugin returned no executable".into(),
            ));
        }
        Ok(Executable {
            raw: a.executable,
            client: self.client.clone(),
        })
    }

    /// The devices the program runs on, in argument-list order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Outputs per device.
    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    pub fn options(&self) -> &CompileOptions {
        &self.options
    }

    /// The compiled module's name.
    pub fn name(&self) -> Result<String> {
        let exe = self.executable()?;
        let mut a = ffi::PJRT_Executable_Name_Args::new();
        a.executable = exe.raw;
        // SAFETY: matching args; the string is copied before `exe` drops.
        unsafe { self.client.api.call(Slot::PJRT_Executable_Name, &mut a)? };
        // SAFETY: the plugin returned this (pointer, length) pair.
        Ok(unsafe { lossy(a.executable_name.cast(), a.executable_name_size) })
    }

    /// Per-device memory the compiler planned for this program.
    pub fn compiled_memory_stats(&self) -> Result<CompiledMemoryStats> {
        let exe = self.executable()?;
        memory_stats_of(&self.client.api, exe.raw)
    }

    /// The plugin's serialization of this program, for
    /// [`Client::load_serialized`] by a client of the same plugin.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let exe = self.executable()?;
        crate::topology::serialize_executable(&self.client.api, exe.raw)
    }

    /// Runs the program. `args[d]` are the arguments for `self.devices()[d]`
    /// (one shard per argument per device); the result holds each device's
    /// outputs in the same order. Buffers of donated arguments are deleted
    /// by the run. Execution is asynchronous: outputs become ready later and
    /// reading them waits.
    pub fn execute(&self, args: &[Vec<&Buffer>]) -> Result<Vec<Vec<Buffer>>> {
        self.check_arguments(args)?;
        let num_devices = self.devices.len();
        let num_args = args.first().map_or(0, Vec::len);
        let arg_ptrs: Vec<Vec<*mut ffi::PJRT_Buffer>> = args
            .iter()
            .map(|list| list.iter().map(|b| b.raw()).collect())
            .collect();
        let arg_lists: Vec<*const *mut ffi::PJRT_Buffer> =
            arg_ptrs.iter().map(|l| l.as_ptr()).collect();
        let mut out_ptrs: Vec<Vec<*mut ffi::PJRT_Buffer>> =
            vec![vec![std::ptr::null_mut(); self.num_outputs]; num_devices];
        let out_lists: Vec<*mut *mut ffi::PJRT_Buffer> =
            out_ptrs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut options = ffi::PJRT_ExecuteOptions::new();
        let mut a = ffi::PJRT_LoadedExecutable_Execute_Args::new();
        a.executable = self.raw;
        a.options = &mut options;
        a.argument_lists = arg_lists.as_ptr();
        a.num_devices = num_devices;
        a.num_args = num_args;
        a.output_lists = out_lists.as_ptr();
        // SAFETY: argument and output arrays have the sizes the header asks
        // for and outlive the call; output buffers become ours.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_LoadedExecutable_Execute, &mut a)?
        };
        out_ptrs
            .into_iter()
            .map(|list| {
                list.into_iter()
                    .map(|p| Buffer::wrap(self.client.clone(), p))
                    .collect()
            })
            .collect()
    }

    /// Refuses argument lists the plugin might crash on rather than reject.
    fn check_arguments(&self, args: &[Vec<&Buffer>]) -> Result<()> {
        if args.len() != self.devices.len() {
            return Err(Error::InvalidArgument(format!(
                "the program runs on {} devices but {} argument lists were given",
                self.devices.len(),
                args.len()
            )));
        }
        let n = args.first().map_or(0, Vec::len);
        for (d, list) in args.iter().enumerate() {
            if list.len() != n {
                return Err(Error::InvalidArgument(format!(
                    "device {d} got {} arguments but device 0 got {n}",
                    list.len()
                )));
            }
            for (i, buffer) in list.iter().enumerate() {
                if !buffer.same_client(&self.client) {
                    return Err(Error::InvalidArgument(format!(
                        "argument {i} for device {d} belongs to another client"
                    )));
                }
                if let Some(Some(want)) = self.params.as_ref().and_then(|p| p.get(i)) {
                    self.check_type(i, d, buffer, want)?;
                }
                if buffer.device()? != self.devices[d] {
                    return Err(Error::InvalidArgument(format!(
                        "argument {i} for device {d} lives on {:?}, not on {:?}",
                        buffer.device()?,
                        self.devices[d]
                    )));
                }
            }
        }
        if let Some(params) = &self.params {
            if n != params.len() {
                return Err(Error::InvalidArgument(format!(
                    "the program takes {} arguments but {n} were given",
                    params.len()
                )));
            }
        }
        Ok(())
    }

    /// Element type must match; dims must match exactly for one device, and
    /// divide the global dims for a partitioned program (a shard).
    fn check_type(&self, i: usize, d: usize, buffer: &Buffer, want: &ParamType) -> Result<()> {
        let dtype = buffer.dtype()?;
        let dims = buffer.dims()?;
        let fits = if self.options.num_partitions == 1 {
            dims == want.dims
        } else {
            dims.len() == want.dims.len()
                && dims
                    .iter()
                    .zip(&want.dims)
                    .all(|(&s, &g)| s > 0 && s <= g && g % s == 0 || s == g)
        };
        if dtype != want.dtype || !fits {
            let what = if self.options.num_partitions == 1 {
                ""
            } else {
                " (or a shard of it)"
            };
            return Err(Error::InvalidArgument(format!(
                "argument {i} for device {d} is {dtype}{dims:?} but the program expects {}{:?}{what}",
                want.dtype, want.dims
            )));
        }
        Ok(())
    }
}

/// `PJRT_Executable_GetCompiledMemoryStats` of `raw`.
pub(crate) fn memory_stats_of(
    api: &crate::plugin::Api,
    raw: *mut ffi::PJRT_Executable,
) -> Result<CompiledMemoryStats> {
    let mut a = ffi::PJRT_Executable_GetCompiledMemoryStats_Args::new();
    a.executable = raw;
    // SAFETY: matching args.
    unsafe { api.call(Slot::PJRT_Executable_GetCompiledMemoryStats, &mut a)? };
    Ok(CompiledMemoryStats {
        generated_code_size_in_bytes: a.generated_code_size_in_bytes,
        argument_size_in_bytes: a.argument_size_in_bytes,
        output_size_in_bytes: a.output_size_in_bytes,
        alias_size_in_bytes: a.alias_size_in_bytes,
        temp_size_in_bytes: a.temp_size_in_bytes,
        peak_memory_in_bytes: a.peak_memory_in_bytes,
    })
}
