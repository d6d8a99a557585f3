//! `#[repr(C)]` declarations of the PJRT C API pieces we call.
//!
//! Written by hand for the API 0.114-era layouts (every `*_Args` struct here
//! has the size the 0.114 header gives it; the `const` asserts below pin
//! that). A plugin checks that `struct_size` is at least the size it was built
//! with, so a struct here may be larger than an older plugin's, never smaller
//! than the newest one we support. Names follow the C header so a reader can
//! put the two side by side.
#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code
)]

use std::ffi::{c_char, c_void};
use std::mem::size_of;

/// Opaque PJRT handles.
#[repr(C)]
pub struct PJRT_Error {
    _private: [u8; 0],
}
#[repr(C)]
pub(crate) struct PJRT_Client {
    _private: [u8; 0],
}
#[repr(C)]
pub(crate) struct PJRT_Device {
    _private: [u8; 0],
}
#[repr(C)]
pub(crate) struct PJRT_DeviceDescription {
    _private: [u8; 0],
}
#[repr(C)]
pub(crate) struct PJRT_Buffer {
    _private: [u8; 0],
}
#[repr(C)]
pub(crate) struct PJRT_Event {
    _private: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Executable {
    _private: [u8; 0],
}
#[repr(C)]
pub(crate) struct PJRT_TopologyDescription {
    _private: [u8; 0],
}
#[repr(C)]
pub(crate) struct PJRT_SerializedExecutable {
    _private: [u8; 0],
}
#[repr(C)]
pub(crate) struct PJRT_LoadedExecutable {
    _private: [u8; 0],
}

/// `PJRT_Api_Version`, embedded by value at the start of `PJRT_Api`.
#[repr(C)]
pub struct PJRT_Api_Version {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub major_version: i32,
    pub minor_version: i32,
}

/// The head of `PJRT_Api`; the function table follows at [`API_TABLE_OFFSET`].
#[repr(C)]
pub struct PJRT_Api {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub pjrt_api_version: PJRT_Api_Version,
}

/// Byte offset of the first function pointer in `PJRT_Api`.
pub const API_TABLE_OFFSET: usize = size_of::<PJRT_Api>();
const _: () = assert!(API_TABLE_OFFSET == 40);

/// Index of each function we call in the `PJRT_Api` table (declaration order
/// in the header; the table only ever grows at the end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Slot {
    PJRT_Error_Destroy = 0,
    PJRT_Error_Message = 1,
    PJRT_Error_GetCode = 2,
    PJRT_Plugin_Initialize = 3,
    PJRT_Plugin_Attributes = 4,
    PJRT_Event_Destroy = 5,
    PJRT_Event_IsReady = 6,
    PJRT_Event_Error = 7,
    PJRT_Event_Await = 8,
    PJRT_Event_OnReady = 9,
    PJRT_Client_Create = 10,
    PJRT_Client_Destroy = 11,
    PJRT_Client_PlatformName = 12,
    PJRT_Client_ProcessIndex = 13,
    PJRT_Client_PlatformVersion = 14,
    PJRT_Client_Devices = 15,
    PJRT_Client_AddressableDevices = 16,
    PJRT_Client_Compile = 20,
    PJRT_Client_BufferFromHostBuffer = 22,
    PJRT_DeviceDescription_Id = 23,
    PJRT_DeviceDescription_ProcessIndex = 24,
    PJRT_DeviceDescription_Attributes = 25,
    PJRT_DeviceDescription_Kind = 26,
    PJRT_DeviceDescription_DebugString = 27,
    PJRT_DeviceDescription_ToString = 28,
    PJRT_Device_GetDescription = 29,
    PJRT_Device_IsAddressable = 30,
    PJRT_Device_LocalHardwareId = 31,
    PJRT_Device_MemoryStats = 34,
    PJRT_Executable_Destroy = 40,
    PJRT_Executable_Name = 41,
    PJRT_Executable_NumReplicas = 42,
    PJRT_Executable_NumPartitions = 43,
    PJRT_Executable_NumOutputs = 44,
    PJRT_Executable_OptimizedProgram = 48,
    PJRT_Executable_Serialize = 49,
    PJRT_LoadedExecutable_Destroy = 50,
    PJRT_LoadedExecutable_GetExecutable = 51,
    PJRT_LoadedExecutable_AddressableDevices = 52,
    PJRT_LoadedExecutable_Execute = 55,
    PJRT_Executable_DeserializeAndLoad = 56,
    PJRT_Buffer_Destroy = 58,
    PJRT_Buffer_ElementType = 59,
    PJRT_Buffer_Dimensions = 60,
    PJRT_Buffer_OnDeviceSizeInBytes = 64,
    PJRT_Buffer_Device = 65,
    PJRT_Buffer_Delete = 67,
    PJRT_Buffer_IsDeleted = 68,
    PJRT_Buffer_ToHostBuffer = 70,
    PJRT_Buffer_ReadyEvent = 72,
    PJRT_TopologyDescription_Create = 82,
    PJRT_TopologyDescription_Destroy = 83,
    PJRT_TopologyDescription_PlatformName = 84,
    PJRT_TopologyDescription_GetDeviceDescriptions = 86,
    PJRT_Compile = 89,
    PJRT_Executable_OutputElementTypes = 90,
    PJRT_Executable_OutputDimensions = 91,
    PJRT_Executable_Fingerprint = 94,
    PJRT_Executable_GetCompiledMemoryStats = 96,
}

