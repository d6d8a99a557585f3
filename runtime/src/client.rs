//! The PJRT client and its devices.

use std::ffi::c_char;
use std::fmt;
use std::sync::Arc;

use hlo_rendezvous::KvClient;

use crate::buffer::Buffer;
use crate::compile_options::{CompileOptions, XlaOption};
use crate::error::{Error, Result};
use crate::executable::LoadedExecutable;
use crate::ffi::{self, Args, Slot};
use crate::host::HostArray;
use crate::kv_callbacks;
use crate::plugin::{lossy, read_named_values, Api, AttrValue, Plugin};

/// A value of a client create option.
#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    Int64(i64),
    Bool(bool),
    Float(f32),
    String(String),
    /// `visible_devices` and the like.
    Int64List(Vec<i64>),
}

/// Options passed to `PJRT_Client_Create`.
///
/// ```
/// let opts = hlo_runtime::ClientOptions::cpu(8);
/// assert_eq!(opts.options[0].0, "cpu_device_count");
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClientOptions {
    pub options: Vec<(String, OptionValue)>,
}

impl ClientOptions {
    /// The CPU plugin with `devices` virtual devices.
    pub fn cpu(devices: i64) -> Self {
        ClientOptions {
            options: vec![("cpu_device_count".into(), OptionValue::Int64(devices))],
        }
    }
}

pub(crate) struct ClientInner {
    pub(crate) api: Arc<Api>,
    pub(crate) raw: *mut ffi::PJRT_Client,
    plugin: Plugin,
    /// The key-value store the plugin calls back into; dropped only after
    /// the PJRT client is destroyed (fields drop after `Drop::drop`).
    _kv: Option<Arc<KvClient>>,
}

// SAFETY: PJRT clients are thread-safe.
unsafe impl Send for ClientInner {}
unsafe impl Sync for ClientInner {}

impl ClientInner {
    pub(crate) fn wrap_devices(
        self: &Arc<Self>,
        ptr: *const *mut ffi::PJRT_Device,
        n: usize,
    ) -> Vec<Device> {
        if ptr.is_null() {
            return Vec::new();
        }
        // SAFETY: the plugin gave `n` device pointers at `ptr`.
        let raw = unsafe { std::slice::from_raw_parts(ptr, n) };
        raw.iter()
            .map(|&d| Device {
                raw: d,
                client: self.clone(),
            })
            .collect()
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_Client_Destroy_Args::new();
        a.client = self.raw;
        // SAFETY: destroyed exactly once, after every buffer and executable
        // (they hold an Arc to this).
        // An error while tearing down cannot be acted upon; drop it.
        let _ = unsafe { self.api.call(Slot::PJRT_Client_Destroy, &mut a) };
    }
}

/// A PJRT client: the devices of one plugin, and the door to compile and
/// transfer. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
    /// Executables hold the client alive, so the cache lives beside it, not
    /// in it (no cycle: the last `Client` clone drops the cache, then the
    /// executables, then the PJRT client).
    pub(crate) cache: Arc<crate::jit::CompileCache>,
    /// XLA options every program of this client is compiled with (see
    /// [`Client::with_xla_options`]).
    xla_options: Arc<[(String, XlaOption)]>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("plugin", &self.inner.plugin)
            .finish()
    }
}

impl Client {
    /// Creates a client of `plugin` with create `options`.
    pub fn new(plugin: &Plugin, options: &ClientOptions) -> Result<Client> {
        Self::create(plugin, options, None)
    }

    /// A client of the CPU plugin (where [`crate::PluginSpec::Cpu`] finds
    /// it) with `devices` virtual devices.
    pub fn cpu(devices: i64) -> Result<Client> {
        let plugin = Plugin::load(crate::PluginSpec::Cpu.resolve()?)?;
        Client::new(&plugin, &ClientOptions::cpu(devices))
    }

