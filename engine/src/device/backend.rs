//! Where programs run: a PJRT plugin's client and the devices of a mesh,
//! chosen once from the plugin, an optional device count and an optional
//! mesh, by the same rules for every command.

use std::sync::Arc;

use hlo_partitioner::{Mesh, PartitionSpec, Sharding};
use hlo_runtime::{
    Client, ClientOptions, Device, DeviceArray, HostArray, OptionValue, Plugin, PluginKind,
    PluginSpec, XlaOption,
};

use crate::device::processes::{Launch, ProcessGroup};
use crate::error::{EngineError, Result};

/// How every program a command compiles is compiled (`--xla-option`),
/// declared once here. A run records it, and a resumed run takes it back
/// unless given anew (never a difference: a resumed run may work around
/// a compiler bug).
#[derive(clap::Args, Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CompilerSpec {
    /// An XLA compiler flag for every program this command compiles,
    /// KEY=VALUE (repeatable): `xla_cpu_enable_fast_math=false`,
    /// `xla_gpu_enable_triton_gemm=false` (matmuls as cuBLASLt/hipBLASLt
    /// calls, which a deviceless compile makes faster than untuned Triton
    /// ones). The value is a bool (true/false), an integer, a number with
    /// a point, else text, and must be of the flag's type. Per compile, on
    /// top of XLA's defaults (XLA_FLAGS applies to the whole process).
    #[arg(long = "xla-option", id = "xla_option", value_name = "KEY=VALUE",
          value_parser = crate::settings::xla_option)]
    #[serde(rename = "xla-option", with = "crate::settings::xla_options_written")]
    pub xla_options: Vec<(String, XlaOption)>,
}

/// What a run asks of the devices.
#[derive(Clone, Debug)]
pub struct BackendOptions {
    pub plugin: PluginSpec,
    /// The CPU plugin: how many virtual devices to make. A GPU plugin: how
    /// many of its devices to use (the first ones). Must equal the mesh's
    /// size when both are given.
    pub devices: Option<u32>,
    /// The device mesh; default `dp=1,fsdp=N,mp=1` over `devices` (one
    /// device when neither is given).
    pub mesh: Option<Mesh>,
    /// This process's place in a run of several (None: one process).
    pub launch: Option<Launch>,
    /// XLA flags every program of the run is compiled with (`--xla-option`,
    /// sent per compile: `XLA_FLAGS` would be the whole process's).
    pub xla_options: Vec<(String, XlaOption)>,
}

impl BackendOptions {
    /// The CPU plugin with one device.
    pub fn cpu() -> BackendOptions {
        BackendOptions {
            plugin: PluginSpec::Cpu,
            devices: None,
            mesh: None,
            launch: None,
            xla_options: Vec::new(),
        }
    }

    /// The mesh these options give, checked against an explicit device
    /// count: `mesh` (the axes it leaves out of size 1, see
    /// [`full_mesh`]), or `dp=1,fsdp=devices,mp=1`.
    ///
    /// ```
    /// use hlo_engine::device::backend::BackendOptions;
    /// let mut o = BackendOptions::cpu();
    /// o.devices = Some(4);
    /// assert_eq!(o.mesh_or(None).unwrap().to_string(), "dp=1,fsdp=4,mp=1");
    /// o.mesh = Some("dp=2,fsdp=2".parse().unwrap());
    /// assert_eq!(o.mesh_or(None).unwrap().to_string(), "dp=2,fsdp=2,mp=1");
    /// o.mesh = Some("dp=1,fsdp=2,mp=1".parse().unwrap());
    /// assert!(o.mesh_or(None).is_err()); // 2 devices, 4 asked for
    /// ```
    pub fn mesh_or(&self, default: Option<&Mesh>) -> Result<Mesh> {
        let mesh = match (&self.mesh, default) {
            (Some(m), _) => full_mesh(m)?,
            (None, Some(d)) if self.devices.is_none() => d.clone(),
            (None, _) => Mesh::new(&[
                ("dp", 1),
                ("fsdp", i64::from(self.devices.unwrap_or(1))),
                ("mp", 1),
            ])?,
        };
        if let Some(n) = self.devices {
            if mesh.size() != i64::from(n) {
                return Err(EngineError::MeshDevices {
                    mesh: mesh.to_string(),
                    mesh_devices: mesh.size(),
                    devices: n,
                });
            }
        }
        Ok(mesh)
    }
}

