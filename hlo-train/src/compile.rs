//! `hlo-train compile`: the train step `train` runs with the same flags,
//! compiled once for `--target`'s devices and written to `--out FILE`
//! with its manifest, for `train --executable FILE` on those devices. A
//! GPU target is compiled by its own XLA compiler, deviceless (`make
//! setup-targets`); `cpu` by the run's plugin, as `train` compiles.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_engine::device::compiled::{device_name, CompiledStep, Manifest, PluginIdentity};
use hlo_engine::device::target::TargetCompiler;
use hlo_engine::runtime::{program_fingerprint, CompileOptions, Mode};
use hlo_engine::Run;

use crate::plan::Target;
use crate::train::TrainArgs;

#[derive(Args, Debug)]
pub struct CompileArgs {
    /// The devices to compile for: a GPU of the hardware table (its own
    /// XLA compiler, no GPU needed), or `cpu` (the run's --plugin, as
    /// `train` would compile). The mesh is --mesh or --devices, as train's.
    #[arg(long, value_enum, default_value = "cpu")]
    pub target: Target,

    #[command(flatten)]
    pub train: TrainArgs,
}

pub fn run(args: &CompileArgs, given: &std::collections::BTreeSet<String>) -> Result<()> {
    let mut spec = crate::train::spec(&args.train, given);
    let Some(file) = spec.output.out.take() else {
        bail!("compile needs --out FILE: where to write the compiled step");
    };
    if spec.output.resume.is_some() {
        bail!("compile compiles a step for a new run; --resume takes a run's own settings, which compile does not read");
    }
    let device = args.target.device();
    let gpu = device.gpu_target_config().is_some();
    if gpu {
        spec.compile_for = Some(device);
    }
    let xla_options = spec.backend.xla_options.clone();
    let s = Run::step_to_compile(spec)?;
    let mesh = s.backend.mesh().clone();
    let program = s.step.stablehlo();
    let t0 = Instant::now();
    let (bytes, compiler, plugin, device) = if gpu {
        let compiler = TargetCompiler::open(device, mesh.size() as usize)?;
        let options = CompileOptions {
            env_option_overrides: xla_options,
            ..Default::default()
        };
        let compiled = compiler.compile(&s.step, &options)?;
        let platform = device.compiler_platform().unwrap_or("cuda");
        let plugin = PluginIdentity::of(compiler.plugin().path(), platform)?;
        (
            compiled.executable.serialize()?,
            compiler.describe(),
            plugin,
            device.name.to_string(),
        )
    } else {
        let program = s.step.compile(&s.backend, Mode::Jit)?;
        let client = s.backend.client();
        let platform = client.platform_name()?;
        let plugin = PluginIdentity::of(client.plugin().path(), &platform)?;
        let bytes = program
            .serialize()?
            .context("a JIT program has an executable")?;
        let name = device_name(&s.backend)?;
        (bytes, format!("the {platform} plugin"), plugin, name)
    };
    let compile_s = t0.elapsed().as_secs_f64();
    let manifest = Manifest {
        program_fingerprint: format!("{:016x}", program_fingerprint(&program)),
        settings: s.settings.clone(),
        device,
        devices: mesh.size(),
        plugin,
        compiler,
        compile_s,
        executable_sha256: String::new(),
    };
    let compiled = CompiledStep::new(manifest, bytes);
    compiled.write(&file)?;
    let m = &compiled.manifest;
    println!("{}", s.choices);
    println!(
        "compiled by {} in {compile_s:.1}s for {} × {} (mesh {mesh}): {} ({} bytes), program {}",
        m.compiler,
        m.devices,
        m.device,
        file.display(),
        compiled.executable.len(),
        m.program_fingerprint
    );
    Ok(())
}
