//! `hlo-e2e` holds the cross-crate end-to-end tests: programs traced with
//! `hlo-ir`, lowered by `hlo-lowering` and run by `hlo-runtime` on the real
//! CPU plugin, checked against independent references (the host f64
//! interpreter, finite differences, HF/PEFT/JAX fixtures as they arrive).
//! Tests that need the plugin fail loudly without it: `make test` installs
//! it. This library holds what the tests share.

use std::sync::OnceLock;

use hlo_ir::{interpret, DType, Function, Literal, TensorType};
use hlo_runtime::{Client, ClientOptions, CompiledFunction, HostArray, Plugin, PluginSpec};

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
    let path = PluginSpec::Cpu
        .resolve()
        .expect("the CPU plugin is missing: run `make setup`");
    let plugin = Plugin::load(path).expect("load the CPU plugin");
    Client::new(&plugin, &ClientOptions::cpu(devices)).expect("create a CPU client")
}

/// splitmix64: small, seeded, reproducible test inputs.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }

    /// A literal of `ty` with values uniform in [lo, hi) (integers: floored).
    pub fn literal(&mut self, ty: TensorType, lo: f64, hi: f64) -> Literal {
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