/// The axes the partition rules split over; a mesh's axes must be among
/// them (an axis no rule names would only repeat the same work).
pub const MESH_AXES: [&str; 3] = ["dp", "fsdp", "mp"];

/// `mesh` with every axis of [`MESH_AXES`] it leaves out added at size
/// 1 (an axis of one device splits nothing, so the devices keep their
/// places), each where the axes' order puts it; refused when the mesh has
/// an axis no partition rule names ([`check_mesh_axes`]).
///
/// ```
/// use hlo_engine::device::backend::full_mesh;
/// let full = |m: &str| full_mesh(&m.parse().unwrap()).map(|m| m.to_string());
/// assert_eq!(full("dp=2,fsdp=2").unwrap(), "dp=2,fsdp=2,mp=1");
/// assert_eq!(full("fsdp=4").unwrap(), "dp=1,fsdp=4,mp=1");
/// assert_eq!(full("mp=2,dp=2").unwrap(), "mp=2,dp=2,fsdp=1");
/// assert_eq!(full("dp=1,fsdp=2,mp=1").unwrap(), "dp=1,fsdp=2,mp=1");
/// assert!(full("dp=2,xx=2").is_err());
/// ```
pub fn full_mesh(mesh: &Mesh) -> Result<Mesh> {
    check_mesh_axes(mesh)?;
    let rank = |name: &str| MESH_AXES.iter().position(|a| *a == name);
    let mut axes: Vec<(&str, i64)> = mesh.axes().iter().map(|(n, s)| (n.as_str(), *s)).collect();
    for (k, missing) in MESH_AXES.iter().enumerate() {
        if mesh.axis_index(missing).is_some() {
            continue;
        }
        // After the last axis that comes before it, else first.
        let at = axes
            .iter()
            .rposition(|(n, _)| rank(n).is_some_and(|r| r < k))
            .map_or(0, |i| i + 1);
        axes.insert(at, (missing, 1));
    }
    Ok(Mesh::new(&axes)?)
}

/// Refuses a mesh with an axis no partition rule names.
///
/// ```
/// use hlo_engine::device::backend::check_mesh_axes;
/// assert!(check_mesh_axes(&"dp=1,fsdp=2,mp=1".parse().unwrap()).is_ok());
/// assert!(check_mesh_axes(&"dp=1,fsdp=1,mp=1,xx=2".parse().unwrap()).is_err());
/// ```
pub fn check_mesh_axes(mesh: &Mesh) -> Result<()> {
    match mesh
        .axes()
        .iter()
        .find(|(n, _)| !MESH_AXES.contains(&n.as_str()))
    {
        Some((name, _)) => Err(EngineError::MeshAxis {
            mesh: mesh.to_string(),
            axis: name.clone(),
        }),
        None => Ok(()),
    }
}

/// A client and the mesh's devices (in mesh order).
#[derive(Clone)]
pub struct Backend {
    client: Client,
    mesh: Mesh,
    devices: Vec<Device>,
    kind: PluginKind,
    /// How many devices the plugin offers in all.
    available: usize,
    /// The other processes of the run, when there are any.
    group: Option<Arc<ProcessGroup>>,
}

impl Backend {
    /// Loads the plugin, creates a client and takes the mesh's devices:
    /// the CPU plugin makes exactly as many virtual devices; a GPU plugin's
    /// first `mesh.size()` devices are used.
    pub fn open(options: &BackendOptions) -> Result<Backend> {
        let mesh = options.mesh_or(None)?;
        let backend = match &options.launch {
            None => Self::open_for(&options.plugin, mesh),
            Some(launch) => {
                refuse_cpu_across_processes(&options.plugin, launch, "a program")?;
                Self::open_across(&options.plugin, mesh, launch)
            }
        }?;
        Ok(backend.with_xla_options(&options.xla_options))
    }

    /// The same devices, every program compiled with the XLA `options`
    /// too (on top of XLA's defaults; see [`Client::with_xla_options`]).
    pub fn with_xla_options(mut self, options: &[(String, XlaOption)]) -> Backend {
        self.client = self.client.with_xla_options(options);
        self
    }