    /// Creates a client of one process of several: the plugin reaches the
    /// others' through `kv` (its `kv_get`/`kv_try_get`/`kv_put` callbacks,
    /// kept alive as long as the client). `options` carry what the plugin
    /// needs to know (`node_id`/`num_nodes` for the GPU plugins).
    pub fn with_kv(plugin: &Plugin, options: &ClientOptions, kv: Arc<KvClient>) -> Result<Client> {
        Self::create(plugin, options, Some(kv))
    }

    fn create(
        plugin: &Plugin,
        options: &ClientOptions,
        kv: Option<Arc<KvClient>>,
    ) -> Result<Client> {
        let api = plugin.api.clone();
        // The named values point into `options`, which outlives the call.
        let values = named_values(&options.options);
        let mut a = ffi::PJRT_Client_Create_Args::new();
        a.create_options = values.as_ptr();
        a.num_options = values.len();
        if let Some(kv) = &kv {
            let user = kv_callbacks::user_arg(kv);
            a.kv_get_callback = kv_callbacks::kv_get as ffi::PJRT_KeyValueGetCallback as *mut _;
            a.kv_get_user_arg = user;
            a.kv_try_get_callback =
                kv_callbacks::kv_try_get as ffi::PJRT_KeyValueTryGetCallback as *mut _;
            a.kv_try_get_user_arg = user;
            a.kv_put_callback = kv_callbacks::kv_put as ffi::PJRT_KeyValuePutCallback as *mut _;
            a.kv_put_user_arg = user;
        }
        // SAFETY: `values` and the strings it points to live across the call.
        unsafe { api.call(Slot::PJRT_Client_Create, &mut a)? };
        if a.client.is_null() {
            return Err(Error::InvalidArgument(
                "PJRT_Client_Create returned no client".into(),
            ));
        }
        Ok(Client {
            inner: Arc::new(ClientInner {
                api,
                raw: a.client,
                plugin: plugin.clone(),
                _kv: kv,
            }),
            cache: Default::default(),
            xla_options: Arc::new([]),
        })
    }

    /// This client (sharing its devices and compile cache), compiling every
    /// program with the XLA `options` too (a program's own
    /// [`CompileOptions::env_option_overrides`] win for a key both set):
    /// one run's flags reach every compile without each caller passing them.
    pub fn with_xla_options(&self, options: &[(String, XlaOption)]) -> Client {
        Client {
            xla_options: options.into(),
            ..self.clone()
        }
    }

    /// The XLA options every program of this client is compiled with.
    pub fn xla_options(&self) -> &[(String, XlaOption)] {
        &self.xla_options
    }

