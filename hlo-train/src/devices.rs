//! `hlo-train devices`: what the plugin is and which devices it offers.

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};

use hlo_engine::Backend;

use crate::args::PluginArgs;

#[derive(Args, Debug)]
pub struct DevicesArgs {
    #[command(flatten)]
    pub plugin: PluginArgs,

    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: &DevicesArgs) -> Result<()> {
    let backend = Backend::open_devices(&args.plugin.backend(None))?;
    let client = backend.client();
    let plugin = client.plugin();
    let (major, minor) = plugin.api_version();
    let mut devices = Vec::new();
    for d in client.devices()? {
        let memory = d.memory_stats().map(|m| {
            json!({
                "bytes_in_use": m.bytes_in_use,
                "peak_bytes_in_use": m.peak_bytes_in_use,
                "bytes_limit": m.bytes_limit,
            })
        });
        devices.push(json!({
            "id": d.id()?,
            "kind": d.kind()?,
            "process_index": d.process_index()?,
            "description": d.to_description_string()?,
            "addressable": d.is_addressable()?,
            "memory": memory,
        }));
    }
    let attributes: serde_json::Map<String, Value> = plugin
        .attributes()
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.to_string())))
        .collect();
    // Several processes: each shows its own devices and, gathered through
    // the rendezvous, how many every process has.
    let (process_index, num_processes, per_process) = match backend.group() {
        None => (client.process_index()?, 1, vec![devices.len()]),
        Some(group) => {
            // A GPU plugin lists every process's devices; count our own.
            let mine = (client.addressable_devices()?.len() as u64).to_le_bytes();
            let all = group.all_gather("devices", &mine)?;
            let counts = all
                .iter()
                .map(|v| match <[u8; 8]>::try_from(v.as_slice()) {
                    Ok(b) => Ok(u64::from_le_bytes(b) as usize),
                    Err(_) => Err(anyhow::anyhow!(
                        "a process sent a device count of {} bytes",
                        v.len()
                    )),
                })
                .collect::<Result<Vec<_>>>()?;
            // Process 0 serves the rendezvous until every process is done.
            group.finish()?;
            (group.process_id() as i32, group.num_processes(), counts)
        }
    };
    let report = json!({
        "plugin": plugin.path().display().to_string(),
        "platform": client.platform_name()?,
        "platform_version": client.platform_version()?,
        "api_version": format!("{major}.{minor}"),
        "attributes": attributes,
        "process_index": process_index,
        "num_processes": num_processes,
        "devices_per_process": per_process,
        "devices": devices,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "plugin            {}",
        report["plugin"].as_str().unwrap_or("")
    );
    println!(
        "platform          {}",
        report["platform"].as_str().unwrap_or("")
    );
    println!(
        "platform version  {}",
        report["platform_version"].as_str().unwrap_or("")
    );
    println!("PJRT API          {major}.{minor}");
    for (k, v) in plugin.attributes() {
        println!("  {k:<26} {v}");
    }
    if num_processes > 1 {
        println!(
            "process           {process_index} of {num_processes} (devices per process: {})",
            per_process
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    println!("devices           {}", devices.len());
    for d in &devices {
        let memory = match d["memory"].get("bytes_limit").and_then(Value::as_i64) {
            Some(limit) => format!("  {:.1} GiB", limit as f64 / (1u64 << 30) as f64),
            None => String::new(),
        };
        println!(
            "  {:>3}  {}  process {}  {}{memory}",
            d["id"],
            d["kind"].as_str().unwrap_or(""),
            d["process_index"],
            d["description"].as_str().unwrap_or("")
        );
    }
    Ok(())
}
