//! Loading a PJRT plugin and calling into its function table.
//!
//! Discipline (see style.md): every call sets `struct_size`, checks that its
//! slot lies inside the plugin's `PJRT_Api.struct_size` and is non-null,
//! carries the plugin's error message verbatim and destroys each `PJRT_Error`
//! once. A loaded plugin is never unloaded: XLA plugins keep worker threads
//! and static state that do not survive `dlclose`, so the library handle is
//! kept for the life of the process (loads are cached by path).

use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, ErrorCode, Result};
use crate::ffi::{self, Args, Slot};

/// The oldest PJRT C API we accept: the oldest plugin the runtime test suite
/// has passed on (`xla-cpu-pjrt` 0.0.1, API 0.81). Our struct layouts are
/// 0.114-era; an older plugin reads the prefix it knows of each larger struct.
pub const MIN_API_VERSION: (i32, i32) = (0, 81);

/// Refuses a plugin whose API is older than [`MIN_API_VERSION`].
fn check_api_version(path: &Path, version: (i32, i32)) -> Result<()> {
    if version < MIN_API_VERSION {
        return Err(Error::PluginTooOld {
            path: path.to_path_buf(),
            major: version.0,
            minor: version.1,
            need_major: MIN_API_VERSION.0,
            need_minor: MIN_API_VERSION.1,
        });
    }
    Ok(())
}

/// A value of a plugin or device attribute (`PJRT_NamedValue`).
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    String(String),
    Int64(i64),
    Int64List(Vec<i64>),
    Float(f32),
    Bool(bool),
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::String(s) => f.write_str(s),
            AttrValue::Int64(v) => write!(f, "{v}"),
            AttrValue::Int64List(v) => write!(f, "{v:?}"),
            AttrValue::Float(v) => write!(f, "{v}"),
            AttrValue::Bool(v) => write!(f, "{v}"),
        }
    }
}

/// The loaded function table; shared by every object made from it.
pub(crate) struct Api {
    raw: *const ffi::PJRT_Api,
    table_size: usize,
    path: PathBuf,
    version: (i32, i32),
}

// SAFETY: the PJRT C API is thread-safe; `raw` points into a library that is
// never unloaded.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

impl Api {
    /// Calls the function in `slot` with `args`, turning a returned
    /// `PJRT_Error` into [`Error::Pjrt`].
    ///
    /// # Safety
    /// `A` must be the argument struct of the function in `slot`, and every
    /// pointer inside `args` must be valid for that call.
    pub(crate) unsafe fn call<A: Args>(&self, slot: Slot, args: &mut A) -> Result<()> {
        let f = self.function(slot)?;
        let f: unsafe extern "C" fn(*mut A) -> *mut ffi::PJRT_Error = std::mem::transmute(f);
        let err = f(args);
        if err.is_null() {
            Ok(())
        } else {
            Err(self.take_error(slot, err))
        }
    }

    /// The non-null function pointer in `slot`, if the table holds it.
    fn function(&self, slot: Slot) -> Result<*const c_void> {
        let missing = || Error::MissingFunction {
            function: slot.name(),
        };
        if slot.offset() + std::mem::size_of::<*const c_void>() > self.table_size {
            return Err(missing());
        }
        // SAFETY: the slot lies inside the table the plugin says it has.
        let f = unsafe { *((self.raw as *const u8).add(slot.offset()) as *const *const c_void) };
        if f.is_null() {
            return Err(missing());
        }
        Ok(f)
    }

    /// Whether the plugin provides the function in `slot`.
    pub(crate) fn has(&self, slot: Slot) -> bool {
        self.function(slot).is_ok()
    }

    /// Destroys a plugin error whose message nobody reads.
    ///
    /// # Safety
    /// `err` must be null or an error the plugin returned, not yet
    /// destroyed.
    pub(crate) unsafe fn drop_error(&self, err: *mut ffi::PJRT_Error) {
        if err.is_null() {
            return;
        }
        if let Ok(f) = self.function(Slot::PJRT_Error_Destroy) {
            let f: unsafe extern "C" fn(*mut ffi::PJRT_Error_Destroy_Args) = std::mem::transmute(f);
            let mut d = ffi::PJRT_Error_Destroy_Args::new();
            d.error = err;
            f(&mut d);
        }
    }