    /// This process's client and devices, for listing them: a process of
    /// several first meets the others (on any plugin, since nothing runs
    /// across them); the CPU plugin's devices then get the ids
    /// `2048 · process + i`.
    pub fn open_devices(options: &BackendOptions) -> Result<Backend> {
        let Some(launch) = &options.launch else {
            return Self::open(options);
        };
        if options.plugin.kind() != PluginKind::Cpu {
            return Ok(
                Self::open_across(&options.plugin, options.mesh_or(None)?, launch)?
                    .with_xla_options(&options.xla_options),
            );
        }
        let mesh = options.mesh_or(None)?;
        let group = ProcessGroup::join(launch)?;
        let loaded = Plugin::load(&options.plugin.resolve()?)?;
        let mut client_options = ClientOptions::cpu(mesh.size());
        client_options.options.push((
            "process_id".into(),
            OptionValue::Int64(i64::from(launch.process_id)),
        ));
        let client = Client::new(&loaded, &client_options)?;
        let all = client.addressable_devices()?;
        let plugin = format!("{} ({})", options.plugin, launch.describe());
        Ok(
            Self::on_first_devices(client, PluginKind::Cpu, mesh, all, plugin, Some(group))?
                .with_xla_options(&options.xla_options),
        )
    }

    /// A GPU plugin's client as one node of several: it learns the others'
    /// devices through the group's key-value store; the mesh is laid over
    /// all processes' devices, process by process.
    fn open_across(plugin: &PluginSpec, mesh: Mesh, launch: &Launch) -> Result<Backend> {
        let kind = plugin.kind();
        let loaded = Plugin::load(&plugin.resolve()?)?;
        let group = ProcessGroup::join(launch)?;
        let client = Client::with_kv(&loaded, &node_options(launch), group.kv().clone())?;
        // The order compiled programs assign partitions in (runtime's
        // `spmd_options`): the mesh takes the first devices of it.
        let all = client.devices_in_process_order()?;
        let plugin = format!("{plugin} ({})", launch.describe());
        Self::on_first_devices(client, kind, mesh, all, plugin, Some(group))
    }

    /// The client with the first `mesh.size()` of `all`, or how many are
    /// missing.
    fn on_first_devices(
        client: Client,
        kind: PluginKind,
        mesh: Mesh,
        all: Vec<Device>,
        plugin: String,
        group: Option<Arc<ProcessGroup>>,
    ) -> Result<Backend> {
        if (all.len() as i64) < mesh.size() {
            return Err(EngineError::TooFewDevices {
                what: format!("the mesh {mesh}"),
                needs: mesh.size(),
                has: all.len(),
                plugin,
            });
        }
        let devices = all[..mesh.size() as usize].to_vec();
        Ok(Backend {
            client,
            mesh,
            devices,
            kind,
            available: all.len(),
            group,
        })
    }

    /// [`Backend::open`] for a mesh already chosen.
    pub fn open_for(plugin: &PluginSpec, mesh: Mesh) -> Result<Backend> {
        let kind = plugin.kind();
        let path = plugin.resolve()?;
        let loaded = Plugin::load(&path)?;
        let client_options = match kind {
            PluginKind::Cpu => ClientOptions::cpu(mesh.size()),
            _ => ClientOptions::default(),
        };
        let client = Client::new(&loaded, &client_options)?;
        let all = client.addressable_devices()?;
        Self::on_first_devices(client, kind, mesh, all, plugin.to_string(), None)
    }

    /// The same client with only the mesh's first device (a one-device
    /// mesh), for small side programs.
    pub fn first_device(&self) -> Backend {
        Backend {
            client: self.client.clone(),
            mesh: Mesh::single(),
            devices: self.devices[..1].to_vec(),
            kind: self.kind,
            available: self.available,
            group: self.group.clone(),
        }
    }

    /// The run's other processes (None: this is the only one).
    pub fn group(&self) -> Option<&Arc<ProcessGroup>> {
        self.group.as_ref()
    }

