//! `hlo-train plan --nodes N`: which mesh axes cross nodes, the step's
//! communication per axis at the target's link rates, and a node count
//! that does not divide the mesh refused in one line.

mod common;

use common::*;

use serde_json::Value;

fn plan_json(args: &[&str]) -> Value {
    let mut all = vec![
        "plan", "--model", "tiny", "--batch", "8", "--seq", "16", "--json",
    ];
    all.extend_from_slice(args);
    serde_json::from_str(&ok(&hlo_train(&all))).expect("one JSON object")
}

/// The rows of `v["communication"]` over `axis`.
fn rows<'a>(v: &'a Value, axis: &str) -> Vec<&'a Value> {
    v["communication"]
        .as_array()
        .expect("a communication array")
        .iter()
        .filter(|r| r["axis"] == axis)
        .collect()
}

#[test]
fn data_parallel_pairs_cross_two_nodes_and_fsdp_stays_inside() {
    let v = plan_json(&["--mesh", "dp=2,fsdp=4,mp=1", "--nodes", "2"]);
    assert_eq!(v["nodes"], 2);
    assert_eq!(v["devices_per_node"], 4);
    let span = |axis: &str| {
        v["axes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["axis"] == axis)
            .unwrap_or_else(|| panic!("no axis {axis} in {v}"))["nodes"]
            .clone()
    };
    assert_eq!(span("dp"), "across");
    assert_eq!(span("fsdp"), "within");
    assert_eq!(span("mp"), "within");
    // dp all-reduces the LoRA gradients over the NIC (MI300X: 50 GB/s);
    // fsdp gathers weights and scatters gradients over Infinity Fabric.
    let dp = rows(&v, "dp");
    assert_eq!(dp.len(), 1, "{v}");
    assert_eq!(dp[0]["collective"], "all-reduce");
    assert_eq!(dp[0]["nodes"], "across");
    assert_eq!(dp[0]["link_gb_per_s"], 50.0);
    let fsdp = rows(&v, "fsdp");
    assert!(fsdp.iter().any(|r| r["collective"] == "all-gather"), "{v}");
    assert!(
        fsdp.iter().any(|r| r["collective"] == "reduce-scatter"),
        "{v}"
    );
    for r in fsdp.iter().chain(&dp) {
        assert!(r["bytes_per_device"].as_u64().unwrap() > 0, "{r}");
        let (bytes, ms) = (
            r["bytes_per_device"].as_f64().unwrap(),
            r["estimated_ms"].as_f64().unwrap(),
        );
        let gbs = r["link_gb_per_s"].as_f64().unwrap();
        assert!(
            (ms - bytes / (gbs * 1e9) * 1e3).abs() <= 1e-9 * ms.max(1.0),
            "{r}"
        );
        if r["axis"] == "fsdp" {
            assert_eq!((r["nodes"].as_str(), gbs), (Some("within"), 448.0), "{r}");
        }
    }
    assert!(rows(&v, "mp").is_empty(), "mp=1 moves nothing: {v}");
    let total = &v["communication_total"];
    let sum: u64 = v["communication"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["bytes_per_device"].as_u64().unwrap())
        .sum();
    assert!(total["bytes_per_device"].as_u64().unwrap().abs_diff(sum) <= 4);
    assert_eq!(total["peak_tflops"], 1307.4);
    assert!(total["compute_ms"].as_f64().unwrap() > 0.0);

    // The memory plan is per device: --nodes leaves it as it was.
    let one = plan_json(&["--mesh", "dp=2,fsdp=4,mp=1"]);
    assert_eq!(one["per_device"], v["per_device"]);
    assert_eq!(one["nodes"], 1);
    assert!(one["axes"]
        .as_array()
        .unwrap()
        .iter()
        .all(|a| a["nodes"] == "within"));
    // --num-processes says the same as --nodes.
    let alias = plan_json(&["--mesh", "dp=2,fsdp=4,mp=1", "--num-processes", "2"]);
    assert_eq!(alias["axes"], v["axes"]);
}

#[test]
fn the_table_names_the_axes_and_cpu_has_no_link_figures() {
    let text = ok(&hlo_train(&[
        "plan",
        "--batch",
        "8",
        "--seq",
        "16",
        "--mesh",
        "dp=2,fsdp=4,mp=1",
        "--nodes",
        "2",
    ]));
    assert!(
        text.contains(
            "communication per step, per device (2 nodes × 4 devices; dp=2 across, fsdp=4 within):"
        ),
        "{text}"
    );
    assert!(text.contains("at the links' peak"), "{text}");
    let v = plan_json(&["--mesh", "dp=1,fsdp=4,mp=2", "--target", "cpu"]);
    let rows = v["communication"].as_array().unwrap();
    assert!(rows.iter().any(|r| r["axis"] == "mp"), "{v}");
    assert!(rows
        .iter()
        .all(|r| r["link_gb_per_s"].is_null() && r["estimated_ms"].is_null()));
}

#[test]
fn nodes_that_do_not_divide_the_mesh_are_one_line() {
    let err = one_line_error(&hlo_train(&[
        "plan",
        "--model",
        "tiny",
        "--mesh",
        "dp=2,fsdp=4,mp=1",
        "--nodes",
        "3",
    ]));
    assert!(
        err.contains("--nodes 3") && err.contains("8 devices"),
        "{err}"
    );
    let out = hlo_train(&["plan", "--nodes", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}
