//! The `backend_config` of the cuDNN attention calls: XLA's
//! `GpuBackendConfig` as JSON, holding a `cudnn_fmha_backend_config`. XLA's
//! GPU compiler reads the call's whole description from it (the masking,
//! the scale, which dimensions the two batched products contract), so it
//! is written field for field as JAX writes it for the `[B, T, N, H]`
//! layout, with Python's `json.dumps` spacing.

use super::{CudnnFmha, Shape};
use crate::DType;

/// `["0", "2"]`: XLA's int64 proto fields are JSON strings.
fn strings(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(|x| format!("\"{x}\"")).collect();
    format!("[{}]", items.join(", "))
}

/// One product's dot dimension numbers, `"name": {...}`.
fn dot_dims(name: &str, (lc, rc): (i64, i64), (lb, rb): (&[i64], &[i64])) -> String {
    format!(
        "\"{name}\": {{\"lhs_contracting_dimensions\": {}, \"rhs_contracting_dimensions\": {}, \
         \"lhs_batch_dimensions\": {}, \"rhs_batch_dimensions\": {}}}",
        strings(&[lc]),
        strings(&[rc]),
        strings(lb),
        strings(rb)
    )
}

/// The products' dimension numbers for Q, K, V in `[B, T, N, H]` and the
/// scores P in `[B, N, T, S]`: the forward's two (`Q·Kᵀ -> P`, `P·V -> O`)
/// or the backward's four (`dP·Q -> dK`, `dP·K -> dQ`, `P·dO -> dV`,
/// `dO·Vᵀ -> dP`).
fn products(backward: bool) -> Vec<String> {
    // Batch over (B, N): dimensions 0 and 2 of a [B, T, N, H] operand,
    // 0 and 1 of the scores.
    let (btnh, bnts): (&[i64], &[i64]) = (&[0, 2], &[0, 1]);
    if backward {
        vec![
            dot_dims(
                "bmm1_grad_gemm1_dot_dimension_numbers",
                (2, 1),
                (bnts, btnh),
            ),
            dot_dims(
                "bmm1_grad_gemm2_dot_dimension_numbers",
                (3, 1),
                (bnts, btnh),
            ),
            dot_dims(
                "bmm2_grad_gemm1_dot_dimension_numbers",
                (2, 1),
                (bnts, btnh),
            ),
            dot_dims(
                "bmm2_grad_gemm2_dot_dimension_numbers",
                (3, 3),
                (btnh, btnh),
            ),
        ]
    } else {
        vec![
            dot_dims("bmm1_dot_dimension_numbers", (3, 3), (btnh, btnh)),
            dot_dims("bmm2_dot_dimension_numbers", (3, 1), (bnts, btnh)),
        ]
    }
}

/// The scores' shape `[B, N, T, S]` as an XLA `ShapeProto` (row-major).
fn scores_shape(shape: &Shape) -> String {
    let element = match shape.dtype {
        DType::F16 => "F16",
        _ => "BF16",
    };
    format!(
        "{{\"element_type\": \"{element}\", \"dimensions\": {}, \"tuple_shapes\": [], \
         \"layout\": {{\"dim_level_types\": [], \"dim_unique\": [], \"dim_ordered\": [], \
         \"minor_to_major\": {}, \"tiles\": [], \"element_size_in_bits\": \"0\", \
         \"memory_space\": \"0\", \"index_primitive_type\": \"PRIMITIVE_TYPE_INVALID\", \
         \"pointer_primitive_type\": \"PRIMITIVE_TYPE_INVALID\", \
         \"dynamic_shape_metadata_prefix_bytes\": \"0\"}}, \
         \"is_dynamic_dimension\": [false, false, false, false]}}",
        strings(&[shape.b, shape.n, shape.t, shape.s]),
        strings(&[3, 2, 1, 0])
    )
}

/// The whole `backend_config` of the forward or backward call of
/// `shape` (the per-device shape inside a manual region).
pub(super) fn backend_config(shape: &Shape, config: &CudnnFmha, backward: bool) -> String {
    // The algorithm is left for XLA's autotuner to pick (`algo_id` 0,
    // workspace 0); the knobs are those JAX passes.
    let algorithm = "{\"algo_id\": \"0\", \"math_type\": \"TENSOR_OP_MATH\", \
                     \"tuning_knobs\": {\"17\": \"1\", \"24\": \"0\"}, \
                     \"is_cudnn_frontend\": true, \"workspace_size\": \"0\"}";
    // `{:?}` writes the shortest text that reads back as the same f64,
    // with a decimal point, as Python's float repr does.
    format!(
        "{{\"operation_queue_id\": \"0\", \"cudnn_fmha_backend_config\": {{\
         \"algorithm\": {algorithm}, \"fmha_scale\": {:?}, \
         \"intermediate_tensor_shape\": {}, \"is_flash_attention\": true, \
         \"mask_type\": \"CAUSAL\", {}, \"dropout_rate\": 0.0, \"seed\": 42, \
         \"sliding_window_length\": {}, \"max_seg_per_batch\": 1, \
         \"is_paged_attention\": false}}}}",
        config.scale,
        scores_shape(shape),
        products(backward).join(", "),
        config.window.unwrap_or(0),
    )
}
