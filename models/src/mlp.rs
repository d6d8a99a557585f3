//! A two-layer perceptron: the example program of `hlo-train dump-hlo` until
//! Llama lands, and the program whose lowered text the snapshots hold.

use hlo_ir::{call, scope, trace, DType, Function, Outputs, TensorType, TraceError};

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

/// One SGD step of [`two_layer_mlp`] on a mean-squared-error loss: inputs
/// are the MLP's (`x`, parameters), the `target` and the learning rate
/// `lr`; outputs are `loss` and each parameter's updated value under its own
/// name. The gradient comes from [`hlo_ir::value_and_grad`].
pub fn two_layer_mlp_sgd_step(
    batch: i64,
    d_in: i64,
    d_hidden: i64,
    d_out: i64,
    dtype: DType,
) -> Result<Function, Box<dyn std::error::Error + Send + Sync>> {
    let forward = two_layer_mlp(batch, d_in, d_hidden, d_out, dtype)?;
    let mut inputs: Vec<(String, TensorType)> = forward
        .inputs
        .iter()
        .map(|b| (b.name.clone(), forward.ty(b.value).clone()))
        .collect();
    inputs.push(("target".into(), TensorType::new(dtype, [batch, d_out])));
    let n = forward.inputs.len();
    let with_loss = trace("mlp_loss", &inputs, |i| {
        let y = call(&forward, &i.tensors()[..n])[0];
        let err = y - i["target"];
        Outputs::new().add("loss", scope("loss", || (err * err).mean(&[0, 1])))
    })?;
    let params = [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ];
    let grads = hlo_ir::value_and_grad(&with_loss, "loss", &params)?;
    let mut step_inputs = inputs;
    step_inputs.push(("lr".into(), TensorType::scalar(dtype)));
    let step = trace("mlp_sgd_step", &step_inputs, |i| {
        let out = call(&grads, &i.tensors()[..grads.inputs.len()]);
        let mut o = Outputs::new().add("loss", out[0]);
        for (k, p) in params.iter().enumerate() {
            o = o.add(*p, scope("sgd", || i[*p] - i["lr"] * out[1 + k]));
        }
        o
    })?;
    Ok(step)
}

/// Partition rules for the example MLP: the batch over `("dp", "fsdp")`,
/// weights `[in, out]` over `("fsdp", "mp")`, biases over `mp`.
pub fn rules() -> hlo_partitioner::Rules {
    use hlo_partitioner::{PartitionSpec, Rules};
    let p = |d: &[&[&str]]| PartitionSpec::new(d);
    Rules::new(&[
        (r"^(x|target|y)$", p(&[&["dp", "fsdp"], &[]])),
        (r"weight$", p(&[&["fsdp"], &["mp"]])),
        (r"bias$", p(&[&["mp"]])),
    ])
    .expect("the MLP rules compile")
}
