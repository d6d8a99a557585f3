//! Any text as a mesh and as a partition spec: parsed or an error, never a
//! panic; a spec that validates against a mesh and shape splits it evenly.
#![no_main]

use hlo_partitioner::{Mesh, PartitionSpec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let (left, right) = text.split_once('|').unwrap_or((text, ""));
    let mesh = left.parse::<Mesh>().ok();
    if let Some(m) = &mesh {
        assert_eq!(m.to_string().parse::<Mesh>().ok().as_ref(), Some(m));
    }
    if let Ok(spec) = PartitionSpec::parse(right) {
        let mesh = mesh.unwrap_or_else(Mesh::single);
        let shape = [12i64, 8, 6];
        if spec.validate(&mesh, &shape, "x").is_ok() {
            for (d, &n) in shape.iter().enumerate() {
                let parts: i64 = spec
                    .axes(d)
                    .iter()
                    .map(|a| mesh.axis_size(a).unwrap_or(1))
                    .product();
                assert_eq!(n % parts, 0);
            }
        }
    }
});
