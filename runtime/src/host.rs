//! Dense host arrays: the bytes that go to and come back from a device.

use half::{bf16, f16};
use hlo_ir::{DType, Literal, TensorType};

use crate::error::{Error, Result};

/// A Rust scalar type that maps to one [`DType`].
pub trait Element: Copy + 'static {
    const DTYPE: DType;
    fn append_le(values: &[Self], out: &mut Vec<u8>);
    fn read_le(bytes: &[u8]) -> Vec<Self>;
}

macro_rules! element {
    ($($t:ty => $d:expr),* $(,)?) => {$(
        impl Element for $t {
            const DTYPE: DType = $d;
            fn append_le(values: &[Self], out: &mut Vec<u8>) {
                out.reserve(values.len() * std::mem::size_of::<$t>());
                for v in values {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            fn read_le(bytes: &[u8]) -> Vec<Self> {
                bytes
                    .chunks_exact(std::mem::size_of::<$t>())
                    .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")))
                    .collect()
            }
        }
    )*};
}

element! {
    i8 => DType::I8, i32 => DType::I32, i64 => DType::I64,
    u8 => DType::U8, u32 => DType::U32, u64 => DType::U64,
    f16 => DType::F16, bf16 => DType::BF16, f32 => DType::F32, f64 => DType::F64,
}

impl Element for bool {
    const DTYPE: DType = DType::Pred;
    fn append_le(values: &[Self], out: &mut Vec<u8>) {
        out.extend(values.iter().map(|&b| b as u8));
    }
    fn read_le(bytes: &[u8]) -> Vec<Self> {
        bytes.iter().map(|&b| b != 0).collect()
    }
}

/// A dense, row-major (major-to-minor) array in host memory.
///
/// ```
/// use hlo_runtime::HostArray;
/// let a = HostArray::new(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
/// assert_eq!(a.to_vec::<f32>().unwrap()[3], 4.0);
/// assert!(a.to_vec::<i32>().is_err());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct HostArray {
    dtype: DType,
    dims: Vec<i64>,
    data: Vec<u8>,
}

/// Number of elements of `dims`, or an error for negative or overflowing dims.
pub fn element_count(dims: &[i64]) -> Result<usize> {
    dims.iter().try_fold(1usize, |acc, &d| {
        usize::try_from(d)
            .ok()
            .and_then(|d| acc.checked_mul(d))
            .ok_or_else(|| Error::InvalidArgument(format!("bad dimensions {dims:?}")))
    })
}

impl HostArray {
    /// An array of `values` with shape `dims`.
    pub fn new<T: Element>(dims: &[i64], values: &[T]) -> Result<Self> {
        let n = element_count(dims)?;
        if n != values.len() {
            return Err(Error::InvalidArgument(format!(
                "shape {dims:?} holds {n} elements but {} were given",
                values.len()
            )));
        }
        let mut data = Vec::new();
        T::append_le(values, &mut data);
        Ok(HostArray {
            dtype: T::DTYPE,
            dims: dims.to_vec(),
            data,
        })
    }

    /// A scalar.
    pub fn scalar<T: Element>(value: T) -> Self {
        let mut data = Vec::new();
        T::append_le(&[value], &mut data);
        HostArray {
            dtype: T::DTYPE,
            dims: Vec::new(),
            data,
        }
    }

    /// An array from raw little-endian bytes.
    pub(crate) fn from_bytes(dtype: DType, dims: &[i64], data: Vec<u8>) -> Result<Self> {
        let want = element_count(dims)? * dtype.size_in_bytes();
        if data.len() != want {
            return Err(Error::InvalidArgument(format!(
                "{dtype}{dims:?} needs {want} bytes but {} were given",
                data.len()
            )));
        }
        Ok(HostArray {
            dtype,
            dims: dims.to_vec(),
            data,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn dims(&self) -> &[i64] {
        &self.dims
    }

    pub fn element_count(&self) -> usize {
        self.data.len() / self.dtype.size_in_bytes()
    }

    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The elements as `T`, which must be this array's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::InvalidArgument(format!(
                "array holds {} but {} was asked for",
                self.dtype,
                T::DTYPE
            )));
        }
        Ok(T::read_le(&self.data))
    }

    /// The elements converted to f64 (for comparisons against references).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let d = &self.data;
        match self.dtype {
            DType::Pred => bool::read_le(d)
                .into_iter()
                .map(|v| v as u8 as f64)
                .collect(),
            DType::I8 => i8::read_le(d).into_iter().map(f64::from).collect(),
            DType::I32 => i32::read_le(d).into_iter().map(f64::from).collect(),
            DType::I64 => i64::read_le(d).into_iter().map(|v| v as f64).collect(),
            DType::U8 => u8::read_le(d).into_iter().map(f64::from).collect(),
            DType::U32 => u32::read_le(d).into_iter().map(f64::from).collect(),
            DType::U64 => u64::read_le(d).into_iter().map(|v| v as f64).collect(),
            DType::F16 => f16::read_le(d).into_iter().map(f64::from).collect(),
            DType::BF16 => bf16::read_le(d).into_iter().map(f64::from).collect(),
            DType::F32 => f32::read_le(d).into_iter().map(f64::from).collect(),
            DType::F64 => f64::read_le(d),
        }
    }
}

impl From<Literal> for HostArray {
    fn from(l: Literal) -> Self {
        HostArray {
            dtype: l.ty.dtype,
            dims: l.ty.dims,
            data: l.bytes,
        }
    }
}

impl From<HostArray> for Literal {
    fn from(h: HostArray) -> Self {
        Literal {
            ty: TensorType::new(h.dtype, h.dims),
            bytes: h.data,
        }
    }
}

impl HostArray {
    /// The array's type.
    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype, self.dims.clone())
    }
}
