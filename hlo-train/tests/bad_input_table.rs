//! Every bad input we try, and the one line it gives: each must exit with
//! code 2, print one line, no panic, and leave no file behind. The table of
//! cases and messages is the README's ("What bad input gives"); this test
//! fails when they differ, and `HLO_TRAIN_UPDATE_README=1 cargo test -p
//! hlo-train --test bad_input_table` rewrites it.

mod common;

use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// A copy of the fixture checkpoint whose `model.safetensors` is `bytes`
/// (or whose config is `config`).
fn checkpoint(root: &Path, name: &str, bytes: Option<Vec<u8>>, config: Option<String>) -> PathBuf {
    let d = root.join(name);
    std::fs::create_dir_all(&d).unwrap();
    let weights = bytes
        .unwrap_or_else(|| std::fs::read(fixture("gqa_llama3").join("model.safetensors")).unwrap());
    std::fs::write(d.join("model.safetensors"), weights).unwrap();
    let cfg = config.unwrap_or_else(|| {
        std::fs::read_to_string(fixture("gqa_llama3").join("config.json")).unwrap()
    });
    std::fs::write(d.join("config.json"), cfg).unwrap();
    d
}

/// The fixture's safetensors with its header rewritten by `edit`.
fn with_header(edit: impl Fn(&mut Value)) -> Vec<u8> {
    let bytes = std::fs::read(fixture("gqa_llama3").join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let text = header.to_string().into_bytes();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

/// A PEFT adapter folder (the QLoRA fixture's) with no run beside it.
fn adapter_without_run(root: &Path) -> String {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qlora/llama/adapter");
    let to = root.join("adapter");
    std::fs::create_dir_all(&to).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
    to.to_str().unwrap().to_string()
}

/// The preference fixture's pre-tokenized pairs, in `root`.
fn pairs_file(root: &Path) -> String {
    let from =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/preference/data_ids.jsonl");
    let to = root.join("pairs.jsonl");
    std::fs::copy(from, &to).unwrap();
    to.to_str().unwrap().to_string()
}

/// The fixture's safetensors with raw header bytes.
fn raw_header(header: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(&[0u8; 64]);
    out
}

/// A real shared library presenting PJRT API 0.30 (tests/fixtures/plugin),
/// built with the toolchain's `rustc`.
fn old_api_plugin(root: &Path) -> String {
    let lib = root.join("libold_api.so");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/plugin/old_api.rs");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let built = Command::new(rustc)
        .args(["--crate-type", "cdylib", "--edition", "2021", "-o"])
        .arg(&lib)
        .arg(source)
        .status()
        .unwrap();
    assert!(built.success());
    lib.display().to_string()
}

fn tensor_names(h: &Value) -> Vec<String> {
    let mut names: Vec<String> = h
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort();
    names
}

#[test]
fn bad_input_table() {
    let root = scratch("bad", "table");
    let r = root.to_str().unwrap().to_string();
    let ckpt = |name: &str, bytes: Option<Vec<u8>>, config: Option<String>| {
        checkpoint(&root, name, bytes, config)
            .to_str()
            .unwrap()
            .to_string()
    };
    let jsonl = |name: &str, text: &str| {
        let p = root.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let fixture_config =
        std::fs::read_to_string(fixture("gqa_llama3").join("config.json")).unwrap();
    let gen = |dir: String| {
        vec![
            "generate".to_string(),
            "--checkpoint".into(),
            dir,
            "--prompt-ids".into(),
            "1,2".into(),
        ]
    };
    let train = |extra: &[&str]| {
        let mut a: Vec<String> = ["train", "--steps", "1", "--batch", "2", "--seq", "8"]
            .map(String::from)
            .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let not_plugin = jsonl("not_a_plugin.so", "just text");
    let old_plugin = old_api_plugin(&root);
    let serve = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["serve", "--port", "0", "--checkpoint"]
            .map(String::from)
            .to_vec();
        v.push(fixture("gqa_llama3").to_str().unwrap().into());
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let sets = PreparedSets::make(&root);
    let score = |extra: &[&str]| {
        let mut a: Vec<String> = vec![
            "score".into(),
            "--checkpoint".into(),
            fixture_file("reward", "seqcls").to_str().unwrap().into(),
            "--tokenizer".into(),
            fixture_file("preference", "tokenizer/tokenizer.json")
                .to_str()
                .unwrap()
                .into(),
            "--data".into(),
            fixture_file("reward", "pairs_ids.jsonl")
                .to_str()
                .unwrap()
                .into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("checkpoint folder missing", gen(format!("{r}/nowhere"))),
        (
            "safetensors body truncated",
            gen(ckpt(
                "truncated",
                Some({
                    let b = std::fs::read(fixture("gqa_llama3").join("model.safetensors")).unwrap();
                    b[..b.len() - 100].to_vec()
                }),
                None,
            )),
        ),
        (
            "safetensors header length larger than the file",
            gen(ckpt(
                "long_header",
                Some(vec![255, 255, 0, 0, 0, 0, 0, 0, b'{', b'}']),
                None,
            )),
        ),
        (
            "safetensors offsets overlapping",
            gen(ckpt(
                "overlap",
                Some(with_header(|h| {
                    let names = tensor_names(h);
                    let first = h[&names[0]]["data_offsets"].clone();
                    let second = &mut h[&names[1]]["data_offsets"];
                    let len = second[1].as_u64().unwrap() - second[0].as_u64().unwrap();
                    // Inside the first tensor, not at its start (ties sort either way).
                    let start = first[0].as_u64().unwrap() + 4;
                    *second = serde_json::json!([start, start + len]);
                })),
                None,
            )),
        ),
        (
            "safetensors offsets past the end",
            gen(ckpt(
                "range",
                Some(with_header(|h| {
                    let names = tensor_names(h);
                    let d = &mut h[&names[0]]["data_offsets"];
                    let len = d[1].as_u64().unwrap() - d[0].as_u64().unwrap();
                    *d = serde_json::json!([1u64 << 40, (1u64 << 40) + len]);
                })),
                None,
            )),
        ),
        (
            "safetensors dtype unknown",
            gen(ckpt(
                "dtype",
                Some(with_header(|h| {
                    let names = tensor_names(h);
                    h[&names[0]]["dtype"] = "Q7".into();
                })),
                None,
            )),
        ),
        (
            "safetensors header not UTF-8",
            gen(ckpt(
                "utf8",
                Some(raw_header(&[b'{', 0xff, 0xfe, b'}'])),
                None,
            )),
        ),
        (
            "safetensors header not JSON",
            gen(ckpt("json", Some(raw_header(b"{not json")), None)),
        ),
        (
            "config.json not JSON",
            gen(ckpt("config_json", None, Some("{".into()))),
        ),
        (
            "config and weights disagree on a shape",
            gen(ckpt(
                "shape",
                None,
                Some(
                    fixture_config
                        .replace("\"intermediate_size\": 64", "\"intermediate_size\": 72"),
                ),
            )),
        ),
        (
            "config names an unsupported architecture (OLMoE)",
            gen(ckpt(
                "arch",
                None,
                Some(
                    fixture_config
                        .replace("LlamaForCausalLM", "OlmoeForCausalLM")
                        .replace("\"model_type\": \"llama\"", "\"model_type\": \"olmoe\""),
                ),
            )),
        ),
        (
            "config of a family whose attention is not computed (Qwen3-Next)",
            gen(ckpt(
                "qwen3-next",
                None,
                Some(
                    fixture_config
                        .replace("LlamaForCausalLM", "Qwen3NextForCausalLM")
                        .replace("\"model_type\": \"llama\"", "\"model_type\": \"qwen3_next\""),
                ),
            )),
        ),
        (
            "--quantize nf4 where a projection's rows are not whole blocks of 64",
            {
                let mut a = gen(ckpt("blocks", None, None));
                a.extend(["--quantize".into(), "nf4".into()]);
                a
            },
        ),
        (
            "a config quantized other than as bitsandbytes 4-bit NF4",
            gen(ckpt(
                "fp4",
                None,
                Some(fixture_config.replacen(
                    '{',
                    r#"{"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "fp4"},"#,
                    1,
                )),
            )),
        ),
        ("--full with --quantize nf4", train(&["--full", "--quantize", "nf4"])),
        (
            "prompt token id outside the vocabulary",
            vec![
                "generate".into(),
                "--checkpoint".into(),
                fixture("gqa_llama3").to_str().unwrap().into(),
                "--prompt-ids".into(),
                "1,999".into(),
            ],
        ),
        (
            "data: a line that is not JSON",
            train(&[
                "--data",
                &jsonl("a.jsonl", "{\"text\": \"ok\"}\nnot json\n"),
            ]),
        ),
        (
            "data: a line without the fields",
            train(&["--data", &jsonl("b.jsonl", "{\"question\": \"no\"}\n")]),
        ),
        (
            "data: labels that are not the tokens",
            train(&[
                "--data",
                &jsonl(
                    "c.jsonl",
                    "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 7, 3]}\n",
                ),
            ]),
        ),
        (
            "data: token id outside the vocabulary",
            train(&["--data", &jsonl("d.jsonl", "{\"input_ids\": [1, 9999]}\n")]),
        ),
        (
            "data file missing",
            train(&["--data", &format!("{r}/none.jsonl")]),
        ),
        (
            "mesh does not divide a tensor",
            train(&["--mesh", "dp=1,fsdp=3,mp=1"]),
        ),
        (
            "mesh and --devices disagree",
            train(&["--mesh", "dp=1,fsdp=4,mp=1", "--devices", "2"]),
        ),
        (
            "plan: mesh and --devices disagree",
            vec![
                "plan".into(),
                "--devices".into(),
                "4".into(),
                "--mesh".into(),
                "dp=1,fsdp=2,mp=1".into(),
            ],
        ),
        (
            "plan: device memory of 0 GB",
            vec!["plan".into(), "--device-memory".into(), "0".into()],
        ),
        (
            "compile without a file to write",
            vec!["compile".into(), "--batch".into(), "2".into()],
        ),
        (
            "train --executable: a file compile did not write",
            train(&["--executable", &not_plugin]),
        ),
        (
            "train --executable with --eager",
            train(&["--executable", &not_plugin, "--eager"]),
        ),
        ("mesh with an unknown axis", train(&["--mesh", "dp=1,tp=2"])),
        (
            "mesh whose sizes multiply past any machine",
            vec![
                "plan".into(),
                "--mesh".into(),
                "dp=4611686018427387904,fsdp=4,mp=1".into(),
            ],
        ),
        (
            "plan: sizes whose tensors pass 2^63 bytes",
            vec![
                "plan".into(),
                "--seq".into(),
                "10000000".into(),
                "--batch".into(),
                "1000000".into(),
                "--attention".into(),
                "naive".into(),
            ],
        ),
        (
            "mesh with an axis no rule splits over",
            train(&["--mesh", "dp=1,fsdp=1,mp=1,xx=2"]),
        ),
        (
            "plugin missing",
            vec![
                "devices".into(),
                "--plugin".into(),
                format!("{r}/missing.so"),
            ],
        ),
        (
            "plugin not a shared library",
            vec!["devices".into(), "--plugin".into(), not_plugin],
        ),
        (
            "plugin with a PJRT API too old",
            vec!["devices".into(), "--plugin".into(), old_plugin],
        ),
        ("--lora-rank 0", train(&["--lora-rank", "0"])),
        (
            "--modules-to-save gate (a router) on a dense model",
            train(&["--modules-to-save", "gate"]),
        ),
        ("--lr -1", train(&["--lr=-1"])),
        (
            "--seq 0",
            ["train", "--seq", "0"].map(String::from).to_vec(),
        ),
        (
            "--batch 0",
            vec!["bench".into(), "--batch".into(), "0".into()],
        ),
        (
            "--attention-block that does not divide --seq",
            train(&["--attention-block", "3"]),
        ),
        (
            "--attention-block with --attention naive",
            train(&["--attention", "naive", "--attention-block", "4"]),
        ),
        (
            "--loss-chunk that does not divide --seq",
            train(&["--loss-chunk", "5"]),
        ),
        (
            "--resume from a folder without a checkpoint",
            train(&["--resume", &r]),
        ),
        (
            "a hub id that is not in the HF cache (HF_HUB_OFFLINE=1)",
            train(&["--checkpoint", "meta-llama/No-Such-Model@main"]),
        ),
        (
            "a recipe key that is no flag",
            train(&[
                "--recipe",
                &jsonl("bad-recipe.yaml", "lora_rank: 4\nlora_rnak: 8\n"),
            ]),
        ),
        (
            "a recipe number that is not finite",
            train(&["--recipe", &jsonl("inf-recipe.yaml", "lr: .inf\n")]),
        ),
        (
            "a recipe key given in both spellings",
            train(&[
                "--recipe",
                &jsonl("twice-recipe.yaml", "lora_rank: 4\nlora-rank: 8\n"),
            ]),
        ),
        (
            "a row holding two shapes (text and prompt/completion)",
            train(&[
                "--data",
                &jsonl(
                    "two-shapes.jsonl",
                    "{\"text\": \"a\", \"prompt\": \"b\", \"completion\": \"c\"}\n",
                ),
            ]),
        ),
        (
            "a negative token id",
            train(&[
                "--data",
                &jsonl("negative-id.jsonl", "{\"input_ids\": [5, -1, 7]}\n"),
            ]),
        ),
        (
            "a Parquet row of no known shape",
            train(&["--data", &{
                let p = root.join("rows.parquet");
                std::fs::copy(
                    Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join("../tests/fixtures/data/bad_row.parquet"),
                    &p,
                )
                .unwrap();
                p.to_str().unwrap().to_string()
            }]),
        ),
        (
            "a sharegpt turn from an unknown role",
            train(&[
                "--data",
                &jsonl(
                    "sharegpt.jsonl",
                    "{\"conversations\": [{\"from\": \"tool\", \"value\": \"x\"}]}\n",
                ),
            ]),
        ),
        (
            "train across processes on the CPU plugin",
            train(&[
                "--num-processes",
                "2",
                "--process-id",
                "0",
                "--coordinator",
                "127.0.0.1:1",
            ]),
        ),
        (
            "--num-processes without --coordinator",
            train(&["--num-processes", "2", "--process-id", "1"]),
        ),
        (
            "a process whose coordinator never answers",
            [
                "devices",
                "--num-processes",
                "2",
                "--process-id",
                "1",
                "--coordinator",
                "127.0.0.1:1",
                "--init-timeout",
                "0.5",
            ]
            .map(String::from)
            .to_vec(),
        ),
        (
            "serve: --adapter without NAME=",
            serve(&["--adapter", "my-adapter"]),
        ),
        (
            "serve: an adapter folder that is missing",
            serve(&["--adapter", &format!("support={r}/no-adapter")]),
        ),
        (
            "merge: no --checkpoint, and an adapter without its run",
            [
                "merge",
                "--adapter",
                &adapter_without_run(&root),
                "--out",
                &format!("{r}/merged"),
            ]
            .map(String::from)
            .to_vec(),
        ),
        (
            "serve: --max-model-len above the model's positions",
            serve(&["--max-model-len", "4096"]),
        ),
        (
            "--objective dpo on rows that are not pairs",
            train(&[
                "--objective",
                "dpo",
                "--data",
                &jsonl("sft.jsonl", "{\"text\": \"abc\"}\n"),
            ]),
        ),
        (
            "preference pairs without a preference --objective",
            train(&["--data", &pairs_file(&root)]),
        ),
        (
            "a pair row missing `rejected`",
            train(&[
                "--objective",
                "dpo",
                "--data",
                &jsonl("half-pair.jsonl", "{\"prompt\": \"a=\", \"chosen\": \"A\"}\n"),
            ]),
        ),
        (
            "--ref-adapter with an objective that has no reference",
            train(&[
                "--objective",
                "orpo",
                "--data",
                &pairs_file(&root),
                "--ref-adapter",
                &adapter_without_run(&root),
            ]),
        ),
        (
            "--objective dpo with --grad-accum 2",
            train(&["--objective", "dpo", "--data", &pairs_file(&root), "--grad-accum", "2"]),
        ),
        (
            "--objective dpo with --full",
            train(&["--objective", "dpo", "--data", &pairs_file(&root), "--full"]),
        ),
        ("--beta 0", train(&["--objective", "dpo", "--beta", "0"])),
        (
            "a preference setting the objective does not read",
            train(&["--beta", "0.5"]),
        ),
        (
            "--objective grpo: --batch not whole groups",
            train(&["--objective", "grpo", "--reward", "length", "--num-generations", "4"]),
        ),
        (
            "--objective grpo without a reward",
            train(&["--objective", "grpo", "--num-generations", "2"]),
        ),
        (
            "--reward-timeout 0",
            train(&[
                "--objective",
                "grpo",
                "--num-generations",
                "2",
                "--reward",
                "command",
                "--reward-command",
                "cat",
                "--reward-timeout",
                "0",
            ]),
        ),
        (
            "plan: rollout settings without a rollout objective",
            vec!["plan".into(), "--num-generations".into(), "4".into()],
        ),
        (
            "a pair's message of a role no template renders",
            train(&[
                "--objective",
                "dpo",
                "--data",
                &jsonl(
                    "bot-pairs.jsonl",
                    "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}], \"chosen\": [{\"role\": \"bot\", \"content\": \"yo\"}], \"rejected\": [{\"role\": \"assistant\", \"content\": \"no\"}]}\n",
                ),
            ]),
        ),
        (
            "eval --objective grpo",
            vec![
                "eval".into(),
                "--objective".into(),
                "grpo".into(),
                "--data".into(),
                pairs_file(&root),
            ],
        ),
        (
            "eval: no token to score within --seq",
            vec![
                "eval".into(),
                "--data".into(),
                jsonl(
                    "prompt-only.jsonl",
                    "{\"input_ids\": [1, 2, 3, 4, 5, 6], \"labels\": [-100, -100, -100, -100, -100, 6]}\n",
                ),
                "--seq".into(),
                "4".into(),
            ],
        ),
        (
            "--reward not one of the rewards",
            train(&["--objective", "grpo", "--reward", "bleu:2"]),
        ),
        (
            "--reward command without --reward-command",
            train(&["--objective", "grpo", "--reward", "command", "--num-generations", "2"]),
        ),
        (
            "--rollouts whose group does not share a prompt",
            train(&[
                "--objective",
                "grpo",
                "--num-generations", "2",
                "--rollouts",
                &jsonl(
                    "rollouts.jsonl",
                    "{\"prompt_ids\":[1,5],\"completion_ids\":[7],\"reward\":1}\n{\"prompt_ids\":[1,6],\"completion_ids\":[7],\"reward\":0}\n",
                ),
            ]),
        ),
        (
            "--reward-weights without --rollouts",
            train(&["--objective", "grpo", "--reward", "length", "--num-generations", "2", "--reward-weights", "a:1"]),
        ),
        (
            "--reward-weights naming a reward the rollouts do not log",
            train(&[
                "--objective",
                "grpo",
                "--num-generations", "2",
                "--reward-weights", "a:1,c:0.5",
                "--rollouts",
                &jsonl(
                    "rollouts-named.jsonl",
                    "{\"prompt_ids\":[1,5],\"completion_ids\":[7],\"rewards\":{\"a\":1,\"b\":0}}\n{\"prompt_ids\":[1,5],\"completion_ids\":[8],\"rewards\":{\"a\":0,\"b\":1}}\n",
                ),
            ]),
        ),
        (
            "--init random without --full",
            train(&["--init", "random"]),
        ),
        (
            "a rollout setting without a rollout objective",
            train(&["--num-generations", "4"]),
        ),
        (
            "a GRPO loss setting with --objective rloo",
            train(&["--objective", "rloo", "--reward", "length", "--loss-type", "grpo"]),
        ),
        (
            "a distillation teacher of another vocabulary",
            train(&[
                "--objective",
                "distillation",
                "--teacher",
                copy_model("head_dim", &root.join("teacher")).to_str().unwrap(),
            ]),
        ),
        (
            "export of a folder that holds no run",
            vec![
                "export".to_string(),
                root.to_str().unwrap().to_string(),
                "--out".to_string(),
                root.join("exported").to_str().unwrap().to_string(),
            ],
        ),
        (
            "a TRL flag name (--learning-rate)",
            train(&["--learning-rate", "1e-4"]),
        ),
        (
            "--num-train-epochs (no epoch count)",
            train(&["--num-train-epochs", "3"]),
        ),
        (
            "a recipe key spelled as TRL spells it",
            train(&["--recipe", &jsonl("trl.yaml", "learning_rate: 1e-4\n")]),
        ),
        (
            "--xla-option a value XLA would abort on",
            train(&["--xla-option", "xla_cpu_parallel_codegen_split_count=-5"]),
        ),
        (
            "init with an initializer_range its weights cannot hold",
            vec![
                "init".into(),
                "--config".into(),
                jsonl("huge-range.json", &{
                    let mut c: Value = serde_json::from_str(&fixture_config).unwrap();
                    c["initializer_range"] = serde_json::json!(3e38);
                    c.to_string()
                }),
                "--out".into(),
                format!("{r}/init-out"),
            ],
        ),
        (
            "score with no pair within --seq",
            score(&["--seq", "4"]),
        ),
        (
            "score --seq beyond the model's positions",
            score(&["--seq", "100000"]),
        ),
        (
            "a prepared set holding an id its manifest does not",
            train(&["--data", &sets.large_id]),
        ),
        (
            "a prepared set's manifest with another sample count",
            train(&["--data", &sets.miscounted]),
        ),
        (
            "a mixture whose proportions overflow",
            train(&["--data", &sets.overflowing_mixture]),
        ),
        (
            "a mixture file with a key hlo-train does not read",
            train(&["--data", &sets.remote_mixture]),
        ),
        (
            "data prepare into a folder another process writes",
            [
                "data", "prepare", "--data", &sets.corpus, "--out", &sets.held,
            ]
            .map(String::from)
            .to_vec(),
        ),
        (
            "train --out a folder another run writes",
            train(&["--out", &sets.held]),
        ),
        (
            "bench --precompute-ref for an objective without a reference",
            ["bench", "--objective", "orpo", "--precompute-ref", "--steps", "1"]
                .map(String::from)
                .to_vec(),
        ),
    ];
    // Launches that only the environment makes bad, and run tokens that do
    // not fit a coordinator's (one served here, requiring its own token).
    let guarded = hlo_engine::rendezvous::KvServer::start_with(
        "127.0.0.1:0".parse().unwrap(),
        2,
        hlo_engine::rendezvous::ServerOptions {
            run_token: Some(hlo_engine::rendezvous::RunToken::new("process-0s-secret").unwrap()),
            ..Default::default()
        },
    )
    .unwrap();
    let guarded_at = guarded.local_addr().to_string();
    let process_1 = |extra: &[&str]| {
        let mut a: Vec<String> = [
            "devices",
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "--coordinator",
            &guarded_at,
        ]
        .map(String::from)
        .to_vec();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let torchrun = |rank: &str| {
        vec![
            ("WORLD_SIZE", rank_world(rank).1),
            ("RANK", rank_world(rank).0),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", "1".to_string()),
        ]
    };
    let env_cases: Vec<(&str, Vec<String>, Vars)> = vec![
        (
            "RANK outside WORLD_SIZE",
            vec!["devices".into()],
            torchrun("5/2"),
        ),
        (
            "RANK that is not a whole number",
            vec!["devices".into()],
            torchrun("-1/2"),
        ),
        (
            "an empty HLO_TRAIN_RUN_TOKEN",
            process_1(&[]),
            vec![("HLO_TRAIN_RUN_TOKEN", String::new())],
        ),
        (
            "no run token where process 0 requires one",
            process_1(&[]),
            vec![],
        ),
        (
            "a run token other than process 0's",
            process_1(&["--run-token", "a-wrong-guess"]),
            vec![],
        ),
    ];
    let cases = cases
        .into_iter()
        .map(|(what, args)| (what, args, Vec::new()))
        .chain(env_cases);
    let mut rows = vec![
        "| bad input | command | message (exit code 2) |".to_string(),
        "|---|---|---|".to_string(),
    ];
    for (what, args, env) in cases {
        let before: Vec<_> = walk(&root);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let cache = root.join("hf-cache");
        let mut vars: Vec<(&str, &Path)> = vec![("HF_HUB_CACHE", &cache)];
        // A variable's value as the `&Path` (an `OsStr`) the helper takes.
        vars.extend(env.iter().map(|(k, v)| (*k, Path::new(v))));
        let out = hlo_train_env(&args, &vars);
        let err = String::from_utf8_lossy(&out.stderr).trim_end().to_string();
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
            "{what}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{what}: {err}");
        for secret in ["a-wrong-guess", "process-0s-secret"] {
            assert!(!err.contains(secret), "{what}: a run token was printed");
        }
        assert_eq!(walk(&root), before, "{what}: files were left behind");
        let shown = err
            .replace(&r, "DIR")
            .replace(&sets.holder, "pid PID on host HOST")
            .replace(&guarded_at, "127.0.0.1:PORT")
            .replace('|', "\\|");
        let command = args[0];
        // A message quoting names in backticks needs a double-backtick span.
        let fence = if shown.contains('`') { "`` " } else { "`" };
        let close: String = fence.chars().rev().collect();
        rows.push(format!("| {what} | `{command}` | {fence}{shown}{close} |"));
    }
    let table = rows.join("\n") + "\n";
    let readme_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let readme = std::fs::read_to_string(&readme_path).unwrap();
    let (start, end) = (
        "<!-- bad-input-table:start -->\n",
        "<!-- bad-input-table:end -->",
    );
    let (a, b) = (
        readme
            .find(start)
            .expect("README has the table's start marker")
            + start.len(),
        readme.find(end).expect("README has the table's end marker"),
    );
    if std::env::var_os("HLO_TRAIN_UPDATE_README").is_some() {
        let updated = format!("{}{table}{}", &readme[..a], &readme[b..]);
        std::fs::write(&readme_path, updated).unwrap();
    } else {
        assert_eq!(
            &readme[a..b],
            table,
            "the README's bad-input table is stale: run HLO_TRAIN_UPDATE_README=1 cargo test -p hlo-train --test bad_input_table"
        );
    }
}

/// Prepared token sets made bad, mixtures of them, and a folder whose
/// lock this test holds.
struct PreparedSets {
    corpus: String,
    large_id: String,
    miscounted: String,
    overflowing_mixture: String,
    remote_mixture: String,
    held: String,
    /// How the lock names this process (`pid N on host H`).
    holder: String,
    _lock: hlo_engine::data::lock::FolderLock,
}

impl PreparedSets {
    fn make(root: &Path) -> PreparedSets {
        use hlo_engine::data::tokens::Manifest;
        let corpus = root.join("corpus.jsonl");
        let rows: String = (0..12)
            .map(|i| format!("{{\"text\": \"row {i} of the corpus\"}}\n"))
            .collect();
        std::fs::write(&corpus, rows).unwrap();
        let prepared = |name: &str, edit: &dyn Fn(&Path, &mut Manifest)| {
            let out = root.join(name);
            ok(&hlo_train(&[
                "data",
                "prepare",
                "--data",
                corpus.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--rows-per-shard",
                "16",
            ]));
            let mut m = Manifest::read(&out).unwrap().unwrap();
            edit(&out, &mut m);
            m.write(&out).unwrap();
            out.to_str().unwrap().to_string()
        };
        let large_id = prepared("large-id", &|dir, m| {
            let path = dir.join(format!("{}.ids", m.shards[0].name));
            let mut ids = std::fs::read(&path).unwrap();
            ids[4..8].copy_from_slice(&4_000_000_000u32.to_le_bytes());
            std::fs::write(&path, &ids).unwrap();
            m.shards[0].fnv1a.ids = format!("{:016x}", hlo_engine::ir::rng::fnv1a(&ids));
        });
        let miscounted = prepared("miscounted", &|_, m| m.samples += 3);
        prepared("good", &|_, _| {});
        let mixture = |name: &str, body: &str| {
            let path = root.join(name);
            std::fs::write(&path, body).unwrap();
            path.to_str().unwrap().to_string()
        };
        let held = root.join("held");
        let lock = hlo_engine::data::lock::FolderLock::create(&held, "train").unwrap();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        PreparedSets {
            corpus: corpus.to_str().unwrap().to_string(),
            large_id,
            miscounted,
            overflowing_mixture: mixture(
                "overflowing.json",
                r#"{"streams": {"a": {"local": "good", "proportion": 1e308}, "b": {"local": "good", "proportion": 1e308}}}"#,
            ),
            remote_mixture: mixture(
                "remote.json",
                r#"{"streams": {"a": {"local": "good", "proportion": 1, "remote": "s3://bucket/a"}}}"#,
            ),
            held: held.to_str().unwrap().to_string(),
            holder: format!("pid {} on host {}", std::process::id(), host.trim()),
            _lock: lock,
        }
    }
}

/// Environment variables a case sets.
type Vars = Vec<(&'static str, String)>;

/// `"5/2"`: RANK 5 of WORLD_SIZE 2.
fn rank_world(spec: &str) -> (String, String) {
    let (rank, world) = spec.split_once('/').unwrap();
    (rank.to_string(), world.to_string())
}

/// Every file under `dir`, sorted.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}
