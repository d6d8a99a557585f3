//! `xla.CompileOptionsProto`, encoded by hand.
//!
//! We set a handful of fields, so a protobuf toolchain would be all weight and
//! no help. Field numbers are those of `xla/pjrt/proto/compile_options.proto`.
//! An empty `CompileOptionsProto` makes XLA abort the process (a CHECK on the
//! replica count), so [`CompileOptions`] always writes `num_replicas` and
//! `num_partitions`.

/// What we tell the compiler about the program's devices and partitioning.
///
/// ```
/// use hlo_runtime::CompileOptions;
/// let opts = CompileOptions::spmd(8);
/// assert_eq!(opts.num_partitions, 8);
/// assert!(!opts.encode().is_empty());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    /// Always 1: data parallelism is expressed as SPMD partitions.
    pub num_replicas: i64,
    /// Number of devices the program is partitioned over.
    pub num_partitions: i64,
    /// Run XLA's SPMD partitioner over the sharding annotations.
    pub use_spmd_partitioning: bool,
    /// Read Shardy (`sdy`) annotations rather than GSPMD `mhlo.sharding`.
    pub use_shardy_partitioner: bool,
    /// The global device id that runs each partition, when the program must
    /// run on given devices (several processes: every process compiles the
    /// same assignment over all of them). None: the client's first devices.
    pub device_assignment: Option<Vec<i64>>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            num_replicas: 1,
            num_partitions: 1,
            use_spmd_partitioning: false,
            use_shardy_partitioner: false,
            device_assignment: None,
        }
    }
}

impl CompileOptions {
    /// One program partitioned by Shardy over `num_partitions` devices.
    pub fn spmd(num_partitions: i64) -> Self {
        CompileOptions {
            num_replicas: 1,
            num_partitions,
            use_spmd_partitioning: true,
            use_shardy_partitioner: true,
            device_assignment: None,
        }
    }

    /// [`CompileOptions::spmd`] over the devices with these global ids,
    /// partition `i` on `device_ids[i]`.
    ///
    /// ```
    /// let opts = hlo_runtime::CompileOptions::spmd_on(&[0, 1, 2048, 2049]);
    /// assert_eq!(opts.num_partitions, 4);
    /// ```
    pub fn spmd_on(device_ids: &[i64]) -> Self {
        CompileOptions {
            device_assignment: Some(device_ids.to_vec()),
            ..Self::spmd(device_ids.len() as i64)
        }
    }

    /// The serialized `CompileOptionsProto`.
    pub fn encode(&self) -> Vec<u8> {
        // ExecutableBuildOptionsProto
        let mut build = Vec::new();
        put_int64(&mut build, 1, -1); // device_ordinal: any
        put_int64(&mut build, 4, self.num_replicas);
        put_int64(&mut build, 5, self.num_partitions);
        put_bool(&mut build, 6, self.use_spmd_partitioning);
        if let Some(ids) = &self.device_assignment {
            // DeviceAssignmentProto: replica_count (1), computation_count
            // (2), one ComputationDevice (3) per partition holding its one
            // replica's device id (1).
            let mut assignment = Vec::new();
            put_int64(&mut assignment, 1, self.num_replicas);
            put_int64(&mut assignment, 2, ids.len() as i64);
            for &id in ids {
                let mut device = Vec::new();
                put_int64(&mut device, 1, id);
                put_bytes(&mut assignment, 3, &device);
            }
            put_bytes(&mut build, 9, &assignment);
        }
        put_bool(&mut build, 19, self.use_shardy_partitioner);
        // CompileOptionsProto
        let mut out = Vec::new();
        put_bytes(&mut out, 3, &build);
        out
    }
}

const WIRE_VARINT: u64 = 0;
const WIRE_LEN: u64 = 2;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_tag(out: &mut Vec<u8>, field: u64, wire: u64) {
    put_varint(out, (field << 3) | wire);
}

fn put_int64(out: &mut Vec<u8>, field: u64, v: i64) {
    put_tag(out, field, WIRE_VARINT);
    // int64 is encoded as its two's complement bits (10 bytes when negative).
    put_varint(out, v as u64);
}

fn put_bool(out: &mut Vec<u8>, field: u64, v: bool) {
    put_tag(out, field, WIRE_VARINT);
    put_varint(out, v as u64);
}

fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_tag(out, field, WIRE_LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_match_the_protobuf_spec() {
        let mut v = Vec::new();
        put_varint(&mut v, 300);
        assert_eq!(v, [0xac, 0x02]);
        let mut v = Vec::new();
        put_int64(&mut v, 1, -1);
        assert_eq!(
            v,
            [0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
    }

    #[test]
    fn spmd_options_bytes() {
        // Worked out by hand from the field numbers: field 3 (length 20: 11 + 2 + 2 + 2 + 3) holding
        // device_ordinal=-1 (1), num_replicas=1 (4), num_partitions=8 (5),
        // use_spmd_partitioning (6) and use_shardy_partitioner (19, a two-byte tag).
        let bytes = CompileOptions::spmd(8).encode();
        let mut want = vec![0x1a, 20];
        want.extend([
            0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
        ]);
        want.extend([0x20, 0x01, 0x28, 0x08, 0x30, 0x01, 0x98, 0x01, 0x01]);
        assert_eq!(bytes, want);
    }

    #[test]
    fn a_device_assignment_is_field_9_with_one_computation_per_partition() {
        let bytes = CompileOptions::spmd_on(&[0, 2048]).encode();
        let plain = CompileOptions::spmd(2).encode();
        // By hand: field 9 (tag 0x4a) of length 13: replica_count=1 (08 01),
        // computation_count=2 (10 02), then two ComputationDevices (1a ..)
        // holding replica_device_ids 0 (08 00) and 2048 (08 80 10).
        let assignment = [
            0x4a, 13, 0x08, 0x01, 0x10, 0x02, 0x1a, 0x02, 0x08, 0x00, 0x1a, 0x03, 0x08, 0x80, 0x10,
        ];
        // Same fields as without it, plus the assignment after field 6.
        assert_eq!(bytes.len(), plain.len() + assignment.len());
        assert_eq!(bytes[1] as usize, plain[1] as usize + assignment.len());
        let at = bytes
            .windows(assignment.len())
            .position(|w| w == assignment)
            .expect("the assignment is in the build options");
        assert_eq!(&bytes[2..at], &plain[2..at]);
        assert_eq!(&bytes[at + assignment.len()..], &plain[at..]);
    }
}
