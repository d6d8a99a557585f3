//! The three key-value callbacks of `PJRT_Client_Create` over a
//! [`KvClient`]: how a multi-node GPU plugin exchanges its topology and
//! NCCL/RCCL ids with the other processes of a run.
//!
//! The plugin calls them from its own threads, for as long as the client
//! lives, with `user_arg` pointing at the `KvClient` the client keeps alive.
//! They never unwind into C: a panic is turned into an INTERNAL error.

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use hlo_rendezvous::{KvClient, KvError};

use crate::ffi::{
    PJRT_CallbackError, PJRT_Error, PJRT_KeyValueGetCallback_Args, PJRT_KeyValuePutCallback_Args,
    PJRT_KeyValueTryGetCallback_Args,
};

/// The plugin's keys live under this prefix, apart from ours.
pub(crate) const PJRT_KEY_PREFIX: &str = "pjrt/";

// absl status codes, as `PJRT_Error_Code`.
const DEADLINE_EXCEEDED: u32 = 4;
const NOT_FOUND: u32 = 5;
const ABORTED: u32 = 10;
const INTERNAL: u32 = 13;
const UNAVAILABLE: u32 = 14;

/// Bytes a value's length takes in front of it, so the deleter (which gets
/// only the pointer) can rebuild the allocation.
const LEN_HEADER: usize = std::mem::size_of::<usize>();

fn code_of(e: &KvError) -> u32 {
    match e {
        KvError::Timeout { .. } | KvError::BarrierTimeout { .. } => DEADLINE_EXCEEDED,
        KvError::PeerLost { .. } => ABORTED,
        KvError::CoordinatorLost { .. } | KvError::Unreachable { .. } => UNAVAILABLE,
        _ => INTERNAL,
    }
}

/// Reads the key the plugin passed.
///
/// # Safety
/// `key` points at `size` readable bytes.
unsafe fn key_of(key: *const c_char, size: usize) -> String {
    let bytes = if key.is_null() || size == 0 {
        &[][..]
    } else {
        std::slice::from_raw_parts(key.cast::<u8>(), size)
    };
    format!("{PJRT_KEY_PREFIX}{}", String::from_utf8_lossy(bytes))
}

/// Makes a `PJRT_Error` through the plugin's `callback_error`.
///
/// # Safety
/// `make` is the pointer the plugin put in the callback's args.
unsafe fn error(
    make: *const Option<PJRT_CallbackError>,
    code: u32,
    message: &str,
) -> *mut PJRT_Error {
    match make.as_ref().copied().flatten() {
        Some(f) => f(code, message.as_ptr().cast(), message.len()),
        // Without the plugin's maker there is no way to say what failed;
        // a null error would read as success, so this cannot happen quietly:
        // the plugin always passes it.
        None => std::ptr::null_mut(),
    }
}

/// A copy of `value` the plugin frees with [`free_value`].
fn leak_value(value: &[u8]) -> (*mut c_char, usize) {
    let mut block = Vec::with_capacity(LEN_HEADER + value.len());
    block.extend_from_slice(&value.len().to_ne_bytes());
    block.extend_from_slice(value);
    let block: Box<[u8]> = block.into_boxed_slice();
    let base = Box::into_raw(block).cast::<u8>();
    // SAFETY: the block is LEN_HEADER + len bytes long.
    (unsafe { base.add(LEN_HEADER) }.cast(), value.len())
}

/// The deleter handed to the plugin with each value.
unsafe extern "C" fn free_value(value: *mut c_char) {
    if value.is_null() {
        return;
    }
    let base = value.cast::<u8>().sub(LEN_HEADER);
    let len = usize::from_ne_bytes(std::ptr::read_unaligned(base.cast::<[u8; LEN_HEADER]>()));
    let block = std::ptr::slice_from_raw_parts_mut(base, LEN_HEADER + len);
    drop(Box::from_raw(block));
}

/// Runs `f`, turning a panic into an INTERNAL error.
fn guarded(
    make: *const Option<PJRT_CallbackError>,
    f: impl FnOnce() -> *mut PJRT_Error,
) -> *mut PJRT_Error {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(e) => e,
        // SAFETY: `make` came with the args.
        Err(_) => unsafe { error(make, INTERNAL, "hlo-train's key-value callback panicked") },
    }
}

