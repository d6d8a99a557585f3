//! Any bytes as a safetensors file: an index or an error, never a panic,
//! and every indexed tensor lies inside the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::path::Path::new("fuzz.safetensors");
    if let Ok(tensors) = hlo_models::checkpoint::index_file(path, data) {
        for t in tensors {
            assert!(t.start <= t.end && t.end <= data.len());
            let _ = t.literal(data);
        }
    }
});
