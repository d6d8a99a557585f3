//! The devices' peak rate, for MFU: the data sheet's figure from the
//! [`crate::analysis::hardware`] table, or for CPUs (and kinds the table lacks) a
//! measurement (a chain of large f32 matmuls).

use std::time::Instant;

use hlo_ir::{DType, TensorType};
use hlo_partitioner::{FunctionShardings, Mesh};
use hlo_runtime::{Client, HostArray, Mode, Program};

use crate::analysis::hardware;
use crate::device::backend::Backend;
use crate::error::{EngineError, Result};

/// Measures one device's f32 matmul TFLOP/s: the best of four runs of a
/// chain of 1024³ products, large enough to reach the kernels' steady
/// rate (the best, so a busy moment does not inflate every MFU).
pub fn measure_tflops(client: &Client) -> Result<f64> {
    let (n, chain) = (1024i64, 4);
    let t = TensorType::new(DType::F32, [n, n]);
    let f = hlo_ir::trace("peak", &[("a", t.clone()), ("b", t)], |i| {
        let mut x = i["a"];
        for _ in 0..chain {
            x = x.matmul(i["b"]);
        }
        vec![("x", x)]
    })?;
    let mesh = Mesh::single();
    let devices = client.addressable_devices()?;
    let program = Program::compile(
        client,
        &f,
        FunctionShardings::replicated(&f, &mesh),
        &[],
        Mode::Jit,
        &devices[..1],
    )?;
    let host = HostArray::new(&[n, n], &vec![1e-3f32; (n * n) as usize])?;
    let a =
        hlo_runtime::DeviceArray::shard(client, &host, &program.input_sharding(0), &devices[..1])?;
    let run = || -> Result<f64> {
        let t0 = Instant::now();
        let out = program.run(&[&a, &a])?;
        for b in out[0].buffers() {
            b.block_until_ready()?;
        }
        Ok(t0.elapsed().as_secs_f64())
    };
    run()?;
    let mut best = f64::INFINITY;
    for _ in 0..4 {
        best = best.min(run()?);
    }
    Ok(chain as f64 * 2.0 * (n * n * n) as f64 / best / 1e12)
}

/// The mesh's peak FLOP/s for `dtype`: `per_device_tflops` if given, else
/// the data sheet's figure for the first device's kind
/// ([`hardware::lookup`]), else a measurement; times the mesh's size.
pub fn peak_flops(backend: &Backend, dtype: DType, per_device_tflops: Option<f64>) -> Result<f64> {
    let tflops = match per_device_tflops {
        Some(p) if p.is_finite() && p > 0.0 => p,
        Some(p) => return Err(EngineError::PeakTflops(p)),
        None => match hardware::lookup(&backend.devices()[0].kind()?)
            .and_then(|d| d.peak_tflops(dtype))
        {
            Some(p) => p,
            None => measure_tflops(backend.client())?,
        },
    };
    Ok(tflops * 1e12 * backend.mesh().size() as f64)
}
