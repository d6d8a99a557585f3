//! `hlo-runtime` owns everything between us and a PJRT plugin: our own
//! `#[repr(C)]` bindings of the PJRT C API (no bindgen, no C++), plugin
//! discovery and loading, clients and devices, host ↔ device transfers,
//! compile options, compilation of StableHLO text with a bounded compile
//! cache, arrays sharded over a mesh, and [`Program`]: a traced function
//! run SPMD over the mesh's devices as one executable (JIT) or op by op
//! (eager), behind one `run`. For runs over several processes it owns the
//! PJRT key-value callbacks through which a multi-node plugin reaches the
//! other processes ([`Client::with_kv`], over an
//! [`hlo_rendezvous::KvClient`]).
//!
//! It does not know what a model is, nor how a step is traced, laid out or
//! driven (`hlo-models`, `hlo-engine`): it lowers a given function with
//! given shardings (through `hlo-lowering`), compiles it and runs it on
//! device arrays. It serves nothing over the network and parses no launch:
//! the key-value service and who a process is belong to `hlo-rendezvous`.
//!
//! ```no_run
//! use hlo_runtime::{Client, ClientOptions, CompileOptions, HostArray, Plugin, PluginSpec};
//! let plugin = Plugin::load(PluginSpec::Cpu.resolve()?)?;
//! let client = Client::new(&plugin, &ClientOptions::cpu(1))?;
//! let exe = client.compile(
//!     r#"func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> {
//!          %0 = "stablehlo.add"(%a, %a) : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>
//!          func.return %0 : tensor<2xf32>
//!        }"#,
//!     &CompileOptions::default(),
//! )?;
//! let device = &exe.devices()[0];
//! let x = client.buffer_from_host(&HostArray::new(&[2], &[1.0f32, 2.0])?, device)?;
//! let out = exe.execute(&[vec![&x]])?;
//! assert_eq!(out[0][0].to_host()?.to_vec::<f32>()?, vec![2.0, 4.0]);
//! # Ok::<(), hlo_runtime::Error>(())
//! ```

mod buffer;
mod client;
mod compile_options;
mod discovery;
mod eager;
mod error;
mod executable;
mod ffi;
mod host;
mod jit;
mod kv_callbacks;
mod lru;
mod plugin;
mod program;
mod sharded;
mod signature;
mod topology;

pub use buffer::{Buffer, ReadyTime};
pub use client::{Client, ClientOptions, Device, DeviceMemoryStats, OptionValue};
pub use compile_options::{
    check_xla_key, check_xla_value, parse_xla_option, CompileOptions, XlaOption, XlaOptionError,
};
pub use discovery::{
    find_jax_plugin, find_target_compiler, CompilerInstall, PluginKind, PluginSpec,
    CPU_PLUGIN_RELATIVE, CUDA_COMPILER_RELATIVE, ROCM_COMPILER_RELATIVE,
};
pub use eager::{Eager, EagerStats, Observer, EAGER_CACHE_CAPACITY};
pub use error::{Error, ErrorCode, Result};
pub use executable::{CompiledMemoryStats, LoadedExecutable};
pub use host::{element_count, Element, HostArray};
pub use jit::{program_fingerprint, CompiledFunction, Jit, COMPILE_CACHE_CAPACITY};
pub use lru::Lru;
pub use plugin::{AttrValue, Plugin, MIN_API_VERSION};
pub use program::{Mode, Program};
pub use sharded::{blocks_to_write, copy_overlap, rows_held, DeviceArray, ShardedFunction};
pub use signature::{main_parameters, ParamType};
pub use topology::{CompiledForTarget, Topology};
