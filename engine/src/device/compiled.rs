//! A train step compiled once, for devices that may be elsewhere, in one
//! file (`hlo-train compile --out step.pjrt`), loaded by `train
//! --executable step.pjrt` in place of compiling. The file is a line
//! naming the format, a line of JSON ([`Manifest`]: what was compiled,
//! with which settings, by which plugin, for which devices), then the
//! plugin's serialized executable.
//!
//! A run loads it only if it is the same program (its StableHLO's
//! fingerprint), for the same kind and number of devices, by the same
//! plugin build (its sha256): an executable is only defined for the
//! plugin version that made it. Anything else is refused, naming the
//! first difference.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use hlo_runtime::{CompileOptions, Mode, XlaOption};

use crate::analysis::hardware::Device;
use crate::device::backend::Backend;
use crate::device::pipeline::ShardedStep;
use crate::device::target::TargetCompiler;
use crate::error::{EngineError, Result};

/// The first line of the file.
pub(crate) const FORMAT_LINE: &str = "hlo-train executable 1";

/// The plugin that compiled (or loads) a program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginIdentity {
    /// The plugin's file name.
    pub file: String,
    /// The sha256 of the plugin's file: executables are only defined for
    /// the build that made them.
    pub sha256: String,
    /// `cuda`, `rocm` or `cpu`.
    pub platform: String,
}

impl PluginIdentity {
    /// The plugin of `client`, as it names its platform.
    pub(crate) fn of_client(client: &hlo_runtime::Client) -> Result<PluginIdentity> {
        PluginIdentity::of(client.plugin().path(), &client.platform_name()?)
    }

    /// The plugin at `path`, of `platform`.
    pub fn of(path: &Path, platform: &str) -> Result<PluginIdentity> {
        let mut hash = Sha256::new();
        crate::files::for_each_chunk(path, |chunk| hash.update(chunk))?;
        Ok(PluginIdentity {
            file: path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
            sha256: hex(&hash.finalize()),
            platform: platform.to_ascii_lowercase(),
        })
    }
}

/// What a compiled step is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// The fingerprint of the program's StableHLO text
    /// ([`hlo_runtime::program_fingerprint`]), in hex.
    pub program_fingerprint: String,
    /// The settings that shape the step (as `train_state/` records
    /// them) and the mesh: what a refusal names.
    pub settings: BTreeMap<String, Value>,
    /// The device kind compiled for, as the hardware table names it
    /// (`H100`, `MI300X`, `CPU`).
    pub device: String,
    /// Devices the program spans (the mesh's).
    pub devices: i64,
    pub plugin: PluginIdentity,
    /// The compiler in words (`XLA's CUDA compiler for one H100`).
    pub compiler: String,
    pub compile_s: f64,
    /// The sha256 of the executable's bytes.
    pub executable_sha256: String,
}

/// A compiled step and what it is.
pub struct CompiledStep {
    pub manifest: Manifest,
    pub executable: Vec<u8>,
    /// The file it was read from, for what a refusal names.
    pub path: Option<std::path::PathBuf>,
}

impl CompiledStep {
    /// `executable` with its manifest (the executable's sha256 filled).
    pub fn new(mut manifest: Manifest, executable: Vec<u8>) -> CompiledStep {
        manifest.executable_sha256 = hex(&Sha256::digest(&executable));
        CompiledStep {
            manifest,
            executable,
            path: None,
        }
    }

