//! XLA options per compile on the real CPU plugin: the plugin applies
//! `env_option_overrides` (a known flag compiles and runs, an unknown one
//! or a value of the wrong type is refused by XLA with its own message).
//! Needs the plugin (`make setup`).

mod common;

use std::sync::OnceLock;

use hlo_runtime::{parse_xla_option, Client, CompileOptions, HostArray, XlaOption};

fn client() -> &'static Client {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    CLIENT.get_or_init(|| common::cpu_client(1))
}

const DOUBLE: &str = "func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> {
  %0 = stablehlo.add %a, %a : tensor<2xf32>
  return %0 : tensor<2xf32>
}";

fn options(texts: &[&str]) -> Vec<(String, XlaOption)> {
    texts
        .iter()
        .map(|t| parse_xla_option(t).expect("a valid option"))
        .collect()
}

/// Compiles `DOUBLE` with `texts` as the client's options, and runs it.
fn doubled_with(texts: &[&str]) -> hlo_runtime::Result<Vec<f32>> {
    let c = client().with_xla_options(&options(texts));
    let exe = c.compile_cached(DOUBLE, &CompileOptions::default())?;
    let device = &exe.devices()[0];
    let x = c.buffer_from_host(&HostArray::new(&[2], &[1.5f32, -2.0])?, device)?;
    let out = exe.execute(&[vec![&x]])?;
    out[0][0].to_host()?.to_vec::<f32>()
}

#[test]
fn known_options_of_each_kind_compile_and_run() {
    let got = doubled_with(&[
        "xla_cpu_enable_fast_math=false",
        "xla_backend_optimization_level=2",
        "--xla_dump_hlo_as_text=false",
        "xla_gpu_auto_spmd_partitioning_memory_budget_ratio=1.5",
        "xla_dump_to=",
    ])
    .expect("the plugin accepts the options");
    assert_eq!(got, [3.0, -4.0]);
}

#[test]
fn the_executable_records_the_clients_options_and_the_cache_keys_on_them() {
    let plain = client()
        .compile_cached(DOUBLE, &CompileOptions::default())
        .expect("compile");
    let with = client()
        .with_xla_options(&options(&["xla_cpu_enable_fast_math=false"]))
        .compile_cached(DOUBLE, &CompileOptions::default())
        .expect("compile");
    assert!(plain.options().env_option_overrides.is_empty());
    assert_eq!(
        with.options().env_option_overrides,
        options(&["xla_cpu_enable_fast_math=false"])
    );
    assert!(!std::sync::Arc::ptr_eq(&plain, &with));
}

#[test]
fn xla_refuses_an_unknown_option_and_a_value_of_the_wrong_type() {
    let unknown = doubled_with(&["xla_no_such_option_anywhere=true"])
        .expect_err("an unknown option is refused");
    let text = unknown.to_string();
    assert!(text.contains("xla_no_such_option_anywhere"), "{text}");
    let wrong = doubled_with(&["xla_cpu_enable_fast_math=3"]).expect_err("an int for a bool");
    assert!(
        wrong.to_string().contains("xla_cpu_enable_fast_math"),
        "{wrong}"
    );
}

/// A value XLA would abort the process on, made without
/// `parse_xla_option` (a library caller's own options), is refused by the
/// compile before XLA sees it: an error, not exit 134.
#[test]
fn a_value_xla_would_abort_on_is_refused_by_the_compile() {
    let key = "xla_cpu_parallel_codegen_split_count".to_string();
    for value in [XlaOption::Int(-5), XlaOption::Str("-5".into())] {
        let c = client().with_xla_options(&[(key.clone(), value.clone())]);
        let Err(e) = c.compile(DOUBLE, &CompileOptions::default()) else {
            panic!("{value}: compiled");
        };
        assert!(
            e.to_string().contains("XLA takes 1 to 4096"),
            "{value}: {e}"
        );
    }
    let c = client().with_xla_options(&[(key, XlaOption::Int(4))]);
    c.compile(DOUBLE, &CompileOptions::default())
        .expect("a count in range compiles");
}
