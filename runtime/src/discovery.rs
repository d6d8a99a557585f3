//! Finding a plugin from what the user wrote: `cpu`, `cuda`, `rocm` or a path.
//!
//! - `cpu`: the pinned CPU plugin that `make setup` installs at
//!   `.plugins/cpu/pjrt_cpu_plugin.so` in the project folder. The folder is
//!   looked for under `$HLO_TRAIN_HOME`, then upwards from the running
//!   executable and from the current directory, then the source tree this
//!   binary was built from.
//! - `cuda` / `rocm`: the plugin of an installed JAX plugin package
//!   (`jax_plugins/xla_cuda13`, `xla_cuda12`, `xla_rocm7`, ...) in the
//!   site-packages that `python3` (or `$HLO_TRAIN_PYTHON`) reports. Newer
//!   major versions win.
//! - anything else is a path to a plugin `.so`.
//!
//! Platform quirks are made explicit here rather than left to the
//! environment: see [`PluginKind::notes`].

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Where the CPU plugin lives inside the project folder.
pub const CPU_PLUGIN_RELATIVE: &str = ".plugins/cpu/pjrt_cpu_plugin.so";

/// Which plugin the user asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginSpec {
    Cpu,
    Cuda,
    Rocm,
    Path(PathBuf),
}

/// The platform family of a plugin spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginKind {
    Cpu,
    Cuda,
    Rocm,
}

impl PluginKind {
    /// What a user must know about loading this kind of plugin.
    pub fn notes(self) -> &'static str {
        match self {
            PluginKind::Cpu => "virtual devices come from the `cpu_device_count` create option",
            PluginKind::Cuda => {
                "compiling needs ptxas and libdevice: XLA looks beside the plugin (cuda/bin, \
                 cuda/nvvm/libdevice) and in the CUDA wheels; set XLA_FLAGS=--xla_gpu_cuda_data_dir=DIR \
                 if they are elsewhere"
            }
            PluginKind::Rocm => "load from the main thread; ROCm initialises per-thread state",
        }
    }
}

impl FromStr for PluginSpec {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Ok(match s {
            "cpu" => PluginSpec::Cpu,
            "cuda" => PluginSpec::Cuda,
            "rocm" => PluginSpec::Rocm,
            path => PluginSpec::Path(PathBuf::from(path)),
        })
    }
}

impl fmt::Display for PluginSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginSpec::Cpu => f.write_str("cpu"),
            PluginSpec::Cuda => f.write_str("cuda"),
            PluginSpec::Rocm => f.write_str("rocm"),
            PluginSpec::Path(p) => write!(f, "{}", p.display()),
        }
    }
}

impl PluginSpec {
    /// The platform family, guessed from the file name for a path.
    pub fn kind(&self) -> PluginKind {
        match self {
            PluginSpec::Cpu => PluginKind::Cpu,
            PluginSpec::Cuda => PluginKind::Cuda,
            PluginSpec::Rocm => PluginKind::Rocm,
            PluginSpec::Path(p) => {
                let name = p.to_string_lossy().to_ascii_lowercase();
                if name.contains("cuda") {
                    PluginKind::Cuda
                } else if name.contains("rocm") {
                    PluginKind::Rocm
                } else {
                    PluginKind::Cpu
                }
            }
        }
    }

    /// The plugin file this spec names.
    pub fn resolve(&self) -> Result<PathBuf> {
        match self {
            PluginSpec::Path(p) => {
                if p.is_file() {
                    Ok(p.clone())
                } else {
                    Err(Error::PluginNotFound { path: p.clone() })
                }
            }
            PluginSpec::Cpu => find_cpu_plugin(),
            PluginSpec::Cuda => find_jax_plugin(&python_site_dirs()?, "cuda").ok_or_else(|| {
                Error::PluginDiscovery(
                    "no CUDA PJRT plugin found in python3's site-packages \
                     (looked for jax_plugins/xla_cuda*/); install one with \
                     `pip install jax[cuda13]` or pass --plugin PATH"
                        .into(),
                )
            }),
            PluginSpec::Rocm => find_jax_plugin(&python_site_dirs()?, "rocm").ok_or_else(|| {
                Error::PluginDiscovery(
                    "no ROCm PJRT plugin found in python3's site-packages \
                     (looked for jax_plugins/xla_rocm*/); install one with \
                     `pip install jax-rocm7-pjrt` or pass --plugin PATH"
                        .into(),
                )
            }),
        }
    }
}

