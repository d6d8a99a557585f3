//! Device buffers: one array on one device.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use hlo_ir::DType;

use crate::client::{ClientInner, Device};
use crate::error::{Error, Result};
use crate::ffi::{self, Args, Slot};
use crate::host::HostArray;
use crate::plugin::Api;

pub(crate) fn to_pjrt_type(d: DType) -> ffi::PJRT_Buffer_Type {
    match d {
        DType::Pred => ffi::PJRT_Buffer_Type_PRED,
        DType::I8 => ffi::PJRT_Buffer_Type_S8,
        DType::I32 => ffi::PJRT_Buffer_Type_S32,
        DType::I64 => ffi::PJRT_Buffer_Type_S64,
        DType::U8 => ffi::PJRT_Buffer_Type_U8,
        DType::U32 => ffi::PJRT_Buffer_Type_U32,
        DType::U64 => ffi::PJRT_Buffer_Type_U64,
        DType::F16 => ffi::PJRT_Buffer_Type_F16,
        DType::BF16 => ffi::PJRT_Buffer_Type_BF16,
        DType::F32 => ffi::PJRT_Buffer_Type_F32,
        DType::F64 => ffi::PJRT_Buffer_Type_F64,
    }
}

pub(crate) fn from_pjrt_type(t: ffi::PJRT_Buffer_Type) -> Result<DType> {
    Ok(match t {
        ffi::PJRT_Buffer_Type_PRED => DType::Pred,
        ffi::PJRT_Buffer_Type_S8 => DType::I8,
        ffi::PJRT_Buffer_Type_S32 => DType::I32,
        ffi::PJRT_Buffer_Type_S64 => DType::I64,
        ffi::PJRT_Buffer_Type_U8 => DType::U8,
        ffi::PJRT_Buffer_Type_U32 => DType::U32,
        ffi::PJRT_Buffer_Type_U64 => DType::U64,
        ffi::PJRT_Buffer_Type_F16 => DType::F16,
        ffi::PJRT_Buffer_Type_BF16 => DType::BF16,
        ffi::PJRT_Buffer_Type_F32 => DType::F32,
        ffi::PJRT_Buffer_Type_F64 => DType::F64,
        other => {
            return Err(Error::InvalidArgument(format!(
                "the plugin returned element type {other}, which hlo-train does not handle"
            )))
        }
    })
}

/// One array on one device; destroyed on drop.
pub struct Buffer {
    raw: *mut ffi::PJRT_Buffer,
    client: Arc<ClientInner>,
}

// SAFETY: PJRT buffers may be used from any thread.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_Buffer_Destroy_Args::new();
        a.buffer = self.raw;
        // SAFETY: each buffer is destroyed exactly once, here. Nothing can be
        // done about a failure during drop.
        let _ = unsafe { self.client.api.call(Slot::PJRT_Buffer_Destroy, &mut a) };
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.dtype(), self.dims()) {
            (Ok(t), Ok(d)) => write!(f, "Buffer({t}{d:?})"),
            _ => write!(f, "Buffer(?)"),
        }
    }
}

impl Buffer {
    pub(crate) fn wrap(client: Arc<ClientInner>, raw: *mut ffi::PJRT_Buffer) -> Result<Buffer> {
        if raw.is_null() {
            return Err(Error::InvalidArgument(
                "the plugin returned no buffer".into(),
            ));
        }
        Ok(Buffer { raw, client })
    }

    pub(crate) fn raw(&self) -> *mut ffi::PJRT_Buffer {
        self.raw
    }

    pub(crate) fn same_client(&self, client: &Arc<ClientInner>) -> bool {
        Arc::ptr_eq(&self.client, client)
    }