    /// `options` with this client's XLA options added.
    pub(crate) fn effective_options<'a>(
        &self,
        options: &'a CompileOptions,
    ) -> std::borrow::Cow<'a, CompileOptions> {
        match self.xla_options.is_empty() {
            true => std::borrow::Cow::Borrowed(options),
            false => std::borrow::Cow::Owned(options.with_defaults(&self.xla_options)),
        }
    }

    pub fn plugin(&self) -> &Plugin {
        &self.inner.plugin
    }

    /// `"cpu"`, `"cuda"`, `"rocm"`, ...
    pub fn platform_name(&self) -> Result<String> {
        let mut a = ffi::PJRT_Client_PlatformName_Args::new();
        a.client = self.inner.raw;
        // SAFETY: matching args; the string is owned by the client.
        unsafe {
            self.inner
                .api
                .call(Slot::PJRT_Client_PlatformName, &mut a)?
        };
        // SAFETY: the plugin returned this (pointer, length) pair.
        Ok(unsafe { lossy(a.platform_name.cast(), a.platform_name_size) })
    }

    pub fn platform_version(&self) -> Result<String> {
        let mut a = ffi::PJRT_Client_PlatformVersion_Args::new();
        a.client = self.inner.raw;
        // SAFETY: matching args; the string is owned by the client.
        unsafe {
            self.inner
                .api
                .call(Slot::PJRT_Client_PlatformVersion, &mut a)?
        };
        // SAFETY: the plugin returned this (pointer, length) pair.
        Ok(unsafe { lossy(a.platform_version.cast(), a.platform_version_size) })
    }

    pub fn process_index(&self) -> Result<i32> {
        let mut a = ffi::PJRT_Client_ProcessIndex_Args::new();
        a.client = self.inner.raw;
        // SAFETY: matching args.
        unsafe {
            self.inner
                .api
                .call(Slot::PJRT_Client_ProcessIndex, &mut a)?
        };
        Ok(a.process_index)
    }

    /// Every device of the client (all processes).
    pub fn devices(&self) -> Result<Vec<Device>> {
        let mut a = ffi::PJRT_Client_Devices_Args::new();
        a.client = self.inner.raw;
        // SAFETY: matching args; the array is owned by the client.
        unsafe { self.inner.api.call(Slot::PJRT_Client_Devices, &mut a)? };
        Ok(self.wrap_devices(a.devices, a.num_devices))
    }

    /// The devices this process can put buffers on, in the order the plugin
    /// gives them (the order SPMD programs are assigned in by default).
    pub fn addressable_devices(&self) -> Result<Vec<Device>> {
        let mut a = ffi::PJRT_Client_AddressableDevices_Args::new();
        a.client = self.inner.raw;
        // SAFETY: matching args; the array is owned by the client.
        unsafe {
            self.inner
                .api
                .call(Slot::PJRT_Client_AddressableDevices, &mut a)?
        };
        Ok(self.wrap_devices(a.addressable_devices, a.num_addressable_devices))
    }

    pub(crate) fn wrap_devices(&self, ptr: *const *mut ffi::PJRT_Device, n: usize) -> Vec<Device> {
        self.inner.wrap_devices(ptr, n)
    }

    /// Every device of the run (all processes' for a multi-node client),
    /// process by process, by id within a process: the order meshes are
    /// laid over.
    pub fn devices_in_process_order(&self) -> Result<Vec<Device>> {
        let mut keyed = Vec::new();
        for d in self.devices()? {
            keyed.push(((d.process_index()?, d.id()?), d));
        }
        keyed.sort_by_key(|(k, _)| *k);
        Ok(keyed.into_iter().map(|(_, d)| d).collect())
    }

    /// Whether some of the client's devices belong to other processes.
    pub(crate) fn spans_processes(&self) -> Result<bool> {
        Ok(self.devices()?.len() > self.addressable_devices()?.len())
    }

    /// Compiles StableHLO (MLIR text or bytecode) with `options` (and the
    /// client's XLA options, [`Client::with_xla_options`]).
    pub fn compile(&self, mlir: &str, options: &CompileOptions) -> Result<LoadedExecutable> {
        let options = &*self.effective_options(options);
        // XLA CHECK-fails (kills the process) on some options; refuse
        // them first, however they were made.
        crate::compile_options::check_before_compile(options)?;
        if let Some(ids) = &options.device_assignment {
            // Every process compiles the same assignment over all devices;
            // an id the client does not know would be a CHECK failure.
            let known = self
                .devices()?
                .iter()
                .map(|d| d.id().map(i64::from))
                .collect::<Result<std::collections::BTreeSet<_>>>()?;
            let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
            if ids.len() as i64 != options.num_partitions || distinct.len() != ids.len() {
                return Err(Error::InvalidArgument(format!(
                    "a device assignment needs {} distinct devices, one per partition, got {ids:?}",
                    options.num_partitions
                )));
            }
            if let Some(id) = ids.iter().find(|id| !known.contains(id)) {
                return Err(Error::InvalidArgument(format!(
                    "the device assignment names device {id}, which this client does not have (it has {known:?})"
                )));
            }
        }
        let devices = self.addressable_devices()?;
        if options.device_assignment.is_none() && options.num_partitions as usize > devices.len() {
            return Err(Error::InvalidArgument(format!(
                "the program is partitioned over {} devices but the client has {}",
                options.num_partitions,
                devices.len()
            )));
        }
        let program = ffi::PJRT_Program::mlir(mlir);
        let encoded = options.encode();
        let mut a = ffi::PJRT_Client_Compile_Args::new();
        a.client = self.inner.raw;
        a.program = &program;
        a.compile_options = encoded.as_ptr() as *const c_char;
        a.compile_options_size = encoded.len();
        // SAFETY: program text and options outlive the call.
        unsafe { self.inner.api.call(Slot::PJRT_Client_Compile, &mut a)? };
        LoadedExecutable::wrap(
            self,
            a.executable,
            options.clone(),
            crate::signature::main_parameters(mlir),
        )
    }

    /// Copies `host` to `device`.
    pub fn buffer_from_host(&self, host: &HostArray, device: &Device) -> Result<Buffer> {
        let mut a = ffi::PJRT_Client_BufferFromHostBuffer_Args::new();
        a.client = self.inner.raw;
        a.data = host.bytes().as_ptr().cast();
        a.type_ = crate::buffer::to_pjrt_type(host.dtype());
        a.dims = host.dims().as_ptr();
        a.num_dims = host.dims().len();
        a.host_buffer_semantics = ffi::PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
        a.device = device.raw;
        // SAFETY: the host bytes live across the call; with "immutable only
        // during call" the plugin copies them before returning.
        unsafe {
            self.inner
                .api
                .call(Slot::PJRT_Client_BufferFromHostBuffer, &mut a)?
        };
        let buffer = Buffer::wrap(self.inner.clone(), a.buffer);
        self.inner.api.await_event(
            a.done_with_host_buffer,
            Slot::PJRT_Client_BufferFromHostBuffer,
        )?;
        buffer
    }
}