impl Slot {
    /// The C name, for error messages.
    pub fn name(self) -> String {
        format!("{self:?}")
    }

    /// Byte offset of this slot inside `PJRT_Api`.
    pub const fn offset(self) -> usize {
        API_TABLE_OFFSET + (self as usize) * size_of::<*const c_void>()
    }
}

/// Every `*_Args` struct starts with `struct_size` and `extension_start`; the
/// rest is plain pointers, integers and bools, so all-zero is a valid start.
pub trait Args: Sized {
    /// A zeroed value with `struct_size` set.
    fn new() -> Self;
}

macro_rules! pjrt_args {
    ($( $(#[$m:meta])* $name:ident ($size:expr) { $($field:ident : $ty:ty),* $(,)? } )*) => {$(
        $(#[$m])*
        #[repr(C)]
        pub struct $name {
            pub struct_size: usize,
            pub extension_start: *mut c_void,
            $(pub $field: $ty,)*
        }
        impl Args for $name {
            fn new() -> Self {
                // SAFETY: every field is a raw pointer, integer, bool or a
                // fieldless C enum with a zero variant; all-zero is valid.
                let mut a: Self = unsafe { std::mem::zeroed() };
                a.struct_size = size_of::<Self>();
                a
            }
        }
        const _: () = assert!(size_of::<$name>() == $size);
    )*};
}

/// Called once an event is ready; owns (and must destroy) `error`.
pub(crate) type PJRT_Event_OnReadyCallback =
    unsafe extern "C" fn(error: *mut PJRT_Error, user_arg: *mut c_void);

/// `PJRT_CallbackError`: the plugin's maker of a `PJRT_Error`, handed to
/// our key-value callbacks so they can fail (the message is copied).
pub type PJRT_CallbackError =
    unsafe extern "C" fn(code: u32, message: *const c_char, message_size: usize) -> *mut PJRT_Error;

/// Frees a value our get callbacks returned; the plugin calls it after
/// copying the value.
pub(crate) type PJRT_KeyValueGetCallback_ValueDeleter = unsafe extern "C" fn(value: *mut c_char);

/// `PJRT_KeyValueGetCallback_Args`: a blocking get, `timeout_in_ms` long.
#[repr(C)]
pub struct PJRT_KeyValueGetCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub timeout_in_ms: i32,
    pub callback_error: *const Option<PJRT_CallbackError>,
    pub user_arg: *mut c_void,
    pub value: *mut c_char,
    pub value_size: usize,
    pub value_deleter_callback: Option<PJRT_KeyValueGetCallback_ValueDeleter>,
}
const _: () = assert!(size_of::<PJRT_KeyValueGetCallback_Args>() == 80);

/// `PJRT_KeyValueTryGetCallback_Args`: a get that answers NOT_FOUND at once.
#[repr(C)]
pub struct PJRT_KeyValueTryGetCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub callback_error: *const Option<PJRT_CallbackError>,
    pub user_arg: *mut c_void,
    pub value: *mut c_char,
    pub value_size: usize,
    pub value_deleter_callback: Option<PJRT_KeyValueGetCallback_ValueDeleter>,
}
const _: () = assert!(size_of::<PJRT_KeyValueTryGetCallback_Args>() == 72);

