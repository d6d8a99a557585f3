//! Compiling a step for a GPU that is not here: XLA's own CUDA or ROCm
//! compiler (the official plugins, installed by `make setup-targets`),
//! given a topology of N devices of a kind of the hardware table and that
//! kind's target description, compiles the step's StableHLO as it would
//! on the device's host, with no device and no driver. What comes back is
//! XLA's memory figures for that GPU, the HLO it optimized, and the
//! executable's bytes (the real cubin or HSACO), loadable on the GPU's
//! host by the same plugin.
//!
//! Two things differ from a compile on the device: nothing is autotuned
//! (matmuls get fallback tiles: memory and fusion are the device's,
//! speed is not), and cuDNN's fused attention cannot be compiled without
//! libcuda, so a step that would take it compiles with its stand-in
//! ([`crate::analysis::plan::cudnn_stand_in`]) and says so.

use std::time::Instant;

use hlo_runtime::{
    find_target_compiler, CompileOptions, CompiledForTarget, CompiledMemoryStats, Plugin,
    PluginKind, Topology,
};

use crate::analysis::hardware::Device;
use crate::device::pipeline::ShardedStep;
use crate::error::{EngineError, Result};

/// XLA's compiler for `devices` devices of one GPU kind.
pub struct TargetCompiler {
    topology: Topology,
    device: &'static Device,
    devices: usize,
}

impl std::fmt::Debug for TargetCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TargetCompiler")
            .field("device", &self.device.name)
            .field("devices", &self.devices)
            .finish()
    }
}

/// A step compiled for a target.
pub struct TargetCompile {
    pub executable: CompiledForTarget,
    /// XLA's figures for one device of the target.
    pub xla: CompiledMemoryStats,
    /// Seconds the compile took here.
    pub compile_s: f64,
}

impl TargetCompiler {
    /// The compiler for `devices` of `device`'s kind, if installed: the
    /// error says what to run when it is not.
    pub fn open(device: &'static Device, devices: usize) -> Result<TargetCompiler> {
        let (Some(config), Some(platform)) =
            (device.gpu_target_config(), device.compiler_platform())
        else {
            return Err(EngineError::Target {
                target: device.name.to_string(),
                why: "no GPU compiler targets it: targets are the GPUs of the hardware table"
                    .into(),
            });
        };
        let kind = match platform {
            "rocm" => PluginKind::Rocm,
            _ => PluginKind::Cuda,
        };
        let install = find_target_compiler(kind)?;
        // Installed but broken: say how to install it again.
        let broken = |e: hlo_runtime::Error| {
            EngineError::Target {
            target: device.name.to_string(),
            why: format!(
                "XLA's compiler at {} does not load: {e}; run `make setup-targets` to install it again",
                install.plugin.display()
            ),
        }
        };
        let plugin = Plugin::load_after(&install.plugin, &install.preload).map_err(broken)?;
        let topology = Topology::gpu(&plugin, 1, devices, config).map_err(broken)?;
        Ok(TargetCompiler {
            topology,
            device,
            devices,
        })
    }

    /// The plugin that compiles.
    pub fn plugin(&self) -> &Plugin {
        self.topology.plugin()
    }

    /// The platform the plugin compiles for (`cuda`, `rocm`), as it says.
    pub fn platform_name(&self) -> Result<String> {
        Ok(self.topology.platform_name()?)
    }

    /// The compiler in words: `XLA's CUDA compiler for 8 × H100`.
    pub fn describe(&self) -> String {
        let platform = match self.device.compiler_platform() {
            Some("rocm") => "ROCm",
            _ => "CUDA",
        };
        let devices = match self.devices {
            1 => format!("one {}", self.device.name),
            n => format!("{n} × {}", self.device.name),
        };
        format!("XLA's {platform} compiler for {devices}")
    }

    /// Compiles `step` (its mesh's size must be the topology's) with the
    /// XLA flags of `options`.
    pub fn compile(&self, step: &ShardedStep, options: &CompileOptions) -> Result<TargetCompile> {
        let options = self.spmd_options(step, options)?;
        self.timed(|| Ok(self.topology.compile(&step.stablehlo(), &options)?))
    }

    /// Compiles `step` as [`TargetCompiler::compile`] does and returns
    /// the HLO XLA optimized too (after fusion, remat and collectives).
    pub fn compile_optimized(
        &self,
        step: &ShardedStep,
        options: &CompileOptions,
    ) -> Result<(TargetCompile, String)> {
        let options = self.spmd_options(step, options)?;
        let dir = DumpDir::new()?;
        let mut text = String::new();
        let compiled = self.timed(|| {
            let (executable, optimized) =
                self.topology
                    .compile_optimized_text(&step.stablehlo(), &options, &dir.0)?;
            text = optimized;
            Ok(executable)
        })?;
        Ok((compiled, text))
    }

    /// `step`'s SPMD options over the topology's devices, with the XLA
    /// flags of `options`.
    fn spmd_options(&self, step: &ShardedStep, options: &CompileOptions) -> Result<CompileOptions> {
        let n = step.mesh().size();
        if n as usize != self.devices {
            return Err(EngineError::Target {
                target: self.device.name.to_string(),
                why: format!(
                    "the step is laid out over {n} devices; the compiler's topology has {}",
                    self.devices
                ),
            });
        }
        Ok(CompileOptions {
            env_option_overrides: options.env_option_overrides.clone(),
            ..CompileOptions::spmd(n)
        })
    }

    /// Runs `compile`, timed, with XLA's figures of what it made.
    fn timed(&self, compile: impl FnOnce() -> Result<CompiledForTarget>) -> Result<TargetCompile> {
        let t0 = Instant::now();
        let executable = compile()?;
        let compile_s = t0.elapsed().as_secs_f64();
        let xla = executable.compiled_memory_stats()?;
        Ok(TargetCompile {
            executable,
            xla,
            compile_s,
        })
    }
}

/// A folder of its own for one compile's dump, removed when dropped.
struct DumpDir(std::path::PathBuf);

impl DumpDir {
    fn new() -> Result<DumpDir> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("hlo-train-xla-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(EngineError::io("create", &dir))?;
        Ok(DumpDir(dir))
    }
}

impl Drop for DumpDir {
    fn drop(&mut self) {
        // What XLA wrote is read already; a leftover in /tmp harms nothing.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