/// Memory figures a device reports (GPU plugins do; the CPU plugin does not).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemoryStats {
    pub bytes_in_use: i64,
    pub peak_bytes_in_use: Option<i64>,
    pub bytes_limit: Option<i64>,
}

/// A device of a client. Valid as long as the client (it holds it alive).
#[derive(Clone)]
pub struct Device {
    pub(crate) raw: *mut ffi::PJRT_Device,
    client: Arc<ClientInner>,
}

// SAFETY: device handles are immutable and owned by the thread-safe client.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.id() {
            Ok(id) => write!(f, "Device({id})"),
            Err(_) => write!(f, "Device(?)"),
        }
    }
}

macro_rules! description_string {
    ($(#[$m:meta])* $fn:ident, $args:ident, $slot:ident, $ptr:ident, $len:ident) => {
        $(#[$m])*
        pub fn $fn(&self) -> Result<String> {
            let mut a = ffi::$args::new();
            a.device_description = self.description()?;
            // SAFETY: matching args; the string is owned by the description.
            unsafe { self.client.api.call(Slot::$slot, &mut a)? };
            // SAFETY: the plugin returned this (pointer, length) pair.
        Ok(unsafe { lossy(a.$ptr.cast(), a.$len) })
        }
    };
}

impl Device {
    fn description(&self) -> Result<*mut ffi::PJRT_DeviceDescription> {
        let mut a = ffi::PJRT_Device_GetDescription_Args::new();
        a.device = self.raw;
        // SAFETY: matching args; the description is owned by the device.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_Device_GetDescription, &mut a)?
        };
        Ok(a.device_description)
    }

    /// The global device id.
    pub fn id(&self) -> Result<i32> {
        let mut a = ffi::PJRT_DeviceDescription_Id_Args::new();
        a.device_description = self.description()?;
        // SAFETY: matching args.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_DeviceDescription_Id, &mut a)?
        };
        Ok(a.id)
    }

    pub fn process_index(&self) -> Result<i32> {
        let mut a = ffi::PJRT_DeviceDescription_ProcessIndex_Args::new();
        a.device_description = self.description()?;
        // SAFETY: matching args.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_DeviceDescription_ProcessIndex, &mut a)?
        };
        Ok(a.process_index)
    }

    description_string!(
        /// The device kind (`"cpu"`, `"NVIDIA H100 80GB HBM3"`, ...).
        kind, PJRT_DeviceDescription_Kind_Args, PJRT_DeviceDescription_Kind,
        device_kind, device_kind_size
    );
    description_string!(
        /// A short description (`"CpuDevice(id=0)"`).
        to_description_string, PJRT_DeviceDescription_ToString_Args,
        PJRT_DeviceDescription_ToString, to_string, to_string_size
    );
    description_string!(
        /// A longer description for logs.
        debug_string, PJRT_DeviceDescription_DebugString_Args,
        PJRT_DeviceDescription_DebugString, debug_string, debug_string_size
    );

    /// Attributes the plugin reports for this device (compute capability, ...).
    pub fn attributes(&self) -> Result<Vec<(String, AttrValue)>> {
        let mut a = ffi::PJRT_DeviceDescription_Attributes_Args::new();
        a.device_description = self.description()?;
        // SAFETY: matching args; the values are copied at once.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_DeviceDescription_Attributes, &mut a)?;
            Ok(read_named_values(a.attributes, a.num_attributes))
        }
    }

    pub fn is_addressable(&self) -> Result<bool> {
        let mut a = ffi::PJRT_Device_IsAddressable_Args::new();
        a.device = self.raw;
        // SAFETY: matching args.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_Device_IsAddressable, &mut a)?
        };
        Ok(a.is_addressable)
    }

    /// Memory in use and its limit, if the plugin reports them (`None` when
    /// it does not implement the call, as the CPU plugin does not).
    pub fn memory_stats(&self) -> Option<DeviceMemoryStats> {
        if !self.client.api.has(Slot::PJRT_Device_MemoryStats) {
            return None;
        }
        let mut a = ffi::PJRT_Device_MemoryStats_Args::new();
        a.device = self.raw;
        // SAFETY: matching args.
        unsafe { self.client.api.call(Slot::PJRT_Device_MemoryStats, &mut a) }.ok()?;
        Some(DeviceMemoryStats {
            bytes_in_use: a.bytes_in_use,
            peak_bytes_in_use: a.peak_bytes_in_use_is_set.then_some(a.peak_bytes_in_use),
            bytes_limit: a.bytes_limit_is_set.then_some(a.bytes_limit),
        })
    }
}