    /// Compiles `step` (laid out over `backend`'s mesh) for `target`'s
    /// devices by their own XLA compiler with its XLA flags, or, without
    /// a target, by `backend`'s plugin as `train` compiles it; `settings`
    /// are what shaped the step
    /// ([`crate::train::checkpoint::step_settings`]).
    pub fn compile(
        step: &ShardedStep,
        backend: &Backend,
        (target, xla_options): (Option<&'static Device>, &[(String, XlaOption)]),
        settings: BTreeMap<String, Value>,
    ) -> Result<CompiledStep> {
        let devices = backend.mesh().size();
        let t0 = std::time::Instant::now();
        let (executable, compiler, plugin, device) = match target {
            Some(device) => {
                let compiler = TargetCompiler::open(device, devices as usize)?;
                let options = CompileOptions {
                    env_option_overrides: xla_options.to_vec(),
                    ..Default::default()
                };
                let compiled = compiler.compile(step, &options)?;
                let plugin =
                    PluginIdentity::of(compiler.plugin().path(), &compiler.platform_name()?)?;
                let bytes = compiled.executable.serialize()?;
                (bytes, compiler.describe(), plugin, device.name.to_string())
            }
            None => {
                let program = step.compile(backend, Mode::Jit)?;
                let plugin = PluginIdentity::of_client(backend.client())?;
                let bytes = program.serialize()?.ok_or_else(|| {
                    EngineError::Executable("a JIT program has no executable".into())
                })?;
                let compiler = format!("the {} plugin", plugin.platform);
                (bytes, compiler, plugin, device_name(backend)?)
            }
        };
        let manifest = Manifest {
            program_fingerprint: fingerprint_hex(&step.stablehlo()),
            settings,
            device,
            devices,
            plugin,
            compiler,
            compile_s: t0.elapsed().as_secs_f64(),
            executable_sha256: String::new(),
        };
        Ok(CompiledStep::new(manifest, executable))
    }

    /// Writes the file (under a temporary name, then renamed).
    pub fn write(&self, path: &Path) -> Result<()> {
        let manifest = serde_json::to_string(&self.manifest)
            .map_err(|e| EngineError::Executable(format!("cannot record the manifest: {e}")))?;
        let mut bytes = format!("{FORMAT_LINE}\n{manifest}\n").into_bytes();
        bytes.extend_from_slice(&self.executable);
        hlo_models::io::write_atomic(path, &bytes)?;
        Ok(())
    }

    /// Reads a file [`CompiledStep::write`] wrote, checking its format and
    /// the executable's sha256.
    pub fn read(path: &Path) -> Result<CompiledStep> {
        let bytes = std::fs::read(path).map_err(EngineError::io("read", path))?;
        let bad = |why: &str| {
            EngineError::Executable(format!(
                "{} is not an executable `hlo-train compile` wrote: {why}",
                path.display()
            ))
        };
        let mut lines = bytes.splitn(3, |&b| b == b'\n');
        let (Some(format), Some(manifest), Some(executable)) =
            (lines.next(), lines.next(), lines.next())
        else {
            return Err(bad("it has no manifest"));
        };
        if format != FORMAT_LINE.as_bytes() {
            return Err(bad(&format!("its first line is not `{FORMAT_LINE}`")));
        }
        let manifest: Manifest = serde_json::from_slice(manifest)
            .map_err(|e| bad(&format!("its manifest does not read: {e}")))?;
        let mut step = CompiledStep::new(manifest.clone(), executable.to_vec());
        if step.manifest.executable_sha256 != manifest.executable_sha256 {
            return Err(bad(
                "the executable's bytes do not have the sha256 its manifest records (changed or cut short)",
            ));
        }
        step.path = Some(path.to_path_buf());
        Ok(step)
    }

    /// Refuses this step for a run of `program` with `settings` on
    /// `backend`'s devices unless it is that program, for those devices,
    /// by that plugin: the first difference, in words.
    pub fn check(
        &self,
        backend: &Backend,
        program: &str,
        settings: &BTreeMap<String, Value>,
    ) -> Result<()> {
        self.differences(backend, program, settings)
            .map_err(|e| match (e, &self.path) {
                (EngineError::Executable(why), Some(p)) => {
                    EngineError::Executable(format!("--executable {}: {why}", p.display()))
                }
                (e, _) => e,
            })
    }

    fn differences(
        &self,
        backend: &Backend,
        program: &str,
        settings: &BTreeMap<String, Value>,
    ) -> Result<()> {
        let m = &self.manifest;
        let plugin = PluginIdentity::of_client(backend.client())?;
        if plugin != m.plugin {
            return Err(EngineError::Executable(format!(
                "it was compiled by {} {} (sha256 {}), and this run's plugin is {} {} (sha256 {}): an executable loads only in the plugin build that made it",
                m.plugin.platform,
                m.plugin.file,
                short(&m.plugin.sha256),
                plugin.platform,
                plugin.file,
                short(&plugin.sha256)
            )));
        }
        let device = device_name(backend)?;
        let devices = backend.mesh().size();
        if (device.as_str(), devices) != (m.device.as_str(), m.devices) {
            return Err(EngineError::Executable(format!(
                "it was compiled for {} × {}, and this run has {devices} × {device}",
                m.devices, m.device
            )));
        }
        if fingerprint_hex(program) == m.program_fingerprint {
            return Ok(());
        }
        let differs = settings_difference(&m.settings, settings)
            .unwrap_or_else(|| "the program differs, its settings alike".into());
        Err(EngineError::Executable(format!(
            "it is another step than this run's: {differs}"
        )))
    }
}

/// The device kind of `backend`'s first device, as the hardware table
/// names it (the PJRT kind where the table lacks it).
pub(crate) fn device_name(backend: &Backend) -> Result<String> {
    let kind = match backend.devices().first() {
        Some(d) => d.kind()?,
        None => String::new(),
    };
    let cpu = backend.platform()?.eq_ignore_ascii_case("cpu");
    Ok(match crate::analysis::hardware::lookup(&kind) {
        _ if cpu => "CPU".into(),
        Some(d) => d.name.to_string(),
        None => kind,
    })
}

/// The first setting that differs: `batch: 8 compiled, 4 in this run`.
fn settings_difference(
    compiled: &BTreeMap<String, Value>,
    run: &BTreeMap<String, Value>,
) -> Option<String> {
    let keys: std::collections::BTreeSet<&String> = compiled.keys().chain(run.keys()).collect();
    keys.into_iter().find_map(|k| {
        let (a, b) = (compiled.get(k), run.get(k));
        (a != b).then(|| {
            let show = |v: Option<&Value>| v.map_or("not set".to_string(), Value::to_string);
            format!("{k}: {} compiled, {} in this run", show(a), show(b))
        })
    })
}

/// A program's fingerprint as the manifest records it.
fn fingerprint_hex(program: &str) -> String {
    format!("{:016x}", hlo_runtime::program_fingerprint(program))
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_differing_setting_is_named() {
        let a: BTreeMap<String, Value> = [
            ("batch".to_string(), Value::from(8)),
            ("seq".into(), 64.into()),
        ]
        .into();
        let mut b = a.clone();
        assert_eq!(settings_difference(&a, &b), None);
        b.insert("seq".into(), 32.into());
        assert_eq!(
            settings_difference(&a, &b).unwrap(),
            "seq: 64 compiled, 32 in this run"
        );
        b.insert("mesh".into(), "dp=1,fsdp=2,mp=1".into());
        assert!(settings_difference(&a, &b)
            .unwrap()
            .starts_with("mesh: not set compiled"));
    }
}