/// Where `make setup-targets` installs XLA's GPU compilers (the official
/// CUDA and ROCm plugins), inside the project folder.
pub const CUDA_COMPILER_RELATIVE: &str = ".plugins/cuda/xla_cuda_plugin.so";
pub const ROCM_COMPILER_RELATIVE: &str = ".plugins/rocm/xla_rocm_plugin.so";

/// An installed GPU compiler: the plugin and the libraries to load before
/// it (ROCm's stand-ins for the runtime libraries it links against, which
/// compiling never calls; none for CUDA).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompilerInstall {
    pub plugin: PathBuf,
    pub preload: Vec<PathBuf>,
}

/// The GPU compiler for `kind` (CUDA or ROCm) that `make setup-targets`
/// installed, or what to run to install it.
pub fn find_target_compiler(kind: PluginKind) -> Result<CompilerInstall> {
    let relative = match kind {
        PluginKind::Cuda => CUDA_COMPILER_RELATIVE,
        PluginKind::Rocm => ROCM_COMPILER_RELATIVE,
        PluginKind::Cpu => {
            return Err(Error::PluginDiscovery(
                "the CPU plugin compiles for the CPU only; targets are CUDA or ROCm GPUs".into(),
            ))
        }
    };
    // `$HLO_TRAIN_COMPILERS` names the one folder holding `cuda/` and
    // `rocm/` (compilers kept elsewhere); else the project folder's
    // `.plugins/`.
    let plugin = match std::env::var_os("HLO_TRAIN_COMPILERS") {
        Some(dir) => {
            let under = Path::new(relative)
                .strip_prefix(".plugins")
                .unwrap_or(Path::new(relative));
            vec![PathBuf::from(dir).join(under)]
        }
        None => project_roots()
            .into_iter()
            .map(|r| r.join(relative))
            .collect(),
    }
    .into_iter()
    .find(|p| p.is_file())
    .ok_or_else(|| {
        Error::PluginDiscovery(format!(
            "XLA's {kind:?} compiler is not installed ({relative} not found in the project \
             folder or $HLO_TRAIN_COMPILERS); run `make setup-targets`"
        ))
    })?;
    let stubs = plugin.with_file_name("stubs");
    let order = stubs.join("LOAD_ORDER");
    let preload = match kind {
        PluginKind::Rocm => {
            let text = std::fs::read_to_string(&order).map_err(|e| {
                Error::PluginDiscovery(format!(
                    "the ROCm compiler's stand-in libraries are missing ({}: {e}); run \
                     `make setup-targets`",
                    order.display()
                ))
            })?;
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(|l| stubs.join(l))
                .collect()
        }
        _ => Vec::new(),
    };
    if let Some(missing) = preload.iter().find(|p| !p.is_file()) {
        return Err(Error::PluginDiscovery(format!(
            "{} is missing; run `make setup-targets`",
            missing.display()
        )));
    }
    Ok(CompilerInstall { plugin, preload })
}

/// Folders that may hold `.plugins/`, most specific first.
fn project_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Some(home) = std::env::var_os("HLO_TRAIN_HOME") {
        roots.push(PathBuf::from(home));
    }
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).map(Path::to_path_buf));
    }
    if let Ok(cwd) = std::env::current_dir() {
        roots.extend(cwd.ancestors().map(Path::to_path_buf));
    }
    // The workspace this crate was built in (runtime/..).
    roots.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/..")));
    roots
}

fn find_cpu_plugin() -> Result<PathBuf> {
    project_roots()
        .into_iter()
        .map(|root| root.join(CPU_PLUGIN_RELATIVE))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            Error::PluginDiscovery(format!(
                "the CPU PJRT plugin is not installed ({CPU_PLUGIN_RELATIVE} not found \
                 in the project folder); run `make setup`, set HLO_TRAIN_HOME to the \
                 project folder, or pass --plugin PATH"
            ))
        })
}

