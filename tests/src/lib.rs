//! `hlo-e2e` holds the cross-crate end-to-end tests: programs traced with
//! `hlo-ir`, lowered by `hlo-lowering` and run by `hlo-runtime` on the real
//! CPU plugin, checked against independent references (the host f64
//! interpreter, finite differences, HF/PEFT/JAX fixtures as they arrive).
//! Tests that need the plugin fail loudly without it: `make test` installs
//! it. This library holds what the tests share.

use std::sync::OnceLock;

use hlo_ir::{interpret, DType, Function, Literal, TensorType};
use hlo_runtime::{Client, CompiledFunction, HostArray};

/// A CPU client with 8 virtual devices, shared by a test binary.
pub fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| new_client(8))
}

/// A client of its own (for tests that count compilations).
pub fn new_client(devices: i64) -> Client {
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    }
    Client::cpu(devices).expect("a CPU client (the plugin is installed by `make setup`)")
}

pub use hlo_ir::rng::Rng;

/// Random literals from the shared seeded generator.
pub trait RandomLiteral {
    /// A literal of `ty` with values uniform in [lo, hi) (integers: floored).
    fn literal(&mut self, ty: TensorType, lo: f64, hi: f64) -> Literal;
}

impl RandomLiteral for Rng {
    fn literal(&mut self, ty: TensorType, lo: f64, hi: f64) -> Literal {
        let n = ty.element_count();
        let v: Vec<f64> = (0..n)
            .map(|_| self.uniform(lo, hi))
            .map(|x| if ty.dtype.is_float() { x } else { x.floor() })
            .collect();
        Literal::from_f64s(ty, &v)
    }
}

/// Relative and absolute tolerance for comparing a dtype's results with the
/// f64 reference.
pub fn tolerance(d: DType) -> (f64, f64) {
    match d {
        DType::F64 => (1e-12, 1e-12),
        DType::F32 => (2e-6, 2e-6),
        // One or two units in the last place of an 8-bit (bf16) or 11-bit
        // (f16) mantissa, after f32 arithmetic inside XLA.
        DType::BF16 => (1.6e-2, 1e-2),
        DType::F16 => (2e-3, 1e-3),
        _ => (0.0, 0.0),
    }
}

/// Asserts `got` equals `want` within `dtype`'s tolerance (NaN equals NaN,
/// infinities must match).
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: (f64, f64)) {
    assert_eq!(got.len(), want.len(), "{what}: element count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan())
            || g == w
            || (g.is_finite() && w.is_finite() && (g - w).abs() <= tol.1 + tol.0 * w.abs());
        assert!(
            ok,
            "{what}: element {i}: got {g}, want {w} (rtol {}, atol {})",
            tol.0, tol.1
        );
    }
}

/// Compiles `f` on the CPU plugin, runs it on `inputs`, and compares every
/// output with the reference interpreter, within `scale` × the dtype's
/// tolerance. Returns the device outputs.
pub fn check_against_reference(f: &Function, inputs: &[Literal], scale: f64) -> Vec<Literal> {
    let want = interpret(f, inputs).unwrap_or_else(|e| panic!("reference for {}: {e}", f.name));
    let exe = CompiledFunction::new(client(), f)
        .unwrap_or_else(|e| panic!("compile {}: {e}\n{f}", f.name));
    dump(&exe);
    let host: Vec<HostArray> = inputs.iter().cloned().map(HostArray::from).collect();
    let got = exe
        .run(&host)
        .unwrap_or_else(|e| panic!("run {}: {e}", f.name));
    assert_eq!(got.len(), want.len());
    let mut out = Vec::new();
    for ((g, w), b) in got.into_iter().zip(&want).zip(&f.outputs) {
        let g = Literal::from(g);
        assert_eq!(g.ty, w.ty, "{}: output {} type", f.name, b.name);
        let (r, a) = tolerance(w.ty.dtype);
        assert_close(
            &format!("{} output {}", f.name, b.name),
            &g.to_f64s(),
            &w.to_f64s(),
            (r * scale, a * scale),
        );
        out.push(g);
    }
    out
}

/// With `HLO_E2E_DUMP=DIR`, writes each compiled program as StableHLO and as
/// HLO text, for `scripts/check_hlo_text.py` to check the HLO printer
/// against XLA's own parser and the StableHLO form.
fn dump(exe: &CompiledFunction) {
    let Some(dir) = std::env::var_os("HLO_E2E_DUMP") else {
        return;
    };
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir).expect("create dump dir");
    let f = exe.function();
    let stem = format!("{}_{}_{n}", f.name, std::process::id());
    std::fs::write(dir.join(format!("{stem}.stablehlo.mlir")), exe.stablehlo())
        .expect("write dump");
    std::fs::write(
        dir.join(format!("{stem}.hlo.txt")),
        hlo_lowering::to_hlo_text(f),
    )
    .expect("write dump");
}

