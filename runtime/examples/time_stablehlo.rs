//! Times any StableHLO module on one CPU-plugin device, its arguments filled
//! with a constant (floats) or a small ramp (integers). It lets a program
//! written elsewhere (`bench/jax_lora_step.py --emit-stablehlo FILE`) be
//! compared with ours on the same plugin, so a difference is the program's
//! and not the XLA version's.
//!
//! ```sh
//! cargo run --release --example time_stablehlo -- FILE.mlir [STEPS]
//! ```

use std::time::Instant;

use anyhow::{bail, Context, Result};
use hlo_ir::DType;
use hlo_runtime::{Buffer, Client, ClientOptions, CompileOptions, HostArray, Plugin, PluginSpec};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1) else {
        bail!("usage: time_stablehlo FILE.mlir [STEPS]");
    };
    let steps: usize = match args.get(2) {
        Some(s) => s.parse().context("STEPS must be a positive integer")?,
        None => 8,
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
    let plugin = Plugin::load("cpu".parse::<PluginSpec>()?.resolve()?)?;
    let client = Client::new(&plugin, &ClientOptions::cpu(1))?;
    let device = client.addressable_devices()?[0].clone();

    // The arguments of `main`, from its signature.
    let params = hlo_runtime::main_parameters(&text).context("no @main function")?;
    let mut host = Vec::new();
    for (k, p) in params.into_iter().enumerate() {
        let p = p.with_context(|| format!("argument {k} is not a static tensor"))?;
        let n = p.dims.iter().product::<i64>() as usize;
        let values: Vec<f64> = match p.dtype {
            DType::I32 | DType::I64 => (0..n).map(|i| (i % 97) as f64).collect(),
            _ => vec![0.01; n],
        };
        let ty = hlo_ir::TensorType::new(p.dtype, p.dims.clone());
        host.push(HostArray::from(hlo_ir::Literal::from_f64s(ty, &values)));
    }
    let t0 = Instant::now();
    let exe = client.compile(&text, &CompileOptions::spmd(1))?;
    let compile_s = t0.elapsed().as_secs_f64();
    let mut times = Vec::new();
    for i in 0..steps + 2 {
        // Fresh arguments each run: a module may donate them.
        let buffers: Vec<Buffer> = host
            .iter()
            .map(|h| client.buffer_from_host(h, &device))
            .collect::<Result<_, _>>()?;
        for b in &buffers {
            b.block_until_ready()?;
        }
        let t = Instant::now();
        let out = exe.execute(&[buffers.iter().collect()])?;
        for b in &out[0] {
            b.block_until_ready()?;
        }
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{path}: {} arguments, compile {compile_s:.2} s, median {:.2} ms over {steps} runs",
        host.len(),
        times[times.len() / 2] * 1e3
    );
    Ok(())
}
