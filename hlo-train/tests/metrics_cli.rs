//! The figures a user sees are checked against the wall clock: each
//! step's `step_time_s` in the metrics file is the time that step took on
//! the devices, for JIT on one device, JIT on a 2×4 mesh of 8 devices, and
//! eager. The reference is an independent clock: `elapsed_s`, the wall
//! time at which each step's figures were read, whose differences are the
//! steps' wall-clock durations once the loop runs steadily.

mod common;

use common::*;

/// (step_time_s, elapsed_s) of every train line.
fn timings(metrics: &std::path::Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("step_time_s").is_some())
        .map(|v| {
            (
                v["step_time_s"].as_f64().unwrap(),
                v["elapsed_s"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
fn step_times_agree_with_the_wall_clock() {
    let dir = scratch("metrics", "wall");
    for (name, extra) in [
        ("jit", &[][..]),
        (
            "mesh",
            &["--mesh", "dp=2,fsdp=4,mp=1", "--devices", "8"][..],
        ),
        ("eager", &["--eager"][..]),
    ] {
        let metrics = dir.join(format!("{name}.jsonl"));
        let mut args = vec![
            "train",
            "--steps",
            "64",
            "--batch",
            "16",
            "--seq",
            "64",
            "--log-every",
            "1000",
            "--metrics",
            metrics.to_str().unwrap(),
        ];
        args.extend(extra);
        ok(&hlo_train(&args));
        let t = timings(&metrics);
        assert_eq!(t.len(), 64, "{name}");
        // The first steps compile (eager) or warm up; after them the loop
        // is steady and a step's wall time is the gap between reports.
        let steady = &t[4..];
        let reported = median(steady.iter().map(|s| s.0).collect());
        let wall = median(steady.windows(2).map(|w| w[1].1 - w[0].1).collect());
        let ratio = reported / wall;
        assert!(
            (0.7..=1.3).contains(&ratio),
            "{name}: median step_time_s {reported:.5} s against {wall:.5} s of wall clock"
        );
        let shortest = steady.iter().map(|s| s.0).fold(f64::INFINITY, f64::min);
        assert!(
            shortest >= 0.3 * reported,
            "{name}: a step reported {shortest:.6} s, the median is {reported:.5} s"
        );
        // Steps cannot have taken longer in all than the wall clock
        // between the first and last report.
        let total: f64 = steady[1..].iter().map(|s| s.0).sum();
        let span = steady[steady.len() - 1].1 - steady[0].1;
        assert!(
            total <= 1.05 * span + 0.01,
            "{name}: {total:.3} s of steps in {span:.3} s"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}
