//! gpt-oss's released expert weights in MXFP4 (the OCP microscaling
//! format), dequantized as the checkpoint is read, as transformers does
//! on a machine without the MXFP4 kernels
//! (`integrations/mxfp4.py`'s `convert_moe_packed_tensors`).
//!
//! An expert tensor the model holds as `[experts, in, out]` is stored as
//! `<name>_blocks` (u8 `[experts, out, in/32, 16]`: 32 FP4 e2m1 codes per
//! block, two a byte, the low nibble first) and `<name>_scales` (u8
//! `[experts, out, in/32]`: each block's power of two, biased by 127).
//! Every dequantized value is a code's value times a power of two, so it
//! is exact in bf16 and f32.

/// The value of each 4-bit e2m1 code (sign bit 3).
pub(crate) const FP4_VALUES: [f64; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Values per block (one scale each).
pub const BLOCK: i64 = 32;

/// The scale byte E8M0 reserves for NaN.
pub(crate) const NAN_SCALE: u8 = 255;

/// 2¹²⁸: the first power of two past bf16's and f32's range. A
/// dequantized value (a code's value times a power of two) below it is
/// exact in both; one at or above it would be infinite.
///
/// ```
/// assert_eq!(hlo_models::mxfp4::RANGE, 2f64.powi(128));
/// ```
pub const RANGE: f64 = 3.402_823_669_209_385e38;

/// The suffixes of a quantized tensor's two stored parts.
pub(crate) const BLOCKS_SUFFIX: &str = "_blocks";
pub(crate) const SCALES_SUFFIX: &str = "_scales";

/// The shapes of the blocks and scales that store a tensor held as
/// `held` (`[experts, in, out]`); None when `in` is not whole blocks.
pub fn stored_shapes(held: &[i64]) -> Option<(Vec<i64>, Vec<i64>)> {
    let [e, din, dout] = held else {
        return None;
    };
    if din % BLOCK != 0 {
        return None;
    }
    let groups = din / BLOCK;
    Some((vec![*e, *dout, groups, BLOCK / 2], vec![*e, *dout, groups]))
}

/// The values of a tensor held as `held` (`[experts, in, out]`, row
/// major) from its `blocks` and `scales` bytes (shaped as
/// [`stored_shapes`] says).
///
/// ```
/// // One expert, 32 inputs, 1 output: codes 1 (0.5) and 10 (-1.0) in the
/// // first byte, scale 2^1.
/// let mut blocks = vec![0u8; 16];
/// blocks[0] = 0xA1;
/// let v = hlo_models::mxfp4::dequantize(&blocks, &[128], &[1, 32, 1]);
/// assert_eq!(&v[..3], &[1.0, -2.0, 0.0]);
/// ```
pub fn dequantize(blocks: &[u8], scales: &[u8], held: &[i64]) -> Vec<f64> {
    let (e, din, dout) = (held[0] as usize, held[1] as usize, held[2] as usize);
    let groups = din / BLOCK as usize;
    let half = BLOCK as usize / 2;
    let mut out = vec![0.0; e * din * dout];
    for x in 0..e {
        for o in 0..dout {
            for g in 0..groups {
                let row = (x * dout + o) * groups + g;
                let scale = 2f64.powi(i32::from(scales[row]) - 127);
                for b in 0..half {
                    let byte = blocks[row * half + b];
                    for (k, code) in [byte & 0x0F, byte >> 4].into_iter().enumerate() {
                        let i = g * BLOCK as usize + 2 * b + k;
                        out[(x * din + i) * dout + o] = FP4_VALUES[code as usize] * scale;
                    }
                }
            }
        }
    }
    out
}
