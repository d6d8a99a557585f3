//! 4-bit NormalFloat (NF4) weights as bitsandbytes stores them, on the
//! host: the QLoRA paper's data type, so a checkpoint quantized here and
//! one quantized by `bitsandbytes.functional.quantize_4bit(...,
//! quant_type="nf4")` hold the same bytes.
//!
//! A weight is taken row-major and flat, in blocks of [`BLOCK_SIZE`]
//! values; each block keeps its largest magnitude (`absmax`, f32) and each
//! value the index of the nearest of the 16 [`NF4_LEVELS`] to
//! `value / absmax`, two indices a byte (the first value in the high
//! nibble). Double quantization stores the absmax themselves in 8 bits:
//! their mean is taken off and the rest quantized in blocks of 256 with the
//! signed dynamic map ([`dynamic_map`]).
//!
//! ```
//! use hlo_models::nf4::Nf4Tensor;
//! let w: Vec<f32> = (0..128).map(|i| (i as f32 - 64.0) / 64.0).collect();
//! let q = Nf4Tensor::quantize(&w, &[2, 64], false);
//! assert_eq!(q.codes.len(), 64); // two values a byte
//! let back = q.dequantize();
//! // Within half the widest gap between levels (-1 to -0.70).
//! assert!(back.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 0.153));
//! ```

use hlo_ir::{constant, full, DType, Literal, Tensor, TensorType};

/// Values per block, as bitsandbytes' QLoRA default (`blocksize=64`).
pub const BLOCK_SIZE: usize = 64;

/// Values per block of the absmax's own quantization (double
/// quantization), as bitsandbytes.
pub(crate) const ABSMAX_BLOCK_SIZE: usize = 256;

/// The 16 NF4 levels: quantiles of a standard normal scaled to [-1, 1]
/// with an exact zero (QLoRA, appendix E), in code order.
/// Written with the digits bitsandbytes prints (each the same f32).
#[allow(clippy::excessive_precision)]
pub const NF4_LEVELS: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// QLoRA's storage of a model's base projections: NF4 in blocks of 64,
/// optionally with the absmax quantized again (`--double-quant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nf4Config {
    pub double_quant: bool,
}

/// Whether module `short` is stored in NF4, as bitsandbytes converts HF's models:
/// every `nn.Linear` of the layers (the seven modules LoRA targets by
/// default, latent attention's four others, Qwen2-MoE's one-row
/// `shared_expert_gate`); not the embeddings, norms, the LM head, the
/// routers or the fused experts, which transformers 5 holds as
/// parameters, not `nn.Linear`s (bitsandbytes leaves them as they are).
pub fn is_quantized_module(short: &str) -> bool {
    use crate::projections::{LATENT_PROJECTIONS, LAYER_PROJECTIONS};
    LAYER_PROJECTIONS.contains(&short)
        || LATENT_PROJECTIONS.contains(&short)
        || short == crate::decoder::SharedExpert::GATE
}

/// The suffix of a quantized weight's block scales
/// (`model.layers.0.self_attn.q_proj.weight.absmax`, as bitsandbytes names
/// them in HF checkpoints).
pub const ABSMAX_SUFFIX: &str = ".absmax";

/// Whether `name` (`model.layers.3.mlp.up_proj.weight`, or a stacked
/// `model.layers.mlp.up_proj.weight`) is a weight NF4 replaces.
pub fn is_quantized(name: &str) -> bool {
    name.strip_suffix(".weight")
        .and_then(|m| m.rsplit('.').next())
        .is_some_and(is_quantized_module)
}

/// What a quantized `[out, in]` weight is held as: its codes `u8 [out, in
/// / 2]` and its block scales `f32 [out, in / 64]` (so each block lies in
/// one row). None when `in` is not a multiple of 64.
pub fn stored_types(shape: &[i64]) -> Option<(TensorType, TensorType)> {
    let (&cols, rows) = shape.split_last()?;
    if cols % BLOCK_SIZE as i64 != 0 {
        return None;
    }
    let with_last = |last: i64| {
        let mut d = rows.to_vec();
        d.push(last);
        d
    };
    Some((
        TensorType::new(DType::U8, with_last(cols / 2)),
        TensorType::new(DType::F32, with_last(cols / BLOCK_SIZE as i64)),
    ))
}

/// The per-block scales of an [`Nf4Tensor`].
#[derive(Clone, Debug, PartialEq)]
pub enum Absmax {
    /// One f32 per block.
    Plain(Vec<f32>),
    /// Quantized again (bitsandbytes' `compress_statistics=True`).
    Double(DoubleQuant),
}