    pub fn dtype(&self) -> Result<DType> {
        let mut a = ffi::PJRT_Buffer_ElementType_Args::new();
        a.buffer = self.raw;
        // SAFETY: matching args.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_Buffer_ElementType, &mut a)?
        };
        from_pjrt_type(a.type_)
    }

    pub fn dims(&self) -> Result<Vec<i64>> {
        let mut a = ffi::PJRT_Buffer_Dimensions_Args::new();
        a.buffer = self.raw;
        // SAFETY: matching args; the dims are owned by the buffer and copied.
        unsafe {
            self.client.api.call(Slot::PJRT_Buffer_Dimensions, &mut a)?;
            if a.dims.is_null() {
                return Ok(Vec::new());
            }
            Ok(std::slice::from_raw_parts(a.dims, a.num_dims).to_vec())
        }
    }

    /// The device holding the buffer.
    pub fn device(&self) -> Result<Device> {
        let mut a = ffi::PJRT_Buffer_Device_Args::new();
        a.buffer = self.raw;
        // SAFETY: matching args.
        unsafe { self.client.api.call(Slot::PJRT_Buffer_Device, &mut a)? };
        let devices = self.client.wrap_devices(&a.device, 1);
        devices
            .into_iter()
            .next()
            .ok_or_else(|| Error::InvalidArgument("buffer has no device".into()))
    }

    /// True once the buffer was deleted or donated to an execution.
    pub fn is_deleted(&self) -> Result<bool> {
        let mut a = ffi::PJRT_Buffer_IsDeleted_Args::new();
        a.buffer = self.raw;
        // SAFETY: matching args.
        unsafe { self.client.api.call(Slot::PJRT_Buffer_IsDeleted, &mut a)? };
        Ok(a.is_deleted)
    }

    /// Waits until the buffer's value has been computed; execution errors
    /// surface here.
    pub fn block_until_ready(&self) -> Result<()> {
        let mut a = ffi::PJRT_Buffer_ReadyEvent_Args::new();
        a.buffer = self.raw;
        // SAFETY: matching args; the event is awaited and destroyed once.
        unsafe { self.client.api.call(Slot::PJRT_Buffer_ReadyEvent, &mut a)? };
        self.client
            .api
            .await_event(a.event, Slot::PJRT_Buffer_ReadyEvent)
    }

    /// Asks the plugin to note the moment this buffer's value is computed,
    /// without waiting for it: a step's time on the devices is the gap
    /// between such moments, wherever the host was meanwhile.
    pub fn ready_time(&self) -> Result<ReadyTime> {
        let mut a = ffi::PJRT_Buffer_ReadyEvent_Args::new();
        a.buffer = self.raw;
        // SAFETY: matching args; the event is destroyed below, once.
        unsafe { self.client.api.call(Slot::PJRT_Buffer_ReadyEvent, &mut a)? };
        let ready = ReadyTime::default();
        let note = Box::into_raw(Box::new(ReadyNote {
            ready: ready.clone(),
            api: self.client.api.clone(),
        }));
        let mut on = ffi::PJRT_Event_OnReady_Args::new();
        on.event = a.event;
        on.callback = Some(note_ready);
        on.user_arg = note.cast();
        // SAFETY: matching args; `note` is reclaimed by the callback, which
        // the plugin calls exactly once (at once if the event is ready). The
        // callback holds its own reference to the event's value, so the
        // event is ours to destroy.
        let registered = unsafe { self.client.api.call(Slot::PJRT_Event_OnReady, &mut on) };
        if registered.is_err() {
            // SAFETY: the plugin did not take `note`.
            drop(unsafe { Box::from_raw(note) });
        }
        let mut d = ffi::PJRT_Event_Destroy_Args::new();
        d.event = a.event;
        // SAFETY: the event came from the plugin; destroyed once.
        let destroyed = unsafe { self.client.api.call(Slot::PJRT_Event_Destroy, &mut d) };
        registered?;
        destroyed?;
        Ok(ready)
    }

    /// Copies the buffer to host memory (waits for it to be ready).
    pub fn to_host(&self) -> Result<HostArray> {
        let dtype = self.dtype()?;
        let dims = self.dims()?;
        // Ask the plugin for the size it will write, rather than assume.
        let mut q = ffi::PJRT_Buffer_ToHostBuffer_Args::new();
        q.src = self.raw;
        // SAFETY: matching args; a null dst asks for the size only.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_Buffer_ToHostBuffer, &mut q)?
        };
        let mut data = vec![0u8; q.dst_size];
        let mut a = ffi::PJRT_Buffer_ToHostBuffer_Args::new();
        a.src = self.raw;
        a.dst = data.as_mut_ptr().cast();
        a.dst_size = data.len();
        // SAFETY: `data` stays alive and unmoved until the event completes,
        // which is awaited before returning.
        unsafe {
            self.client
                .api
                .call(Slot::PJRT_Buffer_ToHostBuffer, &mut a)?
        };
        self.client
            .api
            .await_event(a.event, Slot::PJRT_Buffer_ToHostBuffer)?;
        HostArray::from_bytes(dtype, &dims, data)
    }
}

/// When a buffer's value was computed, as the plugin reported it.
#[derive(Clone, Debug, Default)]
pub struct ReadyTime(Arc<(Mutex<Option<Instant>>, Condvar)>);

impl ReadyTime {
    /// The moment, if the plugin has reported it.
    pub fn get(&self) -> Option<Instant> {
        *self.0 .0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for the report (which follows the value's completion at once).
    pub fn wait(&self) -> Instant {
        let (lock, ready) = &*self.0;
        let mut at = lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(t) = *at {
                return t;
            }
            at = ready.wait(at).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn set(&self, at: Instant) {
        let (lock, ready) = &*self.0;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = Some(at);
        ready.notify_all();
    }
}

/// What the ready callback needs: where to write, and the API to free the
/// event's error with.
struct ReadyNote {
    ready: ReadyTime,
    api: Arc<Api>,
}

/// Notes the time; a failed computation also counts as done (its error
/// surfaces when the value is read).
unsafe extern "C" fn note_ready(error: *mut ffi::PJRT_Error, user_arg: *mut std::ffi::c_void) {
    let at = Instant::now();
    // SAFETY: `user_arg` is the box `ready_time` leaked for this one call.
    let note = unsafe { Box::from_raw(user_arg.cast::<ReadyNote>()) };
    // SAFETY: the callback owns `error`.
    unsafe { note.api.drop_error(error) };
    note.ready.set(at);
}
