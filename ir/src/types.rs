//! Tensor types: an element type and static dimensions.

use std::fmt;

use crate::DType;

/// The type of a traced value: element type and dimensions (row-major).
///
/// ```
/// use hlo_ir::{DType, TensorType};
/// let t = TensorType::new(DType::F32, [2, 3]);
/// assert_eq!(t.to_string(), "f32[2,3]");
/// assert_eq!(t.mlir(), "tensor<2x3xf32>");
/// assert_eq!(t.element_count(), 6);
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorType {
    pub dtype: DType,
    pub dims: Vec<i64>,
}

impl TensorType {
    pub fn new(dtype: DType, dims: impl Into<Vec<i64>>) -> Self {
        TensorType {
            dtype,
            dims: dims.into(),
        }
    }

    pub fn scalar(dtype: DType) -> Self {
        TensorType {
            dtype,
            dims: Vec::new(),
        }
    }

    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    pub fn element_count(&self) -> usize {
        self.dims.iter().map(|&d| d.max(0) as usize).product()
    }

    pub fn size_in_bytes(&self) -> usize {
        self.element_count() * self.dtype.size_in_bytes()
    }

    /// The bytes of a tensor of this type, None when they pass what a
    /// program can address (`i64::MAX`; XLA counts in signed 64 bits).
    ///
    /// ```
    /// use hlo_ir::{DType, TensorType};
    /// assert_eq!(TensorType::new(DType::F32, [2, 3]).checked_bytes(), Some(24));
    /// let huge = TensorType::new(DType::F32, [1 << 40, 1 << 40]);
    /// assert_eq!(huge.checked_bytes(), None);
    /// ```
    pub fn checked_bytes(&self) -> Option<u64> {
        self.dims
            .iter()
            .try_fold(self.dtype.size_in_bytes() as u64, |n, &d| {
                n.checked_mul(d.max(0) as u64)
            })
            .filter(|&n| n <= i64::MAX as u64)
    }

    /// The same dims with another element type.
    pub fn with_dtype(&self, dtype: DType) -> Self {
        TensorType {
            dtype,
            dims: self.dims.clone(),
        }
    }

    /// `tensor<2x3xf32>`.
    pub fn mlir(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.dims {
            s += &format!("{d}x");
        }
        s += self.dtype.mlir_name();
        s.push('>');
        s
    }

    /// `f32[2,3]{1,0}` (with the default row-major layout; `f32[]` for a scalar).
    pub fn hlo(&self) -> String {
        if self.dims.is_empty() {
            return format!("{}[]", self.dtype.hlo_name());
        }
        let dims: Vec<String> = self.dims.iter().map(i64::to_string).collect();
        let layout: Vec<String> = (0..self.dims.len()).rev().map(|i| i.to_string()).collect();
        format!(
            "{}[{}]{{{}}}",
            self.dtype.hlo_name(),
            dims.join(","),
            layout.join(",")
        )
    }

    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut strides = vec![1usize; self.dims.len()];
        for i in (0..self.dims.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.dims[i + 1] as usize;
        }
        strides
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.dims.iter().map(i64::to_string).collect();
        write!(f, "{}[{}]", self.dtype, dims.join(","))
    }
}

/// Iterates over every multi-index of `dims` in row-major order.
pub(crate) fn for_each_index(dims: &[i64], mut f: impl FnMut(&[i64])) {
    let n: i64 = dims.iter().product();
    if n <= 0 && !dims.is_empty() {
        return;
    }
    let mut idx = vec![0i64; dims.len()];
    loop {
        f(&idx);
        let mut k = dims.len();
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            idx[k] += 1;
            if idx[k] < dims[k] {
                break;
            }
            idx[k] = 0;
        }
    }
}

/// Row-major linear offset of `idx` in `dims`.
pub(crate) fn linear_index(dims: &[i64], idx: &[i64]) -> usize {
    let mut off = 0i64;
    for (d, i) in dims.iter().zip(idx) {
        off = off * d + i;
    }
    off as usize
}
