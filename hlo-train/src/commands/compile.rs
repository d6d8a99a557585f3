//! `hlo-train compile`: the train step `train` runs with the same flags,
//! compiled once for `--target`'s devices and written to `--out FILE`
//! with its manifest, for `train --executable FILE` on those devices. A
//! GPU target is compiled by its own XLA compiler, deviceless (`make
//! setup-targets`); `cpu` by the run's plugin, as `train` compiles.

use anyhow::{bail, Result};
use clap::Args;
use hlo_engine::run::Run;

use crate::commands::plan::Target;
use crate::commands::train::TrainArgs;

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
    let mut spec = crate::commands::train::spec(&args.train, given);
    let Some(file) = spec.output.out.take() else {
        bail!("compile needs --out FILE: where to write the compiled step");
    };
    if spec.output.resume.is_some() {
        bail!("compile compiles a step for a new run; --resume takes a run's own settings, which compile does not read");
    }
    // A GPU is compiled for by its own compiler; the CPU by the plugin.
    let device = args.target.device();
    spec.compile_for = device.gpu_target_config().map(|_| device);
    let (compiled, choices) = Run::compile(spec)?;
    compiled.write(&file)?;
    let m = &compiled.manifest;
    println!("{choices}");
    println!(
        "compiled by {} in {:.1}s for {} × {} (mesh {}): {} ({} bytes), program {}",
        m.compiler,
        m.compile_s,
        m.devices,
        m.device,
        m.settings
            .get("mesh")
            .and_then(|v| v.as_str())
            .unwrap_or("?"),
        file.display(),
        compiled.executable.len(),
        m.program_fingerprint
    );
    Ok(())
}