/// One input of a gradient check: name, type, and the range its random
/// values are drawn from.
pub struct Arg {
    pub name: &'static str,
    pub ty: TensorType,
    pub lo: f64,
    pub hi: f64,
}

/// An input named `name` of `dtype[dims]`, uniform in [lo, hi).
pub fn arg(name: &'static str, dtype: DType, dims: &[i64], lo: f64, hi: f64) -> Arg {
    Arg {
        name,
        ty: TensorType::new(dtype, dims.to_vec()),
        lo,
        hi,
    }
}

/// Checks the gradients of `body` with respect to `wrt` by central finite
/// differences in f64, run through the CPU plugin.
///
/// The scalar loss is `Σ_k sum(out_k · probe_k)` with fixed random probes,
/// so every output element contributes. The gradient program is compiled
/// and run on the plugin; for three random directions `v` its directional
/// derivative `Σ <grad, v>` must match `(L(x + hv) − L(x − hv)) / 2h`
/// (also run on the plugin) within relative error `rtol`. The plugin's
/// gradients are also compared with the reference interpreter's. Returns
/// the gradient function.
pub fn check_grads(
    name: &str,
    args: &[Arg],
    wrt: &[&str],
    rtol: f64,
    body: impl Fn(&hlo_ir::Inputs) -> Vec<hlo_ir::Tensor>,
) -> Function {
    let mut rng = Rng::from_state(
        name.bytes()
            .fold(17u64, |h, b| h.wrapping_mul(131).wrapping_add(b as u64)),
    );
    let (f, probe_types) = probed_loss(name, args, body);
    let g = hlo_ir::value_and_grad(&f, "loss", wrt).unwrap_or_else(|e| panic!("grad {name}: {e}"));
    let mut values: Vec<Literal> = args
        .iter()
        .map(|a| rng.literal(a.ty.clone(), a.lo, a.hi))
        .collect();
    values.extend(
        probe_types
            .iter()
            .map(|t| rng.literal(t.clone(), -1.0, 1.0)),
    );
    let backward = CompiledFunction::new(client(), &g)
        .unwrap_or_else(|e| panic!("compile {name} gradient: {e}\n{g}"));
    dump(&backward);
    let got: Vec<Literal> = backward
        .run(&host(&values))
        .expect("run gradient")
        .into_iter()
        .map(Literal::from)
        .collect();
    let reference = interpret(&g, &values).expect("reference gradient");
    for (k, (a, b)) in got.iter().zip(&reference).enumerate() {
        let (r, t) = tolerance(b.ty.dtype);
        assert_close(
            &format!("{name} gradient output {k} vs reference"),
            &a.to_f64s(),
            &b.to_f64s(),
            (r * 100.0, t * 100.0),
        );
    }
    let grads: Vec<Vec<f64>> = got[1..].iter().map(|l| l.to_f64s()).collect();
    let check = DirectionalCheck {
        name,
        args,
        wrt,
        rtol,
    };
    check.run(&f, &values, &grads, &mut rng);
    g
}

/// `values` as host arrays for a compiled function.
fn host(values: &[Literal]) -> Vec<HostArray> {
    values.iter().cloned().map(HostArray::from).collect()
}

/// `body`'s outputs reduced to the scalar `loss = Σ_k sum(out_k ·
/// probe_k)` (in f64), the probes `probe.K` inputs after `args`, so every
/// output element contributes; with the probes' types.
fn probed_loss(
    name: &str,
    args: &[Arg],
    body: impl Fn(&hlo_ir::Inputs) -> Vec<hlo_ir::Tensor>,
) -> (Function, Vec<TensorType>) {
    let mut inputs: Vec<(String, TensorType)> = args
        .iter()
        .map(|a| (a.name.to_string(), a.ty.clone()))
        .collect();
    // Output types, to size the probes: trace once without them.
    let probe_types: Vec<TensorType> = hlo_ir::trace(name, &inputs, |i| body(i))
        .expect("trace")
        .output_types();
    for (k, t) in probe_types.iter().enumerate() {
        inputs.push((format!("probe.{k}"), t.clone()));
    }
    let n_args = args.len();
    let f = hlo_ir::trace(name, &inputs, |i| {
        let outs = body(i);
        let mut loss: Option<hlo_ir::Tensor> = None;
        for (k, o) in outs.iter().enumerate() {
            let p = i.tensors()[n_args + k];
            let all: Vec<i64> = (0..o.rank() as i64).collect();
            let term = (o.cast(DType::F64) * p.cast(DType::F64)).sum(&all);
            loss = Some(match loss {
                None => term,
                Some(l) => l + term,
            });
        }
        vec![("loss", loss.expect("at least one output"))]
    })
    .unwrap_or_else(|e| panic!("trace {name}: {e}"));
    (f, probe_types)
}

