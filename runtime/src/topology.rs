//! Compiling for devices that are not here: a plugin's description of a
//! topology (`PJRT_TopologyDescription_Create`) and `PJRT_Compile` against
//! it, which needs no client and so no device or driver. XLA's official
//! GPU plugins take the devices as two string options, `"topology"`
//! (`"1x1x8"`: slices × hosts × devices a host) and `"target_config"` (a
//! `GpuTargetConfigProto` in protobuf text format); the result is an
//! unloaded executable whose memory figures are XLA's for that GPU and
//! whose serialization holds the real machine code, to be loaded by a
//! client of the same plugin on the GPU's host ([`Client::load_serialized`]).
//!
//! Serializing a compiled program and loading it back is here too, for
//! any plugin that implements it (the CPU plugin does).

use std::os::raw::c_char;
use std::path::Path;

use crate::client::{named_values, Client, OptionValue};
use crate::compile_options::{CompileOptions, XlaOption};
use crate::error::{Error, Result};
use crate::executable::{CompiledMemoryStats, LoadedExecutable};
use crate::ffi::{self, Args, Slot};
use crate::plugin::{lossy, Api, Plugin};

/// Devices a plugin compiles for, described rather than present.
pub struct Topology {
    raw: *mut ffi::PJRT_TopologyDescription,
    plugin: Plugin,
}

// SAFETY: a topology description is immutable once made.
unsafe impl Send for Topology {}
unsafe impl Sync for Topology {}

impl Drop for Topology {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_TopologyDescription_Destroy_Args::new();
        a.topology = self.raw;
        // SAFETY: destroyed exactly once, after every compile that used it.
        let _ = unsafe {
            self.plugin
                .api
                .call(Slot::PJRT_TopologyDescription_Destroy, &mut a)
        };
    }
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topology")
            .field("plugin", &self.plugin)
            .finish()
    }
}

impl Topology {
    /// The plugin's topology `name` made with `options`.
    pub fn new(plugin: &Plugin, name: &str, options: &[(String, OptionValue)]) -> Result<Self> {
        let values = named_values(options);
        let mut a = ffi::PJRT_TopologyDescription_Create_Args::new();
        a.topology_name = name.as_ptr() as *const c_char;
        a.topology_name_size = name.len();
        a.create_options = values.as_ptr();
        a.num_options = values.len();
        // SAFETY: name and options outlive the call.
        unsafe {
            plugin
                .api
                .call(Slot::PJRT_TopologyDescription_Create, &mut a)?
        };
        if a.topology.is_null() {
            return Err(Error::InvalidArgument(
                "PJRT_TopologyDescription_Create returned no topology".into(),
            ));
        }
        Ok(Topology {
            raw: a.topology,
            plugin: plugin.clone(),
        })
    }

    /// `devices` GPUs on each of `hosts` hosts, described by
    /// `target_config` (a `GpuTargetConfigProto` in text format), as
    /// XLA's CUDA and ROCm plugins take them.
    pub fn gpu(plugin: &Plugin, hosts: usize, devices: usize, target_config: &str) -> Result<Self> {
        if hosts == 0 || devices == 0 {
            return Err(Error::InvalidArgument(format!(
                "a topology needs at least one host and one device, got {hosts} × {devices}"
            )));
        }
        let options = [
            (
                "topology".to_string(),
                OptionValue::String(format!("1x{hosts}x{devices}")),
            ),
            (
                "target_config".to_string(),
                OptionValue::String(target_config.to_string()),
            ),
        ];
        Self::new(plugin, "", &options)
    }

    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    fn api(&self) -> &Api {
        &self.plugin.api
    }

    /// The platform the topology's devices are (`cuda`, `rocm`).
    pub fn platform_name(&self) -> Result<String> {
        let mut a = ffi::PJRT_TopologyDescription_PlatformName_Args::new();
        a.topology = self.raw;
        // SAFETY: matching args; the string is owned by the topology.
        unsafe {
            self.api()
                .call(Slot::PJRT_TopologyDescription_PlatformName, &mut a)?
        };
        // SAFETY: the plugin returned this (pointer, length) pair.
        Ok(unsafe { lossy(a.platform_name.cast(), a.platform_name_size) })
    }

    /// The global ids of the topology's devices, in the plugin's order.
    pub fn device_ids(&self) -> Result<Vec<i64>> {
        let mut a = ffi::PJRT_TopologyDescription_GetDeviceDescriptions_Args::new();
        a.topology = self.raw;
        // SAFETY: matching args; the descriptions are owned by the topology.
        unsafe {
            self.api()
                .call(Slot::PJRT_TopologyDescription_GetDeviceDescriptions, &mut a)?
        };
        if a.descriptions.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin gave `num_descriptions` pointers.
        let descriptions =
            unsafe { std::slice::from_raw_parts(a.descriptions, a.num_descriptions) };
        descriptions
            .iter()
            .map(|&d| {
                let mut id = ffi::PJRT_DeviceDescription_Id_Args::new();
                id.device_description = d;
                // SAFETY: matching args.
                unsafe { self.api().call(Slot::PJRT_DeviceDescription_Id, &mut id)? };
                Ok(i64::from(id.id))
            })
            .collect()
    }

