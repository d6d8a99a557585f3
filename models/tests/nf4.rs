//! NF4 as bitsandbytes makes it: codes, block scales, double quantization
//! and dequantized values equal `bitsandbytes.functional.quantize_4bit(...,
//! blocksize=64, quant_type="nf4")` bit for bit on the fixture tensors of
//! `scripts/make_nf4_fixtures.py` (bitsandbytes 0.50.2 on the CPU): random
//! f32 and bf16 weights, a partial last block, an all-zero block, exact
//! extremes, values on and one ulp either side of the thresholds between
//! levels, and more than 256 blocks.

use std::collections::HashMap;
use std::path::PathBuf;

use hlo_ir::{DType, Literal};
use hlo_models::io::read_safetensors;
use hlo_models::nf4::{dynamic_map, Absmax, DoubleQuant, Nf4Tensor, NF4_LEVELS};

fn fixture() -> HashMap<String, Literal> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/nf4/quantize.safetensors");
    read_safetensors(&path)
        .expect("the NF4 fixture (scripts/make_nf4_fixtures.py)")
        .into_iter()
        .collect()
}

fn f32s(lit: &Literal) -> Vec<f32> {
    lit.to_f64s().iter().map(|&v| v as f32).collect()
}

/// Values as the input's dtype holds them (bitsandbytes returns the
/// dequantized weight in the input's dtype).
fn rounded(values: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::BF16 => values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect(),
        _ => values.to_vec(),
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

const INPUTS: [&str; 5] = ["a", "b", "c", "d", "e"];

#[test]
fn codes_and_absmax_equal_bitsandbytes() {
    let fx = fixture();
    for x in INPUTS {
        let input = &fx[&format!("{x}.input")];
        let shape: Vec<usize> = input.ty.dims.iter().map(|&d| d as usize).collect();
        let q = Nf4Tensor::quantize(&f32s(input), &shape, false);
        assert_eq!(q.codes, fx[&format!("{x}.codes")].bytes, "{x}: codes");
        let Absmax::Plain(absmax) = &q.absmax else {
            panic!("{x}: plain absmax expected")
        };
        assert_eq!(
            bits(absmax),
            bits(&f32s(&fx[&format!("{x}.absmax")])),
            "{x}: absmax"
        );
        if let Some(want) = fx.get(&format!("{x}.dequantized")) {
            let got = rounded(&q.dequantize(), input.ty.dtype);
            assert_eq!(bits(&got), bits(&f32s(want)), "{x}: dequantized");
        }
    }
}

#[test]
fn double_quantized_absmax_equal_bitsandbytes() {
    let fx = fixture();
    assert_eq!(bits(&dynamic_map()), bits(&f32s(&fx["a.dq.code2"])));
    assert_eq!(bits(&NF4_LEVELS), bits(&f32s(&fx["nf4.code"])));
    for x in INPUTS {
        let input = &fx[&format!("{x}.input")];
        let shape: Vec<usize> = input.ty.dims.iter().map(|&d| d as usize).collect();
        let absmax = f32s(&fx[&format!("{x}.absmax")]);
        let offset = f32s(&fx[&format!("{x}.dq.offset")])[0];
        // The codes take the offset torch.mean gave (its summation order is
        // the CPU's); ours is the same mean to within an ulp or two.
        let q = Nf4Tensor::quantize(&f32s(input), &shape, true);
        let Absmax::Double(ours) = &q.absmax else {
            panic!("{x}: double absmax expected")
        };
        assert!(
            (ours.offset - offset).abs() <= 4.0 * f32::EPSILON * offset.abs(),
            "{x}: offset {} vs {offset}",
            ours.offset
        );
        assert_eq!(q.codes, fx[&format!("{x}.dq.codes")].bytes, "{x}: codes");
        let d = DoubleQuant::new(&absmax, offset);
        assert_eq!(
            d.codes,
            fx[&format!("{x}.dq.absmax")].bytes,
            "{x}: absmax codes"
        );
        assert_eq!(
            bits(&d.absmax2),
            bits(&f32s(&fx[&format!("{x}.dq.absmax2")])),
            "{x}: absmax2"
        );
        assert_eq!(
            fx[&format!("{x}.dq.blocksize2")].to_f64s(),
            vec![d.blocksize as f64]
        );
        if let Some(want) = fx.get(&format!("{x}.dq.dequantized")) {
            let q = Nf4Tensor {
                absmax: Absmax::Double(d),
                ..q
            };
            let got = rounded(&q.dequantize(), input.ty.dtype);
            assert_eq!(bits(&got), bits(&f32s(want)), "{x}: dequantized");
        }
    }
}
