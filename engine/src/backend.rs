//! Where programs run: a PJRT plugin's client and the devices of a mesh,
//! chosen once from the plugin, an optional device count and an optional
//! mesh, by the same rules for every command.

use hlo_partitioner::{Mesh, PartitionSpec, Sharding};
use hlo_runtime::{
    Client, ClientOptions, Device, DeviceArray, HostArray, Plugin, PluginKind, PluginSpec,
};

use crate::error::{EngineError, Result};

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
}

impl BackendOptions {
    /// The CPU plugin with one device.
    pub fn cpu() -> BackendOptions {
        BackendOptions {
            plugin: PluginSpec::Cpu,
            devices: None,
            mesh: None,
        }
    }

    /// The mesh these options give, checked against an explicit device
    /// count: `mesh`, or `dp=1,fsdp=devices,mp=1`.
    ///
    /// ```
    /// use hlo_engine::BackendOptions;
    /// let mut o = BackendOptions::cpu();
    /// o.devices = Some(4);
    /// assert_eq!(o.mesh_or(None).unwrap().to_string(), "dp=1,fsdp=4,mp=1");
    /// o.mesh = Some("dp=1,fsdp=2,mp=1".parse().unwrap());
    /// assert!(o.mesh_or(None).is_err()); // 2 devices, 4 asked for
    /// ```
    pub fn mesh_or(&self, default: Option<&Mesh>) -> Result<Mesh> {
        let mesh = match (&self.mesh, default) {
            (Some(m), _) => m.clone(),
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

/// A client and the mesh's devices (in mesh order).
#[derive(Clone)]
pub struct Backend {
    client: Client,
    mesh: Mesh,
    devices: Vec<Device>,
    kind: PluginKind,
    /// How many devices the plugin offers in all.
    available: usize,
}

impl Backend {
    /// Loads the plugin, creates a client and takes the mesh's devices:
    /// the CPU plugin makes exactly as many virtual devices; a GPU plugin's
    /// first `mesh.size()` devices are used.
    pub fn open(options: &BackendOptions) -> Result<Backend> {
        let mesh = options.mesh_or(None)?;
        Self::open_for(&options.plugin, mesh)
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
        if (all.len() as i64) < mesh.size() {
            return Err(EngineError::TooFewDevices {
                what: format!("the mesh {mesh}"),
                needs: mesh.size(),
                has: all.len(),
                plugin: plugin.to_string(),
            });
        }
        let devices = all[..mesh.size() as usize].to_vec();
        Ok(Backend {
            client,
            mesh,
            devices,
            kind,
            available: all.len(),
        })
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
        }
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

    pub fn plugin_kind(&self) -> PluginKind {
        self.kind
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

    /// `host` on every device of the mesh.
    pub fn replicate(&self, host: &HostArray) -> Result<DeviceArray> {
        self.place(host, &PartitionSpec::replicated())
    }
}
