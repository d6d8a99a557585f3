//! `hlo-train train --objective grpo --rollouts FILE` against TRL 1.16's
//! own `GRPOTrainer` (fixtures made by `scripts/make_grpo_fixtures.py`;
//! formulas in `tests/fixtures/grpo/FORMULAS.md`): on the tiny f32 Llama
//! and two prompts of four fixed completions each, every step's loss,
//! gradient norm and every metric the run writes equal TRL's to 1e-5, and
//! the adapter it saves after the last step equals TRL's to 1e-6 — for
//! each `loss_type`, with and without β, μ = 1 and μ = 2 (the second step
//! against the first one's old log-probabilities), each `scale_rewards`,
//! ε_high, a temperature, AdamW, two logged rewards with TRL's
//! `reward_weights`, and a reference that is a copy of the adapter
//! training starts from or another adapter; on one device and on a
//! `dp=1,fsdp=2,mp=2` mesh.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use hlo_engine::models::io::read_safetensors;
use serde_json::Value;

fn grpo(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/grpo")
        .join(name)
}

/// Every case of `expected.json` and `expected_variants.json`.
fn expected() -> Value {
    let read = |f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(grpo(f)).unwrap()).unwrap()
    };
    let mut all = read("expected.json");
    if let (Some(a), Value::Object(b)) = (all.as_object_mut(), read("expected_variants.json")) {
        a.extend(b);
    }
    all
}

/// The flags of a fixture case, from the settings TRL ran with.
fn flags(settings: &Value) -> Vec<String> {
    let s = |k: &str| settings[k].clone();
    let num = |k: &str| s(k).as_f64().unwrap().to_string();
    let mut f: Vec<String> = vec![
        "--objective".into(),
        "grpo".into(),
        "--checkpoint".into(),
        fixture("gqa_llama3").display().to_string(),
        // TRL's tokenizer: its EOS (id 1) ends a completion, as the
        // checkpoint's generation config's (id 2) does.
        "--tokenizer".into(),
        grpo("../preference/tokenizer/tokenizer.json")
            .display()
            .to_string(),
        "--rollouts".into(),
        grpo(s("rollouts").as_str().unwrap()).display().to_string(),
        "--batch".into(),
        num("per_device_train_batch_size"),
        "--num-generations".into(),
        num("num_generations"),
        "--seq".into(),
        "16".into(),
        "--steps".into(),
        num("max_steps"),
        "--clip-norm".into(),
        "0".into(),
        "--loss-type".into(),
        s("loss_type").as_str().unwrap().into(),
        "--beta".into(),
        num("beta"),
        "--num-iterations".into(),
        num("num_iterations"),
        "--scale-rewards".into(),
        s("scale_rewards").as_str().unwrap().into(),
        "--epsilon".into(),
        num("epsilon"),
        "--max-completion-length".into(),
        num("max_completion_length"),
        "--temperature".into(),
        num("temperature"),
        "--optimizer".into(),
        match s("optim").as_str().unwrap() {
            "sgd" => "sgd".into(),
            _ => "adamw".into(),
        },
        "--lr".into(),
        num("learning_rate"),
        "--weight-decay".into(),
        "0".into(),
        "--log-every".into(),
        "1".into(),
    ];
    // TRL's reward_weights, by the logged rewards' names.
    if let Some(w) = s("reward_weights").as_array() {
        let names = s("reward_funcs");
        let pairs: Vec<String> = (names.as_array().unwrap().iter().zip(w))
            .map(|(n, w)| format!("{}:{}", n.as_str().unwrap(), w))
            .collect();
        f.extend(["--reward-weights".into(), pairs.join(",")]);
    }
    if let Some(e) = s("epsilon_high_given").as_f64() {
        f.extend(["--epsilon-high".into(), e.to_string()]);
    }
    // The variants' settings (GSPO, CISPO, SAPO, the KL's weighting).
    if let Some(level) = s("importance_sampling_level").as_str() {
        f.extend(["--importance-sampling-level".into(), level.into()]);
    }
    if let Some(on) = s("use_bias_correction_kl").as_bool() {
        f.extend(["--use-bias-correction-kl".into(), on.to_string()]);
    }
    if s("loss_type").as_str() == Some("sapo") {
        for key in ["sapo_temperature_pos", "sapo_temperature_neg"] {
            f.extend([format!("--{}", key.replace('_', "-")), num(key)]);
        }
    }
    let adapter = |a: &str| grpo(a).display().to_string();
    match s("start").as_str().unwrap() {
        "fresh" => f.extend(["--init-adapter".into(), adapter("adapters/fresh")]),
        "init" => f.extend(["--init-adapter".into(), adapter("adapters/init")]),
        "ref" => f.extend([
            "--init-adapter".into(),
            adapter("adapters/init"),
            "--ref-adapter".into(),
            adapter("adapters/ref"),
        ]),
        other => panic!("start {other}"),
    }
    f
}

