//! Flags shared by every command, and the plugin/client they select.

use anyhow::{bail, Context, Result};
use clap::Args;
use hlo_partitioner::Mesh;
use hlo_runtime::{Client, ClientOptions, Device, Plugin, PluginKind, PluginSpec};

/// `--plugin` and `--devices`.
#[derive(Args, Clone, Debug)]
pub struct PluginArgs {
    /// PJRT plugin: cpu, cuda, rocm, or a path to a plugin .so.
    #[arg(long, env = "HLO_TRAIN_PLUGIN", default_value = "cpu")]
    pub plugin: PluginSpec,

    /// Number of virtual devices of the CPU plugin.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub devices: Option<u32>,
}

impl PluginArgs {
    /// A client with devices for `mesh` (the CPU plugin makes as many
    /// virtual devices unless `--devices` says otherwise), and the mesh's
    /// devices.
    pub fn client_for(&self, mesh: &Mesh) -> Result<(Client, Vec<Device>)> {
        let mut plugin = self.clone();
        if plugin.plugin.kind() == PluginKind::Cpu && plugin.devices.is_none() {
            plugin.devices = Some(mesh.size() as u32);
        }
        let client = plugin.client()?;
        let devices = mesh_devices(&client, mesh)?;
        Ok((client, devices))
    }

    /// Loads the plugin and creates a client with the requested devices.
    pub fn client(&self) -> Result<Client> {
        let path = self.plugin.resolve()?;
        let plugin = Plugin::load(&path)?;
        let kind = self.plugin.kind();
        let options = match (kind, self.devices) {
            (PluginKind::Cpu, n) => ClientOptions::cpu(i64::from(n.unwrap_or(1))),
            (_, None) => ClientOptions::default(),
            (_, Some(_)) => bail!(
                "--devices sets the number of virtual CPU devices; the {} plugin uses its real devices",
                self.plugin
            ),
        };
        Client::new(&plugin, &options)
            .with_context(|| format!("cannot create a client of {}", path.display()))
    }
}

/// The first `mesh.size()` devices of `client`, or an error when it has
/// fewer.
pub fn mesh_devices(client: &Client, mesh: &Mesh) -> Result<Vec<Device>> {
    let all = client.addressable_devices()?;
    if (all.len() as i64) < mesh.size() {
        bail!(
            "the mesh {mesh} needs {} devices but the plugin has {}",
            mesh.size(),
            all.len()
        );
    }
    Ok(all[..mesh.size() as usize].to_vec())
}
