//! The devices' peak rate, for MFU: a datasheet table by device kind, or
//! for CPUs a measurement (a chain of large f32 matmuls).

use std::time::Instant;

use hlo_ir::{DType, TensorType};
use hlo_partitioner::{FunctionShardings, Mesh};
use hlo_runtime::{Client, HostArray, Mode, Program};

use crate::backend::Backend;
use crate::error::{EngineError, Result};

/// Dense peak TFLOP/s of one device by kind (bf16 datasheet figures; half
/// for f32), None when the kind is not in the table.
///
/// ```
/// use hlo_engine::flops::datasheet_tflops;
/// assert_eq!(datasheet_tflops("NVIDIA H100 80GB HBM3", hlo_ir::DType::BF16), Some(989.0));
/// assert_eq!(datasheet_tflops("cpu", hlo_ir::DType::F32), None);
/// ```
pub fn datasheet_tflops(kind: &str, dtype: DType) -> Option<f64> {
    let bf16 = [
        ("H100", 989.0),
        ("H200", 989.0),
        ("MI300X", 1307.4),
        ("MI250", 362.1),
        ("A100", 312.0),
        // Dense BF16 with FP32 accumulation (NVIDIA Ada Lovelace white paper).
        ("RTX 4090", 165.2),
    ];
    let k = kind.to_uppercase();
    let v = bf16
        .iter()
        .find(|(name, _)| k.contains(name))
        .map(|(_, v)| *v)?;
    Some(if dtype == DType::F32 { v / 2.0 } else { v })
}

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
/// the datasheet figure of the first device's kind, else a measurement;
/// times the mesh's size.
pub fn peak_flops(backend: &Backend, dtype: DType, per_device_tflops: Option<f64>) -> Result<f64> {
    let tflops = match per_device_tflops {
        Some(p) if p.is_finite() && p > 0.0 => p,
        Some(p) => return Err(EngineError::PeakTflops(p)),
        None => match datasheet_tflops(&backend.devices()[0].kind()?, dtype) {
            Some(p) => p,
            None => measure_tflops(backend.client())?,
        },
    };
    Ok(tflops * 1e12 * backend.mesh().size() as f64)
}