/// Absmax in 8 bits: `absmax[b] = code[codes[b]] * absmax2[b / blocksize]
/// + offset`.
#[derive(Clone, Debug, PartialEq)]
pub struct DoubleQuant {
    pub codes: Vec<u8>,
    pub offset: f32,
    pub absmax2: Vec<f32>,
    /// The 256 values the codes index (bitsandbytes' `nested_quant_map`).
    pub code: Vec<f32>,
    pub blocksize: usize,
}

/// One weight in NF4: its shape, its packed codes and its block scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4Tensor {
    pub shape: Vec<usize>,
    /// Two codes a byte, the first value in the high nibble; an odd count
    /// pads the last low nibble with the code of 0 (7).
    pub codes: Vec<u8>,
    pub absmax: Absmax,
}

/// The thresholds between consecutive levels, `(l[i] + l[i+1]) / 2` in
/// f32.
fn midpoints(levels: &[f32]) -> Vec<f32> {
    levels.windows(2).map(|w| (w[0] + w[1]) * 0.5).collect()
}

/// The code of a scaled value: how many thresholds lie strictly below it,
/// so a value exactly between two levels takes the lower one (as
/// bitsandbytes decides; "nearest" would be ambiguous there).
fn code_of(thresholds: &[f32], s: f32) -> u8 {
    thresholds.partition_point(|&m| m < s) as u8
}

/// NF4 codes (one per value, unpacked) and each block's absmax, as
/// bitsandbytes' `quantize_4bit` computes them in f32: a full block scales
/// by the reciprocal of its absmax, the last partial block divides by it,
/// and an all-zero block scales by 1e38 (its absmax floored at 1e-38), so
/// every value takes the zero level.
fn quantize_nf4(values: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let thresholds = midpoints(&NF4_LEVELS);
    let mut codes = Vec::with_capacity(values.len());
    let mut absmax = Vec::with_capacity(values.len().div_ceil(BLOCK_SIZE));
    for block in values.chunks(BLOCK_SIZE) {
        let (scale, stored) = block_scale(block);
        let partial = block.len() < BLOCK_SIZE;
        let inverse = 1.0 / scale;
        codes.extend(block.iter().map(|&x| {
            let s = if partial { x / scale } else { x * inverse };
            code_of(&thresholds, s.clamp(-1.0, 1.0))
        }));
        absmax.push(stored);
    }
    (codes, absmax)
}

/// A block's scale (its largest magnitude, floored at 1e-38) and the
/// absmax bitsandbytes stores for it (the floor kept for a partial block
/// only).
fn block_scale(block: &[f32]) -> (f32, f32) {
    let m = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = m.max(1e-38);
    (scale, if block.len() < BLOCK_SIZE { scale } else { m })
}

/// A float literal's values in f32 (bf16 and f16 widen exactly).
pub(crate) fn f32_values(lit: &Literal) -> Vec<f32> {
    let pairs = || lit.bytes.chunks_exact(2).map(|b| [b[0], b[1]]);
    match lit.ty.dtype {
        DType::F32 => lit
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        DType::BF16 => pairs()
            .map(|b| half::bf16::from_le_bytes(b).to_f32())
            .collect(),
        DType::F16 => pairs()
            .map(|b| half::f16::from_le_bytes(b).to_f32())
            .collect(),
        _ => lit.to_f64s().iter().map(|&v| v as f32).collect(),
    }
}

/// Block scales as the compiled steps take them, `f32 [.., rows, cols /
/// 64]` for a weight of `shape`.
fn scales_literal(shape: &[usize], scales: &[f32]) -> Literal {
    let mut dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    if let Some(last) = dims.last_mut() {
        *last = (*last + BLOCK_SIZE as i64 - 1) / BLOCK_SIZE as i64;
    }
    Literal {
        ty: TensorType::new(DType::F32, dims),
        bytes: scales.iter().flat_map(|a| a.to_le_bytes()).collect(),
    }
}

/// The block scales of the float weight `lit` as [`Nf4Tensor::absmax_literal`]
/// gives them, without finding every value's code.
pub fn absmax_of(lit: &Literal, double: bool) -> Literal {
    let absmax: Vec<f32> = f32_values(lit)
        .chunks(BLOCK_SIZE)
        .map(|b| block_scale(b).1)
        .collect();
    let absmax = if double {
        DoubleQuant::new(&absmax, mean(&absmax)).absmax()
    } else {
        absmax
    };
    let shape: Vec<usize> = lit.ty.dims.iter().map(|&d| d as usize).collect();
    scales_literal(&shape, &absmax)
}

/// bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map(signed=True)`):
/// for each decade `10^(i-6)`, `i` in 0..7, the midpoints of `2^i` equal
/// steps of [0.1, 1] scaled by it, with both signs; then 0 and 1; sorted.
/// 256 values in [-1, 1], computed in f32 as PyTorch's `linspace` spaces
/// them (the first half of the points from 0.1 up, the rest from 1 down,
/// each one fused multiply-add).
pub fn dynamic_map() -> Vec<f32> {
    let mut data: Vec<f32> = Vec::with_capacity(256);
    for i in 0..7i32 {
        let k = (1usize << i) + 1;
        let step = (1.0f32 - 0.1f32) / (k - 1) as f32;
        let point = |j: usize| {
            if j < k / 2 {
                step.mul_add(j as f32, 0.1)
            } else {
                (-step).mul_add((k - 1 - j) as f32, 1.0)
            }
        };
        let scale = 10f64.powi(i - 6) as f32;
        for j in 0..k - 1 {
            let mean = (point(j) + point(j + 1)) / 2.0;
            data.push(scale * mean);
            data.push(-scale * mean);
        }
    }
    data.push(0.0);
    data.push(1.0);
    data.sort_by(f32::total_cmp);
    data
}

/// How many entries the absmax quantization's lookup table has.
const LOOKUP: usize = 1 << 16;

impl DoubleQuant {
    /// The absmax of a weight quantized again, around `offset` (their
    /// mean), as bitsandbytes' `quantize_blockwise` does on the CPU: in
    /// blocks of 256, `t = (a - offset) / max|a - offset|` picks its code
    /// through a table of 65536 evenly spaced values in [-1, 1] (each
    /// holding the code whose interval contains it), not the exact
    /// nearest code.
    pub fn new(absmax: &[f32], offset: f32) -> DoubleQuant {
        let code = dynamic_map();
        let thresholds = midpoints(&code);
        let table: Vec<u8> = (0..LOOKUP)
            .map(|i| {
                let v = -1.0f32 + (2.0f32 * i as f32) / (LOOKUP - 1) as f32;
                code_of(&thresholds, v)
            })
            .collect();
        let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
        let mut codes = Vec::with_capacity(centred.len());
        let mut absmax2 = Vec::new();
        for block in centred.chunks(ABSMAX_BLOCK_SIZE) {
            let m = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            absmax2.push(m);
            if m == 0.0 {
                codes.extend(std::iter::repeat_n(0, block.len()));
                continue;
            }
            let inverse = 1.0 / m;
            codes.extend(block.iter().map(|&v| {
                let t = (v * inverse).clamp(-1.0, 1.0);
                let at = ((t + 1.0) * 0.5 * (LOOKUP - 1) as f32 + 0.5) as usize;
                table[at.min(LOOKUP - 1)]
            }));
        }
        DoubleQuant {
            codes,
            offset,
            absmax2,
            code,
            blocksize: ABSMAX_BLOCK_SIZE,
        }
    }

    /// The absmax back: `code[q] * absmax2[block] + offset`, rounded after
    /// each operation.
    pub fn absmax(&self) -> Vec<f32> {
        self.codes
            .iter()
            .enumerate()
            .map(|(b, &c)| self.code[c as usize] * self.absmax2[b / self.blocksize] + self.offset)
            .collect()
    }
}

impl Nf4Tensor {
    /// Quantizes a row-major weight of `shape` (`double`: the absmax in 8
    /// bits too).
    pub fn quantize(values: &[f32], shape: &[usize], double: bool) -> Nf4Tensor {
        let (indices, absmax) = quantize_nf4(values);
        // An odd count pads with the code of 0.
        let pad = code_of(&midpoints(&NF4_LEVELS), 0.0);
        let codes = indices
            .chunks(2)
            .map(|p| (p[0] << 4) | p.get(1).copied().unwrap_or(pad))
            .collect();
        let absmax = if double {
            Absmax::Double(DoubleQuant::new(&absmax, mean(&absmax)))
        } else {
            Absmax::Plain(absmax)
        };
        Nf4Tensor {
            shape: shape.to_vec(),
            codes,
            absmax,
        }
    }

    /// How many values the tensor holds.
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Each block's scale (dequantized when doubly quantized).
    pub(crate) fn block_absmax(&self) -> Vec<f32> {
        match &self.absmax {
            Absmax::Plain(a) => a.clone(),
            Absmax::Double(d) => d.absmax(),
        }
    }