/// `PJRT_KeyValuePutCallback_Args`: `value` lives only for the call.
#[repr(C)]
pub struct PJRT_KeyValuePutCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub value: *const c_char,
    pub value_size: usize,
    pub callback_error: *const Option<PJRT_CallbackError>,
    pub user_arg: *mut c_void,
}
const _: () = assert!(size_of::<PJRT_KeyValuePutCallback_Args>() == 64);

pub type PJRT_KeyValueGetCallback =
    unsafe extern "C" fn(args: *mut PJRT_KeyValueGetCallback_Args) -> *mut PJRT_Error;
pub type PJRT_KeyValueTryGetCallback =
    unsafe extern "C" fn(args: *mut PJRT_KeyValueTryGetCallback_Args) -> *mut PJRT_Error;
pub type PJRT_KeyValuePutCallback =
    unsafe extern "C" fn(args: *mut PJRT_KeyValuePutCallback_Args) -> *mut PJRT_Error;

/// `PJRT_Buffer_Type`.
pub type PJRT_Buffer_Type = u32;
pub(crate) const PJRT_Buffer_Type_PRED: PJRT_Buffer_Type = 1;
pub(crate) const PJRT_Buffer_Type_S8: PJRT_Buffer_Type = 2;
pub(crate) const PJRT_Buffer_Type_S32: PJRT_Buffer_Type = 4;
pub(crate) const PJRT_Buffer_Type_S64: PJRT_Buffer_Type = 5;
pub(crate) const PJRT_Buffer_Type_U8: PJRT_Buffer_Type = 6;
pub(crate) const PJRT_Buffer_Type_U32: PJRT_Buffer_Type = 8;
pub(crate) const PJRT_Buffer_Type_U64: PJRT_Buffer_Type = 9;
pub(crate) const PJRT_Buffer_Type_F16: PJRT_Buffer_Type = 10;
pub(crate) const PJRT_Buffer_Type_F32: PJRT_Buffer_Type = 11;
pub(crate) const PJRT_Buffer_Type_F64: PJRT_Buffer_Type = 12;
pub(crate) const PJRT_Buffer_Type_BF16: PJRT_Buffer_Type = 13;

/// `PJRT_HostBufferSemantics`.
pub(crate) const PJRT_HostBufferSemantics_kImmutableOnlyDuringCall: u32 = 0;

/// `PJRT_NamedValue_Type`.
pub(crate) const PJRT_NamedValue_kString: u32 = 0;
pub(crate) const PJRT_NamedValue_kInt64: u32 = 1;
pub(crate) const PJRT_NamedValue_kInt64List: u32 = 2;
pub(crate) const PJRT_NamedValue_kFloat: u32 = 3;
pub(crate) const PJRT_NamedValue_kBool: u32 = 4;

/// The value union of `PJRT_NamedValue`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union PJRT_NamedValue_Value {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

/// `PJRT_NamedValue`: a typed key/value (client create options, attributes).
#[repr(C)]
pub struct PJRT_NamedValue {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub name: *const c_char,
    pub name_size: usize,
    pub type_: u32,
    pub value: PJRT_NamedValue_Value,
    /// Bytes of a string, elements of a list, else 1.
    pub value_size: usize,
}
const _: () = assert!(size_of::<PJRT_NamedValue>() == 56);

