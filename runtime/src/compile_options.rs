//! `xla.CompileOptionsProto`, encoded by hand.
//!
//! We set a handful of fields, so a protobuf toolchain would be all weight and
//! no help. Field numbers are those of `xla/pjrt/proto/compile_options.proto`.
//! An empty `CompileOptionsProto` makes XLA abort the process (a CHECK on the
//! replica count), so [`CompileOptions`] always writes `num_replicas` and
//! `num_partitions`.
//!
//! XLA's compiler flags (`xla_cpu_enable_fast_math`, ...) travel per compile
//! as `env_option_overrides` (field 7), which XLA applies on top of its own
//! defaults. We never write `ExecutableBuildOptionsProto.debug_options`: a
//! `DebugOptions` message replaces the defaults whole, every field we leave
//! out reading as zero or false.

use std::collections::BTreeMap;
use std::fmt;
use std::hash::{Hash, Hasher};

/// The value of one XLA option (`OptionOverrideProto`'s oneof): XLA checks
/// it against the flag's type, so `true` for a bool flag, `4` for an int
/// one, `0.5` for a float one (a whole number is an [`XlaOption::Int`]).
///
/// Doubles compare and hash by their bits, so options stay `Eq` and `Hash`
/// (they key the compile cache).
///
/// ```
/// use hlo_runtime::XlaOption;
/// assert_eq!(XlaOption::parse("false"), XlaOption::Bool(false));
/// assert_eq!(XlaOption::parse("-3"), XlaOption::Int(-3));
/// assert_eq!(XlaOption::parse("0.5"), XlaOption::Double(0.5));
/// assert_eq!(XlaOption::parse("/tmp/dump"), XlaOption::Str("/tmp/dump".into()));
/// ```
#[derive(Clone, Debug)]
pub enum XlaOption {
    /// `string_field` (1); XLA also parses it for a flag of another type.
    Str(String),
    /// `bool_field` (2).
    Bool(bool),
    /// `int_field` (3), an int64.
    Int(i64),
    /// `double_field` (4).
    Double(f64),
}

impl XlaOption {
    /// The value `text` spells: `true`/`false`, a whole number, a finite
    /// number in decimal or exponent notation, else the text itself.
    pub fn parse(text: &str) -> XlaOption {
        match text {
            "true" => return XlaOption::Bool(true),
            "false" => return XlaOption::Bool(false),
            _ => {}
        }
        if let Ok(i) = text.parse::<i64>() {
            return XlaOption::Int(i);
        }
        // Only digits, signs, a point and an exponent: `inf` or `nan` are
        // more likely words meant for a string flag than numbers.
        let numeric = text
            .chars()
            .all(|c| c.is_ascii_digit() || "+-.eE".contains(c));
        match text.parse::<f64>() {
            Ok(x) if numeric && x.is_finite() => XlaOption::Double(x),
            _ => XlaOption::Str(text.to_string()),
        }
    }

    /// A discriminant and the payload's bits, which equality and hashing
    /// share.
    fn key(&self) -> (u8, u64, &str) {
        match self {
            XlaOption::Str(s) => (0, 0, s),
            XlaOption::Bool(b) => (1, *b as u64, ""),
            XlaOption::Int(i) => (2, *i as u64, ""),
            XlaOption::Double(x) => (3, x.to_bits(), ""),
        }
    }
}

impl PartialEq for XlaOption {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for XlaOption {}

impl Hash for XlaOption {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

/// The text [`XlaOption::parse`] reads back as the same value (a double
/// always with a point or an exponent, so it stays a double).
impl fmt::Display for XlaOption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            XlaOption::Str(s) => f.write_str(s),
            XlaOption::Bool(b) => write!(f, "{b}"),
            XlaOption::Int(i) => write!(f, "{i}"),
            XlaOption::Double(x) => write!(f, "{x:?}"),
        }
    }
}

/// An XLA option that cannot be one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum XlaOptionError {
    /// No `=` between the flag and its value.
    #[error("XLA option `{0}` is not KEY=VALUE (e.g. xla_cpu_enable_fast_math=false)")]
    NotAssignment(String),
    /// A key that is no XLA flag name.
    #[error("XLA option key `{0}` is not an XLA flag name: lowercase letters, digits and `_` only (e.g. xla_gpu_enable_triton_gemm)")]
    BadKey(String),
    /// A value XLA would take for the flag and then abort the process on
    /// (see [`check_xla_value`]).
    #[error("XLA option {key}={value}: XLA takes {min} to {max}; {why}")]
    OutOfRange {
        key: String,
        value: String,
        min: i64,
        max: i64,
        why: &'static str,
    },
}

