//! Preference losses against TRL 1.16's own trainers (fixtures made by
//! `scripts/make_preference_fixtures.py`; formulas in
//! `tests/fixtures/preference/FORMULAS.md`): on the tiny f32 Llama and
//! four pre-tokenized pairs, the traced loss of DPO (sigmoid), IPO,
//! SimPO (CPO-SimPO and `cpo_alpha` 0) and ORPO gives TRL's first-step
//! loss and logged metrics, and one SGD and one AdamW step of the LoRA
//! adapter give TRL's adapter after it. Compiled and run on the CPU plugin.
//!
//! DPO's and IPO's reference is the base with the adapter off (TRL's for a
//! fresh adapter), a frozen copy of the adapter training starts from
//! (TRL's for an existing one), or another adapter.

use std::collections::BTreeMap;
use std::path::PathBuf;

use hlo_e2e::{client, fixture_dir};
use hlo_ir::{value_and_grad, DType, Literal, TensorType};
use hlo_models::adapter::Adapter;
use hlo_models::checkpoint::Checkpoint;
use hlo_models::cpo::CpoLoss;
use hlo_models::io::read_safetensors;
use hlo_models::preference::{reference_name, PreferenceLoss, Reference};
use hlo_models::train::{
    preference_loss, preference_train_step, Optimizer, Preference, Schedule, TrainConfig,
};
use hlo_runtime::{CompiledFunction, HostArray};
use serde_json::Value;

fn preference(path: &str) -> PathBuf {
    fixture_dir("preference").join(path)
}

/// The fixture's pairs as one batch: rows of prompt + chosen, then of
/// prompt + rejected, right-padded with the pad id to the longest; the
/// loss mask on the positions that predict a completion token; segment
/// ids 1 on real tokens.
struct Batch {
    ids: Vec<Vec<u32>>,
    loss_mask: Vec<Vec<f64>>,
    segment_ids: Vec<Vec<f64>>,
    pairs: usize,
}

fn batch(pad: u32) -> Batch {
    let text = std::fs::read_to_string(preference("data_ids.jsonl")).unwrap();
    let pairs: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let mut rows = Vec::new();
    for side in ["chosen_ids", "rejected_ids"] {
        for p in &pairs {
            rows.push((ids(&p["prompt_ids"]), ids(&p[side])));
        }
    }
    let seq = rows.iter().map(|(p, c)| p.len() + c.len()).max().unwrap();
    let mut b = Batch {
        ids: Vec::new(),
        loss_mask: Vec::new(),
        segment_ids: Vec::new(),
        pairs: pairs.len(),
    };
    for (prompt, completion) in rows {
        let mut row = prompt.clone();
        row.extend(&completion);
        let mut mask = vec![0.0; seq];
        for t in prompt.len()..row.len() {
            mask[t - 1] = 1.0;
        }
        let mut real = vec![1.0; row.len()];
        real.resize(seq, 0.0);
        row.resize(seq, pad);
        b.ids.push(row);
        b.loss_mask.push(mask);
        b.segment_ids.push(real);
    }
    b
}

