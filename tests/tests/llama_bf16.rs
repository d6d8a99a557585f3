//! Llama in bf16 against PyTorch + PEFT in bf16: one LoRA SGD step of the
//! `gqa_llama3` fixture model (weights rounded to bf16, the adapter in f32
//! as PEFT keeps it on a bf16 base), its loss, logits and updated adapter
//! (fixture from `scripts/make_bf16_step_fixture.py`: torch 2.9.1,
//! transformers 5.24, PEFT 0.21.2, eager attention), on the CPU plugin.

use hlo_e2e::{client, expected_in, fixture_dir, fixture_logits, max_abs_diff};
use hlo_ir::{DType, Literal, TensorType};
use hlo_models::adapter::Adapter;
use hlo_models::checkpoint::Checkpoint;
use hlo_models::train::{train_step, Optimizer, Schedule, TrainConfig};
use hlo_runtime::{CompiledFunction, HostArray};

const FIXTURE: &str = "llama/gqa_llama3";
const FILE: &str = "bf16_step.safetensors";
const LR: f64 = 0.05;

/// One step's results: the loss, the logits and each adapter tensor's
/// change (by PEFT's key, in PEFT's layout).
struct StepResult {
    loss: f64,
    logits: Vec<f64>,
    updates: Vec<(String, Vec<f64>)>,
}

/// The adapter tensors before the step, by PEFT's key.
fn start() -> Vec<(String, Vec<f64>)> {
    let dir = fixture_dir(FIXTURE).join("adapter");
    hlo_models::io::read_safetensors(&dir.join("adapter_model.safetensors"))
        .unwrap()
        .into_iter()
        .map(|(k, l)| (k, l.to_f64s()))
        .collect()
}

/// The fixture's step under `prefix`: `bf16` (PyTorch's) or `f64` (the
/// same step computed exactly).
fn theirs(prefix: &str) -> StepResult {
    let dir = fixture_dir(FIXTURE);
    let get = |key: &str| expected_in(&dir, FILE, &format!("{prefix}.{key}")).to_f64s();
    let updates = start()
        .into_iter()
        .map(|(k, before)| {
            let after = get(&format!("sgd.{k}"));
            let d = after.iter().zip(&before).map(|(a, b)| a - b).collect();
            (k, d)
        })
        .collect();
    StepResult {
        loss: get("loss")[0],
        logits: get("logits"),
        updates,
    }
}

/// PEFT's key of our LoRA tensor `name`, and whether it is one (`[in, r]`
/// and `[r, out]` here, transposed there).
fn peft_key(name: &str) -> Option<String> {
    let (m, ab) = name
        .strip_suffix(".lora_a")
        .map(|m| (m, "A"))
        .or_else(|| name.strip_suffix(".lora_b").map(|m| (m, "B")))?;
    Some(format!("base_model.model.{m}.lora_{ab}.weight"))
}

/// `v` (`[rows, cols]`, row-major) transposed.
fn transposed(v: &[f64], ty: &TensorType) -> Vec<f64> {
    let (r, c) = (ty.dims[0] as usize, ty.dims[1] as usize);
    (0..c)
        .flat_map(|j| (0..r).map(move |i| v[i * c + j]))
        .collect()
}

/// Our bf16 step from the same weights and adapter, on the same rows.
fn ours() -> StepResult {
    let dir = fixture_dir(FIXTURE);
    let ckpt = Checkpoint::open(&dir).unwrap();
    let config = &ckpt.config;
    let adapter = Adapter::load(&dir.join("adapter"), config).unwrap();
    let ids = expected_in(&dir, FILE, "input_ids");
    let (b, s) = (ids.ty.dims[0], ids.ty.dims[1]);
    let mut tc = TrainConfig::new(DType::BF16, b, s)
        .with_lora(Some(adapter.lora.clone()))
        .with_lr(LR, Schedule::Constant { warmup: 0 })
        .with_optimizer(Optimizer::Sgd);
    tc.clip_norm = None;
    // HF's eager attention, which the fixture ran.
    tc.attention = hlo_models::attention::AttentionKind::Naive;
    let f = train_step(config, &tc).unwrap().function;
    let inputs: Vec<HostArray> = f
        .inputs
        .iter()
        .map(|binding| {
            let ty = f.ty(binding.value).clone();
            HostArray::from(match binding.name.as_str() {
                "input_ids" => ids.clone(),
                // Every next token learned, as HF's loss with labels = ids.
                "loss_mask" => {
                    let m: Vec<f64> = (0..b * s).map(|k| f64::from(k % s != s - 1)).collect();
                    Literal::from_f64s(ty, &m)
                }
                "step" => Literal::scalar(DType::I32, 0.0),
                n => match adapter.get(n) {
                    Some(t) => t.clone(),
                    None => ckpt.read(n, DType::BF16).unwrap(),
                },
            })
        })
        .collect();
    let out = CompiledFunction::new(client(), &f)
        .unwrap()
        .run(&inputs)
        .unwrap();
    let by_name = |name: &str| {
        let k = f.outputs.iter().position(|o| o.name == name).unwrap();
        Literal::from(out[k].clone())
    };
    let updates = f
        .outputs
        .iter()
        .filter_map(|o| {
            let key = peft_key(&o.name)?;
            let before = adapter.get(&o.name).unwrap();
            let after = by_name(&o.name).to_f64s();
            let d: Vec<f64> = after
                .iter()
                .zip(before.to_f64s())
                .map(|(a, b)| a - b)
                .collect();
            Some((key, transposed(&d, &before.ty)))
        })
        .collect();
    StepResult {
        loss: by_name("loss").to_f64s()[0],
        logits: fixture_logits(&dir, DType::BF16, true, false),
        updates,
    }
}