/// `PJRT_KeyValueGetCallback`: blocks until the key is set, or its timeout.
pub(crate) unsafe extern "C" fn kv_get(
    args: *mut PJRT_KeyValueGetCallback_Args,
) -> *mut PJRT_Error {
    let a = &mut *args;
    guarded(a.callback_error, || {
        let kv = &*(a.user_arg as *const KvClient);
        let key = key_of(a.key, a.key_size);
        // A negative timeout means "as long as it takes"; a day will do.
        let timeout = match a.timeout_in_ms {
            ms if ms < 0 => Duration::from_secs(86_400),
            ms => Duration::from_millis(ms as u64),
        };
        match kv.get(&key, timeout) {
            Ok(v) => {
                (a.value, a.value_size) = leak_value(&v);
                a.value_deleter_callback = Some(free_value);
                std::ptr::null_mut()
            }
            Err(e) => error(a.callback_error, code_of(&e), &e.to_string()),
        }
    })
}

/// `PJRT_KeyValueTryGetCallback`: the value, or NOT_FOUND at once.
pub(crate) unsafe extern "C" fn kv_try_get(
    args: *mut PJRT_KeyValueTryGetCallback_Args,
) -> *mut PJRT_Error {
    let a = &mut *args;
    guarded(a.callback_error, || {
        let kv = &*(a.user_arg as *const KvClient);
        let key = key_of(a.key, a.key_size);
        match kv.try_get(&key) {
            Ok(Some(v)) => {
                (a.value, a.value_size) = leak_value(&v);
                a.value_deleter_callback = Some(free_value);
                std::ptr::null_mut()
            }
            Ok(None) => error(
                a.callback_error,
                NOT_FOUND,
                &format!("key `{key}` is not set"),
            ),
            Err(e) => error(a.callback_error, code_of(&e), &e.to_string()),
        }
    })
}

/// `PJRT_KeyValuePutCallback`: sets the key (the value is copied).
pub(crate) unsafe extern "C" fn kv_put(
    args: *mut PJRT_KeyValuePutCallback_Args,
) -> *mut PJRT_Error {
    let a = &mut *args;
    guarded(a.callback_error, || {
        let kv = &*(a.user_arg as *const KvClient);
        let key = key_of(a.key, a.key_size);
        let value = if a.value.is_null() || a.value_size == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(a.value.cast::<u8>(), a.value_size)
        };
        match kv.set(&key, value) {
            Ok(()) => std::ptr::null_mut(),
            Err(e) => error(a.callback_error, code_of(&e), &e.to_string()),
        }
    })
}