/// `got` within `tol` (relative above 1) of TRL's `want`.
fn close(what: &str, got: f64, want: f64, tol: f64) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "{what}: {got} against TRL's {want}"
    );
}

/// What TRL logs that is not a figure of the step: the schedule's
/// position, and `num_tokens` (a running count a resumed run would not
/// know; not kept).
const NOT_COMPARED: [&str; 3] = ["epoch", "learning_rate", "num_tokens"];

/// Runs the case `name` with `extra` flags; checks every step's figures
/// and the adapter saved after the last (to 1e-6 per 0.1 of learning
/// rate: rounding grows with the step).
fn check(name: &str, extra: &[&str]) {
    let want = &expected()[name];
    let tmp = scratch("grpo", &format!("{name}{}", extra.len()));
    let (out, metrics) = (tmp.join("run"), tmp.join("metrics.jsonl"));
    let mut args: Vec<String> = vec!["train".into()];
    args.extend(flags(&want["settings"]));
    for (flag, path) in [("--out", &out), ("--metrics", &metrics)] {
        args.extend([flag.into(), path.display().to_string()]);
    }
    let args = with_flags(args, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let said = ok(&hlo_train(&args));
    // Logged rollouts are the data: no generations of the bundled demo
    // prompts from the user's model.
    assert!(!said.contains("before:"), "{said}");
    let lines: Vec<Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let what = |k: &str| format!("{name} {extra:?}: {k}");
    for trl in want["steps"].as_array().unwrap() {
        let step = trl["step"].as_u64().unwrap();
        let ours = lines
            .iter()
            .find(|l| l["step"] == step && l.get("loss").is_some())
            .unwrap_or_else(|| panic!("{}", what(&format!("step {step}"))));
        for (key, v) in trl["logged"].as_object().unwrap() {
            if NOT_COMPARED.contains(&key.as_str()) {
                continue;
            }
            let k = format!("step {step} {key}");
            let got = ours[key.as_str()]
                .as_f64()
                .unwrap_or_else(|| panic!("{} is not written", what(&k)));
            close(&what(&k), got, v.as_f64().unwrap(), 1e-5);
        }
        // What TRL logs only when it generates, the run writes only then.
        if trl["logged"].get("reward").is_none() {
            assert!(ours.get("reward").is_none(), "{}", what("reward reused"));
        }
    }
    let last = want["steps"].as_array().unwrap().len();
    let ours = read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
    let mut theirs = read_safetensors(&grpo("expected.safetensors")).unwrap();
    theirs.extend(read_safetensors(&grpo("expected_variants.safetensors")).unwrap());
    assert!(!ours.is_empty());
    for (key, t) in &ours {
        let trl = &theirs
            .iter()
            .find(|(k, _)| *k == format!("{name}.step{last}.{key}"))
            .unwrap_or_else(|| panic!("{name}: {key} in the fixture"))
            .1;
        let d = max_diff(&t.to_f64s(), &trl.to_f64s());
        let lr = want["settings"]["learning_rate"].as_f64().unwrap();
        let tol = 1e-6 * (lr / 0.1).max(1.0);
        assert!(d < tol, "{}: differs by {d:e}", what(key));
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

#[test]
fn every_loss_type_with_and_without_beta_once_and_twice_equals_trl() {
    for loss in ["grpo", "dr_grpo", "dapo", "bnpo"] {
        for beta in ["0.0", "0.04"] {
            for mu in [1, 2] {
                check(&format!("{loss}.b{beta}.mu{mu}"), &[]);
            }
        }
    }
}

#[test]
fn scaling_clipping_temperature_adamw_and_references_equal_trl() {
    for name in [
        "dapo.b0.0.mu1.scale_batch",
        "dapo.b0.0.mu1.scale_none",
        "dapo.b0.0.mu1.tied",
        "dapo.b0.0.mu1.two_rewards",
        "dapo.b0.0.mu2.eps_high",
        "dapo.b0.04.mu2.temp0.7",
        "dapo.b0.0.mu1.adamw",
        "dapo.b0.04.mu2.adamw",
        "dapo.b0.04.mu1.init",
        "dapo.b0.04.mu2.init",
        "dapo.b0.04.mu1.ref",
        "dapo.b0.04.mu2.ref",
        "dapo.b0.5.mu1.ref",
    ] {
        check(name, &[]);
    }
}

/// PEFT writes `target_modules` from a set: a reference adapter listing
/// them in another order is the same adapter, and the same step.
#[test]
fn a_reference_adapter_listing_its_modules_in_another_order_is_the_same() {
    let tmp = scratch("grpo", "reversed_targets");
    let reversed = with_targets_reversed(&grpo("adapters/ref"), &tmp.join("ref"));
    check(
        "dapo.b0.04.mu1.ref",
        &["--ref-adapter", reversed.to_str().unwrap()],
    );
    std::fs::remove_dir_all(tmp).unwrap();
}

/// Every case of the first test again on the mesh (each `loss_type`, with
/// and without β, μ = 1 and 2), and two more: a reference adapter beside
/// the policy, and ε_high.
#[test]
fn a_mesh_equals_trl() {
    let mesh = ["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"];
    for loss in ["grpo", "dr_grpo", "dapo", "bnpo"] {
        for beta in ["0.0", "0.04"] {
            for mu in [1, 2] {
                check(&format!("{loss}.b{beta}.mu{mu}"), &mesh);
            }
        }
    }
    for name in ["dapo.b0.04.mu2.ref", "dapo.b0.0.mu2.eps_high"] {
        check(name, &mesh);
    }
}

/// Prompts with answers, in the fixture tokenizer's printable ASCII.
fn prompts(dir: &Path) -> PathBuf {
    let path = dir.join("prompts.jsonl");
    std::fs::write(
        &path,
        "{\"prompt\":\"XYZ=\",\"answer\":\"ZYX\"}\n{\"prompt\":\"KP=\",\"answer\":\"PK\"}\n{\"prompt\":\"A+B:\",\"answer\":\"3\"}\n",
    )
    .unwrap();
    path
}

/// An online run's flags: the policy from the fixture's init adapter,
/// rollouts of 8 tokens at temperature 1, rewarded by a shell command
/// (each request's length: rewards that differ within a group), SGD with
/// a large step so the adapter visibly changes.
fn online(dir: &Path, out: &Path, metrics: &Path, command: &str) -> Vec<String> {
    let tokenizer = grpo("../preference/tokenizer/tokenizer.json");
    [
        "train",
        "--objective",
        "grpo",
        "--checkpoint",
        fixture("gqa_llama3").to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--init-adapter",
        grpo("adapters/init").to_str().unwrap(),
        "--data",
        prompts(dir).to_str().unwrap(),
        "--batch",
        "8",
        "--num-generations",
        "4",
        "--seq",
        "32",
        "--max-completion-length",
        "8",
        "--reward",
        "command",
        "--reward-command",
        command,
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--log-every",
        "1",
        "--log-completions",
        "8",
        "--out",
        out.to_str().unwrap(),
        "--metrics",
        metrics.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

const LENGTH_REWARD: &str = "while read -r line; do echo ${#line}; done";

/// The completions (ids) of step `step`'s rollouts in a metrics file, with
/// their prompts' ids.
fn rollouts_of(metrics: &Path, step: u64) -> Vec<(Value, Value)> {
    let line = std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|l| l["step"] == step && l.get("completions").is_some())
        .unwrap_or_else(|| panic!("step {step}'s completions in {}", metrics.display()));
    line["completions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["prompt_ids"].clone(), c["completion_ids"].clone()))
        .collect()
}

/// `generate --prompts` over `prompts` (ids), 8 at a time, with the run's
/// sampling: the completions' ids.
fn generated(dir: &Path, adapter: &Path, prompts: &[Value]) -> Vec<Value> {
    let file = dir.join("generate.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::json!({ "input_ids": p }).to_string())
        .collect();
    std::fs::write(&file, lines.join("\n")).unwrap();
    let tokenizer = grpo("../preference/tokenizer/tokenizer.json");
    let out = ok(&hlo_train(&[
        "generate",
        "--checkpoint",
        fixture("gqa_llama3").to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--prompts",
        file.to_str().unwrap(),
        "--batch-size",
        "8",
        "--temperature",
        "1",
        "--seed",
        "0",
        "--max-new-tokens",
        "8",
        // The tokenizer's EOS, which ends a rollout too.
        "--stop",
        "1",
    ]));
    out.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["completion_ids"].clone())
        .collect()
}

/// The completions a step trains on are what `generate` samples with the
/// adapter as it stands at that step (same seed and sampling): the first
/// step's with the adapter training starts from, the second's — after a
/// resume, from the run's saved adapter — with the updated one, which
/// samples otherwise than the first.
#[test]
fn rollouts_are_what_generate_samples_with_the_adapter_being_trained() {
    let dir = scratch("grpo", "online");
    let (out, metrics) = (dir.join("run"), dir.join("metrics.jsonl"));
    let mut args = online(&dir, &out, &metrics, LENGTH_REWARD);
    args.extend(["--steps".into(), "1".into()]);
    ok(&hlo_train(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    let first = rollouts_of(&metrics, 1);
    assert_eq!(first.len(), 8);
    let prompts1: Vec<Value> = first.iter().map(|r| r.0.clone()).collect();
    let got = generated(&dir, &grpo("adapters/init"), &prompts1);
    let want: Vec<Value> = first.iter().map(|r| r.1.clone()).collect();
    assert_eq!(
        got, want,
        "step 1's rollouts are generate's with the init adapter"
    );

    // The adapter after step 1, kept before the run goes on.
    let after1 = dir.join("after1");
    std::fs::create_dir_all(&after1).unwrap();
    for f in ["adapter_model.safetensors", "adapter_config.json"] {
        std::fs::copy(out.join(f), after1.join(f)).unwrap();
    }
    ok(&hlo_train(&[
        "train",
        "--resume",
        out.to_str().unwrap(),
        "--steps",
        "2",
    ]));
    let second = rollouts_of(&metrics, 2);
    // The run's second batch of rollouts draws the sampler's second
    // stream: generate's second batch of 8.
    let mut prompts = prompts1.clone();
    prompts.extend(second.iter().map(|r| r.0.clone()));
    let want: Vec<Value> = second.iter().map(|r| r.1.clone()).collect();
    let got = generated(&dir, &after1, &prompts);
    assert_eq!(
        got[8..],
        want[..],
        "step 2's rollouts are generate's with the updated adapter"
    );
    let before = generated(&dir, &grpo("adapters/init"), &prompts);
    assert_ne!(before[8..], want[..], "the update changes what is sampled");
    std::fs::remove_dir_all(dir).unwrap();
}

/// The external reward's protocol: a command started once, one JSON object
/// a line in (prompt, completion, their ids, the row's columns), one
/// number a line out; a command that fails, stops or answers something
/// else stops the run with one line naming it.
#[test]
fn the_reward_command_reads_json_lines_and_its_failures_are_one_line() {
    let dir = scratch("grpo", "command");
    let (out, metrics) = (dir.join("run"), dir.join("metrics.jsonl"));
    // Echoes each request into a file, answers 1 where the row's answer
    // column came along.
    let log = dir.join("requests.jsonl");
    let command = format!(
        "while read -r line; do printf '%s\\n' \"$line\" >> {}; case \"$line\" in *'\"answer\":'*) echo 1;; *) echo 0;; esac; done",
        log.display()
    );
    let mut args = online(&dir, &out, &metrics, &command);
    args.extend(["--steps".into(), "1".into()]);
    let text = ok(&hlo_train(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    // The run's last lines give the reward's course, and no packing.
    assert!(
        text.contains(
            "reward (the mean of a step's completions) 1.0000 over steps 1..1 -> 1.0000 over steps 1..1"
        ) && !text.contains("packing"),
        "{text}"
    );
    let requests: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(requests.len(), 8);
    for r in &requests {
        for key in [
            "prompt",
            "completion",
            "prompt_ids",
            "completion_ids",
            "answer",
        ] {
            assert!(r.get(key).is_some(), "{key} in {r}");
        }
    }
    assert_eq!(metric(&metrics, "rewards/command/mean")[0].1, 1.0);
    for (command, says) in [
        ("true", "stopped before answering"),
        ("while read -r l; do echo nan; done", "gave NaN"),
        (
            "while read -r l; do echo many; done",
            "answered `many`, not a number",
        ),
        ("exit 3", "stopped before answering"),
    ] {
        let _ = std::fs::remove_dir_all(&out);
        let mut args = online(&dir, &out, &metrics, command);
        args.extend(["--steps".into(), "1".into()]);
        let e = one_line_error(&hlo_train(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
        ));
        assert!(
            e.contains("--reward command") && e.contains(says),
            "{command}: {e}"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A one-thread HTTP server on 127.0.0.1 answering each POST with what
/// `answer` makes of its JSON body; the bodies it got come back through
/// the returned channel.
fn reward_server(answer: fn(&Value) -> String) -> (String, std::sync::mpsc::Receiver<Value>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/reward", listener.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap();
                }
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0u8; length];
            reader.read_exact(&mut body).unwrap();
            let body: Value = serde_json::from_slice(&body).unwrap();
            let reply = answer(&body);
            let _ = tx.send(body);
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
                reply.len()
            );
        }
    });
    (url, rx)
}

/// The HTTP reward: each batch of completions is one POST of a JSON array
/// (prompt, completion, their ids, the row's columns), answered by an
/// array of as many numbers; a wrong answer or no server stops the run
/// with one line naming it.
#[test]
fn the_http_reward_posts_each_batch_and_its_failures_are_one_line() {
    let dir = scratch("grpo", "http");
    let (out, metrics) = (dir.join("run"), dir.join("metrics.jsonl"));
    let run = |url: &str| {
        let mut args = online(&dir, &out, &metrics, "unused");
        // Swap the command reward for the endpoint.
        let k = args.iter().position(|a| a == "command").unwrap();
        args[k] = "http".into();
        let k = args.iter().position(|a| a == "--reward-command").unwrap();
        args[k] = "--reward-url".into();
        args[k + 1] = url.into();
        args.extend(["--steps".into(), "1".into(), "--overwrite".into()]);
        hlo_train(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    // 1 for a completion of the first prompt's group (of 4), else 0.
    let (url, bodies) = reward_server(|body| {
        let n = body.as_array().unwrap().len();
        let v: Vec<f64> = (0..n).map(|i| if i < 4 { 1.0 } else { 0.0 }).collect();
        serde_json::to_string(&v).unwrap()
    });
    ok(&run(&url));
    let body = bodies.recv().unwrap();
    let items = body.as_array().unwrap();
    assert_eq!(items.len(), 8);
    for key in [
        "prompt",
        "completion",
        "prompt_ids",
        "completion_ids",
        "answer",
    ] {
        assert!(items.iter().all(|r| r.get(key).is_some()), "{key}");
    }
    assert_eq!(metric(&metrics, "rewards/http/mean")[0].1, 0.5);

    let (short, _keep) = reward_server(|_| "[1, 2]".into());
    let e = one_line_error(&run(&short));
    assert!(
        e.contains("--reward http") && e.contains("answered 2 rewards for 8 completions"),
        "{e}"
    );
    let (text, _keep) = reward_server(|_| "fine".into());
    let e = one_line_error(&run(&text));
    assert!(
        e.contains("--reward http") && e.contains("not a JSON array of numbers"),
        "{e}"
    );
    // Nothing listens there any more.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}/reward", l.local_addr().unwrap())
    };
    let e = one_line_error(&run(&closed));
    assert!(e.contains("--reward http") && e.contains("POST"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A μ = 2 run saved after its first step (between the two iterations on
/// one batch of rollouts) and resumed ends as TRL's two steps: the batch
/// and its old log-probabilities are saved with the run.
#[test]
fn a_run_resumed_between_two_iterations_ends_as_trl() {
    let name = "dapo.b0.04.mu2.ref";
    let want = &expected()[name];
    let tmp = scratch("grpo", "resume-mu2");
    let (out, metrics) = (tmp.join("run"), tmp.join("metrics.jsonl"));
    let mut args: Vec<String> = vec!["train".into()];
    args.extend(flags(&want["settings"]));
    let k = args.iter().position(|a| a == "--steps").unwrap();
    args[k + 1] = "1".into();
    for (flag, path) in [("--out", &out), ("--metrics", &metrics)] {
        args.extend([flag.into(), path.display().to_string()]);
    }
    ok(&hlo_train(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    assert!(out.join("train_state/rollout_batch.json").is_file());
    ok(&hlo_train(&[
        "train",
        "--resume",
        out.to_str().unwrap(),
        "--steps",
        "2",
    ]));
    let trl = &want["steps"][1];
    let ours = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|l| l["step"] == 2)
        .unwrap();
    for key in ["loss", "kl", "clip_ratio/region_mean", "entropy"] {
        close(
            &format!("resumed step 2 {key}"),
            ours[key].as_f64().unwrap(),
            trl["logged"][key].as_f64().unwrap(),
            1e-5,
        );
    }
    let ours = read_safetensors(&out.join("adapter_model.safetensors")).unwrap();
    let theirs = read_safetensors(&grpo("expected.safetensors")).unwrap();
    for (key, t) in &ours {
        let trl = &theirs
            .iter()
            .find(|(k, _)| *k == format!("{name}.step2.{key}"))
            .unwrap()
            .1;
        let d = max_diff(&t.to_f64s(), &trl.to_f64s());
        assert!(d < 1e-6, "resumed {key}: differs by {d:e}");
    }
    std::fs::remove_dir_all(tmp).unwrap();
}

/// The loss a chunk of positions at a time (`--loss-chunk`, what long
/// completions over a large vocabulary take): the same figures and step.
#[test]
fn a_chunked_loss_equals_trl() {
    for name in [
        "dapo.b0.04.mu2.ref",
        "grpo.b0.04.mu2",
        "dapo.b0.04.mu2.temp0.7",
    ] {
        check(name, &["--loss-chunk", "4"]);
    }
}

/// Conversational prompts (`{"messages"}`) go through the chat template
/// with its generation prompt: the rollouts' prompts are the ids TRL
/// renders for the same conversations (the preference fixture's).
#[test]
fn conversational_prompts_are_rendered_as_trl_renders_them() {
    let dir = scratch("grpo", "chat");
    let pref = grpo("../preference");
    let chat: Vec<Value> = std::fs::read_to_string(pref.join("data_chat.jsonl"))
        .unwrap()
        .lines()
        .take(2)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let want: Vec<Value> = std::fs::read_to_string(pref.join("data_chat_ids.jsonl"))
        .unwrap()
        .lines()
        .take(2)
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["prompt_ids"].clone())
        .collect();
    let prompts = dir.join("prompts.jsonl");
    let lines: Vec<String> = chat
        .iter()
        .map(|r| serde_json::json!({ "messages": r["prompt"] }).to_string())
        .collect();
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    let metrics = dir.join("metrics.jsonl");
    let tokenizer = pref.join("chat_tokenizer/tokenizer.json");
    ok(&hlo_train(&[
        "train",
        "--objective",
        "grpo",
        "--checkpoint",
        fixture("gqa_llama3").to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--chat-template",
        pref.join("chat_tokenizer").to_str().unwrap(),
        "--data",
        prompts.to_str().unwrap(),
        "--batch",
        "8",
        "--num-generations",
        "4",
        "--seq",
        "48",
        "--max-completion-length",
        "8",
        "--reward",
        "length",
        "--steps",
        "1",
        "--log-every",
        "1",
        "--log-completions",
        "8",
        "--metrics",
        metrics.to_str().unwrap(),
    ]));
    let mut seen: Vec<Value> = rollouts_of(&metrics, 1).into_iter().map(|r| r.0).collect();
    seen.dedup();
    let mut want = want;
    seen.sort_by_key(|v| v.to_string());
    want.sort_by_key(|v| v.to_string());
    assert_eq!(seen, want);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Whether process `pid` is gone (or a zombie no one has reaped yet: a
/// process killed after its parent exited, in a container whose first
/// process reaps nothing).
fn gone(pid: &str) -> bool {
    match std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

/// Waits up to 10 s for `pid` to be [`gone`].
fn ends(pid: &str) -> bool {
    (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        gone(pid)
    })
}

/// An external reward can never hang a run or shift its rewards: each
/// answer is waited for at most --reward-timeout, a signal ends the wait
/// (the run then stops as a signal stops it: the step finished, saved,
/// exit 0), the command's whole process group is killed however the run
/// ends, and a command that answers unasked, or more than once a request,
/// is refused with its batch.
#[test]
fn rewards_can_never_hang_a_run_or_shift_its_rewards() {
    let dir = scratch("grpo", "bounds");
    let (out, metrics) = (dir.join("run"), dir.join("metrics.jsonl"));
    let args_for = |command: &str, extra: &[&str]| {
        let _ = std::fs::remove_dir_all(&out);
        let mut args = online(&dir, &out, &metrics, command);
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let run = |args: &[String]| hlo_train(&args.iter().map(String::as_str).collect::<Vec<_>>());
    // Never answers; records its own pid and its child's.
    let (shell, child) = (dir.join("shell.pid"), dir.join("child.pid"));
    let silent = format!(
        "echo $$ > {}; sleep 1000 & echo $! > {}; while read -r l; do :; done",
        shell.display(),
        child.display()
    );
    let started = std::time::Instant::now();
    let e = one_line_error(&run(&args_for(
        &silent,
        &["--steps", "2", "--reward-timeout", "1"],
    )));
    assert!(
        e.contains("--reward command") && e.contains("did not answer within 1 s"),
        "{e}"
    );
    assert!(started.elapsed().as_secs() < 60);
    for pid in [&shell, &child] {
        let pid = std::fs::read_to_string(pid).unwrap();
        assert!(
            ends(&pid),
            "the reward command's process {pid} outlived the run"
        );
    }
    // Two answers a request: the surplus is refused before it is taken
    // for another completion's reward (or a later step's).
    let twice = "n=0; while read -r l; do n=$((n+1)); echo $n; echo $((n+100)); done";
    let e = one_line_error(&run(&args_for(twice, &["--steps", "2"])));
    assert!(
        e.contains("--reward command") && e.contains("beyond its"),
        "{e}"
    );
    // Numbers before any request.
    let early = "echo 5; while read -r l; do echo 1; done";
    let e = one_line_error(&run(&args_for(early, &["--steps", "1"])));
    assert!(e.contains("printed `5` before it was asked"), "{e}");

    // SIGTERM while the run waits for the second batch's first answer:
    // step 1 saved, exit 0, the command gone.
    let hangs = format!(
        "echo $$ > {}; n=0; while read -r l; do n=$((n+1)); if [ $n -le 8 ]; then echo $n; else sleep 1000 & echo $! > {}; wait; fi; done",
        shell.display(),
        child.display()
    );
    let _ = std::fs::remove_file(&child);
    let args = args_for(&hangs, &["--steps", "3", "--reward-timeout", "600"]);
    let proc = std::process::Command::new(env!("CARGO_BIN_EXE_hlo-train"))
        .args(&args)
        .env_remove("HLO_TRAIN_PLUGIN")
        .env("HF_HUB_OFFLINE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The command is waited on once it has been asked a ninth time.
    let waited = (0..1200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        child.exists()
    });
    assert!(waited, "the run never asked for the second batch's rewards");
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &proc.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let done = proc.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&done.stdout);
    assert_eq!(done.status.code(), Some(0), "{text} {}", stderr(&done));
    assert!(
        text.contains("stopped by a signal after step 1; saved to"),
        "{text}"
    );
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("train_state/state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 1);
    for pid in [&shell, &child] {
        let pid = std::fs::read_to_string(pid).unwrap();
        assert!(
            ends(&pid),
            "the reward command's process {pid} outlived the run"
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// SIGTERM while the first batch's rewards are awaited: nothing was
/// saved, so the run says so and exits non-zero (a `--resume` would have
/// nothing to continue).
#[test]
fn a_signal_before_the_first_save_keeps_nothing_and_says_so() {
    let dir = scratch("grpo", "signal-first");
    let (out, metrics) = (dir.join("run"), dir.join("metrics.jsonl"));
    let asked = dir.join("asked");
    let silent = format!("while read -r l; do touch {}; done", asked.display());
    let mut args = online(&dir, &out, &metrics, &silent);
    args.extend(["--steps", "2", "--reward-timeout", "600"].map(String::from));
    let proc = std::process::Command::new(env!("CARGO_BIN_EXE_hlo-train"))
        .args(&args)
        .env_remove("HLO_TRAIN_PLUGIN")
        .env("HF_HUB_OFFLINE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let waited = (0..1200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        asked.exists()
    });
    assert!(waited, "the run never asked for the first batch's rewards");
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &proc.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let e = one_line_error(&proc.wait_with_output().unwrap());
    assert!(
        e.contains("stopped by a signal before any step was saved"),
        "{e}"
    );
    assert!(!out.join("train_state").exists());
    std::fs::remove_dir_all(dir).unwrap();
}

/// An endpoint that accepts and never answers is given --reward-timeout.
#[test]
fn an_http_reward_that_never_answers_ends_the_run_at_its_timeout() {
    let dir = scratch("grpo", "http-silent");
    let (out, metrics) = (dir.join("run"), dir.join("metrics.jsonl"));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/reward", listener.local_addr().unwrap());
    // Holds every connection open, reading nothing.
    std::thread::spawn(move || {
        let held: Vec<_> = listener.incoming().collect();
        drop(held);
    });
    let mut args = online(&dir, &out, &metrics, "unused");
    let k = args.iter().position(|a| a == "command").unwrap();
    args[k] = "http".into();
    let k = args.iter().position(|a| a == "--reward-command").unwrap();
    args[k] = "--reward-url".into();
    args[k + 1] = url;
    args.extend(["--steps", "1", "--reward-timeout", "1"].map(String::from));
    let started = std::time::Instant::now();
    let e = one_line_error(&hlo_train(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    ));
    assert!(
        e.contains("--reward http") && e.contains("did not answer within 1 s"),
        "{e}"
    );
    assert!(started.elapsed().as_secs() < 60);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Logged rewards whose group statistics overflow are refused, not
/// turned into zero advantages.
#[test]
fn rewards_whose_statistics_overflow_are_refused() {
    let dir = scratch("grpo", "overflow");
    let rollouts = dir.join("rollouts.jsonl");
    let lines: Vec<String> = [1e308, -1e308, 1e308, -1e308]
        .iter()
        .map(|r| {
            format!(
                "{{\"prompt_ids\": [0, 57, 58], \"completion_ids\": [58, 1], \"reward\": {r:e}}}"
            )
        })
        .collect();
    std::fs::write(&rollouts, lines.join("\n") + "\n").unwrap();
    let e = one_line_error(&hlo_train(&[
        "train",
        "--objective",
        "grpo",
        "--checkpoint",
        fixture("gqa_llama3").to_str().unwrap(),
        "--rollouts",
        rollouts.to_str().unwrap(),
        "--batch",
        "4",
        "--num-generations",
        "4",
        "--seq",
        "8",
        "--steps",
        "1",
    ]));
    assert!(e.contains("overflow their statistics"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// TRL 1.16's newer GRPO variants: sequence ratios (GSPO) with two loss
/// types, CISPO (with a reference too), SAPO at its default and at given
/// temperatures, and the KL estimate without its importance weighting;
/// every one over two steps on one device, GSPO and CISPO on the mesh too.
#[test]
fn gspo_cispo_sapo_and_the_unweighted_kl_equal_trl() {
    for name in [
        "grpo.b0.04.mu2.gspo",
        "dapo.b0.0.mu2.gspo",
        "cispo.b0.0.mu2",
        "cispo.b0.04.mu2.ref",
        "sapo.b0.0.mu2",
        "sapo.b0.04.mu2.temps",
        "dapo.b0.04.mu2.ref.nobias",
        "dapo.b0.5.mu1.ref.nobias",
    ] {
        check(name, &[]);
    }
    let mesh = ["--devices", "4", "--mesh", "dp=1,fsdp=2,mp=2"];
    check("grpo.b0.04.mu2.gspo", &mesh);
    check("cispo.b0.04.mu2.ref", &mesh);
}
