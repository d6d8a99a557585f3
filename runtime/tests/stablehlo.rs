//! Hand-written StableHLO programs on the real CPU plugin, checked against
//! host computations in f64. These need the plugin: `make setup` installs it
//! and the tests fail (not skip) without it.

mod common;

use std::sync::OnceLock;

use half::{bf16, f16};
use hlo_runtime::{Buffer, Client, CompileOptions, Error, HostArray, Plugin};

/// One client with 8 virtual devices for the whole test binary.
fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| common::cpu_client(8))
}

/// splitmix64: small, seeded, good enough for test inputs.
struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
    fn vec_f32(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform() as f32).collect()
    }
}

fn run1(mlir: &str, inputs: &[HostArray]) -> Vec<HostArray> {
    let c = client();
    let exe = c
        .compile(mlir, &CompileOptions::default())
        .expect("compile");
    let device = &exe.devices()[0];
    let bufs: Vec<Buffer> = inputs
        .iter()
        .map(|h| c.buffer_from_host(h, device).expect("transfer"))
        .collect();
    let out = exe.execute(&[bufs.iter().collect()]).expect("execute");
    assert_eq!(out.len(), 1);
    out[0]
        .iter()
        .map(|b| b.to_host().expect("to host"))
        .collect()
}

fn assert_close(got: &[f64], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "element {i}: got {g}, want {w} (rtol {rtol}, atol {atol})"
        );
    }
}

#[test]
fn elementwise_add_is_exact() {
    let mut rng = Rng(1);
    for dims in [vec![3i64, 4], vec![7], vec![2, 3, 5]] {
        let n: i64 = dims.iter().product();
        let t = format!(
            "tensor<{}xf32>",
            dims.iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join("x")
        );
        let mlir = format!(
            "func.func public @main(%a: {t}, %b: {t}) -> {t} {{\n  \
             %0 = \"stablehlo.add\"(%a, %b) : ({t}, {t}) -> {t}\n  \
             func.return %0 : {t}\n}}"
        );
        let a = rng.vec_f32(n as usize);
        let b = rng.vec_f32(n as usize);
        let out = run1(
            &mlir,
            &[
                HostArray::new(&dims, &a).unwrap(),
                HostArray::new(&dims, &b).unwrap(),
            ],
        );
        assert_eq!(out[0].dims(), dims.as_slice());
        // f32 addition of f32 inputs is correctly rounded: compare exactly.
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), want);
    }
}

#[test]
fn batched_dot_general_matches_f64_reference() {
    // [b, m, k] x [b, n, k] -> [b, m, n]: batch dim 0, contracting lhs 2 / rhs 2.
    let (b, m, k, n) = (3usize, 5usize, 7usize, 4usize);
    let mlir = format!(
        "func.func public @main(%x: tensor<{b}x{m}x{k}xf32>, %y: tensor<{b}x{n}x{k}xf32>) -> tensor<{b}x{m}x{n}xf32> {{\n  \
         %0 = \"stablehlo.dot_general\"(%x, %y) {{dot_dimension_numbers = #stablehlo.dot<\
         lhs_batching_dimensions = [0], rhs_batching_dimensions = [0], \
         lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [2]>}} \
         : (tensor<{b}x{m}x{k}xf32>, tensor<{b}x{n}x{k}xf32>) -> tensor<{b}x{m}x{n}xf32>\n  \
         func.return %0 : tensor<{b}x{m}x{n}xf32>\n}}"
    );
    let mut rng = Rng(2);
    let x = rng.vec_f32(b * m * k);
    let y = rng.vec_f32(b * n * k);
    let out = run1(
        &mlir,
        &[
            HostArray::new(&[b as i64, m as i64, k as i64], &x).unwrap(),
            HostArray::new(&[b as i64, n as i64, k as i64], &y).unwrap(),
        ],
    );
    let mut want = vec![0f64; b * m * n];
    for bi in 0..b {
        for i in 0..m {
            for j in 0..n {
                want[(bi * m + i) * n + j] = (0..k)
                    .map(|l| x[(bi * m + i) * k + l] as f64 * y[(bi * n + j) * k + l] as f64)
                    .sum();
            }
        }
    }
    assert_eq!(out[0].dims(), &[b as i64, m as i64, n as i64]);
    // f32 accumulation over k=7 terms of magnitude <= 1.
    assert_close(&out[0].to_f64_vec(), &want, 1e-5, 1e-5);
}

