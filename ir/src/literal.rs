//! Literals: constant tensors with their bytes, and the numeric views the
//! reference interpreter computes with (f64 for floats, i128 for integers).

use half::{bf16, f16};

use crate::{DType, TensorType};

/// A constant tensor: its type and little-endian, row-major bytes.
///
/// ```
/// use hlo_ir::{DType, Literal, TensorType};
/// let l = Literal::from_f64s(TensorType::new(DType::BF16, [2]), &[1.0, 1.0 / 3.0]);
/// assert_eq!(l.to_f64s(), vec![1.0, 0.333984375]); // rounded to bf16
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Literal {
    pub ty: TensorType,
    pub bytes: Vec<u8>,
}

/// Rounds `v` to the nearest value of float type `dtype`.
pub fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        _ => v,
    }
}

/// Wraps `v` into the range of integer type `dtype` (two's complement).
pub fn wrap_to(dtype: DType, v: i128) -> i128 {
    match dtype {
        DType::Pred => (v != 0) as i128,
        DType::I8 => v as i8 as i128,
        DType::I32 => v as i32 as i128,
        DType::I64 => v as i64 as i128,
        DType::U8 => v as u8 as i128,
        DType::U32 => v as u32 as i128,
        DType::U64 => v as u64 as i128,
        _ => v,
    }
}

impl Literal {
    /// Floats rounded to `ty.dtype` (which may also be an integer type: then
    /// values are truncated towards zero and wrapped).
    pub fn from_f64s(ty: TensorType, values: &[f64]) -> Literal {
        assert_eq!(values.len(), ty.element_count(), "literal size");
        if !ty.dtype.is_float() {
            let ints: Vec<i128> = values.iter().map(|&v| v as i128).collect();
            return Literal::from_i128s(ty, &ints);
        }
        let mut bytes = Vec::with_capacity(ty.size_in_bytes());
        for &v in values {
            match ty.dtype {
                DType::F16 => bytes.extend(f16::from_f64(v).to_le_bytes()),
                DType::BF16 => bytes.extend(bf16::from_f64(v).to_le_bytes()),
                DType::F32 => bytes.extend((v as f32).to_le_bytes()),
                _ => bytes.extend(v.to_le_bytes()),
            }
        }
        Literal { ty, bytes }
    }

    /// Integers wrapped to `ty.dtype` (or converted, for a float type).
    pub fn from_i128s(ty: TensorType, values: &[i128]) -> Literal {
        assert_eq!(values.len(), ty.element_count(), "literal size");
        if ty.dtype.is_float() {
            let floats: Vec<f64> = values.iter().map(|&v| v as f64).collect();
            return Literal::from_f64s(ty, &floats);
        }
        let n = ty.dtype.size_in_bytes();
        let mut bytes = Vec::with_capacity(ty.size_in_bytes());
        for &v in values {
            let w = wrap_to(ty.dtype, v);
            bytes.extend_from_slice(&w.to_le_bytes()[..n]);
        }
        Literal { ty, bytes }
    }

    /// A tensor of `ty` with every element `v`.
    pub fn splat(ty: TensorType, v: f64) -> Literal {
        let n = ty.element_count();
        Literal::from_f64s(ty, &vec![v; n])
    }

    pub fn scalar(dtype: DType, v: f64) -> Literal {
        Literal::from_f64s(TensorType::scalar(dtype), &[v])
    }

    /// Elements as f64 (exact for every float type and for integers up to 2^53).
    pub fn to_f64s(&self) -> Vec<f64> {
        let d = self.ty.dtype;
        if !d.is_float() {
            return self.to_i128s().into_iter().map(|v| v as f64).collect();
        }
        let n = d.size_in_bytes();
        self.bytes
            .chunks_exact(n)
            .map(|c| match d {
                DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f64(),
                DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f64(),
                DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
                _ => f64::from_le_bytes(c.try_into().expect("8 bytes")),
            })
            .collect()
    }

    /// How many elements are NaN or infinite (none for integers), without
    /// making a copy of the values.
    pub fn non_finite_count(&self) -> usize {
        let d = self.ty.dtype;
        if !d.is_float() {
            return 0;
        }
        let n = d.size_in_bytes();
        self.bytes
            .chunks_exact(n)
            .filter(|c| !match d {
                DType::F16 => f16::from_le_bytes([c[0], c[1]]).is_finite(),
                DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).is_finite(),
                DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite(),
                _ => f64::from_le_bytes((*c).try_into().expect("8 bytes")).is_finite(),
            })
            .count()
    }

    /// Elements as i128 (integers and pred exactly; floats truncated).
    pub fn to_i128s(&self) -> Vec<i128> {
        let d = self.ty.dtype;
        if d.is_float() {
            return self.to_f64s().into_iter().map(|v| v as i128).collect();
        }
        let n = d.size_in_bytes();
        self.bytes
            .chunks_exact(n)
            .map(|c| {
                let mut b = [0u8; 16];
                b[..n].copy_from_slice(c);
                let raw = u128::from_le_bytes(b) as i128;
                match d {
                    DType::Pred => (raw != 0) as i128,
                    DType::I8 => raw as i8 as i128,
                    DType::I32 => raw as i32 as i128,
                    DType::I64 => raw as i64 as i128,
                    _ => raw,
                }
            })
            .collect()
    }

    /// True when every element has the same bytes.
    pub(crate) fn is_splat(&self) -> bool {
        let n = self.ty.dtype.size_in_bytes();
        self.bytes.chunks_exact(n).all(|c| c == &self.bytes[..n])
    }

    /// Element `i` as f64 (floats) or i128 (integers), decoding only it.
    fn element(&self, i: usize) -> (f64, i128) {
        let n = self.ty.dtype.size_in_bytes();
        let one = Literal {
            ty: TensorType::scalar(self.ty.dtype),
            bytes: self.bytes[i * n..(i + 1) * n].to_vec(),
        };
        if self.ty.dtype.is_float() {
            (one.to_f64s()[0], 0)
        } else {
            (0.0, one.to_i128s()[0])
        }
    }

    /// One element's value as MLIR writes it inside `dense<...>`: hex bits
    /// for floats (exact, and the only spelling of inf and NaN), decimal for
    /// integers, `true`/`false` for pred.
    pub(crate) fn mlir_element(&self, i: usize) -> String {
        let d = self.ty.dtype;
        let n = d.size_in_bytes();
        let c = &self.bytes[i * n..(i + 1) * n];
        if d == DType::Pred {
            return if c[0] != 0 { "true" } else { "false" }.into();
        }
        if d.is_float() {
            let mut b = [0u8; 8];
            b[..n].copy_from_slice(c);
            let bits = u64::from_le_bytes(b);
            return format!("0x{bits:0width$X}", width = n * 2);
        }
        self.element(i).1.to_string()
    }

    /// One element's value as HLO text writes it (`1.5`, `-inf`, `nan`, `7`, `true`).
    pub(crate) fn hlo_element(&self, i: usize) -> String {
        let d = self.ty.dtype;
        let (v, k) = self.element(i);
        if d == DType::Pred {
            return if k != 0 { "true" } else { "false" }.into();
        }
        if !d.is_float() {
            return k.to_string();
        }
        if v.is_nan() {
            "nan".into()
        } else if v.is_infinite() {
            if v > 0.0 { "inf" } else { "-inf" }.into()
        } else if d == DType::F64 {
            format!("{v:?}")
        } else {
            // Shortest decimal that rounds back to the same f32 (and hence to
            // the same f16/bf16, which are exact in f32).
            format!("{:?}", v as f32)
        }
    }
}
