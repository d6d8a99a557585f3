//! `hlo-train devices`: what the plugin is and which devices it offers.

use anyhow::Result;
use clap::Args;
use serde_json::{json, Value};

use hlo_engine::device::backend::Backend;
use hlo_engine::runtime::{AttrValue, Device};

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
    let devices = client
        .devices()?
        .iter()
        .map(device_json)
        .collect::<Result<Vec<_>>>()?;
    let attributes: serde_json::Map<String, Value> = plugin
        .attributes()
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.to_string())))
        .collect();
    let (process_index, num_processes, per_process) = processes(&backend, devices.len())?;
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
    print_text(&report, plugin.attributes());
    Ok(())
}

/// One device as JSON: id, kind, process, description, whether this
/// process addresses it, and its memory figures when the plugin has them.
fn device_json(d: &Device) -> Result<Value> {
    let memory = d.memory_stats().map(|m| {
        json!({
            "bytes_in_use": m.bytes_in_use,
            "peak_bytes_in_use": m.peak_bytes_in_use,
            "bytes_limit": m.bytes_limit,
        })
    });
    Ok(json!({
        "id": d.id()?,
        "kind": d.kind()?,
        "process_index": d.process_index()?,
        "description": d.to_description_string()?,
        "addressable": d.is_addressable()?,
        "memory": memory,
    }))
}

/// This process's index, the number of processes and each one's device
/// count (`listed` is how many devices the plugin lists). Several
/// processes: each shows its own devices and, gathered through the
/// rendezvous, how many every process has.
fn processes(backend: &Backend, listed: usize) -> Result<(i32, u32, Vec<usize>)> {
    let client = backend.client();
    let Some(group) = backend.group() else {
        return Ok((client.process_index()?, 1, vec![listed]));
    };
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
    Ok((group.process_id() as i32, group.num_processes(), counts))
}

/// The report as text: the plugin, its attributes, the processes and a
/// line per device.
fn print_text(report: &Value, attributes: &[(String, AttrValue)]) {
    let text = |key: &str| report[key].as_str().unwrap_or("").to_string();
    println!("plugin            {}", text("plugin"));
    println!("platform          {}", text("platform"));
    println!("platform version  {}", text("platform_version"));
    println!("PJRT API          {}", text("api_version"));
    for (k, v) in attributes {
        println!("  {k:<26} {v}");
    }
    if report["num_processes"].as_u64().unwrap_or(1) > 1 {
        let per_process: Vec<String> = report["devices_per_process"]
            .as_array()
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .map(Value::to_string)
            .collect();
        println!(
            "process           {} of {} (devices per process: {})",
            report["process_index"],
            report["num_processes"],
            per_process.join(", ")
        );
    }
    let devices = report["devices"].as_array().map_or(&[][..], Vec::as_slice);
    println!("devices           {}", devices.len());
    for d in devices {
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
}