#[test]
fn reduce_sum_and_max_match_reference() {
    let (r, c) = (6usize, 9usize);
    let mlir = format!(
        r#"func.func public @main(%a: tensor<{r}x{c}xf32>) -> (tensor<{r}xf32>, tensor<{c}xf32>) {{
  %zero = "stablehlo.constant"() {{value = dense<0.0> : tensor<f32>}} : () -> tensor<f32>
  %ninf = "stablehlo.constant"() {{value = dense<0xFF800000> : tensor<f32>}} : () -> tensor<f32>
  %sum = "stablehlo.reduce"(%a, %zero) ({{
    ^bb0(%x: tensor<f32>, %y: tensor<f32>):
      %s = "stablehlo.add"(%x, %y) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%s) : (tensor<f32>) -> ()
  }}) {{dimensions = array<i64: 1>}} : (tensor<{r}x{c}xf32>, tensor<f32>) -> tensor<{r}xf32>
  %max = "stablehlo.reduce"(%a, %ninf) ({{
    ^bb0(%x: tensor<f32>, %y: tensor<f32>):
      %m = "stablehlo.maximum"(%x, %y) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%m) : (tensor<f32>) -> ()
  }}) {{dimensions = array<i64: 0>}} : (tensor<{r}x{c}xf32>, tensor<f32>) -> tensor<{c}xf32>
  func.return %sum, %max : tensor<{r}xf32>, tensor<{c}xf32>
}}"#
    );
    let mut rng = Rng(3);
    let a = rng.vec_f32(r * c);
    let out = run1(&mlir, &[HostArray::new(&[r as i64, c as i64], &a).unwrap()]);
    assert_eq!(out.len(), 2);
    let sums: Vec<f64> = (0..r)
        .map(|i| (0..c).map(|j| a[i * c + j] as f64).sum())
        .collect();
    let maxes: Vec<f64> = (0..c)
        .map(|j| {
            (0..r)
                .map(|i| a[i * c + j] as f64)
                .fold(f64::NEG_INFINITY, f64::max)
        })
        .collect();
    assert_close(&out[0].to_f64_vec(), &sums, 1e-6, 1e-6);
    // max is exact.
    assert_eq!(out[1].to_f64_vec(), maxes);
}