    /// Reads message and code of `err`, then destroys it (exactly once).
    unsafe fn take_error(&self, slot: Slot, err: *mut ffi::PJRT_Error) -> Error {
        let mut msg = ffi::PJRT_Error_Message_Args::new();
        msg.error = err;
        let message = match self.function(Slot::PJRT_Error_Message) {
            Ok(f) => {
                let f: unsafe extern "C" fn(*mut ffi::PJRT_Error_Message_Args) =
                    std::mem::transmute(f);
                f(&mut msg);
                lossy(msg.message.cast(), msg.message_size)
            }
            Err(_) => "(plugin gave no error message)".to_string(),
        };
        let mut code = ffi::PJRT_Error_GetCode_Args::new();
        code.error = err;
        let code = match self.function(Slot::PJRT_Error_GetCode) {
            Ok(f) => {
                let f: unsafe extern "C" fn(
                    *mut ffi::PJRT_Error_GetCode_Args,
                ) -> *mut ffi::PJRT_Error = std::mem::transmute(f);
                // A failure to read the code is itself an error we drop: the
                // message is what matters to the user.
                let e = f(&mut code);
                if e.is_null() {
                    ErrorCode::from_raw(code.code)
                } else {
                    ErrorCode::Unknown
                }
            }
            Err(_) => ErrorCode::Unknown,
        };
        if let Ok(f) = self.function(Slot::PJRT_Error_Destroy) {
            let f: unsafe extern "C" fn(*mut ffi::PJRT_Error_Destroy_Args) = std::mem::transmute(f);
            let mut d = ffi::PJRT_Error_Destroy_Args::new();
            d.error = err;
            f(&mut d);
        }
        Error::Pjrt {
            function: slot.name(),
            code,
            message,
        }
    }

    /// Waits for `event` and destroys it; an event error becomes ours.
    pub(crate) fn await_event(&self, event: *mut ffi::PJRT_Event, what: Slot) -> Result<()> {
        if event.is_null() {
            return Ok(());
        }
        let mut a = ffi::PJRT_Event_Await_Args::new();
        a.event = event;
        // SAFETY: `event` came from the plugin and is destroyed below once.
        let waited = unsafe { self.call(Slot::PJRT_Event_Await, &mut a) };
        let mut d = ffi::PJRT_Event_Destroy_Args::new();
        d.event = event;
        // SAFETY: as above.
        let destroyed = unsafe { self.call(Slot::PJRT_Event_Destroy, &mut d) };
        waited.map_err(|e| match e {
            Error::Pjrt { code, message, .. } => Error::Pjrt {
                function: what.name(),
                code,
                message,
            },
            other => other,
        })?;
        destroyed
    }
}

/// Copies a (pointer, length) string from the plugin, tolerating bad UTF-8.
///
/// # Safety
/// `ptr` must be null or point to `len` readable bytes.
pub(crate) unsafe fn lossy(ptr: *const u8, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    // SAFETY: the caller promises `len` readable bytes at `ptr`.
    let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// Reads an array of `PJRT_NamedValue` into owned pairs.
///
/// # Safety
/// `ptr` must point to `count` valid named values (or be null).
pub(crate) unsafe fn read_named_values(
    ptr: *const ffi::PJRT_NamedValue,
    count: usize,
) -> Vec<(String, AttrValue)> {
    if ptr.is_null() {
        return Vec::new();
    }
    let values = std::slice::from_raw_parts(ptr, count);
    values
        .iter()
        .filter_map(|nv| {
            let name = lossy(nv.name.cast(), nv.name_size);
            let value = match nv.type_ {
                ffi::PJRT_NamedValue_kString => {
                    AttrValue::String(lossy(nv.value.string_value.cast(), nv.value_size))
                }
                ffi::PJRT_NamedValue_kInt64 => AttrValue::Int64(nv.value.int64_value),
                ffi::PJRT_NamedValue_kInt64List => {
                    let p = nv.value.int64_array_value;
                    if p.is_null() {
                        AttrValue::Int64List(Vec::new())
                    } else {
                        AttrValue::Int64List(std::slice::from_raw_parts(p, nv.value_size).to_vec())
                    }
                }
                ffi::PJRT_NamedValue_kFloat => AttrValue::Float(nv.value.float_value),
                ffi::PJRT_NamedValue_kBool => AttrValue::Bool(nv.value.bool_value),
                _ => return None,
            };
            Some((name, value))
        })
        .collect()
}

/// A loaded, initialised PJRT plugin.
///
/// ```no_run
/// let plugin = hlo_runtime::Plugin::load("/path/to/pjrt_cpu_plugin.so")?;
/// println!("PJRT API {}.{}", plugin.api_version().0, plugin.api_version().1);
/// # Ok::<(), hlo_runtime::Error>(())
/// ```
#[derive(Clone)]
pub struct Plugin {
    pub(crate) api: Arc<Api>,
    attributes: Arc<Vec<(String, AttrValue)>>,
}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.api.path)
            .field("api_version", &self.api.version)
            .finish()
    }
}

fn loaded() -> &'static Mutex<HashMap<PathBuf, Plugin>> {
    static LOADED: OnceLock<Mutex<HashMap<PathBuf, Plugin>>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