/// The finite-difference half of [`check_grads`]: for three random
/// directions `v`, the gradient's `Σ <grad, v>` against central
/// differences of the loss run on the plugin.
struct DirectionalCheck<'a> {
    name: &'a str,
    args: &'a [Arg],
    wrt: &'a [&'a str],
    rtol: f64,
}

impl DirectionalCheck<'_> {
    fn run(&self, f: &Function, values: &[Literal], grads: &[Vec<f64>], rng: &mut Rng) {
        let name = self.name;
        let forward =
            CompiledFunction::new(client(), f).unwrap_or_else(|e| panic!("compile {name}: {e}"));
        let loss = |v: &[Literal]| -> f64 {
            let out = forward.run(&host(v)).expect("run forward");
            Literal::from(out.into_iter().next().expect("loss")).to_f64s()[0]
        };
        let index: Vec<usize> = self
            .wrt
            .iter()
            .map(|w| {
                self.args
                    .iter()
                    .position(|a| a.name == *w)
                    .expect("wrt names an arg")
            })
            .collect();
        for trial in 0..3 {
            let dirs: Vec<Vec<f64>> = index
                .iter()
                .map(|&i| {
                    (0..self.args[i].ty.element_count())
                        .map(|_| rng.uniform(-1.0, 1.0))
                        .collect()
                })
                .collect();
            let directional: f64 = grads
                .iter()
                .zip(&dirs)
                .map(|(g, d)| g.iter().zip(d).map(|(a, b)| a * b).sum::<f64>())
                .sum();
            let h = 1e-5;
            let shifted = |sign: f64| {
                let mut v = values.to_vec();
                for (&i, d) in index.iter().zip(&dirs) {
                    let x = v[i].to_f64s();
                    let moved: Vec<f64> = x.iter().zip(d).map(|(a, b)| a + sign * h * b).collect();
                    v[i] = Literal::from_f64s(v[i].ty.clone(), &moved);
                }
                loss(&v)
            };
            let fd = (shifted(1.0) - shifted(-1.0)) / (2.0 * h);
            let scale = directional.abs().max(fd.abs()).max(1e-6);
            let err = (directional - fd).abs() / scale;
            let rtol = self.rtol;
            assert!(
                err < rtol,
                "{name}: direction {trial}: gradient gives {directional}, central differences {fd} (relative error {err:.2e} > {rtol:.0e})"
            );
        }
    }
}

/// Folder `path` under `tests/fixtures` (`llama/gqa_llama3`, `families/gemma3`).
pub fn fixture_dir(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(path)
}

/// Tensor `key` of fixture folder `dir`'s `expected.safetensors`.
pub fn expected_tensor(dir: &std::path::Path, key: &str) -> Literal {
    expected_in(dir, "expected.safetensors", key)
}

/// Tensor `key` of the safetensors file `file` in the fixture folder `dir`.
pub fn expected_in(dir: &std::path::Path, file: &str, key: &str) -> Literal {
    hlo_models::io::read_safetensors(&dir.join(file))
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("{key} in {}'s {file}", dir.display()))
        .1
}

/// Whether XLA's CPU code converts between f32 and f16: the CPU has the
/// F16C instructions and `XLA_FLAGS` does not cap the instruction set
/// below them (`--xla_cpu_max_isa=SSE4_2`, where the pinned plugin's JIT
/// calls a conversion routine it cannot find, and the compile fails).
pub fn xla_cpu_converts_f16() -> bool {
    let flags = std::env::var("XLA_FLAGS").unwrap_or_default();
    let capped = flags
        .split_whitespace()
        .filter_map(|f| f.strip_prefix("--xla_cpu_max_isa="))
        .any(|isa| isa.eq_ignore_ascii_case("SSE4_2"));
    #[cfg(target_arch = "x86_64")]
    let has = std::arch::is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    let has = true;
    has && !capped
}

/// Asserts f32 logits `got` are within the model's
/// `ModelConfig::f32_forward_bound` of `want` (HF's, from the fixture in
/// `dir`; the scale the logits' largest magnitude), printing the
/// difference and the bound.
pub fn assert_f32_logits(what: &str, dir: &std::path::Path, got: &[f64], want: &[f64]) {
    let config = hlo_models::checkpoint::Checkpoint::open(dir)
        .map(|c| c.config)
        .unwrap_or_else(|_| {
            hlo_models::decoder::ModelConfig::from_file(&dir.join("config.json")).unwrap()
        });
    let seq = expected_tensor(dir, "input_ids").ty.dims[1];
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    let bound = config.f32_forward_bound(seq, scale);
    let d = max_abs_diff(got, want);
    println!("{what}: f32 max abs diff {d:e} (bound {bound:e})");
    assert!(d <= bound, "{what}: max abs diff {d:e} above {bound:e}");
}

