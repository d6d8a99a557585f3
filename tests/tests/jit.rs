//! `Jit`: traced and compiled once per input signature, cached by program
//! fingerprint, run on host arrays.

use hlo_e2e::new_client;
use hlo_ir::{DType, Outputs, TensorType};
use hlo_runtime::{CompiledFunction, HostArray, Jit};

#[test]
fn compiles_once_per_signature() {
    let c = &new_client(1);
    let jit = Jit::new(c, "scaled_sum", &["x", "y"], |i| {
        Outputs::new().add("out", (i["x"] * 3.0 + i["y"]).sum(&[0]))
    });
    let (compiled0, _) = c.compile_cache_stats();
    let a = HostArray::new(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
    let b = HostArray::new(&[3], &[0.5f32, 0.25, 0.125]).unwrap();
    let out = jit.call(&[a.clone(), b.clone()]).unwrap();
    assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![18.875]);
    // Same signature: no new program.
    jit.call(&[b.clone(), a.clone()]).unwrap();
    let (compiled1, _) = c.compile_cache_stats();
    assert_eq!(compiled1, compiled0 + 1);
    // A new signature traces and compiles again.
    let m = HostArray::new(&[2, 2], &[1.0f64, 2.0, 3.0, 4.0]).unwrap();
    let out = jit.call(&[m.clone(), m]).unwrap();
    assert_eq!(out[0].to_vec::<f64>().unwrap(), vec![16.0, 24.0]);
    let (compiled2, _) = c.compile_cache_stats();
    assert_eq!(compiled2, compiled0 + 2);
    // Wrong arity is an error, not a panic.
    assert!(jit.call(&[a]).is_err());
}

#[test]
fn the_same_program_text_hits_the_client_cache() {
    let c = &new_client(1);
    let t = TensorType::new(DType::F32, [5]);
    let f = hlo_ir::trace("cache_probe_7f3a", &[("x", t)], |i| i["x"].exp() - 1.0).unwrap();
    let (_, hits0) = c.compile_cache_stats();
    let first = CompiledFunction::new(c, &f).unwrap();
    let second = CompiledFunction::new(c, &f).unwrap();
    let (_, hits1) = c.compile_cache_stats();
    assert_eq!(hits1, hits0 + 1);
    assert!(std::ptr::eq(first.executable(), second.executable()));
    let err = first
        .run(&[HostArray::new(&[4], &[0.0f32; 4]).unwrap()])
        .map(|_| ())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid argument: input `x` of cache_probe_7f3a is f32[5], got f32[4]"
    );
}