/// The largest differences between two steps: loss, logits, updates.
fn diffs(a: &StepResult, b: &StepResult) -> [f64; 3] {
    let updates = a
        .updates
        .iter()
        .map(|(k, u)| {
            let (_, v) = b.updates.iter().find(|(l, _)| l == k).unwrap();
            max_abs_diff(u, v)
        })
        .fold(0.0, f64::max);
    [
        (a.loss - b.loss).abs(),
        max_abs_diff(&a.logits, &b.logits),
        updates,
    ]
}

/// The root mean square of `a - b`.
fn rms_diff(a: &[f64], b: &[f64]) -> f64 {
    let sum: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    (sum / a.len() as f64).sqrt()
}

/// The largest magnitude among `values`.
fn largest<'a>(values: impl IntoIterator<Item = &'a f64>) -> f64 {
    values.into_iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// bf16's unit roundoff: 8 significant bits.
const U: f64 = 1.0 / 256.0;

/// How many values a token's forward pass rounds to bf16 one after
/// another, as HF and PEFT compute a Llama layer with every projection
/// adapted: per layer the input norm's cast and weight product (2), the
/// q/k/v projection and PEFT's sum with its branch (2), the rotary
/// embedding's two products and sum (3), the scores and their scaling
/// (2), the probabilities' cast (1), their product with the values (1),
/// the output projection and its branch (2), the residual sum (1), the
/// second norm (2), gate or up and its branch (2), the activation and
/// its product with up (2), down and its branch (2), the residual sum
/// (1): 23; then the final norm (2) and the LM head (1).
fn roundings_in_series(layers: i64) -> f64 {
    (23 * layers + 3) as f64
}

#[test]
fn a_bf16_lora_step_matches_peft_in_bf16() {
    let (mine, torch, exact) = (ours(), theirs("bf16"), theirs("f64"));
    assert_eq!(mine.updates.len(), torch.updates.len());
    let dir = fixture_dir(FIXTURE);
    let layers = Checkpoint::open(&dir).unwrap().config.num_hidden_layers;
    // Every next token of each row is learned.
    let ids = expected_in(&dir, FILE, "input_ids").ty.dims;
    let tokens = (ids[0] * (ids[1] - 1)) as f64;
    // Each bf16 evaluation errs by about √R·u of a value's scale (R
    // roundings in series, each within u, behaving as independent: Higham
    // and Mary's probabilistic bound); two evaluations that round at
    // different points (XLA fuses elementwise chains and may keep them in
    // f32) differ by √2 times that. The gradient also passes every
    // rounding again backwards: 2R. The loss is a mean over T tokens of
    // cross-entropies, each moved at most twice as far as the logits,
    // their errors independent across tokens.
    let r = roundings_in_series(layers);
    let logits_tol = (2.0 * r).sqrt() * U * largest(&torch.logits);
    let updates_tol =
        (4.0 * r).sqrt() * U * largest(torch.updates.iter().flat_map(|(_, u)| u.iter()));
    let loss_tol = 2.0 * logits_tol / tokens.sqrt();
    let d = diffs(&mine, &torch);
    let noise = diffs(&torch, &exact);
    let names = ["loss", "logits", "adapter updates"];
    for (k, tol) in [loss_tol, logits_tol, updates_tol].into_iter().enumerate() {
        println!(
            "{}: max |ours - PyTorch| {:.3e} (tolerance {tol:.3e}); PyTorch's own from the f64 step {:.3e}",
            names[k], d[k], noise[k]
        );
        assert!(d[k] <= tol, "{}: {:.3e} above {tol:.3e}", names[k], d[k]);
    }
    // Against the exact (f64) step: a program that rounds where PyTorch
    // keeps f32 errs more than PyTorch does (RMSNorm in bf16: 1.9 times);
    // one that rounds at as many points errs alike (0.93 times here),
    // within the spread of an RMS over these 18 tokens' logits.
    let (ours_err, torch_err) = (
        rms_diff(&mine.logits, &exact.logits),
        rms_diff(&torch.logits, &exact.logits),
    );
    println!("logits' RMS error from the f64 step: ours {ours_err:.3e}, PyTorch {torch_err:.3e}");
    assert!(
        ours_err <= 1.5 * torch_err,
        "our bf16 logits err {ours_err:.3e} (RMS) from the exact step, PyTorch's {torch_err:.3e}"
    );
}