pjrt_args! {
    PJRT_Error_Destroy_Args(24) { error: *mut PJRT_Error }
    PJRT_Error_Message_Args(40) {
        error: *const PJRT_Error,
        message: *const c_char,
        message_size: usize,
    }
    PJRT_Error_GetCode_Args(32) { error: *const PJRT_Error, code: u32 }
    PJRT_Plugin_Initialize_Args(16) {}
    PJRT_Plugin_Attributes_Args(32) {
        attributes: *const PJRT_NamedValue,
        num_attributes: usize,
    }
    PJRT_Event_Destroy_Args(24) { event: *mut PJRT_Event }
    PJRT_Event_IsReady_Args(32) { event: *mut PJRT_Event, is_ready: bool }
    PJRT_Event_Error_Args(24) { event: *mut PJRT_Event }
    PJRT_Event_Await_Args(24) { event: *mut PJRT_Event }
    PJRT_Event_OnReady_Args(40) {
        event: *mut PJRT_Event,
        callback: Option<PJRT_Event_OnReadyCallback>,
        user_arg: *mut c_void,
    }
    PJRT_Client_Create_Args(88) {
        create_options: *const PJRT_NamedValue,
        num_options: usize,
        kv_get_callback: *mut c_void,
        kv_get_user_arg: *mut c_void,
        kv_put_callback: *mut c_void,
        kv_put_user_arg: *mut c_void,
        client: *mut PJRT_Client,
        kv_try_get_callback: *mut c_void,
        kv_try_get_user_arg: *mut c_void,
    }
    PJRT_Client_Destroy_Args(24) { client: *mut PJRT_Client }
    PJRT_Client_PlatformName_Args(40) {
        client: *mut PJRT_Client,
        platform_name: *const c_char,
        platform_name_size: usize,
    }
    PJRT_Client_ProcessIndex_Args(32) { client: *mut PJRT_Client, process_index: i32 }
    PJRT_Client_PlatformVersion_Args(40) {
        client: *mut PJRT_Client,
        platform_version: *const c_char,
        platform_version_size: usize,
    }
    PJRT_Client_Devices_Args(40) {
        client: *mut PJRT_Client,
        devices: *const *mut PJRT_Device,
        num_devices: usize,
    }
    PJRT_Client_AddressableDevices_Args(40) {
        client: *mut PJRT_Client,
        addressable_devices: *const *mut PJRT_Device,
        num_addressable_devices: usize,
    }
    /// `PJRT_Program`: program text or bytes plus its format (`"mlir"`, `"hlo"`).
    PJRT_Program(48) {
        code: *const c_char,
        code_size: usize,
        format: *const c_char,
        format_size: usize,
    }
    PJRT_Client_Compile_Args(56) {
        client: *mut PJRT_Client,
        program: *const PJRT_Program,
        compile_options: *const c_char,
        compile_options_size: usize,
        executable: *mut PJRT_LoadedExecutable,
    }
    PJRT_Client_BufferFromHostBuffer_Args(120) {
        client: *mut PJRT_Client,
        data: *const c_void,
        type_: PJRT_Buffer_Type,
        dims: *const i64,
        num_dims: usize,
        byte_strides: *const i64,
        num_byte_strides: usize,
        host_buffer_semantics: u32,
        device: *mut PJRT_Device,
        memory: *mut c_void,
        device_layout: *mut c_void,
        done_with_host_buffer: *mut PJRT_Event,
        buffer: *mut PJRT_Buffer,
    }
    PJRT_DeviceDescription_Id_Args(32) {
        device_description: *mut PJRT_DeviceDescription,
        id: i32,
    }
    PJRT_DeviceDescription_ProcessIndex_Args(32) {
        device_description: *mut PJRT_DeviceDescription,
        process_index: i32,
    }
    PJRT_DeviceDescription_Attributes_Args(40) {
        device_description: *mut PJRT_DeviceDescription,
        num_attributes: usize,
        attributes: *const PJRT_NamedValue,
    }
    PJRT_DeviceDescription_Kind_Args(40) {
        device_description: *mut PJRT_DeviceDescription,
        device_kind: *const c_char,
        device_kind_size: usize,
    }
    PJRT_DeviceDescription_DebugString_Args(40) {
        device_description: *mut PJRT_DeviceDescription,
        debug_string: *const c_char,
        debug_string_size: usize,
    }
    PJRT_DeviceDescription_ToString_Args(40) {
        device_description: *mut PJRT_DeviceDescription,
        to_string: *const c_char,
        to_string_size: usize,
    }
    PJRT_Device_GetDescription_Args(32) {
        device: *mut PJRT_Device,
        device_description: *mut PJRT_DeviceDescription,
    }
    PJRT_Device_IsAddressable_Args(32) { device: *mut PJRT_Device, is_addressable: bool }
    PJRT_Device_LocalHardwareId_Args(32) { device: *mut PJRT_Device, local_hardware_id: i32 }
    PJRT_Device_MemoryStats_Args(208) {
        device: *mut PJRT_Device,
        bytes_in_use: i64,
        peak_bytes_in_use: i64,
        peak_bytes_in_use_is_set: bool,
        num_allocs: i64,
        num_allocs_is_set: bool,
        largest_alloc_size: i64,
        largest_alloc_size_is_set: bool,
        bytes_limit: i64,
        bytes_limit_is_set: bool,
        bytes_reserved: i64,
        bytes_reserved_is_set: bool,
        peak_bytes_reserved: i64,
        peak_bytes_reserved_is_set: bool,
        bytes_reservable_limit: i64,
        bytes_reservable_limit_is_set: bool,
        largest_free_block_bytes: i64,
        largest_free_block_bytes_is_set: bool,
        pool_bytes: i64,
        pool_bytes_is_set: bool,
        peak_pool_bytes: i64,
        peak_pool_bytes_is_set: bool,
        peak_allocated_bytes: i64,
        peak_allocated_bytes_is_set: bool,
    }
    PJRT_Executable_Destroy_Args(24) { executable: *mut PJRT_Executable }
    PJRT_Executable_Name_Args(40) {
        executable: *mut PJRT_Executable,
        executable_name: *const c_char,
        executable_name_size: usize,
    }
    PJRT_Executable_NumReplicas_Args(32) { executable: *mut PJRT_Executable, num_replicas: usize }
    PJRT_Executable_NumPartitions_Args(32) { executable: *mut PJRT_Executable, num_partitions: usize }
    PJRT_Executable_NumOutputs_Args(32) { executable: *mut PJRT_Executable, num_outputs: usize }
    PJRT_Executable_OptimizedProgram_Args(32) {
        executable: *mut PJRT_Executable,
        program: *mut PJRT_Program,
    }
    PJRT_Executable_OutputElementTypes_Args(40) {
        executable: *mut PJRT_Executable,
        output_types: *const PJRT_Buffer_Type,
        num_output_types: usize,
    }
    PJRT_Executable_OutputDimensions_Args(48) {
        executable: *mut PJRT_Executable,
        num_outputs: usize,
        dims: *const i64,
        dim_sizes: *const usize,
    }
    PJRT_Executable_Fingerprint_Args(40) {
        executable: *mut PJRT_Executable,
        executable_fingerprint: *const c_char,
        executable_fingerprint_size: usize,
    }
    PJRT_Executable_GetCompiledMemoryStats_Args(144) {
        executable: *mut PJRT_Executable,
        generated_code_size_in_bytes: i64,
        argument_size_in_bytes: i64,
        output_size_in_bytes: i64,
        alias_size_in_bytes: i64,
        temp_size_in_bytes: i64,
        host_generated_code_size_in_bytes: i64,
        host_argument_size_in_bytes: i64,
        host_output_size_in_bytes: i64,
        host_alias_size_in_bytes: i64,
        host_temp_size_in_bytes: i64,
        peak_memory_in_bytes: i64,
        total_size_in_bytes: i64,
        total_allocation_bytes: i64,
        indefinite_allocations: i64,
        peak_unpadded_heap_bytes: i64,
    }
    PJRT_Executable_Serialize_Args(56) {
        executable: *const PJRT_Executable,
        serialized_bytes: *const c_char,
        serialized_bytes_size: usize,
        serialized_executable: *mut PJRT_SerializedExecutable,
        serialized_executable_deleter: Option<unsafe extern "C" fn(*mut PJRT_SerializedExecutable)>,
    }
    PJRT_Executable_DeserializeAndLoad_Args(64) {
        client: *mut PJRT_Client,
        serialized_executable: *const c_char,
        serialized_executable_size: usize,
        loaded_executable: *mut PJRT_LoadedExecutable,
        // Null: the options the program was compiled with.
        overridden_serialized_compile_options: *const c_char,
        overridden_serialized_compile_options_size: usize,
    }
    PJRT_TopologyDescription_Create_Args(56) {
        topology_name: *const c_char,
        topology_name_size: usize,
        create_options: *const PJRT_NamedValue,
        num_options: usize,
        topology: *mut PJRT_TopologyDescription,
    }
    PJRT_TopologyDescription_Destroy_Args(24) { topology: *mut PJRT_TopologyDescription }
    PJRT_TopologyDescription_PlatformName_Args(40) {
        topology: *mut PJRT_TopologyDescription,
        platform_name: *const c_char,
        platform_name_size: usize,
    }
    PJRT_TopologyDescription_GetDeviceDescriptions_Args(40) {
        topology: *mut PJRT_TopologyDescription,
        descriptions: *const *mut PJRT_DeviceDescription,
        num_descriptions: usize,
    }
    /// `PJRT_Compile`: compiles for a topology, no client needed.
    PJRT_Compile_Args(64) {
        topology: *const PJRT_TopologyDescription,
        program: *const PJRT_Program,
        compile_options: *const c_char,
        compile_options_size: usize,
        client: *mut PJRT_Client,
        executable: *mut PJRT_Executable,
    }
    PJRT_LoadedExecutable_Destroy_Args(24) { executable: *mut PJRT_LoadedExecutable }
    PJRT_LoadedExecutable_GetExecutable_Args(32) {
        loaded_executable: *mut PJRT_LoadedExecutable,
        executable: *mut PJRT_Executable,
    }
    PJRT_LoadedExecutable_AddressableDevices_Args(40) {
        executable: *mut PJRT_LoadedExecutable,
        addressable_devices: *const *mut PJRT_Device,
        num_addressable_devices: usize,
    }
    PJRT_ExecuteOptions(144) {
        send_callbacks: *mut c_void,
        recv_callbacks: *mut c_void,
        num_send_ops: usize,
        num_recv_ops: usize,
        launch_id: i32,
        non_donatable_input_indices: *const i64,
        num_non_donatable_input_indices: usize,
        context: *mut c_void,
        call_location: *const c_char,
        num_tasks: usize,
        task_ids: *mut i32,
        incarnation_ids: *mut i64,
        multi_slice_config: *mut c_void,
        use_major_to_minor_data_layout_for_callbacks: bool,
        hlo_output_callbacks: *mut c_void,
        num_hlo_output_callbacks: usize,
    }
    PJRT_LoadedExecutable_Execute_Args(80) {
        executable: *mut PJRT_LoadedExecutable,
        options: *mut PJRT_ExecuteOptions,
        argument_lists: *const *const *mut PJRT_Buffer,
        num_devices: usize,
        num_args: usize,
        output_lists: *const *mut *mut PJRT_Buffer,
        device_complete_events: *mut *mut PJRT_Event,
        execute_device: *mut PJRT_Device,
    }
    PJRT_Buffer_Destroy_Args(24) { buffer: *mut PJRT_Buffer }
    PJRT_Buffer_ElementType_Args(32) { buffer: *mut PJRT_Buffer, type_: PJRT_Buffer_Type }
    PJRT_Buffer_Dimensions_Args(40) {
        buffer: *mut PJRT_Buffer,
        dims: *const i64,
        num_dims: usize,
    }
    PJRT_Buffer_OnDeviceSizeInBytes_Args(32) {
        buffer: *mut PJRT_Buffer,
        on_device_size_in_bytes: usize,
    }
    PJRT_Buffer_Device_Args(32) { buffer: *mut PJRT_Buffer, device: *mut PJRT_Device }
    PJRT_Buffer_Delete_Args(24) { buffer: *mut PJRT_Buffer }
    PJRT_Buffer_IsDeleted_Args(32) { buffer: *mut PJRT_Buffer, is_deleted: bool }
    PJRT_Buffer_ToHostBuffer_Args(56) {
        src: *mut PJRT_Buffer,
        host_layout: *mut c_void,
        dst: *mut c_void,
        dst_size: usize,
        event: *mut PJRT_Event,
    }
    PJRT_Buffer_ReadyEvent_Args(32) { buffer: *mut PJRT_Buffer, event: *mut PJRT_Event }
}

impl PJRT_Program {
    /// StableHLO text as a program (borrowing `mlir`, which must outlive
    /// the call it is passed to).
    pub fn mlir(mlir: &str) -> PJRT_Program {
        const FORMAT: &str = "mlir";
        let mut program = PJRT_Program::new();
        program.code = mlir.as_ptr() as *const c_char;
        program.code_size = mlir.len();
        program.format = FORMAT.as_ptr() as *const c_char;
        program.format_size = FORMAT.len();
        program
    }
}

/// `PJRT_Api* GetPjrtApi(void)`, the one symbol a plugin exports.
pub(crate) type GetPjrtApiFn = unsafe extern "C" fn() -> *const PJRT_Api;
