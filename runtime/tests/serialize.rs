//! A compiled program serialized by the CPU plugin and loaded back runs
//! bit for bit as the program it came from, on every device of a
//! partitioned program; bytes that are no executable are refused.

mod common;

use hlo_runtime::{Buffer, Client, CompileOptions, HostArray, LoadedExecutable};

/// `exp(x) · y + x` over 4×8 f32, partitioned in two along rows.
const PROGRAM: &str = r#"func.func public @main(%x: tensor<4x8xf32> {mhlo.sharding = "{devices=[2,1]<=[2]}"}, %y: tensor<4x8xf32> {mhlo.sharding = "{devices=[2,1]<=[2]}"}) -> (tensor<4x8xf32> {mhlo.sharding = "{devices=[2,1]<=[2]}"}) {
  %e = stablehlo.exponential %x : tensor<4x8xf32>
  %m = stablehlo.multiply %e, %y : tensor<4x8xf32>
  %s = stablehlo.add %m, %x : tensor<4x8xf32>
  return %s : tensor<4x8xf32>
}"#;

fn run(client: &Client, exe: &LoadedExecutable, x: &[f32], y: &[f32]) -> Vec<Vec<u32>> {
    let per_device: Vec<Vec<Buffer>> = exe
        .devices()
        .iter()
        .enumerate()
        .map(|(d, device)| {
            let rows = |v: &[f32]| HostArray::new(&[2, 8], &v[d * 16..d * 16 + 16]).unwrap();
            vec![
                client.buffer_from_host(&rows(x), device).unwrap(),
                client.buffer_from_host(&rows(y), device).unwrap(),
            ]
        })
        .collect();
    let args: Vec<Vec<&Buffer>> = per_device.iter().map(|b| b.iter().collect()).collect();
    exe.execute(&args)
        .unwrap()
        .iter()
        .map(|outs| {
            let v = outs[0].to_host().unwrap().to_vec::<f32>().unwrap();
            v.iter().map(|f| f.to_bits()).collect()
        })
        .collect()
}

#[test]
fn a_serialized_executable_loads_and_runs_bit_for_bit() {
    let client = common::cpu_client(2);
    let options = CompileOptions::spmd(2);
    let compiled = client.compile(PROGRAM, &options).expect("compile");
    let bytes = compiled.serialize().expect("serialize");
    let loaded = client.load_serialized(&bytes, &options).expect("load");
    assert_eq!(loaded.devices().len(), 2);
    let x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) / 7.0).collect();
    let y: Vec<f32> = (0..32).map(|i| (i as f32 * 0.37).sin()).collect();
    let fresh = run(&client, &compiled, &x, &y);
    assert_eq!(run(&client, &loaded, &x, &y), fresh);
    // And both are the computation: within f32 rounding of f64.
    for (d, rows) in fresh.iter().enumerate() {
        for (i, bits) in rows.iter().enumerate() {
            let k = d * 16 + i;
            let want = (x[k] as f64).exp() * y[k] as f64 + x[k] as f64;
            let got = f32::from_bits(*bits) as f64;
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{k}: {got} vs {want}"
            );
        }
    }
    // Bytes that are no executable: an error, not a crash.
    let err = client
        .load_serialized(b"not an executable", &options)
        .err()
        .expect("refused");
    assert!(!err.to_string().is_empty());
}
