//! Compile and run a matmul-heavy program on a plugin, to choose the CPU
//! plugin by measurement (README, "CPU plugin").
//!
//! `cargo run --release -p hlo-runtime --example plugin_bench -- PLUGIN [N] [LAYERS] [f32|bf16]`
//!
//! PLUGIN is `cpu`, `cuda`, `rocm` or a path. The program is LAYERS steps of
//! `x = tanh(x · w_i)` on N×N matrices, the shape of an MLP forward pass.

use std::time::Instant;

use half::bf16;
use hlo_runtime::{
    Client, ClientOptions, CompileOptions, HostArray, Plugin, PluginKind, PluginSpec,
};

fn program(n: usize, layers: usize, dtype: &str) -> String {
    let t = format!("tensor<{n}x{n}x{dtype}>");
    let mut args = vec![format!("%x: {t}")];
    let mut body = String::new();
    let mut prev = "%x".to_string();
    for i in 0..layers {
        args.push(format!("%w{i}: {t}"));
        body += &format!(
            "  %d{i} = \"stablehlo.dot_general\"({prev}, %w{i}) {{dot_dimension_numbers = \
             #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>}} \
             : ({t}, {t}) -> {t}\n  %h{i} = \"stablehlo.tanh\"(%d{i}) : ({t}) -> {t}\n"
        );
        prev = format!("%h{i}");
    }
    format!(
        "func.func public @main({}) -> {t} {{\n{body}  func.return {prev} : {t}\n}}\n",
        args.join(", ")
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut argv = std::env::args().skip(1);
    let spec: PluginSpec = argv.next().unwrap_or_else(|| "cpu".into()).parse()?;
    let n: usize = argv.next().map_or(Ok(1024), |s| s.parse())?;
    let layers: usize = argv.next().map_or(Ok(16), |s| s.parse())?;
    let dtype = argv.next().unwrap_or_else(|| "f32".into());
    if dtype != "f32" && dtype != "bf16" {
        return Err(format!("dtype must be f32 or bf16, not {dtype}").into());
    }
    let t0 = Instant::now();
    let plugin = Plugin::load(spec.resolve()?)?;
    let options = match spec.kind() {
        PluginKind::Cpu => ClientOptions::cpu(1),
        _ => ClientOptions::default(),
    };
    let client = Client::new(&plugin, &options)?;
    let load_s = t0.elapsed().as_secs_f64();
    let text = program(n, layers, &dtype);
    let t0 = Instant::now();
    let exe = client.compile(&text, &CompileOptions::default())?;
    let compile_s = t0.elapsed().as_secs_f64();
    let device = &exe.devices()[0];
    let scale = 1.0 / (n as f32).sqrt();
    let values: Vec<f32> = (0..n * n)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * scale)
        .collect();
    let dims = [n as i64, n as i64];
    let host = if dtype == "bf16" {
        let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
        HostArray::new(&dims, &v)?
    } else {
        HostArray::new(&dims, &values)?
    };
    let bufs: Vec<_> = (0..=layers)
        .map(|_| client.buffer_from_host(&host, device))
        .collect::<Result<_, _>>()?;
    let args: Vec<_> = bufs.iter().collect();
    let mut times = Vec::new();
    for _ in 0..11 {
        let t0 = Instant::now();
        let out = exe.execute(std::slice::from_ref(&args))?;
        out[0][0].block_until_ready()?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.remove(0); // warm-up
    times.sort_by(|a, b| a.total_cmp(b));
    let median = times[times.len() / 2];
    let flops = 2.0 * (n as f64).powi(3) * layers as f64;
    println!(
        "plugin {} api {:?} {dtype} n={n} layers={layers}: load {:.2}s compile {:.3}s run {:.4}s (median of {}) = {:.1} GFLOP/s",
        plugin.path().display(),
        plugin.api_version(),
        load_s,
        compile_s,
        median,
        times.len(),
        flops / median / 1e9
    );
    Ok(())
}