/// The largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The logits (as f64) of the HF fixture model in `dir` on its input ids,
/// computed in `dtype` on the CPU plugin: with its PEFT adapter if
/// `adapter`, with its layers as one scan over stacked weights if `scan`.
pub fn fixture_logits(dir: &std::path::Path, dtype: DType, adapter: bool, scan: bool) -> Vec<f64> {
    let adapter = adapter.then(|| dir.join("adapter"));
    fixture_logits_of(dir, dir, dtype, adapter.as_deref(), scan)
}

/// [`fixture_logits`] of the model in `dir` on the input ids of fixture
/// folder `ids_dir` (a copy of a fixture model in another layout), with
/// the adapter folder `adapter` if given.
pub fn fixture_logits_of(
    dir: &std::path::Path,
    ids_dir: &std::path::Path,
    dtype: DType,
    adapter: Option<&std::path::Path>,
    scan: bool,
) -> Vec<f64> {
    use hlo_models::decoder::{forward_step, is_stacked, stack_literals, unstacked_names};
    let ckpt = hlo_models::checkpoint::Checkpoint::open(dir).unwrap();
    let c = &ckpt.config;
    let ids = expected_tensor(ids_dir, "input_ids");
    let (b, s) = (ids.ty.dims[0], ids.ty.dims[1]);
    let adapter = adapter.map(|a| hlo_models::adapter::Adapter::load(a, c).unwrap());
    let lora = adapter.as_ref().map(|a| &a.lora);
    let f = forward_step(c, dtype, b, s, lora, scan).unwrap().function;
    let read = |n: &str| match adapter.as_ref().and_then(|a| a.get(n)) {
        Some(t) => t.clone(),
        None => ckpt.read(n, dtype).unwrap(),
    };
    let inputs: Vec<HostArray> = f
        .inputs
        .iter()
        .map(|binding| {
            HostArray::from(if binding.name == "input_ids" {
                ids.clone()
            } else if scan && is_stacked(&binding.name) {
                let parts: Vec<Literal> = unstacked_names(&binding.name, c.num_hidden_layers)
                    .iter()
                    .map(|n| read(n))
                    .collect();
                stack_literals(&parts)
            } else {
                read(&binding.name)
            })
        })
        .collect();
    CompiledFunction::new(client(), &f)
        .unwrap()
        .run(&inputs)
        .unwrap()[0]
        .to_f64_vec()
}

/// `config`'s decoder on one device, unscanned, no LoRA, naive attention,
/// its experts run as `kind`.
pub fn plain_decoder(
    config: &hlo_models::decoder::ModelConfig,
    kind: hlo_models::decoder::MoeKind,
) -> hlo_models::decoder::Decoder<'_> {
    hlo_models::decoder::Decoder {
        config,
        lora: None,
        batch_axes: vec![],
        scan_layers: false,
        remat_layers: false,
        remat_mlp: false,
        attention: hlo_models::attention::AttentionKind::Naive,
        moe: kind,
        router: Default::default(),
    }
}

/// Layer 0's sparse MLP of `config` alone as a function of its weights and
/// `x` (`[1, rows, hidden]`), its experts run as `kind`: output `y`, or
/// with `summed` the scalar `sum` of it (to differentiate).
pub fn sparse_layer(
    config: &hlo_models::decoder::ModelConfig,
    kind: hlo_models::decoder::MoeKind,
    rows: i64,
    summed: bool,
) -> Function {
    use hlo_models::decoder::{base_parameter_types, Params};
    let prefix = "model.layers.0.mlp";
    let mut inputs: Vec<(String, TensorType)> = base_parameter_types(config, DType::F32)
        .into_iter()
        .filter(|(n, _)| n.starts_with(prefix))
        .collect();
    inputs.push((
        "x".into(),
        TensorType::new(DType::F32, [1, rows, config.hidden_size]),
    ));
    let model = plain_decoder(config, kind);
    hlo_ir::trace("moe_layer", &inputs, |i| {
        let y = model.mlp(&Params(i), prefix, i["x"]);
        if summed {
            hlo_ir::Outputs::new().add("sum", y.sum(&[0, 1, 2]))
        } else {
            hlo_ir::Outputs::new().add("y", y)
        }
    })
    .expect("the sparse layer traces")
}