/// An integer flag whose values outside `min..=max` XLA takes and then
/// dies of: an abort the process cannot catch, or memory without bound,
/// rather than a compile error.
struct IntRange {
    key: &'static str,
    min: i64,
    max: i64,
    why: &'static str,
}

/// The flags whose values XLA does not check before using them, each
/// found by giving the CPU plugin `-5`, `0` and `2^31 - 1` for every
/// integer flag it has (and `-1`, `99` for each enum) and by reading
/// XLA's code (`xla/service/cpu/cpu_compiler.cc`). Every other value
/// reached XLA's own checks there, which refuse it as a compile error.
/// Not covered: the GPU compiler's flags (`xla_gpu_*`, not tried on a GPU
/// yet) and what a value does to a program rather than to the compiler.
const INT_RANGES: &[IntRange] = &[IntRange {
    key: "xla_cpu_parallel_codegen_split_count",
    min: 1,
    // XLA's default is 32. It makes every part up front: 4096 took 20 MB
    // more than 32 to train the tiny model, 2^31 - 1 more than 10 GB
    // before it was stopped.
    max: 4096,
    why: "XLA:CPU reads it as an unsigned count, so a negative one aborts the process, 0 fails every compile and a huge one takes memory without bound (default 32)",
}];

/// Refuses a value XLA takes for flag `key` but cannot survive (see
/// [`INT_RANGES`]): checked before anything is compiled, since XLA's
/// failure there kills the process. A string value is read as XLA reads
/// it for an integer flag (surrounding spaces and a `+` allowed).
///
/// ```
/// use hlo_runtime::{check_xla_value, XlaOption};
/// let key = "xla_cpu_parallel_codegen_split_count";
/// assert!(check_xla_value(key, &XlaOption::Int(8)).is_ok());
/// assert!(check_xla_value(key, &XlaOption::Int(-5)).is_err());
/// assert!(check_xla_value(key, &XlaOption::Str(" -5".into())).is_err());
/// assert!(check_xla_value("xla_cpu_enable_fast_math", &XlaOption::Int(-5)).is_ok());
/// ```
pub fn check_xla_value(key: &str, value: &XlaOption) -> Result<(), XlaOptionError> {
    let Some(range) = INT_RANGES.iter().find(|r| r.key == key) else {
        return Ok(());
    };
    let n = match value {
        XlaOption::Int(n) => *n,
        // As absl::SimpleAtoi reads it; text that is no integer is XLA's
        // to refuse (a compile error).
        XlaOption::Str(s) => match s.trim().parse::<i64>() {
            Ok(n) => n,
            Err(_) => return Ok(()),
        },
        XlaOption::Bool(_) | XlaOption::Double(_) => return Ok(()),
    };
    match (range.min..=range.max).contains(&n) {
        true => Ok(()),
        false => Err(XlaOptionError::OutOfRange {
            key: key.to_string(),
            value: value.to_string(),
            min: range.min,
            max: range.max,
            why: range.why,
        }),
    }
}

/// Checks that `key` can name an XLA flag: non-empty, `[a-z0-9_]` (XLA
/// itself refuses a well-formed name it does not know, when compiling).
pub fn check_xla_key(key: &str) -> Result<(), XlaOptionError> {
    let valid = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    match valid {
        true => Ok(()),
        false => Err(XlaOptionError::BadKey(key.to_string())),
    }
}

/// One option from `KEY=VALUE`, as `XLA_FLAGS` spells flags too (leading
/// dashes are dropped: `--xla_foo=1` is `xla_foo=1`), its value checked
/// where XLA would die of it ([`check_xla_value`]).
///
/// ```
/// use hlo_runtime::{parse_xla_option, XlaOption};
/// let (key, value) = parse_xla_option("--xla_cpu_enable_fast_math=false").unwrap();
/// assert_eq!((key.as_str(), value), ("xla_cpu_enable_fast_math", XlaOption::Bool(false)));
/// assert!(parse_xla_option("xla_cpu_enable_fast_math").is_err());
/// assert!(parse_xla_option("XLA-Flag=1").is_err());
/// ```
pub fn parse_xla_option(text: &str) -> Result<(String, XlaOption), XlaOptionError> {
    let (key, value) = text
        .split_once('=')
        .ok_or_else(|| XlaOptionError::NotAssignment(text.to_string()))?;
    let key = key.trim_start_matches('-');
    check_xla_key(key)?;
    let value = XlaOption::parse(value);
    check_xla_value(key, &value)?;
    Ok((key.to_string(), value))
}

