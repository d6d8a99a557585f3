//! Element types, with their StableHLO and HLO spellings.

use std::fmt;
use std::str::FromStr;

/// The element type of a tensor.
///
/// `Pred` is XLA's boolean (`i1` in StableHLO, `pred` in HLO); `bool` parses
/// to it.
///
/// ```
/// use hlo_ir::DType;
/// assert_eq!(DType::BF16.size_in_bytes(), 2);
/// assert_eq!(DType::BF16.mlir_name(), "bf16");
/// assert_eq!("bool".parse::<DType>().unwrap(), DType::Pred);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    Pred,
    I8,
    I32,
    I64,
    U8,
    U32,
    U64,
    F16,
    BF16,
    F32,
    F64,
}

impl DType {
    /// Every element type, in a fixed order (useful for tests and tables).
    pub const ALL: [DType; 11] = [
        DType::Pred,
        DType::I8,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U32,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element in a dense host or device array (`Pred` takes a byte).
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::Pred | DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// The short name users write (`f32`, `bf16`, `pred`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Pred => "pred",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    /// The element type as StableHLO/MLIR writes it inside `tensor<...>`.
    pub const fn mlir_name(self) -> &'static str {
        match self {
            DType::Pred => "i1",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "ui8",
            DType::U32 => "ui32",
            DType::U64 => "ui64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    /// The element type as HLO text writes it (`f32[2,3]`).
    pub const fn hlo_name(self) -> &'static str {
        match self {
            DType::Pred => "pred",
            DType::I8 => "s8",
            DType::I32 => "s32",
            DType::I64 => "s64",
            DType::U8 => "u8",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// What sums, softmaxes and losses over values of this type are
    /// computed in: f32, or f64 for f64 (which finite-difference checks
    /// need).
    pub const fn accumulator(self) -> DType {
        match self {
            DType::F64 => DType::F64,
            _ => DType::F32,
        }
    }

    pub const fn is_integer(self) -> bool {
        matches!(
            self,
            DType::I8 | DType::I32 | DType::I64 | DType::U8 | DType::U32 | DType::U64
        )
    }

    pub const fn is_unsigned(self) -> bool {
        matches!(self, DType::U8 | DType::U32 | DType::U64)
    }

    /// Width in bits of one element (`Pred` counts 8, as stored).
    pub const fn bits(self) -> u32 {
        self.size_in_bytes() as u32 * 8
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A dtype name that is not one of ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown dtype `{0}` (expected one of pred, bool, i8, i32, i64, u8, u32, u64, f16, bf16, f32, f64)"
)]
pub struct ParseDTypeError(pub String);

impl FromStr for DType {
    type Err = ParseDTypeError;

    /// Accepts our names, the MLIR and HLO spellings, and `bool`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        let found = DType::ALL
            .into_iter()
            .find(|d| lower == d.name() || lower == d.mlir_name() || lower == d.hlo_name());
        match (found, lower.as_str()) {
            (Some(d), _) => Ok(d),
            (None, "bool") => Ok(DType::Pred),
            _ => Err(ParseDTypeError(s.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
            assert_eq!(d.mlir_name().parse::<DType>(), Ok(d));
            assert_eq!(d.hlo_name().parse::<DType>(), Ok(d));
        }
        assert!("f8".parse::<DType>().is_err());
    }
}