    /// The code of each value, unpacked.
    pub fn indices(&self) -> Vec<u8> {
        let mut out: Vec<u8> = self.codes.iter().flat_map(|b| [b >> 4, b & 15]).collect();
        out.truncate(self.numel());
        out
    }

    /// The weight back in f32, row-major: `level[code] * absmax`.
    pub fn dequantize(&self) -> Vec<f32> {
        let absmax = self.block_absmax();
        self.indices()
            .iter()
            .enumerate()
            .map(|(i, &c)| NF4_LEVELS[c as usize] * absmax[i / BLOCK_SIZE])
            .collect()
    }

    /// [`Nf4Tensor::dequantize`] as a literal of the weight's shape in
    /// `dtype`.
    pub fn dequantized_literal(&self, dtype: DType) -> Literal {
        let values: Vec<f64> = self.dequantize().iter().map(|&v| f64::from(v)).collect();
        let dims: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        Literal::from_f64s(TensorType::new(dtype, dims), &values)
    }
}

impl Nf4Tensor {
    /// Quantizes a float literal (f32, or bf16 and f16 widened exactly).
    pub fn from_literal(lit: &Literal, double: bool) -> Nf4Tensor {
        let shape: Vec<usize> = lit.ty.dims.iter().map(|&d| d as usize).collect();
        Nf4Tensor::quantize(&f32_values(lit), &shape, double)
    }

    /// The codes as the compiled steps take them, `u8 [.., rows, cols / 2]`
    /// (see [`stored_types`]).
    pub fn codes_literal(&self) -> Literal {
        let mut dims: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        if let Some(last) = dims.last_mut() {
            *last = (*last + 1) / 2;
        }
        Literal {
            ty: TensorType::new(DType::U8, dims),
            bytes: self.codes.clone(),
        }
    }

    /// The block scales as the compiled steps take them, `f32 [.., rows,
    /// cols / 64]` (doubly quantized ones dequantized, as bitsandbytes does
    /// before it dequantizes the weight).
    pub fn absmax_literal(&self) -> Literal {
        scales_literal(&self.shape, &self.block_absmax())
    }
}

/// The absmax's mean, the offset of double quantization. torch.mean sums
/// in an order that depends on the CPU's vector width, so its f32 result
/// may differ from this one by an ulp (and then a rare absmax code by one).
fn mean(values: &[f32]) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    (values.iter().map(|&v| f64::from(v)).sum::<f64>() / values.len() as f64) as f32
}