/// Refuses options XLA would CHECK-fail on (killing the process): other
/// than one replica, no partition, or a value it aborts on.
pub(crate) fn check_before_compile(options: &CompileOptions) -> Result<(), crate::Error> {
    if options.num_replicas != 1 || options.num_partitions < 1 {
        return Err(crate::Error::InvalidArgument(format!(
            "compile options need num_replicas = 1 and num_partitions >= 1, got {} and {}",
            options.num_replicas, options.num_partitions
        )));
    }
    for (key, value) in &options.env_option_overrides {
        check_xla_value(key, value).map_err(|e| crate::Error::InvalidArgument(e.to_string()))?;
    }
    Ok(())
}

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
    /// XLA flags for this compile (`env_option_overrides`), by flag name
    /// without dashes; a key given twice takes its last value.
    pub env_option_overrides: Vec<(String, XlaOption)>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            num_replicas: 1,
            num_partitions: 1,
            use_spmd_partitioning: false,
            use_shardy_partitioner: false,
            device_assignment: None,
            env_option_overrides: Vec::new(),
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
            env_option_overrides: Vec::new(),
        }
    }

    /// These options with `defaults` added: each key they do not set
    /// themselves (a client's options for every program it compiles).
    ///
    /// ```
    /// use hlo_runtime::{CompileOptions, XlaOption};
    /// let mut own = CompileOptions::default();
    /// own.env_option_overrides.push(("xla_a".into(), XlaOption::Int(1)));
    /// let defaults = [("xla_a".into(), XlaOption::Int(2)), ("xla_b".into(), XlaOption::Bool(true))];
    /// let both = own.with_defaults(&defaults);
    /// assert_eq!(both.env_option_overrides.len(), 2);
    /// assert_eq!(both.env_option_overrides[0].1, XlaOption::Int(1));
    /// ```
    pub fn with_defaults(&self, defaults: &[(String, XlaOption)]) -> CompileOptions {
        let mut out = self.clone();
        for (key, value) in defaults {
            if !self.env_option_overrides.iter().any(|(k, _)| k == key) {
                out.env_option_overrides.push((key.clone(), value.clone()));
            }
        }
        out
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
        // A map is a repeated entry message (key = 1, value = 2). Sorted by
        // key and one entry per key (the last value given, as a map keeps),
        // so equal options give equal bytes: the compile cache keys on
        // them, and protobuf's deterministic serialization (the test's
        // reference) sorts the same way.
        let overrides: BTreeMap<&str, &XlaOption> = self
            .env_option_overrides
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .collect();
        for (key, value) in overrides {
            let mut entry = Vec::new();
            put_bytes(&mut entry, 1, key.as_bytes());
            put_bytes(&mut entry, 2, &encode_override(value));
            put_bytes(&mut out, 7, &entry);
        }
        out
    }
}

/// An `OptionOverrideProto`. Its fields are a oneof, so the one set is
/// written even when it holds a default (`false`, `0`, `""`): otherwise
/// XLA would read no value at all.
fn encode_override(value: &XlaOption) -> Vec<u8> {
    let mut out = Vec::new();
    match value {
        XlaOption::Str(s) => put_bytes(&mut out, 1, s.as_bytes()),
        XlaOption::Bool(b) => put_bool(&mut out, 2, *b),
        XlaOption::Int(i) => put_int64(&mut out, 3, *i),
        XlaOption::Double(x) => {
            put_tag(&mut out, 4, WIRE_I64);
            out.extend_from_slice(&x.to_bits().to_le_bytes());
        }
    }
    out
}

