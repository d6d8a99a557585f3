//! What the CPU plugin does with several processes, pinned so that a
//! plugin upgrade that changes it is noticed: it numbers a process's
//! devices `2048 · process + i`, and it makes no client spanning processes
//! (so it has no collectives between them, and hlo-train refuses to run a
//! program across processes on it).

use std::sync::Arc;
use std::time::Duration;

use hlo_rendezvous::{KvClient, KvServer};
use hlo_runtime::{Client, ClientOptions, OptionValue, Plugin, PluginSpec};

fn cpu_plugin() -> Plugin {
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    }
    let path = PluginSpec::Cpu
        .resolve()
        .expect("the CPU plugin (make setup)");
    Plugin::load(&path).expect("load the CPU plugin")
}

#[test]
fn a_cpu_process_numbers_its_devices_from_2048_times_its_index() {
    let plugin = cpu_plugin();
    let mut options = ClientOptions::cpu(2);
    options
        .options
        .push(("process_id".into(), OptionValue::Int64(3)));
    let client = Client::new(&plugin, &options).expect("a client for process 3");
    let ids: Vec<i32> = client
        .addressable_devices()
        .unwrap()
        .iter()
        .map(|d| d.id().unwrap())
        .collect();
    assert_eq!(ids, [3 * 2048, 3 * 2048 + 1]);
    // It knows only its own devices: nothing of the other processes.
    assert_eq!(client.devices().unwrap().len(), 2);
}

#[test]
fn the_cpu_plugin_makes_no_client_across_processes() {
    let plugin = cpu_plugin();
    let server = KvServer::start("127.0.0.1:0".parse().unwrap(), 2).unwrap();
    let kv = KvClient::connect(
        &server.local_addr().to_string(),
        0,
        2,
        Duration::from_secs(5),
    )
    .unwrap();
    let mut options = ClientOptions::cpu(1);
    options.options.extend([
        ("node_id".to_string(), OptionValue::Int64(0)),
        ("num_nodes".to_string(), OptionValue::Int64(2)),
    ]);
    let made = Client::with_kv(&plugin, &options, Arc::new(kv));
    // If this starts to succeed, the plugin may have gained collectives
    // between processes: revisit `refuse_cpu_across_processes` in the
    // engine and run a two-process train on the CPU.
    let err = made
        .map(|_| ())
        .expect_err("the CPU plugin now takes num_nodes");
    // It names one of the two (which one varies from run to run).
    let e = err.to_string();
    assert!(e.contains("num_nodes") || e.contains("node_id"), "{e}");
}