/// `a[16,32] · b[32,24]` over a 2×4 mesh: `a` sharded rows over "x" and the
/// contracting dim over "y", `b` sharded rows over "y", the result rows over
/// "x" (so the partitioner must all-reduce partial products over "y").
#[test]
fn sharded_dot_general_over_8_devices() {
    let (m, k, n) = (16usize, 32usize, 24usize);
    let (x_size, y_size) = (2usize, 4usize);
    let mlir = format!(
        r#"module @sharded_matmul attributes {{mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32}} {{
  sdy.mesh @mesh = <["x"={x_size}, "y"={y_size}]>
  func.func public @main(
      %a: tensor<{m}x{k}xf32> {{sdy.sharding = #sdy.sharding<@mesh, [{{"x"}}, {{"y"}}]>}},
      %b: tensor<{k}x{n}xf32> {{sdy.sharding = #sdy.sharding<@mesh, [{{"y"}}, {{}}]>}})
      -> (tensor<{m}x{n}xf32> {{sdy.sharding = #sdy.sharding<@mesh, [{{"x"}}, {{}}]>}}) {{
    %0 = "stablehlo.dot_general"(%a, %b) {{dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>}} : (tensor<{m}x{k}xf32>, tensor<{k}x{n}xf32>) -> tensor<{m}x{n}xf32>
    func.return %0 : tensor<{m}x{n}xf32>
  }}
}}"#
    );
    let c = client();
    let exe = c.compile(&mlir, &CompileOptions::spmd(8)).expect("compile");
    assert_eq!(exe.devices().len(), 8);

    let mut rng = Rng(4);
    let a = rng.vec_f32(m * k);
    let b = rng.vec_f32(k * n);
    // Device d sits at mesh coordinate (d / 4, d % 4): the default device
    // order of a mesh is row-major over its axes.
    let (ms, ks) = (m / x_size, k / y_size);
    let mut shards: Vec<Vec<Buffer>> = Vec::new();
    for (d, device) in exe.devices().iter().enumerate() {
        let (xi, yi) = (d / y_size, d % y_size);
        let a_shard: Vec<f32> = (0..ms)
            .flat_map(|i| (0..ks).map(move |j| (xi * ms + i, yi * ks + j)))
            .map(|(i, j)| a[i * k + j])
            .collect();
        let b_shard: Vec<f32> = b[yi * ks * n..(yi + 1) * ks * n].to_vec();
        shards.push(vec![
            c.buffer_from_host(
                &HostArray::new(&[ms as i64, ks as i64], &a_shard).unwrap(),
                device,
            )
            .unwrap(),
            c.buffer_from_host(
                &HostArray::new(&[ks as i64, n as i64], &b_shard).unwrap(),
                device,
            )
            .unwrap(),
        ]);
    }
    let args: Vec<Vec<&Buffer>> = shards.iter().map(|s| s.iter().collect()).collect();
    let out = exe.execute(&args).expect("execute");
    assert_eq!(out.len(), 8);

    let want: Vec<f64> = (0..m)
        .flat_map(|i| (0..n).map(move |j| (i, j)))
        .map(|(i, j)| {
            (0..k)
                .map(|l| a[i * k + l] as f64 * b[l * n + j] as f64)
                .sum()
        })
        .collect();
    for (d, outputs) in out.iter().enumerate() {
        let xi = d / y_size;
        let shard = outputs[0].to_host().unwrap();
        assert_eq!(shard.dims(), &[ms as i64, n as i64], "device {d}");
        let want_rows = &want[xi * ms * n..(xi + 1) * ms * n];
        assert_close(&shard.to_f64_vec(), want_rows, 1e-5, 1e-5);
    }
}

#[test]
fn every_dtype_round_trips_through_a_device() {
    let c = client();
    let device = &c.addressable_devices().unwrap()[0];
    let arrays = vec![
        HostArray::new(&[3], &[true, false, true]).unwrap(),
        HostArray::new(&[2, 2], &[-128i8, -1, 0, 127]).unwrap(),
        HostArray::new(&[2], &[i32::MIN, i32::MAX]).unwrap(),
        HostArray::new(&[2], &[i64::MIN, 1 << 40]).unwrap(),
        HostArray::new(&[2], &[0u8, 255]).unwrap(),
        HostArray::new(&[2], &[0u32, u32::MAX]).unwrap(),
        HostArray::new(&[2], &[f16::from_f32(1.5), f16::MAX]).unwrap(),
        HostArray::new(&[2], &[bf16::from_f32(-2.25), bf16::MIN_POSITIVE]).unwrap(),
        HostArray::new(&[1, 2], &[1.0e-30f32, -3.5]).unwrap(),
        HostArray::new(&[2], &[std::f64::consts::PI, -1e300]).unwrap(),
        HostArray::scalar(7.0f32),
    ];
    for host in arrays {
        let buffer = c.buffer_from_host(&host, device).unwrap();
        assert_eq!(buffer.dtype().unwrap(), host.dtype());
        assert_eq!(buffer.dims().unwrap(), host.dims());
        assert_eq!(buffer.device().unwrap(), *device);
        assert_eq!(buffer.to_host().unwrap(), host, "{:?}", host.dtype());
    }
}

#[test]
fn donated_argument_is_consumed_and_memory_stats_are_reported() {
    let mlir = r#"func.func public @main(%state: tensor<4xf32> {tf.aliasing_output = 0 : i32}, %delta: tensor<4xf32>) -> tensor<4xf32> {
  %0 = "stablehlo.add"(%state, %delta) : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>
  func.return %0 : tensor<4xf32>
}"#;
    let c = client();
    let exe = c.compile(mlir, &CompileOptions::default()).unwrap();
    let stats = exe.compiled_memory_stats().unwrap();
    assert_eq!(stats.argument_size_in_bytes, 32);
    assert_eq!(stats.output_size_in_bytes, 16);
    assert_eq!(stats.alias_size_in_bytes, 16);
    let device = &exe.devices()[0];
    let state = c
        .buffer_from_host(
            &HostArray::new(&[4], &[1.0f32, 2.0, 3.0, 4.0]).unwrap(),
            device,
        )
        .unwrap();
    let delta = c
        .buffer_from_host(&HostArray::new(&[4], &[0.5f32; 4]).unwrap(), device)
        .unwrap();
    let out = exe.execute(&[vec![&state, &delta]]).unwrap();
    assert_eq!(
        out[0][0].to_host().unwrap().to_vec::<f32>().unwrap(),
        vec![1.5, 2.5, 3.5, 4.5]
    );
    assert!(
        state.is_deleted().unwrap(),
        "donated buffer must be consumed"
    );
    assert!(!delta.is_deleted().unwrap());
    // Using the donated buffer again is the plugin's error, carried through.
    let err = exe.execute(&[vec![&state, &delta]]);
    let err = match err {
        Ok(out) => out[0][0].to_host().map(|_| ()).unwrap_err(),
        Err(e) => e,
    };
    assert!(
        err.to_string().contains("deleted") || err.to_string().contains("donated"),
        "{err}"
    );
}

#[test]
fn unparsable_mlir_shows_the_compiler_diagnostic() {
    let err = client()
        .compile("func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n  %0 = \"stablehlo.frobnicate\"(%a) : (tensor<2xf32>) -> tensor<2xf32>\n  func.return %0 : tensor<2xf32>\n}", &CompileOptions::default())
        .map(|_| ())
        .unwrap_err();
    match &err {
        Error::Pjrt {
            function, message, ..
        } => {
            assert_eq!(function, "PJRT_Client_Compile");
            assert!(message.contains("stablehlo.frobnicate"), "{message}");
            assert!(
                message.contains("2:8"),
                "diagnostic has a position: {message}"
            );
        }
        other => panic!("expected a plugin error, got {other:?}"),
    }
}

#[test]
fn bad_arguments_are_refused_before_the_plugin_sees_them() {
    let mlir = r#"func.func public @main(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>) -> tensor<2x3xf32> {
  %0 = "stablehlo.multiply"(%a, %b) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
  func.return %0 : tensor<2x3xf32>
}"#;
    let c = client();
    let exe = c.compile(mlir, &CompileOptions::default()).unwrap();
    let devices = c.addressable_devices().unwrap();
    let put = |h: HostArray, d: usize| c.buffer_from_host(&h, &devices[d]).unwrap();
    let good = put(HostArray::new(&[2, 3], &[1.0f32; 6]).unwrap(), 0);
    let transposed = put(HostArray::new(&[3, 2], &[1.0f32; 6]).unwrap(), 0);
    let ints = put(HostArray::new(&[2, 3], &[1i32; 6]).unwrap(), 0);
    let elsewhere = put(HostArray::new(&[2, 3], &[1.0f32; 6]).unwrap(), 1);
    let msg = |args: &[Vec<&Buffer>]| exe.execute(args).map(|_| ()).unwrap_err().to_string();
    assert_eq!(
        msg(&[vec![&good]]),
        "invalid argument: the program takes 2 arguments but 1 were given"
    );
    assert_eq!(
        msg(&[vec![&good, &transposed]]),
        "invalid argument: argument 1 for device 0 is f32[3, 2] but the program expects f32[2, 3]"
    );
    assert_eq!(
        msg(&[vec![&ints, &good]]),
        "invalid argument: argument 0 for device 0 is i32[2, 3] but the program expects f32[2, 3]"
    );
    assert!(msg(&[vec![&good, &elsewhere]]).contains("lives on Device(1), not on Device(0)"));
    assert_eq!(
        msg(&[vec![&good, &good], vec![&good, &good]]),
        "invalid argument: the program runs on 1 devices but 2 argument lists were given"
    );
    // And a good call still works after all that.
    let out = exe.execute(&[vec![&good, &good]]).unwrap();
    assert_eq!(
        out[0][0].to_host().unwrap().to_vec::<f32>().unwrap(),
        vec![1.0; 6]
    );
}

#[test]
fn compile_options_the_plugin_would_abort_on_are_refused() {
    let c = client();
    let mlir = "func.func public @main() -> () {\n  func.return\n}";
    let bad = CompileOptions {
        num_replicas: 0,
        ..Default::default()
    };
    assert!(matches!(
        c.compile(mlir, &bad),
        Err(Error::InvalidArgument(_))
    ));
    let too_many = CompileOptions::spmd(64);
    let err = c.compile(mlir, &too_many).map(|_| ()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid argument: the program is partitioned over 64 devices but the client has 8"
    );
}

#[test]
fn files_that_are_not_plugins_are_refused() {
    let dir = std::env::temp_dir().join(format!("hlo-runtime-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("not_a_plugin.so");
    std::fs::write(&text, "this is not an ELF file").unwrap();
    let err = Plugin::load(&text).unwrap_err();
    assert!(matches!(err, Error::NotAPlugin { .. }), "{err:?}");
    assert!(err.to_string().starts_with("cannot load "), "{err}");

    // A real shared library that is not a PJRT plugin.
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists());
    if let Some(libm) = libm {
        let err = Plugin::load(libm).unwrap_err();
        assert!(
            err.to_string().ends_with("it has no GetPjrtApi symbol"),
            "{err}"
        );
    }
    let err = Plugin::load(dir.join("missing.so")).unwrap_err();
    assert!(matches!(err, Error::PluginNotFound { .. }));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plugin_reports_version_and_attributes() {
    let plugin = client().plugin();
    assert!(plugin.api_version() >= hlo_runtime::MIN_API_VERSION);
    assert!(plugin.attribute("stablehlo_current_version").is_some());
    assert_eq!(client().platform_name().unwrap(), "cpu");
    let devices = client().devices().unwrap();
    assert_eq!(devices.len(), 8);
    for (i, d) in devices.iter().enumerate() {
        assert_eq!(d.id().unwrap(), i as i32);
        assert_eq!(d.kind().unwrap(), "cpu");
        assert_eq!(d.process_index().unwrap(), 0);
        assert!(d.is_addressable().unwrap());
    }
}