const WIRE_VARINT: u64 = 0;
const WIRE_I64: u64 = 1;
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

    /// The bytes [`CompileOptions::encode`] adds after the build options
    /// for `overrides`.
    fn overrides_bytes(overrides: &[(&str, XlaOption)]) -> Vec<u8> {
        let mut opts = CompileOptions::default();
        let plain = opts.encode();
        opts.env_option_overrides = overrides
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let bytes = opts.encode();
        assert_eq!(&bytes[..plain.len()], &plain[..]);
        bytes[plain.len()..].to_vec()
    }

    #[test]
    fn a_negative_int_override_is_ten_bytes_of_twos_complement() {
        // By hand: field 7 (tag 0x3a), length 20: key (0a 05 "xla_a"),
        // value (12 0b) holding int_field (18) = -1 as a 10-byte varint.
        let mut want = vec![0x3a, 20, 0x0a, 5];
        want.extend(b"xla_a");
        want.extend([0x12, 11, 0x18]);
        want.extend([0xff; 9]);
        want.push(0x01);
        assert_eq!(overrides_bytes(&[("xla_a", XlaOption::Int(-1))]), want);
    }

    #[test]
    fn a_double_override_is_fixed64_little_endian() {
        // double_field (4) has wire type 1: tag 0x21, then 0.5's bits
        // 0x3fe0000000000000 low byte first.
        let mut want = vec![0x3a, 18, 0x0a, 5];
        want.extend(b"xla_d");
        want.extend([0x12, 9, 0x21, 0, 0, 0, 0, 0, 0, 0xe0, 0x3f]);
        assert_eq!(overrides_bytes(&[("xla_d", XlaOption::Double(0.5))]), want);
        // -2.0 is 0xc000000000000000.
        let neg = overrides_bytes(&[("xla_d", XlaOption::Double(-2.0))]);
        assert_eq!(&neg[neg.len() - 8..], &[0, 0, 0, 0, 0, 0, 0, 0xc0]);
    }

    #[test]
    fn a_false_or_zero_override_is_still_written() {
        // A oneof member has presence: false is `10 00`, not nothing.
        let bytes = overrides_bytes(&[("k", XlaOption::Bool(false))]);
        assert_eq!(bytes, [0x3a, 7, 0x0a, 1, b'k', 0x12, 2, 0x10, 0x00]);
        let bytes = overrides_bytes(&[("k", XlaOption::Str(String::new()))]);
        assert_eq!(bytes, [0x3a, 7, 0x0a, 1, b'k', 0x12, 2, 0x0a, 0x00]);
    }

    #[test]
    fn overrides_are_sorted_and_the_last_of_a_key_wins() {
        let a = overrides_bytes(&[
            ("xla_b", XlaOption::Int(1)),
            ("xla_a", XlaOption::Int(2)),
            ("xla_b", XlaOption::Int(3)),
        ]);
        let b = overrides_bytes(&[("xla_a", XlaOption::Int(2)), ("xla_b", XlaOption::Int(3))]);
        assert_eq!(a, b);
    }

    #[test]
    fn option_text_round_trips_and_keys_are_checked() {
        for text in [
            "true", "false", "0", "-7", "0.5", "1e-3", "2.0", "inf", "1,2", "",
        ] {
            let v = XlaOption::parse(text);
            assert_eq!(XlaOption::parse(&v.to_string()), v, "{text}");
        }
        assert_eq!(XlaOption::parse("2.0"), XlaOption::Double(2.0));
        assert_eq!(XlaOption::parse("inf"), XlaOption::Str("inf".into()));
        assert_eq!(XlaOption::parse("True"), XlaOption::Str("True".into()));
        assert_eq!(XlaOption::Double(f64::NAN), XlaOption::Double(f64::NAN));
        assert_ne!(XlaOption::Double(0.0), XlaOption::Double(-0.0));
        for bad in ["=1", "--=1", "Xla_a=1", "xla-a=1", "xla a=1", "xla_é=1"] {
            assert!(
                matches!(parse_xla_option(bad), Err(XlaOptionError::BadKey(_))),
                "{bad}"
            );
        }
        assert_eq!(
            parse_xla_option("xla_a").unwrap_err().to_string(),
            "XLA option `xla_a` is not KEY=VALUE (e.g. xla_cpu_enable_fast_math=false)"
        );
        let (k, v) = parse_xla_option("-xla_dump_to=/tmp/a=b").unwrap();
        assert_eq!(
            (k.as_str(), v),
            ("xla_dump_to", XlaOption::Str("/tmp/a=b".into()))
        );
    }

    #[test]
    fn values_xla_would_abort_on_are_refused_as_they_are_read() {
        let key = "xla_cpu_parallel_codegen_split_count";
        for bad in ["-5", "0", "4097", " -1 ", "+0", "-9223372036854775808"] {
            let e = parse_xla_option(&format!("{key}={bad}")).unwrap_err();
            assert!(matches!(e, XlaOptionError::OutOfRange { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("XLA takes 1 to 4096"), "{e}");
        }
        // Inside the range, or not an integer (XLA's to refuse), or
        // another flag: passed on.
        for good in ["1", "32", "4096", "+8", " 7 ", "many", "2.5", "true"] {
            assert!(parse_xla_option(&format!("{key}={good}")).is_ok(), "{good}");
        }
        assert!(parse_xla_option("xla_cpu_prefer_vector_width=-5").is_ok());
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