impl Plugin {
    /// Loads the plugin at `path` (once per process), checks its API version
    /// and initialises it.
    pub fn load(path: impl AsRef<Path>) -> Result<Plugin> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(Error::PluginNotFound {
                path: path.to_path_buf(),
            });
        }
        let key = path.canonicalize()?;
        let mut cache = loaded().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = cache.get(&key) {
            return Ok(p.clone());
        }
        let plugin = Self::load_uncached(&key)?;
        cache.insert(key, plugin.clone());
        Ok(plugin)
    }

    /// Loads `libraries` into the process's global namespace, in order,
    /// then the plugin at `path` ([`Plugin::load`]): the libraries answer
    /// the plugin's own dependencies by their sonames.
    pub fn load_after(path: impl AsRef<Path>, libraries: &[PathBuf]) -> Result<Plugin> {
        for lib in libraries {
            let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
            // SAFETY: the libraries are plain C libraries whose initialisers
            // do nothing; they stay loaded for the process's life.
            let l =
                unsafe { libloading::os::unix::Library::open(Some(lib), flags) }.map_err(|e| {
                    Error::NotAPlugin {
                        path: path.as_ref().to_path_buf(),
                        reason: format!("its dependency {} did not load: {e}", lib.display()),
                    }
                })?;
            std::mem::forget(l);
        }
        Self::load(path)
    }

    fn load_uncached(path: &Path) -> Result<Plugin> {
        let not_a_plugin = |reason: String| Error::NotAPlugin {
            path: path.to_path_buf(),
            reason,
        };
        // RTLD_LOCAL keeps two plugins (CPU and a GPU one) from clashing;
        // RTLD_NOW surfaces missing symbols here rather than mid-run.
        let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL;
        // SAFETY: loading a shared library runs its initialisers; that is the
        // contract of a PJRT plugin.
        let lib = unsafe { libloading::os::unix::Library::open(Some(path), flags) }
            .map_err(|e| not_a_plugin(e.to_string()))?;
        // SAFETY: `GetPjrtApi` has this signature in every PJRT plugin.
        let get_api: ffi::GetPjrtApiFn = unsafe {
            *lib.get::<ffi::GetPjrtApiFn>(b"GetPjrtApi\0")
                .map_err(|_| not_a_plugin("it has no GetPjrtApi symbol".into()))?
        };
        // Never unloaded: see the module docs.
        std::mem::forget(lib);
        // SAFETY: calling the plugin's entry point.
        let raw = unsafe { get_api() };
        if raw.is_null() {
            return Err(not_a_plugin("GetPjrtApi returned null".into()));
        }
        // SAFETY: the head of PJRT_Api is stable across all versions.
        let (table_size, version) = unsafe {
            let head = &*raw;
            (
                head.struct_size,
                (
                    head.pjrt_api_version.major_version,
                    head.pjrt_api_version.minor_version,
                ),
            )
        };
        if table_size < ffi::API_TABLE_OFFSET {
            return Err(not_a_plugin(format!(
                "its PJRT_Api struct_size is {table_size} bytes"
            )));
        }
        check_api_version(path, version)?;
        let api = Arc::new(Api {
            raw,
            table_size,
            path: path.to_path_buf(),
            version,
        });
        let mut init = ffi::PJRT_Plugin_Initialize_Args::new();
        // SAFETY: argument struct matches the slot.
        unsafe { api.call(Slot::PJRT_Plugin_Initialize, &mut init)? };
        let attributes = if api.has(Slot::PJRT_Plugin_Attributes) {
            let mut a = ffi::PJRT_Plugin_Attributes_Args::new();
            // SAFETY: argument struct matches the slot; the values live as
            // long as the plugin and are copied at once.
            unsafe {
                api.call(Slot::PJRT_Plugin_Attributes, &mut a)?;
                read_named_values(a.attributes, a.num_attributes)
            }
        } else {
            Vec::new()
        };
        Ok(Plugin {
            api,
            attributes: Arc::new(attributes),
        })
    }

    /// Path of the loaded library.
    pub fn path(&self) -> &Path {
        &self.api.path
    }

    /// `(major, minor)` of the plugin's PJRT C API.
    pub fn api_version(&self) -> (i32, i32) {
        self.api.version
    }

    /// The plugin's attributes (`xla_version`, `stablehlo_current_version`, ...).
    pub fn attributes(&self) -> &[(String, AttrValue)] {
        &self.attributes
    }

    /// One attribute by name.
    pub fn attribute(&self, name: &str) -> Option<&AttrValue> {
        self.attributes
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_plugins_are_refused_with_both_versions_named() {
        let path = Path::new("/opt/old/pjrt.so");
        assert!(check_api_version(path, (0, 115)).is_ok());
        assert!(check_api_version(path, MIN_API_VERSION).is_ok());
        assert!(check_api_version(path, (1, 0)).is_ok());
        let err = check_api_version(path, (0, 54)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "PJRT plugin /opt/old/pjrt.so has API version 0.54; hlo-train needs 0.81 or newer"
        );
    }
}