/// The `user_arg` for all three callbacks: the client, borrowed (the PJRT
/// client holds the `Arc` for as long as the plugin may call back).
pub(crate) fn user_arg(kv: &std::sync::Arc<KvClient>) -> *mut c_void {
    std::sync::Arc::as_ptr(kv) as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;
    use hlo_rendezvous::KvServer;
    use std::sync::{Arc, Mutex};

    /// What our stand-in for the plugin's `callback_error` was asked to make.
    static MADE: Mutex<Vec<(u32, String)>> = Mutex::new(Vec::new());

    /// A recognisable non-null "error": the tests only compare pointers.
    unsafe extern "C" fn fake_error(
        code: u32,
        message: *const c_char,
        size: usize,
    ) -> *mut PJRT_Error {
        let m = std::slice::from_raw_parts(message.cast::<u8>(), size);
        MADE.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((code, String::from_utf8_lossy(m).into_owned()));
        std::ptr::dangling_mut::<u8>().cast()
    }

    const MAKE: Option<PJRT_CallbackError> = Some(fake_error);

    fn pair() -> (KvServer, Arc<KvClient>, Arc<KvClient>) {
        let server = KvServer::start("127.0.0.1:0".parse().unwrap(), 2).unwrap();
        let addr = server.local_addr().to_string();
        let a2 = addr.clone();
        let t = std::thread::spawn(move || KvClient::connect(&a2, 1, 2, Duration::from_secs(5)));
        let c0 = KvClient::connect(&addr, 0, 2, Duration::from_secs(5)).unwrap();
        let c1 = t.join().unwrap().unwrap();
        (server, Arc::new(c0), Arc::new(c1))
    }

    fn put(kv: &Arc<KvClient>, key: &str, value: &[u8]) -> *mut PJRT_Error {
        let mut a = PJRT_KeyValuePutCallback_Args {
            struct_size: std::mem::size_of::<PJRT_KeyValuePutCallback_Args>(),
            extension_start: std::ptr::null_mut(),
            key: key.as_ptr().cast(),
            key_size: key.len(),
            value: value.as_ptr().cast(),
            value_size: value.len(),
            callback_error: &MAKE,
            user_arg: user_arg(kv),
        };
        unsafe { kv_put(&mut a) }
    }

    fn get(kv: &Arc<KvClient>, key: &str, timeout_ms: i32) -> Result<Vec<u8>, *mut PJRT_Error> {
        let mut a = PJRT_KeyValueGetCallback_Args {
            struct_size: std::mem::size_of::<PJRT_KeyValueGetCallback_Args>(),
            extension_start: std::ptr::null_mut(),
            key: key.as_ptr().cast(),
            key_size: key.len(),
            timeout_in_ms: timeout_ms,
            callback_error: &MAKE,
            user_arg: user_arg(kv),
            value: std::ptr::null_mut(),
            value_size: 0,
            value_deleter_callback: None,
        };
        let e = unsafe { kv_get(&mut a) };
        if !e.is_null() {
            return Err(e);
        }
        // As the plugin does: copy, then hand the value back to its deleter.
        let v = unsafe { std::slice::from_raw_parts(a.value.cast::<u8>(), a.value_size) }.to_vec();
        unsafe { (a.value_deleter_callback.expect("a deleter"))(a.value) };
        Ok(v)
    }

    fn try_get(kv: &Arc<KvClient>, key: &str) -> Result<Vec<u8>, *mut PJRT_Error> {
        let mut a = PJRT_KeyValueTryGetCallback_Args {
            struct_size: std::mem::size_of::<PJRT_KeyValueTryGetCallback_Args>(),
            extension_start: std::ptr::null_mut(),
            key: key.as_ptr().cast(),
            key_size: key.len(),
            callback_error: &MAKE,
            user_arg: user_arg(kv),
            value: std::ptr::null_mut(),
            value_size: 0,
            value_deleter_callback: None,
        };
        let e = unsafe { kv_try_get(&mut a) };
        if !e.is_null() {
            return Err(e);
        }
        let v = unsafe { std::slice::from_raw_parts(a.value.cast::<u8>(), a.value_size) }.to_vec();
        unsafe { (a.value_deleter_callback.expect("a deleter"))(a.value) };
        Ok(v)
    }

    #[test]
    fn the_callbacks_carry_binary_values_between_processes_and_fail_with_the_right_codes() {
        let (_server, p0, p1) = pair();
        // A topology blob as the plugin would put it: arbitrary bytes.
        let blob: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
        let waiter = {
            let p1 = p1.clone();
            std::thread::spawn(move || get(&p1, "global_topology", 5000).map_err(|e| e as usize))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(put(&p0, "global_topology", &blob).is_null());
        assert_eq!(waiter.join().unwrap().unwrap(), blob);
        assert_eq!(try_get(&p1, "global_topology").unwrap(), blob);
        assert!(put(&p1, "empty", b"").is_null());
        assert_eq!(get(&p0, "empty", 1000).unwrap(), b"");
        // The plugin's keys are kept apart from ours.
        assert_eq!(
            p0.try_get("pjrt/global_topology").unwrap().as_deref(),
            Some(&blob[..])
        );
        assert_eq!(p0.try_get("global_topology").unwrap(), None);

        let t0 = std::time::Instant::now();
        assert!(get(&p0, "never", 200).is_err());
        assert!(t0.elapsed() >= Duration::from_millis(200));
        assert!(try_get(&p0, "never").is_err());
        let made = MADE.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert!(made
            .iter()
            .any(|(c, m)| *c == DEADLINE_EXCEEDED && m.contains("pjrt/never")));
        assert!(made
            .iter()
            .any(|(c, m)| *c == NOT_FOUND && m.contains("pjrt/never")));
    }
}
