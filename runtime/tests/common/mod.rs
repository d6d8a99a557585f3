//! What the runtime's test binaries share.

use hlo_runtime::Client;

/// A client of the CPU plugin with `devices` virtual devices, XLA's INFO
/// logs kept out of the test output.
pub fn cpu_client(devices: i64) -> Client {
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    }
    Client::cpu(devices).expect("a CPU client (the plugin is installed by `make setup`)")
}
