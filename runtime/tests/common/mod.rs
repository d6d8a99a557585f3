//! What the runtime's test binaries share.

use hlo_runtime::{Client, ClientOptions, Plugin, PluginSpec};

/// A client of the CPU plugin with `devices` virtual devices, XLA's INFO
/// logs kept out of the test output.
pub fn cpu_client(devices: i64) -> Client {
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    }
    let path = PluginSpec::Cpu
        .resolve()
        .expect("the CPU plugin is missing: run `make setup`");
    let plugin = Plugin::load(path).expect("load the CPU plugin");
    Client::new(&plugin, &ClientOptions::cpu(devices)).expect("create a CPU client")
}
