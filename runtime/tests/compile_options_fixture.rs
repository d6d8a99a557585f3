//! [`CompileOptions::encode`] against the `protobuf` package's bytes for
//! the same options (`fixtures/compile_options.json`, written by
//! `scripts/make_compile_options_fixture.py` from our own schema under XLA's
//! field numbers).
//!
//! Bytes are compared as they are: a map has no order on the wire, but the
//! fixture is serialized deterministically (entries sorted by key) and our
//! encoder sorts by key too, so equal options must give equal bytes.

use hlo_runtime::{parse_xla_option, CompileOptions, XlaOption};
use serde_json::Value;

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/compile_options.json"
    );
    let text = std::fs::read_to_string(path).expect("the fixture is in the repository");
    serde_json::from_str(&text).expect("the fixture is JSON")
}

/// The options a fixture case describes, each override read from its
/// KEY=VALUE text and checked to be of the kind the fixture gave it.
fn options_of(case: &Value) -> CompileOptions {
    let n = case["num_partitions"].as_i64().expect("num_partitions");
    let spmd = case["spmd"].as_bool().expect("spmd");
    let mut options = match case["device_assignment"].as_array() {
        Some(ids) => {
            let ids: Vec<i64> = ids.iter().map(|i| i.as_i64().expect("an id")).collect();
            CompileOptions::spmd_on(&ids)
        }
        None if spmd => CompileOptions::spmd(n),
        None => CompileOptions {
            num_partitions: n,
            ..CompileOptions::default()
        },
    };
    for o in case["overrides"].as_array().expect("overrides") {
        let text = o["text"].as_str().expect("text");
        let (key, value) = parse_xla_option(text).expect("a valid option");
        let kind = match value {
            XlaOption::Str(_) => "str",
            XlaOption::Bool(_) => "bool",
            XlaOption::Int(_) => "int",
            XlaOption::Double(_) => "double",
        };
        assert_eq!(kind, o["kind"].as_str().expect("kind"), "{text}");
        options.env_option_overrides.push((key, value));
    }
    options
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn encoded_options_equal_protobufs_bytes() {
    let fixture = fixture();
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 4);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let want = case["hex"].as_str().expect("hex");
        assert_eq!(hex(&options_of(case).encode()), want, "case {name}");
    }
}

#[test]
fn the_order_overrides_are_given_in_does_not_change_the_bytes() {
    let fixture = fixture();
    let case = &fixture["cases"][2];
    let mut options = options_of(case);
    let want = options.encode();
    // Reversed, the duplicate key's last value is another one: drop the
    // earlier duplicate first so the map is the same.
    options
        .env_option_overrides
        .retain(|(k, v)| !(k == "xla_b_negative" && *v == XlaOption::Int(-5)));
    options.env_option_overrides.reverse();
    assert_eq!(options.encode(), want);
}