/// `options` as PJRT named values, pointing into `options` (which must
/// outlive their use).
pub(crate) fn named_values(options: &[(String, OptionValue)]) -> Vec<ffi::PJRT_NamedValue> {
    options
        .iter()
        .map(|(name, v)| {
            let (type_, value, value_size) = match v {
                OptionValue::Int64(i) => (
                    ffi::PJRT_NamedValue_kInt64,
                    ffi::PJRT_NamedValue_Value { int64_value: *i },
                    1,
                ),
                OptionValue::Bool(b) => (
                    ffi::PJRT_NamedValue_kBool,
                    ffi::PJRT_NamedValue_Value { bool_value: *b },
                    1,
                ),
                OptionValue::Float(x) => (
                    ffi::PJRT_NamedValue_kFloat,
                    ffi::PJRT_NamedValue_Value { float_value: *x },
                    1,
                ),
                OptionValue::String(s) => (
                    ffi::PJRT_NamedValue_kString,
                    ffi::PJRT_NamedValue_Value {
                        string_value: s.as_ptr() as *const c_char,
                    },
                    s.len(),
                ),
                OptionValue::Int64List(v) => (
                    ffi::PJRT_NamedValue_kInt64List,
                    ffi::PJRT_NamedValue_Value {
                        int64_array_value: v.as_ptr(),
                    },
                    v.len(),
                ),
            };
            ffi::PJRT_NamedValue {
                struct_size: std::mem::size_of::<ffi::PJRT_NamedValue>(),
                extension_start: std::ptr::null_mut(),
                name: name.as_ptr() as *const c_char,
                name_size: name.len(),
                type_,
                value,
                value_size,
            }
        })
        .collect()
}