/// A weight `[.., rows, cols]` in `dtype`, traced from its NF4 codes
/// (`u8 [.., rows, cols / 2]`) and block scales (`f32 [.., rows, cols /
/// 64]`): unpack the two nibbles, look each level up, scale by its block's
/// absmax in f32, round once. Placed just before the matmul, XLA fuses it.
///
/// Rows of a whole number of blocks (`cols % 64 == 0`) keep every block
/// inside one row, so the codes and the absmax are laid out by the same
/// partition rule as the weight they replace.
pub fn dequantize(codes: Tensor, absmax: Tensor, dtype: DType) -> Tensor {
    let d = codes.dims();
    let r = d.len();
    let nibble = |v: f64| full(TensorType::new(DType::U8, d.clone()), v);
    let high = codes.shift_right_logical(nibble(4.0));
    let low = codes.and(nibble(15.0));
    let mut pair_dims = d.clone();
    pair_dims.push(1);
    let mut weight_dims = d.clone();
    weight_dims[r - 1] *= 2;
    let indices = Tensor::concat(
        &[high.reshape(&pair_dims), low.reshape(&pair_dims)],
        r as i64,
    )
    .reshape(&weight_dims)
    .cast(DType::I32);
    let levels: Vec<f64> = NF4_LEVELS.iter().map(|&l| f64::from(l)).collect();
    let table = constant(Literal::from_f64s(
        TensorType::new(DType::F32, [16]),
        &levels,
    ));
    let mut block_dims = weight_dims.clone();
    block_dims[r - 1] /= BLOCK_SIZE as i64;
    block_dims.push(BLOCK_SIZE as i64);
    let keep: Vec<i64> = (0..r as i64).collect();
    let scaled = table.take(indices, 0).reshape(&block_dims)
        * absmax.cast(DType::F32).broadcast_in_dim(&block_dims, &keep);
    scaled.reshape(&weight_dims).cast(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hlo_ir::{interpret, trace};

    /// Deterministic values in [-1, 1) with a spread of magnitudes.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn each_value_takes_the_nearest_level_of_its_block() {
        let w = values(3 * 128, 1);
        let q = Nf4Tensor::quantize(&w, &[3, 128], false);
        let absmax = q.block_absmax();
        assert_eq!(absmax.len(), 6);
        for (i, (&c, &x)) in q.indices().iter().zip(&w).enumerate() {
            let m = absmax[i / 64];
            let want = f64::from(x) / f64::from(m);
            let err = (f64::from(NF4_LEVELS[c as usize]) - want).abs();
            let best = NF4_LEVELS
                .iter()
                .map(|&l| (f64::from(l) - want).abs())
                .fold(f64::INFINITY, f64::min);
            assert!(err <= best + 1e-6, "value {i}");
        }
    }

    #[test]
    fn an_odd_count_pads_the_last_byte_and_zero_blocks_stay_zero() {
        let mut w = values(64 + 7, 2);
        w[..64].iter_mut().for_each(|v| *v = 0.0);
        let q = Nf4Tensor::quantize(&w, &[71], false);
        assert_eq!(q.codes.len(), 36);
        assert_eq!(q.codes[35] & 15, 7, "padded with the code of 0");
        let back = q.dequantize();
        assert!(back[..64].iter().all(|&v| v == 0.0));
        assert_eq!(back.len(), 71);
    }

    #[test]
    fn the_dynamic_map_has_256_sorted_values_in_the_unit_interval() {
        let m = dynamic_map();
        assert_eq!(m.len(), 256);
        assert!(m.windows(2).all(|w| w[0] < w[1]));
        // The widest decade's last midpoint, 1 - 0.9 / 128, is the most negative.
        assert!((m[0] + (1.0 - 0.9 / 128.0)).abs() < 1e-6, "{}", m[0]);
        assert_eq!(m[255], 1.0);
        assert!(m.contains(&0.0));
    }

    #[test]
    fn double_quantized_absmax_are_close_to_the_plain_ones() {
        let w = values(300 * 64, 3);
        let plain = Nf4Tensor::quantize(&w, &[300, 64], false);
        let double = Nf4Tensor::quantize(&w, &[300, 64], true);
        assert_eq!(plain.codes, double.codes);
        let Absmax::Double(d) = &double.absmax else {
            panic!("not double")
        };
        assert_eq!((d.codes.len(), d.absmax2.len()), (300, 2));
        for (a, b) in plain.block_absmax().iter().zip(double.block_absmax()) {
            assert!((a - b).abs() < 0.01 * a, "{a} {b}");
        }
    }

    #[test]
    fn scales_alone_and_bf16_weights_give_what_quantizing_gives() {
        let w = values(3 * 128, 5);
        let ty = TensorType::new(DType::BF16, [3, 128]);
        let f64s: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
        let lit = Literal::from_f64s(ty, &f64s);
        let widened: Vec<f32> = lit.to_f64s().iter().map(|&v| v as f32).collect();
        for double in [false, true] {
            let q = Nf4Tensor::from_literal(&lit, double);
            assert_eq!(q, Nf4Tensor::quantize(&widened, &[3, 128], double));
            assert_eq!(absmax_of(&lit, double), q.absmax_literal());
            assert_eq!(q.absmax_literal().ty.dims, vec![3, 2]);
            assert_eq!(q.codes_literal().ty.dims, vec![3, 64]);
        }
    }

    #[test]
    fn the_traced_dequantization_equals_the_host_one() {
        let w = values(4 * 128, 4);
        let q = Nf4Tensor::quantize(&w, &[4, 128], false);
        let f = trace(
            "dequantize",
            &[
                ("codes", TensorType::new(DType::U8, [4, 64])),
                ("absmax", TensorType::new(DType::F32, [4, 2])),
            ],
            |p| dequantize(p["codes"], p["absmax"], DType::F32),
        )
        .unwrap();
        let codes: Vec<f64> = q.codes.iter().map(|&c| f64::from(c)).collect();
        let absmax: Vec<f64> = q.block_absmax().iter().map(|&a| f64::from(a)).collect();
        let out = interpret(
            &f,
            &[
                Literal::from_f64s(TensorType::new(DType::U8, [4, 64]), &codes),
                Literal::from_f64s(TensorType::new(DType::F32, [4, 2]), &absmax),
            ],
        )
        .unwrap();
        let want: Vec<f64> = q.dequantize().iter().map(|&v| f64::from(v)).collect();
        assert_eq!(out[0].to_f64s(), want);
    }
}
