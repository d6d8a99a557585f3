//! Several `hlo-train` processes meeting on loopback, as they do across
//! nodes: by flags, by SLURM's variables and by torchrun's; a process
//! alone, a peer that dies, a stranger without the run token, counts that
//! differ, and the CPU plugin's refusal to train across processes.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::one_line_error;
use hlo_engine::rendezvous::{KvClient, KvError};
use serde_json::Value;

/// A loopback port nothing listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `hlo-train args` with only `env` of the launch variables set.
fn spawn(args: &[String], env: &[(String, String)]) -> Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hlo-train"));
    c.args(args)
        .env_remove("HLO_TRAIN_PLUGIN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for v in [
        "SLURM_JOB_ID",
        "SLURM_NTASKS",
        "SLURM_NPROCS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
        "HLO_TRAIN_RUN_TOKEN",
    ] {
        c.env_remove(v);
    }
    c.envs(env.iter().map(|(k, v)| (k, v)));
    c.spawn().expect("start hlo-train")
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn vars(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

fn finish(children: Vec<Child>) -> Vec<Output> {
    children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for hlo-train"))
        .collect()
}

/// Each process's `devices --json` says who it is among how many, and
/// lists its own CPU devices: ids 2048·process + i.
fn check_reports(outs: &[Output], devices_each: usize) {
    let n = outs.len();
    for (k, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "process {k}: {}", common::stderr(out));
        let report: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(report["process_index"], k, "{report}");
        assert_eq!(report["num_processes"], n, "{report}");
        assert_eq!(
            report["devices_per_process"],
            serde_json::json!(vec![devices_each; n])
        );
        let ids: Vec<i64> = report["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .map(|d| d["id"].as_i64().expect("an id"))
            .collect();
        let want: Vec<i64> = (0..devices_each as i64)
            .map(|i| 2048 * k as i64 + i)
            .collect();
        assert_eq!(ids, want, "process {k}");
        for d in report["devices"].as_array().unwrap() {
            assert_eq!(d["process_index"], k);
            assert_eq!(d["addressable"], true);
        }
    }
}

/// `devices` as process `k` of `n` meeting at `coordinator`, waiting up
/// to `timeout` seconds for the others.
fn devices_process(k: usize, n: usize, coordinator: &str, timeout: &str) -> Vec<String> {
    strings(&[
        "devices",
        "--num-processes",
        &n.to_string(),
        "--process-id",
        &k.to_string(),
        "--coordinator",
        coordinator,
        "--init-timeout",
        timeout,
    ])
}

#[test]
fn two_and_four_processes_meet_by_flags() {
    for (n, devices) in [(2usize, 1usize), (4, 2)] {
        let coordinator = format!("127.0.0.1:{}", free_port());
        let children: Vec<Child> = (0..n)
            .map(|k| {
                let mut args = devices_process(k, n, &coordinator, "60");
                args.extend(strings(&["--json", "--devices", &devices.to_string()]));
                spawn(&args, &[])
            })
            .collect();
        check_reports(&finish(children), devices);
    }
}

/// `n` processes of `devices --json`, process `k` launched with `env(k)`.
fn meet(n: usize, env: impl Fn(usize) -> Vec<(String, String)>) -> Vec<Output> {
    let args = strings(&["devices", "--json", "--init-timeout", "60"]);
    finish((0..n).map(|k| spawn(&args, &env(k))).collect())
}

#[test]
fn processes_meet_by_slurm_variables() {
    // The port SLURM's job id gives must be free here: pick a job id whose
    // port is.
    let job = (0..4096u32)
        .map(|j| 700_000 + (std::process::id() + j) % 4096)
        .find(|j| TcpListener::bind(("127.0.0.1", 61440 + (j % 4096) as u16)).is_ok())
        .expect("a free port in 61440..65535");
    let n = 2;
    let outs = meet(n, |k| {
        vars(&[
            ("SLURM_JOB_ID", job.to_string()),
            ("SLURM_NTASKS", n.to_string()),
            ("SLURM_PROCID", k.to_string()),
            ("SLURM_LOCALID", k.to_string()),
            ("SLURM_NODEID", "0".into()),
            ("SLURM_STEP_TASKS_PER_NODE", n.to_string()),
            ("SLURM_STEP_NODELIST", "localhost".into()),
        ])
    });
    check_reports(&outs, 1);
}

#[test]
fn processes_meet_by_torchrun_variables() {
    let port = free_port();
    let n = 4;
    let outs = meet(n, |k| {
        vars(&[
            ("WORLD_SIZE", n.to_string()),
            ("RANK", k.to_string()),
            ("LOCAL_RANK", k.to_string()),
            ("LOCAL_WORLD_SIZE", n.to_string()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.to_string()),
        ])
    });
    check_reports(&outs, 1);
}

#[test]
fn a_process_alone_gives_up_within_the_init_timeout_with_one_line() {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let alone = |k: &str| {
        let args = strings(&[
            "devices",
            "--num-processes",
            "2",
            "--process-id",
            k,
            "--coordinator",
            &coordinator,
            "--init-timeout",
            "2",
        ]);
        let t0 = Instant::now();
        let out = finish(vec![spawn(&args, &[])]).remove(0);
        (out, t0.elapsed())
    };
    // Process 0 serves, and process 1 never comes.
    let (out, took) = alone("0");
    let line = one_line_error(&out);
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(10),
        "{took:?}"
    );
    assert!(line.contains("process 0 of 2 (--num-processes)"), "{line}");
    assert!(line.contains("never reached"), "{line}");
    assert!(line.contains(" 1 "), "names the missing process: {line}");
    // Process 1 finds no one serving.
    let (out, took) = alone("1");
    let line = one_line_error(&out);
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(line.contains("process 1 of 2"), "{line}");
    assert!(line.contains(&coordinator), "{line}");
}

