//! A two-layer perceptron: the example program of `hlo-train dump-hlo` until
//! Llama lands, and the program whose lowered text the snapshots hold.

use hlo_ir::{scope, trace, DType, Function, Outputs, TensorType, TraceError};

/// `y = tanh(x·W0 + b0)·W1 + b1` over a batch, with parameters named as a
/// checkpoint would name them (`layers.0.weight`, ...).
///
/// ```
/// let f = hlo_models::mlp::two_layer_mlp(8, 16, 32, 4, hlo_ir::DType::F32).unwrap();
/// assert_eq!(f.inputs[1].name, "layers.0.weight");
/// ```
pub fn two_layer_mlp(
    batch: i64,
    d_in: i64,
    d_hidden: i64,
    d_out: i64,
    dtype: DType,
) -> Result<Function, TraceError> {
    let t = |dims: &[i64]| TensorType::new(dtype, dims.to_vec());
    let inputs = [
        ("x", t(&[batch, d_in])),
        ("layers.0.weight", t(&[d_in, d_hidden])),
        ("layers.0.bias", t(&[d_hidden])),
        ("layers.1.weight", t(&[d_hidden, d_out])),
        ("layers.1.bias", t(&[d_out])),
    ];
    trace("mlp", &inputs, |p| {
        let h = scope("layers.0", || {
            (p["x"].matmul(p["layers.0.weight"]) + p["layers.0.bias"]).tanh()
        });
        let y = scope("layers.1", || {
            h.matmul(p["layers.1.weight"]) + p["layers.1.bias"]
        });
        Outputs::new().add("y", y)
    })
}
