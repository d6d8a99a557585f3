//! Runs that stop and continue: `--resume` reproduces the uninterrupted
//! run's losses, SIGKILL in the middle of a save leaves a resumable
//! checkpoint, SIGTERM saves and stops.

mod common;

use common::*;

use std::path::Path;
use std::process::Command;

/// Flags of a short constant-schedule run on the demo task.
fn constant(steps: &str, packing: &str) -> Vec<String> {
    [
        "train",
        "--batch",
        "16",
        "--seq",
        "16",
        "--lr",
        "3e-3",
        "--warmup",
        "2",
        "--lora-rank",
        "16",
        "--lora-alpha",
        "32",
        "--steps",
        steps,
        "--packing",
        packing,
    ]
    .map(String::from)
    .to_vec()
}

fn run_ok(mut args: Vec<String>, extra: &[&str]) -> String {
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&hlo_train(&refs))
}

#[test]
fn resume_reproduces_the_losses_exactly() {
    let dir = scratch("train", "resume");
    // Packed rows too: the data cursor then counts samples, not rows.
    for packing in ["off", "on"] {
        let (whole, first, second) = (
            dir.join(format!("whole_{packing}.jsonl")),
            dir.join(format!("first_{packing}.jsonl")),
            dir.join(format!("second_{packing}.jsonl")),
        );
        let out = dir.join(format!("out_{packing}"));
        let (w, o) = (whole.to_str().unwrap(), out.to_str().unwrap());
        run_ok(constant("8", packing), &["--metrics", w]);
        run_ok(
            constant("4", packing),
            &["--metrics", first.to_str().unwrap(), "--out", o],
        );
        // A constant schedule may be extended; nothing else is given again.
        let second_s = second.to_str().unwrap();
        run_ok(
            vec!["train".into()],
            &["--resume", o, "--steps", "8", "--metrics", second_s],
        );
        let (w, a, b) = (losses(&whole), losses(&first), losses(&second));
        assert_eq!(a, w[..4], "{packing}");
        assert_eq!(b, w[4..], "{packing}");
        // It saved into the resumed folder.
        let state: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("train_state/state.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(state["step"], 8);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Metrics rows as (step, loss).
fn step_losses(metrics: &Path) -> Vec<(u64, f64)> {
    metric(metrics, "loss")
}

#[test]
fn sigkill_mid_save_leaves_a_resumable_checkpoint() {
    let dir = scratch("train", "kill");
    let out = dir.join("out");
    let args = |steps: &str, metrics: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = DEMO.iter().map(|s| s.to_string()).collect();
        a.extend(["16", "--steps", steps, "--metrics"].map(String::from));
        a.push(metrics.to_str().unwrap().into());
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let whole = dir.join("whole.jsonl");
    ok(&hlo_train(
        &args("400", &whole, &[])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    ));
    let reference = step_losses(&whole);
    let saved = || {
        ["train_state", "train_state.old"]
            .iter()
            .any(|d| out.join(d).join("state.json").is_file())
    };
    // Saving after every step, the run spends most of its time saving: kill
    // it (SIGKILL) at several moments, resuming each time from what is on disk.
    let out_s = out.to_str().unwrap().to_string();
    for (k, delay_ms) in [0u64, 37, 110, 250].into_iter().enumerate() {
        let metrics = dir.join(format!("killed{k}.jsonl"));
        let mut extra = vec!["--out", &out_s, "--save-every", "1"];
        if saved() {
            extra.extend(["--resume", &out_s]);
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_hlo-train"))
            .args(args("400", &metrics, &extra))
            .env_remove("HLO_TRAIN_PLUGIN")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Once the run is in its loop (a few steps logged), a little later.
        for _ in 0..2400 {
            if step_losses(&metrics).len() >= 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
    }
    assert!(saved(), "no checkpoint survived the kills");
    // Finish from what is on disk: the losses are the uninterrupted run's.
    let last = dir.join("last.jsonl");
    ok(&hlo_train(
        &args("400", &last, &["--out", &out_s, "--resume", &out_s])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    ));
    let resumed = step_losses(&last);
    assert!(!resumed.is_empty() && resumed.last().unwrap().0 == 400);
    let first = resumed[0].0;
    assert!(first > 1, "nothing was kept from the killed runs");
    for (step, loss) in &resumed {
        let want = reference[*step as usize - 1];
        assert_eq!(want.0, *step);
        assert!(
            (loss - want.1).abs() <= 1e-6 * want.1.abs(),
            "step {step}: {loss} vs {}",
            want.1
        );
    }
}

#[test]
fn sigterm_saves_and_stops() {
    let dir = scratch("train", "sigterm");
    let out = dir.join("out");
    let metrics = dir.join("m.jsonl");
    let mut a: Vec<String> = DEMO.iter().map(|s| s.to_string()).collect();
    a.extend(["16", "--steps", "300", "--metrics"].map(String::from));
    a.push(metrics.to_str().unwrap().into());
    a.extend(["--out".into(), out.to_str().unwrap().into()]);
    let child = Command::new(env!("CARGO_BIN_EXE_hlo-train"))
        .args(&a)
        .env_remove("HLO_TRAIN_PLUGIN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for training to start, then ask it to stop.
    for _ in 0..600 {
        if step_losses(&metrics).len() > 5 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(
        stdout.contains("stopped by a signal after step"),
        "{stdout}"
    );
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("train_state/state.json")).unwrap())
            .unwrap();
    // The checkpoint is of the last step the metrics show.
    let last = step_losses(&metrics).last().unwrap().0;
    assert_eq!(state["step"].as_u64().unwrap(), last);
    assert!(last < 300, "the run ended before the signal");
    // `--resume DIR` alone finishes the run with every saved setting (the
    // cosine schedule over 300 steps included), saving into DIR, and the
    // losses are the uninterrupted run's.
    let resumed = dir.join("resumed.jsonl");
    ok(&hlo_train(&[
        "train",
        "--resume",
        out.to_str().unwrap(),
        "--metrics",
        resumed.to_str().unwrap(),
    ]));
    let whole = dir.join("whole.jsonl");
    let mut b: Vec<String> = DEMO.iter().map(|s| s.to_string()).collect();
    b.extend(["16", "--steps", "300", "--metrics"].map(String::from));
    b.push(whole.to_str().unwrap().into());
    ok(&hlo_train(
        &b.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    let (resumed, whole) = (step_losses(&resumed), step_losses(&whole));
    assert_eq!(resumed.first().unwrap().0, last + 1);
    assert_eq!(resumed.last().unwrap().0, 300);
    for (step, loss) in &resumed {
        let want = whole[*step as usize - 1];
        assert!(
            (loss - want.1).abs() <= 1e-6 * want.1.abs(),
            "step {step}: {loss} vs {}",
            want.1
        );
    }
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("train_state/state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 300);
}