#[test]
fn a_peer_that_dies_ends_the_others_with_one_line_naming_it() {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let args = |k: usize| devices_process(k, 3, &coordinator, "60");
    // Processes 0 and 1 wait for process 2, which never comes; process 1
    // dies while they wait.
    let p0 = spawn(&args(0), &[]);
    std::thread::sleep(Duration::from_millis(500));
    let mut p1 = spawn(&args(1), &[]);
    std::thread::sleep(Duration::from_millis(1500));
    let t0 = Instant::now();
    p1.kill().expect("kill process 1");
    let _ = p1.wait();
    let out = finish(vec![p0]).remove(0);
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    let line = one_line_error(&out);
    assert!(line.contains("process 1 left the run"), "{line}");
}

#[test]
fn training_across_processes_on_the_cpu_is_refused_by_every_process() {
    // No rendezvous is needed to refuse: each process says so at once.
    let coordinator = format!("127.0.0.1:{}", free_port());
    let children: Vec<Child> = (0..2)
        .map(|k| {
            let args = strings(&[
                "train",
                "--steps",
                "1",
                "--num-processes",
                "2",
                "--process-id",
                &k.to_string(),
                "--coordinator",
                &coordinator,
            ]);
            spawn(&args, &[])
        })
        .collect();
    for out in finish(children) {
        let line = one_line_error(&out);
        assert!(
            line.contains("train across 2 processes needs collectives between processes, which the CPU plugin does not have"),
            "{line}"
        );
    }
    // So is one launched by SLURM.
    let env = vars(&[
        ("SLURM_JOB_ID", "5".into()),
        ("SLURM_NTASKS", "2".into()),
        ("SLURM_PROCID", "1".into()),
        ("SLURM_STEP_NODELIST", "localhost".into()),
    ]);
    let out = finish(vec![spawn(&strings(&["bench", "--steps", "1"]), &env)]).remove(0);
    assert!(one_line_error(&out).contains("bench across 2 processes"));
    // On a GPU plugin, commands other than train and devices do not run
    // across processes yet: refused before the plugin loads.
    let out = finish(vec![spawn(
        &strings(&[
            "bench",
            "--plugin",
            "cuda",
            "--num-processes",
            "2",
            "--process-id",
            "0",
            "--coordinator",
            &coordinator,
        ]),
        &[],
    )])
    .remove(0);
    assert!(one_line_error(&out).contains("bench across 2 processes is not in this build"));
    // Settings that make no launch are one line too.
    let out = finish(vec![spawn(
        &strings(&["devices", "--num-processes", "2", "--process-id", "0"]),
        &[],
    )])
    .remove(0);
    assert!(one_line_error(&out).contains("needs --coordinator HOST:PORT"));
}

/// Waits (bounded) until something listens on `addr`.
fn until_listening(addr: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(addr).is_err() {
        assert!(Instant::now() < deadline, "process 0 never served {addr}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_stranger_holding_a_process_id_without_the_run_token_does_not_stop_the_run() {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let token = vars(&[("HLO_TRAIN_RUN_TOKEN", "run-35-secret".into())]);
    let args = |k: usize| {
        let mut a = devices_process(k, 2, &coordinator, "30");
        a.push("--json".into());
        a
    };
    let t0 = Instant::now();
    let p0 = spawn(&args(0), &token);
    until_listening(&coordinator);
    // A stranger that speaks the protocol but holds no token claims
    // process 1, and is told it needs one...
    let err = KvClient::connect(&coordinator, 1, 2, Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, KvError::TokenRequired { .. }), "{err}");
    // ...and one that just writes a hello for process 1 and holds its
    // connection open is closed unheard.
    let mut raw = TcpStream::connect(&coordinator).expect("connect");
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = vec![1u8, 0, 0, 0, 1];
    hello.extend_from_slice(&u64::MAX.to_be_bytes());
    hello.extend_from_slice(&0u32.to_be_bytes());
    hello.extend_from_slice(&8u64.to_be_bytes());
    hello.extend_from_slice(b"HKV2");
    hello.extend_from_slice(&2u32.to_be_bytes());
    let _ = raw.write_all(&hello);
    let mut rest = Vec::new();
    let _ = raw.read_to_end(&mut rest);
    // The real process 1 then joins, and both finish normally.
    let p1 = spawn(&args(1), &token);
    let outs = finish(vec![p0, p1]);
    check_reports(&outs, 1);
    assert!(t0.elapsed() < Duration::from_secs(25), "{:?}", t0.elapsed());
    for out in &outs {
        let all = [&out.stdout[..], &out.stderr[..]].concat();
        assert!(
            !String::from_utf8_lossy(&all).contains("run-35-secret"),
            "the run token was printed"
        );
    }
    drop(raw);
}

#[test]
fn process_counts_that_differ_end_both_processes_at_once_naming_both() {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let args = |k: usize, n: usize| devices_process(k, n, &coordinator, "60");
    let t0 = Instant::now();
    let p0 = spawn(&args(0, 2), &[]);
    until_listening(&coordinator);
    let p1 = spawn(&args(1, 3), &[]);
    let outs = finish(vec![p0, p1]);
    // Far within the 60 s either would otherwise wait.
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    for (k, out) in outs.iter().enumerate() {
        let line = one_line_error(out);
        assert!(
            line.contains("process 1 was started for 3 processes but process 0 runs 2"),
            "process {k}: {line}"
        );
    }
}
