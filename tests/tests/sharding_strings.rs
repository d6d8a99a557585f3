//! Our Shardy and GSPMD spellings of (mesh, PartitionSpec) pairs against
//! JAX's, from `tests/fixtures/sharding_strings.json`
//! (`scripts/make_sharding_fixture.py`).

use hlo_lowering::{gspmd_sharding, sdy_mesh, sdy_sharding};
use hlo_partitioner::{Mesh, PartitionSpec};
use serde_json::Value;

#[test]
fn shardy_and_gspmd_strings_equal_jax() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/sharding_strings.json"
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 80, "the fixture covers the table");
    let mut mismatches = Vec::new();
    for case in cases {
        let mesh: Mesh = case["mesh"].as_str().unwrap().parse().unwrap();
        let spec = PartitionSpec(
            case["spec"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| {
                    d.as_array()
                        .unwrap()
                        .iter()
                        .map(|a| a.as_str().unwrap().to_string())
                        .collect()
                })
                .collect(),
        );
        let shape: Vec<i64> = case["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_i64().unwrap())
            .collect();
        spec.validate(&mesh, &shape, "x").unwrap();
        let ours = (
            sdy_mesh(&mesh),
            sdy_sharding(&spec, shape.len()),
            gspmd_sharding(&mesh, &spec, shape.len()),
        );
        let jax = (
            case["sdy_mesh"].as_str().unwrap().to_string(),
            case["sdy"].as_str().unwrap().to_string(),
            case["gspmd"].as_str().unwrap().to_string(),
        );
        if ours != jax {
            mismatches.push(format!("{mesh} {spec}: ours {ours:?}, JAX {jax:?}"));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} differ:\n{}",
        mismatches.len(),
        cases.len(),
        mismatches.join("\n")
    );
}