/// The site-packages folders of `python3` (or `$HLO_TRAIN_PYTHON`).
fn python_site_dirs() -> Result<Vec<PathBuf>> {
    let python = std::env::var("HLO_TRAIN_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = "import site, sys\n\
                  dirs = list(site.getsitepackages()) + [site.getusersitepackages()] + sys.path\n\
                  print('\\n'.join(d for d in dirs if d))";
    let out = Command::new(&python)
        .args(["-c", script])
        .output()
        .map_err(|e| {
            Error::PluginDiscovery(format!(
                "cannot run `{python}` to find JAX plugin packages: {e}; pass --plugin PATH"
            ))
        })?;
    if !out.status.success() {
        return Err(Error::PluginDiscovery(format!(
            "`{python}` failed while listing site-packages: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .collect())
}

/// The newest `jax_plugins/xla_{platform}N/*.so` under `site_dirs`.
pub fn find_jax_plugin(site_dirs: &[PathBuf], platform: &str) -> Option<PathBuf> {
    let prefix = format!("xla_{platform}");
    let mut found: Vec<(u32, PathBuf)> = Vec::new();
    for dir in site_dirs {
        let Ok(entries) = std::fs::read_dir(dir.join("jax_plugins")) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            let major: u32 = rest.parse().unwrap_or(0);
            let Ok(files) = std::fs::read_dir(entry.path()) else {
                continue;
            };
            let mut sos: Vec<PathBuf> = files
                .flatten()
                .map(|f| f.path())
                .filter(|p| p.extension().is_some_and(|e| e == "so"))
                .collect();
            sos.sort();
            if let Some(so) = sos.into_iter().next() {
                found.push((major, so));
            }
        }
    }
    found.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    found.into_iter().next().map(|(_, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_and_paths() {
        assert_eq!("cpu".parse::<PluginSpec>().unwrap(), PluginSpec::Cpu);
        assert_eq!("cuda".parse::<PluginSpec>().unwrap(), PluginSpec::Cuda);
        assert_eq!("rocm".parse::<PluginSpec>().unwrap(), PluginSpec::Rocm);
        assert_eq!(
            "/x/y.so".parse::<PluginSpec>().unwrap(),
            PluginSpec::Path("/x/y.so".into())
        );
        assert_eq!(
            PluginSpec::Path("/a/jax_plugins/xla_rocm7/xla_rocm_plugin.so".into()).kind(),
            PluginKind::Rocm
        );
    }

    #[test]
    fn finds_newest_jax_plugin_package() {
        let tmp = std::env::temp_dir().join(format!("hlo-discovery-{}", std::process::id()));
        let site_a = tmp.join("a");
        let site_b = tmp.join("b");
        for (site, pkg, so) in [
            (&site_a, "xla_cuda12", "xla_cuda_plugin.so"),
            (&site_b, "xla_cuda13", "xla_cuda_plugin.so"),
            (&site_a, "xla_rocm7", "xla_rocm_plugin.so"),
        ] {
            let d = site.join("jax_plugins").join(pkg);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(so), b"").unwrap();
            std::fs::write(d.join("__init__.py"), b"").unwrap();
        }
        let sites = vec![site_a.clone(), site_b.clone(), tmp.join("missing")];
        assert_eq!(
            find_jax_plugin(&sites, "cuda"),
            Some(site_b.join("jax_plugins/xla_cuda13/xla_cuda_plugin.so"))
        );
        assert_eq!(
            find_jax_plugin(&sites, "rocm"),
            Some(site_a.join("jax_plugins/xla_rocm7/xla_rocm_plugin.so"))
        );
        assert_eq!(find_jax_plugin(&sites[2..], "rocm"), None);
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn missing_path_is_a_clear_error() {
        let err = PluginSpec::Path("/nonexistent/plugin.so".into())
            .resolve()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "PJRT plugin not found at /nonexistent/plugin.so"
        );
    }
}