    /// Whether this process prints and writes for the run (process 0, or
    /// the only one).
    pub fn is_main(&self) -> bool {
        self.group.as_ref().is_none_or(|g| g.is_main())
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The mesh's devices, in mesh order.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// The platform's name (`cpu`, `cuda`, `rocm`).
    pub fn platform(&self) -> Result<String> {
        Ok(self.client.platform_name()?)
    }

    /// Which devices run, for a run's header: "8 virtual CPU devices", or
    /// "devices 0-3 of 8 (NVIDIA H100)".
    pub fn describe(&self) -> Result<String> {
        let n = self.devices.len();
        let kind = self.devices[0].kind()?;
        if self.kind == PluginKind::Cpu {
            return Ok(match n {
                1 => "1 CPU device".to_string(),
                n => format!("{n} virtual CPU devices"),
            });
        }
        let ids: Vec<i32> = self
            .devices
            .iter()
            .map(|d| d.id())
            .collect::<Result<_, _>>()?;
        let span = match (ids.first(), ids.last()) {
            (Some(a), Some(b)) if n > 1 => format!("devices {a}-{b}"),
            (Some(a), _) => format!("device {a}"),
            _ => "no device".into(),
        };
        Ok(if n < self.available {
            format!("{span} of {} ({kind})", self.available)
        } else {
            format!("{span} ({kind})")
        })
    }

    /// `host` laid out over the mesh by `spec`, each device sent only its
    /// block.
    pub fn place(&self, host: &HostArray, spec: &PartitionSpec) -> Result<DeviceArray> {
        Ok(DeviceArray::shard(
            &self.client,
            host,
            &Sharding::new(self.mesh.clone(), spec.clone()),
            &self.devices,
        )?)
    }

    /// An array of type `ty` laid out over the mesh by `spec`, each block
    /// this process's devices hold from `fill(offset, dims)` (see
    /// [`DeviceArray::from_blocks`]): a restore never holds the whole.
    pub(crate) fn place_blocks(
        &self,
        ty: &hlo_ir::TensorType,
        spec: &PartitionSpec,
        fill: impl FnMut(&[i64], &[i64]) -> Result<HostArray>,
    ) -> Result<DeviceArray> {
        let sharding = Sharding::new(self.mesh.clone(), spec.clone());
        DeviceArray::from_blocks(&self.client, ty, &sharding, &self.devices, fill)
    }

    /// `host` on every device of the mesh.
    pub fn replicate(&self, host: &HostArray) -> Result<DeviceArray> {
        self.place(host, &PartitionSpec::replicated())
    }
}

/// What a GPU plugin is told about its node: `node_id`/`num_nodes`, and
/// `visible_devices` when each process drives one GPU.
///
/// ```
/// use hlo_engine::device::backend::node_options;
/// use hlo_engine::device::processes::{Launch, LaunchSource};
/// let launch = Launch {
///     num_processes: 16, process_id: 9, local_id: Some(1), local_processes: Some(8),
///     coordinator: "node-a:29500".into(), init_timeout: std::time::Duration::from_secs(300),
///     source: LaunchSource::Torchrun, run_token: None,
/// };
/// let opts = node_options(&launch).options;
/// assert_eq!(opts[0], ("node_id".to_string(), hlo_engine::runtime::OptionValue::Int64(9)));
/// assert_eq!(opts[2].1, hlo_engine::runtime::OptionValue::Int64List(vec![1]));
/// ```
pub fn node_options(launch: &Launch) -> ClientOptions {
    let mut options = vec![
        (
            "node_id".to_string(),
            OptionValue::Int64(i64::from(launch.process_id)),
        ),
        (
            "num_nodes".to_string(),
            OptionValue::Int64(i64::from(launch.num_processes)),
        ),
    ];
    if let Some(gpu) = launch.visible_device() {
        options.push((
            "visible_devices".to_string(),
            OptionValue::Int64List(vec![i64::from(gpu)]),
        ));
    }
    ClientOptions { options }
}

/// The CPU plugin has no collectives between processes: a program over
/// several is refused before anyone waits for anyone.
pub fn refuse_cpu_across_processes(
    plugin: &PluginSpec,
    launch: &Launch,
    command: &str,
) -> Result<()> {
    if plugin.kind() == PluginKind::Cpu && launch.num_processes > 1 {
        return Err(EngineError::CpuAcrossProcesses {
            command: command.to_string(),
            num_processes: launch.num_processes,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{record, restore, xla_option};
    use serde_json::json;

    #[test]
    fn xla_options_are_recorded_as_written_and_come_back() {
        let spec = CompilerSpec {
            xla_options: vec![xla_option("xla_cpu_enable_fast_math=false").unwrap()],
        };
        let saved = record(&spec);
        assert_eq!(
            saved["xla-option"],
            json!(["xla_cpu_enable_fast_math=false"])
        );
        let back = restore(&CompilerSpec::default(), &saved, |_| true).unwrap();
        assert_eq!(back, spec);
        let bad = [("xla-option".to_string(), json!(["fast"]))];
        let bad = bad.into_iter().collect();
        let err = restore(&CompilerSpec::default(), &bad, |_| true).unwrap_err();
        assert_eq!(err, "xla-option");
    }
}