/// The fixture's `expected.json` (of `dir`: `""`, or `"cpo/"` for CPO's
/// cases, `scripts/make_preference_fixtures.py --cpo`).
fn expected_in(dir: &str) -> Value {
    let path = preference(&format!("{dir}expected.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn expected() -> Value {
    expected_in("")
}

struct Case {
    name: String,
    loss: PreferenceLoss,
    /// The adapter training starts from.
    adapter: &'static str,
    /// The reference's adapter (None: the base).
    reference: Option<&'static str>,
    expected: Value,
    /// The fixture folder of its expected figures (`""` or `"cpo/"`).
    dir: &'static str,
}

/// The case `<method>.<start>.<optimizer>`: TRL's reference for a
/// fresh adapter is the base, for a trained one a frozen copy of it; the
/// `ref` cases start fresh against `adapters/ref`.
fn case(name: &str, loss: PreferenceLoss, start: &'static str) -> Case {
    case_in("", name, loss, start)
}

fn case_in(dir: &'static str, name: &str, loss: PreferenceLoss, start: &'static str) -> Case {
    let (adapter, reference) = match start {
        "fresh" => ("fresh", None),
        "init" => ("init", Some("init")),
        _ => ("fresh", Some("ref")),
    };
    Case {
        name: name.to_string(),
        loss,
        adapter,
        reference: reference.filter(|_| loss.needs_reference()),
        expected: expected_in(dir)[name].clone(),
        dir,
    }
}

/// Runs `c`'s loss with gradients on the fixture; checks the loss and the
/// metrics against TRL's, then the adapter after one SGD (or AdamW) step.
fn check(c: &Case, sgd: bool) {
    let setup = Setup::new(c);
    let (rows, seq) = setup.shape();
    let tc = TrainConfig {
        scan_layers: false,
        ..TrainConfig::new(DType::F32, rows, seq).with_lora(Some(setup.adapter.lora.clone()))
    };
    let f = preference_loss(
        &setup.ckpt.config,
        &tc,
        &Preference::new(c.loss, setup.kind()),
    )
    .unwrap();
    let names: Vec<&str> = setup
        .adapter
        .tensors
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    let g = value_and_grad(&f, "loss", &names).unwrap();
    let out = setup.run(&g);
    let mut grads = BTreeMap::new();
    for (b, v) in g.outputs.iter().zip(&out) {
        let v = v.to_f64_vec();
        if let Some(name) = b.name.strip_prefix("grads.") {
            grads.insert(name, v);
            continue;
        }
        let want = match b.name.as_str() {
            "loss" => c.expected["loss"].as_f64(),
            // Ours, not TRL's: the share of pairs whose chosen side the
            // policy finds likelier, from the fixture's per-pair log-probs
            // (the ones the loss reads: sums, or per-token means).
            "logps/accuracies" => Some(policy_preference(c)),
            name => c.expected["metrics"][name].as_f64(),
        };
        let want = want.unwrap_or_else(|| panic!("{}: TRL logs no {}", c.name, b.name));
        // CPO's and ORPO's `logits/*` average padding positions too, whose
        // logits HF computes under its attention mask: not compared.
        if !b.name.starts_with("logits/") || c.loss.needs_reference() {
            close(c, &b.name, v[0], want);
        }
    }
    // The gradient's global norm as TRL logs it (clipping off), and the
    // adapter after one step.
    let norm = grads.values().flatten().map(|x| x * x).sum::<f64>().sqrt();
    close(
        c,
        "grad_norm",
        norm,
        c.expected["metrics"]["grad_norm"].as_f64().unwrap(),
    );
    let lr = c.expected["settings"]["learning_rate"].as_f64().unwrap();
    let stepped = setup
        .adapter
        .tensors
        .iter()
        .map(|(n, t)| {
            let v: Vec<f64> = t
                .to_f64s()
                .iter()
                .zip(&grads[n.as_str()])
                .map(|(p, g)| match sgd {
                    true => p - lr * g,
                    // AdamW's first step from zero moments (torch's
                    // defaults, no weight decay): m̂ = g, v̂ = g².
                    false => p - lr * g / (g.abs() + 1e-8),
                })
                .collect();
            (n.clone(), Literal::from_f64s(t.ty.clone(), &v))
        })
        .collect();
    setup.assert_stepped(c, stepped);
}

/// What a case's programs read: the base, the adapters and the batch.
struct Setup {
    ckpt: Checkpoint,
    adapter: Adapter,
    reference: Option<Adapter>,
    data: Batch,
}

impl Setup {
    fn new(c: &Case) -> Setup {
        let ckpt = Checkpoint::open(&fixture_dir("llama/gqa_llama3")).unwrap();
        let load = |a: &str| Adapter::load(&preference(&format!("adapters/{a}")), &ckpt.config);
        let pad = expected()["_meta"]["pad_token_id"].as_u64().unwrap() as u32;
        Setup {
            adapter: load(c.adapter).unwrap(),
            reference: c.reference.map(|r| load(r).unwrap()),
            data: batch(pad),
            ckpt,
        }
    }

    /// The reference `preference_loss` is built with.
    fn kind(&self) -> Reference {
        match self.reference {
            Some(_) => Reference::Adapter,
            None => Reference::Base,
        }
    }

    /// The step's rows and their length.
    fn shape(&self) -> (i64, i64) {
        let rows = self.data.ids.len();
        assert_eq!(rows, 2 * self.data.pairs, "chosen then rejected rows");
        (rows as i64, self.data.ids[0].len() as i64)
    }

    /// The value of input `name` of type `ty`: the batch, zero optimizer
    /// state at step 0, the adapters' tensors, else the base's.
    fn input(&self, name: &str, ty: TensorType) -> HostArray {
        let flat = |v: &[Vec<f64>]| v.concat();
        HostArray::from(match name {
            "input_ids" => {
                let v: Vec<f64> = self
                    .data
                    .ids
                    .iter()
                    .flatten()
                    .map(|&x| f64::from(x))
                    .collect();
                Literal::from_f64s(ty, &v)
            }
            "segment_ids" => Literal::from_f64s(ty, &flat(&self.data.segment_ids)),
            "loss_mask" => Literal::from_f64s(ty, &flat(&self.data.loss_mask)),
            "step" => Literal::from_f64s(ty, &[0.0]),
            n if n.starts_with("opt.") => {
                Literal::from_f64s(ty.clone(), &vec![0.0; ty.element_count()])
            }
            n => match (self.adapter.get(n), &self.reference) {
                (Some(t), _) => t.clone(),
                (None, Some(r)) if n.starts_with("ref.") => r
                    .tensors
                    .iter()
                    .find(|(k, _)| reference_name(k) == n)
                    .map(|(_, t)| t.clone())
                    .unwrap(),
                _ => self.ckpt.read(n, DType::F32).unwrap(),
            },
        })
    }

    /// Runs `f` on the case's inputs.
    fn run(&self, f: &hlo_ir::Function) -> Vec<HostArray> {
        let inputs: Vec<HostArray> = f
            .inputs
            .iter()
            .map(|b| self.input(&b.name, f.ty(b.value).clone()))
            .collect();
        CompiledFunction::new(client(), f)
            .unwrap()
            .run(&inputs)
            .unwrap()
    }

    /// Checks the adapter `tensors` (after one step) against TRL's, as
    /// PEFT writes them.
    fn assert_stepped(&self, c: &Case, tensors: Vec<(String, Literal)>) {
        let stepped = Adapter {
            lora: self.adapter.lora.clone(),
            tensors,
        };
        let dir = std::env::temp_dir().join(format!(
            "hlo-e2e-preference-{}-{}",
            std::process::id(),
            c.name
        ));
        stepped.save(&dir, None).unwrap();
        let ours = read_safetensors(&dir.join("adapter_model.safetensors")).unwrap();
        let theirs =
            read_safetensors(&preference(&format!("{}expected.safetensors", c.dir))).unwrap();
        for (key, t) in &ours {
            let want = &theirs
                .iter()
                .find(|(k, _)| *k == format!("{}.{key}", c.name))
                .unwrap_or_else(|| panic!("{}: {key} in the fixture", c.name))
                .1;
            let d = hlo_e2e::max_abs_diff(&t.to_f64s(), &want.to_f64s());
            assert!(d < 1e-6, "{}: {key} differs from TRL's by {d:e}", c.name);
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// The share of the case's pairs whose chosen completion the policy finds
/// likelier, from the fixture's per-pair log-probabilities (f64, by hand).
fn policy_preference(c: &Case) -> f64 {
    let p = &c.expected["pairs_f64"];
    let list = |k: &str| -> Vec<f64> {
        p[k].as_array()
            .unwrap_or_else(|| panic!("{}: no {k}", c.name))
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    // SimPO and ORPO compare per-token means; CPO sums, as DPO.
    let sums = c.loss.needs_reference() || matches!(c.loss, PreferenceLoss::Cpo(_));
    let (chosen, rejected) = match sums {
        true => (list("policy_chosen_sum"), list("policy_rejected_sum")),
        false => (list("policy_chosen_avg"), list("policy_rejected_avg")),
    };
    let wins = chosen.iter().zip(&rejected).filter(|(a, b)| a > b).count();
    wins as f64 / chosen.len() as f64
}

/// `got` within 1e-5 (relative above 1) of TRL's `want`.
fn close(c: &Case, what: &str, got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
        "{}: {what} {got} against TRL's {want}",
        c.name
    );
}

fn each(name: &str, loss: PreferenceLoss, starts: &[&'static str]) {
    for start in starts {
        for (optim, sgd) in [("sgd", true), ("adamw", false)] {
            check(&case(&format!("{name}.{start}.{optim}"), loss, start), sgd);
        }
    }
}

#[test]
fn dpo_and_ipo_equal_trl_against_the_base_a_copy_of_the_adapter_and_another_adapter() {
    let starts = ["fresh", "init", "ref"];
    each("dpo", PreferenceLoss::Dpo { beta: 0.1 }, &starts);
    each("ipo", PreferenceLoss::Ipo { beta: 0.1 }, &starts);
}

#[test]
fn simpo_and_orpo_equal_trl_from_a_fresh_and_a_trained_adapter() {
    let simpo = |cpo_alpha| PreferenceLoss::Simpo {
        beta: 0.1,
        gamma: 0.5,
        label_smoothing: 0.0,
        cpo_alpha,
    };
    each("simpo", simpo(1.0), &["fresh", "init"]);
    each("simpo_a0", simpo(0.0), &["fresh", "init"]);
    each(
        "orpo",
        PreferenceLoss::Orpo { beta: 0.1 },
        &["fresh", "init"],
    );
}

/// CPO (`CPOTrainer`, `loss_type="sigmoid"`): with its NLL term at TRL's
/// default weight, with label smoothing and half the weight, and without
/// it.
#[test]
fn cpo_equals_trl_from_a_fresh_and_a_trained_adapter() {
    let cpo = |label_smoothing, cpo_alpha| {
        PreferenceLoss::Cpo(CpoLoss {
            beta: 0.1,
            label_smoothing,
            cpo_alpha,
        })
    };
    for start in ["fresh", "init"] {
        for (optim, sgd) in [("sgd", true), ("adamw", false)] {
            let name = format!("cpo.{start}.{optim}");
            check(&case_in("cpo/", &name, cpo(0.0, 1.0), start), sgd);
        }
    }
    for (name, start, sgd) in [
        ("cpo_ls.fresh.sgd", "fresh", true),
        ("cpo_ls.init.adamw", "init", false),
    ] {
        check(&case_in("cpo/", name, cpo(0.1, 0.5), start), sgd);
    }
    check(
        &case_in("cpo/", "cpo_a0.fresh.sgd", cpo(0.0, 0.0), "fresh"),
        true,
    );
}

/// The whole preference train step (loss, gradients and the optimizer in
/// one compiled program) gives TRL's adapter after one SGD and one AdamW
/// step, and its loss and metrics among the outputs.
#[test]
fn the_compiled_preference_step_updates_the_adapter_as_trl() {
    let cases = [
        ("dpo", "ref", PreferenceLoss::Dpo { beta: 0.1 }),
        ("orpo", "init", PreferenceLoss::Orpo { beta: 0.1 }),
    ];
    for (method, start, loss) in cases {
        for (optim, optimizer, lr) in [
            ("sgd", Optimizer::Sgd, 0.1),
            ("adamw", Optimizer::adamw(0.0), 1e-3),
        ] {
            let c = case(&format!("{method}.{start}.{optim}"), loss, start);
            let setup = Setup::new(&c);
            let (rows, seq) = setup.shape();
            let tc = TrainConfig {
                scan_layers: false,
                clip_norm: None,
                ..TrainConfig::new(DType::F32, rows, seq)
                    .with_lora(Some(setup.adapter.lora.clone()))
                    .with_lr(lr, Schedule::Constant { warmup: 0 })
                    .with_optimizer(optimizer)
            };
            let step = preference_train_step(
                &setup.ckpt.config,
                &tc,
                &Preference::new(c.loss, setup.kind()),
            )
            .unwrap();
            let f = &step.function;
            let out = setup.run(f);
            let output = |n: &str| {
                let k = f.outputs.iter().position(|b| b.name == n).unwrap();
                out[k].to_f64_vec()
            };
            for key in ["loss", "grad_norm", "rewards/margins", "logps/chosen"] {
                let want = c.expected["metrics"][key]
                    .as_f64()
                    .or(c.expected[key].as_f64());
                close(&c, key, output(key)[0], want.unwrap());
            }
            let stepped = setup
                .adapter
                .tensors
                .iter()
                .map(|(n, t)| (n.clone(), Literal::from_f64s(t.ty.clone(), &output(n))))
                .collect();
            setup.assert_stepped(&c, stepped);
        }
    }
}