    /// Compiles StableHLO `mlir` for this topology. `options` partition
    /// it over `num_partitions` of its devices; without a device
    /// assignment the first ones are assigned, as the plugin orders them.
    pub fn compile(&self, mlir: &str, options: &CompileOptions) -> Result<CompiledForTarget> {
        crate::compile_options::check_before_compile(options)?;
        let ids = self.device_ids()?;
        let n = options.num_partitions as usize;
        if n > ids.len() {
            return Err(Error::InvalidArgument(format!(
                "the program is partitioned over {n} devices but the topology has {}",
                ids.len()
            )));
        }
        let mut options = options.clone();
        if options.device_assignment.is_none() {
            options.device_assignment = Some(ids[..n].to_vec());
        }
        let program = ffi::PJRT_Program::mlir(mlir);
        let encoded = options.encode();
        let mut a = ffi::PJRT_Compile_Args::new();
        a.topology = self.raw;
        a.program = &program;
        a.compile_options = encoded.as_ptr() as *const c_char;
        a.compile_options_size = encoded.len();
        // SAFETY: program text and options outlive the call.
        unsafe { self.api().call(Slot::PJRT_Compile, &mut a)? };
        if a.executable.is_null() {
            return Err(Error::InvalidArgument(
                "PJRT_Compile returned no executable".into(),
            ));
        }
        Ok(CompiledForTarget {
            raw: a.executable,
            plugin: self.plugin.clone(),
        })
    }

    /// Compiles `mlir` as [`Topology::compile`] does, with XLA writing the
    /// program it optimized into `dir`; returns the compiled program and
    /// that HLO's text (the module after XLA's last pass).
    pub fn compile_optimized_text(
        &self,
        mlir: &str,
        options: &CompileOptions,
        dir: &Path,
    ) -> Result<(CompiledForTarget, String)> {
        let mut options = options.clone();
        let dump = [
            (
                "xla_dump_to",
                XlaOption::Str(dir.to_string_lossy().into_owned()),
            ),
            ("xla_dump_hlo_as_text", XlaOption::Bool(true)),
            ("xla_dump_hlo_pass_re", XlaOption::Str("^$".into())),
        ];
        for (key, value) in dump {
            options.env_option_overrides.retain(|(k, _)| k != key);
            options.env_option_overrides.push((key.to_string(), value));
        }
        let compiled = self.compile(mlir, &options)?;
        let text = largest_optimized_dump(dir)?;
        Ok((compiled, text))
    }
}

/// The text of the largest `*after_optimizations.txt` XLA dumped into
/// `dir` (the program; smaller ones are helper modules).
fn largest_optimized_dump(dir: &Path) -> Result<String> {
    let mut best: Option<(u64, std::path::PathBuf)> = None;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if !name.is_some_and(|n| n.ends_with("after_optimizations.txt")) {
            continue;
        }
        let len = std::fs::metadata(&path)?.len();
        if best.as_ref().is_none_or(|(l, _)| len > *l) {
            best = Some((len, path));
        }
    }
    match best {
        Some((_, path)) => Ok(std::fs::read_to_string(path)?),
        None => Err(Error::InvalidArgument(format!(
            "XLA wrote no optimized program into {}",
            dir.display()
        ))),
    }
}

/// A program compiled for a topology: XLA's figures and its serialization,
/// not runnable here.
pub struct CompiledForTarget {
    raw: *mut ffi::PJRT_Executable,
    plugin: Plugin,
}

// SAFETY: an unloaded executable is only read.
unsafe impl Send for CompiledForTarget {}
unsafe impl Sync for CompiledForTarget {}

impl Drop for CompiledForTarget {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_Executable_Destroy_Args::new();
        a.executable = self.raw;
        // SAFETY: destroyed exactly once.
        let _ = unsafe { self.plugin.api.call(Slot::PJRT_Executable_Destroy, &mut a) };
    }
}

impl CompiledForTarget {
    /// Per-device memory XLA planned for the program on the target.
    pub fn compiled_memory_stats(&self) -> Result<CompiledMemoryStats> {
        crate::executable::memory_stats_of(&self.plugin.api, self.raw)
    }

    /// The plugin's serialization of the program (machine code included).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        serialize_executable(&self.plugin.api, self.raw)
    }
}

/// `PJRT_Executable_Serialize` of `raw`, copied out.
pub(crate) fn serialize_executable(api: &Api, raw: *mut ffi::PJRT_Executable) -> Result<Vec<u8>> {
    let mut a = ffi::PJRT_Executable_Serialize_Args::new();
    a.executable = raw;
    // SAFETY: matching args; the bytes live until the deleter runs.
    unsafe { api.call(Slot::PJRT_Executable_Serialize, &mut a)? };
    let bytes = if a.serialized_bytes.is_null() {
        Vec::new()
    } else {
        // SAFETY: the plugin gave this (pointer, length) pair.
        unsafe {
            std::slice::from_raw_parts(a.serialized_bytes.cast::<u8>(), a.serialized_bytes_size)
                .to_vec()
        }
    };
    if let Some(deleter) = a.serialized_executable_deleter {
        // SAFETY: called exactly once, as the API asks.
        unsafe { deleter(a.serialized_executable) };
    }
    if bytes.is_empty() {
        return Err(Error::InvalidArgument(
            "the plugin serialized the executable as no bytes".into(),
        ));
    }
    Ok(bytes)
}

impl Client {
    /// Loads an executable serialized by this plugin (same version),
    /// compiled with `options`, onto this client's devices.
    pub fn load_serialized(
        &self,
        bytes: &[u8],
        options: &CompileOptions,
    ) -> Result<LoadedExecutable> {
        let mut a = ffi::PJRT_Executable_DeserializeAndLoad_Args::new();
        a.client = self.inner.raw;
        a.serialized_executable = bytes.as_ptr() as *const c_char;
        a.serialized_executable_size = bytes.len();
        // SAFETY: the bytes outlive the call.
        unsafe {
            self.inner
                .api
                .call(Slot::PJRT_Executable_DeserializeAndLoad, &mut a)?
        };
        LoadedExecutable::wrap(self, a.loaded_executable, options.clone(), None)
    }
}
